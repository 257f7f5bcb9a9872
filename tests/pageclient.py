"""A client of the equeue broker written from docs/protocol.md alone (issue 23: "a client
in another language can be written from the page alone"). It imports the standard
library and msgpack only, never equeue, so that what it does is what the page says: the
test_protocol_from_page tests hold the broker to the page through it."""

from __future__ import annotations

import contextlib
import socket
import struct
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

VERSIONS = (1, 2, 3, 4, 5, 6)
# Which op came with which version ("Version 2 (2026-11-25) adds one op, ..."): a
# client must not send one of a later version than the welcome's.
OP_VERSIONS = {
    "send_bodies": 2,
    "pull_columns": 3,
    "query_by_key_page": 4,
    "deleted_topics": 5,
    "delete_group": 5,
    "cancel_pull": 6,
}
HELLO_MAX_FRAME_BYTES = 64 * 1024  # "Until the hello is accepted a frame may be at most 64 KiB"
LENGTH_FIELD_MAX = 2**32 - 1
# "The required ones are max_frame_bytes, max_in_flight and max_connections"; the other
# four a client may go without, two of them then taken as their defaults.
REQUIRED_LIMITS = ("max_frame_bytes", "max_in_flight", "max_connections")
OPTIONAL_LIMITS = (
    "max_batch_messages",
    "max_pull_count",
    "max_message_size",
    "max_properties_size",
)
ABSENT_LIMIT_DEFAULTS = {"max_batch_messages": 65536, "max_pull_count": 65536}
# max_properties_size may be 0 ("a store that takes no properties"), the others not.
ZERO_ALLOWED_LIMITS = ("max_properties_size",)
# The page's "Errors" table: each code and the code it is a kind of ("" for none).
PARENTS = {
    "ProtocolError": "",
    "FrameTooLargeError": "ProtocolError",
    "ShmRingError": "ProtocolError",
    "AuthenticationError": "",
    "LimitExceededError": "",
    "BrokerStoppingError": "",
    "BrokerError": "",
    "GroupError": "",
    "FencedMemberError": "GroupError",
    "GroupNotFoundError": "GroupError",
    "TopicNotFoundError": "",
    "QueueNotFoundError": "",
    "InvalidMessageError": "",
    "MessageTooLargeError": "InvalidMessageError",
    "InvalidTypeError": "",
    "ConfigError": "",
    "NewerFormatError": "ConfigError",
    "PositionError": "",
    "PositionNotFoundError": "PositionError",
    "MessageNotFoundError": "PositionError",
    "ChunkRemovedError": "PositionError",
    "CompactedAwayError": "PositionError",
    "CorruptionError": "",
    "ChecksumMismatchError": "CorruptionError",
    "TruncatedError": "CorruptionError",
    "CorruptRecordError": "CorruptionError",
    "MissingChunkError": "CorruptionError",
    "ChunkReplacedError": "CorruptionError",
    "InvalidRecordError": "",
    "RecordTooLargeError": "InvalidRecordError",
    "StoreWriteError": "",
    "DiskFullError": "StoreWriteError",
    "StoreReplacedError": "StoreWriteError",
    "StoreReadError": "",
    "StorePathError": "",
    "UsageError": "",
    "ReadOnlyError": "",
    "ClosedError": "",
    "ReentrantSendError": "",
    "WriterExistsError": "",
    "StoreLockedError": "",
    "NotAStoreError": "",
    "BrokerTooOldError": "ProtocolError",
    "ConnectionLostError": "",
    "WrongLoopError": "",
    "CompactionError": "",
    "DataLossError": "",
    "SinkCommitError": "",
    "SparkClusterError": "",
    "SparkOptionError": "",
    "SparkSchemaError": "",
    "SparkUnavailableError": "",
}
ERROR_CODES = frozenset(PARENTS)


class PageError(Exception):
    """An error answer: ``code`` the broker's class name, ``request_id`` 0 for the
    connection's own (sent just before the broker closes it)."""

    def __init__(self, request_id: int, code: str, message: str) -> None:
        super().__init__(f"{code}: {message} (request id {request_id})")
        self.request_id = request_id
        self.code = code
        self.message = message

    @property
    def listed(self) -> bool:
        return self.code in ERROR_CODES

    def is_a(self, code: str) -> bool:
        """Whether this error is of ``code`` or a kind of it (an unknown code: BrokerError)."""
        found = self.code if self.code in PARENTS else "BrokerError"
        while found:
            if found == code:
                return True
            found = PARENTS[found]
        return False


