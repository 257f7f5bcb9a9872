"""The C accelerator (equeue/cext/) against the pure-Python paths: the same
bytes on disk, the same results, the same errors, and damaged records still reported
by the precise Python error."""

from __future__ import annotations

import dataclasses
import errno
import gc
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import xxhash
from code_paths import code_path  # noqa: F401 - the fixture
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from equeue import Message, MessageStore, OutgoingMessage, StoreConfig, speedups
from equeue.errors import CorruptionError, CorruptRecordError, EQueueError, StoreWriteError
from equeue.format.chunk import HEADER_SIZE
from equeue.store.config import FlushPolicy

needs_c = pytest.mark.skipif(speedups.SPEEDUPS is None, reason="the C accelerator is not built")
CONFIG = StoreConfig(
    chunk_data_size=8192, queue_chunk_records=342, max_message_size=3000, flush="os"
)


def test_accelerator_is_built() -> None:
    """make test builds it (setup.py); a silent build failure must not pass unnoticed."""
    if os.environ.get("EQUEUE_PURE_PYTHON"):
        pytest.skip("EQUEUE_PURE_PYTHON is set")
    assert speedups.SPEEDUPS is not None, "equeue._speedups did not build or load"


@needs_c
def test_checksum_is_the_xxhash_packages_for_every_length() -> None:
    """The C checksum (XXH3-64, written out) against the xxhash package: every length
    through the short, mid-size and long (striped, 1 KiB blocks) paths."""
    assert speedups.SPEEDUPS is not None
    for n in range(2100):
        data = bytes((i * 131 + n) % 251 for i in range(n))
        assert speedups.SPEEDUPS.xxh3_64(data) == xxhash.xxh3_64_intdigest(data), n


@needs_c
@given(data=st.binary(max_size=5000))
def test_checksum_matches_xxhash_on_random_bytes(data: bytes) -> None:
    assert speedups.SPEEDUPS is not None
    assert speedups.SPEEDUPS.xxh3_64(data) == xxhash.xxh3_64_intdigest(data)


@pytest.fixture
def fixed_clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Both runs stamp the same times, so their records are byte for byte comparable."""
    monkeypatch.setattr(time, "time_ns", lambda: 1_700_000_000_123_456_789)
    yield


def data_areas(directory: Path) -> dict[str, bytes]:
    """Every chunk file's data area (headers differ: chunk ids and creation times)."""
    areas = {}
    for path in sorted(directory.rglob("chunk-*")):
        if path.suffix != ".tmp":
            areas[str(path.relative_to(directory))] = path.read_bytes()[HEADER_SIZE:-128]
    return areas


names = st.text(st.characters(codec="utf-8"), max_size=6)
outgoing = st.builds(
    OutgoingMessage,
    body=st.binary(max_size=700),
    tag=st.sampled_from(["", "a", "b", "é"]),
    key=st.none() | names,
    properties=st.none() | st.dictionaries(names, names, max_size=2),
    code=st.integers(-(2**31), 2**31 - 1),
    queue_id=st.none() | st.integers(0, 2),
)
batch_items = st.one_of(outgoing, st.binary(max_size=300))
steps = st.lists(
    st.tuples(st.booleans(), st.lists(batch_items, min_size=1, max_size=12)), max_size=8
)


def run(path: Path, plan: list[tuple[bool, list[Any]]]) -> tuple[list[Any], list[Any]]:
    results: list[Any] = []
    with MessageStore.open(path, CONFIG) as store:
        store.create_topic("t", 3)
        for one_by_one, items in plan:
            if one_by_one:
                for item in items:
                    fields = item if isinstance(item, OutgoingMessage) else OutgoingMessage(item)
                    body, tag, key, props, code, queue_id = fields
                    results.append(
                        store.send(
                            "t", body, tag=tag, key=key, properties=props, code=code,
                            queue_id=queue_id,
                        )
                    )  # fmt: skip
            else:
                results.extend(store.send_batch("t", items))
        pulled = [store.pull("t", q, 0, max_count=1000).messages for q in store.queue_ids("t")]
    strip = [(r.topic, r.queue_id, r.queue_offset, r.position, r.message_id[8:]) for r in results]
    return strip, [[m._replace(message_id=m.message_id[8:]) for m in q] for q in pulled]


