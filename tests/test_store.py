"""Unit tests of MessageStore: send, pull, lookups, offsets, topics, locking and retention."""

from __future__ import annotations

import datetime as dt
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import xxhash

import equeue.format.message
import equeue.store.reads
import equeue.store.validate
from equeue import Message, MessageStore, OutgoingMessage, PullResult, SendResult, StoreConfig
from equeue.errors import (
    ChunkRemovedError,
    ConfigError,
    InvalidMessageError,
    MessageNotFoundError,
    PositionError,
    StoreLockedError,
    TopicNotFoundError,
)
from equeue.format.chunk import FOOTER_SIZE, HEADER_SIZE

CHUNK = 4096
CHUNK_FILE = CHUNK + HEADER_SIZE + FOOTER_SIZE


def config(**overrides: Any) -> StoreConfig:
    settings: dict[str, Any] = {
        "chunk_data_size": CHUNK,
        "queue_chunk_records": 400,
        "default_queue_count": 4,
    }
    settings.update(overrides)
    return StoreConfig(**settings)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[MessageStore]:
    with MessageStore.open(tmp_path / "store", config()) as s:
        yield s


def message_files(store: MessageStore) -> list[str]:
    return sorted(p.name for p in (store.path / "messages").glob("chunk-*"))


def pull_all(store: MessageStore, topic: str, queue_id: int, offset: int = 0) -> list[Message]:
    messages: list[Message] = []
    while True:
        result = store.pull(topic, queue_id, offset, max_count=100)
        messages += result.messages
        if result.next_offset == offset:
            return messages
        offset = result.next_offset


def same_as_sent(message: Message, sent: SendResult) -> None:
    assert message.message_id == sent.message_id
    assert message.topic == sent.topic
    assert message.queue_id == sent.queue_id
    assert message.queue_offset == sent.queue_offset
    assert message.position == sent.position
    assert message.stored_at == sent.stored_at


# --- send and pull -------------------------------------------------------------


def test_send_pull_round_trip_every_field(store: MessageStore) -> None:
    before = time.time()
    sent = store.send(
        "orders",
        b"\x00body\xff",
        tag="TagA",
        key="order-\u00e9",
        properties={"a": "1", "\u00fc": "\u20ac", "": ""},
        code=-(1 << 31),
        queue_id=2,
    )
    after = time.time()
    assert sent.topic == "orders"
    assert sent.queue_id == 2
    assert sent.queue_offset == 0
    assert sent.position == 0
    assert len(sent.message_id) == 24
    assert sent.message_id == f"{store.store_id:08x}{sent.position:016x}"
    assert before - 0.001 <= sent.stored_at <= after + 0.001

    result = store.pull("orders", 2, 0)
    assert result.next_offset == 1
    [message] = result.messages
    same_as_sent(message, sent)
    assert message.tag == "TagA"
    assert message.key == "order-\u00e9"
    assert message.properties == {"a": "1", "\u00fc": "\u20ac", "": ""}
    assert message.code == -(1 << 31)
    assert message.body == b"\x00body\xff"
    assert type(message.body) is bytes
    assert message.created_at == message.stored_at
    assert store.get(sent.message_id) == message
    assert store.read(sent.position) == message
    for other in (0, 1, 3):
        assert store.pull("orders", other, 0) == PullResult([], 0)


def test_send_defaults_and_edge_values(store: MessageStore) -> None:
    array: Any = bytearray(b"ba")  # bytes-like bodies are accepted too
    view_body: Any = memoryview(b"mv")
    plain = store.send("t", b"", queue_id=0)
    empty_key = store.send("t", array, key="", code=(1 << 31) - 1, queue_id=0)
    view = store.send("t", view_body, properties={}, queue_id=0)
    messages = store.pull("t", 0, 0).messages
    assert [m.body for m in messages] == [b"", b"ba", b"mv"]
    assert (messages[0].tag, messages[0].key, messages[0].properties, messages[0].code) == (
        "",
        None,
        {},
        0,
    )
    assert messages[1].key == ""
    assert messages[1].code == (1 << 31) - 1
    for message, sent in zip(messages, (plain, empty_key, view), strict=True):
        same_as_sent(message, sent)
    # Positions: each record follows the previous one.
    assert plain.position < empty_key.position < view.position


