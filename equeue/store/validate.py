"""Checks of everything a caller passes in; each failure names the limit and its setting."""

from __future__ import annotations

import datetime as dt
import errno
import math
import os
import re
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from equeue.errors import (
    ConfigError,
    DiskFullError,
    InvalidMessageError,
    InvalidTypeError,
    MessageTooLargeError,
    NotAStoreError,
    QueueNotFoundError,
    StoreWriteError,
)
from equeue.format.chunk import FRAME_OVERHEAD
from equeue.format.message import (
    MAX_NAME_BYTES,
    MESSAGE_HEAD_SIZE,
    encode_properties,
    tag_hash,
)
from equeue.store.types import OutgoingMessage

# The largest offset a metadata file may hold for a queue (an int64, as the wire and the
# queue chunks' positions carry it): a file's larger offset was not written by equeue.
MAX_FILE_OFFSET = (1 << 63) - 1

if TYPE_CHECKING:
    from equeue.store.config import StoreConfig

# A send after its checks: body, tag bytes, tag hash, key bytes, key, properties
# bytes, code, queue id (None: by key, else round robin).
Checked = tuple[bytes, bytes, int, bytes, str | None, bytes, int, int | None]
_TOPIC_RE = re.compile(r"[A-Za-z0-9._-]+\Z")
_INT32 = 1 << 31


def utf8(value: str, what: str) -> bytes:
    try:
        return value.encode()
    except UnicodeEncodeError as exc:
        raise InvalidMessageError(f"{what} is not encodable as UTF-8: {exc.reason}") from None


def check_topic(topic: object) -> str:
    if not isinstance(topic, str):
        raise InvalidTypeError(f"topic must be a str, got {type(topic).__name__}")
    return _check_topic(topic)


@lru_cache(maxsize=1024)
def _check_topic(topic: str) -> str:
    if not topic:
        raise InvalidMessageError("topic must not be empty")
    size = len(utf8(topic, "topic"))
    if size > MAX_NAME_BYTES:
        raise InvalidMessageError(
            f"topic {topic[:40]!r}... is {size} bytes; the limit is {MAX_NAME_BYTES}"
        )
    if topic in (".", ".."):
        raise InvalidMessageError(f"topic {topic!r} is not allowed: it names a directory")
    if not _TOPIC_RE.match(topic):
        raise InvalidMessageError(f"topic {topic!r} has characters outside [A-Za-z0-9._-]")
    return topic


def check_tag(tag: object) -> tuple[bytes, int]:
    """(UTF-8 tag, tag hash)."""
    if not isinstance(tag, str):
        raise InvalidTypeError(f"tag must be a str, got {type(tag).__name__}")
    return _check_tag(tag)


@lru_cache(maxsize=4096)
def _check_tag(tag: str) -> tuple[bytes, int]:
    encoded = utf8(tag, "tag")
    if len(encoded) > MAX_NAME_BYTES:
        raise InvalidMessageError(
            f"tag is {len(encoded)} bytes UTF-8; the limit is {MAX_NAME_BYTES} bytes"
        )
    return encoded, tag_hash(tag)


def check_key(key: object) -> bytes:
    if not isinstance(key, str):
        raise InvalidTypeError(f"key must be a str or None, got {type(key).__name__}")
    encoded = utf8(key, "key")
    if len(encoded) > MAX_NAME_BYTES:
        raise InvalidMessageError(
            f"key is {len(encoded)} bytes UTF-8; the limit is {MAX_NAME_BYTES} bytes"
        )
    return encoded


def check_properties(properties: object, limit: int) -> bytes:
    if not isinstance(properties, dict):
        raise InvalidTypeError(
            f"properties must be a dict[str, str], got {type(properties).__name__}"
        )
    for k, v in properties.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise InvalidTypeError(
                f"properties must map str to str; got {type(k).__name__} -> {type(v).__name__}"
            )
        if len(utf8(k, "a properties key")) > 0xFFFF or len(utf8(v, "a properties value")) > 0xFFFF:
            raise MessageTooLargeError(f"property {k[:40]!r} is longer than 65535 bytes")
    encoded = encode_properties(properties)
    if len(encoded) > limit:
        raise MessageTooLargeError(
            f"properties encode to {len(encoded)} bytes; the limit is {limit} "
            "(StoreConfig.max_properties_size)"
        )
    return encoded


