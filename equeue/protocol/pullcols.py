"""A pull's answer in columns (protocol version 3, the op ``pull_columns``): one msgpack
array per field instead of one array per message, so that neither side makes or reads
12 objects a message. An array of 14::

    index  field          type
    0      next_offset    uint
    1      topic          str      every message's topic
    2      queue_id       uint     every message's queue id
    3      id_prefix      str      a message's id is id_prefix + its position in 16 hex digits
    4      message_ids    nil | array of str   (nil: every id is of id_prefix, as above)
    5      queue_offsets  array of uint        N items, one a message, in order
    6      positions      array of uint        N
    7      created_ns     array of int         N
    8      stored_ns      array of int         N
    9      bodies         array of bin         N
    10     tags           str | array of str   (a str: every message's tag)
    11     keys           nil | array of (str | nil)   (nil: no message has a key)
    12     codes          int | array of int   (an int: every message's code)
    13     properties     nil | array of [index, map str -> str], index ascending, only
                          the messages that have properties (nil: none has)

The broker packs it in C from the store's Messages without making their fields
(equeue/cext/pullcols.c) and the client turns it into Messages in one C call; this
module is the same in Python: the fallback where the accelerator is not loaded, and the
checker that says what is wrong with a hostile answer (ProtocolError).
"""

from __future__ import annotations

from typing import Any, Final

import msgpack

from equeue import speedups
from equeue.errors import ProtocolError
from equeue.protocol.records import unpack_pull_result
from equeue.store.types import Message, PullResult

COLUMNS: Final = 14
# What a message adds to the answer at most, counted as the C packer counts it
# (equeue/cext/pullcols.c, read_row and pack_pull_columns) so that both cut an answer at
# the same message (tests/test_pull_columns.py compares them): ROW_BOUND for its four
# ints, its code and the heads of its body and tag; a key's head (KEY_HEAD) or nil (1);
# with properties, PROPS_BOUND for the [index, map] item and ENTRY_BOUND an entry.
ROW_BOUND: Final = 4 * 9 + 9 + 5 + 5
KEY_HEAD: Final = 5
PROPS_BOUND: Final = 1 + 9 + 5
ENTRY_BOUND: Final = 5 + 5
# The answer's own, topic and id prefix aside, as the C packer counts it: the array head,
# next_offset, the heads of topic and prefix, queue_id, nil ids, 8 column heads, and 5.
HEAD_BOUND: Final = 1 + 9 + 5 + 9 + 5 + 1 + 8 * 5 + 5
# Only Python packs an ids column (C leaves such answers to it): its head, and each
# message's id in it then counts 5 + its bytes.
IDS_HEAD: Final = 5


def pack(
    result: PullResult, topic: str, queue_id: int, id_prefix: str, room: int
) -> tuple[bytes | None, int]:
    """The answer's msgpack bytes holding the most of ``result``'s messages that fit in
    ``room`` bytes, and how many that is ((None, 0): not even the first fits); cut
    short, its next_offset is the first message left out."""
    fast = speedups.SPEEDUPS
    messages = result.messages
    if fast is not None and type(messages) is list:
        packed: tuple[bytes | None, int] | None = fast.pack_pull_columns(
            messages, result.next_offset, topic, queue_id, id_prefix, room
        )
        if packed is not None:
            return packed
    return _pack(list(messages), result.next_offset, topic, queue_id, id_prefix, room)


def _pack(
    messages: list[Message], next_offset: int, topic: str, queue_id: int, id_prefix: str,
    room: int,
) -> tuple[bytes | None, int]:  # fmt: skip
    total = HEAD_BOUND + len(topic.encode()) + len(id_prefix.encode())
    kept = 0
    # once one id is not of the prefix, an ids column holds every message's id
    own_ids, id_bytes = False, IDS_HEAD
    for message in messages:
        total += _bound(message)
        id_bytes += 5 + len(message.message_id.encode())
        own_ids = own_ids or message.message_id != _id(id_prefix, message.position)
        if total + (id_bytes if own_ids else 0) > room:
            break
        kept += 1
    if messages and not kept:
        return None, 0
    if kept < len(messages):
        next_offset = messages[kept].queue_offset
    rows = messages[:kept]
    ids = [m.message_id for m in rows]
    tags = [m.tag for m in rows]
    keys = [m.key for m in rows]
    codes = [m.code for m in rows]
    props = [[i, dict(m.properties)] for i, m in enumerate(rows) if m.properties]
    value = [
        next_offset, topic, queue_id, id_prefix,
        None if ids == [_id(id_prefix, m.position) for m in rows] else ids,
        [m.queue_offset for m in rows], [m.position for m in rows],
        [m.created_ns for m in rows], [m.stored_ns for m in rows], [m.body for m in rows],
        _once(tags, ""),
        keys if any(k is not None for k in keys) else None,
        _once(codes, 0),
        props or None,
    ]  # fmt: skip
    data: bytes = msgpack.packb(value, use_bin_type=True)
    return data, kept


def _once(column: list[Any], empty: object) -> object:
    """A column whose items are all one value as that value (``empty`` for none)."""
    if not column:
        return empty
    return column[0] if column.count(column[0]) == len(column) else column


