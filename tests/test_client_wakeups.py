"""The blocking client's waiting threads against the real broker: an answer wakes the
thread it is for (and the end of a reader's turn one thread to take it), not every
waiting thread; no thread is left asleep with its answer read (many threads mixing
round trips, long polls answered by sends and long polls that time out; a broker
killed under held polls; a thread interrupted in its sleep or as it is handed the
reader's turn)."""

from __future__ import annotations

import _thread
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from client_helpers import BrokerProcess, temporary_broker

import equeue
from equeue.client import sync
from equeue.errors import ConnectionLostError


@pytest.fixture
def broker() -> Iterator[BrokerProcess]:
    with temporary_broker() as running:
        yield running


def _run(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)


def test_an_answer_wakes_its_own_thread_not_every_waiting_one(broker: BrokerProcess) -> None:
    pollers, pingers, calls = 6, 2, 150
    client = equeue.connect(broker.url, timeout=20)
    sleeps: Counter[int] = Counter()
    sleep = client._sleep

    def counted(*args: Any) -> None:
        sleeps[threading.get_ident()] += 1  # (the GIL: += on a Counter is safe here)
        sleep(*args)

    client._sleep = counted  # type: ignore[method-assign,assignment]
    errors: list[BaseException] = []

    def poll(queue_id: int) -> None:
        try:  # held by the broker until the message sent to its queue at the end
            assert len(client.pull("t", queue_id, 0, 1, wait=15.0)) == 1
        except BaseException as exc:
            errors.append(exc)

    def ping() -> None:
        try:
            for _ in range(calls):
                client.ping()
        except BaseException as exc:
            errors.append(exc)

    try:
        client.create_topic("t", pollers)
        held = [threading.Thread(target=poll, args=(q,)) for q in range(pollers)]
        for t in held:
            t.start()
        for _ in range(500):  # (bounded: 10 s) until the broker holds every long poll
            if client.stats()["held_pulls"] == pollers:
                break
            time.sleep(0.02)
        _run([threading.Thread(target=ping) for _ in range(pingers)])
        for q in range(pollers):
            client.send("t", b"wake", queue_id=q)
        for t in held:
            t.join(30)
        assert not any(t.is_alive() for t in held) and not errors, errors
        # While the pings go on, the long polls' threads (but the one reading) sleep: woken
        # at every answer (notify_all), each would go to sleep again once per ping; woken
        # only for their own answer or for the reader's turn, about once in all.
        total = pingers * calls
        assert sum(sleeps.values()) <= 2 * total + 4 * pollers, (sum(sleeps.values()), total)
    finally:
        client.close()


def test_many_threads_mixing_long_polls_and_round_trips_all_get_their_answers(
    broker: BrokerProcess,
) -> None:
    # A lost wake-up leaves a thread asleep until its deadline: ConnectionLostError
    # (timeout=10 s) instead of its answer.
    client = equeue.connect(broker.url, timeout=10)
    client.create_topic("m", 4)
    client.create_topic("e", 4)  # never sent to
    errors: list[BaseException] = []
    got: Counter[str] = Counter()

    def pinger() -> None:
        try:
            for _ in range(100):
                client.ping()
            got["ping"] += 1
        except BaseException as exc:
            errors.append(exc)

    def sender() -> None:
        try:
            for i in range(50):
                client.send("m", b"x", queue_id=i % 4)
            got["send"] += 1
        except BaseException as exc:
            errors.append(exc)

    def empty_poller(queue_id: int) -> None:
        try:
            for _ in range(10):  # waits of 20 ms that end without a message
                assert len(client.pull("e", queue_id, 0, 1, wait=0.02)) == 0
            got["empty"] += 1
        except BaseException as exc:
            errors.append(exc)

    def long_poller(queue_id: int) -> None:
        try:  # held until the sender's first message on its queue
            result = client.pull("m", queue_id, 0, 1, wait=8.0)
            assert len(result) == 1
            got["long"] += 1
        except BaseException as exc:
            errors.append(exc)

    try:
        lanes = [threading.Thread(target=long_poller, args=(q,)) for q in range(4)]
        lanes += [threading.Thread(target=pinger) for _ in range(6)]
        lanes += [threading.Thread(target=empty_poller, args=(q,)) for q in range(4)]
        lanes += [threading.Thread(target=sender) for _ in range(2)]
        _run(lanes)
        assert not errors, errors
        assert got == {"long": 4, "ping": 6, "empty": 4, "send": 2}
        assert sum(client.queue_range("m", q)[1] for q in range(4)) == 100
    finally:
        client.close()