@needs_c
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(plan=steps)
def test_same_bytes_and_results(
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
    fixed_clock: None,
    plan: list[tuple[bool, list[Any]]],
) -> None:
    base = tmp_path_factory.mktemp("same")
    fast = run(base / "c", plan)
    with monkeypatch.context() as m:
        m.setattr(speedups, "SPEEDUPS", None)
        slow = run(base / "python", plan)
    assert fast == slow
    assert data_areas(base / "c") == data_areas(base / "python")
    sent = sum(len(items) for _, items in plan)
    assert len(fast[0]) == sent and sum(map(len, fast[1])) == sent


@needs_c
def test_same_bytes_across_queue_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fixed_clock: None
) -> None:
    """Runs that end where a queue chunk is full (342 entries) or a log chunk is."""
    plan: list[tuple[bool, list[Any]]] = [
        (False, [OutgoingMessage(b"%d" % i, queue_id=i % 2) for i in range(900)]),
        (True, [b"single %d" % i for i in range(400)]),
    ]
    fast = run(tmp_path / "c", plan)
    with monkeypatch.context() as m:
        m.setattr(speedups, "SPEEDUPS", None)
        slow = run(tmp_path / "python", plan)
    assert fast == slow
    areas = data_areas(tmp_path / "c")
    assert areas == data_areas(tmp_path / "python")
    assert sum("queues" in name for name in areas) > 3  # queue chunks did fill up


bad_fields = st.fixed_dictionaries(
    {
        "body": st.sampled_from([b"ok", bytearray(b"ba"), "str", None, b"x" * 3001]),
        "tag": st.sampled_from(["", "t", 5, "x" * 256, "\ud800"]),
        "key": st.sampled_from([None, "k", 7, "y" * 256, "\udfff"]),
        "properties": st.sampled_from([None, {}, {"a": "b"}, {"a": 1}, []]),
        "code": st.sampled_from([0, -(2**31), 2**31, True, 1.5, "1"]),
        "queue_id": st.sampled_from([None, 0, 2, 3, -1, False, "0"]),
    }
)


def attempt(store: MessageStore, fields: dict[str, Any], as_batch: bool) -> tuple[str, str]:
    try:
        if as_batch:
            store.send_batch("t", [b"first", OutgoingMessage(**fields)])
        else:
            rest = {k: v for k, v in fields.items() if k != "body"}
            store.send("t", fields["body"], **rest)
    except EQueueError as exc:
        return type(exc).__name__, str(exc)
    return "ok", ""


@needs_c
@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(fields=bad_fields, as_batch=st.booleans(), flush=st.sampled_from(["os", "sync"]))
def test_same_errors(
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
    fields: dict[str, Any],
    as_batch: bool,
    flush: FlushPolicy,
) -> None:
    """Whatever the mix of good and bad fields, both paths accept or reject alike, with
    the same error; a rejected send writes nothing. Under "os" a single send goes through
    Sender.send (store.send is Sender.call, tests/test_hot_path.py), under "sync" through
    Sender.check and the group commit."""
    base = tmp_path_factory.mktemp("errors")
    config = dataclasses.replace(CONFIG, flush=flush)
    seen = []
    for kind in ("c", "python"):
        with monkeypatch.context() as m:
            if kind == "python":
                m.setattr(speedups, "SPEEDUPS", None)
            with MessageStore.open(base / kind, config) as store:
                store.create_topic("t", 3)
                before = data_areas(base / kind)
                got = attempt(store, fields, as_batch)
                if got[0] != "ok":
                    assert data_areas(base / kind) == before
                    assert store.queue_range("t", 0) == (0, 0)
                seen.append(got)
    assert seen[0] == seen[1]