class PageProtocolError(Exception):
    """The broker sent what the page does not allow, or the client refused to send
    what the page forbids."""


class Closed(Exception):
    """The broker closed the connection (end of stream)."""


@dataclass(frozen=True)
class Message:
    message_id: str
    topic: str
    queue_id: int
    queue_offset: int
    position: int
    tag: str
    key: str | None
    properties: dict[str, str]
    code: int
    body: bytes
    created_ns: int
    stored_ns: int


@dataclass(frozen=True)
class SendResult:
    message_id: str
    topic: str
    queue_id: int
    queue_offset: int
    position: int
    stored_at: float


@dataclass(frozen=True)
class PullResult:
    messages: list[Message]
    next_offset: int


def _uint(value: Any, what: str) -> int:
    if type(value) is not int or value < 0:
        raise PageProtocolError(f"{what}: expected a uint, got {value!r}")
    return value


def _int(value: Any, what: str) -> int:
    if type(value) is not int:
        raise PageProtocolError(f"{what}: expected an int, got {value!r}")
    return value


def _str(value: Any, what: str) -> str:
    if type(value) is not str:
        raise PageProtocolError(f"{what}: expected a str, got {value!r}")
    return value


def _list(value: Any, what: str, length: int | None = None) -> list[Any]:
    if type(value) is not list or (length is not None and len(value) != length):
        raise PageProtocolError(f"{what}: expected an array of {length}, got {value!r}")
    return value


def _str_map(value: Any, what: str) -> dict[str, str]:
    if type(value) is not dict or any(
        type(k) is not str or type(v) is not str for k, v in value.items()
    ):
        raise PageProtocolError(f"{what}: expected a map str->str, got {value!r}")
    return value


def decode_message(value: Any) -> Message:
    """Records, "Message": an array of 12."""
    fields = _list(value, "Message", 12)
    key = fields[6]
    if key is not None:
        _str(key, "Message.key")
    if type(fields[9]) is not bytes:
        raise PageProtocolError(f"Message.body: expected bin, got {fields[9]!r}")
    return Message(
        message_id=_str(fields[0], "Message.message_id"),
        topic=_str(fields[1], "Message.topic"),
        queue_id=_uint(fields[2], "Message.queue_id"),
        queue_offset=_uint(fields[3], "Message.queue_offset"),
        position=_uint(fields[4], "Message.position"),
        tag=_str(fields[5], "Message.tag"),
        key=key,
        properties=_str_map(fields[7], "Message.properties"),
        code=_int(fields[8], "Message.code"),
        body=fields[9],
        created_ns=_int(fields[10], "Message.created_ns"),
        stored_ns=_int(fields[11], "Message.stored_ns"),
    )


def decode_send_result(value: Any) -> SendResult:
    """Records, "SendResult": an array of 6, ``stored_at`` a float64."""
    fields = _list(value, "SendResult", 6)
    if type(fields[5]) is not float:
        raise PageProtocolError(f"SendResult.stored_at: expected a float, got {fields[5]!r}")
    return SendResult(
        message_id=_str(fields[0], "SendResult.message_id"),
        topic=_str(fields[1], "SendResult.topic"),
        queue_id=_uint(fields[2], "SendResult.queue_id"),
        queue_offset=_uint(fields[3], "SendResult.queue_offset"),
        position=_uint(fields[4], "SendResult.position"),
        stored_at=fields[5],
    )


def decode_pull(value: Any) -> PullResult:
    """Records, "PullResult": ``[messages, next_offset]``."""
    messages, next_offset = _list(value, "PullResult", 2)
    return PullResult(
        [decode_message(m) for m in _list(messages, "PullResult.messages")],
        _uint(next_offset, "PullResult.next_offset"),
    )


def decode_send_columns(value: Any, count: int) -> list[SendResult]:
    """ "SendResult columns": ``[topic, message_ids, queue_ids, queue_offsets, positions,
    stored_at]``, the five arrays of the request's length."""
    topic, ids, queue_ids, offsets, positions, stored_at = _list(value, "send columns", 6)
    columns = [_list(c, "send column", count) for c in (ids, queue_ids, offsets, positions)]
    stored = _list(stored_at, "send column stored_at", count)
    return [
        decode_send_result([columns[0][i], topic, *(c[i] for c in columns[1:]), stored[i]])
        for i in range(count)
    ]


