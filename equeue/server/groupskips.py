"""The offsets of a queue that retention removed before a consumer group consumed them:
counted once each, per group and queue, and warned about (docs/groups.md). A member given
a queue whose group's committed offset is below what retention kept starts at the first
offset kept; the coordinator notes the offsets it skips, and ``stats`` reports them.

Functions bound into GroupCoordinator's class body (equeue/server/groups.py; as
store/storesend.py's into MessageStore): the same function objects are its methods. The
counts live in the coordinator's ``skipped`` (in memory: a broker restart starts afresh).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from equeue.store import offsets as group_offsets

if TYPE_CHECKING:
    from equeue.server.groups import GroupCoordinator, Queue, _Group

log = logging.getLogger("equeue.groups")  # (groups.py's: one logger for the groups' warnings)

MAX_SKIP_GROUPS: Final = 4096  # groups whose skips the coordinator counts
MAX_SKIP_RANGES: Final = 4  # the last ranges kept per queue (the count is of all)
MAX_COUNTED_RANGES: Final = 64  # disjoint counted ranges kept per queue (_Skipped.counted)


@dataclass
class _Skipped:
    count: int = 0
    ranges: list[tuple[int, int]] = field(default_factory=list)  # [start, first) each
    # The offsets counted, as sorted disjoint [start, end) ranges: a note may start below
    # an earlier one (the queue's next holder starts at the group's commit, below where the
    # last holder's pull was answered from: reviewh F2), so one watermark is not enough.
    counted: list[tuple[int, int]] = field(default_factory=list)

    def uncounted(self, start: int, first: int) -> list[tuple[int, int]]:
        """The parts of [start, first) no earlier note counted."""
        parts = []
        for low, high in self.counted:
            if low > start:
                parts.append((start, min(low, first)))
            start = max(start, high)
            if start >= first:
                return [part for part in parts if part[0] < part[1]]
        parts.append((start, first))
        return [part for part in parts if part[0] < part[1]]

    def add(self, start: int, first: int) -> None:
        merged: list[tuple[int, int]] = []
        for low, high in sorted([*self.counted, (start, first)]):
            if merged and low <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], high))
            else:
                merged.append((low, high))
        if len(merged) > MAX_COUNTED_RANGES:  # bounded: the lowest gap is taken as counted
            merged[:2] = [(merged[0][0], merged[1][1])]
        self.counted = merged


def note_skip(
    self: GroupCoordinator, group: str, topic: str, queue_id: int, start: int, first: int
) -> None:
    """The group was to read ``topic``/``queue_id`` from ``start``, but retention
    removed the offsets before ``first``: count them (once) and warn."""
    queues = self.skipped.get(group)
    if queues is None:
        if len(self.skipped) >= MAX_SKIP_GROUPS:
            return  # bounded: the warning below still names the first groups
        queues = self.skipped[group] = {}
    found = queues.setdefault((topic, queue_id), _Skipped())
    for low, high in found.uncounted(start, first):  # (what no earlier note counted)
        found.count += high - low
        found.ranges = [*found.ranges[-(MAX_SKIP_RANGES - 1) :], (low, high)]
        found.add(low, high)
        log.warning(
            "group %r: offsets %d to %d of %s/%d were removed by retention before the "
            "group consumed them; it goes on at %d (%d skipped in all on this queue)",
            group, low, high - 1, topic, queue_id, first, found.count,
        )  # fmt: skip


def _check_retained(self: GroupCoordinator, state: _Group, queues: frozenset[Queue]) -> None:
    """Queues just given to a member: is the group's committed offset below what
    retention kept (the member then starts at the first retained)? The group's
    offsets are read once (offsets.json's entry and its file), not once per queue."""
    try:
        offsets = group_offsets.committed_group(self.store, state.name)
    except Exception:  # the member's own reads report it
        return
    for topic, queue_id in queues:
        committed = offsets.get(topic, {}).get(str(queue_id))
        try:
            first = self.store.queue_range(topic, queue_id)[0]
        except Exception:  # the member's own reads report it
            continue
        if committed is not None and committed < first:
            self.note_skip(state.name, topic, queue_id, committed, first)


def skips(self: GroupCoordinator, only: str | None = None) -> dict[str, dict[str, Any]]:
    """Per group (also one with no member now; ``only``: that one), per
    ``"topic/queue_id"``: how many offsets retention removed before the group consumed
    them, and the last ranges (``[start, first)``) since the broker started."""
    return {
        name: {
            f"{t}/{q}": {"count": found.count, "ranges": [list(r) for r in found.ranges]}
            for (t, q), found in sorted(queues.items())
        }
        for name, queues in sorted(self.skipped.items())
        if only is None or name == only
    }


def skipped_counts(self: GroupCoordinator) -> dict[str, int]:
    """Per group: the offsets retention removed before it consumed them, every queue's."""
    return {
        name: sum(found.count for found in queues.values()) for name, queues in self.skipped.items()
    }
