"""The blocking client: ``equeue.connect(url)``. Thread-safe; pipelined (send_many).

Many threads may share one client. Requests are written under a write lock, each
once there is a place for it (at most the broker's ``max_in_flight`` in flight); answers
are read by whichever waiting thread takes the reader's turn (no thread of its own),
which hands each answer to the thread waiting for it (matched by request id), so a
long-poll pull in one thread does not hold up another thread's send. A waiting thread
sleeps on a lock of its own: an answer wakes the one thread it is for, the end of a
reader's turn wakes one other waiting thread to take it (not every thread at every
answer).

A broken connection fails every request in flight on it with ConnectionLostError
(``unanswered``: the sends among them, as given); the next call reconnects.

A KeyboardInterrupt reaches the thread it lands in wherever it lands; the other threads
go on: the reader's turn is passed on, answers read are handed in first, and where
bytes may be lost with it (a write cut short, a TLS read, the handing in itself) the
connection is closed instead, failing its requests as above.
"""

from __future__ import annotations

import _socket
import contextlib
import os
import socket
import ssl
import struct
import threading
import time
import weakref
from _thread import LockType
from types import TracebackType
from typing import Any

from equeue.client import args, endings, syncmethods, turns
from equeue.client.calls import Call
from equeue.client.connect import again, connect_with_retries
from equeue.client.core import (
    DECODERS,
    PULL_OPS,
    SEND_OPS,
    answer_error,
    given,
    lost,
    lost_in_flight,
    readable,
)
from equeue.client.inflight import _Connection as _Connection
from equeue.client.inflight import _deadline
from equeue.client.inflight import _Slot as _Slot
from equeue.client.syncmethods import DEFAULT_WINDOW as DEFAULT_WINDOW
from equeue.client.turns import TURN_CHECK as TURN_CHECK
from equeue.client.turns import Turns
from equeue.client.url import Endpoint, parse_url
from equeue.errors import (
    ClosedError,
    ConfigError,
    ConnectionLostError,
    EQueueError,
    InvalidTypeError,
    ProtocolError,
)
from equeue.protocol.frames import CONNECTION_REQUEST_ID, STATUS_OK, check_answer
from equeue.protocol.handshake import Welcome
from equeue.protocol.ops import check_args

DEFAULT_TIMEOUT = 30.0
DEFAULT_CONNECT_TIMEOUT = 5.0
# A connection idle this long (seconds) is polled before the next request, so one the
# broker closed meanwhile is made anew instead of failing the request; back-to-back
# requests skip the poll (a syscall each): a close in that gap fails like one in flight.
IDLE_CHECK = 0.001
# A reader whose request has at least this share of the timeout left blocks in recv with
# the kernel's timeout (SO_RCVTIMEO, the client's timeout) instead of polling first: its
# expiry is late by at most the rest of the timeout, this 1 % of it.
DIRECT_READ = 0.99


