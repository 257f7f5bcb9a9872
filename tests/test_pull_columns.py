"""Protocol version 3's pull_columns (a pull answered in columns, equeue/protocol/
pullcols.py and equeue/cext/pullcols.c) against a real broker: it gives what the
version-2 pull gives, message for message; its answer stays within max_frame_bytes; a
compacted store's gaps come through; a hostile answer is a ProtocolError; and a client
and a broker of different versions still talk (pull to a broker before version 3)."""

from __future__ import annotations

import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from client_helpers import WELCOME, FakeBroker, Peer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import raw, short_dir, short_home
from test_compaction import SMALL, fill, message_chunk_files

import equeue
from equeue import MessageStore, StoreConfig
from equeue.chunks.stream import ChunkFile
from equeue.compaction.rewrite import rewrite_group
from equeue.errors import ProtocolError
from equeue.protocol import pullcols
from equeue.protocol.frames import COLUMNS_VERSION, encode
from equeue.protocol.records import unpack_pull_result
from equeue.server import BrokerThread
from equeue.store.types import Message, PullResult

HERE = Path(__file__).parent
home = pytest.fixture(short_home, name="home")


@pytest.fixture(scope="module")
def broker() -> Iterator[BrokerThread]:
    directory = short_dir()
    try:
        with BrokerThread(directory / "s") as running:
            yield running
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _both(client: Any, **args: Any) -> tuple[PullResult, PullResult, Any]:
    """The same pull as version 2's pull and as pull_columns, both decoded; and the raw
    columns."""
    v2 = unpack_pull_result(client.request("pull", args), "test")
    columns = client.request("pull_columns", args)
    return v2, pullcols.unpack(columns, "test"), columns


names = st.text(st.characters(codec="utf-8"), max_size=8)
sends = st.lists(
    st.fixed_dictionaries(
        {
            "body": st.one_of(st.just(b""), st.binary(max_size=64), st.just(b"L" * 70_000)),
            "tag": st.sampled_from(["", "a", "b", "ü"]),
            "key": st.one_of(st.none(), names),
            "properties": st.one_of(
                st.none(), st.dictionaries(names, names, min_size=1, max_size=3)
            ),
            "code": st.integers(-(2**31), 2**31 - 1),
        }
    ),
    min_size=1,
    max_size=12,
)
counter = iter(range(1 << 30))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    messages=sends,
    tags=st.sampled_from([None, "a", ["a", "ü"], "*"]),
    max_count=st.integers(1, 16),
    start=st.integers(0, 14),
)
def test_columns_decode_to_what_the_v2_pull_gives(
    broker: BrokerThread, messages: list[dict[str, Any]], tags: Any, max_count: int, start: int
) -> None:
    topic = f"h{next(counter)}"
    with equeue.connect(broker.urls[0]) as client:
        assert client.welcome is not None and client.welcome.version >= COLUMNS_VERSION
        client.create_topic(topic, 1)
        for fields in messages:
            client.send(topic, **fields, queue_id=0)
        args: dict[str, Any] = {
            "topic": topic,
            "queue_id": 0,
            "offset": start,
            "max_count": max_count,
        }
        if tags is not None:
            args["tags"] = tags
        v2, v3, columns = _both(client, **args)
        assert v3 == v2  # next_offset and every message, field for field
        assert [type(m) for m in v3.messages] == [Message] * len(v3.messages)
        # the Python reference decodes the same, and its packer packs what decodes the same
        assert pullcols._unpack(columns, "test") == v2
        data, kept = pullcols._pack(
            list(v2.messages), v2.next_offset, topic, 0, columns[3], 1 << 30
        )
        assert kept == len(v2.messages) and data is not None
        import msgpack

        assert pullcols.unpack(msgpack.unpackb(data), "test") == v2
        # the client's own pull is pull_columns now, and gives the same
        assert client.pull(topic, 0, start, max_count, tags) == v2


