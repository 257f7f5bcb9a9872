"""Queue entries read without their messages (``queue_positions``, ``offset_for_time``'s
search), checked for what an entry alone can show to be damage.

A queue entry has no checksum of its own (docs/format.md: 12 bytes, position + 1 and a
tag hash). What holds of every intact entry of a queue, and can be checked without
reading a message: its position is at least 0 and below the message log's end, and the
positions of a queue's entries rise strictly with the offset (a queue's messages are
appended to the log in offset order; compaction and retention remove records, never
move them; the reads check order only, not that two entries differ). A damaged entry
that still satisfies both (a flipped low bit that stays between its neighbours) and a
damaged tag hash are found only by reading the message: by ``pull``, which checks every
message against its entry, and by ``equeue verify``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from equeue.errors import CorruptRecordError, PositionError
from equeue.store.queue import Queue

if TYPE_CHECKING:
    from equeue.store.store import MessageStore

_U64 = (1 << 64) - 1


def checked_positions(
    store: MessageStore, queue: Queue, offset: int, entries: list[tuple[int, int]]
) -> list[int]:
    """The positions of ``entries`` (``queue``'s, from ``offset`` on), or a
    CorruptRecordError naming the queue file and offset of the first entry that cannot be
    intact."""
    positions = [position for position, _ in entries]
    if not positions:
        return positions
    # Non-decreasing, checked by a sort of sorted data (a quarter of a pairwise
    # comparison's CPU at 1,000 entries); two entries naming one position pass here and
    # are found by pull and verify (each entry's message names its own offset).
    if positions[0] >= 0 and sorted(positions) == positions:
        last = positions[-1]
        if last < store._known_log_end or last < _log_end(store, last):
            return positions
    error = _first_bad(store, queue, offset, positions)
    if error is not None:
        raise error
    return positions


def checked_position(store: MessageStore, queue: Queue, offset: int, position: int) -> int:
    """``position``, the entry of ``queue`` at ``offset``, if it lies in the log."""
    error = (
        None
        if 0 <= position < store._known_log_end or 0 <= position < _log_end(store, position)
        else _first_bad(store, queue, offset, [position])
    )
    if error is not None:
        raise error
    return position


def unreadable_entry(
    queue: Queue, offset: int, position: int, exc: Exception
) -> CorruptRecordError:
    """The entry at ``offset`` names ``position``, where reading failed with ``exc`` (no
    intact record there): the error names the queue file and the entry's offset."""
    file, at = queue.entry_location(offset)
    return CorruptRecordError(
        f"queue {queue.topic}/{queue.queue_id} entry for offset {offset} names position "
        f"{position}, where no intact message was found ({exc})",
        file=file,
        offset=at,
    )


def _log_end(store: MessageStore, position: int) -> int:
    """The message log's end; a read-only handle catches up with the writer first if
    ``position`` lies past its view (an entry is written after its message)."""
    messages = store._messages
    end = messages.committed_position
    if position >= end and store.read_only:
        messages.refresh()
        end = messages.committed_position
    store._known_log_end = end
    return end


def _first_bad(
    store: MessageStore, queue: Queue, offset: int, positions: list[int]
) -> CorruptRecordError | None:
    """The error for the first entry of ``positions`` that breaks a rule (module
    docstring), or None. A read-only handle looks twice, each look after a refresh of
    its view of the log when an entry lies past it: a refresh may come up short (a chunk
    it needed removed or swapped meanwhile), and an entry past a view that was behind
    is no damage; only one still outside after the second look is."""
    error = _rule_broken(store, queue, offset, positions)
    if error is not None and store.read_only:
        error = _rule_broken(store, queue, offset, positions)
    return error


def _rule_broken(
    store: MessageStore, queue: Queue, offset: int, positions: list[int]
) -> CorruptRecordError | None:
    """Of two entries out of order, the one whose message does not name it is the
    damaged one; if neither can be told so, the later one is named."""
    end = _log_end(store, max(positions))
    previous: int | None = None
    for at, position in enumerate(positions, offset):
        if not 0 <= position < end:
            return _damaged(
                queue,
                at,
                position,
                f"names position {position}, outside the message log [0, {end}) (its stored "
                "value, position + 1, is at most the log's end)",
                end,
            )
        if previous is not None and position <= previous:
            if not _names_entry(store, queue, at - 1, previous):
                return _damaged(
                    queue,
                    at - 1,
                    previous,
                    f"names position {previous}, not before the next entry's {position}, "
                    "and no record of this offset is there (its stored value is below the "
                    "next entry's)",
                    position,
                )
            return _damaged(
                queue,
                at,
                position,
                f"names position {position}, not after the previous entry's {previous} "
                "(its stored value is above the previous entry's)",
                previous + 2,
            )
        previous = position
    return None  # (the log grew past a position between the two looks: no damage)


def _names_entry(store: MessageStore, queue: Queue, offset: int, position: int) -> bool:
    """Whether the message at ``position`` is ``queue``'s at ``offset``."""
    try:
        message = store._log.read(position)
    except (CorruptRecordError, PositionError):
        return False
    return (message.topic, message.queue_id, message.queue_offset) == (
        queue.topic,
        queue.queue_id,
        offset,
    )


def _damaged(
    queue: Queue, offset: int, position: int, why: str, expected: int
) -> CorruptRecordError:
    file, at = queue.entry_location(offset)
    return CorruptRecordError(
        f"queue {queue.topic}/{queue.queue_id} entry for offset {offset} {why}: the entry is "
        "damaged (equeue verify checks every entry against its message)",
        file=file,
        offset=at,
        expected=expected,
        found=(position + 1) & _U64,
    )