BAD_BATCHES: list[Any] = [
    None,
    5,
    b"ab",
    "ab",
    {"body": b"x"},
    [b"ok", None],
    [b"ok", {}],  # no body
    [b"ok", {"body": b"x", "colour": "red"}],
    [b"ok", {1: b"x"}],
    [b"ok", {"body": b"x", "tag": 5}],
    [b"ok", ("t",)],
    [b"ok", OutgoingMessage(b"x", key="\ud800")],
]


@needs_c
def test_same_errors_for_bad_batches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """send_batch with a messages argument or an item of the wrong kind: check_batch in
    C and the Python loop raise the same equeue error, and nothing is written."""
    seen: dict[str, list[tuple[str, str]]] = {}
    for kind in ("c", "python"):
        with monkeypatch.context() as m:
            if kind == "python":
                m.setattr(speedups, "SPEEDUPS", None)
            with MessageStore.open(tmp_path / kind, CONFIG) as store:
                store.create_topic("t", 3)
                before = data_areas(tmp_path / kind)
                for batch in BAD_BATCHES:
                    with pytest.raises(EQueueError) as caught:
                        store.send_batch("t", batch)
                    seen.setdefault(kind, []).append(
                        (type(caught.value).__name__, str(caught.value))
                    )
                assert data_areas(tmp_path / kind) == before
                assert len(store.send_batch("t", [b"ok", {"body": b"x"}])) == 2  # the control
    assert seen["c"] == seen["python"]


@pytest.mark.usefixtures("code_path")
def test_damaged_record_reported(tmp_path: Path) -> None:
    """A damaged record in a completed chunk: the C decoder hands it to the Python path,
    which raises with the file and offset; the queue's other messages still read."""
    bodies = [b"m%03d" % i + bytes(100) for i in range(200)]  # three 8 KiB log chunks
    with MessageStore.open(tmp_path / "s", CONFIG) as store:
        store.create_topic("t", 2)
        sent = store.send_batch("t", bodies)
        clean = store.pull("t", 0, 0, max_count=10)  # control: undamaged, reads fine
        assert [m.body for m in clean.messages] == bodies[0:20:2]
    victim = sent[4]  # queue 0, offset 2, in the first (completed) chunk
    chunk = tmp_path / "s" / "messages" / "chunk-000000000000.0000"
    at = HEADER_SIZE + victim.position + 4 + 56 + len("t") + 1  # the body's 2nd byte
    with chunk.open("r+b") as f:
        f.seek(at)
        f.write(b"X")
    with MessageStore.open(tmp_path / "s", CONFIG) as store:
        with pytest.raises(CorruptRecordError) as caught:
            store.pull("t", 0, 0, max_count=10)
        assert chunk.name in str(caught.value)
        assert [m.body for m in store.pull("t", 0, 0, max_count=2).messages] == bodies[0:4:2]
        assert [m.body for m in store.pull("t", 0, 3, max_count=2).messages] == bodies[6:10:2]


@needs_c
@given(
    data=st.lists(st.sampled_from([0, 0, 0, 1, 255]), max_size=300).map(bytes),
    bounds=st.tuples(st.integers(0, 300), st.integers(0, 300)),
)
def test_last_nonzero_matches_rstrip(data: bytes, bounds: tuple[int, int]) -> None:
    assert speedups.SPEEDUPS is not None
    start, stop = sorted(min(b, len(data)) for b in bounds)
    expected = start + len(data[start:stop].rstrip(b"\0"))
    assert speedups.SPEEDUPS.last_nonzero(data, start, stop) == expected


@pytest.mark.usefixtures("code_path")
def test_batch_changed_while_it_is_checked(tmp_path: Path) -> None:
    """send_batch checks a private copy: a tag whose hashing empties the caller's list
    (Python code runs inside the check) changes nothing, and nothing crashes."""
    batch: list[Any] = []

    class EmptiesTheBatch(str):
        def __hash__(self) -> int:
            batch.clear()
            return str.__hash__(self)

    batch.extend([OutgoingMessage(b"x", tag=EmptiesTheBatch("t"))] + [b"y"] * 3)
    with MessageStore.open(tmp_path / "s", CONFIG) as store:
        store.create_topic("t", 1)
        results = store.send_batch("t", batch)
        assert len(results) == 4
        assert [m.body for m in store.pull("t", 0, 0).messages] == [b"x", b"y", b"y", b"y"]


