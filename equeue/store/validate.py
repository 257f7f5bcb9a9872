"""Checks of everything a caller passes in; each failure names the limit and its setting."""

from __future__ import annotations

import re
from functools import lru_cache
from typing import TYPE_CHECKING

from equeue.errors import (
    InvalidMessageError,
    InvalidTypeError,
    MessageTooLargeError,
    QueueNotFoundError,
)
from equeue.format.chunk import FRAME_OVERHEAD
from equeue.format.message import (
    MAX_NAME_BYTES,
    MESSAGE_HEAD_SIZE,
    encode_properties,
    tag_hash,
)

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


def check_body(body: object, limit: int) -> bytes:
    if type(body) is not bytes:
        if not isinstance(body, bytearray | memoryview):
            raise InvalidTypeError(f"body must be bytes-like, got {type(body).__name__}")
        body = bytes(body)
    if len(body) > limit:
        raise MessageTooLargeError(
            f"body is {len(body)} bytes; the limit is {limit} (StoreConfig.max_message_size)"
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


def check_queue_count(queue_count: object) -> int:
    if not isinstance(queue_count, int) or isinstance(queue_count, bool):
        raise InvalidTypeError(f"queue_count must be an int, got {type(queue_count).__name__}")
    if not 1 <= queue_count <= 1024:
        raise InvalidMessageError(f"queue_count {queue_count} must lie in [1, 1024]")
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
    if size + FRAME_OVERHEAD > config.chunk_data_size:
        raise InvalidMessageError(
            f"a message of about {size} bytes does not fit a chunk of chunk_data_size="
            f"{config.chunk_data_size}; raise StoreConfig.chunk_data_size"
        )
    return (body, tag_bytes, hashed, key_bytes, key, props, code, queue_id)  # type: ignore[return-value]
