"""The asyncio client: ``await equeue.aio.connect(url)``.

Any number of coroutines share one client: each request gets an id and a future, the
frames written in one loop turn go out in one write, and the answers (in any order)
resolve their futures. At most the broker's ``max_in_flight`` requests are in flight;
more wait for a place. A request holds its place until its answer arrives, also when
its caller was cancelled (the late answer is dropped); a long poll's cancelled caller
asks the broker to answer it at once (cancel_pull, protocol version 6). A
broken connection fails every request in flight on it with ConnectionLostError
(``unanswered``: the sends among them, as given); the next call reconnects.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import ssl
import time
from collections import deque
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, cast

from equeue.client import aioends, aiomethods, args, calls, forks, rawconn, shmconn
from equeue.client.calls import Call, Given
from equeue.client.coalesce import HEARD_RECENTLY, Answer, Coalescer, _which, woken_together
from equeue.client.connect import RECV_BYTES, again, telling, then, tls_refusal, tls_refused
from equeue.client.core import (
    DECODERS,
    AnswerReader,
    RequestEncoder,
    answer_error,
    given,
    hello_frame,
    lost,
    lost_in_flight,
    no_answer,
    readable,
    welcome,
)
from equeue.client.csend import answered, fast
from equeue.client.loops import close_from_here, running_loop, wrong_loop
from equeue.client.sync import DEFAULT_CONNECT_TIMEOUT, DEFAULT_TIMEOUT, check_timeout
from equeue.client.url import Endpoint, parse_url
from equeue.errors import (
    ClosedError,
    ConnectionLostError,
    EQueueError,
    InvalidTypeError,
    ProtocolError,
)
from equeue.protocol import shmrings
from equeue.protocol.frames import (
    BODIES_VERSION,
    CONNECTION_REQUEST_ID,
    HELLO_MAX_FRAME_BYTES,
    STATUS_ERROR,
    STATUS_OK,
    check_answer,
)
from equeue.protocol.handshake import Welcome
from equeue.protocol.plainsend import conn_type as _conn_type
from equeue.store.types import OutgoingMessage, SendResult

_STATUSES: Final = (STATUS_OK, STATUS_ERROR)

# request id -> (its future, or a coalesced group's Answer; its messages as given for a
# send, or the body alone of a plain send written by `direct`; its deadline)
_Entry = tuple["asyncio.Future[Any] | Answer", Given | bytes, float]


class _PyConn:
    """ClientConn's fields (equeue/cext/clientconn.c; the base instead when built) and
    its methods without the accelerator: no direct send, every read the general way."""

    loop: asyncio.AbstractEventLoop  # the future of a direct send is bound to it
    inbuf: memoryview
    pending: dict[int, _Entry]
    queued: deque[asyncio.Future[None]]  # callers waiting for a place
    transport: asyncio.Transport | None
    next_id: Callable[[], int]
    reader: AnswerReader
    coalescer: Coalescer | None  # a broker of protocol version 2 or later
    # The request id and topic of the send `direct` wrote: its answer is looked for in
    # the next read (0: read the general way)
    waiting: int
    waiting_topic: str
    heard: float  # time.monotonic() when the broker's bytes last arrived
    timeout: float
    recent: float  # HEARD_RECENTLY
    free: int  # places for requests in flight: max_in_flight, once welcomed
    limit: int  # max_frame_bytes, the welcome's once welcomed
    read_in_c: int  # answers read by ClientConn.buffer_updated
    closed: bool
    flushing: bool
    welcomed: bool

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.inbuf

    def buffer_updated(self, nbytes: int) -> None:
        self.data_received(self.inbuf[:nbytes])

    def data_received(self, data: bytes | memoryview) -> None:
        raise NotImplementedError

    def direct(self, topic: str, body: bytes) -> asyncio.Future[Any] | None:
        """A plain send on an idle connection heard from within ``recent`` (the one send
        in flight of a task with a connection of its own): its frame made in C and
        written at once, its answer read in C by ``buffer_updated``, the future given the
        SendResult (or, read the general way, ``(status, payload)`` as ``_call``'s). The
        future is equeue/cext/wakeup.c's, bound to ``loop``: given the answer in C, it
        wakes its task at once where that is safe, else through call_soon as a Future.
        None: nothing done, the coalescer's or the general path takes it (here always;
        in C: something in flight or queued, a frame past the limit, a topic not UTF-8)."""
        return None


if TYPE_CHECKING:
    _Conn = _PyConn
else:
    _Conn = _PyConn if _conn_type is None else _conn_type


class _Protocol(_Conn, asyncio.BufferedProtocol):  # one buffer for every read
    def __init__(
        self, hello: bytes, where: str, timeout: float, next_id: Callable[[], int]
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.next_id = next_id
        self.where = where
        self.timeout = timeout
        self.recent = HEARD_RECENTLY
        self.hello = hello
        self.transport = None
        self.reader = AnswerReader(HELLO_MAX_FRAME_BYTES, where)
        self.limit = HELLO_MAX_FRAME_BYTES
        self.encoder: RequestEncoder | None = None
        self.coalescer = None
        self.max_in_flight = 0
        self.welcome: asyncio.Future[Welcome] = self.loop.create_future()
        self.pending = {}
        self.out: list[bytes] = []
        self.flushing = False
        self.closed = False
        self.free = 0
        self.queued = deque()
        self.welcomed = False
        self.watchdog: asyncio.TimerHandle | None = None
        self.inbuf = memoryview(bytearray(RECV_BYTES))
        self.heard = 0.0
        self.waiting = 0
        self.waiting_topic = ""
        self.read_in_c = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's transports are not asyncio.Transport subclasses: no isinstance check)
        self.transport = cast(asyncio.Transport, transport)
        self.transport.write(self.hello)
        self.watchdog = self.loop.call_later(self._tick(), self._watch)

    def _tick(self) -> float:
        return min(max(self.timeout / 4, 0.01), 1.0)

    def data_received(self, data: bytes | memoryview) -> None:
        self.heard = time.monotonic()
        try:
            bodies = self.reader.feed(data)
        except ProtocolError as exc:
            self.fail(f"the broker at {self.where} broke the protocol: {exc}", exc)
            return
        if self.welcomed:
            self.answers(bodies)
            return
        for index, body in enumerate(bodies):
            try:
                found = welcome(body, self.where)
            except EQueueError as exc:
                self.welcome.set_exception(exc)
                self.fail(f"the broker at {self.where} refused the connection: {exc}", exc)
                return
            limit = found.limits["max_frame_bytes"]
            self.reader.max_frame_bytes = self.limit = limit
            self.encoder = encoder = RequestEncoder.for_welcome(found, self.where)
            self.free = self.max_in_flight = found.limits["max_in_flight"]
            if found.version >= BODIES_VERSION:
                self.coalescer = Coalescer(self, limit, encoder.max_batch_messages)
            self.welcomed = True
            self.welcome.set_result(found)
            self.answers(bodies[index + 1 :])
            return

    def answers(self, bodies: list[Any]) -> None:
        if len(bodies) > 1 and not self.flushing:  # (their callers' next sends: one group)
            woken_together(self, self._answers, bodies)
        else:
            self._answers(bodies)

    def _answers(self, bodies: list[Any]) -> None:
        pending = self.pending
        for body in bodies:
            if type(body) is list and len(body) == 3 and body[1] in _STATUSES:
                request_id, status, payload = body  # (a request id of another type: unknown)
            else:
                try:
                    request_id, status, payload = check_answer(body, self.where)
                except ProtocolError as exc:
                    self.fail(f"the broker at {self.where} broke the protocol: {exc}", exc)
                    return
            entry = pending.pop(request_id, None) if type(request_id) is int else None
            if entry is None:
                if request_id == CONNECTION_REQUEST_ID:
                    error = answer_error(payload, self.where)
                    self.fail(f"the broker at {self.where} closed the connection: {error}", error)
                else:
                    error = ProtocolError(
                        f"{self.where}: an answer to request {request_id}, which is not in flight"
                    )
                    self.fail(f"the broker at {self.where} broke the protocol: {error}", error)
                return
            target = entry[0]
            try:
                # Its place comes back only now: a cancelled caller's request is still
                # held by the broker until this answer (which is then dropped).
                self.free += 1
                if self.queued:
                    self.release()
                if isinstance(target, Answer):  # a coalesced group: each caller its own
                    target.answered(status, payload)
                elif not target.done():  # (its caller may have been cancelled)
                    target.set_result((status, payload))
            except BaseException:
                # (review15 R15-3) out of pending, its callers not all answered: put back
                # while one waits, so the connection's end (fail, which the transport
                # calls for the error raised from the read) answers it; as clientconn.c's
                # put_back does for the reads made in C
                if aioends.still_waiting(target):
                    pending[request_id] = entry
                raise

    def connection_lost(self, exc: Exception | None) -> None:
        if isinstance(exc, BrokenPipeError | ConnectionResetError) and not self.closed:
            aioends.read_rest(self)  # a write found the broker gone: its last frames first
            if self.closed:
                return
        reason = f"the broker at {self.where} closed the connection"
        self.fail(f"{reason}: {exc}" if exc else reason, exc)

    def fail(self, reason: str, cause: BaseException | None) -> None:
        """Close, and fail each request in flight with ConnectionLostError."""
        if self.closed:
            return
        self.closed = True
        if self.watchdog is not None:
            self.watchdog.cancel()
        if self.transport is not None:
            self.transport.abort()
        if not self.welcome.done():  # the handshake failed: a broken protocol is no retry
            refused = isinstance(cause, EQueueError) and not isinstance(cause, ConnectionLostError)
            self.welcome.set_exception(cause if refused else lost(reason, [], cause))  # type: ignore[arg-type]
            self.welcome.exception()  # (retrieved: a connect that failed never awaits it)
        pending = list(self.pending.values())
        self.pending.clear()
        for target, unanswered, _ in pending:
            if isinstance(target, Answer):
                target.lost(reason, cause)
            elif not target.done():
                if type(unanswered) is bytes:  # the plain send `direct` wrote, as Answer.lost
                    # says a coalesced one's (direct writes only with nothing in flight, so
                    # waiting_topic is still its topic)
                    failed = f"{reason}; {_which(0, 1, self.waiting_topic)} {no_answer(cause)}"
                    target.set_exception(
                        lost_in_flight(failed, [OutgoingMessage(unanswered)], cause)
                    )
                else:
                    target.set_exception(lost_in_flight(reason, given(unanswered), cause))  # type: ignore[arg-type]
        if self.coalescer is not None:
            self.coalescer.drop(reason, cause)
        while self.queued:  # they find it closed
            waiter = self.queued.popleft()
            if not waiter.done():
                waiter.set_result(None)

    async def place(self) -> None:
        """Wait until fewer than max_in_flight requests are in flight (or it closed)."""
        if self.loop is not running_loop():  # (before a waiter of this loop is made)
            raise wrong_loop(self.loop, self.where)
        while self.free <= 0 and not self.closed:
            waiter = self.loop.create_future()
            self.queued.append(waiter)
            try:
                await waiter
            except BaseException:
                if self.free > 0:
                    self.release()  # (the place it was woken for goes to the next)
                raise

    def release(self) -> None:
        while self.queued:
            waiter = self.queued.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def input_waiting(self) -> bool:
        """Whether bytes (or the end) wait unread: while idle, the loop may not have run
        since the broker stopped (a caller blocking it), and a write now would fail."""
        if self.closed or self.transport is None:
            return False
        sock = self.transport.get_extra_info("socket")
        try:
            return sock is not None and readable(sock, 0)
        except (OSError, ValueError):
            return True

    def send(self, request_id: int, frame: bytes, entry: _Entry) -> None:
        self.pending[request_id] = entry
        self.out.append(frame)
        self.schedule()

    def put(self, request_id: int, frame: bytes, answer: Answer) -> None:
        """A coalesced request (its messages are reported by coalesce.py when it breaks)."""
        self.pending[request_id] = (answer, None, time.monotonic() + self.timeout)
        self.out.append(frame)

    def schedule(self) -> None:
        if not self.flushing:
            self.flushing = True
            self.loop.call_soon(self._flush)

    def give_back(self, places: int) -> None:
        self.free += places
        for _ in range(min(places, len(self.queued))):
            self.release()

    def _flush(self) -> None:
        """Everything written in this loop turn, in one write."""
        self.flushing = False
        if self.closed or self.transport is None:
            return
        if self.coalescer is not None:
            self.coalescer.emit()
        out = self.out
        if out:  # (none: the turn's only group could not be encoded; nothing to write)
            self.transport.write(out[0] if len(out) == 1 else b"".join(out))
            out.clear()

    def write_now(self) -> None:
        """The one frame of an idle connection, written at once (one write either way:
        a later send of this turn finds it in flight and goes in the turn's group)."""
        if self.flushing or self.transport is None:
            self.schedule()
        elif self.out:
            self.transport.write(self.out[0] if len(self.out) == 1 else b"".join(self.out))
            self.out.clear()

    def write_out(self) -> None:
        """What was made of this turn so far, written now (a coalesced group's part: the
        rest of the turn is written by the ``_flush`` already scheduled)."""
        out = self.out
        if out and self.transport is not None:
            self.transport.write(out[0] if len(out) == 1 else b"".join(out))
            out.clear()

    def _watch(self) -> None:
        now = time.monotonic()
        for _, _, deadline in self.pending.values():
            if deadline < now:
                self.fail(
                    f"no answer from the broker at {self.where} within timeout="
                    f"{self.timeout:g}s; the connection is closed",
                    None,
                )
                return
        if not self.closed:
            self.watchdog = self.loop.call_later(self._tick(), self._watch)


class AsyncClient:
    """An asyncio connection to an equeue broker with MessageStore's methods, each a
    coroutine (docs/broker.md). Made by ``await equeue.aio.connect(url)``."""

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        token: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        ssl_context: ssl.SSLContext | None = None,
        cafile: str | os.PathLike[str] | None = None,
        client_name: str = "",
        shm: bool = False,
    ) -> None:
        self.endpoint: Endpoint = parse_url(url, ssl_context=ssl_context, cafile=cafile)
        self.url = str(self.endpoint)
        if token is not None and not isinstance(token, str):
            raise InvalidTypeError(f"token must be a str or None, got {type(token).__name__}")
        self.timeout = check_timeout("timeout", timeout)
        self.connect_timeout = check_timeout("connect_timeout", connect_timeout)
        name = args.name("client_name", client_name) or f"python-asyncio pid {os.getpid()}"
        self._hello = hello_frame(token, name)
        # The shared-memory rings (shmconn.py): asked for in the hello of a
        # unix: connection when shm=True; the broker's --shm decides
        self._shm_hello: Callable[[str], bytes] | None = None
        if shm and self.endpoint.kind == "unix" and shmrings.AVAILABLE:
            self._shm_hello = lambda group: hello_frame(token, name, group)
        self._protocol: _Protocol | None = None
        self._reconnect: asyncio.Task[_Protocol] | None = None  # the attempt under way
        self._closed = False
        self._closed_why = "is closed"  # (the ClosedError's words)
        self._ids = itertools.count(1).__next__
        forks.track(self)

    def after_fork(self, parent: int) -> None:
        """In a forked child: closed, its connection left to the parent (forks.py)."""
        self._closed = True
        self._closed_why = (
            f"{forks.made_before_fork(parent)}; connect in this process with a loop of its own"
        )
        protocol, self._protocol = self._protocol, None
        transport = protocol.transport if protocol is not None else None
        sock = transport.get_extra_info("socket") if transport is not None else None
        fd = sock.fileno() if sock is not None else -1
        if fd >= 0:
            forks.point_at_a_dead_socket(fd)

    @property
    def welcome(self) -> Welcome | None:
        protocol = self._protocol
        if protocol is None or not protocol.welcome.done() or protocol.welcome.exception():
            return None
        return protocol.welcome.result()

    async def _connected(self, unsent: Given = None) -> _Protocol:
        """The open connection, made again if it broke. One attempt runs at a time, and
        every caller that finds the connection broken meanwhile waits for it: a failed
        attempt fails each of them (its own error, ``unsent`` its messages) without a
        try of its own; a call after that tries again."""
        if self._closed:
            raise ClosedError(f"the client of {self.url} {self._closed_why}")
        protocol = self._protocol
        if protocol is not None and not protocol.closed:
            return protocol
        attempt = self._reconnect
        if attempt is not None and attempt.get_loop() is not running_loop():
            raise wrong_loop(attempt.get_loop(), self.url)
        if attempt is None:
            attempt = self._reconnect = asyncio.get_running_loop().create_task(self._attempt())
        try:  # (shielded: a caller cancelled does not end the others' attempt)
            return await asyncio.shield(attempt)
        except asyncio.CancelledError:
            if attempt.cancelled() and self._closed:  # close() ended the attempt
                raise ClosedError(f"the client of {self.url} was closed") from None
            raise
        except EQueueError as exc:
            raise again(exc, given(unsent)) from exc.__cause__

    async def _attempt(self) -> _Protocol:
        try:
            protocol = await self._connect()
        finally:
            self._reconnect = None  # (before the callers waiting for it resume)
        if self._closed:  # close() came while the handshake finished
            protocol.fail(f"the client of {self.url} was closed", None)
            raise ClosedError(f"the client of {self.url} is closed")
        self._protocol = protocol
        return protocol

    async def _connect(self) -> _Protocol:
        """Connect and shake hands, retrying a broker that is not (yet) there with a
        growing pause until connect_timeout; a refusal is not retried."""
        loop = asyncio.get_running_loop()
        endpoint = self.endpoint
        deadline = time.monotonic() + self.connect_timeout
        delay = 0.02
        attempts = 0
        last: BaseException | None = None
        newest: BaseException | None = None
        while True:
            attempts += 1
            shm = self._shm_hello
            hello = b"" if shm is not None else self._hello  # (shm: sent before the protocol)
            protocol = _Protocol(hello, self.url, self.timeout, self._ids)
            try:
                async with asyncio.timeout(max(deadline - time.monotonic(), 0.001)):
                    if shm is not None:
                        await shmconn.open_connection(loop, endpoint, protocol, shm)
                    elif rawconn.usable(loop, endpoint, protocol):  # (own transport, in C)
                        await rawconn.open_connection(loop, endpoint, protocol)
                    elif endpoint.kind == "unix":
                        await loop.create_unix_connection(lambda: protocol, endpoint.path)  # noqa: B023
                    else:
                        await loop.create_connection(
                            lambda: protocol, endpoint.host, endpoint.port,  # noqa: B023
                            ssl=endpoint.ssl_context,
                            server_hostname=endpoint.host if endpoint.ssl_context else None,
                        )  # fmt: skip
                    await protocol.welcome
                return protocol
            except ssl.SSLCertVerificationError as exc:
                protocol.fail("TLS refused", exc)
                raise lost(
                    f"{self.url}: the broker's TLS certificate is refused: {exc}", [], exc
                ) from None
            except ssl.SSLError as exc:
                protocol.fail("TLS refused", exc)
                if tls_refused(exc):
                    raise lost(f"{self.url}: {tls_refusal(exc)}", [], exc) from None
                last, newest = telling(last, exc), exc
            except (OSError, ConnectionLostError, TimeoutError) as exc:
                last, newest = telling(last, exc), exc
                protocol.fail("connect failed", exc)
            except BaseException:
                protocol.fail("connect failed", None)
                raise
            if time.monotonic() + delay > deadline:
                raise lost(
                    f"cannot connect to the broker at {self.url} within connect_timeout="
                    f"{self.connect_timeout:g}s ({attempts} attempts): {last!r}"
                    f"{then(last, newest)}",
                    [],
                    last,
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)

    async def _call(self, call: Call, decode: bool = True) -> Any:
        protocol = self._protocol
        if protocol is not None and protocol.loop is not running_loop():
            raise wrong_loop(protocol.loop, self.url)
        if protocol is not None and not protocol.pending:
            for _ in range(4):  # let the loop read it: the end of a broker that went away
                if not protocol.input_waiting():  # (reading the end takes loop turns)
                    break
                await asyncio.sleep(0)
        if protocol is None or protocol.closed:
            protocol = await self._connected(call.unanswered)
        assert protocol.encoder is not None
        request_id = self._ids()
        frame = protocol.encoder.frame(request_id, call.op, call.args)
        if protocol.free <= 0:
            await protocol.place()
        if protocol.closed:  # (while it waited for a place)
            error = lost(f"the connection to {self.url} broke; the request was not sent", [])
            error.unsent = given(call.unanswered)
            raise error
        protocol.free -= 1  # given back when its answer arrives (data_received)
        future: asyncio.Future[tuple[int, Any]] = protocol.loop.create_future()
        deadline = time.monotonic() + self.timeout + call.wait
        protocol.send(request_id, frame, (future, call.unanswered, deadline))
        try:
            status, payload = await future
        except asyncio.CancelledError:
            if call.wait:  # a long poll given up (wait_for): the broker answers it now
                aioends.cancel_pull(protocol, request_id)
            raise
        if status != STATUS_OK:
            raise answer_error(payload, self.url)
        return DECODERS[call.op](payload, self.url) if decode else payload

    # ``request`` and MessageStore's methods but ``send``, one request each: aiomethods.py
    _made = aiomethods._made
    request = aiomethods.request

    # --- MessageStore's methods --------------------------------------------------

    @fast  # (with the accelerator its plain call is a coroutine in C: csend.py)
    async def send(
        self,
        topic: str,
        body: bytes,
        *,
        tag: str = "",
        key: str | None = None,
        properties: dict[str, str] | None = None,
        code: int = 0,
        queue_id: int | None = None,
    ) -> SendResult:
        protocol = self._protocol
        if (
            protocol is not None and key is None and properties is None and queue_id is None
            and tag == "" and code == 0 and type(code) is int and type(body) is bytes
            and type(topic) is str and not protocol.closed
        ):  # fmt: skip  # a plain send on a live connection
            # (pending: the pipelined case's sends, coalesced, pay no call here)
            alone = None if protocol.pending else protocol.direct(topic, body)
            if alone is not None:  # alone on its connection: written at once
                answer = await alone
                if type(answer) is not tuple:  # the SendResult, read in C
                    return answer  # type: ignore[no-any-return]
                return answered(self, answer)  # (read the general way)
            coalescer = protocol.coalescer
            if coalescer is not None:  # the loop turn's group
                if protocol.free <= 0:
                    await protocol.place()
                if not protocol.closed:
                    future = coalescer.add(topic, body)
                    if future is not None:
                        return await future
        call = calls.send(topic, body, tag, key, properties, code, queue_id)
        result: SendResult = await self._call(call)
        return result

    # the others: aiomethods.py
    send_batch = aiomethods.send_batch
    pull = aiomethods.pull
    get = aiomethods.get
    query_by_key = aiomethods.query_by_key
    offset_for_time = aiomethods.offset_for_time
    commit_offset = aiomethods.commit_offset
    committed_offset = aiomethods.committed_offset
    delete_group = aiomethods.delete_group
    create_topic = aiomethods.create_topic
    topics = aiomethods.topics
    deleted_topics = aiomethods.deleted_topics
    queue_ids = aiomethods.queue_ids
    queue_range = aiomethods.queue_range
    stats = aiomethods.stats
    ping = aiomethods.ping
    consumer = aiomethods.consumer

    # --- life --------------------------------------------------------------------

    async def close(self) -> None:
        """Close the connection; requests still in flight raise ConnectionLostError."""
        self._closed = True
        if self._reconnect is not None:
            self._reconnect.cancel()
        protocol = self._protocol
        if protocol is not None:  # (from another loop too: loops.close_from_here)
            close_from_here(protocol, f"the client of {self.url} was closed")

    @property
    def closed(self) -> bool:
        return self._closed

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def __repr__(self) -> str:
        protocol = self._protocol
        connected = protocol is not None and not protocol.closed
        state = "closed" if self._closed else ("connected" if connected else "disconnected")
        return f"<equeue.aio.AsyncClient {self.url} {state}>"


async def connect(
    url: str | os.PathLike[str], *, token: str | None = None, **options: Any
) -> AsyncClient:
    """An asyncio client of the broker at ``url``, connected (options as equeue.connect)."""
    client = AsyncClient(url, token=token, **options)
    await client._connected()
    return client
