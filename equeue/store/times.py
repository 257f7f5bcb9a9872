"""Times given to the API and the CLI, under one rule, and ``offset_for_time``'s search.

The rule: a time is seconds since the epoch (an int or float, as ``time.time()`` and
``Message.stored_at``), an aware ``datetime``, or, as text (the CLI), unix seconds or
ISO-8601 naming its zone ("Z", "+02:00"). A naive datetime, or ISO text without a zone,
is refused: local time or UTC would both be a guess, and a wrong guess moves a
consumer by hours without a word.
"""

from __future__ import annotations

import datetime as dt
import decimal
from collections.abc import Callable
from typing import TYPE_CHECKING

from equeue.errors import (
    ChunkRemovedError,
    CompactedAwayError,
    CorruptRecordError,
    InvalidMessageError,
    PositionNotFoundError,
)
from equeue.format.message import MESSAGE_HEAD
from equeue.store import follow, validate
from equeue.store.entrycheck import checked_position, unreadable_entry
from equeue.store.queue import Queue

if TYPE_CHECKING:
    from equeue.store.store import MessageStore

_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_NAIVE = (
    "has no time zone; give an aware datetime (datetime.now(UTC), "
    "dt.replace(tzinfo=...)) or seconds since the epoch"
)


def check_time(value: object) -> float | int | dt.datetime:
    """``value`` if it is a time under the rule (module docstring), else an equeue error."""
    if isinstance(value, dt.datetime):
        if value.tzinfo is None or value.utcoffset() is None:
            raise InvalidMessageError(f"time {value.isoformat()} {_NAIVE}")
        return value
    return validate.check_timestamp(value)


def epoch_ns(value: object) -> int:
    """A time under the rule as integer nanoseconds since the epoch (a datetime exactly:
    it has microseconds; a float as exactly as its binary value allows)."""
    value = check_time(value)
    if isinstance(value, dt.datetime):
        return (value - _EPOCH) // dt.timedelta(microseconds=1) * 1000
    if isinstance(value, int):
        return value * 10**9
    return int(decimal.Decimal(value) * 10**9)


def parse_time(text: str) -> int:
    """Integer nanoseconds since the epoch from text: unix seconds ("1700000000.5",
    exact to the nanosecond) or ISO-8601 with a zone ("2024-05-01T12:00:00Z"). Naive
    ISO text is refused (InvalidMessageError), as a naive datetime is by the API."""
    try:
        ns = int(decimal.Decimal(text.strip()) * 10**9)  # Decimal: a float rounds the ns
    except (decimal.DecimalException, ValueError, OverflowError):  # ("1e999999": Overflow)
        pass
    else:
        # ns past an i64 (years before 1678 or after 2262) are no message's time, and a
        # caller's ns / 1e9 past 1e308 s raised a builtin OverflowError (R11-7's audit)
        if not -(2**63) <= ns < 2**63:
            raise InvalidMessageError(
                f"time {text[:40]!r} is out of range: unix seconds must lie within "
                "+-9223372036 (the years 1678 to 2262)"
            )
        return ns
    try:
        when = dt.datetime.fromisoformat(text.strip())
    except ValueError:
        raise InvalidMessageError(
            f"cannot read time {text!r}: give ISO-8601 with a zone (2024-05-01T12:00:00Z) "
            "or unix seconds"
        ) from None
    if when.tzinfo is None:
        # text comes from a command line or an option, not Python: the advice is text's
        raise InvalidMessageError(
            f"time {text!r} has no time zone; add Z or an offset such as +02:00 "
            f"({when.isoformat(timespec='seconds')}Z), or give unix seconds"
        )
    return epoch_ns(when)


def _before(when: float | int | dt.datetime) -> Callable[[int], bool]:
    """Whether a message stored at these nanoseconds comes before ``when``, compared as
    the user sees the message's time: ``stored_at`` (float seconds) against a number,
    ``datetime.fromtimestamp(stored_at, UTC)`` (microseconds) against a datetime. So a
    message's own stored_at, or that datetime, finds that message, rounding and all."""
    if isinstance(when, dt.datetime):
        return lambda ns: dt.datetime.fromtimestamp(ns / 1e9, dt.UTC) < when
    return lambda ns: ns / 1e9 < when


