"""A read that is exactly one send_bodies frame (a sync producer's send_batch, one request
at a time): read by C from the connection's read buffer itself (cext/bodyspans.c
bodies_read, Connection._read_general/_spans_read), appended and answered with the whole
answer frame made in C (batch.c packed_answer, bodyspans.c answer_around). What it reads
is what bodies_body reads from the frame copied out; anything else is left to the
general path; the answers and stored messages are those of the general path; a failure
is answered and the broker goes on."""

from __future__ import annotations

import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from server_helpers import raw, short_home

import equeue
from equeue import MessageStore, StoreConfig, speedups
from equeue.errors import BrokerError, ClosedError, ReadOnlyError
from equeue.protocol import records
from equeue.protocol.frames import check_answer
from equeue.server import BrokerThread
from equeue.server import handlers as handlers_module
from equeue.server.connection import Connection
from equeue.store.bodies import send_packed

pytestmark = pytest.mark.skipif(speedups.SPEEDUPS is None, reason="the C accelerator is not built")
home = pytest.fixture(short_home, name="home")
BUFFER = 1 << 18  # the connection's read buffer (connection.py)
# small chunks: batches meet a log rollover and queue-chunk reservations (append_bodies
# stops there and Appender.append takes the body)
CONFIG = StoreConfig(chunk_data_size=65536, alloc_step=4096, queue_chunk_records=342, flush="async")


def _fast() -> Any:
    assert speedups.SPEEDUPS is not None
    return speedups.SPEEDUPS


def _spans(read: Any) -> Any:
    if read is None:
        return None
    rid, topic, spans = read
    return rid, topic, [spans[i] for i in range(len(spans))]


def _in_buffer(data: bytes) -> memoryview:
    buffer = bytearray(BUFFER)
    buffer[: len(data)] = data
    return memoryview(buffer)


request_st = st.builds(
    lambda rid, topic, bodies, first: [
        rid,
        "send_bodies",
        {"topic": topic, "bodies": bodies} if first else {"bodies": bodies, "topic": topic},
    ],
    st.integers(1, 2**64 - 1),
    st.text(max_size=20),
    st.lists(st.binary(max_size=300), min_size=1, max_size=30),
    st.booleans(),
)


@settings(max_examples=300, deadline=None)
@given(request=request_st, data=st.data())
def test_a_read_of_one_frame_is_read_as_bodies_body_reads_the_frame(
    request: list[Any], data: st.DataObject
) -> None:
    """Whole frames and hostile ones (a byte changed, cut, bytes added): bodies_read
    reads from the buffer exactly what bodies_body reads from the frame's body copied
    out, or None where it gives None."""
    body = msgpack.packb(request)
    if data.draw(st.booleans()):
        at = data.draw(st.integers(0, len(body) - 1))
        how = data.draw(st.sampled_from(["flip", "cut", "add"]))
        if how == "flip":
            body = body[:at] + bytes([data.draw(st.integers(0, 255))]) + body[at + 1 :]
        elif how == "cut":
            body = body[:at]
        else:
            body = body + data.draw(st.binary(min_size=1, max_size=3))
    frame = struct.pack(">I", len(body)) + body
    fast = _fast()
    read = _spans(fast.bodies_read(_in_buffer(frame), len(frame), 1 << 24, 1 << 24))
    assert read == _spans(fast.bodies_body(body, 1 << 24))


def test_a_read_that_is_not_exactly_one_frame_within_the_limits_is_none() -> None:
    body = msgpack.packb([5, "send_bodies", {"topic": "t", "bodies": [b"a", b"bc"]}])
    frame = struct.pack(">I", len(body)) + body
    fast = _fast()
    read = fast.bodies_read
    view = _in_buffer(frame + frame)
    assert _spans(read(view, len(frame), 1 << 20, 10)) == (5, "t", [b"a", b"bc"])  # control
    assert read(view, len(frame) - 1, 1 << 20, 10) is None  # the frame not whole
    assert read(view, 2 * len(frame), 1 << 20, 10) is None  # two frames in the read
    assert read(view, len(frame) + 3, 1 << 20, 10) is None  # a second frame begun
    assert read(view, len(frame), len(body) - 1, 10) is None  # past max_frame_bytes
    assert read(view, len(frame), 1 << 20, 1) is None  # past max_bodies
    assert read(view, 4, 1 << 20, 10) is None
    assert read(view[:10], len(frame), 1 << 20, 10) is None  # more than the buffer
    with pytest.raises(TypeError):
        read(bytearray(frame), len(frame), 1 << 20, 10)