# what a refused body's error names as its limit (a broker that lowered the limit names
# its own setting instead: equeue/server/limitnote.py)
BODY_LIMIT_SETTING = "(StoreConfig.max_message_size)"


def check_body(body: object, limit: int) -> bytes:
    if type(body) is not bytes:
        if not isinstance(body, bytearray | memoryview):
            raise InvalidTypeError(f"body must be bytes-like, got {type(body).__name__}")
        body = bytes(body)
    if len(body) > limit:
        raise MessageTooLargeError(
            f"body is {len(body)} bytes; the limit is {limit} {BODY_LIMIT_SETTING}"
        )
    return body


def check_code(code: object) -> int:
    if not isinstance(code, int) or isinstance(code, bool):
        raise InvalidTypeError(f"code must be an int, got {type(code).__name__}")
    if not -_INT32 <= code < _INT32:
        raise InvalidMessageError(f"code {code} is outside the 32-bit signed range")
    return code


def check_queue_id(queue_id: object, topic: str, queue_count: int) -> int:
    if not isinstance(queue_id, int) or isinstance(queue_id, bool):
        raise InvalidTypeError(f"queue_id must be an int, got {type(queue_id).__name__}")
    if not 0 <= queue_id < queue_count:
        raise QueueNotFoundError(
            f"queue_id {queue_id} is out of range for topic {topic!r} with {queue_count} queues "
            f"(0..{queue_count - 1}); create_topic() can raise the queue count"
        )
    return queue_id


# A topic's most queues: the one bound that check_queue_count, default_queue_count and
# every reader of queue ids (queue directories, group files, deletion intents) use
# (review9 R9-6: four copies of it)
MAX_QUEUES = 1024


def check_queue_count(queue_count: object, topic: str | None = None) -> int:
    """The one check of a queue count: create_topic's (the store's, and the clients' before
    sending) and every file's that records one. ``topic``: named in the message."""
    if not isinstance(queue_count, int) or isinstance(queue_count, bool):
        raise InvalidTypeError(f"queue_count must be an int, got {type(queue_count).__name__}")
    if not 1 <= queue_count <= MAX_QUEUES:
        of = "" if topic is None else f" of topic {topic!r}"
        raise InvalidMessageError(
            f"queue_count {queue_count!r}{of} is out of range: it must lie in [1, {MAX_QUEUES}] "
            "(MAX_QUEUES in equeue/store/validate.py, a topic's most queues: a fixed bound, "
            "no setting raises it)"
        )
    return queue_count


def check_message(
    config: StoreConfig,
    topic: str,
    queue_count: int,
    body: object,
    tag: object,
    key: object,
    properties: object,
    code: object,
    queue_id: object,
) -> Checked:
    """Every field of a send, in order; the first bad one raises."""
    if type(body) is not bytes or len(body) > config.max_message_size:
        body = check_body(body, config.max_message_size)
    tag_bytes, hashed = check_tag(tag)
    key_bytes = b"" if key is None else check_key(key)
    props = b"" if properties is None else check_properties(properties, config.max_properties_size)
    if type(code) is not int:
        code = check_code(code)
    elif not -_INT32 <= code < _INT32:
        check_code(code)
    if queue_id is not None:
        check_queue_id(queue_id, topic, queue_count)
    # The longest topic counted: a message that fits fits whatever its topic.
    size = (
        MESSAGE_HEAD_SIZE + len(tag_bytes) + len(key_bytes) + len(props) + len(body)
        + MAX_NAME_BYTES
    )  # fmt: skip
    if size + FRAME_OVERHEAD > config.layout.chunk_data_size:
        raise InvalidMessageError(
            f"a message of about {size} bytes does not fit a chunk of chunk_data_size="
            f"{config.layout.chunk_data_size}; raise StoreConfig.chunk_data_size"
        )
    return (body, tag_bytes, hashed, key_bytes, key, props, code, queue_id)  # type: ignore[return-value]


# --- arguments of the other public methods -----------------------------------------------