def test_a_columns_answer_never_passes_max_frame_bytes(home: Path) -> None:
    limit = 256 * 1024
    store = MessageStore.open(home / "s", StoreConfig(max_message_size=200 * 1024))
    try:
        with (
            BrokerThread(store, max_frame_bytes=limit) as running,
            equeue.connect(running.urls[0]) as client,
        ):
            client.create_topic("t", 1)
            bodies = [bytes([i]) * (60_000 + 7_000 * i) for i in range(12)]
            for body in bodies:
                client.send("t", body, key="k" * 200, properties={"p": "v" * 300})
            offset, got, answers = 0, [], 0
            for _ in range(20):  # bounded: 12 messages, at least one an answer
                args = {"topic": "t", "queue_id": 0, "offset": offset, "max_count": 100}
                columns = client.request("pull_columns", args)
                assert len(encode([1, 0, columns])) <= limit  # the frame, header and all
                result = pullcols.unpack(columns, "test")
                if not result.messages:
                    break
                answers += 1
                got += [m.body for m in result.messages]
                offset = result.next_offset
            assert got == bodies and offset == 12
            assert answers > 3  # it was cut, more than once
            # a held pull_columns of large messages is cut as well
            client.send("t", b"z" * 150_000)
            client.send("t", b"y" * 150_000)
            held = client.request("pull_columns", {**args, "offset": 12, "wait_ms": 100})
            assert len(encode([1, 0, held])) <= limit
            assert [m.body[:1] for m in pullcols.unpack(held, "t").messages] == [b"z"]
    finally:
        store.close()


def _compacted(path: Path) -> None:
    """A store whose first three chunks are one compacted chunk, every third record of
    them removed (test_compaction's rewrite, without Spark)."""
    fill(path)
    files = message_chunk_files(path)[:3]
    chunks = [ChunkFile.open(p) for p in files]
    records = [c.header.start_position + local for c in chunks for local, _ in c.records()]
    staging = path / "staging"
    staging.mkdir()
    result = rewrite_group(chunks, records[::3], staging, version=1)
    for f in files:
        f.unlink()
    shutil.move(staging / result.file_name, path / "messages" / result.file_name)


def test_a_compacted_store_pulled_through_the_broker(home: Path) -> None:
    _compacted(home / "s")
    expected: dict[int, list[Message]] = {}
    with MessageStore.open(home / "s", SMALL) as store:
        for queue_id in store.queue_ids("k"):
            found: list[Message] = []
            offset = 0
            while batch := store.pull("k", queue_id, offset, 7).messages:
                found += batch
                offset = store.pull("k", queue_id, offset, 7).next_offset
            expected[queue_id] = found
    offsets = [m.queue_offset for m in expected[0]]
    assert offsets != list(range(len(offsets)))  # control: compaction left gaps
    with BrokerThread(home / "s") as running, equeue.connect(running.urls[0]) as client:
        for queue_id, messages in expected.items():
            got: list[Message] = []
            offset = 0
            for _ in range(1000):
                args = {"topic": "k", "queue_id": queue_id, "offset": offset, "max_count": 7}
                v2, v3, _ = _both(client, **args)
                assert v3 == v2
                if not v3.messages:
                    break
                got += v3.messages
                offset = v3.next_offset
            assert got == messages


def _bad(n: int = 1, **columns: Any) -> list[Any]:
    """A well-formed answer of ``n`` messages but for the ``columns`` given."""
    good: dict[str, Any] = {
        "next": n, "topic": "t", "queue_id": 0, "prefix": "ab", "ids": None,
        "offsets": list(range(n)), "positions": list(range(n)), "created": [1] * n,
        "stored": [1] * n, "bodies": [b""] * n, "tags": "", "keys": None, "codes": 0,
        "props": None,
    }  # fmt: skip
    good.update(columns)
    return list(good.values())