@settings(max_examples=200, deadline=None)
@given(
    topic=st.sampled_from(["t", "x" * 31, "y" * 32, "z" * 255, "é" * 200]),
    count=st.sampled_from([0, 1, 15, 16, 100, 65535, 65536]),
    columns=st.lists(st.binary(max_size=40), min_size=5, max_size=5),
)
def test_the_c_answer_is_the_bytes_the_python_answer_joins(
    topic: str, count: int, columns: list[bytes]
) -> None:
    arrays = [bytearray(c) for c in columns]
    fast = records.packed_answer(topic, count, arrays)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(speedups, "SPEEDUPS", None)
        slow = records.packed_answer(topic, count, arrays)
    assert fast == slow
    for rid in (1, 127, 128, 65536, 2**64 - 1):
        assert _fast().answer_around(rid, fast) == handlers_module._answer_around(rid, fast)
    assert _fast().packed_answer(topic, count, arrays[:4]) is None  # not its arguments


def test_answer_around_takes_only_an_id_and_bytes() -> None:
    for args in [(1, bytearray(b"x")), ("1", b"x"), (-1, b"x"), (1,)]:
        with pytest.raises((TypeError, OverflowError)):
            _fast().answer_around(*args)


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """How many reads went through _spans_read (answered there) and data_received."""
    counts = {"spans": 0, "general": 0}
    # (getattr: a tree without _spans_read, before it was written, fails the counts)
    spans_read = getattr(Connection, "_spans_read", None)
    data_received = Connection.data_received

    def spans(self: Connection, *args: Any) -> bool:
        assert spans_read is not None
        done: bool = spans_read(self, *args)
        counts["spans"] += done
        return done

    def general(self: Connection, *args: Any) -> None:
        counts["general"] += 1
        data_received(self, *args)

    if spans_read is not None:
        monkeypatch.setattr(Connection, "_spans_read", spans)
    monkeypatch.setattr(Connection, "data_received", general)
    yield counts


@pytest.mark.parametrize("flush", ["async", "sync"])
def test_send_batch_is_served_from_the_read_buffer(
    home: Path, counted: dict[str, int], flush: str
) -> None:
    """Sync client send_batch of 100 bodies, 40 times (the log rolls over twice): every
    batch is served by _spans_read (none by the general reader: only the hello), every
    result names the message stored with its body, in each queue's order."""
    config = StoreConfig(
        chunk_data_size=65536, alloc_step=4096, queue_chunk_records=342, flush="async"
    )
    sent: list[tuple[Any, bytes]] = []
    with (
        MessageStore.open(home / "store", config) as store,
        BrokerThread(store, flush=flush) as broker,
        equeue.connect(broker.urls[0]) as client,
    ):
        client.create_topic("t", 3)
        general = counted["general"]
        for b in range(40):
            bodies = [f"{b}-{i}-".encode().ljust(10 + (b * 7 + i) % 300, b"x") for i in range(100)]
            sent += zip(client.send_batch("t", bodies), bodies, strict=True)
        assert counted["spans"] == 40
        assert counted["general"] == general  # not one batch read the general way
        for result, body in sent:
            message = store.get(result.message_id)
            assert (message.body, message.queue_id, message.queue_offset) == (
                body,
                result.queue_id,
                result.queue_offset,
            )
        for q in range(3):
            lane = [body for result, body in sent if result.queue_id == q]
            assert [m.body for m in store.pull("t", q, 0, 10_000).messages] == lane
    assert counted["spans"] == 40


