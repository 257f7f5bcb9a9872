"""Deleting old message chunks, and the queue chunks that only point into them."""

from __future__ import annotations

import logging
import os
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

from equeue.errors import PositionNotFoundError
from equeue.format.chunk import HEADER_SIZE, RECOVERED_DIR, parse_chunk_file_name
from equeue.format.message import QUEUE_RECORD, QUEUE_RECORD_SIZE
from equeue.protocol.retries import DELAY_TOPIC, MOVER_GROUP, RETRY_PREFIX
from equeue.store.checkpoint import note_retention
from equeue.store.meta import CONSUMERS_DIR
from equeue.store.offsets import committed
from equeue.store.queuerebuild import points_at_its_message
from equeue.store.retentionhold import Reader, note_hold

if TYPE_CHECKING:
    from equeue.store.queue import Queue
    from equeue.store.store import MessageStore

log = logging.getLogger("equeue.retention")

# Per store and queue, a log position no live entry of the queue points below: its first
# entry's when last looked at (entries only ever get later positions, and the first
# offset only moves on), or the log's end when the queue was empty. A removal of log
# chunks below it leaves the queue as it is, without opening it: with 10,000 queues
# and 79 kept open, opening every queue on every removal cost 10,000 reopens under the
# store's lock (about 1 ms each), for the few queues that had entries there.
_floors: weakref.WeakKeyDictionary[MessageStore, dict[tuple[str, int], int]] = (
    weakref.WeakKeyDictionary()
)


def apply_retention(store: MessageStore, now: float) -> int:
    """Remove completed message chunks, oldest first, while they are past ``retention``
    or the store is over ``max_store_bytes``; the ongoing chunk is never removed.

    With ``retention_respects_consumers`` a chunk also stays until every consumer
    group has committed, on every queue it has committed on, past the chunk's end, and
    the broker's retries were read past it (``_lowest_reader``); who held it back is
    noted (``retentionhold``). The caller holds the checkpoint lock and the store's
    write lock.
    """
    config = store.config
    messages = store._messages
    chunks = list(messages)
    total = sum(chunk.file_size for chunk in chunks)
    cutoff_ns = None
    if config.retention is not None:
        cutoff_ns = int((now - config.retention.total_seconds()) * 1e9)
    lowest = _lowest_reader(store) if config.retention_respects_consumers else None
    consumed = None
    if config.retention_respects_consumers:  # no reader: up to the log's end
        end = messages.committed_position
        consumed = end if lowest is None else min(lowest.position, end)
    remove_before = new_start = None
    held = expired = False
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
            held = True
            break
        remove_before = chunk.end_number + 1
        new_start = chunk.end_position
        total -= chunk.file_size
    if config.retention_respects_consumers:
        note_hold(store, lowest if held else None, total, expired)
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
    starts = _first_offsets(store, new_start)
    note_retention(store, new_start, starts)  # first: else a crash mid-way reads as a deletion
    removed = messages.remove_chunks_before(remove_before)
    first = messages.first_position
    _settle_queues(store, first, starts)
    store._keys.forget_below(first)
    log.info("retention removed %d message chunks; the log now starts at %d", len(removed), first)
    return len(removed)


def _lowest_reader(store: MessageStore) -> Reader | None:
    """The reader with the lowest log position still to read (None: none has anything
    left): a consumer group on a queue it committed on, and the broker's internal readers
    on the queues they have not committed on yet, from the queue's first offset: the retry
    mover in each ``equeue.delay`` queue, and group G in ``equeue.retry.G``. A delayed
    retry is read only by the mover, whose cursor is first written when it first moves a
    copy of that level, and a retry copy waits for G's first commit there: without them
    retention removed retries before they were due (review 37a A4)."""
    lowest: Reader | None = None
    below = store._messages.committed_position + 1
    offsets = committed(store)  # also what read-only consumers committed
    unknown = _unknown_group(store)
    if unknown is not None:  # a group whose offsets nobody knows: fail safe, keep everything
        return unknown
    for group, groups in offsets.items():
        for topic, queue_offsets in groups.items():
            for queue_id, offset in queue_offsets.items():
                found = _position_at(store, topic, int(queue_id), offset)
                if found is not None and found[1] < below:  # (a Reader made only then)
                    lowest = Reader(group, topic, int(queue_id), *found)
                    below = found[1]
    for topic in store._queues:
        reader = _internal_reader(topic)
        if reader is None:
            continue
        mine = offsets.get(reader, {}).get(topic, {})
        for queue in store._queues[topic]:
            if str(queue.queue_id) in mine:
                continue  # counted above, from its commit
            found = _position_at(store, topic, queue.queue_id, queue.first_offset)
            if found is not None and found[1] < below:
                lowest = Reader(reader, topic, queue.queue_id, *found, committed=False)
                below = found[1]
    return lowest


