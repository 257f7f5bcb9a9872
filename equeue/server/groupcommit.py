"""``--flush sync`` across clients: one fdatasync covers the sends of every connection.

Sends are appended on the event loop thread (the broker is the store's only writer)
and their answers kept back in a list. When a flush is due (below), the loop takes the
whole list and hands the fdatasync of the message log to the flusher (flushers.py: a C
thread that needs no GIL, or a Python thread); when it ends, the loop answers the list.
What a flush releases is exactly the answers added before the loop took the list, whose
appends all came before the fdatasync started (an answer is added after its append), so
every answer leaves after an fdatasync that started after its append. Sends arriving
meanwhile wait for the next flush, so the more clients send, the more each fdatasync
covers (RocketMQ's GroupCommitService, across processes instead of threads). One flush
is in progress at a time, and the next is handed over before the last one's answers are
written; the decisions are the loop's, so a send costs a list append and two counts.

When a flush is due (``group_commit_wait_us``, PostgreSQL's ``commit_delay`` made
adaptive): with many connections each with one send in flight, flushing as soon as
anything waits splits them into small cohorts, and every fdatasync costs the broker CPU.
So the loop keeps count of the sends it expects back: each answer of a flush that went to
more than one connection is expected to bring one (a lone sender, or one pipelining
client, is never waited for: its next send is not made later); each send that arrives
takes one off. With no flush in progress, the next starts once no more are expected than
the slack, or when the wait's bound passes (``group_commit_wait_us``, and at most
``WAIT_PER_FDATASYNC`` times the last fdatasync; the expectation is then dropped), or the
broker drains or stops. The slack (``_overlap``; 0 unless ``overlap_per_fdatasync``, the
broker's ``group_commit_overlap``, is set): where a round of sends (every one in flight
arriving, at the rate they came) takes more than that many fdatasyncs, as many as
arrived during the last fdatasync: those few would come during the next one anyway, so
they join the one after, and each fdatasync overlaps the loop reading the next cohort
and the clients handling the last one's answers. Else (or a slow disk) 0: one fdatasync
a round covering every send in flight; two cohorts would halve what each covers. A
send arriving during the wait joins the flush, which starts after it: the ordering above
is unchanged. The wait risks latency only (at most the bound
per flush), never durability: nothing is answered before its fdatasync. With
``group_commit_wait_us`` 0 a flush starts whenever none is in progress and something
waits.

A waiting answer is a (peer, request id, result) tuple, not a closure per send: at tens
of thousands of durable sends a second the broker's CPU per send is the limit. For the
same reason the send lane (cext/sendlane.c) makes ``add`` in C (cext/commitadd.c) where
it decides nothing: a flush in progress, or the bound armed with more sends expected than
the slack. It reads and writes the state below at its __slots__' offsets, and calls this
``add`` in every other case, before changing anything: the policy is this module's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Final, Protocol

from equeue.errors import StoreWriteError
from equeue.server.flushers import Sync, make_sync

log = logging.getLogger("equeue.server")


class Waiter(Protocol):
    """The connection a durable answer goes to (equeue/server/connection.py)."""

    def finish(self, request_id: int, outcome: object) -> None: ...


Entry = tuple[Waiter, int, object]  # the peer, the request id, the answer once durable
Release = Callable[[list[Entry], BaseException | None], None]

# The wait lasts at most this many times the last fdatasync, besides group_commit_wait_us:
# on a fast disk (the broker's CPU the limit) a cohort grows meanwhile and the connections
# not yet back keep the loop busy; on a slow one (the disk the limit) it waits for the
# cohort, up to group_commit_wait_us.
WAIT_PER_FDATASYNC = 2.0
# Cohorts overlap only where a round of sends takes longer than this many fdatasyncs (the
# broker's group_commit_overlap); 0: never, one fdatasync a round (the default).
OVERLAP_PER_FDATASYNC = 0.0


class CrossClientCommit:
    """Runs on the loop (``add``, ``drain``, ``close``); the fdatasync on the flusher.

    ``release(batch, error)`` (on the loop) answers a flushed batch; by default each
    entry's ``peer.finish(request_id, result or the error)``. The broker passes
    release.release_durable, which writes the answers without a callback per
    connection. ``store``: the store whose ``flush_log`` this is, for the C flusher
    (flushers.make_sync says when it is used)."""

    # the state cext/commitadd.c reads at fixed offsets (no __dict__: nothing set on an
    # instance can bypass it)
    __slots__ = (
        "__weakref__", "_arrived", "_back", "_closing", "_flush_log", "_flushing",
        "_flushing_messages", "_hurry", "_last_end", "_loop", "_max_wait", "_messages",
        "_overlap_per", "_per_fdatasync", "_release_batch", "_released_one", "_slack",
        "_sync", "_took", "_waited", "_waiting", "flushes", "overlapped", "sends_flushed",
        "waits", "waits_full",
    )  # fmt: skip

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        flush_log: Callable[[], None],
        release: Release | None = None,
        wait_us: int = 0,
        wait_per_fdatasync: float = WAIT_PER_FDATASYNC,
        overlap_per_fdatasync: float = OVERLAP_PER_FDATASYNC,
        store: object = None,
    ) -> None:
        self._loop = loop
        self._flush_log = flush_log
        self._max_wait = wait_us / 1e6  # the group-commit wait's bound (0: never wait)
        self._per_fdatasync = wait_per_fdatasync
        self._overlap_per = overlap_per_fdatasync
        self._release_batch = release or finish_each
        self._waiting: list[Entry] = []
        self._messages = 0  # messages appended by the waiting answers' requests
        self._flushing: list[Entry] | None = None  # the batch in fdatasync
        self._flushing_messages = 0
        self._back = 0  # sends expected back from answers released to several connections
        self._slack = 0  # the next flush starts once no more than this many are expected
        self._arrived = 0  # sends added since the last flush ended
        self._last_end = time.monotonic()  # when the last flush ended (on the loop)
        self._took = 0.0  # the last fdatasync's seconds
        self._waited = False  # the bound's timer is armed
        self._hurry = False  # draining or closing: no wait
        self._closing = False  # close(): no flush is handed to the flusher any more
        self._released_one: asyncio.Event | None = None  # drain() waits on it
        self.flushes = 0
        self.sends_flushed = 0  # messages, not requests: a send_bodies of 40 counts 40
        # flushes that waited for expected sends, and of those the ones whose count arrived
        # before the bound (the rest cost latency)
        self.waits = 0
        self.waits_full = 0
        self.overlapped = 0  # flushes after which the next was to overlap (_overlap)
        self._sync: Sync = make_sync(loop, flush_log, self._released, store)

    @property
    def pending(self) -> int:
        return len(self._waiting) + len(self._flushing or ())

    @property
    def expecting(self) -> int:
        """The sends the loop expects back (for tests and stats)."""
        return self._back

    def add(self, peer: Waiter, request_id: int, result: object, messages: int = 1) -> None:
        """``peer.finish(request_id, result)`` once what was appended so far is durable
        (or with the flush's error instead of ``result``); ``messages``: how many the
        request appended, for sends_flushed."""
        waiting = self._waiting
        waiting.append((peer, request_id, result))
        self._messages += messages
        self._arrived += 1
        if self._back:
            self._back -= 1
        if self._flushing is None and self._due():
            self._start()

    def _due(self) -> bool:
        """With no flush in progress and something waiting: whether to start one now, else
        (the cohort not in) arm the bound's timer if it is not armed."""
        waiting = len(self._waiting)
        if not waiting or self._closing:
            return False
        if self._hurry or self._back <= self._slack:
            if self._waited:
                self.waits_full += 1
            return True
        if not self._waited:
            bound = self._per_fdatasync * self._took  # at most _max_wait (no min(): a call)
            if self._max_wait < bound:
                bound = self._max_wait
            if bound <= 0:
                return True
            self._waited = True
            self.waits += 1
            self._sync.arm(bound, self._bound_passed)
        return False

    def _bound_passed(self) -> None:
        self._waited = False
        self._back = 0  # they did not come (as many): the expectation is dropped
        if self._flushing is None and self._waiting:
            self._start()

    def _start(self) -> None:
        if self._waited:
            self._waited = False
            self._sync.disarm()
        self._flushing, self._waiting = self._waiting, []
        self._flushing_messages, self._messages = self._messages, 0
        self._sync.start()

    def _released(self, error: BaseException | None, took: float) -> None:
        batch, messages = self._flushing, self._flushing_messages
        if batch is None:  # a defect: nothing was in fdatasync
            log.error("a flush ended with no batch in progress")
            return
        self._flushing = None
        self._took = took
        during = len(self._waiting)  # the sends that arrived during this fdatasync
        if error is None:
            self.flushes += 1
            self.sends_flushed += messages
            if self._max_wait:  # (draining, _due ignores it)
                self._back += expected(batch)
            if self._overlap_per:  # (fixed: without it _slack stays 0, _last_end unused)
                self._slack = self._overlap(during, took)
                self.overlapped += self._slack > 0
            else:
                self._arrived = 0
        else:
            self._back = 0  # the store refuses the sends it expected
            log.error(
                "flushing the message log failed; %d sends answered with it: %s",
                len(batch), error,
            )  # fmt: skip
            if isinstance(error, StoreWriteError):
                error = type(error)(
                    error.errno, f"the flush of this send failed, it may be lost: {error}"
                )
        if self._due():  # the next cohort's fdatasync before this one's answers are written
            self._start()
        try:
            self._release_batch(batch, error)
        except Exception:  # a defect: the others' answers must still go
            log.exception("releasing %d durable answers failed", len(batch))
        if self._released_one is not None:
            self._released_one.set()

    def _overlap(self, during: int, took: float) -> int:
        """The sends still expected at which the next flush starts: as many as came during
        this fdatasync when it is short beside a round (the time every send in flight
        takes to arrive, at the rate they arrived since the last flush ended): two
        cohorts' fdatasyncs then overlap the loop's reading of the other, and the
        stragglers join the next. Else 0: wait for every expected send, one fdatasync a
        round (a slow disk: two cohorts would halve what each covers)."""
        now = time.monotonic()
        cycle, self._last_end = now - self._last_end, now
        arrived, self._arrived = self._arrived, 0
        if not self._overlap_per or not during or arrived <= 0 or cycle <= 0:
            return 0
        round_s = (self._back + during) * cycle / arrived
        return during if self._overlap_per * took < round_s else 0

    async def drain(self) -> None:
        """Until every send handed over so far is released; from now on the loop does not
        wait for expected sends (the broker is stopping: none will come)."""
        self._hurry = True
        if self._flushing is None and self._due():
            self._start()
        while self.pending:
            self._released_one = released = asyncio.Event()
            await released.wait()

    def close(self) -> None:
        """Stop the flusher once the flush in progress ended; what still waits is flushed
        here, on the loop's thread, and answered (nothing leaves unanswered)."""
        self._hurry = self._closing = True
        sync = self._sync
        sync.close()  # the flush in progress ends, and its answers are released here
        if sync.ended:
            log.info(
                "group commit: %d fdatasyncs by the %s, %.0f µs each, handled on the loop "
                "%.0f µs after their end on average; %d followed by an overlapping cohort",
                sync.ended, type(sync).__name__, sync.synced_s / sync.ended * 1e6,
                sync.woke_s / sync.ended * 1e6, self.overlapped,
            )  # fmt: skip
        if self._waiting:
            self._flushing, self._waiting = self._waiting, []
            self._flushing_messages, self._messages = self._messages, 0
            error: BaseException | None = None
            try:
                self._flush_log()
            except BaseException as exc:
                error = exc
            self._released(error, 0.0)

    # The add and _due cext/commitadd.c mirrors, as written above: C adds while the
    # commit's class finds these two under their names, looked at again whenever the
    # class or a base changes (a subclass overriding either, or either replaced on a
    # class at any time, gets its own add called for every send).
    _c_policy: Final = (add, _due)


def expected(batch: list[Entry]) -> int:
    """The sends a flush of ``batch`` leads the flusher to expect next: one from each of
    its answers, if they went to more than one connection; else none (no wait)."""
    first = batch[0][0]
    if batch[-1][0] is not first:  # the common answer, a send per connection: no loop
        return len(batch)
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