def decode_pull_columns(value: Any) -> PullResult:
    """ "Pull columns": an array of 14, rebuilt into the Messages ``pull`` answers."""
    fields = _list(value, "pull columns", 14)
    next_offset = _uint(fields[0], "columns.next_offset")
    topic = _str(fields[1], "columns.topic")
    queue_id = _uint(fields[2], "columns.queue_id")
    id_prefix = _str(fields[3], "columns.id_prefix")
    offsets = _list(fields[5], "columns.queue_offsets")
    count = len(offsets)
    positions = _list(fields[6], "columns.positions", count)
    if fields[4] is None:
        ids = [f"{id_prefix}{_uint(p, 'columns.positions[i]'):016x}" for p in positions]
    else:
        ids = _list(fields[4], "columns.message_ids", count)
    created = _list(fields[7], "columns.created_ns", count)
    stored = _list(fields[8], "columns.stored_ns", count)
    bodies = _list(fields[9], "columns.bodies", count)
    tags = [fields[10]] * count if type(fields[10]) is str else _list(fields[10], "tags", count)
    keys = [None] * count if fields[11] is None else _list(fields[11], "columns.keys", count)
    codes = [fields[12]] * count if type(fields[12]) is int else _list(fields[12], "codes", count)
    properties: dict[int, Any] = {}
    if fields[13] is not None:
        last = -1
        for pair in _list(fields[13], "columns.properties"):
            index, props = _list(pair, "columns.properties item", 2)
            if type(index) is not int or not last < index < count:
                raise PageProtocolError(f"columns.properties: index {index!r} out of order")
            properties[index] = props
            last = index
    messages = [
        decode_message(
            [
                ids[i],
                topic,
                queue_id,
                offsets[i],
                positions[i],
                tags[i],
                keys[i],
                properties.get(i, {}),
                codes[i],
                bodies[i],
                created[i],
                stored[i],
            ]
        )
        for i in range(count)
    ]
    return PullResult(messages, next_offset)


def frame(body: Any) -> bytes:
    """Framing: a u32 big-endian length, then exactly one msgpack object (str as str,
    bytes as bin)."""
    packed: bytes = msgpack.packb(body, use_bin_type=True)
    return struct.pack(">I", len(packed)) + packed