def _internal_reader(topic: str) -> str | None:
    """The group that reads one of the broker's internal topics, if it is one."""
    if topic == DELAY_TOPIC:
        return MOVER_GROUP
    if topic.startswith(RETRY_PREFIX) and len(topic) > len(RETRY_PREFIX):
        return topic[len(RETRY_PREFIX) :]
    return None


def _unknown_group(store: MessageStore) -> Reader | None:
    """A reader at the log's start for a consumer group file no offsets of which are
    known: one that cannot be read and was never read whole (reviewf F9), or one a
    writer's open set aside damaged whose group has not committed since (review3 R5)."""
    files = store._group_files
    if files.unknown:
        exc = files.unknown[0]
        group = "?" if exc.file is None else Path(exc.file).stem
        why = (
            f"a consumer group file cannot be read ({exc}): the group's next commit "
            "rewrites it, or move it out of consumers/ (equeue verify names it)"
        )
    else:
        set_aside = files.set_aside()
        if not set_aside:
            return None
        group = set_aside[0].partition(".json.")[0]
        why = (
            f"{CONSUMERS_DIR}/{RECOVERED_DIR}/{set_aside[0]} was set aside damaged and its "
            "group has not committed since; delete that copy to release retention"
        )
    first = store._messages.first_position
    return Reader(group, "", 0, 0, first, committed=False, damaged=why)


def _position_at(
    store: MessageStore, topic: str, queue_id: int, offset: int
) -> tuple[int, int] | None:
    """A reader of ``topic``/``queue_id`` at ``offset``: the offset it reads next (the
    first retained, if later) and its message's log position; None: no such queue, or
    nothing left to read there."""
    queues = store._queues.get(topic)
    if queues is None or queue_id >= len(queues):
        return None
    queue = queues[queue_id]
    if offset >= queue.next_offset:
        return None
    at = max(offset, queue.first_offset)
    try:
        return at, queue.entry(at)[0]
    except PositionNotFoundError:
        return None


def _first_offsets(store: MessageStore, first: int) -> dict[str, list[int]]:
    """Each queue's first offset once the log starts at ``first`` (the first whose message
    is at or after it), by topic, as the checkpoint records them: found without opening
    a queue whose entries all lie past ``first`` (its floor says so) or that is closed
    (a binary search of preads); a queue is opened only where that fails."""
    floors = _floors.setdefault(store, {})
    starts: dict[str, list[int]] = {}
    for topic, queues in store._queues.items():
        found = starts[topic] = []
        for queue in queues:
            floor = floors.get((queue.topic, queue.queue_id))
            if queue.first_offset >= queue.next_offset or (floor is not None and floor >= first):
                found.append(queue.first_offset)
                continue
            offset = None if queue.is_open else _search_closed(store, queue, first)
            found.append(queue.first_offset_at_or_after(first) if offset is None else offset)
    return starts


