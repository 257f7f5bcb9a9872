"""``equeue verify``'s queue chunks: every entry of a queue chunk checked against the
message it names (equeue/inspect/verify.py walks the message chunks and binds these
into its Verifier, as MessageStore binds equeue/store/storetopics.py's), and what both
share: a chunk's result, and the error for an entry into an unreadable message chunk.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from equeue.format.chunk import FOOTER_SIZE, HEADER_SIZE, ChunkType
from equeue.format.message import QUEUE_RECORD, QUEUE_RECORD_SIZE
from equeue.inspect.layout import ChunkFile, Problem, map_file, trailing_bytes

if TYPE_CHECKING:
    from equeue.inspect.verify import Verifier


class Unreadable(Exception):
    """A queue entry points into a message chunk that cannot be read at all."""


@dataclass
class CheckResult:
    problems: list[Problem] = field(default_factory=list)
    records: int = 0
    frames_damaged: bool = False


def queue_checker(
    self: Verifier, topic: str, queue_id: int
) -> Callable[[ChunkFile, bool], CheckResult]:
    def check(cf: ChunkFile, last: bool) -> CheckResult:
        return self._queue_chunk(cf, last, topic, queue_id)

    return check


def queue_chunk(
    self: Verifier, cf: ChunkFile, last: bool, topic: str, queue_id: int
) -> CheckResult:
    result = CheckResult(list(cf.problems))
    header = cf.header
    if header is None:
        return result
    records = self._store.queue_chunk_records
    self._check_header(
        cf,
        result,
        ChunkType.FIXED,
        None if records is None else records * QUEUE_RECORD_SIZE,
        QUEUE_RECORD_SIZE,
        None,
    )
    if header.record_size != QUEUE_RECORD_SIZE or cf.size <= HEADER_SIZE:
        return result
    self._check_data_checksum(cf, result)
    path = str(cf.path)
    if header.compacted and cf.footer is not None:
        result.problems.append(
            Problem(path, 0, "header", "compacted queue chunks are not checked entry by entry")
        )
        return result
    ongoing = cf.footer is None
    # An ongoing chunk is walked to its first empty slot as it is now, not as it was
    # when the file was listed: a live writer appends all the while.
    end = cf.data_limit - cf.data_limit % QUEUE_RECORD_SIZE if ongoing else cf.data_limit
    if end % QUEUE_RECORD_SIZE:
        result.problems.append(
            Problem(
                path,
                cf.size - FOOTER_SIZE,
                "footer",
                f"physical data size {end} is not a whole number of "
                f"{QUEUE_RECORD_SIZE}-byte entries",
            )
        )
    # A retry of the same chunk starts from what preceded it, not from its own last entry.
    saved = self._previous.get((topic, queue_id))
    before = None if saved is None else saved[1] if saved[0] == cf.start_number else saved[2]
    previous = before
    unreadable: dict[str, list[int]] = {}  # reason -> [file offset, first, last, count]
    local = 0
    mm = cf.content if cf.content is not None else map_file(cf.path)
    try:
        while True:
            while local + QUEUE_RECORD_SIZE <= end:
                p = HEADER_SIZE + local
                stored, hashed = QUEUE_RECORD.unpack_from(mm, p)
                if ongoing and not stored and not hashed:
                    break  # the first empty slot: the end of the entries
                offset = (header.start_position + local) // QUEUE_RECORD_SIZE
                try:
                    why = self._check_entry(topic, queue_id, offset, stored - 1, hashed, previous)
                except Unreadable as exc:
                    # One problem for all the entries that point into one lost chunk.
                    run = unreadable.setdefault(str(exc), [p, offset, offset, 0])
                    run[2], run[3] = offset, run[3] + 1
                    result.records += 1
                    local += QUEUE_RECORD_SIZE
                    # Not carried as the previous entry either: a flipped high bit
                    # names a chunk past the log, and every later entry would be
                    # reported as not after it.
                    continue
                if why is None:
                    previous = stored - 1  # a bad entry is not what the next must follow
                else:
                    name = f"{topic}/{queue_id} offset {offset}"
                    result.problems.append(Problem(path, p, "queue entry", f"{name} {why}"))
                result.records += 1
                local += QUEUE_RECORD_SIZE
            if not ongoing or self._tail_problem(cf, mm, local, last, result):
                break
    finally:
        if isinstance(mm, mmap.mmap):
            mm.close()
    for reason, (p, first, final, count) in unreadable.items():
        offsets = (
            f"offset {first} points"
            if count == 1
            else (f"offsets {first}..{final} ({count} entries) point")
        )
        result.problems.append(
            Problem(path, p, "queue entry", f"{topic}/{queue_id} {offsets} into {reason}")
        )
    self._previous[topic, queue_id] = (cf.start_number, before, previous)
    return result


def tail_problem(
    self: Verifier,
    cf: ChunkFile,
    mm: mmap.mmap | bytes,
    local: int,
    last: bool,
    result: CheckResult,
) -> bool:
    """After an ongoing queue chunk's first empty slot: True when the walk is over
    (nothing but zeros follow, or a torn tail, reported); False when a writer has
    filled the slot meanwhile and the walk should go on."""
    header = cf.header
    assert header is not None
    stop = trailing_bytes(cf, local)
    if stop <= local:
        return True
    # Entries are written in order, so once later bytes are seen, the slot is filled
    # if a writer was appending; still empty, it is a hole or a torn tail.
    p = HEADER_SIZE + local
    if any(mm[p : p + QUEUE_RECORD_SIZE]):
        return False
    kind = "torn tail" if last else "queue entry"
    cut = ", which recovery would cut" if last else ""
    result.problems.append(
        Problem(
            str(cf.path),
            p,
            kind,
            f"{stop - local} bytes after the last queue entry (offset "
            f"{(header.start_position + local) // QUEUE_RECORD_SIZE - 1}){cut}",
        )
    )
    return True


def check_entry(
    self: Verifier,
    topic: str,
    queue_id: int,
    offset: int,
    position: int,
    hashed: int,
    previous: int | None,
) -> str | None:
    """Why the entry is wrong, or None."""
    if position < 0:
        return "is empty inside the data" if position == -1 else "holds a negative position"
    if previous is not None and position <= previous:
        return f"points at position {position}, not after the previous entry's {previous}"
    first, size = self._first_number, self._message_size
    if first is not None and size is not None and position < first * size:
        return None  # the message chunk was removed by retention
    head, why = self._message_at(position)
    if head is None:
        return f"points at position {position}, {why}" if why is not None else None
    found = (head.topic, head.queue_id, head.queue_offset)
    if found != (topic, queue_id, offset):
        return (
            f"points at position {position}, which holds the message of "
            f"{head.topic}/{head.queue_id} offset {head.queue_offset}"
        )
    if head.tag_hash != hashed:
        return (
            f"has tag hash 0x{hashed:x}, but the message at position {position} has "
            f"0x{head.tag_hash:x}"
        )
    return None
