"""The asyncio client's plain sends, coalesced per loop turn (protocol version 2).

While requests are in flight, ``send(topic, body)`` calls without other arguments made
in one loop turn go to the broker as one ``send_bodies`` request per topic (in their
order; a group holds at most ``max_in_flight`` sends and half ``max_frame_bytes`` of
bodies), instead of a request each: the broker appends them with one ``send_batch``
and answers in columns, each caller gets its own SendResult, as MessageStore.send would
give it in that order (the queues are chosen per message, round robin, either way).

Errors stay per send. A group the store refuses whole before appending anything (a
body too large, a reserved or missing topic, a limit) is sent again one request per
send, so each caller gets its own answer (nothing of the group was stored: send_batch
checks every message first); a caller cancelled while its send waits for a place again
is not sent. Any other error (a failed write or flush, a refused store path) is every
send's of the group, as it would be for each alone: each caller gets its own instance of
it (``_twin``). A broken connection raises ConnectionLostError in each caller with its
own message as ``unanswered``.

Each coalesced send holds a place of ``max_in_flight`` until its group is answered, so
the client never has more requests in flight than the broker allows.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Final

from equeue.client.core import DECODERS, answer_error, lost
from equeue.errors import (
    EQueueError,
    InvalidMessageError,
    InvalidTypeError,
    LimitExceededError,
    ProtocolError,
    QueueNotFoundError,
    TopicNotFoundError,
)
from equeue.protocol.frames import STATUS_OK
from equeue.store.types import OutgoingMessage, SendResult

if TYPE_CHECKING:
    from equeue.client.aio import _Protocol

# Refused before anything was appended: each send of the group is tried alone.
REFUSED_WHOLE: Final = (
    InvalidMessageError, InvalidTypeError, TopicNotFoundError, QueueNotFoundError,
    LimitExceededError,
)  # fmt: skip
BODY_OVERHEAD: Final = 5  # a bin's header at most

# (the body, its caller's future, the send as given: calls.send's tuple, or None for a
# plain send of the body alone)
Sub = tuple[bytes, "asyncio.Future[SendResult]", tuple[Any, ...] | None]


class Coalescer:
    """The sends of the current loop turn, by topic; ``emit`` turns them into requests.

    A send made while nothing is in flight or begun goes alone, as a ``send`` (the
    first of a burst is not held back for the others; one send at a time stays one
    request each)."""

    __slots__ = ("_bytes", "_groups", "_new_future", "_protocol", "_sealed", "budget")

    def __init__(self, protocol: _Protocol, max_frame_bytes: int) -> None:
        self._protocol = protocol
        self._groups: dict[str, list[Sub]] = {}
        self._bytes: dict[str, int] = {}
        self._sealed: list[tuple[str, list[Sub]]] = []
        self.budget = max_frame_bytes // 2
        self._new_future = protocol.loop.create_future

    @property
    def begun(self) -> bool:
        """Whether sends wait for this loop turn's end to be written."""
        return bool(self._groups or self._sealed)

    def add(self, topic: str, body: bytes) -> asyncio.Future[SendResult]:
        """A plain send of ``body`` (its place already taken): its caller's future."""
        protocol = self._protocol
        future: asyncio.Future[SendResult] = self._new_future()
        groups = self._groups
        group = groups.get(topic)
        size = len(body) + BODY_OVERHEAD
        if group is None:
            if not protocol.pending and not groups and not self._sealed:  # alone
                self._sealed.append((topic, [(body, future, None)]))
                if not protocol.flushing:
                    protocol.schedule()
                return future
            group = groups[topic] = []
            self._bytes[topic] = size
        else:
            total = self._bytes[topic] + size
            if total > self.budget or len(group) >= protocol.max_in_flight:
                self._sealed.append((topic, group))
                group = groups[topic] = []
                total = size
            self._bytes[topic] = total
        group.append((body, future, None))
        if not protocol.flushing:
            protocol.schedule()
        return future

    def emit(self) -> None:
        """Every group as a request frame, in the order the groups were begun."""
        if not self._groups and not self._sealed:
            return
        groups = self._sealed + list(self._groups.items())
        self._sealed = []
        self._groups = {}
        self._bytes = {}
        for topic, group in groups:
            self.request(topic, group)

    def drop(self, reason: str) -> None:
        """The connection broke before the turn's groups were written: none was sent."""
        groups = self._sealed + list(self._groups.items())
        self._sealed, self._groups, self._bytes = [], {}, {}
        for _, group in groups:
            _fail(group, lost(f"{reason}; the send was not written", [], None))

    def request(self, topic: str, group: list[Sub]) -> None:
        protocol = self._protocol
        encoder = protocol.encoder
        assert encoder is not None
        request_id = protocol.next_id()
        single = len(group) == 1
        try:
            if single:
                frame = encoder.frame(request_id, "send", {"topic": topic, "body": group[0][0]})
            else:
                bodies = [sub[0] for sub in group]
                frame = encoder.frame(request_id, "send_bodies", {"topic": topic, "bodies": bodies})
        except EQueueError as exc:  # (a body past max_frame_bytes: a group of one)
            protocol.give_back(len(group))
            _fail(group, exc)
            return
        protocol.put(request_id, frame, Answer(self, topic, group, single))

    async def resend(self, topic: str, group: list[Sub]) -> None:
        """Each send of a group refused whole, alone (each holds a place again)."""
        protocol = self._protocol
        for sub in group:
            if sub[1].done():  # its caller was cancelled: it is not sent
                continue
            await protocol.place()
            if sub[1].done():  # cancelled while it waited
                continue
            if protocol.closed:
                sub[1].set_exception(lost(f"the connection to {protocol.where} broke", [], None))
                continue
            protocol.free -= 1
            self.request(topic, [sub])
            protocol.schedule()