HOSTILE: list[tuple[str, Any]] = [
    ("truncated", [3, "t", 0, "ab"]),
    ("not an array", {"next_offset": 1}),
    ("short offsets", _bad(2, offsets=[0])),
    ("long bodies", _bad(1, bodies=[b"", b""])),
    ("str body", _bad(1, bodies=["x"])),
    ("negative offset", _bad(1, offsets=[-1])),
    ("bin topic", _bad(1, topic=b"t")),
    ("tags length", _bad(1, tags=["a", "b"])),
    ("keys type", _bad(1, keys=[5])),
    ("codes float", _bad(1, codes=1.5)),
    ("props index", _bad(1, props=[[1, {"a": "b"}]])),
    ("props order", _bad(2, props=[[1, {"a": "b"}], [0, {"a": "b"}]])),
    ("props value", _bad(1, props=[[0, {"a": 1}]])),
    ("ids length", _bad(1, ids=["x", "y"])),
    ("bool next", _bad(0, next=True)),
]


@pytest.mark.parametrize(("what", "answer"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_a_hostile_columns_answer_is_a_protocol_error(what: str, answer: Any) -> None:
    with pytest.raises(ProtocolError, match=r"pull_columns|PullResult"):
        pullcols.unpack(answer, "test")
    with pytest.raises(ProtocolError):
        pullcols._unpack(answer, "test")


def test_a_hostile_broker_answer_reaches_the_client_as_a_protocol_error() -> None:
    def script(peer: Peer) -> None:
        peer.recv()  # the hello
        peer.send({**WELCOME, "version": COLUMNS_VERSION})
        for _what, answer in HOSTILE[2:5]:
            request_id, op, _ = peer.recv()
            assert op == "pull_columns"
            peer.send([request_id, 0, answer])
        peer.recv()

    with FakeBroker(script) as fake, equeue.connect(fake.url, timeout=10) as client:
        for _ in range(3):
            with pytest.raises(ProtocolError):
                client.pull("t", 0, 0)


def test_clients_and_brokers_of_other_versions(home: Path) -> None:
    with BrokerThread(home / "s") as running:
        url = running.urls[0]
        with equeue.connect(url) as client:
            client.create_topic("t", 1)
            client.send_batch("t", [b"a", b"b", b"c"])
            ours = client.pull("t", 0, 0)
        # a client of version 1 or 2 (the hello offers [1]): pull answers as before
        with raw(url, versions=(1,)) as old:
            assert old.welcome["version"] == 1
            messages, following = old.call("pull", topic="t", queue_id=0, offset=0)
            assert unpack_pull_result([messages, following], "t") == ours
        # our client against a broker of version 2 that knows no pull_columns: it pulls
        running.broker.welcome_versions = (1, 2)
        running.broker.handlers.ops.pop("pull_columns")
        with equeue.connect(url) as client:
            assert client.welcome is not None and client.welcome.version == 2
            assert client.pull("t", 0, 0) == ours
            with client.consumer("g", "t", timeout=1.0, batch_size=2) as consumer:
                assert [m.body for m in consumer] == [b"a", b"b", b"c"]
            assert client.committed_offset("g", "t", 0) == 3
        assert running.broker.counters.errors == 0  # no pull_columns reached it


def test_a_killed_members_prefetched_messages_go_to_the_others(home: Path) -> None:
    """SIGKILLed with a message handed out and more prefetched (unhandled, uncommitted):
    after its session ends the other member gets every one of them."""
    with BrokerThread(home / "s") as running, equeue.connect(running.urls[0]) as client:
        url = running.urls[0]
        client.create_topic("t", 1)
        bodies = [f"m{i}".encode() for i in range(40)]
        client.send_batch("t", bodies)
        child = subprocess.Popen(
            [sys.executable, str(HERE / "prefetch_child.py"), url, "g", "t"],
            stdout=subprocess.PIPE,
        )
        try:
            assert child.stdout is not None
            line = child.stdout.readline().decode().split()
            assert line[:3] == ["GOT", "0", "0"] and int(line[4]) >= 9, line  # 1 + 2 batches
            child.send_signal(signal.SIGKILL)
            child.wait(10)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(10)
        assert client.committed_offset("g", "t", 0) is None  # control: nothing committed
        with client.consumer("g", "t", timeout=3.0, session_timeout=2.0) as other:
            got = [m.body for m in other]
        assert got == bodies  # the handed-out one and the prefetched ones: all again
        assert client.committed_offset("g", "t", 0) == 40


def test_a_prefetched_answer_that_skipped_entries_commits_nothing_unhandled(home: Path) -> None:
    """The prefetch pull of a tag-filtered queue comes back empty (it passed over other
    tags' entries) while the first batch is still at hand: the commit that follows
    counts only what was handed out, not past the batch."""
    with BrokerThread(home / "s") as running, equeue.connect(running.urls[0]) as client:
        client.create_topic("t", 1)
        client.send_batch("t", [{"body": b"a%d" % i, "tag": "a"} for i in range(5)])
        client.send_batch("t", [{"body": b"b%d" % i, "tag": "b"} for i in range(5)])
        with client.consumer(
            "g", "t", tags="a", batch_size=5, prefetch=2, auto_commit_interval=0.0
        ) as consumer:
            first = consumer.poll(5.0)
            assert first is not None and first.body == b"a0"
            for _ in range(500):  # bounded: the prefetch pull's answer, in the buffer's view
                if consumer._inflight and all(f.done() for f, *_ in consumer._inflight.values()):
                    break
                time.sleep(0.01)
            second = consumer.poll(5.0)  # takes that answer in, then commits (interval 0)
            assert second is not None and second.body == b"a1"
            assert client.committed_offset("g", "t", 0) == 1  # a0 processed; a1..a4 not


def test_c_and_python_cut_an_answer_at_the_same_message(home: Path) -> None:
    """Review 30a, finding 4: the Python packer counts a message's bound as the C one
    does (a nil key 1 byte, the topic once), so both keep the same messages at every
    room; neither passes it. Control: with ids not of the prefix (Python only: an ids
    column), the answer stays within room too."""
    from equeue import speedups

    fast = speedups.SPEEDUPS
    if fast is None:  # (EQUEUE_PURE_PYTHON=1: no C to compare with)
        pytest.skip("the C accelerator is not built")
    rnd = random.Random(30)
    with MessageStore.open(home / "s") as store:
        store.create_topic("t-topic", 1)
        for _ in range(120):
            store.send(
                "t-topic", rnd.randbytes(rnd.choice([0, 1, 31, 32, 255, 256, 70_000])),
                tag=rnd.choice(["", "a", "é" * 40]), key=rnd.choice([None, "", "k" * 255]),
                properties=rnd.choice(
                    [None, {}, {"p": "v" * rnd.randint(0, 40)}, {str(j): "x" for j in range(20)}]
                ),
                code=rnd.choice([0, -1, -33, 2**31 - 1, -(2**31)]),
            )  # fmt: skip
        result = store.pull("t-topic", 0, 0, max_count=120)
        prefix = f"{store.store_id:08x}"
    messages = list(result.messages)
    rooms = [*range(0, 3000, 13), *range(3000, 3_000_000, 29_989)]
    cuts = 0
    for room in rooms:
        packed = fast.pack_pull_columns(messages, result.next_offset, "t-topic", 0, prefix, room)
        assert packed is not None  # the store's own messages: C packs them
        data, kept = pullcols._pack(messages, result.next_offset, "t-topic", 0, prefix, room)
        assert packed[1] == kept, f"room {room}: C keeps {packed[1]}, Python {kept}"
        for found in (packed[0], data):
            assert found is None or len(found) <= room
        cuts += 0 < kept < len(messages)
        other, kept = pullcols._pack(messages, result.next_offset, "t-topic", 0, "ffffffff", room)
        assert other is None or len(other) <= room
        if other is not None:
            assert pullcols._unpack(msgpack.unpackb(other), "t").messages == messages[:kept]
    assert cuts > 50  # most rooms cut the answer somewhere


def test_the_message_field_order_is_declared_once_for_c() -> None:
    """Review 30a, finding 5: message.c keeps a Message's slots by an enum that
    pullcols.c read through message_slots from a copy of its own; now one enum in
    speedups.h, in the order of Message._fields, and no C file declares another."""
    cext = Path(pullcols.__file__).parent.parent / "cext"
    header = (cext / "speedups.h").read_text()
    found = re.search(r"enum \{([^}]*\bMSG_NFIELDS\b[^}]*)\}", header)
    assert found is not None, "speedups.h declares no MSG_* enum of the Message's fields"
    names = [n.strip() for n in found[1].split(",") if n.strip()]
    short = {
        "message_id": "ID", "topic": "TOPIC", "queue_id": "QID", "queue_offset": "QOFF",
        "position": "POS", "tag": "TAG", "key": "KEY", "properties": "PROPS", "code": "CODE",
        "body": "BODY", "created_ns": "CREATED", "stored_ns": "STORED",
    }  # fmt: skip
    assert names == [f"MSG_{short[f]}" for f in Message._fields] + ["MSG_NFIELDS"]
    for source in sorted(cext.glob("*.c")):
        assert not re.search(r"\bF_PROPS\b", source.read_text()), f"{source.name}: a copy"


def test_the_packer_is_given_the_topic_and_id_prefix_its_messages_hold(
    broker: BrokerThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    """perfgroup: the broker hands pullcols.pack the topic and id prefix str objects its
    messages hold (the store's queue's topic, the store's prefix), not the request's
    topic (a str msgpack made anew) and a prefix of its own, so that the C packer's check
    of both on every message is an identity test, not two string comparisons (~180
    instructions a message of the broker's ~3,300 a pulled message). Both a pull answered
    at once and a held one (answered by holds.py when a send arrives); the answers stay
    what the version-2 pull gives."""
    seen: list[tuple[PullResult, str, str]] = []
    real = pullcols.pack

    def spy(result: PullResult, topic: str, queue_id: int, id_prefix: str, room: int) -> Any:
        seen.append((result, topic, id_prefix))
        return real(result, topic, queue_id, id_prefix, room)

    monkeypatch.setattr(pullcols, "pack", spy)
    topic = f"same{next(counter)}"
    with equeue.connect(broker.urls[0]) as client:
        client.create_topic(topic, 1)
        for i in range(3):
            client.send(topic, b"m%d" % i, tag="t", queue_id=0)
        v2, v3, _ = _both(client, topic=topic, queue_id=0, offset=0, max_count=10)
        assert len(v3.messages) == 3 and v3 == v2
        held: list[Any] = []
        later = {"topic": topic, "queue_id": 0, "offset": 3, "max_count": 10, "wait_ms": 10_000}
        waiting = threading.Thread(
            target=lambda: held.append(client.request("pull_columns", later))
        )
        waiting.start()
        deadline = time.monotonic() + 10
        while not broker.broker.holds.count and time.monotonic() < deadline:
            time.sleep(0.01)
        assert broker.broker.holds.count  # the pull is held, not answered empty
        with equeue.connect(broker.urls[0]) as sender:
            sender.send(topic, b"late", queue_id=0)
        waiting.join(10)
        assert [m.body for m in pullcols.unpack(held[0], "test").messages] == [b"late"]
    store_prefix = broker.store._id_prefix
    packed = [(result, t, p) for result, t, p in seen if result.messages]
    assert len(packed) == 2  # the pull at once and the held one
    for result, packed_topic, packed_prefix in packed:
        assert packed_topic == topic and packed_topic is result.messages[0].topic
        assert packed_prefix is store_prefix
