"""Deleting old message chunks, and the queue chunks that only point into them."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from equeue.errors import PositionNotFoundError
from equeue.store.checkpoint import note_retention
from equeue.store.offsets import committed

if TYPE_CHECKING:
    from equeue.store.store import MessageStore

log = logging.getLogger("equeue.retention")


def apply_retention(store: MessageStore, now: float) -> int:
    """Remove completed message chunks, oldest first, while they are past ``retention``
    or the store is over ``max_store_bytes``; the ongoing chunk is never removed.

    With ``retention_respects_consumers`` a chunk also stays until every consumer
    group has committed, on every queue it has committed on, past the chunk's end.
    The caller holds the checkpoint lock and the store's write lock.
    """
    config = store.config
    messages = store._messages
    chunks = list(messages)
    total = sum(chunk.file_size for chunk in chunks)
    cutoff_ns = None
    if config.retention is not None:
        cutoff_ns = int((now - config.retention.total_seconds()) * 1e9)
    consumed = _consumed_position(store) if config.retention_respects_consumers else None
    remove_before = new_start = None
    for chunk in chunks[:-1]:
        footer = chunk.footer
        if footer is None:
            break
        # A chunk compaction emptied has no timestamps and nothing to keep: it must not
        # stop time-based retention from reaching the chunks after it.
        expired = cutoff_ns is not None and (
            footer.last_timestamp is None or footer.last_timestamp < cutoff_ns
        )
        over = config.max_store_bytes is not None and total > config.max_store_bytes
        if not (expired or over):
            break
        if consumed is not None and chunk.end_position > consumed:
            break
        remove_before = chunk.end_number + 1
        new_start = chunk.end_position
        total -= chunk.file_size
    if remove_before is None:
        # A crash may have stopped an earlier run between the log chunks and the queue
        # chunks: the open set each queue's first offset past the removed messages, and
        # the queue chunks wholly below it go now (no entry read: this runs every turn).
        for queues in store._queues.values():
            for queue in queues:
                queue.remove_chunks_below(None)
        return 0
    # The entries of sends made since the checkpoint were not flushed, and once the log
    # chunks holding their messages are gone, recovery cannot rebuild them from the log
    # (and the queue's next offset would move back after a power loss).
    store._flush_queues()
    assert new_start is not None
    note_retention(store, new_start)  # first: else a crash mid-way reads as a deletion
    removed = messages.remove_chunks_before(remove_before)
    first = messages.first_position
    for queues in store._queues.values():
        for queue in queues:
            queue.first_offset = queue.first_offset_at_or_after(first)
            queue.remove_chunks_below(first)
    store._keys.forget_below(first)
    log.info("retention removed %d message chunks; the log now starts at %d", len(removed), first)
    return len(removed)


def _consumed_position(store: MessageStore) -> int:
    """The lowest log position some consumer group still has to read."""
    lowest = store._messages.committed_position
    for groups in committed(store).values():  # also what read-only consumers committed
        for topic, offsets in groups.items():
            for queue_id, offset in offsets.items():
                queues = store._queues.get(topic)
                if queues is None or int(queue_id) >= len(queues):
                    continue
                queue = queues[int(queue_id)]
                if offset < queue.next_offset:
                    try:
                        lowest = min(lowest, queue.entry(max(offset, queue.first_offset))[0])
                    except PositionNotFoundError:
                        continue
    return lowest
