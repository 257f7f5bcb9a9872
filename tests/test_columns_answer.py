"""The sync client reads a send_bodies answer in C (records.columns_answer) straight
from the frame's bytes into SendResults: the same results as the msgpack path
(unpack_send_columns) for every answer it takes, and None (the msgpack path decides)
for anything it cannot reproduce exactly or that is malformed."""

from __future__ import annotations

import contextlib
import struct
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

import msgpack
import pytest
from client_helpers import BrokerProcess
from hypothesis import given, settings
from hypothesis import strategies as st
from server_helpers import raw, short_home

import equeue
import equeue.client.core as core
import equeue.protocol.records as records
from equeue import MessageStore, StoreConfig, speedups
from equeue.errors import (
    ConnectionLostError,
    FrameTooLargeError,
    InvalidMessageError,
    MessageTooLargeError,
    ProtocolError,
)
from equeue.protocol.frames import BODIES_VERSION, check_answer
from equeue.protocol.records import bodies_request, columns_answer, unpack_send_columns
from equeue.server import BrokerThread

pytestmark = pytest.mark.skipif(speedups.SPEEDUPS is None, reason="the accelerator is not built")

home = pytest.fixture(short_home, name="home")
MAX = 2**63 - 1


def _frame(rid: int, value: Any, status: int = 0) -> bytes:
    return msgpack.packb([rid, status, value], use_bin_type=True)  # type: ignore[no-any-return]


def _value(topic: str, prefix: str, rows: list[tuple[int, int, int, float]]) -> list[Any]:
    return [
        topic,
        [f"{prefix}{position:016x}" for _, _, position, _ in rows],
        [q for q, _, _, _ in rows],
        [offset for _, offset, _, _ in rows],
        [position for _, _, position, _ in rows],
        [stored for _, _, _, stored in rows],
    ]


def _same(fast: list[Any], slow: list[Any]) -> None:
    assert len(fast) == len(slow)
    for a, b in zip(fast, slow, strict=True):
        assert tuple(a) == tuple(b)
        assert [type(v) for v in a] == [type(v) for v in b]
        assert (a.message_id, a.queue_id, a.position) == (b.message_id, b.queue_id, b.position)


rows = st.lists(
    st.tuples(
        st.integers(0, MAX),
        st.integers(0, MAX),
        st.integers(0, MAX),
        st.sampled_from([1.5e9, 1795660303.4716203, 0.0])
        | st.floats(allow_nan=False, allow_infinity=True),
    ),
    max_size=300,
)


@settings(max_examples=150, deadline=None)
@given(
    rid=st.integers(0, 2**64 - 1),
    topic=st.text(max_size=40),
    prefix=st.text(st.characters(max_codepoint=127), max_size=40),
    rows=rows,
)
def test_the_c_read_gives_what_the_msgpack_path_gives(
    rid: int, topic: str, prefix: str, rows: list[tuple[int, int, int, float]]
) -> None:
    value = _value(topic, prefix, rows)
    frame = _frame(rid, value)
    fast = columns_answer(frame, {rid})
    assert fast is not None and fast[:2] == [rid, 0] and type(fast[2]) is tuple
    _same(fast[2][0], unpack_send_columns(msgpack.unpackb(frame)[2], "here"))
    assert core.DECODERS["send_bodies"](fast[2], "here") is fast[2][0]
    assert columns_answer(frame, {rid + 1}) is None  # not a send_bodies in flight


GOOD = _value("t", "0bffcd16", [(0, 0, 7, 1.5), (1, 3, 300, 1.5)])


