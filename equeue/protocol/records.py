"""What the store's results look like on the wire: Message, SendResult, PullResult.

Message, an array of 12 in the order of ``equeue.Message``::

    index field         type
    0     message_id    str (24 hex digits)
    1     topic         str
    2     queue_id      uint
    3     queue_offset  uint
    4     position      uint
    5     tag           str
    6     key           str | nil
    7     properties    map str -> str
    8     code          int
    9     body          bin
    10    created_ns    int (ns since the epoch)
    11    stored_ns     int (ns since the epoch)

SendResult, an array of 6: message_id, topic, queue_id, queue_offset, position,
stored_at (float64 seconds since the epoch).

PullResult, an array of 2: [messages (array of Message), next_offset (uint)].

The answer to send_bodies (protocol version 2), the SendResults of one topic in columns,
an array of 6: [topic (str), message_ids (array of str), queue_ids, queue_offsets,
positions (arrays of uint), stored_at (array of float64)], the five arrays of one
length, the messages' order. Half the bytes of an array of SendResult arrays to pack
and decode, and no per-message array.
"""

from __future__ import annotations

import io
from itertools import repeat
from typing import Any, Final

import msgpack

from equeue import speedups
from equeue.errors import ProtocolError
from equeue.store.types import Message, PullResult, SendColumns, SendResult

MESSAGE_FIELDS: Final = len(Message._fields)
assert MESSAGE_FIELDS == 12
SEND_RESULT_FIELDS: Final = len(SendResult._fields)
assert SEND_RESULT_FIELDS == 6

_OPTIONAL_STR: Final = (str, type(None))
_MESSAGE_TYPES: Final = (str, str, int, int, int, str, _OPTIONAL_STR, dict, int, bytes, int, int)
_SEND_RESULT_TYPES: Final = (str, str, int, int, int, float)
# A Message's field types exactly, with a key and without: one tuple comparison for the
# common case (a pull answers many), the field-by-field check only for what differs.
_MESSAGE_EXACT: Final = frozenset(
    (str, str, int, int, int, str, key, dict, int, bytes, int, int) for key in (str, type(None))
)


def pack_message(message: Message) -> list[Any]:
    return list(message)


def unpack_message(value: object, where: str) -> Message:
    if type(value) is list and tuple(map(type, value)) in _MESSAGE_EXACT and not value[7]:
        return Message._make(value)  # no properties: nothing more to check
    fields = _checked(value, _MESSAGE_TYPES, "Message", where)
    properties = fields[7]
    if not all(type(k) is str and type(v) is str for k, v in properties.items()):
        raise ProtocolError(f"{where}: a Message's properties must map strings to strings")
    return Message._make(fields)


def pack_send_result(result: SendResult) -> list[Any]:
    return list(result)


def unpack_send_result(value: object, where: str) -> SendResult:
    return SendResult._make(_checked(value, _SEND_RESULT_TYPES, "SendResult", where))


def pack_columns(columns: SendColumns, packer: msgpack.Packer) -> bytes:
    """The send_bodies answer, msgpack-encoded: in C (the same bytes msgpack writes)
    when the accelerator is built and the values are of the answer's types."""
    fast = speedups.SPEEDUPS
    packed = fast.pack_columns(columns) if fast is not None else None
    if packed is None:
        packed = packer.pack(list(columns))
    return packed  # type: ignore[no-any-return]


def packed_fields(sent: SendResult) -> list[bytes]:
    """One result's column values, each msgpack-encoded (the items of packed columns)."""
    return [msgpack.packb(v) for v in (sent[0], *sent[2:])]


def packed_answer(topic: str, count: int, columns: list[bytearray]) -> bytes:
    """The send_bodies answer around five columns of ``count`` packed items each:
    what pack_columns gives for the same results (in C when built: one allocation)."""
    fast = speedups.SPEEDUPS
    packed = fast.packed_answer(topic, count, columns) if fast is not None else None
    if packed is not None:
        return packed  # type: ignore[no-any-return]
    head = (
        bytes([0x90 | count])
        if count <= 15
        else b"\xdc" + count.to_bytes(2, "big")
        if count <= 0xFFFF
        else b"\xdd" + count.to_bytes(4, "big")
    )
    parts = [b"\x96", msgpack.packb(topic)]
    for column in columns:  # (joined as they are: one copy of each)
        parts += (head, column)
    return b"".join(parts)


def unpack_packed(topic: str, columns: list[bytearray]) -> list[SendResult]:
    """The results in packed columns (a failed batch's ``sent``)."""
    values = [list(msgpack.Unpacker(io.BytesIO(bytes(c)))) for c in columns]
    return list(map(SendResult, values[0], repeat(topic), *values[1:]))