def _settle_queues(store: MessageStore, first: int, starts: dict[str, list[int]]) -> None:
    """After the log chunks below ``first`` went: each queue's first offset set to what
    ``_first_offsets`` found, and its queue chunks that only point below ``first``
    removed (the queue opened for that only if it has such chunks)."""
    floors = _floors.setdefault(store, {})
    end = store._messages.committed_position
    for topic, queues in store._queues.items():
        for queue, offset in zip(queues, starts.get(topic, []), strict=False):
            key = (queue.topic, queue.queue_id)
            moved = offset > queue.first_offset
            queue.first_offset = max(queue.first_offset, offset)
            if moved and queue._expected is not None:
                # What the queue's next open checks its files against and starts from
                # (QueueFiles._check_ends): else that open moved the first offset back.
                queue._expected = (queue.first_offset, queue._expected[1])
            entries = _ClosedEntries(store, queue) if moved and not queue.is_open else None
            # An open queue costs nothing to look at: also the chunks a killed run left
            # below its first offset go (the open moved it past the removed messages).
            if queue.is_open or (entries is not None and entries.below(queue.first_offset)):
                queue.remove_chunks_below(first)
            if queue.first_offset >= queue.next_offset:
                floors[key] = end
            elif moved or key not in floors:
                position = (entries or _ClosedEntries(store, queue)).position(queue.first_offset)
                if position is not None:
                    floors[key] = max(first, position)


class _ClosedEntries:
    """Entries of a queue read from its chunk files with pread: what retention needs of
    a closed queue (a first offset), without the open a ChunkManager makes (a listing,
    every chunk header, a scan and a mapping of the ongoing chunk).

    Nor are the open's checks made: of a queue not opened yet in this process (its open
    deferred by the store's, ``Queue.checked``), an entry counts only where it points at
    its own message (else None: the caller opens the queue, which checks it, and rebuilds
    it if damaged), so a damaged entry cannot move the first offset, the floor and the
    checkpoint's ``queue_starts``."""

    def __init__(self, store: MessageStore, queue: Queue) -> None:
        self.store = store
        self.queue = queue
        self.chunk_size = queue._records * QUEUE_RECORD_SIZE
        self.files: dict[int, str] = {}
        try:
            names = os.listdir(queue.directory)
        except OSError:
            return
        best: dict[int, int] = {}
        for name in names:
            parsed = parse_chunk_file_name(name)
            if parsed is not None and parsed[1] >= best.get(parsed[0], -1):
                best[parsed[0]] = parsed[1]
                self.files[parsed[0]] = name

    def below(self, offset: int) -> bool:
        """Whether a chunk file lies wholly below ``offset`` (retention removes it)."""
        number = offset * QUEUE_RECORD_SIZE // self.chunk_size
        return not self.files or min(self.files) < number

    def position(self, offset: int) -> int | None:
        """The message position at ``offset``; None if it cannot be read or is not one."""
        if self.queue.is_open:
            try:
                position = self.queue.entry(offset)[0]
            except PositionNotFoundError:
                return None
            return position if position >= 0 else None
        number, local = divmod(offset * QUEUE_RECORD_SIZE, self.chunk_size)
        name = self.files.get(number)
        if name is None:
            return None
        try:
            fd = os.open(self.queue.directory / name, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return None
        try:
            raw = os.pread(fd, QUEUE_RECORD_SIZE, HEADER_SIZE + local)
        except OSError:
            return None
        finally:
            os.close(fd)
        if len(raw) < QUEUE_RECORD_SIZE:
            return None
        stored, tag = QUEUE_RECORD.unpack(raw)
        position = int(stored) - 1
        if position < 0:
            return None
        if not self.queue.checked and not points_at_its_message(
            self.store, self.queue, offset, position, int(tag)
        ):
            return None
        return position


def _search_closed(store: MessageStore, queue: Queue, first: int) -> int | None:
    """A closed queue's first offset whose message is at or after ``first``, by a binary
    search of preads; None if an entry does not read as one (a damaged entry, which
    Queue.first_offset_at_or_after scans past, or one of an unchecked queue that does
    not point at its message: the open checks it)."""
    entries = _ClosedEntries(store, queue)
    lo, hi = queue.first_offset, queue.next_offset
    while lo < hi:
        mid = (lo + hi) // 2
        position = entries.position(mid)
        if position is None:
            return None
        if position < first:
            lo = mid + 1
        else:
            hi = mid
    return lo
