"""Bringing the derived indexes back in line with the message log at open.

The message log is the source of truth. The checkpoint says up to which log
position every queue entry was durable; past it, each message record is
re-dispatched to its queue (and key index), entries that disagree with the
log are cut, and entries past what the log holds are cut too. The work is
proportional to what was written after the checkpoint, not to the store size.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from equeue import speedups
from equeue.chunks import ChunkManager, ChunkReader
from equeue.chunks.recovery import SCAN_STEP, TailCut, TailHint
from equeue.errors import (
    ChunkRemovedError,
    CompactedAwayError,
    CorruptionError,
    CorruptRecordError,
    EQueueError,
    PositionError,
    location,
)
from equeue.format.chunk import (
    FRAME_OVERHEAD,
    FRAME_PREFIX,
    FRAME_PREFIX_SIZE,
    FRAME_SUFFIX,
    HEADER_SIZE,
)
from equeue.format.message import (
    FLAG_HAS_KEY,
    MESSAGE_HEAD,
    MESSAGE_HEAD_SIZE,
    QUEUE_RECORD_SIZE,
)
from equeue.store.keyindex import KeyIndex
from equeue.store.queue import Queue
from equeue.store.queuerebuild import start_rebuilt

log = logging.getLogger("equeue.recovery")


@dataclass
class RecoveryReport:
    """What opening the store found and did (``store.recovery``); ``clean`` after a clean
    shutdown.

    ``cuts``: torn tails cut from chunk files (TailCut: file, offset, bytes; the cut bytes
    are copied to ``recovered/`` first); ``problems``: one sentence per loss or damage
    found, naming the file (each also logged); ``compactions``: interrupted compaction
    installs finished or undone; ``redispatched``: messages written after the last
    checkpoint whose queue entries were rebuilt from the log; ``reindexed_keys``: keys
    added back to the key index; ``start_position``: the log position recovery scanned
    from. A read-only handle does no recovery: its report holds only what it saw.
    """

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


def tail_hint(checkpoint: dict[str, Any]) -> TailHint | None:
    """The checkpoint's record of where the ongoing log chunk's records ended; None
    where it has none (written before there was one, or with no ongoing chunk)."""
    tail = checkpoint.get("log_tail")
    if not isinstance(tail, dict):
        return None
    chunk_id, data_end, records = tail.get("chunk_id"), tail.get("data_end"), tail.get("records")
    if not (isinstance(chunk_id, str) and isinstance(data_end, int) and isinstance(records, int)):
        return None
    try:
        return TailHint(uuid.UUID(hex=chunk_id), data_end, records)
    except ValueError:
        return None


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


def _keys_from(keys: KeyIndex, log_manager: ChunkManager) -> int:
    """The log position from which the key index is re-built."""
    return min(keys.indexed_position, log_manager.committed_position)


def redispatch_start(start: int, keys: KeyIndex, log_manager: ChunkManager) -> int:
    """Where ``redispatch`` starts for ``start``: earlier if the key index is behind."""
    return min(start, max(_keys_from(keys, log_manager), log_manager.first_position))


def redispatch(
    reader: ChunkReader,
    start: int,
    queues: dict[str, list[Queue]],
    keys: KeyIndex,
    report: RecoveryReport,
    recorded: dict[str, Any] | None = None,
    deleted: dict[str, int] | None = None,
    logged: Iterable[str] = (),
    recorded_at: int | None = None,
    live: bool = False,
) -> None:
    """Re-dispatch the log from ``start``; ``recorded`` is the checkpoint's queue offsets,
    ``recorded_at`` its log position (taken with them: an entry at or past a queue's
    recorded offset points at or past it); ``deleted`` {topic: log position of its
    deletion}: earlier records of it are skipped; ``logged``: problems logged already (by
    queues' chunk managers closed since); ``live``: ``start`` is the live tail's, read only
    in the boot that wrote it, so this follows a process crash, not a power loss: the page
    cache kept every entry, and none below the start was torn low (``_unmisled`` walks
    nothing)."""
    # Keys: rows at or past the index's own mark may be duplicates (a query commits
    # pending keys early) or point past a cut in the log; drop and re-index them.
    start = redispatch_start(start, keys, reader.manager)  # before forget_from moves it
    key_from = _keys_from(keys, reader.manager)
    keys.forget_from(key_from)
    report.start_position = start
    log_end = reader.manager.committed_position
    log_first = reader.manager.first_position
    seen: dict[Queue, int] = {}
    fast = _Matcher(reader.manager, queues, key_from) if speedups.SPEEDUPS is not None else None
    position = start
    while True:
        if fast is not None:  # the records whose entries are in place, in C
            position = fast.run(position, log_end, seen, keys, report)
        resume = None
        handled: set[Queue] = set()  # the queues whose records the loop below takes
        records = reader.iter_from(position)
        while True:
            try:
                position, payload = next(records)
            except StopIteration:
                break
            except CorruptRecordError as exc:  # a completed chunk's record, damaged
                resume = _past_damaged(reader, exc, queues, seen, handled, report)
                if resume is None:
                    raise
                break
            (pos, _, _, qoff, qid, _, th, flags, tl, gl, kl, _, _) = MESSAGE_HEAD.unpack_from(
                payload
            )
            topic = payload[MESSAGE_HEAD_SIZE : MESSAGE_HEAD_SIZE + tl].decode(errors="replace")
            if deleted and position < deleted.get(topic, 0):
                continue  # a deleted topic's record (delete_topic): not queued, not a problem
            topic_queues = queues.get(topic)
            if pos != position or topic_queues is None or not 0 <= qid < len(topic_queues):
                report.problems.append(
                    f"message record at position {position} names position {pos}, topic "
                    f"{topic!r}, queue {qid}, which the store does not have; left out of the "
                    f"queues {_record_location(reader, position)}"
                )
                continue
            queue = topic_queues[qid]
            queue.manager  # noqa: B018 (opened first: a deferred queue's end is its files')
            handled.add(queue)
            following = queue.next_offset
            in_place = qoff < following
            # Position and tag hash: a sector torn inside a 12-byte entry can keep one.
            if in_place and queue.entry(qoff) != (position, th):
                report.cuts += queue.cut_from(qoff)
                following = queue.next_offset
                in_place = False
            if qoff > following and start_rebuilt(queue, qoff, log_first):
                following = queue.next_offset
            if qoff == following:
                queue.append(position, th)
                report.redispatched += 1
            elif qoff > following:
                report.problems.append(
                    f"queue {topic}/{qid} lacks offsets {following}..{qoff - 1} before the "
                    f"message at position {position}; their messages are not in the log "
                    f"{_record_location(reader, position)}"
                )
                continue
            seen[queue] = qoff + 1
            if flags & FLAG_HAS_KEY and position >= key_from:
                p = MESSAGE_HEAD_SIZE + tl + gl
                keys.add(topic, payload[p : p + kl].decode(errors="replace"), position)
                report.reindexed_keys += 1
            if in_place and fast is not None and fast.resumable(position):
                resume = position + len(payload) + FRAME_OVERHEAD  # back to C after it
                break
        if resume is None:
            break
        if fast is not None:
            fast.handled(handled)
        position = resume
    for topic, topic_queues in queues.items():
        for queue in topic_queues:
            limit = seen.get(queue)
            if limit is None and queue.deferred:
                continue  # no record of it past the checkpoint at the log's end
            recorded_end = _checkpointed_offset(recorded, topic, queue.queue_id)
            if limit is None:
                # No record after ``start`` is this queue's: it ends where the
                # checkpoint says it did (its entries past that are not backed by the
                # log), or, without one, where its entries reach ``start``; never past
                # the log's end.
                if recorded_end is None and _created_since(recorded, topic, queue.queue_id):
                    # The checkpoint does not list it: each record of it lies past the
                    # checkpoint's position, so past ``start`` (and no compaction rewrote
                    # one), and none was met. Its entries are a power loss's tail, none
                    # checkpointed: a search for the first at or past ``start`` is misled
                    # by a last one torn low and keeps them all (review12 F2: pulls failed
                    # for ever, the next send reused an offset); no read decides it.
                    limit = recorded_end = queue.first_offset
                    unchecked = None
                elif recorded_end is None:
                    # (after a process crash no walk back: review14 F1, a quiet queue's
                    # entries retention or compaction removed were each checked, 45,061
                    # record checks for 16 such queues on a reopen from the live tail)
                    durable = queue.next_offset if live else 0
                    limit, unchecked = _tail_from(reader, queue, start, durable)
                else:
                    tail, unchecked = _tail_from(reader, queue, log_end, recorded_end)
                    limit = min(recorded_end, tail)
                    if limit < tail:  # the entry kept on faith is cut after all
                        unchecked = None
                if unchecked is not None:
                    report.problems.append(unchecked)
                # Entries of messages retention removed since (sends between its
                # checkpoint and its deletions) cannot be checked against the log: they
                # stay, else the queue's next offset would move back below offsets
                # already acknowledged, and the next sends would reuse them. (Also when
                # retention removed the queue chunk holding the checkpoint's offset.)
                # An entry below the one before it, or past the checkpoint's offset but
                # below its position, was torn low: a lost send's, not retention's.
                if log_first > 0:
                    limit = max(limit, queue.first_offset)
                    previous = queue.entry(limit - 1)[0] if limit > queue.first_offset else -1
                    while limit < queue.next_offset:
                        at = queue.entry(limit)[0]
                        if not previous < at < log_first or (
                            recorded_end is not None
                            and recorded_at is not None
                            and limit >= recorded_end
                            and at < recorded_at
                        ):
                            break
                        previous = at
                        limit += 1
            kept_from = limit
            limit = _past_removed(reader, queue, limit, recorded_end, log_end)
            if limit > kept_from and recorded_end is None:
                report.problems.append(_unvouched(queue, kept_from, limit))
            if queue.next_offset > limit:
                report.cuts += queue.cut_from(limit)
    for chunk in reader.manager:  # what the matcher read stays in the page cache only
        chunk.release_behind(0, chunk.data_end)
    keys.mark(log_end)
    keys.commit()
    # Each cut, and each problem a chunk manager found, was logged where it was found.
    logged = {
        p
        for m in [reader.manager, *(q._manager for qs in queues.values() for q in qs)]
        if m is not None
        for p in m.recovery_problems
    } | set(logged)
    for problem in report.problems:
        if problem not in logged:
            log.error("recovery: %s", problem)


def _past_damaged(
    reader: ChunkReader,
    exc: CorruptRecordError,
    queues: dict[str, list[Queue]],
    seen: dict[Queue, int],
    handled: set[Queue],
    report: RecoveryReport,
) -> int | None:
    """Re-dispatch met a record of a completed log chunk that fails its checksum (a bit
    flipped on disk): the open goes on past it rather than refusing every writable
    open. Returns where to go on, or None if the record is not in a completed chunk.

    If its frame is intact and its head names this position and a queue whose entry for
    it is in place, or due next, that entry is kept (appended): reading it raises
    CorruptRecordError, and the queue's next offset stays past it. Otherwise it is left
    out of the queues. A frame whose length is damaged hides where the next record
    starts: the rest of the chunk is skipped. Each case is reported."""
    chunk = next((c for c in reader.manager if str(c.path) == exc.file), None)
    if chunk is None or not chunk.is_completed or chunk.header.compacted or exc.offset is None:
        return None
    local = exc.offset - HEADER_SIZE
    position = chunk.start_position + local
    mm = chunk.mapping()
    n: int = FRAME_PREFIX.unpack_from(mm, exc.offset)[0]
    end = local + FRAME_OVERHEAD + n
    intact = n >= MESSAGE_HEAD_SIZE and end <= chunk.data_end
    if not intact or FRAME_SUFFIX.unpack_from(mm, exc.offset + FRAME_PREFIX_SIZE + n)[1] != n:
        report.problems.append(
            f"{exc}; the records from there to the chunk's end (position "
            f"{chunk.end_position}) were not re-dispatched: their queue entries are kept "
            "only where a later record of the same queue was found"
        )
        return chunk.end_position
    head = MESSAGE_HEAD.unpack_from(mm, exc.offset + FRAME_PREFIX_SIZE)
    pos, qoff, qid, th, tl = head[0], head[3], head[4], head[6], head[8]
    start = exc.offset + FRAME_PREFIX_SIZE + MESSAGE_HEAD_SIZE
    topic = bytes(mm[start : start + tl]).decode(errors="replace")
    topic_queues = queues.get(topic)
    queue = (
        topic_queues[qid]
        if pos == position and topic_queues is not None and 0 <= qid < len(topic_queues)
        else None
    )
    kept = ""
    if queue is not None and queue.first_offset <= qoff < queue.next_offset:
        kept = "kept" if queue.entry(qoff) == (position, th) else ""
    elif queue is not None and qoff == queue.next_offset:
        queue.append(position, th)
        kept = "re-added"
    if queue is not None and kept:
        handled.add(queue)
        seen[queue] = max(seen.get(queue, 0), qoff + 1)
        what = (
            f"its entry, queue {topic}/{qid} offset {qoff}, is {kept}: reading it raises "
            "CorruptRecordError"
        )
    else:
        what = "it is left out of the queues (its head does not name a queue entry)"
    report.problems.append(f"{exc}; the message there is unreadable, {what}")
    return chunk.start_position + end


_BLOCK = 4096  # entries read at a time by the walks over a queue's tail


def _tail_from(
    reader: ChunkReader, queue: Queue, position: int, durable: int = 0
) -> tuple[int, str | None]:
    """The first offset of ``queue``'s tail of entries at or past log ``position`` (what a
    crash left past the log's end). The binary search is checked entry by entry from
    where it ends, so that one damaged entry in the middle (a flipped high bit: a position
    far past the log) does not make it cut the good entries after it: the tail starts
    after the last entry below ``position`` that the log backs. The damaged one stays, and
    reads report it (equeue/store/entrycheck.py). An entry below ``position`` that the log
    does not back is no reason to keep the entries before it: a power loss's tail whose
    last entry was torn to a small position (its u64's high half not written back) is cut
    whole (review10 F1).

    The entries are read backwards a block at a time from the queue's end, so memory stays
    one block whatever the queue's length (review11 R11-3: a list of every entry past a
    damaged one took 122 MiB for 1 M entries). With the offset, the problem to report if
    an entry the log cannot check ends the kept ones."""
    start = queue.first_offset_at_or_after(position)
    start = _unmisled(reader, queue, start, position, durable)
    # Entries' positions rise with the offset: one the log cannot check (retention or
    # compaction removed its record) is taken for good only if it lies above the last
    # entry before the tail, and if at most one entry before it lies at or past
    # ``position`` (one flipped entry; a crash's tail is every entry before a torn one,
    # review11 R11-2). It is kept on faith, so that is a problem to report.
    floor = queue.entry(start - 1)[0] if start > queue.first_offset else None
    second: int | None = None  # the offset of the second entry at or past ``position``
    end = queue.next_offset
    while end > start:
        first = max(start, end - _BLOCK)
        block = queue.entries(first, end - first)
        for offset in range(first + len(block) - 1, first - 1, -1):
            at = block[offset - first][0]
            if not 0 <= at < position:
                continue
            backed = _backs(reader, queue, offset, at)
            if backed:  # the last backed entry ends the kept ones
                return offset + 1, None
            if backed is None and floor is not None and at > floor:
                if second is None:
                    second = _second_at_or_past(queue, start, position)
                if offset <= second:
                    return offset + 1, (
                        f"queue {queue.topic}/{queue.queue_id}: offsets {start}..{offset} are "
                        f"kept although offset {start}'s entry points at or past log "
                        f"position {position} (a damaged entry): offset {offset}'s record, "
                        f"at position {at}, was removed by retention or compaction, so the "
                        f"log cannot check it {_entry_location(queue, offset)}"
                    )
        end = first
    return start, None


def _unmisled(reader: ChunkReader, queue: Queue, start: int, position: int, durable: int) -> int:
    """``start``, the binary search's first offset at or past ``position``, moved back
    where a tail's last entries torn low (below ``position``) misled the search past the
    tail's entries that lie at or past it: 10 entries, then 2 lost sends, the last torn
    low, gave 12, so the walk checked nothing, both stayed, and after retention the
    queue's first offset became 12 too (offsets 10-11 skipped, kept silently). The walk
    back from ``start`` crosses entries below ``position`` the log does not back (at
    most a block of them); an entry at or past ``position`` before them means the search
    was misled, and the tail starts at the first such entry of the rising entries
    before it. An entry not above the one before it was torn low (positions rise with
    the offset): the tail starts there at the latest, and the walk in ``_tail_from``
    keeps it only if it lies above the entry before the tail. Entries below ``durable``
    (the checkpoint's offset: flushed before it was written) are no crash's tail and are
    not walked: a clean reopen reads no record here (without the bound, one per open
    queue)."""
    offset = start
    later: int | None = None  # the position of the entry after ``offset - 1``
    while offset > max(queue.first_offset, start - _BLOCK, durable):
        at = queue.entry(offset - 1)[0]
        if later is not None and 0 <= later <= at:
            start = offset
        later = at
        if not 0 <= at < position:
            lo, hi = queue.first_offset, offset - 1
            while lo < hi:  # the entries before this one rise (or the search is no worse)
                mid = (lo + hi) // 2
                if 0 <= queue.entry(mid)[0] < position:
                    lo = mid + 1
                else:
                    hi = mid
            return lo
        if _backs(reader, queue, offset - 1, at):
            break
        offset -= 1
    return start


def _second_at_or_past(queue: Queue, start: int, position: int) -> int:
    """The offset of the second entry from ``start`` on whose position is not in
    [0, ``position``) (or the queue's next offset): the scan stops there."""
    found = 0
    offset = start
    while offset < queue.next_offset:
        block = queue.entries(offset, _BLOCK)
        if not block:
            break
        for at, _ in block:
            if not 0 <= at < position:
                found += 1
                if found == 2:
                    return offset
            offset += 1
    return queue.next_offset


def _past_removed(
    reader: ChunkReader, queue: Queue, limit: int, recorded_end: int | None, log_end: int
) -> int:
    """``limit`` moved on over the entries after it whose records retention or compaction
    removed (the log cannot check them, ``_backs`` is None): those records were durable
    (compaction rewrites only chunks that end at or before a checkpoint), so the entries
    stay, else their offsets would be handed out again (review11 R11-1: a re-dispatch
    that starts at or below a compacted chunk sees a queue only up to its last surviving
    record). Positions must rise from the entry before ``limit`` and stay below the log's
    end, and never past the checkpoint's offset for the queue (a record compaction
    removed lies below the checkpoint's position): a crash's tail stops the walk at its
    first entry, which lies past the log's end, before any record is read."""
    bound = queue.next_offset if recorded_end is None else min(recorded_end, queue.next_offset)
    if not queue.first_offset <= limit < bound:
        return limit
    previous = queue.entry(limit - 1)[0] if limit > queue.first_offset else -1
    while limit < bound:
        block = queue.entries(limit, min(_BLOCK, bound - limit))
        if not block:
            break
        for at, _ in block:
            if not previous < at < log_end or _backs(reader, queue, limit, at) is not None:
                return limit
            previous = at
            limit += 1
    return limit


def _unvouched(queue: Queue, first: int, end: int) -> str:
    """The problem to report for entries ``first``..``end - 1`` that ``_past_removed``
    kept with no checkpointed offset to bound them (review12 F3): a power loss's entry
    torn to a position compaction or retention emptied looks the same, and would be an
    offset handed out with no message behind it."""
    span = f"offset {first} is" if end - first == 1 else f"offsets {first}..{end - 1} are"
    return (
        f"queue {queue.topic}/{queue.queue_id}: {span} kept although no checkpoint records "
        f"the queue's end: the records, from log position {queue.entry(first)[0]} on, were "
        "removed by compaction or retention, so the log cannot check them (an entry a power "
        "loss tore into such a gap looks the same, and pulls skip it) "
        f"{_entry_location(queue, first)}"
    )


def _entry_location(queue: Queue, offset: int) -> str:
    """'in FILE at offset N' of a queue entry."""
    chunk = queue.manager.get_chunk_for(offset * QUEUE_RECORD_SIZE)
    return location(chunk.path, HEADER_SIZE + offset * QUEUE_RECORD_SIZE - chunk.base)


def _backs(reader: ChunkReader, queue: Queue, offset: int, position: int) -> bool | None:
    """Whether the log record at ``position`` is ``queue``'s at ``offset``; None where the
    log no longer holds that record (retention or compaction removed it)."""
    if position < reader.manager.first_position:
        return None
    try:
        payload = reader.read(position)
    except (ChunkRemovedError, CompactedAwayError):
        return None
    except (CorruptionError, PositionError):
        return False
    if len(payload) < MESSAGE_HEAD_SIZE:
        return False
    head = MESSAGE_HEAD.unpack_from(payload)
    pos, qoff, qid, tl = head[0], head[3], head[4], head[8]
    topic = payload[MESSAGE_HEAD_SIZE : MESSAGE_HEAD_SIZE + tl].decode(errors="replace")
    return (pos, qoff, qid, topic) == (position, offset, queue.queue_id, queue.topic)


def _checkpointed_offset(recorded: dict[str, Any] | None, topic: str, queue_id: int) -> int | None:
    offsets = (recorded or {}).get(topic)
    if isinstance(offsets, list) and queue_id < len(offsets) and isinstance(offsets[queue_id], int):
        return int(offsets[queue_id])
    return None


def _created_since(recorded: dict[str, Any] | None, topic: str, queue_id: int) -> bool:
    """Whether a checkpoint that lists queues lists no ``topic``/``queue_id``: the queue
    was created after it (its offsets are taken with its position, under the lock)."""
    if not isinstance(recorded, dict):
        return False
    offsets = recorded.get(topic)  # (a value of another type: damage, not absence)
    return offsets is None or (isinstance(offsets, list) and queue_id >= len(offsets))


def _record_location(reader: ChunkReader, position: int) -> str:
    """'in FILE at offset N' of a log record (its frame in an uncompacted chunk)."""
    chunk = reader.manager.get_chunk_for(position)
    return location(chunk.path, HEADER_SIZE + position - chunk.base)


class _Matcher:
    """``redispatch``'s common case in C (``_speedups.match_run``): after a crash nearly
    every record past the recovery start already has its queue entry, and only confirming
    that took most of a reopen in Python (0.36-0.50 s for 85 MB past the checkpoint). It
    hands each record it cannot confirm to the Python loop, which decides as before."""

    def __init__(self, manager: ChunkManager, queues: dict[str, list[Queue]], key_from: int):
        self._manager = manager
        self._key_from = key_from
        # Per topic and queue id, a row [entries mapping, first offset, entry count, seen,
        # queue]: the queue's chunk holding the next offset expected (an entry in another
        # chunk stops the run and the Python loop reads it). C writes seen, and lists the
        # rows it wrote in touched, so a run costs what it matched, not the queue count.
        self._targets: dict[bytes, list[list[Any]]] = {}
        self._rows: dict[Queue, list[Any]] = {}
        for topic, topic_queues in queues.items():
            rows = self._targets[topic.encode()] = []
            for queue in topic_queues:
                rows.append([None, 0, 0, -1, queue])
                self._rows[queue] = rows[-1]
        self._first: dict[Queue, int] = {}  # each queue's first offset past the start
        # Rows to refresh before a run: none at first, so that a queue is opened only once
        # a record of it is met (C hands that record to the Python loop, which opens it).
        self._stale: Iterable[Queue] = []
        self._mapped: set[Queue] = set()  # rows holding a mapping

    def _refresh(self, position: int, seen: dict[Queue, int]) -> None:
        """For each stale queue, the chunk holding the next offset expected after
        ``position`` (its last chunk if that is unknown), as it is now: the Python loop
        between two runs may have appended or cut entries, and closed a mapping. A row
        whose queue the cache closed lets go of its mapping (its descriptor)."""
        for queue in [q for q in self._mapped if not q.is_open]:
            self._rows[queue][:3] = [None, 0, 0]
            self._mapped.discard(queue)
        for queue in self._stale:
            queue.manager  # noqa: B018 (opened first: a deferred queue's end is its files')
            row = self._rows[queue]
            expected = seen.get(queue)
            if expected is None:
                expected = self._first.get(queue)
                if expected is None:
                    expected = self._first[queue] = queue.first_offset_at_or_after(position)
            chunk = queue.manager.last_chunk
            if expected < queue.next_offset:
                with contextlib.suppress(EQueueError):  # removed meanwhile: the last one
                    chunk = queue.manager.get_chunk_for(expected * QUEUE_RECORD_SIZE)
            if chunk is None or chunk.header.compacted:
                row[:3] = [None, 0, 0]
            else:
                first = chunk.base // QUEUE_RECORD_SIZE
                row[:3] = [chunk.mapping(), first, chunk.data_end // QUEUE_RECORD_SIZE]
                self._mapped.add(queue)

    def handled(self, queues: Iterable[Queue]) -> None:
        """The Python loop took records of these queues: their rows are refreshed next."""
        self._stale = queues

    def resumable(self, position: int) -> bool:
        return not self._manager.get_chunk_for(position).header.compacted

    def run(
        self,
        position: int,
        log_end: int,
        seen: dict[Queue, int],
        keys: KeyIndex,
        report: RecoveryReport,
    ) -> int:
        """Confirm records from ``position`` on; returns the first it could not confirm."""
        fast = speedups.SPEEDUPS
        assert fast is not None
        manager = self._manager
        last = manager.last_chunk
        self._refresh(position, seen)
        touched: list[list[Any]] = []
        while position < log_end:
            chunk = manager.get_chunk_for(position)
            if chunk.header.compacted:
                break
            start = position - chunk.base
            end = min(chunk.data_end, log_end - chunk.base)
            # A step at a time, each released once read: only a step stays resident. (A
            # record across a step's end stops the run: the Python loop takes it.)
            step_end = min(end, start + SCAN_STEP)
            # The last chunk's frames and checksums were checked by its scan at load.
            verify = chunk is not last or chunk.is_completed
            keyed: list[tuple[str, str, int]] = []
            stop, _ = fast.match_run(
                chunk.mapping(), HEADER_SIZE, start, step_end, chunk.base, verify,
                self._targets, self._key_from, keyed, touched,
            )  # fmt: skip
            for topic, key, at in keyed:
                keys.add(topic, key, at)
            report.reindexed_keys += len(keyed)
            chunk.release_behind(start, stop)
            position = chunk.base + stop
            if stop < step_end:
                break
            if step_end < end:
                continue
            if not chunk.is_completed:
                break
            position = chunk.end_position  # the rest of a completed chunk is padding
        for row in touched:
            if row[3] >= 0:
                seen[row[4]] = max(seen.get(row[4], 0), row[3])
                row[3] = -1
        return position
