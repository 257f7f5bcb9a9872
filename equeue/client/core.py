"""What the sync and asyncio clients share: request frames, the answer stream, the
handshake's frames, result decoding, and the errors a broken connection raises."""

from __future__ import annotations

import select
from collections.abc import Callable
from typing import Any, Final

import msgpack

from equeue.errors import (
    ConnectionLostError,
    EQueueError,
    FrameTooLargeError,
    InvalidMessageError,
    InvalidTypeError,
    ProtocolError,
)
from equeue.protocol.faults import unpack_error
from equeue.protocol.frames import (
    BODIES_VERSION,
    COLUMNS_VERSION,
    CONNECTION_REQUEST_ID,
    FRAME_HEADER,
    FRAME_HEADER_SIZE,
    STATUS_OK,
    check_answer,
    decode_body,
)
from equeue.protocol.handshake import Hello, Welcome
from equeue.protocol.pullcols import pull_answer
from equeue.protocol.pullcols import unpack_any as _pull_columns
from equeue.protocol.records import (
    bodies_request,
    columns_answer,
    unpack_message,
    unpack_messages,
    unpack_pull_result,
    unpack_send_columns,
    unpack_send_result,
)
from equeue.store.types import Message, OutgoingMessage, PullResult, SendResult

# A request is (op, args, what ConnectionLostError.unanswered gets for it: the message
# as the caller gave it for a send, None for an op that stores nothing).
SEND_OPS: Final = frozenset({"send", "send_batch", "send_bodies"})
PULL_OPS: Final = frozenset({"pull", "pull_columns"})  # held by the broker up to wait_ms

_pack_header = FRAME_HEADER.pack
_unpack_header = FRAME_HEADER.unpack_from


class RequestEncoder:
    """Request frames, one msgpack Packer reused (not thread-safe: one per writer)."""

    __slots__ = ("_packer", "max_frame_bytes", "version", "where")

    def __init__(self, max_frame_bytes: int, where: str, version: int) -> None:
        self._packer = msgpack.Packer(use_bin_type=True)
        self.max_frame_bytes = max_frame_bytes
        self.where = where
        self.version = version  # the protocol version the broker chose

    def frame(self, request_id: int, op: str, args: dict[str, Any]) -> bytes:
        if op == "send_bodies" and self.version < BODIES_VERSION:  # a broker before it
            op = "send_batch"
            args = {"topic": args["topic"], "messages": [{"body": b} for b in args["bodies"]]}
        elif op == "send_bodies" and len(args) == 2:  # written in C, the bytes msgpack's
            frame = bodies_request(request_id, args["topic"], args["bodies"], self.max_frame_bytes)
            if type(frame) is bytes:
                return frame
            if type(frame) is int:  # its size, over the limit: refused before it is built
                raise self._too_large(op, frame)
        elif op == "pull_columns" and self.version < COLUMNS_VERSION:  # answered as a pull
            op = "pull"
        try:
            payload: bytes = self._packer.pack([request_id, op, args])
        except UnicodeEncodeError as exc:
            self._packer = msgpack.Packer(use_bin_type=True)
            raise InvalidMessageError(
                f"{op}: a string argument is not encodable as UTF-8 ({exc.reason})"
            ) from None
        except (TypeError, ValueError, OverflowError) as exc:  # request() with odd values
            self._packer = msgpack.Packer(use_bin_type=True)
            raise InvalidTypeError(f"{op}: an argument the wire cannot carry: {exc}") from None
        if len(payload) > self.max_frame_bytes:
            raise self._too_large(op, len(payload))
        return _pack_header(len(payload)) + payload

    def _too_large(self, op: str, size: int) -> FrameTooLargeError:
        return FrameTooLargeError(
            f"{self.where}: a {op} request of {size} bytes exceeds the broker's "
            f"max_frame_bytes={self.max_frame_bytes} (its welcome's limit; a broker "
            "setting); split the batch"
        )


class AnswerReader:
    """Frame bodies from the broker's byte stream, decoded (any split of the bytes)."""

    __slots__ = ("_buffer", "columns", "max_frame_bytes", "pulls", "where")

    def __init__(self, max_frame_bytes: int, where: str) -> None:
        self._buffer = bytearray()
        self.max_frame_bytes = max_frame_bytes
        self.where = where
        # Request ids of send_bodies in flight: their answers read by columns_answer (C),
        # straight from the frame's bytes into SendResults, when of the expected form
        self.columns: set[int] = set()
        # Request ids of pull_columns in flight whose caller takes a pull_answer tuple
        # (the group consumer's start_request): read in C straight into Messages
        self.pulls: set[int] = set()

    def feed(self, data: bytes | memoryview) -> list[Any]:
        buffer = self._buffer
        size = len(data)
        if not buffer and (self.columns or self.pulls) and size > FRAME_HEADER_SIZE:
            # One whole answer alone in the read (a send_batch's, one request at a time,
            # or a pull's): read where it lies, not copied into the buffer first
            (length,) = _unpack_header(data, 0)
            if length == size - FRAME_HEADER_SIZE and length <= self.max_frame_bytes:
                with memoryview(data) as whole, whole[FRAME_HEADER_SIZE:] as payload:
                    body = columns_answer(payload, self.columns) if self.columns else None
                    if body is None and self.pulls:
                        body = pull_answer(payload, self.pulls)
                    if body is None:
                        body = decode_body(payload, self.where)
                return [body]
        buffer += data
        end = len(buffer)
        bodies: list[Any] = []
        start = 0
        view = memoryview(buffer)
        try:
            while end - start >= FRAME_HEADER_SIZE:
                (length,) = _unpack_header(buffer, start)
                if length > self.max_frame_bytes or length == 0:
                    raise (FrameTooLargeError if length else ProtocolError)(
                        f"{self.where}: the broker sent a frame of {length} bytes; the "
                        f"limit is 1..max_frame_bytes={self.max_frame_bytes}"
                    )
                body_start = start + FRAME_HEADER_SIZE
                if end - body_start < length:
                    break
                with view[body_start : body_start + length] as payload:
                    body = columns_answer(payload, self.columns) if self.columns else None
                    if body is None and self.pulls:
                        body = pull_answer(payload, self.pulls)
                    if body is None:
                        body = decode_body(payload, self.where)
                bodies.append(body)
                start = body_start + length
        finally:
            view.release()
        if start:
            del buffer[:start]
        return bodies

    @property
    def pending(self) -> int:
        return len(self._buffer)


