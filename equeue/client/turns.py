"""The reader's turn of the blocking client (equeue.client.sync): threads waiting behind
the reader sleep, each on a lock of its own, and the turn is passed on when it ends.

A mixin of sync.Client (its methods are the client's, called as before): the part of
the client that must hold whatever a KeyboardInterrupt does, wherever it lands (hence
the inline loops, not helper calls: an interrupt at a function's entry would leave the
lock or the turn taken). The state is the client's: ``_cond`` guards ``_sleepers`` (the
sleeping threads, by the slot each waits for; None: the writer waiting for a place in
max_in_flight) and ``_reading`` (a thread has the reader's turn).
"""

from __future__ import annotations

import threading
import time
from _thread import LockType, allocate_lock
from typing import TYPE_CHECKING

from equeue.client.inflight import _Connection, _Slot

# A thread asleep behind the reader looks again this often (seconds) whether the turn is
# free: an interrupt at the entry of _end_turn or _hand_over gives the turn up without
# waking anyone, and the answers may then sit unread until each sleeper's deadline.
TURN_CHECK = 1.0


class Turns:
    _cond: threading.RLock
    _reading: bool
    _sleepers: dict[_Slot | None, LockType]

    if TYPE_CHECKING:

        def _expire(self, conn: _Connection, slot: _Slot) -> None: ...

    def _doze(self, conn: _Connection, due: _Slot, slot: _Slot | None) -> None:
        """Another thread reads: sleep (for ``slot``, see _sleep) until ``due``'s deadline
        (at most TURN_CHECK at a time), or close the connection if it passed."""
        remaining = due.deadline - time.monotonic()
        if remaining <= 0:
            self._expire(conn, due)
        else:
            self._sleep(slot, remaining if remaining < TURN_CHECK else TURN_CHECK)

    def _sleep(self, slot: _Slot | None, seconds: float) -> None:
        """Sleep (self._cond held, released meanwhile) until woken for ``slot`` (None:
        for a place in max_in_flight), or for the reader's turn, or ``seconds`` passed.

        A KeyboardInterrupt may land anywhere here: in the wait, as a call returns (just
        after the release, just after the re-acquire) or in an acquire of a contended
        ``_cond`` (which then is not held). Whatever happens, this returns or raises with
        ``_cond`` held by this thread exactly once (the caller's ``with`` releases it), its
        waiter no longer registered, and the reader's turn passed on if it came to this
        thread: the other sleepers' answers may already be in the socket."""
        waiter = allocate_lock()
        waiter.acquire()
        sleepers = self._sleepers
        sleepers[slot] = waiter
        cond = self._cond
        failure: BaseException | None = None
        try:
            cond.release()
            waiter.acquire(True, seconds)
        except BaseException as exc:
            failure = exc
        while True:  # (inline: an interrupt at a function's entry would leave _cond free)
            try:
                if not cond._is_owned():  # type: ignore[attr-defined]
                    cond.acquire()  # (a contended acquire raises without it: again)
                    continue
                if sleepers.get(slot) is waiter:  # the time ran out, or interrupted
                    del sleepers[slot]
                break
            except BaseException as exc:
                if failure is None:
                    failure = exc
        if failure is not None:
            if not self._reading:  # the turn may have come to this thread
                self._hand_over()
            raise failure

    def _end_turn(self) -> None:
        """The reader's turn (this thread's) was given up (``_reading`` reset by the
        caller, inline: an interrupt at this function's entry must not leave it taken):
        pass it on, also when an interrupt lands here (raised after). An interrupt at the
        entry of this one (or of _hand_over) wakes no one: the sleepers take the turn when
        they look again (TURN_CHECK)."""
        cond = self._cond
        failure: BaseException | None = None
        while True:  # (inline: a function's entry here would leave _cond unheld)
            try:
                if cond._is_owned():  # type: ignore[attr-defined]
                    break
                cond.acquire()
            except BaseException as exc:  # (held or not: _is_owned knows)
                if failure is None:
                    failure = exc
        try:
            if self._sleepers:
                self._hand_over()
        finally:
            cond.release()
        if failure is not None:
            raise failure

    def _hand_over(self) -> None:
        """The reader's turn ended (self._cond held): wake one thread still waiting for
        its answer to take the turn, and the writer waiting for a place (if any), which
        may take it instead or go on once there is room."""
        sleepers = self._sleepers
        if not sleepers:
            return
        writer = sleepers.pop(None, None)
        if writer is not None:
            writer.release()
        if sleepers:
            first = next(iter(sleepers))
            sleepers.pop(first).release()