def _mutations() -> list[tuple[str, bytes]]:
    good = _frame(9, GOOD)
    ids = list(GOOD[1])
    return [
        ("truncated", good[:-1]),
        ("trailing byte", good + b"\x00"),
        ("an error status", _frame(9, GOOD, status=1)),
        ("five items", _frame(9, GOOD[:5])),
        ("arrays of two lengths", _frame(9, [*GOOD[:2], [0], *GOOD[3:]])),
        ("a count past the frame", good.replace(b"\x92", b"\xdc\xff\xff", 1)),
        ("an id not of its position", _frame(9, [GOOD[0], [ids[1], ids[0]], *GOOD[2:]])),
        ("an uppercase hex id", _frame(9, [GOOD[0], [ids[0].upper(), ids[1]], *GOOD[2:]])),
        ("ids of two prefixes", _frame(9, [GOOD[0], [ids[0], "x" + ids[1][1:]], *GOOD[2:]])),
        ("a short id", _frame(9, [GOOD[0], ["12", "34"], *GOOD[2:]])),
        ("a non-ASCII prefix", _frame(9, _value("t", "é", [(0, 0, 7, 1.5)]))),
        ("a negative queue id", _frame(9, [*GOOD[:2], [-1, 0], *GOOD[3:]])),
        ("a bool for a uint", _frame(9, [*GOOD[:2], [True, 0], *GOOD[3:]])),
        ("a uint of 2**63", _frame(9, _value("t", "p", [(2**63, 0, 7, 1.5)]))),
        ("an int stored_at", _frame(9, [*GOOD[:5], [1, 2]])),
        ("a float32 stored_at", _frame(9, GOOD)[:-18] + b"\xca" + struct.pack(">f", 1.5) * 2),
        ("a bin topic", _frame(9, [b"t", *GOOD[1:]])),
        ("a bad UTF-8 topic", _frame(9, GOOD).replace(b"\xa1t", b"\xa1\xff", 1)),
        ("an array of SendResult arrays", _frame(9, [list(range(6))])),
        ("not an answer", msgpack.packb({"a": 1})),
    ]


@pytest.mark.parametrize(("what", "frame"), _mutations(), ids=[m[0] for m in _mutations()])
def test_an_answer_not_of_the_exact_form_goes_to_the_msgpack_path(what: str, frame: bytes) -> None:
    assert columns_answer(_frame(9, GOOD), {9}) is not None  # the control
    assert columns_answer(frame, {9}) is None
    try:  # the msgpack path: a ProtocolError for what is malformed, never a builtin error
        body = msgpack.unpackb(frame, strict_map_key=False)
        if type(body) is list and len(body) == 3 and body[1] == 0:
            core.DECODERS["send_bodies"](body[2], "here")
    except (ProtocolError, msgpack.ExtraData, ValueError):
        pass


@settings(max_examples=25, deadline=None)
@given(
    batches=st.lists(
        st.lists(
            st.sampled_from([b"", b"x", b"y" * 100, b"z" * 4000]) | st.binary(max_size=300),
            min_size=1,
            max_size=120,
        ),
        min_size=1,
        max_size=4,
    )
)
def test_against_a_real_broker_every_result_names_its_stored_message(
    batches: list[list[bytes]],
) -> None:
    # one broker for the examples (small chunks: batches cross rollovers)
    for batch in batches:
        results = CLIENT.send_batch("t", batch)
        assert len(results) == len(batch)
        for sent, body in zip(results, batch, strict=True):
            stored = BROKER.store.get(sent.message_id)
            assert stored.body == body
            assert (stored.queue_id, stored.queue_offset, stored.position) == (
                sent.queue_id,
                sent.queue_offset,
                sent.position,
            )
    assert READ_IN_C[0] > 0  # the fast path was taken
    assert not CLIENT._conn.reader.columns  # every in-flight id was answered and dropped


BROKER: Any = None
CLIENT: Any = None
READ_IN_C = [0]


