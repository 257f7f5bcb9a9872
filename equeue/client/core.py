"""What the sync and asyncio clients share: request frames, the answer stream, the
handshake's frames, result decoding, and the errors a broken connection raises."""

from __future__ import annotations

import select
from collections.abc import Callable
from typing import Any, Final

import msgpack

from equeue.errors import (
    BrokerStoppingError,
    BrokerTooOldError,
    ConnectionLostError,
    EQueueError,
    FrameTooLargeError,
    InvalidMessageError,
    InvalidTypeError,
    LimitExceededError,
    MessageTooLargeError,
    ProtocolError,
)
from equeue.protocol.bounded import (
    OBJECTS_PER_MESSAGE,
    SEND_BATCH_OBJECTS,
    counted_above,
    max_objects,
    message_objects,
)
from equeue.protocol.faults import unpack_error
from equeue.protocol.frames import (
    BODIES_VERSION,
    COLUMNS_VERSION,
    CONNECTION_REQUEST_ID,
    DEFAULT_MAX_BATCH_MESSAGES,
    FRAME_HEADER,
    FRAME_HEADER_SIZE,
    KEY_PAGES_VERSION,
    MESSAGE_OVERHEAD,
    STATS_GROUP_VERSION,
    STATUS_OK,
    check_answer,
    decode_body,
)
from equeue.protocol.handshake import Hello, Welcome
from equeue.protocol.ops import OP_VERSIONS
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
from equeue.store.groupdeletion import DeletedGroup
from equeue.store.types import Message, OutgoingMessage, PullResult, SendResult

# A request is (op, args, what ConnectionLostError.unanswered gets for it: the message
# as the caller gave it for a send, None for an op that stores nothing).
SEND_OPS: Final = frozenset({"send", "send_batch", "send_bodies"})
PULL_OPS: Final = frozenset({"pull", "pull_columns"})  # held by the broker up to wait_ms

# What a batch refused for its size is told to do.
_SPLIT: Final = (
    "Nothing was sent: send smaller batches (Client.send_many splits the messages into "
    "requests within the broker's limits)"
)

_pack_header = FRAME_HEADER.pack
_unpack_header = FRAME_HEADER.unpack_from


# What to do instead of an op an older broker does not have, where there is something.
_REMEDIES: Final = {
    "delete_group": ": upgrade it, or stop it and run 'equeue delete-group STORE GROUP'",
}