@needs_c
@pytest.mark.parametrize("position", [-(2**63), -(2**63) + 1, 2**63 - 1, -1, 2**70, 4096 + 10])
def test_decode_run_leaves_impossible_positions_to_python(tmp_path: Path, position: int) -> None:
    """Positions from damaged queue entries: 'not here' (None), never a crash or an
    OverflowError, while the real record in the same run still decodes (the control)."""
    assert speedups.SPEEDUPS is not None
    with MessageStore.open(tmp_path / "s", CONFIG) as store:
        sent = store.send("t", b"real body")
    data = next((tmp_path / "s" / "messages").glob("chunk-*")).read_bytes()
    end = sent.position + 12 + 56 + 1 + len(b"real body")
    decoded = speedups.SPEEDUPS.decode_run(
        data, HEADER_SIZE, end, 0, [sent.position, position], Message, "00000000", dict
    )
    assert decoded[1] is None
    message, tag_hash = decoded[0]
    assert (message.body, message.topic, message.position, tag_hash) == (
        b"real body",
        "t",
        sent.position,
        0,
    )


@pytest.mark.usefixtures("code_path")
@pytest.mark.parametrize("stored", [-(2**63), -(2**63) + 1, 2**62])
def test_damaged_queue_entry_is_a_corruption_error(tmp_path: Path, stored: int) -> None:
    with MessageStore.open(tmp_path / "s", CONFIG) as store:
        store.create_topic("t", 1)
        store.send_batch("t", [b"a%d" % i for i in range(400)])  # queue chunk 0 completes
    queue_chunk = tmp_path / "s" / "queues" / "t" / "0" / "chunk-000000000000.0000"
    with queue_chunk.open("r+b") as f:
        f.seek(HEADER_SIZE + 2 * 12)  # offset 2's entry: message position + 1
        f.write(stored.to_bytes(8, "little", signed=True))
    with MessageStore.open(tmp_path / "s", CONFIG) as store:
        with pytest.raises(CorruptionError) as caught:
            store.pull("t", 0, 2, max_count=3)
        assert queue_chunk.name in str(caught.value)
        assert [m.body for m in store.pull("t", 0, 0, max_count=2).messages] == [b"a0", b"a1"]


@pytest.mark.usefixtures("code_path")
@pytest.mark.parametrize("retained", [False, True])
def test_damaged_entry_does_not_hide_earlier_messages(tmp_path: Path, retained: bool) -> None:
    """A negative position in a damaged entry of a completed queue chunk: the messages
    before it still pull, whether or not retention has removed the log's first chunk
    (the store then searches each queue for its first retained offset), and the
    damaged one raises."""
    config = dataclasses.replace(CONFIG, max_store_bytes=36_000 if retained else None)
    with MessageStore.open(tmp_path / "s", config) as store:
        store.create_topic("t", 1)
        store.create_topic("u", 1)
        store.send_batch("u", [b"x" * 1000] * 7)  # log chunk 0: topic u only
        store.send_batch("t", [b"a%d" % i for i in range(400)])
        assert store.apply_retention() == (1 if retained else 0)
        first, end = store.queue_range("t", 0)
        assert end == 400 and (first > 0) == retained  # control: what the damage must not move
    queue_chunk = tmp_path / "s" / "queues" / "t" / "0" / "chunk-000000000000.0000"
    with queue_chunk.open("r+b") as f:
        f.seek(HEADER_SIZE + 200 * 12)
        f.write((-5).to_bytes(8, "little", signed=True))
    with MessageStore.open(tmp_path / "s", config) as store:
        assert store.queue_range("t", 0) == (first, 400)
        pulled = store.pull("t", 0, 0, max_count=3).messages
        assert [m.body for m in pulled] == [b"a%d" % i for i in range(first, first + 3)]
        with pytest.raises(CorruptionError):
            store.pull("t", 0, 199, max_count=3)


