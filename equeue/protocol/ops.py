"""Every request the broker answers: its op name, its arguments and their wire types.

``check_args`` holds a request to this table before the broker acts on it: an unknown
op, a missing required argument, an argument the op does not take, or one of another
msgpack type is a ProtocolError (the connection closes: its peer is not speaking the
protocol). Values of the right type are checked by the store like any API call (a bad
topic name is an InvalidMessageError answer; the connection stays).

The result of each op is in docs/protocol.md.
"""

from __future__ import annotations

from typing import Any, Final

from equeue.errors import ProtocolError
from equeue.protocol.frames import (
    BODIES_VERSION,
    CANCEL_PULL_VERSION,
    COLUMNS_VERSION,
    DELETED_TOPICS_VERSION,
    GROUP_DELETE_VERSION,
    KEY_PAGES_VERSION,
)

NIL: Final = type(None)
UINT: Final = "uint"  # an int >= 0 (msgpack has no separate unsigned type in Python)

# op -> {argument: (wire types, required)}
Spec = dict[str, tuple[tuple[object, ...], bool]]

_MESSAGE_ARGS: Final[Spec] = {
    "body": ((bytes,), True),
    "tag": ((str,), False),
    "key": ((str, NIL), False),
    "properties": ((dict, NIL), False),
    "code": ((int,), False),
    "queue_id": ((UINT, NIL), False),
}
_QUEUE: Final[Spec] = {"topic": ((str,), True), "queue_id": ((UINT,), True)}
_MEMBER: Final[Spec] = {"group": ((str,), True), "consumer": ((str,), True)}
# join's answer: carried by a member's later requests (docs/groups.md, "one member per
# consumer id"); a client sends it only to a broker that answered one
_JOIN_ID: Final[Spec] = {"join_id": ((UINT,), False)}
_PULL: Final[Spec] = {
    **_QUEUE,
    "offset": ((UINT,), True),
    "max_count": ((UINT,), False),
    "tags": ((str, list, NIL), False),
    "wait_ms": ((UINT,), False),
    "max_bytes": ((UINT, NIL), False),
    # a pull on behalf of a group member: refused unless it owns the queue
    "group": ((str,), False),
    "consumer": ((str,), False),
    **_JOIN_ID,
}

OPS: Final[dict[str, Spec]] = {
    "ping": {},
    "send": {"topic": ((str,), True), **_MESSAGE_ARGS},
    "send_batch": {"topic": ((str,), True), "messages": ((list,), True)},
    # protocol version 2: bodies alone (an array of bin), answered in columns (records.py)
    "send_bodies": {"topic": ((str,), True), "bodies": ((list,), True)},
    "pull": _PULL,
    # protocol version 3: the same pull, answered in columns (pullcols.py)
    "pull_columns": _PULL,
    "get": {"message_id": ((str,), True)},
    "query_by_key": {"topic": ((str,), True), "key": ((str,), True), "limit": ((UINT,), False)},
    # protocol version 4: the same, from below a log position, answered [messages, next]
    "query_by_key_page": {
        "topic": ((str,), True),
        "key": ((str,), True),
        "limit": ((UINT,), False),
        "before": ((UINT, NIL), False),
    },
    "offset_for_time": {**_QUEUE, "timestamp": ((float, int), True)},
    "commit_offset": {
        **_QUEUE,
        "group": ((str,), True),
        "offset": ((UINT,), True),
        "consumer": ((str,), False),
        **_JOIN_ID,
    },
    "committed_offset": {**_QUEUE, "group": ((str,), True)},
    "create_topic": {"topic": ((str,), True), "queue_count": ((UINT, NIL), False)},
    "topics": {},
    # protocol version 5: topic -> the log position of its last deletion
    "deleted_topics": {},
    "queue_ids": {"topic": ((str,), True)},
    "queue_range": _QUEUE,
    # protocol version 5: "group", that group's per-queue detail (docs/protocol.md, "stats")
    "stats": {"group": ((str,), False)},
    # consumer groups (equeue/server/groups.py)
    "join": {
        **_MEMBER,
        "topics": ((list,), True),
        "session_timeout_ms": ((UINT,), False),
        "max_retries": ((UINT,), False),
    },
    # generation: that of the last assignment the member applied (releases revoked queues)
    "heartbeat": {**_MEMBER, "generation": ((UINT,), False), **_JOIN_ID},
    "leave": {**_MEMBER, **_JOIN_ID},
    "nack": {
        **_MEMBER,
        **_JOIN_ID,
        "message_id": ((str,), True),
        "delay_ms": ((UINT, NIL), False),
    },
    # protocol version 5: a group with no live member deleted (equeue/server/groupdelete.py)
    "delete_group": {"group": ((str,), True), "delete_dead_letters": ((bool,), False)},
    # protocol version 6: the held pull of this connection with that request id answered
    # empty now (holds.py cancel); not held to max_in_flight (it holds nothing)
    "cancel_pull": {"request_id": ((UINT,), True)},
}


