"""The broker's counters and the ``stats`` op's answer (docs/protocol.md, "stats")."""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Any

from equeue.server.retry import Retries
from equeue.speedups import SPEEDUPS
from equeue.store.config import StoreConfig
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


def group_lag(store: MessageStore) -> dict[str, Any]:
    """Per consumer group that committed offsets (through the broker or an embedded
    consumer): its lag (messages past its committed offsets) in total and per queue
    (``"topic/queue_id"``: committed, end, lag)."""
    groups: dict[str, Any] = {}
    for group, topics in store.consumer_groups().items():
        total = 0
        per_queue: dict[str, Any] = {}
        for topic, queues in sorted(topics.items()):
            for queue_id, committed in sorted(queues.items()):
                try:
                    first, end = store.queue_range(topic, queue_id)
                except Exception:  # a topic deleted since: no lag to speak of
                    continue
                lag = max(end - max(committed, first), 0)
                total += lag
                per_queue[f"{topic}/{queue_id}"] = {"committed": committed, "end": end, "lag": lag}
        groups[group] = {"lag": total, "queues": per_queue}
    return groups


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