def test_a_failure_in_the_append_is_answered_and_the_broker_goes_on(
    home: Path, counted: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A defect (a builtin exception) in the append of a batch read from the buffer: the
    client gets BrokerError naming the op, the connection and the broker stay up, and
    the next batch is stored. Control: a batch before the failure."""
    with (
        MessageStore.open(home / "store", CONFIG) as store,
        BrokerThread(store) as broker,
        equeue.connect(broker.urls[0]) as client,
    ):
        client.create_topic("t", 2)
        first = client.send_batch("t", [b"before"] * 10)
        with monkeypatch.context() as patch:

            def broken(*args: Any, **kwargs: Any) -> bytes:
                raise RuntimeError("the append broke")

            patch.setattr(handlers_module, "send_packed", broken)
            with pytest.raises(BrokerError) as refused:
                client.send_batch("t", [b"lost"] * 10)
        assert "the append broke" in str(refused.value)
        client.ping()  # the connection is up
        after = client.send_batch("t", [b"after"] * 10)
        assert [store.get(r.message_id).body for r in first + after] == [b"before"] * 10 + [
            b"after"
        ] * 10
        assert sum(store.queue_range("t", q)[1] for q in range(2)) == 20  # nothing of the lost
        # a hostile frame read whole: the general path refuses it and closes the connection
        with raw(broker.urls[0]) as c:
            body = msgpack.packb([1, "send_bodies", {"topic": "t", "bodies": [b"a"]}])[:-1]
            c.send_raw(struct.pack(">I", len(body)) + body)
            rid, status, error = check_answer(c.recv(), "test")
            assert (rid, status, error["code"]) == (0, 1, "ProtocolError")
        assert len(client.send_batch("t", [b"still"] * 3)) == 3


def test_checked_packed_sends_refuse_a_closed_or_read_only_store(home: Path) -> None:
    """send_packed(checked=True) (send_spans' call) leaves the writable check to the
    topic's look-up: a read_only handle still gets ReadOnlyError, a closed store
    ClosedError, nothing written. Control: the writer's send goes through."""
    with MessageStore.open(home / "s", CONFIG) as store:
        assert send_packed(store, "t", [b"x"], checked=True) is not None  # control
        with (
            MessageStore.open(home / "s", read_only=True) as reader,
            pytest.raises(ReadOnlyError),
        ):
            send_packed(reader, "t", [b"x"], checked=True)
    with pytest.raises(ClosedError):
        send_packed(store, "t", [b"x"], checked=True)
    with MessageStore.open(home / "s", CONFIG) as store:
        assert sum(store.queue_range("t", q)[1] for q in store.queue_ids("t")) == 1


def test_a_released_view_is_refused_not_read() -> None:
    body = msgpack.packb([5, "send_bodies", {"topic": "t", "bodies": [b"a"]}])
    frame = struct.pack(">I", len(body)) + body
    view = _in_buffer(frame)
    assert _spans(_fast().bodies_read(view, len(frame), 1 << 20, 10)) == (5, "t", [b"a"])
    view.release()  # (its buffer may be freed: never read through it)
    with pytest.raises(ValueError, match="released"):
        _fast().bodies_read(view, len(frame), 1 << 20, 10)
    # a view that is not contiguous is left to the general path, as before
    assert _fast().bodies_read(_in_buffer(frame)[::2], 9, 1 << 20, 10) is None


def test_with_a_pull_held_each_batch_is_parsed_once(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """send_spans refuses every batch while a pull is held (each send is noted for the
    holds): then the read is not parsed by C at all (neither bodies_read nor
    bodies_body, nor send_spans called), only once by msgpack; without one, every batch
    goes through send_spans once (the control). Both store every message."""
    calls = {"send_spans": 0}
    send_spans = handlers_module.Handlers.send_spans

    def counting(self: Any, *args: Any) -> Any:
        calls["send_spans"] += 1
        return send_spans(self, *args)

    monkeypatch.setattr(handlers_module.Handlers, "send_spans", counting)
    with (
        MessageStore.open(home / "store", CONFIG) as store,
        BrokerThread(store) as broker,
        equeue.connect(broker.urls[0]) as producer,
        equeue.connect(broker.urls[0], timeout=10.0) as waiter,
    ):
        producer.create_topic("one", 1)
        producer.create_topic("idle", 1)
        for _ in range(5):  # the control: no pull held
            producer.send_batch("one", [b"x" * 100] * 100)
        assert calls["send_spans"] == 5
        held = waiter.start_request(
            "pull_columns", {"topic": "idle", "queue_id": 0, "offset": 0, "wait_ms": 8000}
        )
        for _ in range(500):  # (bounded: until the broker holds it)
            if broker.broker.holds.count:
                break
            time.sleep(0.01)
        assert broker.broker.holds.count == 1
        for _ in range(10):
            producer.send_batch("one", [b"y" * 100] * 100)
        assert calls["send_spans"] == 5  # 20 more before the fix (two refusals a batch)
        producer.send("idle", b"wake")  # the held pull answered
        waiter.finish_request(held)
        assert len(store.pull("one", 0, 0, 2000).messages) == 1500