def test_send_round_trip_across_reopen(tmp_path: Path) -> None:
    path = tmp_path / "store"
    with MessageStore.open(path, config()) as s:
        sent = [
            s.send("t", bytes([i]) * (i % 50 * 37), tag=f"g{i % 3}", key=f"k{i}", code=i)
            for i in range(200)
        ]
        before = {q: pull_all(s, "t", q) for q in s.queue_ids("t")}
    assert len(message_files_of(path)) > 1  # chunks rolled over
    with MessageStore.open(path, config()) as s:
        assert s.recovery.clean
        after = {q: pull_all(s, "t", q) for q in s.queue_ids("t")}
        assert after == before
        by_id = {m.message_id: m for ms in after.values() for m in ms}
        for i, result in enumerate(sent):
            message = by_id[result.message_id]
            same_as_sent(message, result)
            assert message.body == bytes([i]) * (i % 50 * 37)
            assert (message.tag, message.key, message.code) == (f"g{i % 3}", f"k{i}", i)


def message_files_of(path: Path) -> list[Path]:
    return sorted((path / "messages").glob("chunk-*"))


# --- queue choice ----------------------------------------------------------------


def test_explicit_queue_id(store: MessageStore) -> None:
    for queue_id in (3, 1, 3, 0, 3):
        assert store.send("t", b"x", queue_id=queue_id, key="same").queue_id == queue_id
    assert [store.queue_range("t", q) for q in range(4)] == [(0, 1), (0, 1), (0, 0), (0, 3)]


def test_same_key_same_queue(tmp_path: Path) -> None:
    path = tmp_path / "store"
    keys = [f"key-{i}" for i in range(20)]
    with MessageStore.open(path, config()) as s:
        first = {key: s.send("t", b"1", key=key).queue_id for key in keys}
        for key in keys:
            assert s.send("t", b"2", key=key).queue_id == first[key]
    with MessageStore.open(path, config()) as s:
        for key in keys:
            assert s.send("t", b"3", key=key).queue_id == first[key]
        assert first == {key: xxhash.xxh32_intdigest(key.encode()) % 4 for key in keys}
        assert len(set(first.values())) > 1  # keys spread over queues
        for key in keys:
            bodies = [m.body for m in s.query_by_key("t", key)]
            assert bodies == [b"3", b"2", b"1"]


def test_round_robin_without_key(store: MessageStore) -> None:
    results = [store.send("t", b"%d" % i) for i in range(12)]
    start = results[0].queue_id
    assert [r.queue_id for r in results] == [(start + i) % 4 for i in range(12)]
    for q in range(4):
        assert [r.queue_offset for r in results if r.queue_id == q] == [0, 1, 2]
    # Sends with a key or a queue id do not take a round-robin turn away.
    store.send("t", b"k", key="x")
    store.send("t", b"q", queue_id=0)
    assert store.send("t", b"next").queue_id == (start + 12) % 4


def test_queue_offsets_dense_per_queue(store: MessageStore) -> None:
    results = [store.send("t", b"x", key=f"k{i % 7}") for i in range(100)]
    for q in range(4):
        offsets = [r.queue_offset for r in results if r.queue_id == q]
        assert offsets == list(range(len(offsets)))
        assert store.queue_range("t", q) == (0, len(offsets))


# --- send_batch ----------------------------------------------------------------


def batch_messages() -> list[Any]:
    return [
        b"plain",
        bytearray(b"array"),
        OutgoingMessage(b"o1", tag="A", key="k1", properties={"p": "v"}, code=7),
        OutgoingMessage(b"o2", queue_id=3),
        {"body": b"d1", "tag": "B", "key": "k2", "code": -1},
        {"body": b"d2", "properties": {"x": "y"}},
        OutgoingMessage(b"o3"),
        *[OutgoingMessage(b"z" * 300, key=f"z{i % 4}") for i in range(30)],  # crosses chunks
    ]


