"""MessageStore's upkeep: flushes and the outcome of the last one, checkpoints, retention
and the adoption of chunks a compaction installed, ``refresh()``; the service thread
(flush.py, run_service) calls these each turn. Apart from store.py: the work behind a
store's durability and size, not its open state."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from equeue.chunks import ChunkManager
from equeue.chunks.config import MiB
from equeue.compaction import commit as compaction_commit
from equeue.errors import CompactionError, StoreReplacedError, StoreWriteError
from equeue.store import follow, validate
from equeue.store.checkpoint import write_checkpoint
from equeue.store.flush import STICKY_ATTEMPT, flush_recorded, record_flush_failure

if TYPE_CHECKING:
    from equeue.store.store import MessageStore

# Recovery re-dispatches what was written after the last checkpoint; one is written
# whenever this much log has been written since, so that work stays bounded.
_CHECKPOINT_BYTES = 32 * MiB

log = logging.getLogger("equeue.compaction")


def flush(self: MessageStore) -> None:
    """Make everything sent so far durable, under any flush policy, and checkpoint it."""
    self._check_writable()
    attempt = self._start_flush()
    try:
        self._checkpoint(flush=True)
    except StoreWriteError as exc:  # later sends refused (until a reopen: a failed log)
        record_flush_failure(self, exc, attempt)
        raise
    self._set_flush_error(None, attempt)


def flush_log(self: MessageStore) -> None:
    """fdatasync the message log up to every append so far (safe beside appends): what
    flush="sync" does per batch, for a caller batching acknowledgments (the broker).
    A failure refuses every later send, nothing written, until the store is reopened."""
    self._check_writable()
    flush_recorded(self, self._writer.flush)


def _flush_log(self: MessageStore, least_bytes: int = 0) -> None:
    self._writer.flush(least_bytes)


def _flush_queues(self: MessageStore, least_bytes: int = 0) -> None:
    for queues in list(self._queues.values()):
        for queue in queues:
            queue.flush(least_bytes)
    self._files.sync_closed()  # after: what a close left unflushed meanwhile too


def _start_flush(self: MessageStore) -> int:
    """Number a flush attempt as it starts, for ``_set_flush_error``."""
    with self._flush_state_lock:
        self._flush_attempts += 1
        return self._flush_attempts


def _set_flush_error(self: MessageStore, error: StoreWriteError | None, attempt: int) -> None:
    """Keep how flush ``attempt`` ended (None: it succeeded), unless an attempt that
    started after it has ended already: a service turn that failed before a later
    flush() succeeded, but reports only after it, must not refuse the sends after it."""
    with self._flush_state_lock:
        if attempt >= self._flush_reported:
            self._flush_reported = attempt
            self._flush_error = error


def _checkpoint(self: MessageStore, *, flush: bool, settle: bool = True) -> None:
    write_checkpoint(self, flush=flush, settle=settle)


def _check_directory(self: MessageStore) -> None:
    """Before a writer's metadata write by path: StoreReplacedError if STORE or STORE/LOCK
    is not what this writer opened (dirguard.py); sends are refused from then on."""
    if self._guard is None:  # read-only: it writes only consumers/, by path, as asked
        return
    try:
        self._guard.check()
    except StoreReplacedError as exc:
        self._set_flush_error(exc, STICKY_ATTEMPT)
        raise


def _checkpoint_due(self: MessageStore) -> bool:
    """A full key batch, or enough log written since the last checkpoint that
    recovery would otherwise re-dispatch more than ``_CHECKPOINT_BYTES``."""
    if self._keys.pending >= self.config.key_index_batch:
        return True
    if self.config.flush == "os":  # its checkpoints come from flush() and close() only
        return False
    return self._messages.committed_position - self._checkpointed >= _CHECKPOINT_BYTES


def _adopt_compacted(self: MessageStore, *, blocking: bool) -> None:
    """Adopt chunks a compaction job installed since we last looked (the service
    calls this each turn, without waiting for a job that is installing right now)."""
    if compaction_commit.installed_marker(self.path) == self._installed:
        return
    try:
        with compaction_commit.commit_lock(self.path, blocking=blocking):
            self._adopt_compacted_locked()
    except CompactionError:
        return  # a job is installing: the next turn adopts it all at once


def _adopt_compacted_locked(self: MessageStore) -> None:
    marker = compaction_commit.installed_marker(self.path)
    if marker != self._installed:
        self._messages.adopt_replacements()
        self._installed = marker


def apply_retention(self: MessageStore, now: float | None = None) -> int:
    """Delete completed message chunks past retention; returns how many were removed."""
    # Checkpoint first: queue entries are flushed lazily, and once the log before
    # them is gone, recovery could no longer rebuild them from it.
    now = validate.check_now(now)
    self._check_writable()
    self._checkpoint(flush=True)
    return self._retain(now)


def _retain(self: MessageStore, now: float | None) -> int:
    """``apply_retention`` right after a checkpoint."""
    from equeue.store.retention import apply_retention

    # Under the compaction commit lock, after adopting what was installed: else a
    # replacement installed meanwhile would outlive the chunks retention deletes. A job
    # that died after its commit point is installed first, for the same reason.
    with compaction_commit.commit_lock(self.path):
        for line in compaction_commit.finish_committed(self.path):
            log.warning("retention: %s (a compaction job died after its commit)", line)
        self._adopt_compacted_locked()
        with self._checkpoint_lock, self._lock:  # note_retention rewrites the checkpoint
            self._check_writable()
            return apply_retention(self, time.time() if now is None else now)


def _apply_retention_in_service(self: MessageStore) -> None:
    """Called right after the service's checkpoint."""
    if self.config.retention or self.config.max_store_bytes:
        self._retain(None)


def refresh(self: MessageStore) -> None:
    """Pick up what changed on disk: chunks a compaction installed (the service does
    this by itself every ``flush_interval_ms``) and, read-only, the topics, consumer
    offsets and messages the writer added since."""
    self._check_open()
    if not self.read_only:
        self._adopt_compacted(blocking=True)
        return
    follow.refresh(self)


def _chunk_managers(self: MessageStore) -> list[ChunkManager]:
    return [self._messages, *self._files.managers()]
