"""The asyncio client's plain sends, coalesced per loop turn (protocol version 2).

While requests are in flight, ``send(topic, body)`` calls without other arguments made
in one loop turn go to the broker as one ``send_bodies`` request per topic (in their
order; a group holds at most ``max_in_flight`` and ``max_batch_messages`` sends and half
``max_frame_bytes`` of bodies), instead of a request each: the broker appends them with
one ``send_batch`` and answers in columns, each caller gets its own SendResult, as
MessageStore.send would give it in that order (the queues are chosen per message, round
robin, either way).

Errors stay per send. A group the store refuses whole before appending anything (a
body too large, a reserved or missing topic, a limit) is sent again one request per
send, so each caller gets its own answer (nothing of the group was stored: send_batch
checks every message first); a caller cancelled while its send waits for a place again
is not sent. Any other error (a failed write or flush, a refused store path) is every
send's of the group, as it would be for each alone: each caller gets its own instance of
it (``_twin``). A broken connection raises ConnectionLostError in each caller, an
instance of its own naming its send's place in the group, with its message as
``unanswered`` (written: it may be stored) or ``unsent`` (the group not yet written).

Each coalesced send holds a place of ``max_in_flight`` until its group is answered, so
the client never has more requests in flight than the broker allows.
"""

from __future__ import annotations

import asyncio
import time
from asyncio import InvalidStateError
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final

