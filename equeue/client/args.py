"""The clients' arguments as the wire carries them, checked before anything is sent.

A value the wire cannot carry as its op declares (equeue/protocol/ops.py) would make the
broker close the connection (a ProtocolError for every request on it), so it is refused
here, with the class ``MessageStore`` raises for it: InvalidTypeError for a wrong type
(bool is not an int), and for a value of the right type that no store accepts (a
negative offset or queue id) the store's error for it. Values of the right type are
otherwise checked by the broker's store, so limits and names give the store's errors.
"""

from __future__ import annotations

import datetime as dt
import math
import re
from functools import lru_cache
from typing import Any, TypeGuard

from equeue.errors import (
    InvalidMessageError,
    InvalidTypeError,
    MessageNotFoundError,
    QueueNotFoundError,
)
from equeue.store.types import OutgoingMessage
from equeue.store.validate import MAX_WAIT, check_queue_count

_INT32 = 1 << 31
_UINT64 = 1 << 64
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


def is_int(value: object) -> TypeGuard[int]:
    return type(value) is int or (isinstance(value, int) and not isinstance(value, bool))


# The store's rule for a topic name (equeue/store/validate.py, and the format's u8 name
# length), checked here first as the store does: a bad name is the error a call reports
# before any other argument's. tests/test_client_url.py holds the two to the same verdicts.
MAX_NAME_BYTES = 255
_TOPIC_RE = re.compile(r"[A-Za-z0-9._-]+\Z")


def topic(value: object) -> str:
    if type(value) is not str:
        if not isinstance(value, str):
            raise InvalidTypeError(f"topic must be a str, got {type(value).__name__}")
        value = str(value)
    return _topic(value)


@lru_cache(maxsize=1024)
def _topic(value: str) -> str:
    if not value:
        raise InvalidMessageError("topic must not be empty")
    try:
        size = len(value.encode())
    except UnicodeEncodeError as exc:
        raise InvalidMessageError(f"topic is not encodable as UTF-8: {exc.reason}") from None
    if size > MAX_NAME_BYTES:
        raise InvalidMessageError(
            f"topic {value[:40]!r}... is {size} bytes; the limit is {MAX_NAME_BYTES}"
        )
    if value in (".", ".."):
        raise InvalidMessageError(f"topic {value!r} is not allowed: it names a directory")
    if not _TOPIC_RE.match(value):
        raise InvalidMessageError(f"topic {value!r} has characters outside [A-Za-z0-9._-]")
    return value


def name(what: str, value: object) -> str:
    if not isinstance(value, str):
        raise InvalidTypeError(f"{what} must be a str, got {type(value).__name__}")
    return str(value)


def queue_id(value: object, where: str) -> int:
    if not is_int(value):
        raise InvalidTypeError(f"queue_id must be an int, got {type(value).__name__}")
    number = int(value)
    if not 0 <= number < _UINT64:
        raise QueueNotFoundError(f"queue_id {number} is out of range for topic {where!r}")
    return number


def offset(value: object, what: str = "offset") -> int:
    if not is_int(value) or value < 0:
        raise InvalidMessageError(f"{what} must be an int >= 0, got {value!r}")
    if value >= _UINT64:  # the store refuses it as past the queue's end (check_commit)
        raise InvalidMessageError(
            f"{what} {value} is past the queue's end (past 2**64 - 1, the wire's uint64)"
        )
    return int(value)


def pull_offset(value: object) -> int:
    """A pull's offset: any int >= 0, as the store's pull takes it. Past 2**64 - 1 (the
    wire's uint64) it is sent as 2**64 - 1: past every queue's end either way, so the
    answer is the store's (empty, next_offset = the end)."""
    if not is_int(value) or value < 0:
        raise InvalidMessageError(f"offset must be an int >= 0, got {value!r}")
    return min(int(value), _UINT64 - 1)


def positive(what: str, value: object) -> int:
    """max_count, max_bytes: the store refuses a non-int and < 1 alike."""
    if not is_int(value) or not 1 <= value < _UINT64:
        raise InvalidMessageError(f"{what} must be an int >= 1, got {value!r}")
    return int(value)


def message(
    body: object, tag: object, key: object, properties: object, code: object, qid: object,
    where: str,
) -> dict[str, Any]:  # fmt: skip
    """One send's fields (the store's order of checks), without those at their defaults."""
    if type(body) is not bytes:
        if not isinstance(body, bytes | bytearray | memoryview):
            raise InvalidTypeError(f"body must be bytes-like, got {type(body).__name__}")
        body = bytes(body)
    fields: dict[str, Any] = {"body": body}
    if tag != "":
        fields["tag"] = name("tag", tag)
    if key is not None:
        if not isinstance(key, str):
            raise InvalidTypeError(f"key must be a str or None, got {type(key).__name__}")
        fields["key"] = str(key)
    if properties is not None:
        fields["properties"] = _properties(properties)
    if code != 0 or type(code) is not int:
        if not is_int(code):
            raise InvalidTypeError(f"code must be an int, got {type(code).__name__}")
        if not -_INT32 <= code < _INT32:
            raise InvalidMessageError(f"code {code} is outside the 32-bit signed range")
        fields["code"] = int(code)
    if qid is not None:
        fields["queue_id"] = queue_id(qid, where)
    return fields


