"""Framing of the equeue wire protocol (docs/protocol.md is the full description).

A connection is a stream of frames in each direction. A frame::

    offset size type    field
    0      4    u32 BE  body length N (bytes after this field; 1 <= N <= max_frame_bytes)
    4      N    msgpack body: one msgpack object (the shapes below)

Bodies, client to broker:

* first frame, the hello: a map ``{"versions": [1, 2, 3, 4, 5], "token": str|nil, "client": str}``
* then requests: an array ``[request_id: uint, op: str, args: map]``; ``request_id``
  is chosen by the client, unique among its requests in flight (answers may come in
  any order: a long-poll pull is answered after later sends).

Bodies, broker to client:

* the welcome (answer to the hello): a map ``{"version": 5, "server": str,
  "limits": map}``, or an error answer with request id 0, then the broker closes;
* answers: an array ``[request_id, STATUS_OK, result]`` or
  ``[request_id, STATUS_ERROR, {"code": str, "message": str}]``. Request id 0 is
  the connection's own: an error about the connection (a malformed frame, a limit)
  sent just before the broker closes it.

msgpack: strings are str (UTF-8), bytes are bin; integers up to 64 bits.
"""

from __future__ import annotations

import itertools
import reprlib
import struct
from typing import Any, Final

import msgpack

from equeue.errors import FrameTooLargeError, ProtocolError

PROTOCOL_VERSION: Final = 6
SUPPORTED_VERSIONS: Final = (1, 2, 3, 4, 5, 6)
# Version 2 adds the op send_bodies (a batch of bodies alone, answered in columns:
# records.py); everything of version 1 is unchanged. A client speaking 2 to a broker
# that chose 1 sends such a batch as send_batch.
BODIES_VERSION: Final = 2
# Version 3 adds the op pull_columns (a pull answered in columns: pullcols.py); a client
# speaking 3 to a broker that chose 2 or 1 sends pull instead.
COLUMNS_VERSION: Final = 3
# Version 4 adds the op query_by_key_page (query_by_key's messages and where the rest
# begins, when the answer was cut to the frame); a client speaking 4 to an older broker
# sends query_by_key, whose answer an older broker does not cut.
KEY_PAGES_VERSION: Final = 4
# Version 5 adds the op deleted_topics (MessageStore.deleted_topics: where each topic was
# last deleted, which tells a topic created again from the one a reader knew); a client
# welcomed with an older version refuses it before sending (BrokerTooOldError).
DELETED_TOPICS_VERSION: Final = 5
# Version 5 also adds stats' argument "group" (that group's per-queue detail: the answer
# without it is a summary bounded by the broker's stats_max_listed, on every version); a
# client speaking 5 to an older broker asks for the whole stats and keeps that group.
STATS_GROUP_VERSION: Final = 5
# Version 5 also adds the op delete_group (a consumer group's offsets, retry topic and,
# when asked, dead letters removed); a client speaking 5 to an older broker refuses the
# call itself (BrokerTooOldError: there is nothing to fall back to).
GROUP_DELETE_VERSION: Final = 5
# Version 6 adds the op cancel_pull (a held long poll of the connection answered empty at
# once, its place under max_in_flight freed: a client whose caller gave up on it sends
# it); a client speaking 6 to an older broker sends nothing and lets the pull run out.
CANCEL_PULL_VERSION: Final = 6
# Version 6 also has a draining broker end each connection with BrokerStoppingError
# (request id 0) once it answered every request it read: whatever is unanswered then was
# not read, so a client reports those sends unsent. An older client is not sent it.
STOP_NOTICE_VERSION: Final = 6
# Version 6 also adds delete_group's answer key "unfinished" (str, only when a step after
# the deletion's commit point failed: DeletedGroup.unfinished); an older client is not
# sent it and reads the deletion as done, as before.
UNFINISHED_VERSION: Final = 6