class RequestEncoder:
    """Request frames, one msgpack Packer reused (not thread-safe: one per writer).

    What the broker would refuse for its size is refused here, before anything is
    written, with the class the store raises where it has one: a frame past
    ``max_frame_bytes`` (MessageTooLargeError for a send, or for a batch holding a body
    no frame carries; FrameTooLargeError for a batch to split), a send_batch of more than
    ``max_batch_messages`` messages or, past ``counted_above`` bytes, of more msgpack
    objects than ``max_objects`` (LimitExceededError: the broker would close the
    connection past twice the count, or past the objects; equeue/protocol/bounded.py)."""

    __slots__ = (
        "_check_above", "_packer", "max_batch_messages", "max_frame_bytes", "max_objects",
        "version", "where",
    )  # fmt: skip

    def __init__(
        self,
        max_frame_bytes: int,
        where: str,
        version: int,
        max_batch_messages: int = DEFAULT_MAX_BATCH_MESSAGES,
    ) -> None:
        self._packer = msgpack.Packer(use_bin_type=True)
        self.max_frame_bytes = max_frame_bytes
        self.where = where
        self.version = version  # the protocol version the broker chose
        self.max_batch_messages = max_batch_messages
        self.max_objects = max_objects(max_batch_messages)
        # One comparison a request, as before the objects were counted: past it the frame
        # is too large, or a send_batch's objects are counted (_refuse)
        self._check_above = min(max_frame_bytes, counted_above(self.max_objects))

    @classmethod
    def for_welcome(cls, welcome: Welcome, where: str) -> RequestEncoder:
        """The encoder of a connection the broker welcomed (its limits, its version)."""
        limits = welcome.limits
        batch = limits.get("max_batch_messages", DEFAULT_MAX_BATCH_MESSAGES)
        return cls(limits["max_frame_bytes"], where, welcome.version, batch)

    def frame(self, request_id: int, op: str, args: dict[str, Any]) -> bytes:
        if op == "send_bodies":
            bodies = args["bodies"]
            if len(bodies) > self.max_batch_messages:
                raise self._too_many(len(bodies))
            if self.version < BODIES_VERSION:  # a broker before it
                op = "send_batch"
                args = {"topic": args["topic"], "messages": [{"body": b} for b in bodies]}
            elif len(args) == 2:  # written in C, the bytes msgpack's
                frame = bodies_request(request_id, args["topic"], bodies, self.max_frame_bytes)
                if type(frame) is bytes:
                    return frame
                if type(frame) is int:  # its size, over the limit: refused before it is built
                    raise self._too_large(op, frame, args)
        elif op == "pull_columns":
            if self.version < COLUMNS_VERSION:  # answered as a pull
                op = "pull"
        elif op == "query_by_key_page" and self.version < KEY_PAGES_VERSION:
            op = "query_by_key"  # answered whole (its one page), never with "before"
            args = {name: value for name, value in args.items() if name != "before"}
        elif self.version < OP_VERSIONS.get(op, 1):  # no older op answers it
            raise BrokerTooOldError(
                f"{op}: the broker at {self.where} speaks protocol version {self.version}; "
                f"{op} is of version {OP_VERSIONS[op]} (an equeue broker of 2026-11-27 or "
                f"later); nothing was sent{_REMEDIES.get(op, '')}"
            )
        elif op == "send_batch" and len(args.get("messages", ())) > self.max_batch_messages:
            raise self._too_many(len(args["messages"]))
        elif op == "stats" and args and self.version < STATS_GROUP_VERSION:
            args = {}  # every group's detail: the caller keeps the one asked (calls.one_group)
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
        if len(payload) > self._check_above:
            self._refuse(op, len(payload), args)
        return _pack_header(len(payload)) + payload

    def _refuse(self, op: str, size: int, args: dict[str, Any]) -> None:
        """A request past ``_check_above`` bytes: its error raised if the broker would
        refuse it for its size or its send_batch's objects."""
        if size > self.max_frame_bytes:
            raise self._too_large(op, size, args)
        if op != "send_batch" or size <= counted_above(self.max_objects):
            return
        messages = args.get("messages")
        if type(messages) is not list:
            return
        count = SEND_BATCH_OBJECTS + sum(
            message_objects(m) if type(m) is dict else 1 for m in messages
        )
        if count > self.max_objects:
            raise LimitExceededError(
                f"{self.where}: a send_batch of {len(messages)} messages holds {count} msgpack "
                "objects as the broker counts them (a message of a body and properties 7 + 2 "
                f"a property); a request body past {counted_above(self.max_objects)} bytes "
                f"may hold at most {self.max_objects}: the bound is per request, not per "
                f"message ({OBJECTS_PER_MESSAGE} x the broker's max_batch_messages="
                f"{self.max_batch_messages}, equeue serve --max-batch-messages). {_SPLIT}"
            )

    def _too_many(self, count: int) -> LimitExceededError:
        return LimitExceededError(
            f"{self.where}: a send_batch of {count} messages; the broker takes at most "
            f"max_batch_messages={self.max_batch_messages} a request (its welcome's limit; "
            f"equeue serve --max-batch-messages). {_SPLIT}"
        )

    def _too_large(self, op: str, size: int, args: dict[str, Any]) -> EQueueError:
        """A request past max_frame_bytes, named as its caller called it (send_bodies is
        a send_batch of bodies): MessageTooLargeError where one message is too large (a
        send; a body of a batch past what any frame carries with it), as the store says."""
        limit = self.max_frame_bytes
        setting = (
            f"the broker's max_frame_bytes={limit} (its welcome's limit; equeue serve "
            "--max-frame-bytes)"
        )
        if op == "send":
            return MessageTooLargeError(
                f"{self.where}: a message of a body of {_length(args.get('body'))} bytes is a "
                f"send request of {size} bytes, past {setting}: the broker takes a body of "
                "at most its store's max_message_size, below that"
            )
        if op not in ("send_batch", "send_bodies"):
            return FrameTooLargeError(
                f"{self.where}: a {op} request of {size} bytes exceeds {setting}"
            )
        for index, body in enumerate(_bodies(op, args)):
            if _length(body) > limit - MESSAGE_OVERHEAD:
                return MessageTooLargeError(
                    f"{self.where}: message {index} of the send_batch has a body of "
                    f"{_length(body)} bytes, more than any request carries with its "
                    f"message: {setting} less {MESSAGE_OVERHEAD} bytes; the broker takes a "
                    "body of at most its store's max_message_size, below that"
                )
        return FrameTooLargeError(
            f"{self.where}: a send_batch request of {size} bytes exceeds {setting}. {_SPLIT}"
        )


