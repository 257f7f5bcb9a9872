"""The blocking client's read of a pull_columns answer straight from the frame's bytes
(equeue/cext/pullanswer.c, used for the group consumer's pulls): for every answer it
takes it gives exactly what msgpack and pullcols.unpack give, it takes the common form
(so the saving is not silently lost), and a truncated, flipped or hostile frame is left
to the msgpack path (None), never read differently."""

from __future__ import annotations

import random
import struct
from typing import Any

import msgpack
import pytest
import test_pull_columns
from client_helpers import WELCOME, FakeBroker, Peer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_pull_columns import HOSTILE

import equeue
from equeue import speedups
from equeue.client.consumer import GroupConsumer
from equeue.client.core import AnswerReader
from equeue.errors import EQueueError, ProtocolError
from equeue.protocol import pullcols
from equeue.protocol.frames import COLUMNS_VERSION, decode_body
from equeue.server import BrokerThread
from equeue.store.types import Message, PullResult

broker = test_pull_columns.broker  # its module-scoped BrokerThread fixture
pytestmark = pytest.mark.skipif(speedups.SPEEDUPS is None, reason="the C accelerator is not built")

INT64 = 2**63 - 1
RID = 77


def _message(i: int, fields: dict[str, Any], prefix: str) -> Message:
    return Message(
        f"{prefix}{fields['position']:016x}", "töpic", 3, fields["offset"], fields["position"],
        fields["tag"], fields["key"], fields["properties"], fields["code"], fields["body"],
        fields["created"], fields["stored"],
    )  # fmt: skip


def _frame(data: bytes, rid: int = RID, status: int = 0) -> bytes:
    """An answer's frame body as the broker writes it: [request id, status, value]."""
    return b"\x93" + bytes(msgpack.packb(rid)) + bytes(msgpack.packb(status)) + data


def _by_msgpack(body: bytes) -> PullResult:
    rid, status, value = decode_body(body, "test")
    assert (rid, status) == (RID, 0)
    return pullcols.unpack(value, "test")


