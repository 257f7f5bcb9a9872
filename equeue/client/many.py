"""``Client.send_many``: the messages in chunks of consecutive ones, each chunk one
request, at most ``window`` messages in flight.

A chunk of bodies alone (bytes) goes as ``send_bodies`` (to a broker of protocol version 1
as ``send_batch``, by the encoder), a chunk with a message map (tag, key, properties,
code, queue id) as ``send_batch``, a chunk of one message as ``send``. A chunk is half
the window (two requests in flight: PARTS), cut further so the broker never refuses
it for its size: at most the welcome's ``max_batch_messages`` messages and as many as
fit one ``max_frame_bytes`` frame, with their answer and their msgpack objects (_cut).

A chunk is all or nothing, as ``send_batch``: the store checks every message before it
appends any, so one bad message (a body past ``max_message_size``, a bad tag) refuses
its whole chunk. When one fails midway the error raised says what happened to each
message; ``sent``, ``unsent`` and ``unanswered`` are in the messages' order and together
hold every message once:

* ``sent``: the SendResults of the messages acknowledged;
* ``unsent``: the messages not stored: those of a refused chunk (an error answer, or a
  chunk the client could not encode: MessageTooLargeError for a message past
  ``max_frame_bytes``), those never written (the writing stops at the first error), and
  those of the chunks in flight when a stopping broker said it served none of them
  (BrokerStoppingError, the ConnectionLostError's cause);
* ``unanswered``: the messages written whose outcome is unknown, each may or may not be
  stored: their answer never came (ConnectionLostError), or it was a failed write or
  flush (StoreWriteError, which leaves them in the page cache: docs/durability.md) or
  a BrokerError.

After an error the chunks already in flight are still awaited (a later chunk may be
stored, and is then in ``sent``), so the report is complete when it is raised; the first
error is raised, or ConnectionLostError if the connection broke meanwhile.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any, Final, TypeVar, cast

from equeue.client import args
from equeue.client.calls import Call
from equeue.client.core import DECODERS, lost, unread
from equeue.errors import (
    BrokerError,
    ConnectionLostError,
    EQueueError,
    InvalidMessageError,
    ProtocolError,
    StoreWriteError,
)
from equeue.protocol.bounded import SEND_BATCH_OBJECTS, max_objects, message_objects
from equeue.protocol.frames import ANSWER_OVERHEAD, DEFAULT_MAX_BATCH_MESSAGES, SEND_RESULT_OVERHEAD
from equeue.store.types import SendResult

if TYPE_CHECKING:
    from equeue.client.sync import Client, _Connection, _Slot
    from equeue.protocol.handshake import Welcome

# A chunk is this part of the window: requests in flight at once. 2 against 4, alternated
# (window 100, 100 B): client 1.8-2.4 us a message against 2.2-3.1, broker 1.9-2.4
# against 2.2-3.2 (tools/bench_send_many.py); two keep the broker busy while the client
# makes the next chunk. 1 (the whole window one request, nothing overlapped) cost less
# CPU at 100 B (1.22 / 1.35 against 1.52 / 1.60) and the same at 1 KiB, at rates alike on
# a loaded machine (load 11); kept at 2 for the overlap where a core is free.
PARTS: Final = 2
# A request frame's bytes around its messages, the topic aside (header, id, op, the args
# map and its keys, the array's header); a bound, not a count.
REQUEST_BYTES: Final = 64
# A body's bytes beyond its own: a bin header (5), and as a version-1 send_batch map
# (the encoder's fallback) a map header and its "body" key (6).
BODY_BYTES: Final = 11
# Answered after appending anything, or for a reason unknown: maybe stored.
MAYBE_STORED: Final = (StoreWriteError, BrokerError)

Failure = TypeVar("Failure", bound=BaseException)  # an EQueueError, or an interrupt
Wire = bytes | dict[str, Any]  # a body alone, or a message's wire map


def send_many(client: Client, topic: str, messages: object, window: int) -> list[SendResult]:
    if not args.is_int(window) or window < 1:
        raise InvalidMessageError(f"window must be an int >= 1, got {window!r}")
    name = args.topic(topic)
    items = args.batch_items(messages)
    # An interrupt (KeyboardInterrupt, or what a signal handler raises) gets the three
    # lists too (reviewk F8); one before the messages were taken in (a generator's items
    # being taken) wrote nothing and gets none.
    run: _Run | None = None
    try:
        try:
            plain = set(map(type, items)) <= {bytes}  # (at C speed: bodies alone, the usual)
            wire = cast("list[Wire]", items) if plain else [_wire(item, name) for item in items]
            welcome = _welcome(client)
        except EQueueError as exc:  # nothing was written
            raise _report(exc, [], items, [], [], 0) from None
        run = _Run(client, name, items, wire, int(window), plain)
        return run.go(welcome)
    except EQueueError:
        raise  # (its lists set)
    except BaseException as exc:
        if run is None:
            _report(exc, [], items, [], [], 0)
        else:
            run.report_interrupt(exc)
        raise


def _wire(item: object, name: str) -> Wire:
    if type(item) is bytes:
        return item
    if isinstance(item, bytearray | memoryview):
        return bytes(item)
    return args.outgoing(item, name)


def _welcome(client: Client) -> Welcome:
    """The connection's welcome (connecting first if the last connection broke)."""
    welcome = client.welcome
    if welcome is None:
        with client._write_lock:
            welcome = client._connection().welcome
    return welcome