def _outgoing(sub: Sub) -> OutgoingMessage:
    return OutgoingMessage(sub[0]) if sub[2] is None else OutgoingMessage._make(sub[2])


class Answer:
    """A group's request in flight: its answer, or its connection's end, to each caller
    (called by the protocol as it reads the answer: no future of its own)."""

    __slots__ = ("coalescer", "group", "single", "topic")

    def __init__(self, coalescer: Coalescer, topic: str, group: list[Sub], single: bool) -> None:
        self.coalescer, self.topic, self.group, self.single = coalescer, topic, group, single

    def lost(self, reason: str, cause: BaseException | None) -> None:
        for sub in self.group:
            if not sub[1].done():
                sub[1].set_exception(lost(reason, [_outgoing(sub)], cause))

    def answered(self, status: int, payload: Any) -> None:
        group = self.group
        protocol = self.coalescer._protocol
        if len(group) > 1:
            protocol.give_back(len(group) - 1)  # (the request's own place: answers())
        if status != STATUS_OK:
            error = answer_error(payload, protocol.where)
            if len(group) > 1 and isinstance(error, REFUSED_WHOLE):
                pending = [sub for sub in group if not sub[1].done()]
                protocol.loop.create_task(self.coalescer.resend(self.topic, pending))
                return
            _fail(group, error)
            return
        try:
            if self.single:
                results: list[SendResult] = [DECODERS["send"](payload, protocol.where)]
            else:
                results = DECODERS["send_bodies"](payload, protocol.where)
                if len(results) != len(group):
                    raise ProtocolError(
                        f"{protocol.where}: {len(results)} results for a send_bodies of "
                        f"{len(group)}"
                    )
        except ProtocolError as error:
            _fail(group, error)
            protocol.fail(f"the broker at {protocol.where} broke the protocol: {error}", error)
            return
        for sub, result in zip(group, results, strict=True):
            future = sub[1]
            if not future.done():
                future.set_result(result)


def _fail(group: list[Sub], error: BaseException) -> None:
    first = True
    for _, future, _ in group:
        if not future.done():
            future.set_exception(error if first else _twin(error))
            first = False


def _twin(error: BaseException) -> BaseException:
    """Another instance of ``error``, for another caller (one raised in several tasks
    would gather each one's traceback). Built as faults.unpack_error builds an error from
    the wire, without its __init__: copy.copy calls ``cls(*args)``, which fails for a
    class taking keyword arguments (StorePathError's file=), and would leave the rest of
    the group unanswered."""
    cls = type(error)
    try:
        twin = cls.__new__(cls, *error.args)
        twin.__dict__.update(
            (name, list(value) if type(value) is list else value)  # (unanswered: its own)
            for name, value in error.__dict__.items()
        )
    except Exception:  # (a class no error of ours is): the callers share the one
        return error
    twin.__cause__ = error.__cause__
    return twin
