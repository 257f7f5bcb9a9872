"""Queue chunks are derived data: a writable open that finds a queue's chunks damaged
moves them to the queue's ``recovered/`` and rebuilds the queue from the log.

Damage is: a chunk that fails to load (header, footer, size, a gap between chunks),
a queue that starts later than the checkpoint's ``queue_starts`` records (its first
chunk was deleted), or a completed chunk whose first or last entry points at a record
that is not that entry's message. Re-dispatch (``recovery.redispatch``) then places
each message at the offset its record names (MESSAGE_HEAD's qoff), so offsets do not
change; offsets whose messages retention removed are filled with entries below the
log's start, as retention leaves them, and the queue's next offset never moves back
below the checkpoint's. A read-only open refuses a queue whose chunks fail to load
with an error that names the file and says that a writable open rebuilds it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from equeue.chunks import ChunkManager
from equeue.errors import CorruptionError, PositionError, location
from equeue.format.chunk import HEADER_SIZE, parse_chunk_file_name
from equeue.format.message import MESSAGE_HEAD, MESSAGE_HEAD_SIZE, QUEUE_RECORD_SIZE
from equeue.store import follow
from equeue.store.config import open_queue_limit
from equeue.store.meta import QUEUES_DIR, move_to_recovered
from equeue.store.queue import Queue
from equeue.store.queuecache import QUEUE_READ_MAPS, QueueFiles, files_cover

if TYPE_CHECKING:
    from equeue.store.store import MessageStore

log = logging.getLogger("equeue.recovery")


def open_queue(
    store: MessageStore, topic: str, queue_id: int, ends: tuple[int, int] | None = None
) -> Queue:
    """The queue's chunks, loaded; a writer moves damaged ones aside and starts it empty
    (``Queue.rebuilt``), for ``reconcile_at_open`` to rebuild from the log. With ``ends``
    (first, next offset) known, nothing is loaded until it is used (queuecache.py)."""
    directory = store.path / QUEUES_DIR / topic / str(queue_id)
    if (
        ends is not None
        and ends[1]
        and not files_cover(directory, ends, store.config.layout.queue_chunk_records)
    ):
        ends = None  # opened now: its chunks were deleted from outside
    try:
        return _queue(store, directory, topic, queue_id, ends)
    except CorruptionError as exc:
        if store.read_only:
            raise CorruptionError(
                f"queue {topic}/{queue_id} cannot be loaded ({exc}); its chunks are derived "
                "from the message log: a writable open moves them to recovered/ and rebuilds "
                "the queue",
                file=exc.file,
                offset=exc.offset,
            ) from None
        why = str(exc)
    return _set_aside(store, directory, topic, queue_id, why, store._meta_problems)


def _queue(
    store: MessageStore,
    directory: Path,
    topic: str,
    queue_id: int,
    ends: tuple[int, int] | None = None,
) -> Queue:
    return Queue(
        directory,
        topic,
        queue_id,
        store.config.layout.queue_chunk_records,
        max_open_chunks=QUEUE_READ_MAPS,
        read_only=store.read_only,
        alloc_step=store.config.alloc_step,
        files=store._files,
        ends=ends,
    )


def _set_aside(
    store: MessageStore, directory: Path, topic: str, queue_id: int, why: str, problems: list[str]
) -> Queue:
    moved = [
        move_to_recovered(directory / name)
        for name in sorted(os.listdir(directory))
        if parse_chunk_file_name(name) is not None
    ]
    problems.append(
        f"queue {topic}/{queue_id} in {directory} is damaged ({why}): its chunk files were "
        f"moved to {', '.join(str(m) for m in moved) or 'nowhere (none)'}; the queue is "
        "rebuilt from the message log"
    )
    queue = _queue(store, directory, topic, queue_id)
    queue.rebuilt = True
    return queue


def check_queues(store: MessageStore, checkpoint: dict[str, Any]) -> None:
    """A writer's open: set aside each loaded queue that starts later than the checkpoint
    recorded or whose entries point at the wrong records (see the module's text)."""
    starts = checkpoint.get("queue_starts")
    starts = starts if isinstance(starts, dict) else {}
    for topic, queues in store._queues.items():
        recorded = starts.get(topic)
        for queue in queues:
            if queue.rebuilt or not queue.is_open:  # (not open: checked when opened)
                continue
            why = None
            first = queue.manager.first_position // QUEUE_RECORD_SIZE
            expected = (
                recorded[queue.queue_id]
                if isinstance(recorded, list) and queue.queue_id < len(recorded)
                else None
            )
            if isinstance(expected, int) and first > expected:
                why = f"it starts at offset {first}, but the checkpoint recorded {expected}"
            else:
                why = _wrong_entry(store, queue)
            if why is not None:
                queue.close()
                queues[queue.queue_id] = _set_aside(
                    store, queue.directory, topic, queue.queue_id, why,
                    store.recovery.problems,
                )  # fmt: skip


def _wrong_entry(store: MessageStore, queue: Queue) -> str | None:
    """Why the first or last entry of a completed chunk is wrong, or None: a spot check,
    two record heads per queue chunk, so the open's cost stays per chunk, not per entry
    (``equeue verify`` checks every entry). Entries past the log's end are re-dispatch's
    to cut, entries below its start retention's."""
    log_first = store._messages.first_position
    log_end = store._messages.committed_position
    for chunk in list(queue.manager)[:-1]:
        if chunk.header.compacted or not chunk.data_end:
            continue
        first = chunk.base // QUEUE_RECORD_SIZE
        for offset in (first, first + chunk.data_end // QUEUE_RECORD_SIZE - 1):
            if not queue.first_offset <= offset < queue.next_offset:
                continue
            position, tag = queue.entry(offset)
            if not log_first <= position < log_end:
                continue
            found = _head_at(store, position)
            if found is not None and found != (position, queue.topic, queue.queue_id, offset, tag):
                at = HEADER_SIZE + offset * QUEUE_RECORD_SIZE - chunk.base
                return (
                    f"its entry for offset {offset} {location(chunk.path, at)} points at "
                    f"position {position}, which holds no message of that offset"
                )
    return None


def points_at_its_message(
    store: MessageStore, queue: Queue, offset: int, position: int, tag: int
) -> bool:
    """Whether the entry at ``offset`` (``position``, ``tag``) points at a record of the
    log that is its own message: what the spot check (``_wrong_entry``) asks of a chunk's
    first and last entries, asked of an entry read without opening the queue (retention's
    preads). False also where the record cannot be read: no proof either way."""
    if not store._messages.first_position <= position < store._messages.committed_position:
        return False
    return _head_at(store, position) == (position, queue.topic, queue.queue_id, offset, tag)


def _head_at(store: MessageStore, position: int) -> tuple[int, str, int, int, int] | None:
    """(position, topic, queue id, queue offset, tag hash) of the record at ``position``;
    None where it fails its checks (a damaged record, or the entry points inside one):
    that is no proof the entry is wrong, and rebuilding the queue past a damaged record
    could lose the entries after it; reads report it instead."""
    try:
        payload = store._reader.read(position)
    except (CorruptionError, PositionError):
        return None
    if len(payload) < MESSAGE_HEAD_SIZE:
        return (-1, "", -1, -1, 0)  # not a message record
    head = MESSAGE_HEAD.unpack_from(payload)
    topic = payload[MESSAGE_HEAD_SIZE : MESSAGE_HEAD_SIZE + head[8]]
    return head[0], topic.decode(errors="replace"), head[4], head[3], head[6]


def start_rebuilt(queue: Queue, offset: int, log_first: int) -> bool:
    """Place an empty rebuilt queue's next offset at ``offset``: the offsets before it,
    in the same chunk, get entries below the log's start (their messages were removed by
    retention). False where the log's start leaves no room for them (they were lost)."""
    if not queue.rebuilt or queue.manager.last_chunk is not None or offset <= 0:
        return False
    records = queue.manager.config.chunk_data_size // QUEUE_RECORD_SIZE
    number = offset // records
    fill = offset - number * records
    if fill > log_first:
        return False
    queue.manager.add_new_chunk(start_number=number)
    for i in range(fill):  # increasing positions below the log's start, tag hash 0
        queue.append(log_first - fill + i, 0)
    queue.first_offset = offset
    return True


def finish_rebuilt(store: MessageStore, recorded: dict[str, Any] | None) -> None:
    """After re-dispatch: a rebuilt queue's next offset is at least the checkpoint's, and
    how many entries it got is reported."""
    log_first = store._messages.first_position
    for topic, queues in store._queues.items():
        offsets = (recorded or {}).get(topic)
        for queue in queues:
            if not queue.rebuilt:
                continue
            expected = (
                offsets[queue.queue_id]
                if isinstance(offsets, list) and queue.queue_id < len(offsets)
                else None
            )
            if isinstance(expected, int) and queue.next_offset < expected:
                # No record of it is in the log (retention removed them all): it starts
                # where the checkpoint says it ended, else the next send would reuse offsets.
                start_rebuilt(queue, expected, log_first)
            store.recovery.problems.append(
                f"queue {topic}/{queue.queue_id} in {queue.directory} was rebuilt from "
                f"the message log: {queue.next_offset - queue.first_offset} entries, offsets "
                f"[{queue.first_offset}, {queue.next_offset})"
            )
            queue.rebuilt = False


def rebuild_deferred(
    store: MessageStore, queue: Queue, ends: tuple[int, int], why: str
) -> ChunkManager:
    """A queue whose open the store's open deferred (queuecache.py) is damaged: as a
    writable open does (``_set_aside``, re-dispatch, ``finish_rebuilt``), for this queue
    alone, from the log's first record; with the write lock held. Returns its manager."""
    directory = queue.directory
    moved = [
        move_to_recovered(directory / name)
        for name in (sorted(os.listdir(directory)) if directory.is_dir() else [])
        if parse_chunk_file_name(name) is not None
    ]
    problems = store._files.problems
    problems.append(
        f"queue {queue.topic}/{queue.queue_id} in {directory} is damaged ({why}): its chunk "
        f"files were moved to {', '.join(str(m) for m in moved) or 'nowhere (none)'}; the "
        "queue is rebuilt from the message log"
    )
    log.warning("recovery: %s", problems[-1])
    queue._expected = None
    queue.first_offset = queue.next_offset = 0
    manager = queue.load()
    queue.rebuilt = True
    log_first = store._messages.first_position
    name = queue.topic.encode()
    try:
        for position, payload in store._reader.iter_from(
            max(log_first, store._deleted.get(queue.topic, 0))
        ):
            if len(payload) < MESSAGE_HEAD_SIZE:
                continue
            pos, _, _, qoff, qid, _, th, _, tl, *_ = MESSAGE_HEAD.unpack_from(payload)
            if qid != queue.queue_id or pos != position:
                continue
            if payload[MESSAGE_HEAD_SIZE : MESSAGE_HEAD_SIZE + tl] != name:
                continue
            if qoff > queue.next_offset:
                start_rebuilt(queue, qoff, log_first)
            if qoff == queue.next_offset:
                queue.append(position, th)
    except CorruptionError as exc:
        problems.append(f"rebuilding queue {queue.topic}/{queue.queue_id} stopped at {exc}")
    if queue.next_offset < ends[1]:
        start_rebuilt(queue, ends[1], log_first)
    if log_first > 0:
        queue.first_offset = queue.first_offset_at_or_after(log_first)
    queue.rebuilt = False
    problems.append(
        f"queue {queue.topic}/{queue.queue_id} in {directory} was rebuilt from the message "
        f"log: {queue.next_offset - queue.first_offset} entries, offsets "
        f"[{queue.first_offset}, {queue.next_offset})"
    )
    return manager


def deferred_checks(
    store: MessageStore,
) -> tuple[Callable[[Queue], None], Callable[[Queue, tuple[int, int], str], ChunkManager]]:
    """QueueFiles.check and .rebuild for a writer: ``check_queues`` and the rebuild of a
    queue the store's open deferred, run on its first open."""

    def check(queue: Queue) -> None:
        why = _wrong_entry(store, queue)
        if why is not None:
            raise CorruptionError(why, file=str(queue.directory))

    def rebuild(queue: Queue, ends: tuple[int, int], why: str) -> ChunkManager:
        return rebuild_deferred(store, queue, ends, why)

    return check, rebuild


def _skips_past(store: MessageStore, checkpoint: dict[str, Any]) -> bool:
    """Whether recovery's scan starts at a live tail past the checkpoint's position (a
    process killed in this boot): re-dispatch then meets no record sent between the two,
    so a queue deferred with the checkpoint's end would keep that end, short of its
    entries, answering pulls and queue_range at it until something opened it (review20
    R20-6), and a group's commit past it would look like a crash's cut (R20-1). Such an
    open opens its queues, reading each one's end from its files."""
    messages, position = store._messages, checkpoint.get("log_position")
    skipped_to = messages.scan_started_at
    return (
        messages.started_at_live_hint
        and skipped_to is not None
        and (not isinstance(position, int) or skipped_to > position)
    )


def queue_files(store: MessageStore, checkpoint: dict[str, Any]) -> QueueFiles:
    """The store's cache of open queues, with its lock, an RLock, the store's write lock
    (queues are opened and closed under it); a writer's checks of deferred queues, and
    the checkpoint that says which queues its open may defer."""
    files = QueueFiles(threading.RLock(), open_queue_limit(store.config))
    files.problems = store._meta_problems
    if not store.read_only:
        files.check, files.rebuild = deferred_checks(store)
        if not _skips_past(store, checkpoint):
            files.pending = (checkpoint, store._messages.committed_position)
    else:  # queues past the cache's room opened on first use (follow.py: reader_opened)
        files.after_open, files.lazy_reader = follow.reader_opened(store), True
    return files