def readable(sock: Any, timeout: float) -> bool:
    """Whether ``sock`` has bytes (or its end) to read within ``timeout`` seconds: poll,
    not select, which refuses a descriptor past 1023 (a busy process has them)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(max(timeout, 0.0) * 1000))


def hello_frame(token: str | None, client_name: str) -> bytes:
    payload: bytes = msgpack.packb(Hello(token=token, client=client_name).pack(), use_bin_type=True)
    return _pack_header(len(payload)) + payload


def welcome(body: object, where: str) -> Welcome:
    """The broker's first frame: its welcome, or its refusal raised as its error class."""
    if type(body) is list:
        request_id, status, payload = check_answer(body, where)
        if request_id == CONNECTION_REQUEST_ID and status != STATUS_OK:
            raise unpack_error(payload, where)
        raise ProtocolError(f"{where}: the broker's first frame is an answer, not a welcome")
    return Welcome.unpack(body, where)


def lost(reason: str, unanswered: list[Any], cause: BaseException | None = None) -> EQueueError:
    error = ConnectionLostError(reason)
    error.unanswered = unanswered
    error.__cause__ = cause
    return error


def answer_error(payload: object, where: str) -> EQueueError:
    return unpack_error(payload, where)


# --- results: the wire's values as MessageStore returns them ---------------------------


_SEND_RESULT_TYPES: Final = (str, str, int, int, int, float)


def _send_result(value: Any, where: str) -> SendResult:
    if type(value) is list and tuple(map(type, value)) == _SEND_RESULT_TYPES:
        return SendResult._make(value)  # the common case, checked in one comparison
    return unpack_send_result(value, where)  # the ProtocolError saying what is wrong


def given(unanswered: tuple[Any, ...] | list[Any] | None) -> list[Any]:
    """A request's messages as the caller gave them (a send keeps its fields as a tuple:
    the OutgoingMessage is made only if the connection breaks)."""
    if unanswered is None:
        return []
    if type(unanswered) is tuple:
        return [OutgoingMessage._make(unanswered)]
    return list(unanswered)


def _none(value: object, where: str) -> None:
    return None


def _uint(value: object, where: str) -> int:
    if type(value) is not int or value < 0:
        raise ProtocolError(f"{where}: expected a uint, got {type(value).__name__}")
    return value


def _optional_uint(value: object, where: str) -> int | None:
    return None if value is None else _uint(value, where)


def _send_results(value: object, where: str) -> list[SendResult]:
    if type(value) is not list:
        raise ProtocolError(f"{where}: expected an array of SendResult")
    return [_send_result(item, where) for item in value]


def _send_bodies(value: object, where: str) -> list[SendResult]:
    """The columns of protocol version 2, or (sent as send_batch to a version 1 broker)
    an array of SendResult arrays; a tuple: the results AnswerReader read in C (msgpack
    makes no tuple)."""
    if type(value) is tuple:
        results: list[SendResult] = value[0]
        return results
    if type(value) is list and value and type(value[0]) is str:
        return unpack_send_columns(value, where)
    return _send_results(value, where)


def _strings(value: object, where: str) -> list[str]:
    if type(value) is not list or not all(type(item) is str for item in value):
        raise ProtocolError(f"{where}: expected an array of str")
    return value


def _uints(value: object, where: str) -> list[int]:
    if type(value) is not list:
        raise ProtocolError(f"{where}: expected an array of uint")
    return [_uint(item, where) for item in value]


def _range(value: object, where: str) -> tuple[int, int]:
    if type(value) is not list or len(value) != 2:
        raise ProtocolError(f"{where}: a queue range must be [first, next]")
    return _uint(value[0], where), _uint(value[1], where)


def _map(value: object, where: str) -> dict[str, Any]:
    if type(value) is not dict:
        raise ProtocolError(f"{where}: expected a map, got {type(value).__name__}")
    return value


def _messages(value: object, where: str) -> list[Message]:
    return unpack_messages(value, where)


def _pull(value: object, where: str) -> PullResult:
    return unpack_pull_result(value, where)


def _message(value: object, where: str) -> Message:
    return unpack_message(value, where)


Decoder = Callable[[Any, str], Any]
DECODERS: Final[dict[str, Decoder]] = {
    "ping": _none,
    "send": _send_result,
    "send_batch": _send_results,
    "send_bodies": _send_bodies,
    "pull": _pull,
    "pull_columns": _pull_columns,
    "get": _message,
    "query_by_key": _messages,
    "offset_for_time": _uint,
    "commit_offset": _none,
    "committed_offset": _optional_uint,
    "create_topic": _none,
    "topics": _strings,
    "queue_ids": _uints,
    "queue_range": _range,
    "stats": _map,
}