FRAME_HEADER: Final = struct.Struct(">I")
FRAME_HEADER_SIZE: Final = FRAME_HEADER.size
assert FRAME_HEADER_SIZE == 4

STATUS_OK: Final = 0
STATUS_ERROR: Final = 1
CONNECTION_REQUEST_ID: Final = 0  # answers about the connection itself, not a request

# Defaults of the limits; the broker announces the ones in force in its welcome.
DEFAULT_MAX_FRAME_BYTES: Final = 64 * 1024 * 1024  # a send_batch of many 4 MiB messages fits
MIN_MAX_FRAME_BYTES: Final = 1024
HELLO_MAX_FRAME_BYTES: Final = 64 * 1024  # before authentication, a stranger gets this much
DEFAULT_MAX_IN_FLIGHT: Final = 1024
DEFAULT_MAX_CONNECTIONS: Final = 1024
# One request's work: a send_batch's messages (and any array or map of a request), a
# pull's messages. A SendResult packs to at most 65 bytes plus its topic's UTF-8.
DEFAULT_MAX_BATCH_MESSAGES: Final = 65536
DEFAULT_MAX_PULL_COUNT: Final = 65536
SEND_RESULT_OVERHEAD: Final = 65
ANSWER_OVERHEAD: Final = 32  # [request_id, status, ...] around a result, and the header
# A Message's fields but body and properties, packed (ids, topic, tag, key of at most
# 255 bytes each, ints), and the answer around it: a generous bound. A broker's store
# takes bodies of at most max_frame_bytes less its max_properties_size and this, so that
# a pull's answer carries its largest message (equeue/server/serve.py).
MESSAGE_OVERHEAD: Final = 2048

_packer_options: Final = {"use_bin_type": True}


def encode(body: object) -> bytes:
    """One frame: the header and the msgpack body."""
    try:
        payload: bytes = msgpack.packb(body, **_packer_options)
    except (TypeError, ValueError, OverflowError) as exc:  # a value msgpack cannot carry
        raise ProtocolError(f"cannot encode a frame body: {exc}") from exc
    return FRAME_HEADER.pack(len(payload)) + payload


def decode_body(
    payload: bytes | memoryview, where: str, max_items: int = -1, setting: str = ""
) -> Any:
    """The object of one frame body; ProtocolError naming ``where`` if it is not one
    whole msgpack object. ``max_items`` (the broker's ``setting``) bounds every array and
    map: past it the decoding stops at that container's header, before building it."""
    try:
        return msgpack.unpackb(
            payload, raw=False, strict_map_key=True, use_list=True,
            max_array_len=max_items, max_map_len=max_items,
        )  # fmt: skip
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise ProtocolError(f"{where}: the frame body is not one msgpack object ({exc})") from exc
    except (ValueError, TypeError, UnicodeDecodeError) as exc:
        raise not_valid(exc, where, setting) from exc


def not_valid(exc: Exception, where: str, setting: str) -> ProtocolError:
    """The error of a body msgpack refused: naming the item bound (``setting``) only
    where msgpack's refusal is the count's ("N exceeds max_array_len(M)"), not for a
    non-str map key or bad UTF-8 (they read "may hold more than" too, round 17)."""
    counted = setting and " exceeds max_" in str(exc)
    limit = f"; no array or map may hold more than {setting}" if counted else ""
    return ProtocolError(f"{where}: the frame body is not valid msgpack ({exc}{limit})")


