"""The wire protocol's pieces on their own: frames, the handshake, records, errors."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import equeue.errors as errors
from equeue.protocol import faults, frames, handshake, ops, records
from equeue.store.types import Message, PullResult, SendResult

MESSAGE = Message(
    "0123456789abcdef01234567", "orders", 3, 17, 4096, "paid", None, {"a": "b"}, 7,
    b"\x00body", 1_700_000_000_123_456_789, 1_700_000_000_223_456_789,
)  # fmt: skip


@given(
    bodies=st.lists(st.binary(min_size=0, max_size=300), min_size=1, max_size=8),
    cuts=st.lists(st.integers(min_value=0, max_value=3000), max_size=12),
)
def test_frame_reader_reassembles_any_split(bodies: list[bytes], cuts: list[int]) -> None:
    stream = b"".join(frames.encode(body) for body in bodies)
    reader = frames.FrameReader(1 << 20, "test")
    got: list[bytes] = []
    at = 0
    for cut in [*sorted({c % (len(stream) + 1) for c in cuts}), len(stream)]:
        got += reader.feed(stream[at:cut])
        at = cut
    assert [frames.decode_body(b, "test") for b in got] == bodies
    assert reader.pending == 0


def test_truncated_frame_stays_pending() -> None:
    frame = frames.encode([1, "ping", {}])
    reader = frames.FrameReader(1024, "test")
    assert reader.feed(frame[:-1]) == []
    assert reader.pending == len(frame) - 1


def test_oversized_header_is_refused_before_the_body_arrives() -> None:
    reader = frames.FrameReader(1024, "conn 7")
    with pytest.raises(errors.FrameTooLargeError, match=r"conn 7.*1025.*max_frame_bytes=1024"):
        reader.feed(frames.FRAME_HEADER.pack(1025))


def test_empty_frame_is_a_protocol_error() -> None:
    with pytest.raises(errors.ProtocolError, match="empty frame"):
        frames.FrameReader(1024, "t").feed(bytes(4))


@pytest.mark.parametrize(
    "payload", [b"\xc1", b"\x92\x01", b"\x01\x02", b"\xd9\x05ab", b"\xa2\xff\xfe"]
)
def test_bad_bodies_are_protocol_errors(payload: bytes) -> None:
    with pytest.raises(errors.ProtocolError):
        frames.decode_body(payload, "t")


def test_encode_refuses_what_msgpack_cannot_carry() -> None:
    with pytest.raises(errors.ProtocolError, match="cannot encode"):
        frames.encode({"x": object()})
    with pytest.raises(errors.ProtocolError):
        frames.encode(1 << 70)


@pytest.mark.parametrize(
    "body",
    [None, [], [0, "ping", {}], [1, "ping"], [1, 2, {}], [True, "ping", {}], [1, "ping", []]],
)
def test_request_shapes(body: object) -> None:
    with pytest.raises(errors.ProtocolError, match="a request must be"):
        frames.check_request(body, "t")


def test_request_and_answer_round_trip() -> None:
    body = frames.decode_body(frames.encode([5, "send", {"topic": "t"}])[4:], "t")
    assert frames.check_request(body, "t") == (5, "send", {"topic": "t"})
    assert frames.check_answer([5, frames.STATUS_OK, None], "t") == (5, 0, None)
    with pytest.raises(errors.ProtocolError):
        frames.check_answer([5, 2, None], "t")


def test_hello_and_welcome_round_trip() -> None:
    hello = handshake.Hello((1,), "secret", "worker-1")
    assert handshake.Hello.unpack(msgpack.unpackb(msgpack.packb(hello.pack())), "t") == hello
    limits = {name: 10 for name in handshake.LIMIT_NAMES}
    welcome = handshake.Welcome(1, "equeue 0.1.0", limits)
    assert handshake.Welcome.unpack(welcome.pack(), "t") == welcome
    assert handshake.choose_version((1, 7)) == 1
    assert handshake.choose_version((7,)) is None


@pytest.mark.parametrize(
    "hello",
    [
        [],
        {"versions": []},
        {"versions": [0]},
        {"versions": [1], "token": 5},
        {"versions": [1], "client": "x" * 201},
    ],
)
def test_bad_hellos(hello: object) -> None:
    with pytest.raises(errors.ProtocolError):
        handshake.Hello.unpack(hello, "t")


def test_welcome_with_an_unknown_version_is_refused() -> None:
    limits = {name: 10 for name in handshake.LIMIT_NAMES}
    with pytest.raises(errors.ProtocolError, match="version 7"):
        handshake.Welcome.unpack({"version": 7, "server": "x", "limits": limits}, "t")
    with pytest.raises(errors.ProtocolError, match="max_frame_bytes"):
        handshake.Welcome.unpack({"version": 1, "server": "x", "limits": {}}, "t")


def test_welcome_limits_are_held_to_the_longest_frame() -> None:
    # More means nothing on a 4-byte length field; no broker of ours announces more (its
    # settings stop at 2**31): a client takes the ceiling. Not above 0: refused, said.
    limits = {name: 2**64 - 1 for name in handshake.LIMIT_NAMES}
    limits |= {"max_in_flight": 64, "max_pull_count": 2**32, "max_batch_messages": 2**32 - 1}
    found = handshake.Welcome.unpack({"version": 1, "server": "x", "limits": limits}, "t")
    assert found.limits == {
        "max_frame_bytes": 2**32 - 1,
        "max_in_flight": 64,
        "max_connections": 2**32 - 1,
        "max_pull_count": 2**32 - 1,
        "max_batch_messages": 2**32 - 1,
    }
    assert handshake.LIMIT_CEILING == 2**32 - 1
    limits["max_in_flight"] = -5
    with pytest.raises(errors.ProtocolError, match=r"peer: welcome limit 'max_in_flight'.*-5"):
        handshake.Welcome.unpack({"version": 1, "server": "x", "limits": limits}, "peer")


def test_records_round_trip_through_msgpack() -> None:
    def wire(value: object) -> object:
        return msgpack.unpackb(msgpack.packb(value, use_bin_type=True), raw=False)

    assert records.unpack_message(wire(records.pack_message(MESSAGE)), "t") == MESSAGE
    sent = SendResult("0123456789abcdef01234567", "orders", 1, 2, 3, 1_700_000_000.25)
    assert records.unpack_send_result(wire(records.pack_send_result(sent)), "t") == sent
    pulled = records.unpack_pull_result(
        wire(records.pack_pull_result(PullResult([MESSAGE, MESSAGE], 19))), "t"
    )
    assert list(pulled) == [MESSAGE, MESSAGE]
    assert pulled.next_offset == 19


@pytest.mark.parametrize(
    "index,value",
    [(2, "3"), (2, True), (6, 5), (7, {"a": 1}), (9, "text"), (11, 1.5)],
)
def test_a_message_with_a_wrong_field_type_is_refused(index: int, value: object) -> None:
    fields = records.pack_message(MESSAGE)
    fields[index] = value
    with pytest.raises(errors.ProtocolError, match=f"field {index}|properties"):
        records.unpack_message(fields, "t")


def test_errors_cross_the_wire_as_their_class() -> None:
    sent = errors.TopicNotFoundError("topic 'x' does not exist")
    back = faults.unpack_error(faults.pack_error(sent), "t")
    assert type(back) is errors.TopicNotFoundError
    assert str(back) == "topic 'x' does not exist"
    corrupt = errors.ChecksumMismatchError("bad record", file="/s/c", offset=8, expected=1, found=2)
    back = faults.unpack_error(faults.pack_error(corrupt), "t")
    assert type(back) is errors.ChecksumMismatchError
    assert back.file is None
    assert str(back) == str(corrupt)
    full = faults.unpack_error(faults.pack_error(errors.DiskFullError(28, "full")), "t")
    assert isinstance(full, errors.DiskFullError)
    assert full.sent == []


def test_unexpected_and_unknown_errors_become_broker_errors() -> None:
    packed = faults.pack_error(KeyError("k"))
    assert packed["code"] == "BrokerError"
    assert "KeyError" in packed["message"]
    back = faults.unpack_error({"code": "NoSuchError", "message": "m"}, "t")
    assert type(back) is errors.BrokerError
    assert "NoSuchError" in str(back)
    # a code naming something in equeue.errors that is not an error class
    assert type(faults.unpack_error({"code": "location", "message": ""}, "t")) is (
        errors.BrokerError
    )
    assert type(faults.unpack_error([], "t")) is errors.ProtocolError


def test_check_args_refuses_every_wrong_shape() -> None:
    spec = ops.check_args("send", {"topic": "t", "body": b"x", "queue_id": None}, "t")
    assert "body" in spec
    with pytest.raises(errors.ProtocolError, match="unknown op"):
        ops.check_args("drop_everything", {}, "t")
    with pytest.raises(errors.ProtocolError, match="needs argument 'body'"):
        ops.check_args("send", {"topic": "t"}, "t")
    with pytest.raises(errors.ProtocolError, match="takes no argument 'extra'"):
        ops.check_args("ping", {"extra": 1}, "t")
    with pytest.raises(errors.ProtocolError, match="'queue_id' is a int"):
        ops.check_args("queue_range", {"topic": "t", "queue_id": -1}, "t")
    with pytest.raises(errors.ProtocolError, match="'offset' is a bool"):
        ops.check_args("pull", {"topic": "t", "queue_id": 0, "offset": True}, "t")


_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=False), st.text(max_size=3),
    st.binary(max_size=3), st.lists(st.integers(), max_size=2), st.just({"a": "b"}),
)  # fmt: skip


_GOOD = {
    str: "t",
    bytes: b"b",
    list: [],
    dict: {},
    float: 1.5,
    int: 7,
    ops.UINT: 3,
    ops.NIL: None,
    bool: True,
}


@settings(max_examples=400)
@given(data=st.data(), op=st.sampled_from(sorted(ops.OPS)))
def test_check_args_fast_path_agrees_with_the_spec(data: st.DataObject, op: str) -> None:
    # a valid request, then one argument set to anything (or one extra or one missing)
    args: dict[str, object] = {n: _GOOD[t[0]] for n, (t, _) in ops.OPS[op].items()}
    name = data.draw(st.sampled_from([*args, "bogus"]))
    if data.draw(st.booleans()):
        args.pop(name, None)
    else:
        args[name] = data.draw(_VALUES)
    spec = ops.OPS[op]
    expected_ok = all(
        name in spec and ops._is(value, spec[name][0]) for name, value in args.items()
    ) and all(name in args for name, (_, required) in spec.items() if required)
    try:
        ops.check_args(op, args, "t")
    except errors.ProtocolError:
        assert not expected_ok
    else:
        assert expected_ok


def test_a_welcome_keeps_a_zero_properties_size_and_drops_a_zero_count() -> None:
    # review3 R7: a store taking no properties (max_properties_size=0) announced 0, the
    # client dropped it, and the Spark sink checked rows against 1 MiB instead
    from equeue.protocol.handshake import Welcome

    base = {"max_frame_bytes": 1 << 20, "max_in_flight": 8, "max_connections": 4}
    limits = {**base, "max_properties_size": 0, "max_message_size": 1000, "max_pull_count": 0}
    welcome = Welcome.unpack({"version": 1, "server": "x", "limits": limits}, "test")
    assert welcome.limits["max_properties_size"] == 0
    assert welcome.limits["max_message_size"] == 1000
    assert "max_pull_count" not in welcome.limits  # a count of 0 means nothing: dropped


def test_an_op_newer_than_the_welcome_is_refused_by_the_client_before_sending() -> None:
    from equeue.client.core import RequestEncoder

    older = RequestEncoder(1 << 20, "unix:/x/broker.sock", version=4)
    with pytest.raises(errors.BrokerTooOldError, match=r"version 4; deleted_topics is of version"):
        older.frame(1, "deleted_topics", {})
    assert older.frame(2, "topics", {})  # the ops version 4 has still go
    current = RequestEncoder(1 << 20, "unix:/x/broker.sock", version=5)
    assert current.frame(3, "deleted_topics", {})