def send_one_by_one(store: MessageStore, topic: str) -> list[SendResult]:
    results = []
    for item in batch_messages():
        if isinstance(item, bytes | bytearray):
            item = OutgoingMessage(bytes(item))
        elif isinstance(item, dict):
            item = OutgoingMessage(**item)
        results.append(
            store.send(
                topic,
                item.body,
                tag=item.tag,
                key=item.key,
                properties=item.properties,
                code=item.code,
                queue_id=item.queue_id,
            )
        )
    return results


def test_send_batch_equals_sends(tmp_path: Path) -> None:
    with (
        MessageStore.open(tmp_path / "one", config()) as one,
        MessageStore.open(tmp_path / "batch", config()) as batch,
    ):
        singles = send_one_by_one(one, "t")
        batched = batch.send_batch("t", batch_messages())
        assert len(batched) == len(singles)
        for a, b in zip(singles, batched, strict=True):
            assert (a.topic, a.queue_id, a.queue_offset, a.position) == (
                b.topic,
                b.queue_id,
                b.queue_offset,
                b.position,
            )
            assert a.message_id[8:] == b.message_id[8:]
            assert b.message_id[:8] == f"{batch.store_id:08x}"
        assert message_files(one) == message_files(batch)
        assert len(message_files(one)) > 1
        for q in range(4):
            assert one.queue_range("t", q) == batch.queue_range("t", q)

            def strip(m: Message) -> tuple[Any, ...]:
                return (m.message_id[8:], *m[1:10])

            assert [strip(m) for m in pull_all(one, "t", q)] == [
                strip(m) for m in pull_all(batch, "t", q)
            ]
        for b in batched:
            same_as_sent(batch.get(b.message_id), b)
        assert [m.body for m in batch.query_by_key("t", "k1")] == [b"o1"]


def test_send_batch_empty(store: MessageStore) -> None:
    store.create_topic("t")
    assert store.send_batch("t", []) == []
    assert all(store.queue_range("t", q) == (0, 0) for q in range(4))


# --- tag filters -------------------------------------------------------------------


def send_tagged(store: MessageStore, tags: list[str]) -> None:
    for i, tag in enumerate(tags):
        store.send("t", b"%d" % i, tag=tag, queue_id=0)


def test_pull_tag_filter(store: MessageStore) -> None:
    tags = ["A", "B", "", "A", "C", "B", "A"]
    send_tagged(store, tags)

    def bodies(
        filter_: str | Iterable[str] | None, offset: int = 0, max_count: int = 32
    ) -> list[int]:
        result = store.pull("t", 0, offset, max_count=max_count, tags=filter_)
        return [int(m.body) for m in result.messages]

    assert bodies("A") == [0, 3, 6]
    assert bodies(["A"]) == [0, 3, 6]
    assert bodies(["B", "C"]) == [1, 4, 5]
    assert bodies(("C",)) == [4]
    assert bodies("") == [2]
    assert bodies("missing") == []
    with pytest.raises(InvalidMessageError, match="empty"):  # not "match nothing"
        bodies([])
    assert bodies(None) == list(range(7))
    assert bodies("*") == list(range(7))
    assert bodies("A", offset=1) == [3, 6]
    assert bodies("A", max_count=2) == [0, 3]
    for m in store.pull("t", 0, 0, tags=["A", "B"]).messages:
        assert m.tag in ("A", "B")


def test_pull_tag_filter_next_offset(store: MessageStore) -> None:
    send_tagged(store, ["A", "B", "A", "B", "B"])
    first = store.pull("t", 0, 0, max_count=1, tags="A")
    assert [m.queue_offset for m in first.messages] == [0]
    assert first.next_offset == 1
    second = store.pull("t", 0, first.next_offset, max_count=1, tags="A")
    assert [m.queue_offset for m in second.messages] == [2]
    assert second.next_offset == 3
    third = store.pull("t", 0, second.next_offset, max_count=1, tags="A")
    assert third.messages == []
    assert third.next_offset == 5  # skipped the non-matching messages


