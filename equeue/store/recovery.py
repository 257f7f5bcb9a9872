"""Bringing the derived indexes back in line with the message log at open.

The message log is the source of truth. The checkpoint says up to which log
position every queue entry was durable; past it, each message record is
re-dispatched to its queue (and key index), entries that disagree with the
log are cut, and entries past what the log holds are cut too. The work is
proportional to what was written after the checkpoint, not to the store size.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from equeue.chunks import ChunkManager, ChunkReader
from equeue.chunks.recovery import TailCut
from equeue.errors import location
from equeue.format.chunk import HEADER_SIZE
from equeue.format.message import FLAG_HAS_KEY, MESSAGE_HEAD, MESSAGE_HEAD_SIZE
from equeue.store.keyindex import KeyIndex
from equeue.store.queue import Queue

log = logging.getLogger("equeue.recovery")


@dataclass
class RecoveryReport:
    """What opening the store found and did; empty after a clean shutdown."""

    cuts: list[TailCut] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    compactions: list[str] = field(default_factory=list)  # interrupted installs finished or undone
    redispatched: int = 0
    reindexed_keys: int = 0
    start_position: int = 0

    @property
    def clean(self) -> bool:
        return (
            not self.cuts and not self.problems and not self.compactions and not self.redispatched
        )


def recovery_start(
    checkpoint: dict[str, Any],
    log_manager: ChunkManager,
    queues: dict[str, list[Queue]],
    report: RecoveryReport,
) -> int:
    """Where re-dispatching starts: the checkpoint's log position, or earlier if a queue
    lost entries the checkpoint says were durable (its chunk was damaged), so that those
    entries are rebuilt from the log too."""
    first, end = log_manager.first_position, log_manager.committed_position
    start = checkpoint.get("log_position")
    start = min(max(start, first), end) if isinstance(start, int) else first
    recorded = checkpoint.get("queues")
    if not isinstance(recorded, dict):
        return start
    for topic, offsets in recorded.items():
        for queue_id, expected in enumerate(offsets if isinstance(offsets, list) else []):
            topic_queues = queues.get(topic, [])
            if queue_id >= len(topic_queues) or not isinstance(expected, int):
                continue
            queue = topic_queues[queue_id]
            if queue.next_offset >= expected:
                continue
            last = queue.manager.last_chunk
            where = (
                f" (its entries end {location(last.path, HEADER_SIZE + last.data_end)})"
                if last is not None
                else ""
            )
            report.problems.append(
                f"queue {topic}/{queue_id} ends at offset {queue.next_offset}{where}, but the "
                f"checkpoint recorded {expected} durable entries; rebuilding them from the log"
            )
            if queue.next_offset > queue.first_offset:  # from its last entry's record on
                start = min(start, queue.entry(queue.next_offset - 1)[0])
            else:
                start = first
    return max(start, first)


def redispatch(
    reader: ChunkReader,
    start: int,
    queues: dict[str, list[Queue]],
    keys: KeyIndex,
    report: RecoveryReport,
    recorded: dict[str, Any] | None = None,
) -> None:
    """Re-dispatch the log from ``start``; ``recorded`` is the checkpoint's queue offsets."""
    # Keys: rows at or past the index's own mark may be duplicates (a query commits
    # pending keys early) or point past a cut in the log; drop and re-index them.
    key_from = min(keys.indexed_position, reader.manager.committed_position)
    keys.forget_from(key_from)
    start = min(start, max(key_from, reader.manager.first_position))
    report.start_position = start
    log_end = reader.manager.committed_position
    seen: dict[Queue, int] = {}
    for position, payload in reader.iter_from(start):
        (pos, _, _, qoff, qid, _, th, flags, tl, gl, kl, _, _) = MESSAGE_HEAD.unpack_from(payload)
        topic = payload[MESSAGE_HEAD_SIZE : MESSAGE_HEAD_SIZE + tl].decode(errors="replace")
        topic_queues = queues.get(topic)
        if pos != position or topic_queues is None or not 0 <= qid < len(topic_queues):
            report.problems.append(
                f"message record at position {position} names position {pos}, topic {topic!r}, "
                f"queue {qid}, which the store does not have; left out of the queues "
                f"{_record_location(reader, position)}"
            )
            continue
        queue = topic_queues[qid]
        following = queue.next_offset
        # Position and tag hash: a sector torn inside a 12-byte entry can keep one.
        if qoff < following and queue.entry(qoff) != (position, th):
            report.cuts += queue.cut_from(qoff)
            following = queue.next_offset
        if qoff == following:
            queue.append(position, th)
            report.redispatched += 1
        elif qoff > following:
            report.problems.append(
                f"queue {topic}/{qid} lacks offsets {following}..{qoff - 1} before the message "
                f"at position {position}; their messages are not in the log "
                f"{_record_location(reader, position)}"
            )
            continue
        seen[queue] = qoff + 1
        if flags & FLAG_HAS_KEY and position >= key_from:
            p = MESSAGE_HEAD_SIZE + tl + gl
            keys.add(topic, payload[p : p + kl].decode(errors="replace"), position)
            report.reindexed_keys += 1
    for topic, topic_queues in queues.items():
        for queue in topic_queues:
            limit = seen.get(queue)
            if limit is None:
                # No record after ``start`` is this queue's: it ends where the
                # checkpoint says it did (its entries past that are not backed by the
                # log), or, without one, where its entries reach ``start``.
                limit = queue.first_offset_at_or_after(start)
                recorded_end = _checkpointed_offset(recorded, topic, queue.queue_id)
                if recorded_end is not None:  # and never past the log's end
                    limit = min(recorded_end, queue.first_offset_at_or_after(log_end))
            if queue.next_offset > limit:
                report.cuts += queue.cut_from(limit)
    keys.mark(log_end)
    keys.commit()
    for cut in report.cuts:
        log.warning("recovery: %s", cut)
    for problem in report.problems:
        log.error("recovery: %s", problem)


def _checkpointed_offset(recorded: dict[str, Any] | None, topic: str, queue_id: int) -> int | None:
    offsets = (recorded or {}).get(topic)
    if isinstance(offsets, list) and queue_id < len(offsets) and isinstance(offsets[queue_id], int):
        return int(offsets[queue_id])
    return None


def _record_location(reader: ChunkReader, position: int) -> str:
    """'in FILE at offset N' of a log record (its frame in an uncompacted chunk)."""
    chunk = reader.manager.get_chunk_for(position)
    return location(chunk.path, HEADER_SIZE + position - chunk.base)
