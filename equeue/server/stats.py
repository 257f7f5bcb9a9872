"""The broker's counters and the ``stats`` op's answer (docs/protocol.md, "stats")."""

from __future__ import annotations

import heapq
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Protocol

from equeue.errors import EQueueError
from equeue.server.retry import Retries
from equeue.speedups import SPEEDUPS
from equeue.store import validate
from equeue.store.config import StoreConfig
from equeue.store.offsets import committed_group
from equeue.store.retentionhold import retention_hold
from equeue.store.store import MessageStore

RATE_WINDOW_S = 5.0  # rates are over about the last this many seconds
COUNTERS = (
    "requests", "sends", "send_requests", "pulls", "bytes_in", "bytes_out", "errors",
    "held_pulls_moved",
)  # fmt: skip


class _PyCounters:
    """The counters as Python ints, where the C accelerator is not built or not used."""

    __slots__ = ("bytes_in", "bytes_out", "errors", "pulls", "requests", "send_requests", "sends")


# With the accelerator the counters are C integers (cext/counters.c): the send lane and
# release_frames add to them with no int made a bump (4 a durable send); Python reads and
# writes them as ints, as before (a bump from Python costs ~30 ns more: a getset
# descriptor, not a specialized slot).
if TYPE_CHECKING:  # (the same ints, typed in _speedups.pyi)
    from equeue._speedups import CCounters as _Base
else:
    _Base = _PyCounters if SPEEDUPS is None else SPEEDUPS.CCounters


class Counters(_Base):
    # held_pulls_moved is a Python int: it changes at a rebalance, not per send
    __slots__ = ("_samples", "held_pulls_moved", "started")

    def __init__(self) -> None:
        self.requests = 0
        self.sends = 0  # messages appended (a send_batch counts each)
        self.send_requests = 0
        self.pulls = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.errors = 0  # error answers
        # a group member's long polls answered GroupError because its queue moved or it
        # left while they were held: the group's normal turn, not counted in errors
        self.held_pulls_moved = 0
        self.started = time.monotonic()
        self._samples: deque[tuple[float, tuple[int, ...]]] = deque()

    def totals(self) -> tuple[int, ...]:
        return tuple(getattr(self, name) for name in COUNTERS)

    def sample(self) -> None:
        """Called about once a second from the loop."""
        now = time.monotonic()
        self._samples.append((now, self.totals()))
        while len(self._samples) > 2 and now - self._samples[1][0] >= RATE_WINDOW_S:
            self._samples.popleft()

    def rates(self) -> dict[str, float]:
        now, totals = time.monotonic(), self.totals()
        then, before = self._samples[0] if self._samples else (self.started, (0,) * len(COUNTERS))
        span = max(now - then, 1e-3)
        return {
            f"{name}_per_s": round((totals[i] - before[i]) / span, 1)
            for i, name in enumerate(COUNTERS)
        }


class GroupsOfCoordinator(Protocol):
    """What the groups' part of ``stats`` asks of equeue/server/groups.py's coordinator."""

    def live(self) -> list[str]: ...
    def summary(self, name: str) -> dict[str, Any]: ...
    def detail(self, name: str) -> dict[str, Any] | None: ...
    def skips(self, only: str | None = None) -> dict[str, dict[str, Any]]: ...
    def skipped_counts(self) -> dict[str, int]: ...


def groups_summary(
    store: MessageStore, coordinator: GroupsOfCoordinator, listed: int
) -> dict[str, Any]:
    """``stats``' groups without an argument: the ``listed`` groups with the most lag
    (ties by name), each in three numbers, and as many live groups of the coordinator,
    with how many of each were left out. Its size is bounded by ``listed``
    (``stats_max_listed``), not by the groups, their queues or members (reviewg F11); its
    cost is one queue_range per committed queue of every group, no item made for one."""
    ranges: dict[str, list[Range]] = {}
    totals = {
        group: _total_lag(store, topics, ranges)
        for group, topics in store.consumer_groups().items()
    }
    skipped = coordinator.skipped_counts()
    for group in skipped:  # retention passed it, maybe before its first commit
        totals.setdefault(group, (0, 0))

    def most_lag(group: str) -> tuple[int, str]:
        return -totals.get(group, (0, 0))[0], group

    chosen = heapq.nsmallest(listed, totals, key=most_lag)
    live = coordinator.live()
    chosen_live = heapq.nsmallest(listed, live, key=most_lag)
    return {
        "groups": {
            group: {
                "lag": totals[group][0],
                "queue_count": totals[group][1],
                "skipped_count": skipped.get(group, 0),
            }
            for group in chosen
        },
        "groups_omitted": len(totals) - len(chosen),
        "coordinator": {group: coordinator.summary(group) for group in chosen_live},
        "coordinator_omitted": len(live) - len(chosen_live),
    }