def test_pull_tag_filter_many_non_matching(store: MessageStore) -> None:
    """More non-matching entries than one scan block (256) between two matches."""
    store.send_batch("t", [OutgoingMessage(b"n", tag="N", queue_id=0)] * 600)
    store.send("t", b"y", tag="Y", queue_id=0)
    result = store.pull("t", 0, 0, tags="Y")
    assert [(m.queue_offset, m.body) for m in result.messages] == [(600, b"y")]
    assert result.next_offset == 601


def test_pull_tag_filter_hash_collision(
    store: MessageStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = equeue.format.message.tag_hash

    def colliding(tag: str) -> int:
        return 0x1234 if tag in ("red", "blue") else real(tag)

    cache_clear: Callable[[], None] = equeue.store.validate._check_tag.cache_clear
    cache_clear()
    monkeypatch.setattr(equeue.format.message, "tag_hash", colliding)
    monkeypatch.setattr(equeue.store.validate, "tag_hash", colliding)  # pulls' filters too
    try:
        send_tagged(store, ["red", "blue", "green", "red", "blue"])
        entries = store._queues["t"][0].entries(0, 10)
        assert [h for _, h in entries][:2] == [0x1234, 0x1234]  # the tags really collide

        def bodies(tags: str | list[str]) -> list[int]:
            return [int(m.body) for m in store.pull("t", 0, 0, tags=tags).messages]

        assert bodies("red") == [0, 3]
        assert bodies("blue") == [1, 4]
        assert bodies(["red", "green"]) == [0, 2, 3]
        assert bodies(["red", "blue"]) == [0, 1, 3, 4]
    finally:
        cache_clear()


# --- wait ----------------------------------------------------------------------------


def test_pull_wait_until_a_message_arrives(store: MessageStore) -> None:
    store.create_topic("t")
    sender_started = threading.Event()

    def sender() -> None:
        sender_started.set()
        time.sleep(0.3)
        store.send("t", b"late", queue_id=1)

    thread = threading.Thread(target=sender)
    thread.start()
    try:
        sender_started.wait()
        result = store.pull("t", 1, 0, wait=30.0)
    finally:
        thread.join()
    assert [m.body for m in result.messages] == [b"late"]
    assert result.next_offset == 1


def test_pull_wait_times_out_empty(store: MessageStore) -> None:
    store.create_topic("t")
    store.send("t", b"other queue", queue_id=0)
    result = store.pull("t", 1, 0, wait=0.2)
    assert result == PullResult([], 0)
    # A message already there is returned at once.
    store.send("t", b"here", queue_id=1)
    assert [m.body for m in store.pull("t", 1, 0, wait=30.0).messages] == [b"here"]


# --- get and read ---------------------------------------------------------------------


def test_get_and_read(store: MessageStore) -> None:
    results = [store.send("t", b"m%d" % i, key=f"k{i}") for i in range(50)]
    for result in results:
        message = store.get(result.message_id)
        same_as_sent(message, result)
        assert store.read(result.position) == message
        assert store.get(result.message_id.upper()) == message


@pytest.mark.parametrize(
    "make_id",
    [
        pytest.param(
            lambda s, r: f"{(s.store_id + 1) % (1 << 32):08x}{r.position:016x}", id="foreign"
        ),
        pytest.param(lambda s, r: "", id="empty"),
        pytest.param(lambda s, r: "nonsense", id="short"),
        pytest.param(lambda s, r: "z" * 24, id="not-hex"),
        pytest.param(lambda s, r: r.message_id + "0", id="long"),
        pytest.param(lambda s, r: f"{s.store_id:08x}{1 << 40:016x}", id="past-the-end"),
        pytest.param(lambda s, r: 12345, id="int"),
        pytest.param(lambda s, r: None, id="none"),
    ],
)
def test_get_garbage_id(
    store: MessageStore, make_id: Callable[[MessageStore, SendResult], Any]
) -> None:
    sent = store.send("t", b"x")
    with pytest.raises(MessageNotFoundError):
        store.get(make_id(store, sent))
    assert store.get(sent.message_id).body == b"x"


@pytest.mark.parametrize("delta", [1, 4, 16])
def test_get_id_inside_a_record(store: MessageStore, delta: int) -> None:
    sent = store.send("t", b"x" * 100)
    store.send("t", b"y")
    with pytest.raises(MessageNotFoundError):
        store.get(f"{store.store_id:08x}{sent.position + delta:016x}")


@pytest.mark.parametrize("suffix", ["-000000000000000", "+000000000000000", "0x00000000000000"])
def test_get_non_canonical_id(store: MessageStore, suffix: str) -> None:
    store.send("t", b"x")
    with pytest.raises(MessageNotFoundError):
        store.get(f"{store.store_id:08x}{suffix}")


def test_read_bad_positions(store: MessageStore) -> None:
    sent = store.send("t", b"x")
    for position in (-1, 1 << 40, sent.position + 10_000):
        with pytest.raises(MessageNotFoundError):
            store.read(position)
    with pytest.raises(TypeError):
        store.read("0")  # type: ignore[arg-type]


# --- consumer offsets -----------------------------------------------------------------


def test_commit_offset_persists(tmp_path: Path) -> None:
    path = tmp_path / "store"
    with MessageStore.open(path, config()) as s:
        s.create_topic("t")
        s.create_topic("u", 2)
        for queue_id in range(4):  # an offset can be committed up to the queue's end
            s.send_batch("t", [{"body": b"m", "queue_id": queue_id}] * 10)
        s.send("u", b"m", queue_id=1)
        assert s.committed_offset("g", "t", 0) is None
        s.commit_offset("g", "t", 0, 5)
        s.commit_offset("g", "t", 3, 7)
        s.commit_offset("g", "t", 0, 9)  # overwrites
        s.commit_offset("h", "u", 1, 1)
        assert s.committed_offset("g", "t", 0) == 9
    with MessageStore.open(path, config()) as s:
        assert s.committed_offset("g", "t", 0) == 9
        assert s.committed_offset("g", "t", 3) == 7
        assert s.committed_offset("g", "t", 1) is None
        assert s.committed_offset("h", "u", 1) == 1
        assert s.committed_offset("h", "t", 0) is None
        assert s.consumer_groups() == {"g": {"t": {0: 9, 3: 7}}, "h": {"u": {1: 1}}}


# --- key index ------------------------------------------------------------------------


def test_query_by_key_after_reopen(tmp_path: Path) -> None:
    path = tmp_path / "store"
    with MessageStore.open(path, config()) as s:
        for i in range(60):
            s.send("t", b"t%d" % i, key=f"k{i % 3}")
            s.send("u", b"u%d" % i, key=f"k{i % 3}")
        s.send("t", b"nokey")
        s.send("t", b"empty", key="")
    with MessageStore.open(path, config()) as s:
        k1 = s.query_by_key("t", "k1", limit=100)
        assert [m.body for m in k1] == [b"t%d" % i for i in reversed(range(1, 60, 3))]
        assert all(m.key == "k1" and m.topic == "t" for m in k1)
        positions = [m.position for m in k1]
        assert positions == sorted(positions, reverse=True)
        assert [m.body for m in s.query_by_key("u", "k2", limit=2)] == [b"u59", b"u56"]
        assert s.query_by_key("t", "k9") == []
        assert [m.body for m in s.query_by_key("t", "")] == [b"empty"]
        with pytest.raises(TopicNotFoundError):
            s.query_by_key("nope", "k1")


def test_query_by_key_sees_unflushed_sends(store: MessageStore) -> None:
    for i in range(5):
        store.send("t", b"%d" % i, key="k")
    assert [m.body for m in store.query_by_key("t", "k", limit=3)] == [b"4", b"3", b"2"]


# --- offset_for_time --------------------------------------------------------------------


def test_offset_for_time(store: MessageStore) -> None:
    store.create_topic("t", 1)
    start = time.time()
    time.sleep(0.002)
    results = []
    for i in range(20):
        results.append(store.send("t", b"%d" % i, queue_id=0))
        time.sleep(0.002)  # separates the stored times well beyond float precision
    assert store.offset_for_time("t", 0, start) == 0
    assert store.offset_for_time("t", 0, 0) == 0
    assert store.offset_for_time("t", 0, time.time() + 10) == 20
    for i in range(19):
        middle = (results[i].stored_at + results[i + 1].stored_at) / 2
        assert store.offset_for_time("t", 0, middle) == i + 1
    middle = (results[4].stored_at + results[5].stored_at) / 2
    assert store.offset_for_time("t", 0, dt.datetime.fromtimestamp(middle, dt.UTC)) == 5


def test_offset_for_time_of_a_messages_own_stored_at(store: MessageStore) -> None:
    store.create_topic("t", 1)
    results = [store.send("t", b"%d" % i, queue_id=0) for i in range(200)]
    found = [store.offset_for_time("t", 0, r.stored_at) for r in results]
    # Equal stored times (a coarse clock) legitimately give the first of them.
    expected = [min(j for j in range(200) if results[j].stored_at == r.stored_at) for r in results]
    assert found == expected


# --- topics ---------------------------------------------------------------------------------


def test_queue_count_grows_never_shrinks(tmp_path: Path) -> None:
    path = tmp_path / "store"
    with MessageStore.open(path, config()) as s:
        s.create_topic("t", 2)
        assert s.queue_ids("t") == [0, 1]
        s.send("t", b"a", queue_id=1)
        s.create_topic("t", 2)  # same count: nothing happens
        s.create_topic("t", 5)
        assert s.queue_ids("t") == [0, 1, 2, 3, 4]
        assert s.send("t", b"b", queue_id=4).queue_offset == 0
        with pytest.raises(ConfigError, match="shrink"):
            s.create_topic("t", 3)
        assert s.queue_ids("t") == [0, 1, 2, 3, 4]
        s.create_topic("other")
        assert s.topics() == ["other", "t"]
        assert s.queue_ids("other") == [0, 1, 2, 3]
    with MessageStore.open(path, config()) as s:
        assert s.topics() == ["other", "t"]
        assert s.queue_ids("t") == [0, 1, 2, 3, 4]
        with pytest.raises(ConfigError):
            s.create_topic("t", 1)
        assert [m.body for m in s.pull("t", 1, 0).messages] == [b"a"]
        assert [m.body for m in s.pull("t", 4, 0).messages] == [b"b"]


def test_auto_create_topics_off(tmp_path: Path) -> None:
    with MessageStore.open(tmp_path / "store", config(auto_create_topics=False)) as s:
        with pytest.raises(TopicNotFoundError, match="auto_create_topics"):
            s.send("t", b"x")
        with pytest.raises(TopicNotFoundError):
            s.send_batch("t", [b"x"])
        with pytest.raises(TopicNotFoundError):
            s.pull("t", 0, 0)
        with pytest.raises(LookupError):
            s.queue_range("t", 0)
        assert s.topics() == []
        s.create_topic("t", 2)
        assert s.send("t", b"x").topic == "t"
        assert s.queue_ids("t") == [0, 1]


def test_auto_create_topic_uses_default_queue_count(tmp_path: Path) -> None:
    with MessageStore.open(tmp_path / "store", config(default_queue_count=3)) as s:
        s.send("fresh", b"x")
        assert s.topics() == ["fresh"]
        assert s.queue_ids("fresh") == [0, 1, 2]


@pytest.mark.parametrize(
    ("setting", "other"), [("chunk_data_size", 8192), ("queue_chunk_records", 500)]
)
def test_reopen_with_other_file_shape(tmp_path: Path, setting: str, other: int) -> None:
    path = tmp_path / "store"
    with MessageStore.open(path, config()) as s:
        s.send("t", b"x")
    with pytest.raises(ConfigError, match=setting) as info:
        MessageStore.open(path, config(**{setting: other}))
    assert str(other) in str(info.value)
    # The failed open released the lock; the right configuration opens fine.
    with MessageStore.open(path, config()) as s:
        assert [m.body for m in pull_all(s, "t", 0)] == [b"x"]


def test_second_open_in_same_process_is_locked(tmp_path: Path) -> None:
    path = tmp_path / "store"
    with MessageStore.open(path, config()) as s:
        s.send("t", b"x", queue_id=0)
        with pytest.raises(StoreLockedError) as info:
            MessageStore.open(path, config())
        assert f"pid {os.getpid()}" in str(info.value)
        assert str(path) in str(info.value)
        # The failed attempt closed its own handle without releasing the first one's lock.
        with pytest.raises(StoreLockedError):
            MessageStore.open(path, config())
        # The first handle is unaffected.
        assert s.send("t", b"y", queue_id=0).queue_offset == 1
    with MessageStore.open(path, config()) as s:
        assert [m.body for m in s.pull("t", 0, 0).messages] == [b"x", b"y"]


# --- retention ------------------------------------------------------------------------------


def fill(store: MessageStore, prefix: str, count: int) -> list[SendResult]:
    return [
        store.send("t", f"{prefix}{i}".encode() * 15, key=f"{prefix}-key{i % 5}")
        for i in range(count)
    ]


def chunk_of(result: SendResult) -> int:
    return result.position // CHUNK


def expect_retained(store: MessageStore, results: list[SendResult], first_chunk: int) -> None:
    """Everything in chunks >= first_chunk is there; everything before is gone."""
    kept = [r for r in results if chunk_of(r) >= first_chunk]
    gone = [r for r in results if chunk_of(r) < first_chunk]
    assert gone
    for r in gone:
        with pytest.raises(PositionError):
            store.get(r.message_id)
    for q in range(4):
        in_queue = [r for r in kept if r.queue_id == q]
        everything = [r for r in results if r.queue_id == q]
        first, end = store.queue_range("t", q)
        assert end == len(everything)
        assert first == (in_queue[0].queue_offset if in_queue else end)
        pulled = pull_all(store, "t", q)  # from offset 0: starts at the first retained message
        assert [m.message_id for m in pulled] == [r.message_id for r in in_queue]
        below = store.pull("t", q, max(0, first - 1), max_count=1)
        assert [m.queue_offset for m in below.messages] == ([first] if in_queue else [])
        assert below.next_offset == (first + 1 if in_queue else end)
    for r in kept:
        same_as_sent(store.get(r.message_id), r)


def test_retention_by_time_removes_completed_expired_chunks(tmp_path: Path) -> None:
    retention = dt.timedelta(hours=1)
    with MessageStore.open(tmp_path / "store", config(retention=retention)) as s:
        old = fill(s, "old", 120)
        time.sleep(0.01)
        boundary = time.time()
        time.sleep(0.01)
        new = fill(s, "new", 120)
        results = old + new
        last_chunk = chunk_of(results[-1])
        assert last_chunk >= 6
        # Nothing has expired yet.
        assert s.apply_retention(now=boundary) == 0
        assert len(message_files(s)) == last_chunk + 1
        # A chunk goes when its newest message is older than the cutoff.
        all_old = {chunk_of(r) for r in old} - {chunk_of(r) for r in new}
        expected = max(all_old) + 1
        assert expected >= 2
        assert s.apply_retention(now=boundary + retention.total_seconds()) == expected
        assert len(message_files(s)) == last_chunk + 1 - expected
        expect_retained(s, results, expected)
        for i in range(5):
            assert [m.message_id for m in s.query_by_key("t", f"old-key{i}", 100)] == [
                r.message_id
                for j, r in reversed(list(enumerate(old)))
                if j % 5 == i and chunk_of(r) >= expected
            ]
            assert len(s.query_by_key("t", f"new-key{i}", 100)) == 24
        # Far in the future: every completed chunk goes, the ongoing one stays.
        assert s.apply_retention(now=time.time() + 10 * 3600) == last_chunk - expected
        assert message_files(s) == [f"chunk-{last_chunk:012d}.0000"]
        expect_retained(s, results, last_chunk)
        assert s.apply_retention(now=time.time() + 10 * 3600) == 0
        # The store goes on.
        after = s.send("t", b"after", queue_id=0)
        assert s.pull("t", 0, after.queue_offset).messages[0].body == b"after"


def test_retention_respects_consumers(tmp_path: Path) -> None:
    cfg = config(retention=dt.timedelta(seconds=1), retention_respects_consumers=True)
    future = time.time() + 3600
    with MessageStore.open(tmp_path / "store", cfg) as s:
        results = fill(s, "m", 240)
        last_chunk = chunk_of(results[-1])
        assert last_chunk >= 6
        # No group has committed anything: nothing holds the chunks back.
        s.commit_offset("g", "t", 0, 0)
        s.commit_offset("g", "t", 1, 0)
        assert s.apply_retention(now=future) == 0
        # Queue 0 fully consumed, queue 1 not at all: the first chunk holds queue 1 messages.
        s.commit_offset("g", "t", 0, s.queue_range("t", 0)[1])
        assert s.apply_retention(now=future) == 0
        # Queue 1 consumed up to a message in a middle chunk: the chunks before it go.
        in_q1 = [r for r in results if r.queue_id == 1]
        middle = next(r for r in in_q1 if chunk_of(r) >= 3)
        s.commit_offset("g", "t", 1, middle.queue_offset)
        assert s.apply_retention(now=future) == chunk_of(middle)
        assert len(message_files(s)) == last_chunk + 1 - chunk_of(middle)
        expect_retained(s, results, chunk_of(middle))
        # A second group that lags holds back what is left.
        s.commit_offset("h", "t", 1, middle.queue_offset)
        s.commit_offset("g", "t", 1, s.queue_range("t", 1)[1])
        assert s.apply_retention(now=future) == 0
        s.commit_offset("h", "t", 1, s.queue_range("t", 1)[1])
        assert s.apply_retention(now=future) == last_chunk - chunk_of(middle)
        assert len(message_files(s)) == 1
        expect_retained(s, results, last_chunk)


def test_retention_by_store_size(tmp_path: Path) -> None:
    with MessageStore.open(tmp_path / "store", config(max_store_bytes=3 * CHUNK_FILE)) as s:
        results = fill(s, "m", 200)
        last_chunk = chunk_of(results[-1])
        assert last_chunk >= 5
        assert s.apply_retention() == last_chunk + 1 - 3
        assert len(message_files(s)) == 3
        total = sum(p.stat().st_size for p in (s.path / "messages").glob("chunk-*"))
        assert total <= 3 * CHUNK_FILE
        expect_retained(s, results, last_chunk - 2)
        assert s.apply_retention() == 0


def test_retention_needs_a_limit(tmp_path: Path) -> None:
    with MessageStore.open(tmp_path / "store", config()) as s:
        fill(s, "m", 200)
        files = message_files(s)
        assert s.apply_retention(now=time.time() + 10**9) == 0
        assert message_files(s) == files


def test_retention_survives_reopen(tmp_path: Path) -> None:
    path = tmp_path / "store"
    cfg = config(retention=dt.timedelta(hours=1))
    with MessageStore.open(path, cfg) as s:
        results = fill(s, "m", 240)
        assert s.apply_retention(now=time.time() + 7200) > 0
        ranges = {q: s.queue_range("t", q) for q in range(4)}
    with MessageStore.open(path, cfg) as s:
        assert {q: s.queue_range("t", q) for q in range(4)} == ranges
        expect_retained(s, results, chunk_of(results[-1]))
        for q in range(4):
            assert s.offset_for_time("t", q, 0) == ranges[q][0]


def test_pull_skips_removed_chunks(tmp_path: Path) -> None:
    with MessageStore.open(tmp_path / "store", config(max_store_bytes=CHUNK_FILE)) as s:
        results = fill(s, "m", 200)
        assert s.apply_retention() == chunk_of(results[-1])
        with pytest.raises(ChunkRemovedError):
            s.read(results[0].position)
        q = results[-1].queue_id
        kept = [r for r in results if r.queue_id == q and chunk_of(r) == chunk_of(results[-1])]
        pulled = s.pull("t", q, 0, max_count=1000)
        assert [m.message_id for m in pulled.messages] == [r.message_id for r in kept]
        assert pulled.next_offset == s.queue_range("t", q)[1]