def _properties(value: object) -> dict[str, str]:
    if not isinstance(value, dict):
        raise InvalidTypeError(f"properties must be a dict[str, str], got {type(value).__name__}")
    for k, v in value.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise InvalidTypeError(
                f"properties must map str to str; got {type(k).__name__} -> {type(v).__name__}"
            )
    return {str(k): str(v) for k, v in value.items()}


def batch_items(messages: object) -> list[object]:
    """send_batch's messages as a list (an iterable's items taken once)."""
    if isinstance(messages, str | bytes | bytearray | memoryview | dict):
        raise InvalidTypeError(
            f"send_batch takes an iterable of messages, got {type(messages).__name__}"
        )
    try:
        return list(messages)  # type: ignore[call-overload,no-any-return]
    except TypeError:
        raise InvalidTypeError(
            f"send_batch takes an iterable of messages, got {type(messages).__name__}"
        ) from None


def outgoing(item: object, where: str) -> dict[str, Any]:
    """A send_batch item (bytes, OutgoingMessage or dict) as its wire map."""
    if isinstance(item, bytes | bytearray | memoryview):
        return {"body": bytes(item)}
    if not isinstance(item, OutgoingMessage):
        if not isinstance(item, dict):
            raise InvalidTypeError(
                f"send_batch takes bytes, OutgoingMessage or dict items, got {type(item).__name__}"
            )
        try:
            item = OutgoingMessage(**item)
        except TypeError as exc:
            raise InvalidTypeError(
                f"a send_batch dict item must have the fields of OutgoingMessage "
                f"({', '.join(OutgoingMessage._fields)}; body required): {exc}"
            ) from None
    return message(*item, where)


def tags(value: object) -> str | list[str] | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bytes | bytearray | memoryview | dict) or not hasattr(value, "__iter__"):
        raise InvalidTypeError(
            f"tags must be None, a str or an iterable of str, got {type(value).__name__}"
        )
    result = list(value)
    for tag in result:
        if not isinstance(tag, str):
            raise InvalidTypeError(f"tags must be str values, got {type(tag).__name__}")
    return result


def wait_ms(wait: object) -> int:
    """pull's wait, seconds → whole milliseconds (rounded up: a wait > 0 stays one)."""
    if not isinstance(wait, int | float) or isinstance(wait, bool):
        raise InvalidTypeError(f"wait must be an int or a float, got {type(wait).__name__}")
    # the broker's bound (the store's): a longer wait was sent and refused by the broker
    if not math.isfinite(wait) or not 0 <= wait <= MAX_WAIT:
        raise InvalidMessageError(
            f"pull wait={wait!r} seconds must lie in [0, {MAX_WAIT:g}] (one day: a longer "
            "wait is a loop of pulls)"
        )
    return math.ceil(wait * 1000)


def limit(value: object) -> int:
    if not is_int(value):
        raise InvalidTypeError(f"limit must be an int, got {type(value).__name__}")
    if not 1 <= value <= _INT32 - 1:
        raise InvalidMessageError(
            f"limit={value} is out of range; it must lie in [1, {_INT32 - 1}]"
        )
    return int(value)


def timestamp(value: object) -> float | int:
    """offset_for_time's time: seconds since the epoch, or an aware datetime (sent as its
    seconds; the store compares a datetime at microseconds, a number as a float)."""
    if isinstance(value, dt.datetime):
        if value.tzinfo is None or value.utcoffset() is None:
            raise InvalidMessageError(
                f"time {value.isoformat()} has no time zone; give an aware datetime "
                "(datetime.now(UTC), dt.replace(tzinfo=...)) or seconds since the epoch"
            )
        return (value - _EPOCH) / dt.timedelta(seconds=1)
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise InvalidTypeError(
            f"timestamp must be seconds since the epoch (int or float) or an aware datetime, "
            f"got {type(value).__name__}"
        )
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidMessageError(f"timestamp must be a finite number, got {value!r}")
    if isinstance(value, int) and not -(1 << 63) <= value < (1 << 63):
        return float(value)  # (the store reads it as seconds either way)
    return value if type(value) in (int, float) else float(value)


def group(value: object) -> str:
    """commit_offset's group: the store refuses a non-str group as InvalidMessageError."""
    if not isinstance(value, str):
        raise InvalidMessageError(f"group must be a non-empty str of at most 255 bytes: {value!r}")
    return str(value)


def queue_count(value: object, topic: str) -> int | None:
    """create_topic's queue_count: None (the broker's default), else the store's own check,
    so that the client refuses what the store refuses, in its words."""
    return None if value is None else int(check_queue_count(value, topic))


def message_id(value: object) -> str:
    if not isinstance(value, str):
        raise MessageNotFoundError(f"{value!r} is not a message id of this store")
    return str(value)