def _length(body: object) -> int:
    return len(body) if isinstance(body, bytes | bytearray | memoryview) else 0


def _bodies(op: str, args: dict[str, Any]) -> list[object]:
    """A batch request's bodies, in order (whatever shape request() gave it)."""
    items = args.get("bodies" if op == "send_bodies" else "messages")
    if type(items) is not list:
        return []
    if op == "send_bodies":
        return items
    return [item.get("body") if type(item) is dict else None for item in items]


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


def hello_frame(token: str | None, client_name: str, shm: str | None = None) -> bytes:
    hello = Hello(token=token, client=client_name, shm=shm)
    payload: bytes = msgpack.packb(hello.pack(), use_bin_type=True)
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


def unread(cause: BaseException | None) -> bool:
    """Whether a connection ended by ``cause`` ended with the broker's word that it served
    none of the requests it left unanswered (BrokerStoppingError, its drain's last frame:
    docs/protocol.md, "Stopping")."""
    return isinstance(cause, BrokerStoppingError)


def no_answer(cause: BaseException | None) -> str:
    """What a send in flight when its connection ended is, for its caller's error."""
    if unread(cause):
        return "was not served by the broker (not stored: safe to send again)"
    return "got no answer (it may be stored)"


def lost_in_flight(reason: str, messages: list[Any], cause: BaseException | None) -> EQueueError:
    """The ConnectionLostError of a request in flight when its connection ended: its
    sends ``unanswered`` (they may be stored), or, where the broker said it served none of
    them (``unread``), ``unsent`` (not stored: safe to send again)."""
    if not unread(cause):
        return lost(reason, messages, cause)
    error = lost(reason, [], cause)
    assert isinstance(error, ConnectionLostError)
    error.unsent = messages
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


def batch_results(results: list[SendResult], sent: dict[str, Any], where: str) -> list[SendResult]:
    """A send_batch's results (its request's arguments ``sent``): one per message, else
    ProtocolError for this request (a caller zipping messages with results would drop
    some; whether the messages were stored is unknown)."""
    count = len(sent["bodies"] if "bodies" in sent else sent["messages"])
    if len(results) != count:
        raise ProtocolError(
            f"{where}: {len(results)} SendResults answer a send_batch of {count} messages; "
            "which of them were stored is unknown"
        )
    return results


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


def _positions(value: object, where: str) -> dict[str, int]:
    if type(value) is not dict or not all(type(k) is str for k in value):
        raise ProtocolError(f"{where}: expected a map of str to uint")
    return {topic: _uint(position, where) for topic, position in value.items()}


def _map(value: object, where: str) -> dict[str, Any]:
    if type(value) is not dict:
        raise ProtocolError(f"{where}: expected a map, got {type(value).__name__}")
    return value


def _messages(value: object, where: str) -> list[Message]:
    return unpack_messages(value, where)


def _key_page(value: object, where: str) -> tuple[list[Message], int | None]:
    """A query_by_key_page answer, [messages, next]; or (a broker before version 4, sent
    query_by_key) the array of messages, all there is."""
    if (
        type(value) is list
        and len(value) == 2
        and (value[1] is None or (type(value[1]) is int and value[1] >= 0))
    ):
        return unpack_messages(value[0], where), value[1]
    return unpack_messages(value, where), None


def _deleted_group(value: object, where: str) -> DeletedGroup:
    """delete_group's answer: {"group": str, "offsets": uint, "topics": [str]}, and from a
    version-6 broker "unfinished" (str) when a step after the commit point failed."""
    found = _map(value, where)
    group, topics = found.get("group"), found.get("topics")
    unfinished = found.get("unfinished", "")
    if type(group) is not str or type(topics) is not list or type(unfinished) is not str:
        raise ProtocolError(
            f"{where}: a delete_group answer needs group and topics (and unfinished, if "
            "given, is a str)"
        )
    return DeletedGroup(
        group, _uint(found.get("offsets"), where), tuple(_strings(topics, where)), unfinished
    )


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
    "query_by_key_page": _key_page,
    "offset_for_time": _uint,
    "commit_offset": _none,
    "committed_offset": _optional_uint,
    "create_topic": _none,
    "topics": _strings,
    "deleted_topics": _positions,
    "queue_ids": _uints,
    "queue_range": _range,
    "stats": _map,
    "delete_group": _deleted_group,
}
