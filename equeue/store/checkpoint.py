"""The checkpoint: the log position up to which queue entries and keys are durable."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from equeue.atomicfile import read_json, write_json
from equeue.errors import EQueueError
from equeue.store import grouprecord
from equeue.store.grouprecord import GROUP_FILES_KEY
from equeue.store.meta import CHECKPOINT_FILE

if TYPE_CHECKING:
    from equeue.store.store import MessageStore


def write_checkpoint(store: MessageStore, *, flush: bool, settle: bool = True) -> None:
    """Flush, then record the log position up to which queue entries and keys are
    durable, with each queue's next offset.

    The positions are taken under the write lock, the flushes run after it
    (so sends go on meanwhile), and the file is written last: the checkpoint
    is never ahead of the data it describes. Without ``flush`` (flush="os",
    between explicit flushes) only the key index batch is committed.
    """
    with store._checkpoint_lock:  # one at a time, in order, and none after close()
        with store._lock:
            store._check_open()
            position = store._messages.committed_position
            queues = {t: [q.next_offset for q in qs] for t, qs in store._queues.items()}
            traces = loss_traces(store)
            last = store._messages.last_chunk
            if last is not None and last.is_completed:
                last = None
            tail_end = 0 if last is None else last.data_end
            tail = (
                None
                if last is None
                else {
                    "chunk_id": last.header.chunk_id.hex,
                    "data_end": last.data_end,
                    "records": last.record_count,
                }
            )
            store._keys.mark(position)
        if flush:  # the log first: an entry on disk should find its record there
            store._writer.flush()
            if settle and last is not None:  # what recovery found at open, too
                last.flush(settle=True)
            store._flush_queues()
        store._keys.commit()
        if flush:
            # A tail only once an fdatasync covered it: after a crash, what recovery
            # found in the page cache counts as flushed but may not be on disk yet,
            # and the next open would trust the hint without walking those records.
            if last is None:
                store._log_tail = None
            elif tail is not None and last.synced_end >= tail_end:
                store._log_tail = tail
            store._check_directory()
            # (off the write lock, in the checkpoint lock: delete_group drops a name from
            # the record under it, before the file goes)
            groups = grouprecord.present(store.path, store._group_files)
            write_json(
                store.path / CHECKPOINT_FILE,
                {"log_position": position, "queues": queues, "key_index": position}
                | traces
                | ({GROUP_FILES_KEY: groups} if groups is not None else {})
                | ({"log_tail": store._log_tail} if store._log_tail is not None else {}),
            )
            store._checkpointed = position


def loss_traces(store: MessageStore) -> dict[str, Any]:
    """What the checkpoint records so that a later open or ``equeue verify`` can tell a
    file deleted from outside from retention (equeue/store/losses.py): where the log and
    each queue start, and how many committed offsets exist (they never become fewer).
    The caller holds the write lock."""
    return {
        "log_start": store._messages.first_position,
        "queue_starts": {t: [q.first_offset for q in qs] for t, qs in store._queues.items()},
        "committed_offsets": sum(len(qs) for ts in store._offsets.values() for qs in ts.values()),
    }


def note_retention(
    store: MessageStore, log_start: int, starts: dict[str, list[int]] | None = None
) -> None:
    """Retention, before it deletes chunks: the checkpoint names the log's new start and
    the queues' new first offsets (``starts``, if the caller found them), so a crash
    mid-deletion is not reported as a loss. The caller holds the checkpoint lock and the
    write lock."""
    store._check_directory()  # raising: retention then deletes nothing
    path = store.path / CHECKPOINT_FILE
    body: Any = None
    with contextlib.suppress(OSError, EQueueError):  # none or damaged: nothing to compare
        body = read_json(path)
    if isinstance(body, dict):  # a failed write raises: retention then deletes nothing
        if starts is None:
            starts = {
                t: [q.first_offset_at_or_after(log_start) for q in qs]
                for t, qs in store._queues.items()
            }
        write_json(path, body | {"log_start": log_start, "queue_starts": starts})
