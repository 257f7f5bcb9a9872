"""When sends become durable: group commit for flush="sync", the background service otherwise.

Only the message log is flushed before a send is acknowledged. Its record
carries everything the queue entry holds (topic, queue id, queue offset, tag
hash, position), so the queue chunks are a derived index flushed before each
checkpoint, and recovery rebuilds any entry written after the checkpoint from
the log (RocketMQ flushes its consume queues the same way). One fdatasync per
acknowledged batch instead of two is what lets one producer thread keep up
with a plain append + fdatasync loop.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from equeue.chunks.chunk import Chunk
from equeue.chunks.fileops import write_error
from equeue.chunks.writer import ChunkWriter
from equeue.errors import ClosedError, StoreReplacedError, StoreWriteError
from equeue.store.config import StoreConfig

log = logging.getLogger("equeue.flush")

R = TypeVar("R")
PAGE_SIZE = 4096  # flush_least_pages counts pages of this size
# The attempt number a failed log fdatasync is recorded under (_set_flush_error keeps the
# outcome of the latest-started attempt): no later attempt reaches it, so no later service
# turn or flush that succeeds clears it, only a reopen (a new store) does.
STICKY_ATTEMPT = 1 << 62
# Why the broker's flusher may fail to open a chunk for a moment (log_sync_target)
TRANSIENT_OPEN_ERRORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EINTR})


class _Request:
    __slots__ = ("done", "error", "lead", "result", "work")

    def __init__(self, work: Callable[[], Any]) -> None:
        self.work = work
        self.result: Any = None
        self.error: BaseException | None = None
        self.lead = False
        self.done = threading.Lock()
        self.done.acquire()  # released when the request is durable, failed, or must lead


class FlushRecorder(Protocol):
    def _start_flush(self) -> int: ...
    def _set_flush_error(self, error: StoreWriteError | None, attempt: int) -> None: ...


def flush_recorded(host: FlushRecorder, flush: Callable[[], None], sticky: bool = True) -> None:
    """Run a log flush that acknowledges sends (GroupCommit's, the broker's): a failure is
    kept as the store's flush error, as a failed service turn is, so every later send is
    refused before anything is written instead of being stored, delivered, and answered
    "may be lost". A chunk's failed fdatasync is sticky, so only a reopen clears it: a
    later service turn that skips that chunk (fewer than flush_least_pages unflushed) and
    succeeds must not let the next send into it (recorded under STICKY_ATTEMPT).
    ``sticky`` false: a failure that synced nothing and lost nothing (the broker's flusher
    could not open the chunk: too many open files), refused only until a later flush
    succeeds, as a failed service turn is."""
    try:
        flush()
    except StoreWriteError as exc:
        host._set_flush_error(exc, STICKY_ATTEMPT if sticky else host._start_flush())
        until = "the store is reopened" if sticky else "a flush succeeds"
        # Same class (DiskFullError stays DiskFullError), saying what to do.
        raise type(exc)(
            exc.errno, f"{exc.strerror or exc}; every later send is refused until {until}"
        ) from exc


class GroupCommit:
    """flush="sync": sends are queued, and one thread appends a whole batch and flushes it.

    A sender puts its append (a closure) on the pending list. If no batch is
    in progress it leads: it takes every pending request, runs their appends
    under the write lock, flushes the log once (an fdatasync, during which
    other threads run and queue more requests), and releases each request.
    Then it hands the lead to the oldest request that arrived meanwhile, so
    no sender serves others for long. The write lock changes hands once per
    batch instead of once per send (flat combining; RocketMQ's
    GroupCommitService swaps its request lists for the same effect), and
    batches grow with the number of producer threads.
    """

    def __init__(
        self,
        lock: threading.Lock | threading.RLock,
        flush: Callable[[], None],
        after: Callable[[], None],
    ) -> None:
        self._write_lock = lock
        self._flush = flush
        self._after = after  # wakes waiting pulls once a batch is in place
        self._pending: list[_Request] = []
        self._pending_lock = threading.Lock()
        self._leading = False
        self._submitting: set[int] = set()  # the threads inside submit()
        self.flushes = 0  # how many flushes ran; the benchmark reports sends per flush

    def submit(self, work: Callable[[], R], reentered: Callable[[], BaseException]) -> R:
        """Run ``work`` under the write lock; return its result once it is durable.

        A submit re-entered on a thread inside one already (a signal handler's send, or
        a callback's) raises ``reentered()``: as the leader, outside the write lock while
        it flushes, the thread would wait for itself forever."""
        me = threading.get_ident()
        if me in self._submitting:
            raise reentered()
        self._submitting.add(me)
        try:
            return self._submit(work)
        finally:
            self._submitting.discard(me)

    def _submit(self, work: Callable[[], R]) -> R:
        request = _Request(work)
        with self._pending_lock:
            self._pending.append(request)
            lead = not self._leading
            self._leading = True
        if not lead:
            request.done.acquire()  # served by a leader, or handed the lead
        if lead or request.lead:
            self._lead()
        if request.error is not None:
            raise request.error
        return request.result  # type: ignore[no-any-return]

    def _lead(self) -> None:
        with self._pending_lock:
            batch, self._pending = self._pending, []
        with self._write_lock:
            for request in batch:
                try:
                    request.result = request.work()
                except BaseException as exc:  # handed to its own sender
                    request.error = exc
        try:
            self._flush()
            self.flushes += 1
        except StoreWriteError as exc:
            for request in batch:
                if request.error is None:  # same class: DiskFullError stays DiskFullError
                    request.error = type(exc)(
                        exc.errno, f"the flush of this send failed, it may be lost: {exc}"
                    )
                    request.error.__cause__ = exc
        except BaseException as exc:  # every sender of the batch must still be released
            for request in batch:
                request.error = request.error or exc
        try:
            self._after()
        except Exception:
            log.exception("waking waiting pulls failed")
        with self._pending_lock:
            following = self._pending[0] if self._pending else None
            if following is None:
                self._leading = False
            else:
                following.lead = True
        for request in batch:
            if request.lead:  # that is the caller; it returns from _lead() itself
                request.lead = False
            else:
                request.done.release()
        if following is not None:
            following.done.release()


class ServiceHost(Protocol):
    """What the background service needs from the store."""

    config: StoreConfig

    def _flush_log(self, least_bytes: int) -> None: ...
    def _flush_queues(self, least_bytes: int) -> None: ...
    def _checkpoint_due(self) -> bool: ...
    def _checkpoint(self, *, flush: bool, settle: bool = ...) -> None: ...
    def _apply_retention_in_service(self) -> None: ...
    def _adopt_compacted(self, *, blocking: bool) -> None: ...
    def _start_flush(self) -> int: ...
    def _set_flush_error(self, error: StoreWriteError | None, attempt: int) -> None: ...


_DUE_POLL_SECONDS = 0.05


def run_service(host: ServiceHost, stop: threading.Event) -> None:
    """Background work until ``stop`` is set: periodic flushes, checkpoints, retention.

    Every ``flush_interval_ms``: under "async", flush the log and each queue
    with at least ``flush_least_pages`` unflushed pages. Every
    ``flush_thorough_interval_ms``, or as soon as a checkpoint is due (32 MiB of
    log since the last, or a full key batch; looked at every 50 ms): a
    checkpoint, which flushes everything first, then retention. After a failed
    turn the next one waits the full ``flush_interval_ms``. A failed
    flush is kept as the store's flush error (sends raise it) until a later
    flush succeeds; "later" by when the attempts started, so a turn that fails
    while a concurrent flush() succeeds does not refuse sends after it.
    """
    config = host.config
    least = config.flush_least_pages * PAGE_SIZE
    flush_async = config.flush == "async"
    interval = config.flush_interval_ms / 1000
    thorough_interval = config.flush_thorough_interval_ms / 1000
    last_thorough = last_turn = time.monotonic()
    # Between turns, look often whether a checkpoint is due by bytes: a fast writer
    # fills _CHECKPOINT_BYTES long before the next turn, and what it writes after the
    # checkpoint is what recovery re-reads (measured: 300 MB behind at 500 ms turns).
    poll = min(interval, _DUE_POLL_SECONDS)
    failed = False  # after a failed turn, the next waits the full interval: no retry storm
    while not stop.wait(poll):
        now = time.monotonic()
        if now - last_turn < interval and (failed or not host._checkpoint_due()):
            continue
        last_turn = now
        failed = False
        attempt = host._start_flush()
        try:
            if time.monotonic() - last_thorough >= thorough_interval or host._checkpoint_due():
                host._checkpoint(flush=config.flush != "os")
                last_thorough = time.monotonic()
                _turn_succeeded(host, attempt)
                host._apply_retention_in_service()
            elif flush_async:
                host._flush_log(least)
                host._flush_queues(least)
                _turn_succeeded(host, attempt)
            host._adopt_compacted(blocking=False)
        except ClosedError:
            return
        except StoreReplacedError as exc:  # sticky: every later turn would fail the same
            log.error("the store's service stops: %s", exc)
            return
        except StoreWriteError as exc:
            log.error(
                "background flush failed, sends are refused until one succeeds (after a failed "
                "fdatasync: until the store is reopened): %s",
                exc,
            )
            record_flush_failure(host, exc, attempt)
            failed = True
        except Exception:  # the service must outlive any one failure; the next turn retries
            log.exception("background service step failed")
            failed = True


def _turn_succeeded(host: ServiceHost, attempt: int) -> None:
    """A service turn's flushes succeeded: lift the store's flush error, unless the log's
    current chunk has a failed fdatasync (sticky; a flush() or an earlier turn failed it,
    and this turn skipped the log: fewer than flush_least_pages unflushed): then refuse
    every later send until a reopen, as the broker's group commit does (flush_recorded),
    instead of storing sends into a chunk no flush can make durable."""
    failure = _failed_log(host)
    if failure is None:
        host._set_flush_error(None, attempt)
    else:
        host._set_flush_error(failure, STICKY_ATTEMPT)


def record_flush_failure(host: FlushRecorder, exc: StoreWriteError, attempt: int) -> None:
    """A failed flush (a service turn's, ``flush()``'s) as the store's flush error: sends
    are refused until a later flush succeeds, or until a reopen if the log's chunk failed
    its fdatasync (sticky: no later flush can make what it holds durable)."""
    host._set_flush_error(exc, attempt if _failed_log(host) is None else STICKY_ATTEMPT)


def _failed_log(host: FlushRecorder) -> StoreWriteError | None:
    """The failure of the log's current chunk's fdatasync, if one failed (Chunk._failed)."""
    chunk = getattr(getattr(host, "_writer", None), "_chunk", None)
    failed = getattr(chunk, "_failed", None)
    return None if failed is None else failed[2]


class LogSyncHost(FlushRecorder, Protocol):
    """What the broker's C flusher needs from the store (MessageStore)."""

    _writer: ChunkWriter

    def _check_writable(self) -> None: ...


class OwnDescriptor:
    """The broker's C flusher's own open file description of the log's current chunk, one
    per chunk (an open per chunk, not per flush).

    Linux reports a writeback error to each open file description once (errseq,
    ``f_wb_err``): a dup of the chunk's descriptor shares it with ``Chunk.flush`` (a
    rollover's complete() on the loop, the background service), so an EIO one of those
    was told of could reach the C thread's concurrent fdatasync as success. A description
    of its own is told of every error since it was opened, whoever else was told."""

    def __init__(self) -> None:
        self._chunk: Chunk | None = None
        self._fd = -1

    def of(self, chunk: Chunk) -> int:
        if chunk is not self._chunk:
            self.close()
            self._fd = _open_own(chunk)
            self._chunk = chunk
        return self._fd

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
        self._fd, self._chunk = -1, None


def _open_own(chunk: Chunk) -> int:
    """Open ``chunk``'s file again, checked to be the same file (never a symlink or another
    file put at its path). Under the chunk's flush lock: no fdatasync of it runs meanwhile,
    so an error reported before the open is in ``chunk._failed`` already (the caller looks
    after), and one after it is reported to this description too."""
    with chunk._flush_lock:
        try:
            fd = os.open(chunk.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as exc:
            raise write_error(exc, "opening a chunk for the broker's flusher", chunk.path) from exc
        try:
            mine, its = os.fstat(fd), os.fstat(chunk._fd)
        except OSError as exc:
            os.close(fd)
            raise write_error(exc, "opening a chunk for the broker's flusher", chunk.path) from exc
        if (mine.st_dev, mine.st_ino) != (its.st_dev, its.st_ino):
            os.close(fd)
            raise StoreWriteError(
                errno.ESTALE,
                f"opening a chunk for the broker's flusher: {chunk.path} is no longer the file "
                "the store writes (replaced or renamed under it); its sends cannot be made "
                "durable, close and reopen the store",
            )
        return fd


def log_sync_target(host: LogSyncHost, own: OwnDescriptor) -> tuple[Chunk, int, int] | None:
    """``flush_log`` split for a flusher that fdatasyncs on a thread of its own, with no
    GIL (the broker's, equeue/cext/flusher.c): on the loop, what to fdatasync now to make
    every append so far durable: (the log's current chunk, ``own``'s descriptor of it, its
    data end); None if nothing is to be synced (no append since the last flush, or every
    append is in a completed chunk: completing fdatasyncs it). Raises what ``flush_log``
    would (a closed or read-only store; a chunk whose earlier fdatasync failed, recorded)."""
    host._check_writable()
    chunk = host._writer._chunk
    if chunk is None:
        return None
    if chunk._failed is not None:  # sticky: refused without an fdatasync, as flush_log does
        flush_recorded(host, lambda: chunk._fdatasync("flushing a chunk"))
    end = chunk.data_end
    if end <= chunk.flushed_end or chunk._fd < 0:  # covered already; closed: completed
        return None
    if own._chunk is not chunk:
        try:
            own.of(chunk)
        except StoreWriteError as exc:  # this batch not made durable, recorded
            failure = exc

            def failed_open() -> None:
                raise failure

            # Out of descriptors or memory: nothing failed to reach the disk, the next flush
            # opens again. A file replaced at the chunk's path: refused until a reopen.
            flush_recorded(host, failed_open, sticky=exc.errno not in TRANSIENT_OPEN_ERRORS)
    fd = own._fd if own._chunk is chunk else own.of(chunk)  # (a call less a flush)
    if chunk._failed is not None:  # failed before the open: its description missed it
        flush_recorded(host, lambda: chunk._fdatasync("flushing a chunk"))
    return chunk, fd, end


def log_synced(host: LogSyncHost, chunk: Chunk, end: int, error: int) -> None:
    """After the fdatasync of ``log_sync_target``'s descriptor (``error``: its errno, 0 if
    it succeeded): the chunk's bookkeeping a successful ``Chunk.flush`` does, or what its
    failure does (the chunk's sticky failure, its callback, the store's flush error); then
    raises that failure as ``flush_log`` does. Lock-free: the flushed ends only grow
    (another flush's lower end written meanwhile costs one redundant fdatasync later)."""
    if error == 0 and chunk.name_pending:
        # A chunk made ahead: its name durable before any answer vouches for its data
        # (the chunk maker fsyncs the directory from the roll-over on; this waits for it)
        try:
            chunk.make_name_durable()
        except OSError as name_failure:
            error = name_failure.errno or errno.EIO
    if error == 0 and chunk._failed is not None:
        # Another fdatasync of the chunk failed meanwhile (a rollover's complete(), the
        # service): nothing it covered may be claimed durable, this batch's data included.
        flush_recorded(host, lambda: chunk._fdatasync("flushing a chunk"))
    if error == 0:
        before = chunk.flushed_end
        if end > before:
            chunk.flushed_end = end
        if end > chunk.synced_end:
            chunk.synced_end = end
        # Once per half window crossed, not per flush: a madvise(MADV_DONTNEED) a flush (43
        # sends at 64 connections) zapped the page or two flushed since the last one, a TLB
        # shootdown IPI to the CPU running the flusher or prefault thread each time.
        chunk.release_behind(before, end)
        return
    exc = OSError(error, os.strerror(error))
    failure = write_error(exc, "flushing a chunk", chunk.path)
    if chunk._failed is None:
        chunk._failed = (chunk.flushed_end, exc.strerror or str(exc), failure)
    if chunk.on_sync_failure is not None:
        chunk.on_sync_failure()

    def failed() -> None:
        raise failure from exc

    flush_recorded(host, failed)