def kernel_timeouts(sock: socket.socket, timeout: float) -> None:
    """Blocking mode with the kernel's send and receive timeouts: Python's own timeout
    mode polls before every send and receive (two syscalls more per request); reads are
    polled by the client first anyway. A send or receive blocked past ``timeout`` fails
    with an OSError (EAGAIN), which closes the connection."""
    sock.settimeout(None)
    seconds = int(timeout)
    value = struct.pack("ll", seconds, int((timeout - seconds) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)


def check_timeout(name: str, value: object) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise InvalidTypeError(f"{name} must be seconds (int or float), got {type(value).__name__}")
    if not 0 < value < 1e9:
        raise ConfigError(f"{name}={value!r} seconds must be > 0")
    return float(value)


class Client(Turns):
    """A connection to an equeue broker with MessageStore's methods (docs/broker.md)."""

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
    ) -> None:
        self.endpoint: Endpoint = parse_url(url, ssl_context=ssl_context, cafile=cafile)
        self.url = str(self.endpoint)
        if token is not None and not isinstance(token, str):
            raise InvalidTypeError(f"token must be a str or None, got {type(token).__name__}")
        self.timeout = check_timeout("timeout", timeout)
        self.connect_timeout = check_timeout("connect_timeout", connect_timeout)
        self._token = token
        self._name = args.name("client_name", client_name) or f"python-sync pid {os.getpid()}"
        self._write_lock = threading.Lock()
        # guards the slots, the sleepers and _reading; an RLock for _sleep's _is_owned
        self._cond = threading.RLock()
        self._reading = False
        # the threads asleep in _sleep, by the slot each waits for (None: the writer
        # waiting for a place in max_in_flight), each on a lock of its own, held until woken
        self._sleepers: dict[_Slot | None, LockType] = {}
        self._closed = False
        self._next_id = 1
        self._conn: _Connection | None = None
        # Connect attempts made, and the last one's error (None: it succeeded).
        self._failed: tuple[int, EQueueError | None] = (0, None)
        _CLIENTS.add(self)
        with self._write_lock:
            self._connection()

    def _after_fork(self) -> None:
        """In a forked child: the parent's connection is the parent's (its answers go to
        whichever process reads first), so the child drops its copy of the descriptor
        (not shutdown: that would end the parent's connection too) and connects anew.
        The locks are new: another thread may have held them at the fork."""
        self._write_lock = threading.Lock()
        self._cond = threading.RLock()
        self._reading = False
        self._sleepers = {}
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.broken = True
            conn.pending.clear()
            with contextlib.suppress(OSError):
                conn.sock.close()

    # --- the connection ----------------------------------------------------------

    @property
    def welcome(self) -> Welcome | None:
        """The broker's welcome on the current connection (its version and limits)."""
        conn = self._conn
        return conn.welcome if conn is not None else None

    def _connection(self, failed: int | None = None) -> _Connection:
        """The open connection (made again if it broke); call under the write lock.
        ``failed``: the count of connect attempts when the caller began to wait for the
        lock; if exactly one was made since and it failed, the caller gets its failure
        instead of a try of its own (one attempt at a time, not one connect_timeout per
        waiting thread). After any other attempt (one that succeeded, or more than one)
        the caller tries: a failure from before a later success is stale."""
        if self._closed:
            raise ClosedError(f"the client of {self.url} is closed")
        conn = self._conn
        if (
            conn is not None
            and not conn.pending
            and time.monotonic() - conn.quiet_at >= IDLE_CHECK
            and self._idle_input(conn)
        ):
            conn = self._conn  # the broker went away (or spoke out of turn) while idle
        if conn is None:
            count, last = self._failed
            if failed is not None and count == failed + 1 and last is not None:
                raise again(last, [])
            try:
                sock, welcome, reader = connect_with_retries(
                    self.endpoint, self._token, self._name, self.connect_timeout
                )
            except EQueueError as exc:
                self._failed = (count + 1, exc)
                raise
            self._failed = (count + 1, None)
            kernel_timeouts(sock, self.timeout)
            conn = self._conn = _Connection(sock, welcome, reader)
        return conn

    def _idle_input(self, conn: _Connection) -> bool:
        """Read what arrived while nothing was in flight: the end of the stream after the
        broker stopped, so the next call reconnects instead of failing on a dead socket."""
        sock = conn.sock
        pending_tls = isinstance(sock, ssl.SSLSocket) and sock.pending()
        try:
            ready = pending_tls or readable(sock, 0)
        except (OSError, ValueError):
            ready = True
        if not ready:
            return False
        turn = False
        try:
            with self._cond:
                if self._reading:
                    return False
                self._reading = turn = True  # (no call between: no interrupt lands there)
            sock.setblocking(False)  # no request is in flight and no other thread writes now
            try:
                data = conn.inbuf[: sock.recv_into(conn.inbuf)]
            except (BlockingIOError, ssl.SSLWantReadError):  # e.g. a TLS session ticket
                return False
            except OSError as exc:
                self._break(conn, f"the connection to {self.url} broke: {exc}", exc)
                return True
            finally:
                if not conn.broken:
                    sock.setblocking(True)  # (the kernel's timeouts stay)
            self._received(conn, data)
            return True
        finally:
            if turn:  # (given up inline: no function's entry before, no interrupt lands)
                self._reading = False
                self._end_turn()

    def _break(self, conn: _Connection, reason: str, cause: BaseException | None) -> None:
        with self._cond:
            self._break_locked(conn, reason, cause)

    def _break_locked(self, conn: _Connection, reason: str, cause: BaseException | None) -> None:
        """Close ``conn`` and fail each request in flight on it with ConnectionLostError."""
        if conn.broken:
            return
        pending = conn.pending  # (the errors first: an interrupt there changes nothing)
        errors = [
            lost_in_flight(reason, given(slot.unanswered), cause) for slot in pending.values()
        ]
        try:
            for slot, error in zip(pending.values(), errors, strict=True):
                slot.error = error
                slot.done = True
        finally:  # (an interrupt in it: _wait fails a request left on a broken connection)
            conn.broken = True
            if self._conn is conn:
                self._conn = None
            try:
                pending.clear()
                sleepers = self._sleepers
                while sleepers:  # each looks again: done, or the next reader
                    sleepers.popitem()[1].release()
            finally:
                try:
                    conn.sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked reading it
                except OSError:
                    pass
                finally:
                    sock = conn.sock
                    try:
                        # The C close first: no Python function entry before it, where an
                        # interrupt would leave the descriptor open until the socket is
                        # collected. Idempotent (the fd is -1 before close(2) is called).
                        _socket.socket.close(sock)
                    except (OSError, TypeError):  # (TypeError: not a socket, a test's stand-in)
                        pass
                    finally:
                        with contextlib.suppress(OSError):  # (the descriptor is closed)
                            sock.close()  # the Python bookkeeping: _closed

    def _received(self, conn: _Connection, data: memoryview) -> None:
        """Hand the answers in ``data`` to their slots (EOF and garbage break ``conn``)."""
        if not data:
            self._break(conn, f"the broker at {self.url} closed the connection", None)
            return
        try:
            bodies = conn.reader.feed(data)
        except ProtocolError as exc:
            self._break(conn, f"the broker at {self.url} broke the protocol: {exc}", exc)
            return
        sleepers = self._sleepers
        with self._cond:
            for body in bodies:
                try:
                    request_id, status, payload = check_answer(body, self.url)
                except ProtocolError as exc:
                    self._break_locked(
                        conn, f"the broker at {self.url} broke the protocol: {exc}", exc
                    )
                    return
                slot = conn.pending.pop(request_id, None)
                if conn.reader.columns:
                    conn.reader.columns.discard(request_id)
                conn.reader.pulls.discard(request_id)
                if slot is None:
                    if request_id == CONNECTION_REQUEST_ID:
                        error = answer_error(payload, self.url)
                        text = f"the broker at {self.url} closed the connection: {error}"
                    else:
                        error = ProtocolError(f"{self.url}: an answer to request {request_id}, "
                                              "which is not in flight")  # fmt: skip
                        text = f"the broker at {self.url} broke the protocol: {error}"
                    self._break_locked(conn, text, error)
                    return
                slot.status = status
                slot.payload = payload
                slot.done = True
                if sleepers:
                    waiter = sleepers.pop(slot, None)  # only the thread it is for
                    if waiter is not None:
                        waiter.release()
            if bodies:
                conn.quiet_at = time.monotonic()
                if sleepers:  # a place in max_in_flight came free for a blocked writer
                    waiter = sleepers.pop(None, None)
                    if waiter is not None:
                        waiter.release()

    # --- requests ----------------------------------------------------------------

    def _submit(
        self, batch: list[Call], on: _Connection | None = None, *, columns: bool = True,
        pulls: bool = False,
    ) -> tuple[_Connection, list[_Slot]]:  # fmt: skip
        """Write ``batch``'s requests in one go; their slots, in order. ``on``: only on
        that connection (ConnectionLostError, nothing written, if it broke). ``columns``:
        send_bodies answers read in C into SendResults (only for callers that decode them
        with DECODERS; request() gives what msgpack decodes); ``pulls``: pull_columns'."""
        failed = self._failed[0]
        with self._write_lock:
            while True:
                if on is not None and (on.broken or self._conn is not on):
                    raise lost(f"the connection to {self.url} broke", [])
                try:
                    conn = self._connection(failed)
                except ConnectionLostError as exc:  # nothing of the batch was written
                    exc.unsent = [m for c in batch for m in given(c.unanswered)]
                    raise
                self._wait_for_places(conn, len(batch))
                if not conn.broken:
                    break
            first = self._next_id
            frames = [conn.encoder.frame(first + i, c.op, c.args) for i, c in enumerate(batch)]
            self._next_id = first + len(batch)
            now = time.monotonic()
            slots = [_Slot(c.op, c.unanswered, now + self.timeout + c.wait) for c in batch]
            data = frames[0] if len(frames) == 1 else b"".join(frames)
            registered = False
            try:
                with self._cond:
                    if conn.broken:  # (broke between the check and now: nothing was written)
                        raise lost(f"the connection to {self.url} broke", [])
                    registered = True  # (before: an interrupt as update returns is no orphan)
                    conn.pending.update(zip(range(first, first + len(batch)), slots, strict=True))
                    for i, c in enumerate(batch):
                        if columns and c.op == "send_bodies":  # answer read in C (reader.columns)
                            conn.reader.columns.add(first + i)
                        elif pulls and c.op == "pull_columns":  # the same (reader.pulls)
                            conn.reader.pulls.add(first + i)
                with conn.io_lock:
                    conn.sock.sendall(data)
            except BaseException as exc:  # (a KeyboardInterrupt may leave half a frame)
                if not registered:
                    raise
                if endings.peer_gone(self, exc, conn):  # what the broker wrote before: read
                    return conn, slots  # (by another thread in its turn: it ends conn)
                again: BaseException | None = None
                while not conn.broken:  # (an interrupt in _break, at its entry: again)
                    try:
                        text = f"the connection to {self.url} broke while sending: {exc!r}"
                        self._break(conn, text, exc)
                    except BaseException as second:
                        again = again or second
                if not isinstance(exc, OSError):
                    raise
                if again is not None:
                    raise again from exc
        return conn, slots

    def _wait_for_places(self, conn: _Connection, count: int) -> None:
        """Wait until ``count`` more requests fit in the broker's max_in_flight on
        ``conn`` (past it the broker refuses them), or it broke; under the write lock, so
        later writers queue behind. Reads answers itself when no other thread is reading:
        the requests in flight may be a blocked writer's own (send_many's)."""
        limit = conn.welcome.limits["max_in_flight"]
        if len(conn.pending) + count <= limit:  # (under the write lock only readers take
            return  # from pending: a stale length overstates, never understates)
        while True:
            turn = False
            try:
                with self._cond:
                    while True:
                        pending = conn.pending
                        if conn.broken or not pending or len(pending) + count <= limit:
                            return
                        first = min(pending.values(), key=_deadline)
                        if not self._reading:
                            self._reading = turn = True
                            break
                        self._doze(conn, first, None)
                self._read_some(conn, first)
            finally:
                if turn:  # (given up inline: no function's entry before, no interrupt lands)
                    self._reading = False
                    self._end_turn()

    def _wait(self, conn: _Connection, slot: _Slot, until: float | None = None) -> Any:
        """The decoded-by-msgpack result of ``slot``'s request, or its error raised. With
        ``until`` (time.monotonic()): None once it passed with no answer yet (slot.done
        says; the connection is not closed for it, only at the slot's own deadline)."""
        turn = False  # (the reader's turn, kept while this thread reads on for its answer)
        try:
            while True:
                with self._cond:
                    while not slot.done:
                        if conn.broken:  # (a close interrupted midway: no answer comes)
                            slot.error = lost(f"the connection to {self.url} broke",
                                              given(slot.unanswered))  # fmt: skip
                            slot.done = True
                            continue
                        if turn:
                            break
                        if not self._reading:
                            # (turn set with _reading, no call between: an interrupt
                            # after it, even as the with's release returns, ends the turn)
                            self._reading = turn = True
                            break
                        if until is None or slot.deadline <= until:
                            self._doze(conn, slot, slot)
                            continue
                        left = until - time.monotonic()
                        if left <= 0:
                            return None
                        self._sleep(slot, min(left, turns.TURN_CHECK))
                    else:
                        break
                self._read_some(conn, slot, until)
                if slot.done:  # (its own answer read: no second round under the lock)
                    break
                if until is not None and time.monotonic() >= until:
                    return None
        finally:
            if turn:  # (given up inline: no function's entry before, no interrupt lands)
                self._reading = False
                self._end_turn()
        return self._outcome(slot)  # (a slot done stays as it is: read without the lock)

    def _expire(self, conn: _Connection, slot: _Slot) -> None:
        self._break_locked(
            conn,
            f"no answer from the broker at {self.url} to a {slot.op} request within "
            f"timeout={self.timeout:g}s; the connection is closed",
            None,
        )

    def _read_some(self, conn: _Connection, slot: _Slot, until: float | None = None) -> None:
        if conn.broken:
            return
        sock = conn.sock
        end = slot.deadline if until is None or until > slot.deadline else until
        remaining = end - time.monotonic()
        reading = False
        got: list[int] = []
        try:
            if not (conn.plain and remaining >= DIRECT_READ * self.timeout):
                ready = (isinstance(sock, ssl.SSLSocket) and sock.pending()) or bool(
                    readable(sock, remaining)
                )
                if not ready:
                    if time.monotonic() >= slot.deadline:
                        with self._cond:
                            self._expire(conn, slot)
                    return
            reading = True
            with conn.io_lock:
                # The count is stored by C code (list.extend of map): an interrupt (a
                # KeyboardInterrupt) raised as recv_into returns leaves it known, one
                # raised in recv_into (in its wait) leaves got empty, nothing read.
                got.extend(map(sock.recv_into, conn.inbufs))
        except BlockingIOError:  # the kernel's timeout (EAGAIN) on a direct read
            if time.monotonic() < slot.deadline:
                return  # (a pull's wait: it has longer)
            with self._cond:
                self._expire(conn, slot)
            return
        except (OSError, ValueError) as exc:  # ValueError: a closed socket
            self._break(conn, f"the connection to {self.url} broke: {exc}", exc)
            return
        except BaseException as exc:
            if got:  # interrupted as the read returned: its answers are handed over first
                self._hand_in(conn, conn.inbuf[: got[0]])
            elif reading and not conn.plain:  # (TLS reads in Python: bytes may be lost)
                self._interrupted(conn, exc)
            raise
        try:
            self._received(conn, conn.inbuf[: got[0]])
        except BaseException as exc:  # answers read, some perhaps not handed over
            self._interrupted(conn, exc)
            raise

    def _hand_in(self, conn: _Connection, data: memoryview) -> None:
        try:
            self._received(conn, data)
        except BaseException as exc:  # answers read, some perhaps not handed over
            self._interrupted(conn, exc)
            raise

    def _interrupted(self, conn: _Connection, exc: BaseException) -> None:
        """An interrupt (a KeyboardInterrupt) where bytes read may be lost with it, and
        with them answers other threads wait for: the connection is closed and every
        request in flight on it fails (ConnectionLostError: outcome unknown); the next
        call reconnects."""
        self._break(conn, f"reading from {self.url} was interrupted ({exc!r})", exc)

    def _outcome(self, slot: _Slot) -> Any:
        if slot.error is not None:
            raise slot.error
        if slot.status != STATUS_OK:
            raise answer_error(slot.payload, self.url)
        return slot.payload

    def _call(self, call: Call) -> Any:
        conn, (slot,) = self._submit([call])
        if not call.wait:
            return DECODERS[call.op](self._wait(conn, slot), self.url)
        try:
            payload = self._wait(conn, slot)
        except BaseException:  # (an interrupt: a long poll given up)
            endings.give_up(self, conn, slot)
            raise
        return DECODERS[call.op](payload, self.url)

    def request(self, op: str, arguments: dict[str, Any]) -> Any:
        """One request as the protocol has it (docs/protocol.md): its result as msgpack
        decodes it, or its error raised. The arguments are held to the op table first:
        ProtocolError (nothing sent) for an unknown op or an argument of a wrong type."""
        if not isinstance(op, str) or not isinstance(arguments, dict):
            raise InvalidTypeError("request takes an op (str) and its arguments (dict)")
        check_args(op, arguments, f"request to {self.url}")
        wait = arguments.get("wait_ms", 0) / 1000 if op in PULL_OPS else 0.0
        messages = [arguments] if op in SEND_OPS else None
        conn, (slot,) = self._submit([Call(op, arguments, messages, wait)], columns=False)
        if not wait:
            return self._wait(conn, slot)
        try:
            return self._wait(conn, slot)
        except BaseException:  # (an interrupt: a long poll given up)
            endings.give_up(self, conn, slot)
            raise

    def start_request(self, op: str, arguments: dict[str, Any]) -> tuple[_Connection, _Slot]:
        """``request`` without waiting: whichever thread reads next hands the answer in
        (the slot's ``done``), ``finish_request`` gives it (the group consumer's pulls; a
        pull_columns answer may come as pull_answer's tuple: pullcols.unpack_any)."""
        check_args(op, arguments, f"request to {self.url}")
        wait = arguments.get("wait_ms", 0) / 1000 if op in PULL_OPS else 0.0
        conn, (slot,) = self._submit([Call(op, arguments, None, wait)], columns=False, pulls=True)
        return conn, slot

    def finish_request(self, started: tuple[_Connection, _Slot], until: float | None = None) -> Any:
        """The result of a ``start_request`` (its error raised), waiting for it; with
        ``until`` (time.monotonic()) at most until then: None if not answered by then."""
        conn, slot = started
        return self._outcome(slot) if slot.done else self._wait(conn, slot, until)

    # MessageStore's methods, one request each: equeue/client/syncmethods.py
    _made = syncmethods._made
    send = syncmethods.send
    send_batch = syncmethods.send_batch
    send_many = syncmethods.send_many
    pull = syncmethods.pull
    get = syncmethods.get
    query_by_key = syncmethods.query_by_key
    offset_for_time = syncmethods.offset_for_time
    commit_offset = syncmethods.commit_offset
    committed_offset = syncmethods.committed_offset
    delete_group = syncmethods.delete_group
    create_topic = syncmethods.create_topic
    topics = syncmethods.topics
    deleted_topics = syncmethods.deleted_topics
    queue_ids = syncmethods.queue_ids
    queue_range = syncmethods.queue_range
    stats = syncmethods.stats
    ping = syncmethods.ping
    consumer = syncmethods.consumer

    # --- life --------------------------------------------------------------------

    def close(self) -> None:
        """Close the connection; requests still in flight raise ConnectionLostError."""
        with self._cond:
            self._closed = True
            conn = self._conn
            if conn is not None:
                self._break_locked(conn, f"the client of {self.url} was closed", None)

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("connected" if self._conn else "disconnected")
        return f"<equeue.Client {self.url} {state}>"


_CLIENTS: weakref.WeakSet[Client] = weakref.WeakSet()


def _forked() -> None:
    for client in list(_CLIENTS):
        client._after_fork()


os.register_at_fork(after_in_child=_forked)


def connect(url: str | os.PathLike[str], *, token: str | None = None, **options: Any) -> Client:
    """A blocking client of the broker at ``url`` (``unix:PATH``, ``tcp://HOST:PORT``,
    ``tls://HOST:PORT`` or a store directory); options: timeout, connect_timeout,
    ssl_context, cafile, client_name."""
    return Client(url, token=token, **options)


__all__ = ["Client", "ConnectionLostError", "connect"]
