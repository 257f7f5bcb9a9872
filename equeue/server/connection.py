"""One client connection: frames in, requests to the handlers, answers out.

``asyncio.BufferedProtocol``, not streams: every frame of one read is parsed and
answered before its answers leave in one ``transport.write``; reads land in one buffer
per event-loop thread. Past ``write_buffer_high`` bytes of answers the client has not
read, reading it pauses (backpressure.py). A frame that is not the
protocol closes this connection only, after an error answer with request id 0 and one
log line.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, cast

from equeue import speedups
from equeue.errors import (
    EQueueError,
    LimitExceededError,
    ProtocolError,
)
from equeue.protocol.bounded import OBJECTS_PER_MESSAGE, Refused, decode_request, max_objects
from equeue.protocol.faults import pack_error
from equeue.protocol.frames import (
    CONNECTION_REQUEST_ID,
    FRAME_HEADER,
    FRAME_HEADER_SIZE,
    HELLO_MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    STATUS_ERROR,
    STATUS_OK,
    FrameReader,
    check_request,
    encode,
)
from equeue.protocol.ops import check_args, ops_above, refuse_above
from equeue.protocol.records import pack_send_result
from equeue.protocol.retries import RESERVED_PREFIX
from equeue.server import backpressure
from equeue.server.admission import keep_alive, refusal_of, take_hello
from equeue.server.direct import direct_fd
from equeue.server.handlers import DEFERRED, Frame, Handlers, Packed
from equeue.server.limitnote import name_broker_setting
from equeue.server.partials import make_room
from equeue.server.release import release_durable as release_durable
from equeue.server.release import write_later
from equeue.server.tlsaccept import accept_tls

if TYPE_CHECKING:
    from equeue.server.serve import Broker

log = logging.getLogger("equeue.server")

MIN_DECODE_ITEMS = 65536


READ_BUFFER_BYTES = 256 * 1024  # asyncio's own read size
_per_loop = threading.local()  # a thread runs one event loop at a time


def _read_buffer() -> memoryview:
    """The read buffer of this thread's event loop, shared by its connections: each read is
    consumed (copied into a FrameReader or the hello) before the loop reads again. One
    buffer, instead of asyncio's fresh 256 KiB bytes object per read (an mmap and munmap
    each)."""
    view: memoryview | None = getattr(_per_loop, "view", None)
    if view is None:
        view = _per_loop.view = memoryview(bytearray(READ_BUFFER_BYTES))
    return view


class Connection(asyncio.BufferedProtocol):
    # The state the C read and release paths read on every send (cext/sendlane.c,
    # release.c) in slots, at fixed offsets; everything else in the instance dict.
    __slots__ = (
        "__dict__", "__weakref__", "_backlog", "_batching", "_ended", "_fd", "_hello", "_out",
        "_partial", "_plain_send", "_store", "closed", "in_flight", "transport",
    )  # fmt: skip

    def __init__(
        self, broker: Broker, listener: str, number: int, tls: ssl.SSLContext | None = None
    ) -> None:
        self.broker = broker
        # A tls:// connection until its handshake is done (tlsaccept.py): closed by an
        # abort, never answered on the raw socket.
        self._tls = tls
        self._tls_task: asyncio.Task[None] | None = None
        self._tls_raw = bytearray()  # read before the TLS protocol took the socket
        self.number = number
        self.where = f"connection #{number} on {listener}"
        self.transport: asyncio.Transport | None = None
        self._fd = -1  # the socket release_frames sends answers on, or -1 (direct.py)
        self.client = ""
        self.in_flight = 0
        self.closed = False
        self._hello: bytearray | None = bytearray()  # until the hello is accepted
        self.version = PROTOCOL_VERSION  # the welcome's (speak)
        self._ops_above: frozenset[str] = frozenset()  # ops of later versions: refused
        self._reader = FrameReader(broker.config.max_frame_bytes, self.where)
        self._out: list[bytes] = []
        self._batching = False
        self._write_scheduled = False
        self._paused = False
        self._backlog: list[bytes] = []  # frames read but not yet served (backpressure)
        self._out_bytes = 0
        self._ended = False  # the client half-closed: close once every answer is out
        self._partial = 0  # bytes of a frame begun, counted in broker.partial_bytes
        self._partial_moved = 0.0  # loop time of its last byte (the stalest gives way)
        self._hello_timer: asyncio.TimerHandle | None = None
        self.opened = broker.loop.time()
        config = broker.config
        self._max_in_flight = config.max_in_flight
        self._max_frame_bytes = config.max_frame_bytes
        self._write_high = config.write_buffer_high
        # Any: its result is a frame (bytes) or DEFERRED, no cast per send
        self._send_plain: Callable[[Connection, int, str, bytes], Any] = broker.handlers.send_plain
        fast = speedups.SPEEDUPS
        # C readers of a plain send (cext/sendframe.c); None: every frame the general way
        self._plain_send = fast.plain_send if fast is not None else None
        self._send_body = fast.send_body if fast is not None else None
        self._bodies_body = fast.bodies_body if fast is not None else None  # (send_bodies)
        self._bodies_read = fast.bodies_read if fast is not None else None  # (a read of one)
        self._max_bodies = config.max_batch_messages  # (more: not read in C, nothing allocated)
        self._store = broker.store
        self._commit = broker.handlers.commit  # None unless --flush sync
        self._answer_kind = bytes if self._commit is None else Frame
        self._pack = broker.packer.pack
        self._read_view = _read_buffer()
        cls = type(self)
        if not _reads_own(cls, type(broker.handlers)):
            # A subclass's (or a replaced) _request, _send, send_plain or send_bodies is
            # called for every request: no one-frame read in C goes past them (reviewd F4)
            self._plain_send = self._send_body = self._bodies_body = self._bodies_read = None
        if (
            fast is not None
            and cls.buffer_updated is Connection.buffer_updated
            and cls.get_buffer is Connection.get_buffer
        ):
            # uvloop keeps protocol.buffer_updated and get_buffer as bound methods: the
            # instance's own, in C, take a read without a Python frame (cext/sendlane.c).
            # Not for a subclass's own buffer_updated/get_buffer (the lane would bypass
            # them); the lane reads through plain_send only while _plain_send is it.
            lane = fast.SendLane(
                self, self._read_view, self._max_frame_bytes, self._max_in_flight,
                self._answer_kind, RESERVED_PREFIX, self._commit, broker.counters,
                broker.holds,
            )  # fmt: skip
            self.__dict__["buffer_updated"] = lane
            self.__dict__["get_buffer"] = lane.get_buffer
        # Room for a send_batch past its limit to be answered LimitExceededError (the
        # connection stays), and for a properties map the store would take.
        self._max_items = max(2 * config.max_batch_messages, MIN_DECODE_ITEMS)
        self._items_setting = (
            f"{self._max_items} items (twice max_batch_messages={config.max_batch_messages}, "
            f"at least {MIN_DECODE_ITEMS})"
        )
        # A frame of tiny objects costs the decoder per object: bounded as a whole too.
        self._max_objects = max_objects(config.max_batch_messages)
        self._objects_setting = (
            f"{OBJECTS_PER_MESSAGE} x max_batch_messages={config.max_batch_messages}, "
            "equeue serve --max-batch-messages"
        )

    # --- asyncio callbacks ----------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods
        self.transport = transport = cast(asyncio.Transport, transport)
        self._fd = direct_fd(transport) if self._tls is None else -1  # (TLS: records)
        keep_alive(transport)
        peer = transport.get_extra_info("peername")
        if peer:
            self.where += (
                f" from {peer[0]}:{peer[1]}" if isinstance(peer, tuple) else f" from {peer}"
            )
        broker = self.broker
        broker.connections.add(self)
        transport.set_write_buffer_limits(high=broker.config.write_buffer_high)
        self._hello_timer = broker.loop.call_later(
            broker.config.hello_timeout_ms / 1000, self._hello_expired
        )
        refusal = refusal_of(self)
        if self._tls is not None:
            accept_tls(self, self._tls, refusal)
        elif refusal is not None:
            self._fatal(refusal)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fd = -1  # the transport closes the socket after this: never written again
        # The lane refers to this connection: out of the instance dict, so a closed
        # connection is freed by its last reference, not left to the cyclic GC. No read
        # comes after connection_lost.
        self.__dict__.pop("buffer_updated", None)
        self.__dict__.pop("get_buffer", None)
        self.broker.connections.discard(self)
        self.broker.holds.drop(self)
        self.broker.partial_bytes -= self._partial
        self._partial = 0
        if self._hello_timer is not None:
            self._hello_timer.cancel()

    def speak(self, version: int) -> None:
        """The version the welcome chose: the ops a later version added are refused as a
        ProtocolError (a client must not send them: docs/protocol.md), the C readers of
        send_bodies (version 2) included."""
        self.version = version
        self._ops_above = ops_above(version)
        if "send_bodies" in self._ops_above:
            self._bodies_body = self._bodies_read = None

    def _hello_expired(self) -> None:
        self._hello_timer = None
        if self._hello is not None and not self.closed:
            limit = self.broker.config.hello_timeout_ms
            self._fatal(
                ProtocolError(
                    f"{self.where}: no hello within {limit} ms of connecting "
                    f"(hello_timeout_ms={limit}; equeue serve --hello-timeout-ms)"
                )
            )

    # The backpressure: equeue/server/backpressure.py
    pause_writing = backpressure.pause_writing
    resume_writing = backpressure.resume_writing
    has_room = backpressure.has_room
    wait_for_room = backpressure.wait_for_room
    _room_written = backpressure._room_written
    _serve = backpressure._serve
    buffered = property(backpressure.buffered)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._read_view

    def buffer_updated(self, nbytes: int) -> None:
        """A read of ``nbytes`` into the read buffer (uvloop, asyncio). With the C
        accelerator the instance's own buffer_updated, a SendLane (cext/sendlane.c), takes
        the commonest read in C and calls this for the rest."""
        plain = self._plain_send
        if (
            plain is not None
            and _own_request_and_send(type(self))  # (replaced since: the general path)
            and self._hello is None  # authenticated
            and not self._partial  # no frame begun in an earlier read
            and not self._backlog
            and not self.closed
            and self.in_flight < self._max_in_flight
        ):
            # A read that is exactly one frame holding a plain send (a producer with one
            # send in flight): read, appended and its answer packed in one C call
            # (cext/sendframe.c), then what Handlers.send_plain does after its append:
            # no frame reader, msgpack, output list or write callback (issue 23).
            got = plain(
                self._read_view, nbytes, self._max_frame_bytes, self._store.send,
                self._answer_kind, RESERVED_PREFIX,
            )  # fmt: skip
            if got is not None:
                self._plain_sent(nbytes, got)
                return
        self._read_general(nbytes)

    def _read_general(self, nbytes: int) -> None:
        read = self._bodies_read
        if (
            read is not None
            and self._hello is None
            and not self._partial
            and not self._backlog
            and not self.closed
            and self.in_flight < self._max_in_flight
            and not self.broker.holds.count
        ):
            # A read that is exactly one send_bodies frame (a producer's send_batch, one
            # request at a time): its bodies appended from the read buffer itself
            # (cext/bodyspans.c), no copy of the frame, no frame reader (issue 23). Not
            # while a pull is held: send_spans refuses every batch then (each is noted).
            got = read(self._read_view, nbytes, self._max_frame_bytes, self._max_bodies)
            if (
                got is not None
                and _own_request_and_send(type(self))  # (replaced since: the general path)
                and self._spans_read(nbytes, got)
            ):
                return
        self.data_received(self._read_view[:nbytes])

    def _spans_read(self, nbytes: int, got: tuple[int, str, Any]) -> bool:
        """What data_received and _send_bodies do for a read of one send_bodies frame:
        True when answered; False, nothing done or counted, to read it the general way."""
        request_id, topic, bodies = got
        broker = self.broker
        counters = broker.counters
        try:
            result = broker.handlers.send_spans(self, request_id, topic, bodies)
        except ProtocolError as exc:
            counters.bytes_in += nbytes
            self._fatal(exc)
            return True
        except Exception as exc:  # as _send_bodies answers send_bodies' failures
            counters.bytes_in += nbytes
            counters.requests += 1
            try:
                self._plain_send_failed(request_id, exc, "send_bodies")
            finally:
                broker.after_batch()
            return True
        if result is None:
            return False
        counters.bytes_in += nbytes
        counters.requests += 1
        if result is DEFERRED:
            self.in_flight += 1
        else:
            self._write_frame(result)
        if broker.holds.appended:
            broker.holds.arrived()
        return True

    def _plain_sent(self, nbytes: int, got: tuple[int, Any, Any]) -> None:
        """After plain_send appended (or refused) the read's send: count it, note held
        pulls, and hand the answer to the group commit or write it. SendLane does the
        commonest case of this in C (cext/sendlane.c) and must stay in step with it."""
        request_id, sent, frame = got
        broker = self.broker
        counters = broker.counters
        counters.bytes_in += nbytes
        counters.requests += 1
        if sent is None:  # frame is the exception; nothing was appended
            self._plain_send_failed(request_id, frame)
            return
        counters.sends += 1
        counters.send_requests += 1
        holds = broker.holds
        if holds.count:
            holds.note(sent.topic, sent.queue_id, sent.queue_offset, "")
        if frame is None:  # a result send_answer does not pack
            frame = self._answer_kind(encode([request_id, STATUS_OK, pack_send_result(sent)]))
        commit = self._commit
        if commit is not None:  # answered after the fdatasync covering it
            commit.add(self, request_id, frame, 1)
            self.in_flight += 1
        else:
            self._write_frame(frame)
        if holds.appended:
            holds.arrived()

    def _write_frame(self, frame: bytes) -> None:
        """An answer's whole frame, made within a read: written now, or joined to the
        answers made outside a read that wait for their write."""
        if self._out:
            self._queue(frame)
            self._write_out()
            return
        transport = self.transport
        if transport is not None and not transport.is_closing():
            self.broker.counters.bytes_out += len(frame)
            transport.write(frame)

    def _plain_send_failed(self, request_id: int, exc: Exception, op: str = "send") -> None:
        """A plain send of buffer_updated (or a send_bodies read whole, _spans_read)
        refused: its error answer; a defect gets BrokerError, logged."""
        if not isinstance(exc, EQueueError):
            log.error("%s: op %r failed", self.where, op, exc_info=exc)
        self._batching = True
        try:
            self._answer_error(request_id, exc)
        finally:
            self._batching = False
            self._write_out()

    def data_received(self, data: bytes | memoryview) -> None:
        if self.closed:
            return
        broker = self.broker
        broker.counters.bytes_in += len(data)
        self._batching = True
        try:
            if self._hello is not None:
                if self._tls is not None:  # its handshake's first bytes (tlsaccept.py)
                    self._tls_raw += data
                    if self.transport is not None:
                        self.transport.pause_reading()
                    if len(self._tls_raw) > HELLO_MAX_FRAME_BYTES:  # (one read, a ClientHello)
                        self.close()
                    return
                rest = take_hello(self, data)
                if rest is None:
                    return
                data = rest
            size = len(data)
            if size > FRAME_HEADER_SIZE and not self._backlog and not self._reader.pending:
                # One whole frame and nothing before it: the read of a client with one
                # request in flight (a durable producer, a round trip). No reader buffer,
                # no list: the frame reader's checks, then the request as _serve would.
                (length,) = FRAME_HEADER.unpack_from(data, 0)
                if length == size - FRAME_HEADER_SIZE and length <= self._max_frame_bytes:
                    self._request(bytes(data[FRAME_HEADER_SIZE:]))
                    return
            bodies = self._reader.feed(data)
            self._count_partial()
            if self._backlog:  # reading was paused with frames left: they go first
                self._backlog.extend(bodies)
                bodies = self._backlog
            self._serve(bodies)
        except (ProtocolError, LimitExceededError) as exc:  # FrameTooLargeError too
            self._fatal(exc)
        finally:
            self._batching = False
            self._write_out()
            broker.after_batch()

    def _count_partial(self) -> None:
        """The bytes of the frame begun, against the broker-wide max_partial_frame_bytes:
        past it, the frames stalled longest give way first (partials.py)."""
        broker = self.broker
        pending = self._reader.pending
        if pending != self._partial:
            broker.partial_bytes += pending - self._partial
            self._partial = pending
            if pending:
                self._partial_moved = broker.loop.time()
        if pending and broker.partial_bytes > broker.config.max_partial_frame_bytes:
            make_room(self)

    def eof_received(self) -> bool | None:
        pending = self._reader.pending if self._hello is None else len(self._hello)
        if pending and not self.closed:
            self._fatal(
                ProtocolError(
                    f"{self.where}: the connection ended inside a frame ({pending} bytes of it)"
                )
            )
            return None
        if self.closed:
            return None
        holds = self.broker.holds
        if holds.holding(self):
            # Its long polls are answered now with what there is, not at their wait_ms
            # (up to a day): a client that is gone frees its connection and its place
            # under max_connections at once (reviewg F2); one that half-closed gets them.
            self._ended = True  # (finish closes it after its last answer)
            self._batching = True
            try:
                holds.answer_now(self)
            finally:
                self._batching = False
                self._write_out()
        if self.closed or (not self.in_flight and not self._backlog):
            return None  # close the transport
        # The client half-closed and waits for its answers (sends awaiting an fdatasync):
        # the connection closes once the last is written.
        self._ended = True
        return True

    # --- frames ---------------------------------------------------------------

    def _request(self, body: bytes) -> None:
        where = self.where
        parse = self._send_body
        plain = parse(body) if parse is not None else None
        if plain is not None:
            request_id, topic, data = plain
            if self.in_flight < self._max_in_flight:
                self._send(request_id, topic, data)
                return
        elif self._bodies_body is not None and self._send_bodies(body):
            return
        try:
            decoded = decode_request(
                body,
                where,
                self._max_items,
                self._items_setting,
                self._max_objects,
                self._objects_setting,
            )
        except Refused as refused:  # past the object bound: answered, the connection stays
            self.broker.counters.requests += 1
            self._answer_error(refused.request_id, refused.error)
            return
        request_id, op, args = check_request(decoded, where)
        broker = self.broker
        if op == "send" and len(args) == 2:
            # The commonest request, a plain send: no op table, no args map past here.
            topic = args.get("topic")
            data = args.get("body")
            if type(topic) is str and type(data) is bytes and self.in_flight < self._max_in_flight:
                self._send(request_id, topic, data)
                return
        if op in self._ops_above:
            refuse_above(op, self.version, where)
        check_args(op, args, where)
        broker.counters.requests += 1
        # cancel_pull holds nothing and frees a place: a client at the limit may send it
        if self.in_flight >= broker.config.max_in_flight and op != "cancel_pull":
            limit = broker.config.max_in_flight
            self._answer_error(
                request_id,
                LimitExceededError(
                    f"{where}: {limit} requests are in flight on this connection "
                    f"(max_in_flight={limit}; equeue serve --max-in-flight); wait for answers"
                ),
            )
            return
        try:
            result = broker.handlers.ops[op](self, request_id, args)
        except ProtocolError:
            raise
        except EQueueError as exc:
            self._answer_error(request_id, exc)
            return
        except Exception as exc:  # a defect: the client gets BrokerError, the broker lives on
            log.exception("%s: op %r failed", where, op)
            self._answer_error(request_id, exc)
            return
        if result is DEFERRED:
            self.in_flight += 1
        elif type(result) is Packed:
            self._answer(request_id, STATUS_OK, result)
        else:
            self._answer_ok(request_id, result)

    def _send_bodies(self, body: bytes) -> bool:
        """A send_bodies read by C from the frame, its bodies left there (cext/bodyspans.c,
        handlers.send_spans): True when answered; False, nothing done, to decode the
        frame and serve it the general way (that path's own checks, answers, refusals)."""
        assert self._bodies_body is not None
        if self.broker.holds.count or self.in_flight >= self._max_in_flight:
            return False  # (send_spans refuses every batch while a pull is held)
        read = self._bodies_body(body, self._max_bodies)
        if read is None:
            return False
        request_id, topic, bodies = read
        broker = self.broker
        try:
            result = broker.handlers.send_spans(self, request_id, topic, bodies)
        except ProtocolError:
            raise
        except Exception as exc:  # as _request answers send_bodies' failures
            if not isinstance(exc, EQueueError):
                log.exception("%s: op 'send_bodies' failed", self.where)
            broker.counters.requests += 1
            self._answer_error(request_id, exc)
            return True
        if result is None:
            return False
        broker.counters.requests += 1
        if result is DEFERRED:
            self.in_flight += 1
        else:  # the answer's whole frame
            self._queue(result)
        return True

    def _send(self, request_id: int, topic: str, data: bytes) -> None:
        """A plain send within a read (its answer is queued; the read writes them)."""
        self.broker.counters.requests += 1
        try:
            result = self._send_plain(self, request_id, topic, data)
        except EQueueError as exc:
            self._answer_error(request_id, exc)
            return
        except Exception as exc:  # a defect: the client gets BrokerError
            log.exception("%s: op 'send' failed", self.where)
            self._answer_error(request_id, exc)
            return
        if result is DEFERRED:
            self.in_flight += 1
        else:
            self._queue(result)

    def finish(self, request_id: int, outcome: object, *, error: bool = True) -> None:
        """The answer of a DEFERRED request (a result, or the exception to answer; with
        ``error`` false an exception answered is not counted in the ``errors`` stat)."""
        self.in_flight -= 1
        if self.closed:
            return
        if type(outcome) is Frame:  # a whole answer frame (Handlers.send_plain)
            data: bytes = outcome
            if self._batching:  # in release_durable, which writes them (the commonest)
                self._out.append(data)
                self._out_bytes += len(data)
            else:
                self._queue(data)
        elif isinstance(outcome, BaseException):
            self._answer_error(request_id, outcome, error=error)
        elif type(outcome) is Packed:
            self._answer(request_id, STATUS_OK, outcome)
        else:
            self._answer_ok(request_id, outcome)
        if self._ended and not self.in_flight and not self._backlog:
            self.close()

    def _released(self, data: bytes) -> None:
        """release_durable's joined answers for a connection with more to do than write
        them: answers queued before them go first; a half-closed client is closed after
        its last answer."""
        if self.closed:
            return
        self._out.append(data)
        self._out_bytes += len(data)
        if not self._batching:
            self._write_out()
        if self._ended and not self.in_flight and not self._backlog:
            self.close()

    def _answer_error(self, request_id: int, exc: BaseException, *, error: bool = True) -> None:
        broker = self.broker
        if error:
            broker.counters.errors += 1
        exc = name_broker_setting(
            exc, broker.store, broker._owns_store, broker.config.max_frame_bytes
        )
        self._answer(request_id, STATUS_ERROR, pack_error(exc))

    def _answer_ok(self, request_id: int, payload: Any) -> None:
        """A small result's answer (a send's): one pack, the frame in the output list as
        its header and its body (no concatenation; the write joins them)."""
        try:
            body = self._pack((request_id, STATUS_OK, payload))
        except Exception:
            self.broker.packer.reset()  # what a failed pack left in it
            self._answer_encoded(request_id, STATUS_OK, payload)
            return
        out = self._out
        out.append(FRAME_HEADER.pack(len(body)))
        out.append(body)
        self._out_bytes += FRAME_HEADER_SIZE + len(body)
        if not self._batching and not self._write_scheduled:
            self._write_scheduled = True
            write_later(self)

    def _answer(self, request_id: int, status: int, payload: Any) -> None:
        packer = self.broker.packer
        if type(payload) is Packed:  # [request_id, status, result] around the packed result
            head = b"\x93" + packer.pack(request_id) + packer.pack(status)
            size = len(head) + len(payload.data)
            self._queue(b"".join((FRAME_HEADER.pack(size), head, payload.data)))  # one copy
            return
        try:
            body = packer.pack([request_id, status, payload])
            frame = FRAME_HEADER.pack(len(body)) + body
        except Exception:
            packer.reset()  # what a failed pack left in it
            frame = b""
        if not frame:
            self._answer_encoded(request_id, status, payload)
        else:
            self._queue(frame)

    def _answer_encoded(self, request_id: int, status: int, payload: Any) -> None:
        try:
            frame = encode([request_id, status, payload])
        except ProtocolError as exc:  # a result msgpack cannot carry: a defect
            log.error("%s: cannot encode the answer to request %d: %s", self.where, request_id, exc)
            frame = encode([request_id, STATUS_ERROR, pack_error(exc)])
        self._queue(frame)

    def _queue(self, frame: bytes) -> None:
        self._out.append(frame)
        self._out_bytes += len(frame)
        if not self._batching and not self._write_scheduled:
            self._write_scheduled = True
            write_later(self)

    def _write_out(self) -> None:
        self._write_scheduled = False
        out = self._out
        if not out or self.transport is None:
            return
        # A lone Frame (finish, per answer) joined too: exact bytes, which uvloop writes
        # without a memoryview cast (join copies a lone bytes subclass)
        data = out[0] if len(out) == 1 and type(out[0]) is bytes else b"".join(out)
        out.clear()
        self._out_bytes = 0
        if self.transport.is_closing():
            return
        self.broker.counters.bytes_out += len(data)
        self.transport.write(data)

    def _fatal(self, exc: EQueueError) -> None:
        """Answer ``exc`` about the connection (request id 0) and close it."""
        if self.closed:
            return
        log.warning("%s; closing the connection", exc)
        if self._tls is None:  # (in a TLS handshake the client could not read it)
            self._answer_error(CONNECTION_REQUEST_ID, exc)
        self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._tls is not None and self.transport is not None:
            self.transport.abort()  # in its handshake: nothing of ours to write
            return
        self._write_out()
        if self.transport is not None:
            self.transport.close()  # after what is buffered has been written

    # The methods a read taken whole in C (connection.py buffer_updated, cext/sendlane.c)
    # goes past, as written above: while a connection's class finds these two, and its
    # broker's Handlers class send_plain and send_bodies (_reads_own, when it is made).
    _c_reads: Final = (_request, _send)


def _own_request_and_send(cls: type[Connection]) -> bool:
    """Whether cls still finds Connection's own _request and _send (a read is checked:
    one replaced on the class after a connection was made is called from the next read
    on; the SendLane compares the class's version tag instead)."""
    own = Connection._c_reads
    return cls._request is own[0] and cls._send is own[1]


def _reads_own(cls: type[Connection], handlers: type[Handlers]) -> bool:
    """Whether a connection of cls may take a read whole in C: its _request and _send,
    and the handlers' send_plain and send_bodies, are the ones written here (the general
    path binds the last two when the connection, and the handlers, are made)."""
    return (
        _own_request_and_send(cls)
        and handlers.send_plain is Handlers._c_reads[0]
        and (handlers.send_bodies is Handlers._c_reads[1])
    )