# The longest retention or delete_retention: 100 years. total_seconds() of a longer
# timedelta is a float that does not convert back (timedelta.max overflows on reopen).
MAX_SPAN = dt.timedelta(days=36_500)
# apply_retention(now=...): stored times are int64 nanoseconds, so later times mean nothing.
_MAX_NOW = (1 << 63) / 1e9
MAX_WAIT = 86_400.0  # pull(wait=...): one day; a longer wait is a loop of pulls
# nack's delay_ms (the broker's; the clients' nack(delay=) in seconds): one day as well.
# A copy waits at most the broker's longest delay level (3600 s by default) whatever it asks.
MAX_DELAY_MS = 86_400_000


def check_span(name: str, value: object, *, allow_zero: bool = False) -> dt.timedelta:
    if not isinstance(value, dt.timedelta):
        raise ConfigError(f"{name} must be a datetime.timedelta, got {type(value).__name__}")
    low = "[0" if allow_zero else "(0"
    if (
        value < dt.timedelta(0)
        or (value == dt.timedelta(0) and not allow_zero)
        or (value > MAX_SPAN)
    ):
        raise ConfigError(
            f"{name}={value!r} is out of range; it must lie in {low}, {MAX_SPAN.days} days]"
            + ("" if allow_zero else " (or be None: keep messages forever)")
        )
    return value