@pytest.mark.usefixtures("code_path")
def test_pull_with_a_huge_max_count(tmp_path: Path) -> None:
    with MessageStore.open(tmp_path / "s", CONFIG) as store:
        store.create_topic("t", 1)
        store.send_batch("t", [b"a", b"b"])
        result = store.pull("t", 0, 0, max_count=2**63)
        assert [m.body for m in result.messages] == [b"a", b"b"] and result.next_offset == 2


@needs_c
def test_sender_takes_common_sends_and_hands_back_the_rest(tmp_path: Path) -> None:
    """``Sender.send`` stores a plain send itself, and returns None, having written
    nothing, for every send the Python path must decide."""
    with MessageStore.open(tmp_path, CONFIG) as store:
        store.create_topic("t", 3)
        sender = store._sender
        assert sender is not None
        # A queue's first entry creates its chunk on the Python path.
        assert sender.send("t", b"first", "", None, None, 0, 0) is None
        for q in range(3):
            store.send("t", b"first", queue_id=q)
        result = sender.send("t", b"body", "tag", "key", None, 7, None)
        assert result is not None
        message = store.get(result.message_id)
        assert (message.body, message.tag, message.key, message.code) == (b"body", "tag", "key", 7)
        before = data_areas(tmp_path)
        ranges = [store.queue_range("t", q) for q in range(3)]
        handed_back = [
            ("new-topic", b"b", "", None, None, 0, None),  # created on the Python path
            ("t", b"b", "", None, {"a": "b"}, 0, None),  # properties
            ("t", bytearray(b"b"), "", None, None, 0, None),  # not bytes
            ("t", b"b", "", None, None, 0, 3),  # no such queue: the Python error
            ("t", b"b", "", None, None, 2**31, None),  # code out of range
            ("t", b"b" * 3001, "", None, None, 0, None),  # over max_message_size
            ("t", b"b", "", "k" * 256, None, 0, None),  # key too long
        ]
        for fields in handed_back:
            assert sender.send(*fields) is None, fields
        assert data_areas(tmp_path) == before
        assert [store.queue_range("t", q) for q in range(3)] == ranges
        assert "new-topic" not in store.topics()


@needs_c
def test_sender_leaks_nothing(tmp_path: Path) -> None:
    """Allocated blocks and the reference counts of what a send touches are back where
    they were after many sends: stored in C (keyed, tagged), handed back after the checks
    (a failed background flush refuses them) or before them (properties)."""
    body, tag, key, props = b"x" * 50, "a-tag", "a-key", {"p": "v"}
    topic = "leaks"  # its bytes are the store's alone (b"t" is a shared singleton)
    config = dataclasses.replace(CONFIG, chunk_data_size=64 << 20)  # no chunk is created
    with MessageStore.open(tmp_path, config) as store:
        store.create_topic(topic, 3)
        queues, topic_bytes = store._queues[topic], store._topic_bytes[topic]
        refused = StoreWriteError(errno.EIO, "a background flush failed (the test's)")

        def sends(n: int) -> None:
            for i in range(n):
                store.send(topic, body, tag=tag, key=key, queue_id=i % 3)
                store.send(topic, body, tag=tag)
                store.send(topic, body, properties=props)
                store._flush_error = refused
                with pytest.raises(StoreWriteError):
                    store.send(topic, body, tag=tag, key=key)
                store._flush_error = None
            store._keys.commit()  # KeyIndex.add buffers (topic, key, position)

        sends(400)  # caches, lists and the key index settle
        watched = (body, tag, key, props, queues, topic_bytes)
        gc.collect()  # the refused sends' tracebacks are cycles
        counts = [sys.getrefcount(o) for o in watched]
        blocks = sys.getallocatedblocks()
        sends(300)
        gc.collect()
        assert [sys.getrefcount(o) for o in watched] == counts
        # Measured: 0-5 blocks on both paths alone, up to about 60 under pytest (its
        # bookkeeping, the service thread); a leaked key per keyed C send would be 600+.
        assert sys.getallocatedblocks() - blocks < 300