class PageClient:
    """One connection to a broker's Unix socket: the hello at once (unless ``hello`` is
    False), then requests by id, pipelined, their answers matched by id."""

    def __init__(
        self,
        path: str,
        *,
        versions: Iterable[int] = VERSIONS,
        token: str | None = None,
        client: str = "pageclient",
        timeout_s: float = 10.0,
        hello: bool = True,
    ) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout_s)
        self.sock.connect(path)
        self.buffer = b""
        self.next_id = 1
        self.answers: dict[int, tuple[int, Any]] = {}
        self.connection_error: PageError | None = None
        self.version = 0
        self.server = ""
        self.limits: dict[str, int] = {}
        self.max_frame_bytes = HELLO_MAX_FRAME_BYTES
        if hello:
            self.hello({"versions": list(versions), "token": token, "client": client})

    # -- frames

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def read_body(self) -> Any:
        """The next frame's body; ``Closed`` at the end of the stream."""
        while True:
            if len(self.buffer) >= 4:
                (length,) = struct.unpack(">I", self.buffer[:4])
                if length < 1:
                    raise PageProtocolError("the broker sent an empty frame")
                if len(self.buffer) >= 4 + length:
                    body = self.buffer[4 : 4 + length]
                    self.buffer = self.buffer[4 + length :]
                    return msgpack.unpackb(body, raw=False)
            data = self.sock.recv(1 << 20)
            if not data:
                if self.buffer:
                    raise PageProtocolError(f"the stream ended inside a frame ({self.buffer!r})")
                raise Closed("the broker closed the connection")
            self.buffer += data

    def read_end(self) -> bool:
        """True if the broker closed the connection with nothing more to read."""
        try:
            extra = self.read_body()
        except Closed:
            return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        raise PageProtocolError(f"the connection stayed open: {extra!r}")

    # -- handshake

    def hello(self, hello: Any) -> dict[str, Any]:
        # A broker refusing the connection (max_connections) sends its connection error
        # and closes at once, maybe before the hello: the error is still to be read.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self.send_raw(frame(hello))
        welcome = self.read_body()
        if type(welcome) is list:  # a connection error: [0, 1, {code, message}]
            self._take_answer(welcome)
            raise PageProtocolError(f"the hello was answered {welcome!r}")
        if type(welcome) is not dict:
            raise PageProtocolError(f"the welcome is not a map: {welcome!r}")
        self.version = _uint(welcome.get("version"), "welcome.version")
        if self.version not in (list(hello["versions"]) if type(hello) is dict else []):
            raise PageProtocolError(f"welcomed with version {self.version}, not offered")
        self.server = _str(welcome.get("server"), "welcome.server")
        limits = welcome.get("limits")
        if type(limits) is not dict:
            raise PageProtocolError(f"welcome.limits is not a map: {limits!r}")
        self.limits = dict(ABSENT_LIMIT_DEFAULTS)
        for name in (*REQUIRED_LIMITS, *OPTIONAL_LIMITS):
            value = limits.get(name)
            least = 0 if name in ZERO_ALLOWED_LIMITS else 1
            if type(value) is int and value >= least:
                self.limits[name] = min(value, LENGTH_FIELD_MAX)
            elif name in REQUIRED_LIMITS:
                raise PageProtocolError(f"welcome.limits.{name} is {value!r}")
        self.max_frame_bytes = self.limits["max_frame_bytes"]
        return welcome

    # -- requests

    def request(self, op: str, args: Mapping[str, Any] | None = None) -> int:
        """Sends ``[request_id, op, args]`` and returns its id (answers: ``wait``),
        refusing what the page says a client must not send: an op of a later version than
        the welcome's, a frame past ``max_frame_bytes``."""
        needed = OP_VERSIONS.get(op, 1)
        if needed > self.version:
            raise PageProtocolError(f"op {op!r} is of version {needed}, welcomed {self.version}")
        data = frame([self.next_id, op, dict(args or {})])
        if len(data) - 4 > self.max_frame_bytes:
            raise PageProtocolError(f"a frame of {len(data) - 4} bytes > max_frame_bytes")
        return self._send_request(data)

    def request_unchecked(self, op: str, args: Mapping[str, Any] | None = None) -> int:
        """As ``request`` without its checks, to see what the broker does then."""
        return self._send_request(frame([self.next_id, op, dict(args or {})]))

    def _send_request(self, data: bytes) -> int:
        request_id = self.next_id
        self.next_id += 1
        self.send_raw(data)
        return request_id

    def _take_answer(self, answer: Any) -> None:
        fields = _list(answer, "answer", 3)
        request_id = _uint(fields[0], "answer.request_id")
        status = fields[1]
        if status not in (0, 1):
            raise PageProtocolError(f"answer status {status!r}")
        if status == 1:
            error = fields[2]
            if type(error) is not dict or set(error) != {"code", "message"}:
                raise PageProtocolError(f"error answer of another shape: {error!r}")
            err = PageError(request_id, _str(error["code"], "code"), _str(error["message"], "m"))
            if request_id == 0:
                self.connection_error = err
                return
        self.answers[request_id] = (status, fields[2])

    def wait(self, request_id: int, timeout_s: float = 10.0) -> Any:
        """The result of ``request_id``; ``PageError`` for an error answer, or for the
        connection's own error (request id 0) if that comes first."""
        deadline = time.monotonic() + timeout_s
        while request_id not in self.answers:
            if self.connection_error is not None:
                raise self.connection_error
            if time.monotonic() > deadline:
                raise TimeoutError(f"no answer to request {request_id} in {timeout_s} s")
            self._take_answer(self.read_body())
        status, payload = self.answers.pop(request_id)
        if status == 1:
            raise PageError(request_id, payload["code"], payload["message"])
        return payload

    def next_answer(self) -> tuple[int, int, Any]:
        """The next answer off the stream, in the order the broker wrote them."""
        fields = _list(self.read_body(), "answer", 3)
        return fields[0], fields[1], fields[2]

    def call(self, op: str, **args: Any) -> Any:
        return self.wait(self.request(op, args))

    # -- ops (the page's table, "Operations"); an omitted argument is not sent

    def ping(self) -> None:
        self.call("ping")

    def create_topic(self, topic: str, queue_count: int | None = None) -> None:
        self.call("create_topic", topic=topic, **_given(queue_count=queue_count))

    def topics(self) -> list[str]:
        return [_str(t, "topic") for t in _list(self.call("topics"), "topics")]

    def queue_ids(self, topic: str) -> list[int]:
        return [_uint(q, "queue_id") for q in _list(self.call("queue_ids", topic=topic), "ids")]

    def send(self, topic: str, body: bytes, **options: Any) -> SendResult:
        return decode_send_result(self.call("send", topic=topic, body=body, **options))

    def send_batch(self, topic: str, messages: list[dict[str, Any]]) -> list[SendResult]:
        answer = _list(self.call("send_batch", topic=topic, messages=messages), "send_batch")
        return [decode_send_result(r) for r in answer]

    def send_bodies(self, topic: str, bodies: list[bytes]) -> list[SendResult]:
        return decode_send_columns(
            self.call("send_bodies", topic=topic, bodies=bodies), len(bodies)
        )

    def pull(self, topic: str, queue_id: int, offset: int, **options: Any) -> PullResult:
        args = {"topic": topic, "queue_id": queue_id, "offset": offset, **options}
        return decode_pull(self.call("pull", **args))

    def pull_columns(self, topic: str, queue_id: int, offset: int, **options: Any) -> PullResult:
        args = {"topic": topic, "queue_id": queue_id, "offset": offset, **options}
        return decode_pull_columns(self.call("pull_columns", **args))

    def get(self, message_id: str) -> Message:
        return decode_message(self.call("get", message_id=message_id))

    def query_by_key(self, topic: str, key: str, limit: int | None = None) -> list[Message]:
        answer = self.call("query_by_key", topic=topic, key=key, **_given(limit=limit))
        return [decode_message(m) for m in _list(answer, "query_by_key")]

    def query_by_key_page(
        self, topic: str, key: str, limit: int | None = None, before: int | None = None
    ) -> tuple[list[Message], int | None]:
        args = {"topic": topic, "key": key, **_given(limit=limit, before=before)}
        messages, next_before = _list(self.call("query_by_key_page", **args), "page", 2)
        if next_before is not None:
            _uint(next_before, "query_by_key_page.next")
        return [decode_message(m) for m in _list(messages, "page.messages")], next_before

    def offset_for_time(self, topic: str, queue_id: int, timestamp: float) -> int:
        answer = self.call("offset_for_time", topic=topic, queue_id=queue_id, timestamp=timestamp)
        return _uint(answer, "offset_for_time")

    def commit_offset(self, group: str, topic: str, queue_id: int, offset: int) -> None:
        self.call("commit_offset", group=group, topic=topic, queue_id=queue_id, offset=offset)

    def committed_offset(self, group: str, topic: str, queue_id: int) -> int | None:
        answer = self.call("committed_offset", group=group, topic=topic, queue_id=queue_id)
        return None if answer is None else _uint(answer, "committed_offset")

    def queue_range(self, topic: str, queue_id: int) -> tuple[int, int]:
        first, end = _list(self.call("queue_range", topic=topic, queue_id=queue_id), "range", 2)
        return _uint(first, "queue_range.first"), _uint(end, "queue_range.next")

    def deleted_topics(self) -> dict[str, int]:
        answer = self.call("deleted_topics")
        if type(answer) is not dict:
            raise PageProtocolError(f"deleted_topics: {answer!r}")
        return {_str(k, "topic"): _uint(v, "position") for k, v in answer.items()}

    def stats(self, group: str | None = None) -> dict[str, Any]:
        answer = self.call("stats", **_given(group=group))
        if type(answer) is not dict:
            raise PageProtocolError(f"stats: {answer!r}")
        return answer

    def cancel_pull(self, request_id: int) -> bool:
        answer = self.call("cancel_pull", request_id=request_id)
        if type(answer) is not bool:
            raise PageProtocolError(f"cancel_pull: {answer!r}")
        return answer

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> PageClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _given(**args: Any) -> dict[str, Any]:
    """The arguments given: "omit one to get its default" (nil is a wrong type for most)."""
    return {name: value for name, value in args.items() if value is not None}