def pack_send_columns(topic: str, results: list[SendResult]) -> list[Any]:
    return list(SendColumns.of(topic, results))


def all_bytes(items: list[Any]) -> bool:
    """Whether a batch is bodies alone (sent as send_bodies): a C loop when built."""
    fast = speedups.SPEEDUPS
    if fast is not None:
        return bool(fast.all_bytes(items))
    return bool(items) and set(map(type, items)) == {bytes}


def bodies_request(
    request_id: int, topic: str, bodies: list[bytes], max_frame_bytes: int
) -> bytes | int | None:
    """The whole frame of a send_bodies request (its length header, then the msgpack
    Packer(use_bin_type=True) writes), written in C; the body's size when over
    max_frame_bytes (or 2**32-1), nothing allocated (the caller refuses it); None (pack it
    with msgpack) when the topic is not a str encodable as UTF-8 or a body not bytes, or
    no accelerator."""
    fast = speedups.SPEEDUPS
    if fast is None:
        return None
    frame: bytes | int | None = fast.bodies_request(request_id, topic, bodies, max_frame_bytes)
    return frame


def columns_answer(payload: bytes | memoryview, request_ids: set[int]) -> Any:
    """A frame body answering one of ``request_ids`` (send_bodies) with its columns, read
    in C into ``[request id, 0, (SendResults,)]``; None (decode it with msgpack) when it
    is not exactly that answer's form or the accelerator is not built."""
    fast = speedups.SPEEDUPS
    return None if fast is None else fast.columns_answer(payload, request_ids)


def unpack_send_columns(value: object, where: str) -> list[SendResult]:
    fast = speedups.SPEEDUPS
    if fast is not None:  # checked and built in C; None: the checks below say what is wrong
        results = fast.results_of_columns(value, SendResult)
        if results is not None:
            return results  # type: ignore[no-any-return]
    if type(value) is not list or len(value) != 6 or type(value[0]) is not str:
        raise ProtocolError(f"{where}: a send_bodies answer must be [topic, 5 arrays]")
    topic, ids, queue_ids, offsets, positions, stored = value
    columns = (ids, queue_ids, offsets, positions, stored)
    if not all(type(column) is list and len(column) == len(ids) for column in columns):
        raise ProtocolError(f"{where}: a send_bodies answer's arrays must be of one length")
    # set(map(type, ...)): a column checked at C speed (a bool is not an int on the wire)
    if not set(map(type, ids)) <= {str} or not set(map(type, stored)) <= {float}:
        raise ProtocolError(f"{where}: send_bodies message ids must be str, stored_at float")
    for column in (queue_ids, offsets, positions):
        if not set(map(type, column)) <= {int} or (column and min(column) < 0):
            raise ProtocolError(f"{where}: send_bodies queue ids, offsets, positions: uints")
    return list(map(SendResult, ids, repeat(topic), queue_ids, offsets, positions, stored))


def pack_pull_result(result: PullResult) -> list[Any]:
    return [[list(m) for m in result.messages], result.next_offset]


def unpack_pull_result(value: object, where: str) -> PullResult:
    if type(value) is not list or len(value) != 2 or type(value[0]) is not list:
        raise ProtocolError(f"{where}: a PullResult must be [messages, next_offset]")
    if type(value[1]) is not int or value[1] < 0:
        raise ProtocolError(f"{where}: a PullResult's next_offset must be a uint")
    return PullResult([unpack_message(m, where) for m in value[0]], value[1])


def unpack_messages(value: object, where: str) -> list[Message]:
    if type(value) is not list:
        raise ProtocolError(f"{where}: expected an array of Message")
    return [unpack_message(m, where) for m in value]


def _checked(
    value: object, types: tuple[type | tuple[type, ...], ...], what: str, where: str
) -> list[Any]:
    if type(value) is not list or len(value) != len(types):
        raise ProtocolError(f"{where}: a {what} must be an array of {len(types)}")
    for index, (item, wanted) in enumerate(zip(value, types, strict=True)):
        # type() is not isinstance(): a bool is not an int on the wire
        if type(item) is not wanted and not (isinstance(wanted, tuple) and type(item) in wanted):
            raise ProtocolError(
                f"{where}: field {index} of a {what} is a {type(item).__name__}, "
                f"expected {_name(wanted)}"
            )
    return value


def _name(wanted: type | tuple[type, ...]) -> str:
    if isinstance(wanted, tuple):
        return " or ".join(t.__name__ for t in wanted)
    return wanted.__name__
