"""What runs the group commit's fdatasync (groupcommit.py decides when, on the loop).

``CSync``: a C thread (equeue/cext/flusher.c) fdatasyncs the message log's current chunk
and signals an eventfd the loop watches; it never needs the GIL, so a flush's end reaches
the loop in its next turn however busy it is, and the wait's bound is a timerfd (µs; the
loops' own timers have ms resolution). The bookkeeping (what is durable, a failure's
consequences) is done on the loop (equeue/store/flush.py: log_sync_target, log_synced).

``ThreadSync``: a Python thread calls ``flush_log`` (any callable: the store's, a test's)
and hands the outcome back with ``call_soon_threadsafe``. It needs the GIL after each
fdatasync, which the loop holds through a busy turn. The broker uses it where the C
flusher would bypass what the caller put in place: ``store.flush_log`` or
``os.fdatasync`` replaced (a fault injector, the power-loss model of the tests),
``flush_log`` overridden by a subclass of MessageStore, no C accelerator, or not Linux;
its wait's bound is a loop timer (ms resolution). The choice is made once, when the
broker starts: a fault injector installed after that is not seen by the C thread."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
import types
from collections.abc import Callable
from typing import Any, Protocol

from equeue.chunks.chunk import Chunk
from equeue.store.flush import LogSyncHost, OwnDescriptor, log_sync_target, log_synced
from equeue.store.store import MessageStore

Done = Callable[[BaseException | None, float], None]  # the error or None, fdatasync's seconds

try:
    from equeue._speedups import Flusher
except ImportError:  # no accelerator: ThreadSync
    Flusher = None  # type: ignore[assignment,misc]


class Sync(Protocol):
    # fdatasyncs ended, their seconds in all, and the seconds from each one's end until
    # the loop handled it (what a flusher needing the GIL waited for), in all
    ended: int
    synced_s: float
    woke_s: float

    def start(self) -> None: ...
    def arm(self, seconds: float, expired: Callable[[], None]) -> None: ...
    def disarm(self) -> None: ...
    def close(self) -> None: ...


class ThreadSync:
    """``start()`` (on the loop): ``flush_log()`` on the thread, then ``done(error, took)``
    on the loop. One flush at a time (the caller's rule)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, flush_log: Callable[[], None], done: Done):
        self._loop = loop
        self._flush_log = flush_log
        self._done = done
        self._wake = threading.Condition()
        self._job = False
        self._stopping = False
        self._timer: asyncio.TimerHandle | None = None
        self._outcome: tuple[BaseException | None, float, float] | None = None  # undelivered
        self.ended = 0
        self.synced_s = self.woke_s = 0.0
        self._thread = threading.Thread(target=self._run, name="equeue-broker-flush", daemon=True)
        self._thread.start()

    def start(self) -> None:
        with self._wake:
            self._job = True
            self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._job and not self._stopping:
                    self._wake.wait()
                if not self._job:
                    return
                self._job = False
            error: BaseException | None = None
            began = time.monotonic()
            try:
                self._flush_log()
            except BaseException as exc:  # answered to the batch's clients, on the loop
                error = exc
            ended = time.monotonic()
            with self._wake:
                self._outcome = (error, ended - began, ended)
            try:
                self._loop.call_soon_threadsafe(self._deliver)
            except RuntimeError:  # the loop closed: nobody is left to answer
                return

    def _deliver(self) -> None:
        with self._wake:
            outcome, self._outcome = self._outcome, None
        if outcome is not None:  # else close() delivered it
            error, took, ended = outcome
            self.ended += 1
            self.synced_s += took
            self.woke_s += time.monotonic() - ended
            self._done(error, took)

    def arm(self, seconds: float, expired: Callable[[], None]) -> None:
        self.disarm()
        self._timer = self._loop.call_later(seconds, expired)

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def close(self) -> None:
        """After the flush in progress, if any, ended; its ``done`` runs here."""
        self.disarm()
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join()
        self._deliver()


class CSync:
    """The C flusher on the store's message log; ``done`` runs in the loop's reader."""

    def __init__(self, loop: asyncio.AbstractEventLoop, store: LogSyncHost, done: Done) -> None:
        assert Flusher is not None
        self._loop = loop
        self._store = store
        self._done = done
        self._flusher = flusher = Flusher()
        self._own = OwnDescriptor()  # the C thread's own description of the chunk (errseq)
        self._target: tuple[Chunk, int] | None = None  # the chunk in fdatasync, its end
        self._expired: Callable[[], None] | None = None
        self._outcome: tuple[BaseException | None, float] | None = None  # not yet delivered
        self.ended = 0
        self.synced_s = self.woke_s = 0.0
        loop.add_reader(flusher.event_fd, self._ended)
        loop.add_reader(flusher.timer_fd, self._timer)

    def start(self) -> None:
        try:
            target = log_sync_target(self._store, self._own)
            if target is not None:
                chunk, fd, end = target
                self._flusher.start(fd)
                self._target = (chunk, end)
        except BaseException as exc:  # the batch's answer: after the caller's start
            self._later(exc)
            return
        if target is None:  # nothing unsynced: every append before this is durable
            self._later(None)

    def _later(self, error: BaseException | None) -> None:
        self._outcome = (error, 0.0)
        self._loop.call_soon(self._deliver)

    def _deliver(self) -> None:
        outcome, self._outcome = self._outcome, None
        if outcome is not None:  # else close() delivered it
            self._done(*outcome)

    def _ended(self, outcome: tuple[int, float, float] | None = None) -> None:
        """The fdatasync of ``_target`` ended (the loop's reader of the eventfd, or close()
        with the outcome it collected): its bookkeeping, then ``done``. One Python frame a
        flush: this runs once per fdatasync on the loop."""
        if outcome is None:
            outcome = self._flusher.collect()
            if outcome is None:
                return
        target = self._target
        if target is None:
            return
        error_no, took, ended = outcome
        self.ended += 1
        self.synced_s += took
        self.woke_s += time.monotonic() - ended
        self._target = None
        error: BaseException | None = None
        try:
            log_synced(self._store, target[0], target[1], error_no)
        except BaseException as exc:
            error = exc
        self._done(error, took)

    def arm(self, seconds: float, expired: Callable[[], None]) -> None:
        self._expired = expired
        us = int(seconds * 1e6)  # (not round(): a builtin call, 700 instructions a flush)
        self._flusher.arm(us if us > 0 else 1)

    def disarm(self) -> None:
        self._expired = None
        self._flusher.arm(0)

    def _timer(self) -> None:
        if self._flusher.expired() and self._expired is not None:
            expired, self._expired = self._expired, None
            expired()

    def close(self) -> None:
        """After the flush in progress, if any, ended; its ``done`` runs here."""
        self._expired = None
        flusher = self._flusher
        for fd in (flusher.event_fd, flusher.timer_fd):
            if fd >= 0:
                with contextlib.suppress(Exception):  # the loop closed: nothing to remove
                    self._loop.remove_reader(fd)
        if self._target is None:
            flusher.close()
            self._own.close()
            self._deliver()
            return
        while (outcome := flusher.collect()) is None:  # the thread is in fdatasync
            time.sleep(0.0002)
        flusher.close()
        self._own.close()
        self._ended(outcome)


def make_sync(
    loop: asyncio.AbstractEventLoop,
    flush_log: Callable[[], None],
    done: Done,
    store: Any = None,
) -> Sync:
    """CSync for ``store`` where it does what ``flush_log`` would (see the module's
    docstring), else ThreadSync. Decided here, once."""
    own = (
        store is not None
        and Flusher is not None
        # MessageStore's own flush_log, which log_sync_target/log_synced mirror; not a
        # subclass's override (a store shipping its log, a test's fault injector)
        and getattr(flush_log, "__func__", None) is MessageStore.flush_log
        and type(store).flush_log is MessageStore.flush_log
        and getattr(flush_log, "__self__", None) is store
        and isinstance(os.fdatasync, types.BuiltinFunctionType)
    )
    if own:
        try:
            return CSync(loop, store, done)
        except NotImplementedError:  # not Linux: the accelerator has no C flusher there
            pass
    return ThreadSync(loop, flush_log, done)