@needs_c
def test_sender_takes_str_subclass_topics_through_python(tmp_path: Path) -> None:
    class Topic(str):
        pass

    for flush in ("os", "sync"):
        config = dataclasses.replace(CONFIG, flush=flush)
        with MessageStore.open(tmp_path / flush, config) as store:
            store.create_topic("t", 3)
            one = store.send(Topic("t"), b"one")
            (two,) = store.send_batch(Topic("t"), [b"two"])
            assert [store.get(r.message_id).body for r in (one, two)] == [b"one", b"two"]


@needs_c
def test_a_sender_is_usable_only_once_initialised(tmp_path: Path) -> None:
    assert speedups.SPEEDUPS is not None
    bare = speedups.SPEEDUPS.Sender.__new__(speedups.SPEEDUPS.Sender)
    with pytest.raises(TypeError, match="__init__ was not called"):
        bare.send("t", b"x", "", None, None, 0, None)
    with pytest.raises(TypeError, match="__init__ was not called"):
        bare.write_checked("t", [], ())
    with (
        MessageStore.open(tmp_path, CONFIG) as store,
        pytest.raises(TypeError, match="initialised once"),
    ):
        store._sender.__init__(*([None] * 15))


@needs_c
def test_sync_stores_send_through_the_group_commit(tmp_path: Path) -> None:
    """Under flush="sync" a send must wait for its fdatasync: send() never takes the
    C path that returns before it, while the leader writes through write_checked."""
    config = dataclasses.replace(CONFIG, flush="sync")
    with MessageStore.open(tmp_path, config) as store:
        assert store._sender is None
        checked = store._check_in_c(3, b"x", "tag", "key", None, 0, None)  # checked in C
        assert checked is not None and checked[0] == b"x" and checked[4] == "key"
        store.create_topic("t", 3)
        results = [store.send("t", b"%d" % i, key=f"k{i}") for i in range(50)]
        assert [store.get(r.message_id).body for r in results] == [b"%d" % i for i in range(50)]


def _frames(sizes: list[int]) -> bytes:
    """Valid frames of these payload sizes, back to back."""
    from equeue.format.chunk import frame_packer, record_checksum

    out = bytearray()
    for n in sizes:
        payload = os.urandom(n)
        frame = bytearray(n + 12)
        frame_packer(n)(frame, 0, n, payload, record_checksum(payload), n)
        out += frame
    return bytes(out)


@needs_c
@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 300), max_size=12),
    damage=st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 255)), max_size=2),
    bounds=st.tuples(st.integers(0, 5000), st.integers(0, 5000)),
)
def test_frame_offsets_match_the_python_walk(
    sizes: list[int], damage: list[tuple[int, int]], bounds: tuple[int, int]
) -> None:
    """The streaming reader's frame walk: the same stop and the same frames in C."""
    from equeue.chunks.stream import frame_offsets

    assert speedups.SPEEDUPS is not None
    data = bytearray(_frames(sizes) + bytes(20))
    for at, value in damage:
        data[at % len(data)] = value
    start, end = sorted(b % (len(data) + 1) for b in bounds)
    if damage == [] and start == 0:
        end = len(data)
    expected = frame_offsets(bytes(data), start, end)
    assert speedups.SPEEDUPS.frame_offsets(bytes(data), start, end) == expected
    if not damage and start == 0 and sizes:
        stop, packed = expected
        assert stop == len(data) - 20
        assert len(packed) == 8 * len(sizes)


@needs_c
def test_frame_offsets_refuses_a_range_outside_the_buffer() -> None:
    assert speedups.SPEEDUPS is not None
    with pytest.raises(ValueError):
        speedups.SPEEDUPS.frame_offsets(b"abc", 0, 4)
    with pytest.raises(ValueError):
        speedups.SPEEDUPS.frame_offsets(b"abc", 2, 1)