def group_detail(
    store: MessageStore, coordinator: GroupsOfCoordinator, group: str
) -> dict[str, Any]:
    """``stats {"group": G}``'s groups: G's lag per queue (``"topic/queue_id"``:
    committed, end, lag), its offsets retention removed before it consumed them, and its
    members and assignment if it has members; empty maps for a group with none of them.
    Bounded by one group's queues (MAX_TOPICS x 1,024 at most)."""
    validate.check_group(group)
    committed = {
        topic: {int(queue_id): offset for queue_id, offset in queues.items()}
        for topic, queues in committed_group(store, group).items()
    }
    groups: dict[str, Any] = {}
    if committed:
        groups[group] = group_lag(store, committed)
    for name, skipped in coordinator.skips(group).items():
        groups.setdefault(name, {"lag": 0, "queues": {}})["skipped"] = skipped
    live = coordinator.detail(group)
    return {"groups": groups, "coordinator": {} if live is None else {group: live}}


def group_lag(store: MessageStore, topics: dict[str, dict[int, int]]) -> dict[str, Any]:
    """A consumer group's lag (messages past its committed offsets) in total and per queue
    (``"topic/queue_id"``: committed, end, lag)."""
    total = 0
    per_queue: dict[str, Any] = {}
    for topic, queues in sorted(topics.items()):
        for queue_id, committed in sorted(queues.items()):
            try:
                first, end = store.queue_range(topic, queue_id)
            except EQueueError:  # a topic deleted since: no lag to speak of
                continue
            lag = max(end - max(committed, first), 0)
            total += lag
            per_queue[f"{topic}/{queue_id}"] = {"committed": committed, "end": end, "lag": lag}
    return {"lag": total, "queues": per_queue}


def _total_lag(
    store: MessageStore, topics: dict[str, dict[int, int]], ranges: dict[str, list[Range]]
) -> tuple[int, int]:
    """group_lag's total, and the number of queues it committed on, with nothing made
    per queue. ``ranges``: each topic's queue ranges, read once for every group (groups
    share topics: 4,236 groups of one 64-queue topic read 64 ranges, not 271,104)."""
    total = count = 0
    for topic, queues in topics.items():
        count += len(queues)
        found = ranges.get(topic)
        if found is None:
            found = ranges[topic] = _queue_ranges(store, topic)
        for queue_id, committed in queues.items():
            if queue_id < len(found):  # (else a topic deleted or made again smaller since)
                first, end = found[queue_id]
                if end > committed and end > first:
                    total += end - max(committed, first)
    return total, count


Range = tuple[int, int]


def _queue_ranges(store: MessageStore, topic: str) -> list[Range]:
    try:
        return [store.queue_range(topic, queue_id) for queue_id in store.queue_ids(topic)]
    except EQueueError:  # a topic deleted since: no lag to speak of
        return []


def retention_stats(config: StoreConfig) -> dict[str, Any]:
    """The retention the broker's store applies: ``equeue serve``'s options (not persisted,
    so nothing else shows them) or a caller's handle's own StoreConfig."""
    return {
        "retention_s": None if config.retention is None else config.retention.total_seconds(),
        "max_store_bytes": config.max_store_bytes,
        "respects_consumers": config.retention_respects_consumers,
    }


def render_retention(retention: dict[str, Any]) -> str:
    """``--status``'s line for the ``retention`` map."""
    seconds, cap = retention.get("retention_s"), retention.get("max_store_bytes")
    if seconds is None and cap is None:
        return "retention: none (every log chunk is kept)"
    parts = []
    if seconds is not None:
        parts.append(f"chunks older than {seconds:g} s")
    if cap is not None:
        parts.append(f"the oldest chunks while the store is over {cap} bytes")
    respects = retention.get("respects_consumers")
    after = ", once every group committed past them" if respects else ""
    return f"retention: removes {' and '.join(parts)}{after}"


def retry_and_retention(store: MessageStore, retries: Retries) -> dict[str, Any]:
    """The retry mover's counts (``retry``: docs/groups.md) and, while retention is held
    back under ``retention_respects_consumers``, by whom (``retention_held``, as of
    retention's last run: docs/broker.md, "Retention")."""
    answer: dict[str, Any] = {"retry": retries.stats()}
    hold = retention_hold(store)
    if hold is not None:
        answer["retention_held"] = hold.as_stats()
    return answer
