"""A bounded busy-poll of the broker's event loop (``--busy-poll-us``, issue 23).

Under ``--flush sync`` a round is: the flusher's fdatasync ends and wakes the loop (an
eventfd), the loop writes the answers, the clients handle them and send again, the loop
reads those, the next fdatasync starts. Between these steps the loop sleeps in
``epoll_wait``; on a VM an idle vCPU halts and waking it costs an IPI through the
hypervisor, and every such bubble delays the whole cohort. So after a flush's answers are
written the loop keeps polling (a callback that re-schedules itself with ``call_soon``:
uvloop, like asyncio's loop, then polls with a zero timeout) for ``window_us`` past the
last send it saw or the last flush's end, and while a flush is in progress
(``CrossClientCommit.pending``, bounded by ``MAX_SPIN_WINDOWS`` windows so a slow disk
does not keep a core busy for a whole fdatasync). Once the window passes with nothing
arriving it stops re-scheduling itself: an idle broker sleeps as before.

Costs CPU while it polls (a core's worth at most, for the window after each flush's end);
risks nothing for durability: it changes when the loop looks at its sockets, never what
it answers or when an answer is released.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

# While sends wait for a flush in progress the spin continues, but for at most this many
# windows past the last send or flush end (an fdatasync of a slow disk takes ms).
MAX_SPIN_WINDOWS = 4


class _Commit(Protocol):
    @property
    def pending(self) -> int: ...


class _Counters(Protocol):
    send_requests: int


class BusyPoll:
    """``kick()`` on activity (a flush's answers released); the loop then polls until
    ``window_us`` passes with no new send."""

    __slots__ = ("_counters", "_limit", "_loop", "_seen", "_until", "_window", "active",
                 "commit", "kicks", "spins")  # fmt: skip

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        window_us: int,
        counters: _Counters,
        commit: _Commit | None = None,
    ) -> None:
        self._loop = loop
        self._window = window_us / 1e6
        self._counters = counters
        self.commit = commit  # its pending sends keep the spin going (bounded)
        self._seen = counters.send_requests
        self._until = 0.0  # poll until then (monotonic seconds)
        self._limit = 0.0  # ... or, while a flush is pending, until then
        self.active = False
        self.kicks = 0  # times the spin was (re)started from idle
        self.spins = 0  # loop iterations spent polling

    def kick(self) -> None:
        now = time.monotonic()
        self._until = now + self._window
        self._limit = now + self._window * MAX_SPIN_WINDOWS
        if not self.active:
            self.active = True
            self.kicks += 1
            self._loop.call_soon(self._spin)

    def _spin(self) -> None:
        self.spins += 1
        now = time.monotonic()
        # Only a send opens a new window: the round's sends are what the poll waits for, and a
        # client's stream of stats or pulls alone must not keep a core busy (review 34a).
        sends = self._counters.send_requests
        if sends != self._seen:  # a send arrived since the last look: a new window
            self._seen = sends
            self._until = now + self._window
            self._limit = now + self._window * MAX_SPIN_WINDOWS
        elif now >= self._until:
            commit = self.commit
            if commit is None or not commit.pending or now >= self._limit:
                self.active = False
                return
        self._loop.call_soon(self._spin)

    def stop(self) -> None:
        """Stop at the next look and never spin again (draining)."""
        self._window = self._until = self._limit = 0.0
        self.commit = None