class _Run:
    """One send_many: what is written, in flight, answered, refused."""

    def __init__(
        self,
        client: Client,
        topic: str,
        items: list[Any],
        wire: list[Wire],
        window: int,
        bodies_only: bool,
    ) -> None:
        self.client = client
        self.topic = topic
        self.items = items
        self.wire = wire
        self.window = window
        self.bodies_only = bodies_only or all(type(w) is bytes for w in wire)
        self._cuts: tuple[int, Welcome | None, int] = (-1, None, 0)
        self.results: list[SendResult | None] = [None] * len(items)
        self.refused: list[tuple[int, int]] = []  # chunks that stored nothing
        self.maybe: list[tuple[int, int]] = []  # written, outcome unknown
        self.written = 0  # messages before this one were written (or refused unwritten)
        self.writing = 0  # the end of the chunk being written (an interrupt: maybe written)

    def go(self, welcome: Welcome) -> list[SendResult]:
        client, count = self.client, len(self.items)
        in_flight: deque[tuple[int, int, str, _Slot]] = deque()
        held = 0  # messages in flight
        conn: _Connection | None = None
        failure: EQueueError | None = None
        while True:
            while failure is None and self.written < count:  # write what fits
                if not in_flight:  # (the next write may connect again: its limits)
                    welcome = client.welcome or welcome
                if len(in_flight) >= welcome.limits["max_in_flight"]:
                    break
                start = self.written
                end = self._cut(start, welcome)
                if in_flight and held + end - start > self.window:
                    break
                call = self._call(start, end)
                self.writing = end
                try:  # (a connection that broke under chunks in flight is not replaced)
                    conn, (slot,) = client._submit([call], conn if in_flight else None)
                except ConnectionLostError as exc:  # nothing of this chunk was written
                    failure = exc
                except EQueueError as exc:  # the encoder refused it (its size): not written
                    failure = exc
                    self.refused.append((start, end))
                    self.written = end
                else:
                    in_flight.append((start, end, call.op, slot))
                    held += end - start
                    self.written = end
            if not in_flight:
                break
            assert conn is not None  # (set by the write that put the slots in flight)
            first = True  # wait for the oldest, then take every one answered behind it
            while in_flight and (first or in_flight[0][3].done):
                first = False
                start, end, op, slot = in_flight.popleft()
                held -= end - start
                error = self._answer(conn, start, end, op, slot)
                if isinstance(error, ConnectionLostError):
                    failure = error  # every request on it failed with it, or was answered
                    # before (the broker's drain answers all it served, then says so): each
                    # one's outcome, as this one's (a slot of a broken connection is done)
                    for s, e, o, later in in_flight:
                        self._answer(conn, s, e, o, later)
                    in_flight.clear()
                elif error is not None and failure is None:
                    failure = error  # stop writing; the rest in flight are still awaited
        if failure is None:
            return self.results  # type: ignore[return-value]  # (every one is filled)
        sent = [result for result in self.results if result is not None]
        raise _report(failure, sent, self.items, self.refused, self.maybe, self.written)

    def report_interrupt(self, exc: BaseException) -> None:
        """An interrupt (KeyboardInterrupt, an exception a signal handler raised) ended
        the run: ``sent``, ``unsent`` and ``unanswered`` on it, as on an EQueueError. A
        message with no result, written or being written (in flight, its answer being
        read, its write interrupted), is unanswered: the interrupt breaks the connection,
        and the broker may have stored it; the rest were never written."""
        frontier = max(self.written, self.writing)
        refused: set[int] = set()
        for start, end in self.refused:
            refused.update(range(start, end))
        results = self.results
        maybe = [
            (i, i + 1) for i in range(frontier) if results[i] is None and i not in refused
        ]  # fmt: skip
        sent = [result for result in results if result is not None]
        _report(exc, sent, self.items, self.refused, maybe, frontier)

    def _answer(
        self, conn: _Connection, start: int, end: int, op: str, slot: _Slot
    ) -> EQueueError | None:
        """The chunk's results into ``results``, or its error (its messages refused or
        maybe stored, as the error says)."""
        client = self.client
        try:
            payload = client._wait(conn, slot)
        except ConnectionLostError as exc:  # unsent where the broker said it served none
            (self.refused if unread(exc.__cause__) else self.maybe).append((start, end))
            return exc
        except EQueueError as exc:
            (self.maybe if isinstance(exc, MAYBE_STORED) else self.refused).append((start, end))
            return exc
        try:
            found = DECODERS[op](payload, client.url)
            results = [found] if op == "send" else found
            if len(results) != end - start:
                raise ProtocolError(
                    f"{client.url}: {len(results)} results to a {op} of {end - start} messages"
                )
        except ProtocolError as exc:  # stored or not: the broker cannot be followed
            text = f"the broker at {client.url} broke the protocol: {exc}"
            client._break(conn, text, exc)
            self.maybe.append((start, end))
            return lost(text, [], exc)
        self.results[start:end] = results
        return None

    def _call(self, start: int, end: int) -> Call:
        wire, given = self.wire, self.items[start:end]
        if end - start == 1:
            one = wire[start]
            fields: dict[str, Any] = {"body": one} if isinstance(one, bytes) else dict(one)
            fields["topic"] = self.topic
            return Call("send", fields, given)
        part = wire[start:end]
        if self.bodies_only or all(type(w) is bytes for w in part):
            return Call("send_bodies", {"topic": self.topic, "bodies": part}, given)
        maps = [{"body": w} if type(w) is bytes else w for w in part]
        return Call("send_batch", {"topic": self.topic, "messages": maps}, given)

    def _cut(self, start: int, welcome: Welcome) -> int:
        """The end of the chunk from ``start``: a part of the window, within the broker's
        limits (a message too large alone is a chunk alone, refused by the encoder)."""
        cut = self._cuts  # (a chunk that did not fit the window yet is cut again)
        if cut[0] == start and cut[1] is welcome:
            return cut[2]
        end = self._cut_anew(start, welcome)
        self._cuts = (start, welcome, end)
        return end

    def _cut_anew(self, start: int, welcome: Welcome) -> int:
        limits = welcome.limits
        frame = limits["max_frame_bytes"]
        topic_bytes = len(self.topic.encode())
        batch = limits.get("max_batch_messages", DEFAULT_MAX_BATCH_MESSAGES)
        answers = (frame - ANSWER_OVERHEAD) // (SEND_RESULT_OVERHEAD + topic_bytes)
        most = max(1, min(self.window // PARTS, batch, answers))
        end = min(start + most, len(self.wire))
        room = frame - REQUEST_BYTES - topic_bytes
        objects = max_objects(batch) - SEND_BATCH_OBJECTS
        part = self.wire[start:end]
        if self.bodies_only:
            if (max(map(len, part)) + BODY_BYTES) * len(part) <= room:
                return end
            objects = 1 << 62  # (a body is a few objects: the count bounds them)
        for index, one in enumerate(part):
            if isinstance(one, bytes):
                room -= len(one) + BODY_BYTES
                objects -= 4
            else:
                room -= _packed_bound(one)
                objects -= message_objects(one)
            if room < 0 or objects < 0:
                return start + max(index, 1)
        return end


def _packed_bound(fields: dict[str, Any]) -> int:
    """At least the msgpack size of a message's wire map (a str at 4 bytes a character)."""
    size = 1
    for key, value in fields.items():
        size += len(key) + 1
        if type(value) is bytes:
            size += len(value) + 5
        elif type(value) is str:
            size += 4 * len(value) + 5
        elif type(value) is dict:
            size += 5 + sum(4 * (len(k) + len(v)) + 10 for k, v in value.items())
        else:
            size += 9
    return size


def _report(
    failure: Failure,
    sent: list[SendResult],
    items: list[Any],
    refused: list[tuple[int, int]],
    maybe: list[tuple[int, int]],
    written: int,
) -> Failure:
    """``failure`` with what happened to each message set on it."""
    unsent = [items[i] for start, end in sorted(refused) for i in range(start, end)]
    unsent += items[written:]
    unanswered = [items[i] for start, end in sorted(maybe) for i in range(start, end)]
    # (an EQueueError declares the three; an interrupt's instance takes them as any object)
    failure.sent = sent  # type: ignore[attr-defined]
    failure.unsent = unsent  # type: ignore[attr-defined]
    failure.unanswered = unanswered  # type: ignore[attr-defined]
    return failure