# The ops a protocol version added: a connection welcomed with an older version may not
# send them (docs/protocol.md); every other op is version 1's.
OP_VERSIONS: Final[dict[str, int]] = {
    "send_bodies": BODIES_VERSION,
    "pull_columns": COLUMNS_VERSION,
    "query_by_key_page": KEY_PAGES_VERSION,
    "deleted_topics": DELETED_TOPICS_VERSION,
    "delete_group": GROUP_DELETE_VERSION,
    "cancel_pull": CANCEL_PULL_VERSION,
}


def ops_above(version: int) -> frozenset[str]:
    """The ops a connection welcomed with ``version`` may not send."""
    return frozenset(op for op, added in OP_VERSIONS.items() if added > version)


def refuse_above(op: str, version: int, where: str) -> None:
    raise ProtocolError(
        f"{where}: op {op!r} is of protocol version {OP_VERSIONS[op]}; this connection was "
        f"welcomed with version {version} (offer {OP_VERSIONS[op]} in the hello to use it)"
    )


def check_args(op: str, args: dict[str, Any], where: str) -> Spec:
    # Every request passes here (~0.2 us): set lookups on tables compiled below; the
    # slow loop only builds the message of a refusal.
    compiled = _COMPILED.get(op)
    if compiled is None:
        # its length, not the string: a client that put its token there gets no echo
        raise ProtocolError(f"{where}: unknown op (a string of {len(op)} characters)")
    accepted, uints, required = compiled
    for name, value in args.items():
        kinds = accepted.get(name)
        kind = type(value)
        if kinds is None or kind not in kinds or (kind is int and value < 0 and name in uints):
            _refuse(op, args, where)
    if not required <= args.keys():
        _refuse(op, args, where)
    return OPS[op]


def _refuse(op: str, args: dict[str, Any], where: str) -> None:
    spec = OPS[op]
    for name, value in args.items():
        wanted = spec.get(name)
        if wanted is None:
            raise ProtocolError(f"{where}: op {op!r} takes no argument {str(name)[:64]!r}")
        if not _is(value, wanted[0]):
            raise ProtocolError(
                f"{where}: op {op!r} argument {name!r} is a {type(value).__name__}, "
                f"expected {' or '.join(_type_name(t) for t in wanted[0])}"
            )
    for name, (_, required) in spec.items():
        if required and name not in args:
            raise ProtocolError(f"{where}: op {op!r} needs argument {name!r}")


def _compile(spec: Spec) -> tuple[dict[str, frozenset[object]], frozenset[str], frozenset[str]]:
    accepted = {
        name: frozenset(int if t == UINT else t for t in types) for name, (types, _) in spec.items()
    }
    # UINT is the only int an argument takes where it takes one at all ("code" is int)
    uints = frozenset(name for name, (types, _) in spec.items() if UINT in types)
    required = frozenset(name for name, (_, needed) in spec.items() if needed)
    return accepted, uints, required


_COMPILED: Final = {op: _compile(spec) for op, spec in OPS.items()}


def _is(value: object, types: tuple[object, ...]) -> bool:
    kind = type(value)  # not isinstance: a bool is not an int on the wire
    for wanted in types:
        if wanted == UINT:
            if kind is int and value >= 0:  # type: ignore[operator]
                return True
        elif kind is wanted:
            return True
    return False


def _type_name(wanted: object) -> str:
    if wanted == UINT:
        return "uint"
    if wanted is NIL:
        return "nil"
    return getattr(wanted, "__name__", str(wanted))
