"""The store's cache of open queues: a bound on the files its queues hold.

A queue's files (its chunks' descriptors and mappings) are opened on first use
(``Queue.manager``) and closed again, least recently used first, once more than
``limit`` queues are open; ``first_offset`` and ``next_offset`` stay in memory, so
a closed queue costs neither a descriptor nor a ChunkManager. One open queue holds
at most FILES_PER_QUEUE descriptors: its ongoing chunk's, the duplicate Python's
mmap keeps of it, and one completed chunk mapped for a reader (QUEUE_READ_MAPS).

Queues are opened and closed only under ``lock``, the store's write lock (an RLock,
so a send that holds it opens the queue it writes to): no write is ever in flight
into a queue being closed, and the C Sender, which reads ``Queue._writer`` under
the same lock on every send, finds None after a close and hands the send to the
Python path, which opens the queue again. Being reentrant, the lock would not stop a
send re-entered on the thread that holds it (a signal handler's, a callback's): every
send checks first (``RLock._is_owned``, in C and in Python) and raises
ReentrantSendError, writing nothing (``reentered``). A reader that took a mapping before the
close keeps it valid until it drops it: closing drops references, it unmaps nothing
(``ChunkManager.release_files``).

Entries written since their chunk's last flush are not flushed by the close (an
fdatasync per eviction would make a round-robin send cost one each): their file is
remembered and synced by the next flush of the queues (``sync_closed``), which every
checkpoint runs before it records the queues' ends.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

from equeue.chunks.fileops import write_error
from equeue.errors import CorruptionError, ReentrantSendError, StoreWriteError
from equeue.format.chunk import parse_chunk_file_name
from equeue.format.message import QUEUE_RECORD_SIZE

if TYPE_CHECKING:
    from pathlib import Path

    from equeue.chunks import ChunkManager
    from equeue.chunks.recovery import TailCut
    from equeue.store.queue import Queue

log = logging.getLogger("equeue.recovery")

ticks = itertools.count(1)  # recency of use, for the least recently used (Queue.last_used)

QUEUE_READ_MAPS: Final = 1  # completed chunks of one queue mapped at once (max_open_chunks)
FILES_PER_QUEUE: Final = 2 + QUEUE_READ_MAPS


class QueueFiles:
    def __init__(self, lock: threading.RLock | None, limit: int) -> None:
        self.lock = lock if lock is not None else threading.RLock()
        self.limit = limit  # open queues at most; 0: no limit (a Queue made on its own)
        self._open: dict[Queue, None] = {}  # the open queues
        self._unsynced: set[str] = set()  # chunk files closed with unflushed entries
        self._unsynced_lock = threading.Lock()
        self._failed: tuple[str, StoreWriteError] | None = None  # a failed fdatasync's
        self.on_sync_failure: Callable[[], None] | None = None
        # every queue's ChunkManager.before_create (the store's directory guard)
        self.before_create: Callable[[], None] | None = None
        # What opening a queue found and cut (its ChunkManager's recovery), for the store's
        # RecoveryReport: a queue opened at the store's open may be closed before it is made.
        self.problems: list[str] = []
        self.cuts: list[TailCut] = []
        self.logged: list[str] = []
        self.opened = 0  # counters, for benchmarks and inspect
        self.closed = 0
        # The ends of queues not opened yet: {topic: [(first, next) per queue id]}, from a
        # clean checkpoint (``clean_ends``) while the store opens; ``new`` for the others:
        # None (opened at once, ends from their files) at the open, (0, 0) after it.
        self.known: dict[str, list[tuple[int, int]]] = {}
        self.new: tuple[int, int] | None = None
        self.pending: tuple[dict[str, Any], int] | None = None
        self.log_end = 0  # the log's end at the writer's open
        # The store's checks of a queue whose open it deferred (queuerebuild.py): the spot
        # check of its entries on its first open, and the rebuild of a damaged one.
        self.check: Callable[[Queue], None] | None = None
        # A read-only handle's: its queues past the first ``limit`` are made closed, their
        # ends unknown (read from their files when first opened), and ``after_open`` moves
        # a queue opened again past the entries of messages retention removed.
        self.lazy_reader = False
        self._made = 0
        self.after_open: Callable[[Queue], None] | None = None
        self.rebuild: Callable[[Queue, tuple[int, int], str], ChunkManager] | None = None

    @property
    def open_count(self) -> int:
        return len(self._open)

    def open(self, queue: Queue) -> ChunkManager:
        """Open ``queue``'s files (``Queue.manager`` calls this when they are closed),
        then close the least recently used queues past the limit."""
        with self.lock:
            manager = queue._manager
            if manager is not None:
                return manager
            ends, first_open = queue._expected, not queue.checked
            if queue._read_only:
                queue._expected = None  # a reader's ends are its files' (the writer's)
            try:
                manager = queue.load()
                if self.after_open is not None:
                    self.after_open(queue)
                self.cuts += manager.recovery_cuts
                self.problems += manager.recovery_problems
                self.logged += manager.recovery_problems  # (each logged as it was found)
                self._check_ends(queue, manager)
                if first_open and ends is not None and self.check is not None:
                    self.check(queue)  # the store's open deferred its checks to here
            except CorruptionError as exc:
                queue.release()
                if ends is None or self.rebuild is None or queue._read_only:
                    raise
                manager = self.rebuild(queue, ends, str(exc))
            except BaseException:
                queue.release()
                raise
            queue.checked = True
            if self.on_sync_failure is not None:
                manager.set_on_sync_failure(self.on_sync_failure)
            self.opened += 1
            self._open[queue] = None
            queue.last_used = next(ticks)
            self._evict(queue)
            return manager

    def plan(self, deleted: dict[str, int]) -> None:
        """At a writer's open, once topics.json's deletions are read: which queues open
        lazily (``clean_ends``): all of them, when there are more than stay open."""
        if self.pending is None:
            return
        checkpoint, log_end = self.pending
        self.pending = None
        self.log_end = log_end
        known = clean_ends(checkpoint, log_end, deleted)
        # As many queues as the cache keeps open are opened, and checked, by the store's
        # open, as before; past that, opening them all would only close them again.
        if sum(map(len, known.values())) > self.limit:
            self.known = known

    def opened_store(self) -> None:
        """The writer's open is done: queues created from now on start empty."""
        self.known, self.new = {}, (0, 0)

    def ends(self, topic: str, queue_id: int) -> tuple[int, int] | None:
        known = self.known.get(topic, ())
        if queue_id < len(known):
            return known[queue_id]
        if self.lazy_reader:
            self._made += 1
            return None if self._made <= self.limit else (0, 0)  # (0, 0): opened on use
        return self.new

    def managers(self) -> list[ChunkManager]:
        """The open queues' chunk managers."""
        return [m for m in (q._manager for q in list(self._open)) if m is not None]

    def forget(self, queue: Queue) -> None:
        """``queue`` was closed for good (store close, delete_topic, or a read-only
        handle following a deletion, without the write lock: hence the lock here)."""
        with self.lock:
            self._open.pop(queue, None)

    def reopen_later(self, queue: Queue, forget: bool = True) -> None:
        """A read-only handle's ``queue`` whose files were found replaced: closed. Its next
        use opens its directory as it is now, whatever it held before (``forget``), or
        checks again that the files are the ones it last held (queue.Queue._seen)."""
        with self.lock:
            if queue in self._open:
                self._close(queue)
            if forget:
                queue._seen = None

    def close_idle(self) -> None:
        """Close every open queue (their entries stay in memory): for benchmarks."""
        with self.lock:
            for queue in list(self._open):
                self._close(queue)

    def _evict(self, keep: Queue) -> None:
        excess = len(self._open) - self.limit
        if self.limit <= 0 or excess <= 0:
            return
        # An eighth of the cache at once: one search per limit // 8 opens, not one each
        # (a round robin over more queues than fit opens one per send).
        count = max(excess, self.limit // 8)
        victims = heapq.nsmallest(count, (q for q in self._open if q is not keep), key=_recency)
        for victim in victims:
            self._close(victim)

    def _close(self, queue: Queue) -> None:
        del self._open[queue]
        queue.release(self._remember)
        self.closed += 1

    def _remember(self, path: str) -> None:
        with self._unsynced_lock:
            self._unsynced.add(path)

    def sync_closed(self) -> None:
        """fdatasync the chunk files closed with unflushed entries (under any lock or
        none: a file removed since, by retention or delete_topic, needs nothing).

        After one failed fdatasync every later call fails too, and the files not synced
        stay listed: as for an open chunk (``Chunk._fdatasync``), no later fdatasync of
        that file can vouch for its entries, so no later checkpoint may record them; the
        store is to be reopened."""
        if self._failed is not None:
            path, failure = self._failed
            raise type(failure)(
                failure.errno,
                f"flushing closed queue chunks refused: an earlier fdatasync of {path} "
                f"failed ({failure}), and no later flush can make its entries durable; "
                "close and reopen the store",
            )
        with self._unsynced_lock:
            paths, self._unsynced = self._unsynced, set()
        pending = sorted(paths)
        for i, path in enumerate(pending):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            except OSError as exc:
                self._keep(pending[i:])
                raise write_error(exc, "opening a closed queue chunk to flush it", path) from exc
            try:
                os.fdatasync(fd)
            except OSError as exc:
                self._keep(pending[i:])  # this file and every one after it: none synced
                failure = write_error(exc, "flushing a closed queue chunk", path)
                self._failed = (path, failure)
                if self.on_sync_failure is not None:
                    self.on_sync_failure()
                raise failure from exc
            finally:
                os.close(fd)

    def _keep(self, paths: list[str]) -> None:
        with self._unsynced_lock:
            self._unsynced.update(paths)

    def _check_ends(self, queue: Queue, manager: ChunkManager) -> None:
        """A queue opened with ends known beforehand (``Queue._expected``: a closed
        queue's, or a clean store's checkpoint): its files must end there. Entries past
        it were written after the checkpoint for records the log no longer has (a
        writer's queue grows only through this handle): they are cut, as re-dispatch
        cuts them. Fewer entries than that is damage."""
        expected = queue._expected
        if expected is None:
            return
        first, end = expected
        found = manager.committed_position // QUEUE_RECORD_SIZE
        if found > end and not queue.checked:
            # Deferred by the store's open: entries past the checkpoint's end are those of
            # records sent after it (re-dispatch opens the queues it meets a record of,
            # and checks them). A queue it did not meet keeps those that point below
            # the log's end at the open, as re-dispatch keeps them.
            queue.next_offset = found  # (the search's range)
            end = max(end, queue.first_offset_at_or_after(self.log_end))
        on_disk = manager.first_position // QUEUE_RECORD_SIZE
        if on_disk > first:
            raise CorruptionError(
                f"queue {queue.topic}/{queue.queue_id} starts at offset {on_disk}, but its "
                f"first offset was {first}: its first chunk files were deleted from outside",
                file=str(queue.directory),
            )
        if found > end and not manager.read_only:
            cuts = queue.cut_from(end)
            problem = (
                f"queue {queue.topic}/{queue.queue_id} in {queue.directory} held entries "
                f"past offset {end}, where the checkpoint says it ended; they were cut "
                f"({len(cuts)} cut(s), copied to its recovered/)"
            )
            log.warning("recovery: %s", problem)
            self.problems.append(problem)
        elif found < end:
            last = manager.last_chunk
            raise CorruptionError(
                f"queue {queue.topic}/{queue.queue_id} ends at offset {found}, but {end} "
                "entries were recorded (by the checkpoint, or before its files were closed): "
                "its chunk files were damaged or removed from outside",
                file=str(last.path if last is not None else queue.directory),
            )
        queue.first_offset = max(first, manager.first_position // QUEUE_RECORD_SIZE)
        queue.next_offset = end if found >= end else found
        queue._expected = None


def reentered(path: Path, topic: object) -> ReentrantSendError:
    """A send that found the write lock held by its own thread. The lock is reentrant (a
    send opens the queue it writes to under it), so it would not block: the inner send
    would write at the position and queue offset the outer one has taken already."""
    return ReentrantSendError(
        f"send to topic {topic!r} of the store in {path} refused: this thread holds the "
        "store's write lock already, in another send (a send from a signal handler, or from "
        "a callback that runs inside a send); nothing was written"
    )


def clean_ends(
    checkpoint: dict[str, Any], log_end: int, deleted: dict[str, int]
) -> dict[str, list[tuple[int, int]]]:
    """Each queue's (first, next offset) as the checkpoint recorded them. A topic
    deleted at or after the checkpoint is left out (what it recorded may be the old
    topic's), as are queues the checkpoint does not list (created after it)."""
    position = checkpoint.get("log_position")
    ends, starts = checkpoint.get("queues"), checkpoint.get("queue_starts")
    if not isinstance(ends, dict) or not isinstance(starts, dict):
        return {}
    known: dict[str, list[tuple[int, int]]] = {}
    for topic, e in ends.items():
        s = starts.get(topic)
        if not isinstance(e, list) or not isinstance(s, list) or len(e) != len(s):
            continue
        if deleted.get(topic, -1) >= min(log_end, position if isinstance(position, int) else 0):
            continue
        pairs = list(zip(s, e, strict=True))
        if all(_offset(a) and _offset(b) and a <= b for a, b in pairs):
            known[topic] = pairs
    return known


def files_cover(directory: Path, ends: tuple[int, int], records: int) -> bool:
    """Whether the chunk files listed in a queue's ``directory`` cover the offsets ``ends``
    says it holds (one listdir, no file opened): else its open is not deferred, and the
    store's open reports and repairs what is missing as for any damaged queue."""
    first, end = ends
    if end == 0:
        return True
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return False
    numbers = [n[0] for n in map(parse_chunk_file_name, names) if n is not None]
    low = (first if first < end else end - 1) // records
    return bool(numbers) and min(numbers) <= low and max(numbers) >= (end - 1) // records


def _offset(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _recency(queue: Queue) -> int:
    return queue.last_used