def offset_for_time(store: MessageStore, topic: str, queue_id: int, when: object) -> int:
    """The first offset of the queue whose message was stored at or after ``when``
    (binary search over the queue; offsets compaction removed are skipped, and those
    retention removed meanwhile: the answer is never below them)."""
    queue = store._queue(topic, queue_id)
    before = _before(check_time(when))
    if store.read_only:
        try:
            return _search(_Probe(store, queue, restart=True), before)
        except _Behind:
            # The view is behind the writer's retention (it looked more than 10 ms ago):
            # caught up, and searched once more from the start, never in the middle of a
            # search (fixrecov found that unsafe). Removals from now on are stepped past.
            follow.follow_log(store, queue)
    return _search(_Probe(store, queue), before)


class _Behind(Exception):
    """A read-only view's first search met a chunk retention removed."""


def _search(probe: _Probe, before: Callable[[int], bool]) -> int:
    queue = probe.queue
    lo, hi = queue.first_offset, queue.next_offset
    while lo < hi:
        mid = (lo + hi) // 2
        found = probe.stored_at_or_after(mid, hi)
        # (Comparisons, not max(): a builtin call each cost ~800 instructions, 37 a
        # call, +6.6% of offset_for_time by callgrind.)
        if probe.gone > lo:
            lo = probe.gone
        if found is None:  # every offset in [mid, hi) was compacted away
            hi = mid if mid > lo else lo
            continue
        at, stored = found
        if before(stored):
            lo = at + 1
        else:
            hi = mid if mid > lo else lo
    found = probe.stored_at_or_after(lo, queue.next_offset)  # lo may be compacted
    return queue.next_offset if found is None else found[0]


class _Probe:
    """The search's reads. ``gone``: the offsets below it name messages retention removed
    (found so during the search): the answer is not among them, and no probe reads them
    again (else each probe below the first retained chunk stepped through the removed
    chunks anew)."""

    __slots__ = ("gone", "queue", "restart", "store")

    def __init__(self, store: MessageStore, queue: Queue, *, restart: bool = False) -> None:
        self.store = store
        self.queue = queue
        self.gone = 0
        self.restart = restart  # _Behind at the first removed chunk met

    def stored_at_or_after(self, offset: int, stop: int) -> tuple[int, int] | None:
        """(offset, stored ns) of the first message at or after ``offset`` (before
        ``stop``) that compaction and retention left."""
        store, queue = self.store, self.queue
        gone = self.gone
        at = offset if offset > gone else gone
        while at < stop:
            position = checked_position(store, queue, at, queue.entry(at)[0])
            try:
                payload = store._reader.read(position)
            except CompactedAwayError:
                at += 1
                continue
            except ChunkRemovedError:
                if self.restart:
                    raise _Behind from None
                # Retention ran meanwhile (or since a read-only view last looked): it
                # removes chunks oldest first, so every entry before this one, and those
                # after it up to the end of its chunk, name removed messages too (entries
                # are in log order). Past them at once, by the entries alone: one log read
                # a removed chunk, not one an entry (fixrecov: 5,699 for 256 chunks).
                at = queue.first_offset_at_or_after(_chunk_end(store, position), at + 1, stop)
                self.gone = max(self.gone, at)
                continue
            except (PositionNotFoundError, CorruptRecordError) as exc:
                raise unreadable_entry(queue, at, position, exc) from exc
            _, stored, _, queue_offset, queue_id, *_ = MESSAGE_HEAD.unpack_from(payload)
            if (queue_offset, queue_id) != (at, queue.queue_id):
                raise unreadable_entry(
                    queue,
                    at,
                    position,
                    CorruptRecordError(
                        f"the record there is queue {queue_id}'s offset {queue_offset}"
                    ),
                )
            return at, stored
        return None


def _chunk_end(store: MessageStore, position: int) -> int:
    """The log position where the chunk number holding ``position`` ends."""
    size = store._messages.config.chunk_data_size
    return (position // size + 1) * size