@pytest.fixture(autouse=True)
def _broker(request: pytest.FixtureRequest, home: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    global BROKER, CLIENT
    if request.node.name != "test_against_a_real_broker_every_result_names_its_stored_message":
        yield
        return
    real = records.columns_answer

    def counted(payload: Any, ids: set[int]) -> Any:
        body = real(payload, ids)
        READ_IN_C[0] += body is not None
        return body

    monkeypatch.setattr(core, "columns_answer", counted)
    config = StoreConfig(chunk_data_size=65536, queue_chunk_records=342, max_message_size=4096)
    with MessageStore.open(home / "store", config) as store, BrokerThread(store) as broker:
        client = equeue.connect(broker.urls[0], timeout=20)
        BROKER, CLIENT = broker, client
        try:
            yield
        finally:
            client.close()
            BROKER = CLIENT = None


@settings(max_examples=150, deadline=None)
@given(
    rid=st.integers(0, 2**64 - 1),
    topic=st.text(max_size=300),
    bodies=st.lists(
        st.binary(max_size=300) | st.sampled_from([b"", b"x" * 255, b"y" * 256, b"z" * 65536]),
        max_size=40,
    ),
)
def test_the_c_request_is_the_bytes_msgpack_writes(
    rid: int, topic: str, bodies: list[bytes]
) -> None:
    payload = msgpack.packb([rid, "send_bodies", {"topic": topic, "bodies": bodies}])
    assert bodies_request(rid, topic, bodies, 2**31) == struct.pack(">I", len(payload)) + payload


@pytest.mark.parametrize(
    ("rid", "topic", "bodies"),
    [
        (1, "t", [b"x", "not bytes"]),
        (1, "t", [b"x", bytearray(b"y")]),
        (1, "\udc80", [b"x"]),  # not encodable as UTF-8
        (-1, "t", [b"x"]),
        (2**64, "t", [b"x"]),
        (1, "t", (b"x",)),
    ],
)
def test_a_request_c_cannot_write_goes_to_msgpack(rid: Any, topic: Any, bodies: Any) -> None:
    assert bodies_request(rid, topic, bodies, 2**31) is None


def test_a_request_past_max_frame_bytes_is_refused_as_before() -> None:
    encoder = core.RequestEncoder(1000, "here", BODIES_VERSION)
    assert len(encoder.frame(3, "send_bodies", {"topic": "t", "bodies": [b"x" * 900]})) > 900
    with pytest.raises(MessageTooLargeError, match="max_frame_bytes=1000"):  # (no frame carries it)
        encoder.frame(3, "send_bodies", {"topic": "t", "bodies": [b"x" * 1000]})
    with pytest.raises(InvalidMessageError, match="UTF-8"):
        encoder.frame(3, "send_bodies", {"topic": "\udc80", "bodies": [b"x"]})


def test_an_oversized_request_is_refused_before_its_frame_is_built() -> None:
    """Over max_frame_bytes: FrameTooLargeError naming the limit and the setting, with
    neither the C frame nor msgpack's built (tracemalloc's peak stays below one body);
    at the limit exactly: msgpack's bytes."""
    bodies = [b"x" * (1 << 20)] * 8
    args = {"topic": "t", "bodies": bodies}
    size = len(msgpack.packb([3, "send_bodies", args]))
    assert bodies_request(3, "t", bodies, size - 1) == size
    assert bodies_request(3, "t", bodies, 2**40) is not None  # (the length field's limit)
    at_limit = core.RequestEncoder(size, "here", BODIES_VERSION).frame(3, "send_bodies", args)
    assert at_limit == struct.pack(">I", size) + msgpack.packb([3, "send_bodies", args])
    encoder = core.RequestEncoder(size - 1, "here", BODIES_VERSION)
    tracemalloc.start()
    try:
        with pytest.raises(FrameTooLargeError) as refused:
            encoder.frame(3, "send_bodies", args)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert f"request of {size} bytes" in str(refused.value)
    assert f"max_frame_bytes={size - 1}" in str(refused.value)
    assert "equeue serve --max-frame-bytes" in str(refused.value)
    assert "a send_batch request" in str(refused.value)  # (the caller's op: send_bodies is its)
    assert peak < 1 << 20


@pytest.mark.parametrize("flush", ["sync", "async"])
def test_after_a_sigkill_every_acknowledged_batch_is_stored(home: Path, flush: str) -> None:
    """Three sync clients, each send_batch of 100 bodies one request at a time (the answers
    read in C; the broker reads the requests in C, cext/bodyspans.c), against ``equeue
    serve --flush sync`` and ``async`` (the batched benchmark's), SIGKILLed mid-batch
    once 3,000 are acknowledged: every acknowledged message is in the reopened store
    where its SendResult says, each queue's offsets dense (no torn record). Control: the
    batch acknowledged before the producers started."""
    acked: list[list[tuple[Any, bytes]]] = [[] for _ in range(3)]
    stop = threading.Event()

    def produce(k: int, url: str) -> None:
        with contextlib.suppress(ConnectionLostError), equeue.connect(url, timeout=20) as client:
            for b in range(2000):  # bounded: the kill comes long before
                if stop.is_set():
                    return
                bodies = [f"p{k}-{b}-{i}".encode() * (1 + i % 3) for i in range(100)]
                acked[k] += zip(client.send_batch("t", bodies), bodies, strict=True)

    with BrokerProcess(home / "store", "--flush", flush) as broker:
        with equeue.connect(broker.url) as client:
            control = client.send_batch("t", [b"control"] * 100)
        producers = [threading.Thread(target=produce, args=(k, broker.url)) for k in range(3)]
        for producer in producers:
            producer.start()
        try:
            deadline = time.monotonic() + 60
            while sum(map(len, acked)) < 3000 and time.monotonic() < deadline:
                time.sleep(0.01)
            broker.kill()
        finally:
            stop.set()
            for producer in producers:
                producer.join(60)
    assert sum(map(len, acked)) >= 3000
    with MessageStore.open(home / "store", StoreConfig(flush="async")) as store:
        for sent in control:
            assert store.get(sent.message_id).body == b"control"
        for sent, body in (pair for lane in acked for pair in lane):
            message = store.get(sent.message_id)
            assert (message.body, message.queue_id, message.queue_offset) == (
                body,
                sent.queue_id,
                sent.queue_offset,
            )
        for q in store.queue_ids("t"):
            first, end = store.queue_range("t", q)
            offsets = [m.queue_offset for m in store.pull("t", q, first, 100_000).messages]
            assert offsets == list(range(first, end))


def _request(payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + payload


GOOD_REQUEST = msgpack.packb([1, "send_bodies", {"topic": "t", "bodies": [b"a", b"b", b"c"]}])
HOSTILE_REQUESTS = {
    "an array of 5 holding 3": GOOD_REQUEST.replace(b"\x93\xc4", b"\x95\xc4"),
    "an array of 2 holding 3": GOOD_REQUEST.replace(b"\x93\xc4", b"\x92\xc4"),
    "a body cut short": GOOD_REQUEST[:-1],
    "a bin longer than the frame": GOOD_REQUEST[:-2] + b"\xc4\x09c",
    "a str body": msgpack.packb([1, "send_bodies", {"topic": "t", "bodies": [b"a", "b"]}]),
    "a map body": msgpack.packb([1, "send_bodies", {"topic": "t", "bodies": [b"a", {}]}]),
}


@pytest.mark.parametrize("what", list(HOSTILE_REQUESTS))
def test_a_hostile_send_bodies_frame_closes_only_its_connection(home: Path, what: str) -> None:
    with BrokerThread(home / "store") as broker:
        url = broker.urls[0]
        with raw(url) as c, raw(url) as other:
            assert c.call("ping") is None  # the control: a good request on the same path
            c.send_raw(_request(HOSTILE_REQUESTS[what]))
            body = c.recv()
            assert body[1] == 1 and body[2]["code"] == ProtocolError.__name__, body
            with pytest.raises((ConnectionError, OSError)):
                c.recv()  # closed
            assert other.call("ping") is None
            assert "t" not in broker.store.topics()  # nothing stored
            other.send_raw(_request(GOOD_REQUEST))
            assert len(check_answer(other.recv(), "test")[2][1]) == 3