from equeue import speedups
from equeue.client.core import DECODERS, answer_error, lost, lost_in_flight, no_answer
from equeue.client.loops import future_of, wrong_loop
from equeue.errors import (
    ConnectionLostError,
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
# An idle connection silent for longer is asked whether its end waits unread before a
# send (AsyncClient._call: input_waiting); heard from more recently, it was alive as good
# as now (the broker may go away just after either).
HEARD_RECENTLY: Final = 0.02
# A group may be written as soon as it holds PART_SENDS sends, not at the end of its loop
# turn: the broker then appends it (and under --flush sync starts its fdatasync) while the
# client still steps the turn's other tasks. 0: at the turn's end (the default). Measured
# at 16 and 32 with 64 tasks sharing a client (docs/benchmarks.md, "perfshared"): more
# requests, reads and fdatasyncs a send (the broker's CPU a send +0.5 to +1.5 µs, the
# client's +0.6 to +1.8 k instructions) and no rate resolved above 0 on tmpfs; the disk
# was too loaded to show what the overlap gains there.
PART_SENDS: Final = 0
_decode_send = DECODERS["send"]
_decode_bodies = DECODERS["send_bodies"]
_fast = speedups.SPEEDUPS


def _set_each(
    futures: list[asyncio.Future[SendResult]], results: list[SendResult], now: bool
) -> None:
    for future, result in zip(futures, results, strict=True):
        try:  # noqa: SIM105  (suppress() would be a context manager per send)
            future.set_result(result)
        except InvalidStateError:  # its caller was cancelled
            pass


# A coalesced send's future, and a group's results given to its callers: with the
# accelerator a Waiter whose task group_wake runs at once inside the read, as a direct
# send's is (equeue/cext/groupwake.c: no call_soon Handle per caller); else an
# asyncio.Future and set_result.
_future: Callable[[_Protocol], asyncio.Future[Any] | None] = (
    future_of if _fast is None else _fast.group_future
)
_wake: Callable[[list[asyncio.Future[SendResult]], list[SendResult], bool], None] = (
    _set_each if _fast is None else _fast.group_wake
)

# (the body, its caller's future, the send as given: calls.send's tuple, or None for a
# plain send of the body alone)
Sub = tuple[bytes, "asyncio.Future[SendResult]", tuple[Any, ...] | None]


class _PyGroup:
    """One topic's sends of this loop turn: their bodies and callers, in order."""

    __slots__ = ("bodies", "futures", "size")

    def __init__(self, body: bytes, future: asyncio.Future[SendResult]) -> None:
        self.bodies = [body]
        self.futures = [future]
        self.size = len(body) + BODY_OVERHEAD


class _PyCoalescerBase:
    """CoalescerBase's fields (equeue/cext/coalesceadd.c: its ``add`` the per-send cases in
    C, the rest handed to ``add_slow``) without the accelerator, where ``add`` is
    ``add_slow`` itself."""

    __slots__ = ("_protocol", "budget", "groups", "most", "part", "sealed")

    _protocol: _Protocol
    groups: dict[str, _PyGroup]  # the open group of each topic
    sealed: list[tuple[str, _PyGroup]]  # full ones, still to be written
    budget: int
    most: int
    part: int

    if TYPE_CHECKING:

        def add(self, topic: str, body: bytes) -> asyncio.Future[SendResult] | None: ...


# With the accelerator the group is C's too (coalesceadd.c makes it), the same fields.
if TYPE_CHECKING:
    _Base = _PyCoalescerBase
    _Group = _PyGroup
else:
    _Base, _Group = (
        (_PyCoalescerBase, _PyGroup) if _fast is None else _fast.client_coalescer_types()
    )


class Coalescer(_Base):
    """The sends of the current loop turn, by topic; ``emit`` turns them into requests.

    A send made while nothing is in flight or begun goes alone, as a ``send`` written
    at once (the first of a burst is not held back for the others; one send at a time
    stays one request and one write each, with no callback of the loop between), unless
    a write is due this turn: the callers woken together (``woken_together``) send next
    as one group."""

    __slots__ = ()

    def __init__(self, protocol: _Protocol, max_frame_bytes: int, max_batch_messages: int) -> None:
        self._protocol = protocol
        self.groups = {}
        self.sealed = []
        self.budget = max_frame_bytes // 2
        # sends a group holds: a place each, and a request the encoder does not refuse
        self.most = min(protocol.max_in_flight, max_batch_messages)
        self.part = PART_SENDS  # a group of this many is written at once (0: at turn end)

    def add_slow(self, topic: str, body: bytes) -> asyncio.Future[SendResult] | None:
        """A plain send of ``body``, taking a place (one is free): its caller's future;
        None (no place taken) for an idle connection not heard from recently, whose
        send goes as any request (after its check for an end waiting unread). ``add``:
        this, or with the accelerator its common cases in C (coalesceadd.c), the rest
        handed here."""
        protocol = self._protocol
        groups = self.groups
        group = groups.get(topic)
        if group is not None:
            size = group.size + len(body) + BODY_OVERHEAD
            if size <= self.budget and len(group.futures) < self.most:
                # _future: a future of the running loop, if it is the connection's (one
                # C call; Future(loop=...) would build a keyword dict per send)
                future: asyncio.Future[SendResult] | None = _future(protocol)
                if future is None:
                    raise wrong_loop(protocol.loop, protocol.where)
                group.bodies.append(body)
                futures = group.futures
                futures.append(future)
                group.size = size
                protocol.free -= 1
                if len(futures) == self.part:
                    self.emit()  # (every group of the turn so far, in the order begun)
                    protocol.write_out()
                return future
            self.sealed.append((topic, group))
        elif not groups and not self.sealed and not protocol.pending and not protocol.flushing:
            # alone (no write due this turn)
            if protocol.heard < time.monotonic() - HEARD_RECENTLY:
                return None
            future = _future(protocol)
            if future is None:
                raise wrong_loop(protocol.loop, protocol.where)
            protocol.free -= 1
            self._request(topic, [body], [future], None)
            protocol.write_now()
            return future
        future = _future(protocol)
        if future is None:
            raise wrong_loop(protocol.loop, protocol.where)
        groups[topic] = _Group(body, future)
        protocol.free -= 1
        if not protocol.flushing:
            protocol.schedule()
        return future

    def emit(self) -> None:
        """Every group as a request frame, in the order the groups were begun."""
        if not self.groups and not self.sealed:
            return
        groups = self.sealed + list(self.groups.items())
        self.sealed = []
        self.groups = {}
        for topic, group in groups:
            self._request(topic, group.bodies, group.futures, None)

    def drop(self, reason: str, cause: BaseException | None = None) -> None:
        """The connection broke before the turn's groups were written: none was sent;
        each caller's own error names its send (``unsent``) and its place in the group,
        its ``__cause__`` what ended the connection."""
        groups = self.sealed + list(self.groups.items())
        self.sealed, self.groups = [], {}
        for topic, group in groups:
            count = len(group.futures)
            for index, (body, future) in enumerate(zip(group.bodies, group.futures, strict=True)):
                if not future.done():  # (its caller may have been cancelled)
                    future.set_exception(
                        unsent(
                            f"{reason}; {_which(index, count, topic)} was not written",
                            body,
                            None,
                            cause,
                        )
                    )

    def request(self, topic: str, group: list[Sub]) -> None:
        bodies = [sub[0] for sub in group]
        self._request(topic, bodies, [sub[1] for sub in group], [sub[2] for sub in group])

    def _request(
        self,
        topic: str,
        bodies: list[bytes],
        futures: list[asyncio.Future[SendResult]],
        givens: list[tuple[Any, ...] | None] | None,
    ) -> None:
        protocol = self._protocol
        encoder = protocol.encoder
        assert encoder is not None
        request_id = protocol.next_id()
        single = len(bodies) == 1
        try:
            if single:
                frame = encoder.frame(request_id, "send", {"topic": topic, "body": bodies[0]})
            else:
                frame = encoder.frame(request_id, "send_bodies", {"topic": topic, "bodies": bodies})
        except EQueueError as exc:  # (a body past max_frame_bytes: a group of one)
            protocol.give_back(len(bodies))
            _fail(futures, exc)
            return
        if not single and _fast is not None:  # its answer read in C (AnswerReader.columns)
            protocol.reader.columns.add(request_id)
        protocol.put(request_id, frame, Answer(self, topic, bodies, futures, givens, request_id))

    async def resend(self, topic: str, group: Sequence[Sub]) -> None:
        """Each send of a group refused whole, alone (each holds a place again)."""
        protocol = self._protocol
        for sub in group:
            if sub[1].done():  # its caller was cancelled: it is not sent
                continue
            await protocol.place()
            if sub[1].done():  # cancelled while it waited
                continue
            if protocol.closed:
                sub[1].set_exception(
                    unsent(
                        f"the connection to {protocol.where} broke; the send to topic "
                        f"{topic!r} (refused in a group, to be sent alone) was not written",
                        sub[0],
                        sub[2],
                    )
                )
                continue
            protocol.free -= 1
            self.request(topic, [sub])
            protocol.schedule()


if _fast is None:
    Coalescer.add = Coalescer.add_slow  # type: ignore[method-assign,assignment]


class _PyAnswerBase:
    """AnswerBase's fields (equeue/cext/groupanswer.c: its ``answered`` the plain case in
    C, the rest handed to ``answered_slow``) without the accelerator, where ``answered``
    is ``answered_slow`` itself."""

    __slots__ = ("bodies", "coalescer", "futures", "givens", "request_id", "topic")

    coalescer: Coalescer
    topic: str
    bodies: list[bytes]
    futures: list[asyncio.Future[SendResult]]
    givens: list[tuple[Any, ...] | None] | None  # None: every send of the body alone
    request_id: int

    if TYPE_CHECKING:

        def answered(self, status: int, payload: Any) -> None: ...


if TYPE_CHECKING:
    _AnswerBase = _PyAnswerBase
else:
    _AnswerBase = _PyAnswerBase if _fast is None else _fast.client_answer_type()


class Answer(_AnswerBase):
    """A group's request in flight: its answer, or its connection's end, to each caller
    (called by the protocol as it reads the answer: no future of its own)."""

    __slots__ = ()

    def __init__(
        self,
        coalescer: Coalescer,
        topic: str,
        bodies: list[bytes],
        futures: list[asyncio.Future[SendResult]],
        givens: list[tuple[Any, ...] | None] | None,
        request_id: int,
    ) -> None:
        self.coalescer, self.topic, self.bodies, self.futures = coalescer, topic, bodies, futures
        self.givens = givens
        self.request_id = request_id

    def subs(self) -> list[Sub]:
        givens = self.givens or [None] * len(self.bodies)
        return list(zip(self.bodies, self.futures, givens, strict=True))

    def lost(self, reason: str, cause: BaseException | None) -> None:
        subs = self.subs()
        count = len(subs)
        for index, (body, future, given) in enumerate(subs):
            if not future.done():
                sent = _message(body, given)
                which = _which(index, count, self.topic)
                future.set_exception(
                    lost_in_flight(f"{reason}; {which} {no_answer(cause)}", [sent], cause)
                )

    def answered_slow(self, status: int, payload: Any) -> None:
        """The group's answer to each caller. ``answered``: this, or with the accelerator
        its plain case in C (groupanswer.c: STATUS_OK, results read in C, no caller
        waiting for a place), the rest handed here."""
        futures = self.futures
        count = len(futures)
        protocol = self.coalescer._protocol
        if count > 1:
            protocol.give_back(count - 1)  # (the request's own place: answers())
            protocol.reader.columns.discard(self.request_id)
        if status != STATUS_OK:
            error = answer_error(payload, protocol.where)
            if count > 1 and isinstance(error, REFUSED_WHOLE):
                pending = [sub for sub in self.subs() if not sub[1].done()]
                protocol.loop.create_task(self.coalescer.resend(self.topic, pending))
                return
            _fail(futures, error)
            return
        try:
            if count == 1:
                results: list[SendResult] = [_decode_send(payload, protocol.where)]
            else:
                results = _decode_bodies(payload, protocol.where)
                if len(results) != count:
                    raise ProtocolError(
                        f"{protocol.where}: {len(results)} results for a send_bodies of {count}"
                    )
        except ProtocolError as error:
            _fail(futures, error)
            protocol.fail(f"the broker at {protocol.where} broke the protocol: {error}", error)
            return
        # (run at once unless a caller waits for a place: the first released keeps its
        # turn, as through call_soon)
        if count == 1 or protocol.flushing:
            _wake(futures, results, not protocol.queued)
        else:
            woken_together(protocol, _wake, futures, results, not protocol.queued)


if _fast is None:
    Answer.answered = Answer.answered_slow  # type: ignore[method-assign,assignment]


def woken_together(protocol: _Protocol, wake: Callable[..., None], *args: Any) -> None:
    """``wake(*args)``, whose callers (a group's, or a read's answers') are a burst: their
    next sends, made as they are woken (at once inside the read, or in the loop's next
    pass), find a write due, so none goes alone (the direct path, or ``add``'s lone send)
    and all go in the turn's group, written by the ``_flush`` scheduled after their
    wake-ups. Else the first would go alone at once and the rest after it: two requests
    a turn, which the broker often covers by two fdatasyncs (docs/client.md, "The next
    sends of callers woken together")."""
    protocol.flushing = True
    try:
        wake(*args)
    finally:
        protocol.flushing = False
        if not protocol.closed:
            protocol.schedule()


def _fail(futures: list[asyncio.Future[SendResult]], error: BaseException) -> None:
    first = True
    for future in futures:
        if not future.done():
            future.set_exception(error if first else _twin(error))
            first = False


def _which(index: int, count: int, topic: str) -> str:
    """The send's place in its request, for its caller's error."""
    if count == 1:
        return f"the send to topic {topic!r}"
    return f"send {index + 1} of {count} coalesced into one request to topic {topic!r}"


def _message(body: bytes, given: tuple[Any, ...] | None) -> OutgoingMessage:
    """A send as its caller gave it: calls.send's fields, or the body of a plain send (a
    given of another shape, too: the error must not fail while it is built)."""
    if given is None or len(given) != len(OutgoingMessage._fields):
        return OutgoingMessage(body)
    return OutgoingMessage._make(given)


def unsent(
    reason: str, body: bytes, given: tuple[Any, ...] | None, cause: BaseException | None = None
) -> EQueueError:
    """ConnectionLostError for a send not written: ``unsent`` its message, as given."""
    error = lost(reason, [], cause)
    assert isinstance(error, ConnectionLostError)
    error.unsent = [_message(body, given)]
    return error


def _twin(error: BaseException) -> BaseException:
    """Another instance of ``error``, for another caller (one raised in several tasks
    would gather each one's traceback). Built as faults.unpack_error builds an error from
    the wire, without its __init__: copy.copy calls ``cls(*args)``, which fails for a
    class taking keyword arguments (StorePathError's file=), and would leave the rest of
    the group unanswered."""
    cls = type(error)
    try:
        twin = cls.__new__(cls, *error.args)
        # (OSError.__new__ leaves args empty for a class with an __init__ of its own, as
        # ConnectionLostError and StoreWriteError have: the message would be lost)
        twin.args = error.args
        if isinstance(error, OSError):
            for name in ("errno", "strerror", "filename", "filename2"):
                if getattr(error, name) is not None:  # (a None set would show in str())
                    setattr(twin, name, getattr(error, name))
        twin.__dict__.update(
            (name, list(value) if type(value) is list else value)  # (unanswered: its own)
            for name, value in error.__dict__.items()
        )
    except Exception:  # (a class no error of ours is): the callers share the one
        return error
    twin.__cause__ = error.__cause__
    return twin