def _bound(message: Message) -> int:
    size = ROW_BOUND + len(message.body) + len(message.tag.encode())
    size += 1 if message.key is None else KEY_HEAD + len(message.key.encode())
    if message.properties:
        size += PROPS_BOUND + sum(ENTRY_BOUND + len(k.encode()) + len(v.encode())
                                  for k, v in message.properties.items())  # fmt: skip
    return size


def _id(prefix: str, position: int) -> str:
    return f"{prefix}{position:016x}"


def pull_answer(payload: bytes | memoryview, request_ids: set[int]) -> Any:
    """A frame body answering one of ``request_ids`` (pull_columns) in the common form
    (no ids, keys or properties columns; one tag and code), read in C into ``[request id,
    0, (Messages, next_offset)]``; None (decode it with msgpack) for any other answer or
    where the accelerator is not built."""
    fast = speedups.SPEEDUPS
    return None if fast is None else fast.pull_answer(payload, request_ids)


def unpack_any(value: object, where: str) -> PullResult:
    """A pull_columns answer, or a pull's (an array of 2: what a broker before version 3
    answers, the client having sent ``pull`` to it instead); a tuple: read by
    pull_answer already."""
    if type(value) is tuple:
        return PullResult(*value)
    if type(value) is list and len(value) == 2:
        return unpack_pull_result(value, where)
    return unpack(value, where)


def unpack(value: object, where: str) -> PullResult:
    """The client's side: the decoded answer as a PullResult of Messages; ProtocolError
    naming ``where`` for any other shape, type or column length."""
    fast = speedups.SPEEDUPS
    if fast is not None:
        found = fast.unpack_pull_columns(value, Message)
        if found is not None:
            return PullResult(*found)
    return _unpack(value, where)


def _unpack(value: object, where: str) -> PullResult:
    if type(value) is not list or len(value) != COLUMNS:
        raise ProtocolError(f"{where}: a pull_columns answer must be an array of {COLUMNS}")
    (next_offset, topic, queue_id, prefix, ids, offsets, positions, created, stored, bodies,
     tags, keys, codes, props) = value  # fmt: skip
    if not (_uint(next_offset) and _uint(queue_id)):
        raise ProtocolError(f"{where}: a pull_columns answer's next_offset, queue_id: uints")
    if type(topic) is not str or type(prefix) is not str:
        raise ProtocolError(f"{where}: a pull_columns answer's topic and id_prefix: str")
    if type(offsets) is not list:
        raise ProtocolError(f"{where}: a pull_columns answer's queue_offsets: an array")
    n = len(offsets)
    _column(where, "positions", positions, n, _uint)
    _column(where, "queue_offsets", offsets, n, _uint)
    _column(where, "created_ns", created, n, _int)
    _column(where, "stored_ns", stored, n, _int)
    _column(where, "bodies", bodies, n, lambda v: type(v) is bytes)
    ids = _spread(where, "message_ids", ids, n, None, lambda v: type(v) is str, nil=True)
    tags = _spread(where, "tags", tags, n, tags, lambda v: type(v) is str, scalar=str)
    keys = _spread(where, "keys", keys, n, None, lambda v: v is None or type(v) is str, nil=True)
    codes = _spread(where, "codes", codes, n, codes, _int, scalar=int)
    found: list[dict[str, str]] = [{} for _ in range(n)]
    if props is not None:
        if type(props) is not list:
            raise ProtocolError(f"{where}: a pull_columns answer's properties: nil or an array")
        last = -1
        for pair in props:
            if (
                type(pair) is not list or len(pair) != 2 or not _uint(pair[0])
                or not last < pair[0] < n or type(pair[1]) is not dict
                or not all(type(k) is str and type(v) is str for k, v in pair[1].items())
            ):  # fmt: skip
                raise ProtocolError(
                    f"{where}: a pull_columns answer's properties must be [index, map str->str] "
                    f"pairs, index ascending and below {n}"
                )
            last = pair[0]
            found[last] = pair[1]
    messages = [
        Message(
            ids[i] if ids[i] is not None else _id(prefix, positions[i]),
            topic,
            queue_id,
            offsets[i],
            positions[i],
            tags[i],
            keys[i],
            found[i],
            codes[i],
            bodies[i],
            created[i],
            stored[i],
        )
        for i in range(n)
    ]
    return PullResult(messages, next_offset)


def _uint(value: object) -> bool:
    return type(value) is int and value >= 0


def _int(value: object) -> bool:
    return type(value) is int


def _column(where: str, name: str, column: object, n: int, ok: Any) -> None:
    if type(column) is not list or len(column) != n:
        raise ProtocolError(
            f"{where}: a pull_columns answer's {name} must be an array of {n} (as queue_offsets)"
        )
    if not all(map(ok, column)):
        raise ProtocolError(f"{where}: a pull_columns answer's {name} holds a wrong type")


def _spread(
    where: str, name: str, column: object, n: int, fill: object, ok: Any, *,
    nil: bool = False, scalar: type | None = None,
) -> list[Any]:  # fmt: skip
    """A column that may be given once for every message (nil, or a scalar) or per message."""
    if (nil and column is None) or (scalar is not None and type(column) is scalar):
        return [fill] * n
    _column(where, name, column, n, ok)
    assert isinstance(column, list)
    return column
