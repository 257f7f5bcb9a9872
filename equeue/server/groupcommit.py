"""``--flush sync`` across clients: one fdatasync covers the sends of every connection.

Sends are appended on the event loop thread (the broker is the store's only writer)
and their answers kept back in a list. One flusher thread, the broker's own, takes the
whole list, fdatasyncs the message log, and hands the list back to the loop in one
``call_soon_threadsafe``; the loop writes the answers. What a flush releases is exactly
the answers added before the flusher took the list, whose appends all came before it
(an answer is added after its append), so every answer leaves after an fdatasync that
started after its append. Sends arriving meanwhile wait for the next flush, so the more
clients send, the more each fdatasync covers (RocketMQ's GroupCommitService, across
processes instead of threads).

Wake-ups: the flusher keeps flushing while answers keep waiting (after a flush it takes
the next list at once); only when it finds none does it sleep, and the loop wakes it
(one futex wake) for the first answer after that. So a busy broker pays one
``call_soon_threadsafe`` a flush and nothing per send; a thread pool paid a submit, a
future and a callback for every flush and woke the worker every time.

The wait (``group_commit_wait_us``, PostgreSQL's ``commit_delay`` made adaptive): with
many connections each one send in flight, flushing as soon as anything waits splits them
into small cohorts (the few that arrived during the last fdatasync, while the others are
still on their way), and every fdatasync costs the broker ~80-120 µs of CPU. So after a
flush that released N answers to more than one connection, the flusher expects those N
connections to send again, besides the M sends that arrived during that fdatasync (every
send it knows to be in flight), and before its next fdatasync waits until N + M are
waiting, or the wait's bound passes (``group_commit_wait_us``, and at most
``WAIT_PER_FDATASYNC`` times the last fdatasync's duration), or the broker drains or
stops. Waits that end by their count merge the cohorts into one flush a round. It never
waits when the last flush answered one connection (a lone sender, or one pipelining
client: its next send is not made later), nor after it slept idle longer than
``STALE_S`` (the expectation is old), nor after a failed flush (the store refuses the
sends it expected). A send arriving during the wait joins the flush, which starts after
it: the ordering above is unchanged. The wait risks latency only (at most the bound per
flush), never durability: nothing is answered before its fdatasync.

A waiting answer is a (peer, request id, result) tuple, not a closure per send: at tens
of thousands of durable sends a second the broker's CPU per send is the limit.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from equeue.errors import StoreWriteError

log = logging.getLogger("equeue.server")


class Waiter(Protocol):
    """The connection a durable answer goes to (equeue/server/connection.py)."""

    def finish(self, request_id: int, outcome: object) -> None: ...


Entry = tuple[Waiter, int, object]  # the peer, the request id, the answer once durable
Release = Callable[[list[Entry], BaseException | None], None]

# The wait lasts at most this many times the last fdatasync, besides group_commit_wait_us:
# on a fast disk (the broker's CPU the limit) a batch grows ~3x and the connections not
# yet back keep the loop busy meanwhile; on a slow one (the disk the limit) it waits for
# every send in flight, up to group_commit_wait_us, and each fdatasync covers them all.
WAIT_PER_FDATASYNC = 2.0
STALE_S = 0.01  # idle this long, the flusher no longer expects the last flush's senders
NEVER = 1 << 62  # _wake_at when the flusher is busy: no add wakes it


class CrossClientCommit:
    """``add`` and ``drain`` run on the loop; ``flush_log`` runs on the flusher thread.

    ``release(batch, error)`` (on the loop) answers a flushed batch; by default each
    entry's ``peer.finish(request_id, result or the error)``. The broker passes
    connection.release_durable, which writes the answers without a callback per
    connection."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        flush_log: Callable[[], None],
        release: Release | None = None,
        wait_us: int = 0,
        stale_s: float = STALE_S,
        wait_per_fdatasync: float = WAIT_PER_FDATASYNC,
    ) -> None:
        self._loop = loop
        self._max_wait = wait_us / 1e6  # the group-commit wait's bound (0: never wait)
        self._stale = stale_s
        self._per_fdatasync = wait_per_fdatasync
        self._flush_log = flush_log
        self._release_batch = release or finish_each
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._waiting: list[Entry] = []
        # add() wakes the flusher when this many answers wait (under _lock): 1 while it
        # sleeps idle, the expected count during the group-commit wait, else NEVER
        self._wake_at = NEVER
        self._stopping = False
        self._hurry = False  # draining: flush what waits without the group-commit wait
        self._taken = 0  # sends in batches the flusher took, not yet answered (under _lock)
        self._messages = 0  # messages appended by the waiting answers' requests (under _lock)
        self._released_one: asyncio.Event | None = None  # drain() waits on it
        self.flushes = 0
        self.sends_flushed = 0  # messages, not requests: a send_bodies of 40 counts 40
        self.expecting = 0  # what the flusher expects after its last flush (for tests)
        # flushes that waited for expected sends, and of those the ones whose count arrived
        # before the bound (the rest cost latency); written by the flusher, read by stats
        self.waits = 0
        self.waits_full = 0
        self._thread = threading.Thread(target=self._run, name="equeue-broker-flush", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._waiting) + self._taken

    def add(self, peer: Waiter, request_id: int, result: object, messages: int = 1) -> None:
        """``peer.finish(request_id, result)`` once what was appended so far is durable
        (or with the flush's error instead of ``result``); ``messages``: how many the
        request appended, for sends_flushed."""
        with self._lock:
            self._waiting.append((peer, request_id, result))
            self._messages += messages
            if len(self._waiting) >= self._wake_at:
                self._wake_at = NEVER
                self._wake.notify()

    # --- the flusher thread ---------------------------------------------------------

    def _run(self) -> None:
        wake, loop = self._wake, self._loop
        expect = 0  # sends in flight after the last flush, when it answered several connections
        took = 0.0  # the last fdatasync's duration (s)
        while True:
            with wake:
                if not self._waiting and not self._stopping:
                    slept = time.monotonic()
                    while not self._waiting and not self._stopping:
                        self._wake_at = 1
                        wake.wait()
                    if time.monotonic() - slept > self._stale:
                        expect = 0
                if self._hurry or self._stopping:  # draining or stopping: no sends will come
                    expect = 0
                if self._waiting and expect > len(self._waiting):
                    self._wait_for(expect, min(self._max_wait, self._per_fdatasync * took))
                self._wake_at = NEVER
                if not self._waiting:  # stopping, and nothing left
                    return
                batch, self._waiting = self._waiting, []
                messages, self._messages = self._messages, 0
                self._taken += len(batch)
            error: BaseException | None = None
            began = time.monotonic()
            try:
                self._flush_log()
            except BaseException as exc:  # answered to the batch's clients, on the loop
                error = exc
            took = time.monotonic() - began
            expect = expected(batch) if self._max_wait and error is None else 0
            if expect:  # and the sends that came during this flush: every one in flight
                with self._lock:
                    expect += len(self._waiting)
            self.expecting = expect
            try:
                loop.call_soon_threadsafe(self._released, batch, messages, error)
            except RuntimeError:  # the loop closed: nobody is left to answer
                log.error("the event loop closed with %d durable answers unsent", len(batch))
                return

    def _wait_for(self, expect: int, bound: float) -> None:
        """Under _lock, on the flusher: until ``expect`` answers wait, ``bound`` seconds
        pass, or drain/close asks for the flush now."""
        self.waits += 1
        deadline = time.monotonic() + bound
        while len(self._waiting) < expect and not (self._stopping or self._hurry):
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._wake_at = expect
            self._wake.wait(left)
        if len(self._waiting) >= expect:
            self.waits_full += 1

    # --- back on the loop -------------------------------------------------------------

    def _released(self, batch: list[Entry], messages: int, error: BaseException | None) -> None:
        with self._lock:
            self._taken -= len(batch)
        if error is None:
            self.flushes += 1
            self.sends_flushed += messages
        else:
            log.error(
                "flushing the message log failed; %d sends answered with it: %s",
                len(batch), error,
            )  # fmt: skip
            if isinstance(error, StoreWriteError):
                error = type(error)(
                    error.errno, f"the flush of this send failed, it may be lost: {error}"
                )
        try:
            self._release_batch(batch, error)
        except Exception:  # a defect: the others' answers must still go
            log.exception("releasing %d durable answers failed", len(batch))
        if self._released_one is not None:
            self._released_one.set()

    async def drain(self) -> None:
        """Until every send handed over so far is released; from now on the flusher does
        not wait for expected sends (the broker is stopping: none will come)."""
        with self._lock:
            self._hurry = True
            self._wake.notify()
        while self.pending:
            self._released_one = released = asyncio.Event()
            await released.wait()

    def close(self) -> None:
        """Stop the flusher once what is waiting is flushed (its answers need the loop)."""
        with self._lock:
            self._stopping = True
            self._wake.notify()
        self._thread.join()


def expected(batch: list[Entry]) -> int:
    """The sends a flush of ``batch`` leads the flusher to expect next: one from each of
    its answers, if they went to more than one connection; else none (no wait)."""
    first = batch[0][0]
    for peer, _, _ in batch:
        if peer is not first:
            return len(batch)
    return 0


def finish_each(batch: list[Entry], error: BaseException | None) -> None:
    for peer, request_id, result in batch:
        try:
            peer.finish(request_id, result if error is None else error)
        except Exception:  # one connection's failure must not keep the others' answers
            log.exception("releasing a durable send's answer failed")