rows = st.lists(
    st.fixed_dictionaries(
        {
            "offset": st.integers(0, INT64),
            "position": st.integers(0, INT64),
            "created": st.integers(-(2**63), INT64),
            "stored": st.integers(-(2**63), INT64),
            "body": st.one_of(st.binary(max_size=40), st.just(b"B" * 300), st.just(b"L" * 70_000)),
            "tag": st.sampled_from(["", "a", "ü"]),
            "key": st.one_of(st.none(), st.just("k")),
            "properties": st.one_of(st.just({}), st.just({"p": "v"})),
            "code": st.one_of(st.just(0), st.integers(-(2**63), INT64)),
        }
    ),
    max_size=8,
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(found=rows, prefix=st.sampled_from(["", "ab12cd34", "é"]), next_offset=st.integers(0, INT64))
def test_it_reads_what_msgpack_and_unpack_read(
    found: list[dict[str, Any]], prefix: str, next_offset: int
) -> None:
    messages = [_message(i, fields, prefix) for i, fields in enumerate(found)]
    data, kept = pullcols._pack(messages, next_offset, "töpic", 3, prefix, 1 << 30)
    assert data is not None and kept == len(messages)
    body = _frame(data)
    reference = _by_msgpack(body)
    read = pullcols.pull_answer(body, {RID})
    common = (
        prefix.isascii()
        and all(not m.key and not m.properties for m in messages)
        and len({m.tag for m in messages}) <= 1
        and len({m.code for m in messages}) <= 1
    )
    assert (read is not None) == common  # the common form is taken, nothing else
    if read is not None:
        assert read[:2] == [RID, 0] and type(read[2]) is tuple
        got = pullcols.unpack_any(read[2], "test")
        assert got == reference  # next_offset and every message, field for field
        assert [type(m) for m in got.messages] == [Message] * len(messages)


def _plain(n: int = 3) -> bytes:
    fields: dict[str, Any] = {"tag": "t", "key": None, "properties": {}, "code": 5, "created": -1}
    messages = [
        _message(i, {**fields, "offset": i, "position": 100 + i, "stored": 2**40 + i,
                     "body": bytes([i]) * (i * 20)}, "ab")
        for i in range(n)
    ]  # fmt: skip
    data, _ = pullcols._pack(messages, n, "t", 0, "ab", 1 << 20)
    assert data is not None
    return _frame(data)


def test_truncated_and_flipped_frames_are_never_read_differently() -> None:
    body = _plain()
    assert pullcols.pull_answer(body, {RID}) is not None  # the control: the whole frame is read
    for cut in range(len(body)):  # every truncation (and a byte too many) is left to msgpack
        assert pullcols.pull_answer(body[:cut], {RID}) is None
    assert pullcols.pull_answer(body + b"\x00", {RID}) is None
    rng = random.Random(23)
    taken = 0
    for _ in range(3000):
        flipped = bytearray(body)
        for _ in range(rng.randint(1, 3)):
            flipped[rng.randrange(len(flipped))] = rng.randrange(256)
        read = pullcols.pull_answer(bytes(flipped), {RID})
        if read is None:
            continue
        taken += 1  # what it reads, msgpack and unpack read the same
        try:
            reference = _by_msgpack(bytes(flipped))
        except (EQueueError, AssertionError, ValueError) as exc:
            raise AssertionError(f"read {read!r}, msgpack refused: {exc!r}") from exc
        assert pullcols.unpack_any(read[2], "test") == reference
    assert taken > 0  # (flips of a body byte or an int stay readable)


def test_other_answers_are_left_to_msgpack() -> None:
    body = _plain()
    assert pullcols.pull_answer(body, {RID + 1}) is None  # not a pull_answer request
    assert pullcols.pull_answer(_frame(_plain()[3:], status=1), {RID}) is None  # an error status
    assert pullcols.pull_answer(body, set()) is None
    for what, answer in HOSTILE:  # the shapes pullcols.unpack refuses: msgpack's path says so
        frame = _frame(msgpack.packb(answer, use_bin_type=True))
        assert pullcols.pull_answer(frame, {RID}) is None, what


def test_start_request_pulls_give_what_a_pull_gives(broker: BrokerThread) -> None:
    """Through a real broker: a plain answer read in C, one with keys and properties by
    msgpack; both what client.pull gives; and a group consumer hands out every one."""
    with equeue.connect(broker.urls[0]) as client:
        client.create_topic("sr", 1)
        client.send_batch("sr", [b"a" * 10, b"b" * 300, b""])
        client.send("sr", b"k", key="key", properties={"p": "v"}, tag="x")
        for offset, count, form in ((0, 3, tuple), (2, 10, list)):
            args = {"topic": "sr", "queue_id": 0, "offset": offset, "max_count": count}
            answer = client.finish_request(client.start_request("pull_columns", args))
            assert type(answer) is form
            found = pullcols.unpack_any(answer, "test")
            assert found == client.pull("sr", 0, offset, count)
        got = []
        with GroupConsumer(client, "g", "sr", timeout=1.0) as consumer:
            got = [(m.queue_offset, m.body, m.key, m.properties) for m in consumer]
        assert got == [
            (0, b"a" * 10, None, {}), (1, b"b" * 300, None, {}), (2, b"", None, {}),
            (3, b"k", "key", {"p": "v"}),
        ]  # fmt: skip
        assert client.committed_offset("g", "sr", 0) == 4
        conn = client._conn
        assert conn is not None and not conn.reader.pulls  # (each id out as its answer came)


def test_a_hostile_answer_to_a_pull_of_the_loops_own_thread_is_a_protocol_error() -> None:
    """A fake broker answers the member's first pull (a long poll, from a pool thread)
    with a whole batch, so its next pull goes without a wait from the loop's own thread
    (start_request); that one is answered with nonsense: the loop hands out the batch,
    then raises ProtocolError (no builtin exception), and the fake saw the inline pull."""
    good = [
        _message(i, {"offset": i, "position": i, "tag": "", "key": None, "properties": {},
                     "code": 0, "created": 1, "stored": 2, "body": b"m%d" % i}, "ab")
        for i in range(2)
    ]  # fmt: skip
    data, _ = pullcols._pack(good, 2, "t", 0, "ab", 1 << 20)
    pulls: list[dict[str, Any]] = []
    join = {"generation": 1, "assignment": [["t", 0]], "heartbeat_interval_ms": 1000}

    def script(peer: Peer) -> None:
        peer.recv()
        peer.send({**WELCOME, "version": COLUMNS_VERSION})
        while True:
            request_id, op, args = peer.recv()
            answer: Any = {"join": join, "heartbeat": join, "queue_range": [0, 10]}.get(op)
            if op == "pull_columns":
                pulls.append(args)
                answer = msgpack.unpackb(data) if len(pulls) == 1 else HOSTILE[2][1]
            peer.send([request_id, 0, answer])

    with FakeBroker(script) as fake, equeue.connect(fake.url, timeout=5) as client:
        with GroupConsumer(client, "g", "t", batch_size=2) as consumer:
            assert [m.body for m in (consumer.poll(2.0), consumer.poll(2.0)) if m] == [
                b"m0", b"m1",
            ]  # fmt: skip
            with pytest.raises(ProtocolError, match="pull_columns"):
                consumer.poll(2.0)
        assert not fake.errors
    assert [("wait_ms" in p, p["offset"]) for p in pulls[:2]] == [(True, 0), (False, 2)]


@pytest.mark.parametrize("columns", [set(), {RID + 1}])
def test_a_pull_answer_alone_in_a_read_is_read_by_pull_answer(columns: set[int]) -> None:
    """Review 33a, 3: a read holding exactly one whole answer (read where it lies, not
    buffered) is read by pull_answer when it answers a start_request pull, also with a
    send_batch in flight (columns), as when it comes with other bytes (the control)."""
    body = _plain()
    frame = struct.pack(">I", len(body)) + body
    for data in ([frame], [frame[:5], frame[5:]]):  # alone in its read; split: buffered
        reader = AnswerReader(1 << 20, "test")
        reader.columns, reader.pulls = set(columns), {RID}
        bodies = [b for part in data for b in reader.feed(memoryview(part))]
        assert len(bodies) == 1 and bodies[0][:2] == [RID, 0]
        assert type(bodies[0][2]) is tuple  # pull_answer's (before the fix: msgpack's list)
        assert pullcols.unpack_any(bodies[0][2], "test") == _by_msgpack(body)