class FrameReader:
    """Splits a byte stream into frame bodies, as bytes arrive (any split, any size).

    ``feed`` returns the bodies completed by the new bytes; it raises
    FrameTooLargeError as soon as a header declares more than ``max_frame_bytes``
    (before the body is buffered), and ProtocolError for an empty frame. After an
    error the reader is unusable: the connection must be closed.
    """

    __slots__ = ("_buffer", "_where", "max_frame_bytes")

    def __init__(self, max_frame_bytes: int, where: str) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._buffer = bytearray()
        self._where = where

    def feed(self, data: bytes | memoryview) -> list[bytes]:
        buffer = self._buffer
        buffer += data
        bodies: list[bytes] = []
        start = 0
        end = len(buffer)
        while end - start >= FRAME_HEADER_SIZE:
            (length,) = FRAME_HEADER.unpack_from(buffer, start)
            if length > self.max_frame_bytes:
                raise FrameTooLargeError(
                    f"{self._where}: a frame of {length} bytes (header 0x{length:08x}) "
                    f"exceeds max_frame_bytes={self.max_frame_bytes}"
                )
            if length == 0:
                raise ProtocolError(f"{self._where}: an empty frame (length 0)")
            body_start = start + FRAME_HEADER_SIZE
            if end - body_start < length:
                break
            bodies.append(bytes(buffer[body_start : body_start + length]))
            start = body_start + length
        if start:
            del buffer[:start]
        return bodies

    @property
    def pending(self) -> int:
        """Bytes received that are not yet a whole frame (a truncated frame at EOF)."""
        return len(self._buffer)


def check_request(body: object, where: str) -> tuple[int, str, dict[str, Any]]:
    """A request body as (request id, op, args); ProtocolError for any other shape."""
    if (
        type(body) is list
        and len(body) == 3
        and type(body[0]) is int
        and body[0] > CONNECTION_REQUEST_ID
        and type(body[1]) is str
        and type(body[2]) is dict
    ):
        return body[0], body[1], body[2]
    raise ProtocolError(
        f"{where}: a request must be [request_id > 0, op string, args map]; got {_shape(body)}"
    )


def check_answer(body: object, where: str) -> tuple[int, int, Any]:
    """An answer body as (request id, status, result or error map)."""
    if (
        type(body) is list
        and len(body) == 3
        and type(body[0]) is int
        and body[0] >= CONNECTION_REQUEST_ID
        and body[1] in (STATUS_OK, STATUS_ERROR)
    ):
        return body[0], body[1], body[2]
    raise ProtocolError(
        f"{where}: an answer must be [request_id, status 0|1, payload]; got {_shape(body)}"
    )


class _KeysAndTypes(reprlib.Repr):
    """A map as its keys and the types of its values, a list as the types of its items
    (a map among them as its keys): a client's map may carry its token (a hello sent
    twice, or as a request), a client may put it where an op or a request id goes, and
    error answers and log lines must not echo it (review4 R7)."""

    def repr_list(self, x: list[Any], level: int) -> str:
        if not x:
            return "[]"
        if level <= 0:
            return "[...]"
        shown = [
            self.repr1(item, level - 1) if type(item) is dict else type(item).__name__
            for item in itertools.islice(x, self.maxlist)
        ]
        return "[" + ", ".join(shown + ["..."] * (len(x) > self.maxlist)) + "]"

    def repr_dict(self, x: dict[Any, Any], level: int) -> str:
        if not x:
            return "{}"
        if level <= 0:
            return "{...}"
        shown = [
            f"{self.repr1(key, level - 1)}: {type(value).__name__}"
            for key, value in itertools.islice(x.items(), self.maxdict)
        ]
        return "{" + ", ".join(shown + ["..."] * (len(x) > self.maxdict)) + "}"


_short = _KeysAndTypes()
_short.maxlevel, _short.maxlist, _short.maxdict = 2, 4, 4
_short.maxstring = _short.maxother = _short.maxlong = 40


def _shape(body: object) -> str:
    """A short description of a body: its type, length and first items, never a repr of
    the whole (a 60 MB array of nils is 343 MB of text)."""
    if not isinstance(body, list | dict):
        return type(body).__name__  # (a string alone may be the token)
    text = _short.repr(body)
    text = text if len(text) <= 80 else text[:77] + "..."
    return f"{type(body).__name__} of {len(body)} items {text}"