def test_a_broker_killed_under_held_polls_wakes_every_waiting_thread(
    broker: BrokerProcess,
) -> None:
    """Each thread asleep for its answer gets ConnectionLostError from the break, not
    after its own deadline (600 s + its wait: past the 60 s the test waits)."""
    client = equeue.connect(broker.url, timeout=600)
    client.create_topic("k", 6)
    errors: list[BaseException] = []

    def poll(queue_id: int) -> None:
        try:
            client.pull("k", queue_id, 0, 1, wait=20.0)
        except BaseException as exc:
            errors.append(exc)

    try:
        held = [threading.Thread(target=poll, args=(q,), daemon=True) for q in range(6)]
        for t in held:
            t.start()
        for _ in range(500):  # (bounded: 10 s) until the broker holds every long poll
            if client.stats()["held_pulls"] == 6:
                break
            time.sleep(0.02)
        broker.kill()
        end = time.monotonic() + 60
        for t in held:
            t.join(max(0.0, end - time.monotonic()))
        assert not any(t.is_alive() for t in held)
        assert len(errors) == 6 and all(isinstance(e, ConnectionLostError) for e in errors)
        broker.start()
        client.ping()  # the next call reconnects
    finally:
        client.close()


class _Trap:
    """Where the thread named "victim" gets a KeyboardInterrupt (once each): "wait" in its
    timed wait once woken; "released" as _sleep's release of _cond returns; "acquired" as
    its re-acquire returns once woken (CPython checks signals as a call returns);
    "contended" in that acquire before it gets the lock (an acquire is interruptible)."""

    def __init__(self, points: tuple[str, ...]) -> None:
        self.points = set(points)
        self.woken = False
        self.unheld: list[str] = []  # the threads that released _cond without holding it

    def fire(self, point: str) -> bool:
        if point in self.points and threading.current_thread().name == "victim":
            self.points.remove(point)
            return True
        return False


class _Waiter:
    """The victim's sleeper lock (sync.allocate_lock's)."""

    def __init__(self, trap: _Trap) -> None:
        self.lock = _thread.allocate_lock()
        self.trap = trap

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        got = self.lock.acquire(blocking, timeout)
        if timeout != -1 and got:
            self.trap.woken = True
            if self.trap.fire("wait"):
                raise KeyboardInterrupt
        return got

    def release(self) -> None:
        self.lock.release()


class _Cond:
    """The client's _cond (an RLock), raising where the trap says."""

    def __init__(self, trap: _Trap) -> None:
        self.lock = threading.RLock()
        self.trap = trap

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self.trap.woken and self.trap.fire("contended"):
            raise KeyboardInterrupt
        got = self.lock.acquire(blocking, timeout)
        if self.trap.woken and self.trap.fire("acquired"):
            raise KeyboardInterrupt
        return got

    def release(self) -> None:
        if not self.lock._is_owned():  # type: ignore[attr-defined]
            self.trap.unheld.append(threading.current_thread().name)
        self.lock.release()
        if sys._getframe(1).f_code.co_name == "_sleep" and self.trap.fire("released"):
            raise KeyboardInterrupt

    def _is_owned(self) -> bool:
        return bool(self.lock._is_owned())  # type: ignore[attr-defined]

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


@pytest.mark.parametrize(
    "points",
    [("wait",), ("released",), ("acquired",), ("contended",), ("wait", "contended")],
    ids="+".join,
)
def test_a_thread_interrupted_in_its_sleep_passes_the_turn_on(
    broker: BrokerProcess, monkeypatch: pytest.MonkeyPatch, points: tuple[str, ...]
) -> None:
    """The "victim" is interrupted asleep behind "reader" (at "released") or as the reader's
    turn is handed to it: it gets KeyboardInterrupt (not RuntimeError from a release of a
    lock it does not hold), no thread releases _cond unheld, and "last" is handed the turn
    and reads its answer (left asleep, it would wake at its 600 s deadline)."""
    client = equeue.connect(broker.url, timeout=600)
    other = equeue.connect(broker.url)
    client.create_topic("h", 3)
    trap = _Trap(points)
    client._cond = _Cond(trap)  # type: ignore[assignment]
    outcome: dict[str, object] = {}
    real = _thread.allocate_lock

    def allocate() -> Any:
        return _Waiter(trap) if threading.current_thread().name == "victim" else real()

    monkeypatch.setattr(sync, "allocate_lock", allocate)

    def poll(queue_id: int) -> None:
        try:
            outcome[threading.current_thread().name] = len(
                client.pull("h", queue_id, 0, 1, wait=30.0)
            )
        except BaseException as exc:
            outcome[threading.current_thread().name] = exc

    def held(count: int) -> None:
        for _ in range(500):  # (bounded: 10 s)
            if other.stats()["held_pulls"] == count:
                return
            time.sleep(0.02)

    names = ("reader", "victim", "last")
    threads = [threading.Thread(target=poll, args=(q,), name=n, daemon=True)
               for q, n in enumerate(names)]  # fmt: skip
    try:
        for count, t in enumerate(threads, 1):  # in turn: the reader, then two asleep
            t.start()
            held(count)
        other.send("h", b"x", queue_id=0)  # the reader's answer: the turn goes to "victim"
        threads[0].join(20)
        threads[1].join(20)
        assert outcome["reader"] == 1
        assert isinstance(outcome["victim"], KeyboardInterrupt), outcome
        other.send("h", b"x", queue_id=2)  # read only if "last" was handed the turn
        threads[2].join(20)
        assert outcome.get("last") == 1, outcome
        assert not trap.points and not trap.unheld, (trap.points, trap.unheld)
        assert not client._sleepers and not client._reading
    finally:
        client.close()
        other.close()