def _number(name: str, value: object) -> int | float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise InvalidTypeError(f"{name} must be an int or a float, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidMessageError(f"{name} must be a finite number, got {value!r}")
    return value


def check_offset(offset: object) -> int:
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        raise InvalidMessageError(f"offset must be an int >= 0, got {offset!r}")
    return offset


def check_count(count: object) -> int:
    """How many entries a read of a queue asks for (queue_positions): 0 reads none."""
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise InvalidMessageError(f"count must be an int >= 0, got {count!r}")
    return count


def check_pull(offset: object, max_count: object, wait: object, max_bytes: object = None) -> None:
    check_offset(offset)
    if not isinstance(max_count, int) or isinstance(max_count, bool) or max_count < 1:
        raise InvalidMessageError(f"max_count must be an int >= 1, got {max_count!r}")
    if max_bytes is not None and (
        not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 1
    ):
        raise InvalidMessageError(f"max_bytes must be None or an int >= 1, got {max_bytes!r}")
    if (type(wait) is not float or not 0.0 <= wait <= MAX_WAIT) and not (
        0 <= _number("wait", wait) <= MAX_WAIT
    ):
        raise InvalidMessageError(f"wait={wait!r} seconds must lie in [0, {MAX_WAIT:g}]")


def check_group(group: object) -> None:
    """A group name as commit_offset and committed_offset take it."""
    if not isinstance(group, str) or not group or len(utf8(group, "group")) > MAX_NAME_BYTES:
        raise InvalidMessageError(f"group must be a non-empty str of at most 255 bytes: {group!r}")


def check_commit(group: object, offset: object, next_offset: int) -> None:
    check_group(group)
    check_offset(offset)
    if offset > next_offset:  # type: ignore[operator]
        raise InvalidMessageError(
            f"offset {offset} is past the queue's end: a committed offset lies in "
            f"[0, {next_offset}] (the queue's next offset)"
        )


def check_limit(limit: object) -> int:
    if not isinstance(limit, int) or isinstance(limit, bool):
        raise InvalidTypeError(f"limit must be an int, got {type(limit).__name__}")
    if not 1 <= limit <= _INT32 - 1:
        raise InvalidMessageError(
            f"limit={limit} is out of range; it must lie in [1, {_INT32 - 1}]"
        )
    return limit


def check_timestamp(timestamp: object) -> int | float:
    """Seconds since the epoch (a datetime is checked by equeue.store.times first)."""
    if not isinstance(timestamp, int | float) or isinstance(timestamp, bool):
        raise InvalidTypeError(
            f"timestamp must be seconds since the epoch (int or float) or an aware datetime, "
            f"got {type(timestamp).__name__}"
        )
    return _number("timestamp", timestamp)


def check_now(now: object) -> float | None:
    if now is not None and not 0 <= _number("now", now) <= _MAX_NOW:
        raise InvalidMessageError(
            f"now={now!r} is out of range; it must be None or seconds since the epoch in "
            f"[0, {_MAX_NOW:.0f}]"
        )
    return None if now is None else float(now)  # type: ignore[arg-type]


def check_messages(messages: object) -> list[object]:
    """send_batch's messages as a list (an iterable's items taken once)."""
    if isinstance(messages, str | bytes | bytearray | memoryview | dict):
        raise InvalidTypeError(
            f"send_batch takes an iterable of messages, got {type(messages).__name__}"
        )
    try:
        items = iter(messages)  # type: ignore[call-overload]
    except TypeError:
        raise InvalidTypeError(
            f"send_batch takes an iterable of messages, got {type(messages).__name__}"
        ) from None
    return list(items)


def check_open(path: object, config: object, read_only: object) -> Path:
    """The store directory MessageStore.open was given, refused unless it can be one."""
    from equeue.store.config import StoreConfig

    if not isinstance(path, str | os.PathLike):
        raise InvalidTypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    if config is not None and not isinstance(config, StoreConfig):
        raise InvalidTypeError(f"config must be a StoreConfig or None, got {type(config).__name__}")
    if not isinstance(read_only, bool):
        raise InvalidTypeError(f"read_only must be a bool, got {type(read_only).__name__}")
    try:
        name = os.fspath(path)
    except TypeError as exc:
        raise InvalidTypeError(f"path: {exc}") from None
    if isinstance(name, bytes):
        raise InvalidTypeError("path must be a str or os.PathLike of str, got bytes")
    if not name:
        raise NotAStoreError(
            "the store path is empty; it would name the working directory (pass '.' for that)"
        )
    if "\0" in name:
        raise NotAStoreError(f"the store path {name!r} holds a NUL character")
    try:
        os.fsencode(name)
    except UnicodeEncodeError as exc:
        raise NotAStoreError(f"the store path {name!r} is not encodable: {exc.reason}") from None
    # Absolute once, here: a program that changes its directory later (a daemon) must
    # not write half the store under the new one.
    result = Path(name).absolute()
    try:
        for at in (result, *result.parents):  # the nearest that exists must be a directory
            if at.exists() or at.is_symlink():
                if not at.is_dir():
                    raise NotAStoreError(
                        f"{name} is not an equeue store: {at} is not a directory"
                        if at != result
                        else f"{name} is not an equeue store: it is not a directory"
                    )
                break
    except OSError as exc:  # e.g. a name too long, no permission to look
        if isinstance(exc, NotAStoreError):
            raise
        raise NotAStoreError(f"{name} cannot be a store directory: {exc}") from None
    return result


def make_store_dir(path: Path) -> None:
    """Create a writable open's directory; failing, a StoreWriteError (DiskFullError)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        error = DiskFullError if exc.errno in (errno.ENOSPC, errno.EDQUOT) else StoreWriteError
        raise error(exc.errno, f"cannot create the store directory {path}: {exc}") from None


def check_names(group: object, topic: object, queue_id: object) -> None:
    """committed_offset's lookup keys: of the types commit_offset stores."""
    for name, value, kind in (
        ("group", group, str),
        ("topic", topic, str),
        ("queue_id", queue_id, int),
    ):
        if not isinstance(value, kind) or isinstance(value, bool):
            raise InvalidTypeError(f"{name} must be a {kind.__name__}, got {type(value).__name__}")


def outgoing(message: object) -> OutgoingMessage:
    """A send_batch item as an OutgoingMessage (its fields are checked by check_message)."""
    if isinstance(message, OutgoingMessage):
        return message
    if isinstance(message, bytes | bytearray | memoryview):
        return OutgoingMessage(bytes(message))
    if not isinstance(message, dict):
        raise InvalidTypeError(
            f"send_batch takes bytes, OutgoingMessage or dict items, got {type(message).__name__}"
        )
    try:
        return OutgoingMessage(**message)
    except TypeError as exc:  # a missing body, an unknown field, a key that is no str
        raise InvalidTypeError(
            f"a send_batch dict item must have the fields of OutgoingMessage "
            f"({', '.join(OutgoingMessage._fields)}; body required): {exc}"
        ) from None
