"""A KeyboardInterrupt in a thread of the blocking client, wherever CPython may raise it
(in a wait, as a call returns, in an acquire of a contended lock): the thread gets the
KeyboardInterrupt, no lock is released that it does not hold, the reader's turn is
passed on, and no other thread is left asleep past its answer. Stand-in locks and
socket raise it at each point in the thread named "victim"."""

from __future__ import annotations

import _thread
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from client_helpers import BrokerProcess, temporary_broker

import equeue
from equeue.client import turns


@pytest.fixture
def broker() -> Iterator[BrokerProcess]:
    with temporary_broker() as running:
        yield running


class _Trap:
    """Where the thread named "victim" gets a KeyboardInterrupt (once each): "wait" in its
    timed wait once woken; "released" as _sleep's release of _cond returns; "acquired" as
    its re-acquire returns once woken (CPython checks signals as a call returns);
    "contended" in that acquire before it gets the lock (an acquire is interruptible).
    "submit" as the release of _cond returns after its request was registered, before it
    was written. As the reader: "turn" as the release of _cond returns after it took the
    turn; "read" as its read of answers returns; "end" in the acquire that ends its turn."""

    def __init__(self, points: tuple[str, ...], client: Any = None) -> None:
        self.points = set(points)
        self.client = client
        self.woken = False
        self.read = False  # the victim read bytes
        self.unheld: list[str] = []  # the threads that released _cond without holding it

    def fire(self, point: str) -> bool:
        if point in self.points and threading.current_thread().name == "victim":
            self.points.remove(point)
            return True
        return False


class _Waiter:
    """The victim's sleeper lock (turns.allocate_lock's)."""

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
        trap = self.trap
        if trap.woken and trap.fire("contended"):
            raise KeyboardInterrupt
        if trap.read and trap.client._reading:  # (ends the turn, not handing answers in)
            callers = {sys._getframe(depth).f_code.co_name for depth in (1, 2, 3)}
            ending = "_received" not in callers and callers & {"_wait", "_end_turn"}
            if ending and trap.fire("end"):
                raise KeyboardInterrupt
        got = self.lock.acquire(blocking, timeout)
        if self.trap.woken and self.trap.fire("acquired"):
            raise KeyboardInterrupt
        return got

    def release(self) -> None:
        if not self.lock._is_owned():  # type: ignore[attr-defined]
            self.trap.unheld.append(threading.current_thread().name)
        self.lock.release()
        caller = sys._getframe(1).f_code.co_name
        if caller == "__exit__":  # (a with block's end)
            caller = sys._getframe(2).f_code.co_name
        if caller == "_sleep" and self.trap.fire("released"):
            raise KeyboardInterrupt
        if caller == "_submit" and self.trap.fire("submit"):  # (its request registered)
            raise KeyboardInterrupt
        if caller == "_wait" and self.trap.fire("turn"):  # (it leaves the with: its turn)
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

    monkeypatch.setattr(turns, "allocate_lock", allocate)

    def poll(queue_id: int) -> None:
        try:
            outcome[threading.current_thread().name] = len(
                client.pull("h", queue_id, 0, 1, wait=30.0)
            )
        except BaseException as exc:
            outcome[threading.current_thread().name] = exc

    def held(started: list[threading.Thread]) -> None:
        """Until the broker holds a pull of each thread started that is still in it: one
        interrupted before its pull was held ("released") never will be; waiting for it
        cost the full 10 s, twice, for the same state."""
        for _ in range(500):  # (bounded: 10 s)
            if other.stats()["held_pulls"] == sum(t.is_alive() for t in started):
                return
            time.sleep(0.02)

    names = ("reader", "victim", "last")
    threads = [threading.Thread(target=poll, args=(q,), name=n, daemon=True)
               for q, n in enumerate(names)]  # fmt: skip
    try:
        for count, t in enumerate(threads, 1):  # in turn: the reader, then two asleep
            t.start()
            held(threads[:count])
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


class _Sock:
    """The client's socket: records that the victim read bytes."""

    def __init__(self, sock: Any, trap: _Trap) -> None:
        self.sock = sock
        self.trap = trap

    def recv_into(self, buffer: Any) -> int:
        count: int = self.sock.recv_into(buffer)
        if count and threading.current_thread().name == "victim":
            self.trap.read = True
        return count

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


class _IoLock:
    """conn.io_lock (a null context on a plain socket): its exit is the first point
    after the read where CPython checks signals, as recv_into returns ("read")."""

    def __init__(self, trap: _Trap) -> None:
        self.trap = trap

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        if self.trap.read and self.trap.fire("read"):
            raise KeyboardInterrupt


@pytest.mark.parametrize("point", ["turn", "read", "end"])
def test_a_reader_interrupted_hands_in_what_it_read_and_passes_the_turn_on(
    broker: BrokerProcess, point: str
) -> None:
    """The "victim" is handed the reader's turn; interrupted as it takes it ("turn"), as
    its read of "last"'s answer returns ("read"), or as it ends its turn after handing
    that answer in ("end"). "last" gets its answer (not left asleep to its 600 s
    deadline), and a later call is answered (the turn not left taken)."""
    client = equeue.connect(broker.url, timeout=600)
    other = equeue.connect(broker.url)
    client.create_topic("r", 3)
    trap = _Trap((point,), client)
    client._cond = _Cond(trap)  # type: ignore[assignment]
    conn = client._conn
    assert conn is not None
    conn.sock = _Sock(conn.sock, trap)  # type: ignore[assignment]
    conn.io_lock = _IoLock(trap)
    outcome: dict[str, object] = {}

    def poll(queue_id: int) -> None:
        name = threading.current_thread().name
        try:
            outcome[name] = len(client.pull("r", queue_id, 0, 1, wait=30.0))
        except BaseException as exc:
            outcome[name] = exc

    def held(count: int) -> None:
        for _ in range(500):  # (bounded: 10 s)
            if other.stats()["held_pulls"] == count:
                return
            time.sleep(0.02)

    threads = [threading.Thread(target=poll, args=(q,), name=n, daemon=True)
               for q, n in enumerate(("reader", "victim", "last"))]  # fmt: skip
    try:
        for count, t in enumerate(threads, 1):
            t.start()
            held(count)
        other.send("r", b"x", queue_id=0)  # the reader's answer: the turn goes to "victim"
        threads[0].join(20)
        assert outcome.get("reader") == 1, outcome
        if point != "turn":  # the victim reads on, in recv, for its own answer
            for _ in range(500):  # (bounded: 10 s) until it took the turn
                if client._reading:
                    break
                time.sleep(0.02)
        other.send("r", b"x", queue_id=2)  # "last"'s answer
        threads[2].join(20)
        threads[1].join(20)
        assert isinstance(outcome.get("victim"), KeyboardInterrupt), outcome
        assert outcome.get("last") == 1, outcome
        assert not trap.points and not trap.unheld, (trap.points, trap.unheld)
        pinged: list[int] = []
        later = threading.Thread(target=lambda: pinged.append(len(client.topics())), daemon=True)
        later.start()
        later.join(20)
        assert pinged == [1]
        assert not client._sleepers and not client._reading
    finally:
        client.close()
        other.close()


def test_a_thread_interrupted_before_its_request_is_written_leaves_no_orphan(
    broker: BrokerProcess,
) -> None:
    """An interrupt between the registering of a request and its writing: nothing waits
    for that request, which the broker never got; left registered it would count against
    max_in_flight and, at its deadline, close the connection as "no answer"."""
    client = equeue.connect(broker.url, timeout=600)
    trap = _Trap(("submit",), client)
    client._cond = _Cond(trap)  # type: ignore[assignment]
    outcome: list[BaseException] = []

    def victim() -> None:
        try:
            client.ping()
        except BaseException as exc:
            outcome.append(exc)

    try:
        thread = threading.Thread(target=victim, name="victim", daemon=True)
        thread.start()
        thread.join(20)
        assert len(outcome) == 1 and isinstance(outcome[0], KeyboardInterrupt), outcome
        assert not trap.points and not trap.unheld
        conn = client._conn
        assert conn is None or not conn.pending  # (closed, its request failed, or none)
        assert client.topics() == []  # the next call goes on (reconnecting)
    finally:
        client.close()


class _EntryTrap:
    """A KeyboardInterrupt at the entry of the function named ``name`` (once), in the
    thread it is set in: CPython raises a pending SIGINT at every function's RESUME, before
    its body runs; a trace function raising on the "call" event models that point."""

    def __init__(self, name: str, after: str = "") -> None:
        self.name = name
        self.after = after  # (name ""): at the first function entered after this one's
        self.fired = 0

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event != "call" or self.fired:
            return
        name = frame.f_code.co_name
        if self.after and name == self.after:
            self.after = ""
        elif not self.after and (name == self.name or not self.name):
            self.fired = 1
            raise KeyboardInterrupt

    def run(self, call: Any) -> BaseException | None:
        sys.settrace(self)
        try:
            call()
        except BaseException as exc:
            return exc
        finally:
            sys.settrace(None)
        return None


def _polling(
    client: Any, topic: str, queue_id: int, wait: float, name: str
) -> tuple[threading.Thread, dict[str, BaseException | None]]:
    """A thread long-polling ``topic``'s queue; ``outcome[name]``: None or what it raised."""

    def poll() -> None:
        try:
            client.pull(topic, queue_id, 0, 1, None, wait)
            outcome[name] = None
        except BaseException as exc:
            outcome[name] = exc

    outcome: dict[str, BaseException | None] = {}
    thread = threading.Thread(target=poll, name=name, daemon=True)
    thread.start()
    return thread, outcome


def _until(ready: Any) -> bool:
    for _ in range(200):  # (bounded: 10 s)
        if ready():
            return True
        time.sleep(0.05)
    return False


def test_an_interrupt_at_the_entry_of_end_turn_gives_the_turn_up(broker: BrokerProcess) -> None:
    """The reader's turn is given up even if the interrupt lands before the function
    ending it runs: left taken, every later call on every thread waited out its timeout."""
    client = equeue.connect(broker.url, timeout=600)
    try:
        client.create_topic("t", 1)
        trap = _EntryTrap("_end_turn")
        failure = trap.run(lambda: client.send("t", b"x"))
        assert trap.fired and isinstance(failure, KeyboardInterrupt), failure
        assert not client._reading
        done: list[int] = []

        def ping() -> None:
            client.ping()
            done.append(1)

        thread = threading.Thread(target=ping, daemon=True)
        thread.start()
        thread.join(20)
        assert done == [1]
        assert client.topics() == ["t"]
    finally:
        client.close()


def test_a_break_interrupted_midway_fails_the_waiting_request(broker: BrokerProcess) -> None:
    """An interrupt inside the closing of a connection (at the entry of the socket's
    close): the thread waiting for its answer on it gets ConnectionLostError; it looped
    at 100 % CPU on the broken connection before (the requests were failed after it)."""
    client = equeue.connect(broker.url, timeout=600)
    try:
        client.create_topic("t", 1)
        thread, thread_out = _polling(client, "t", 0, 3.0, "poll")
        assert _until(lambda: client._conn is not None and client._conn.pending)
        conn = client._conn
        assert conn is not None
        trap = _EntryTrap("close")  # (the socket's: the requests are failed before it)
        interrupt = trap.run(lambda: client._break(conn, "broke (test)", None))
        assert trap.fired and isinstance(interrupt, KeyboardInterrupt), interrupt
        thread.join(20)
        assert not thread.is_alive()
        failure = thread_out["poll"]
        assert isinstance(failure, equeue.ConnectionLostError), failure
        assert client.topics() == ["t"]  # the next call reconnects
    finally:
        client.close()


def test_an_interrupt_as_a_woken_sleeper_retakes_the_lock(broker: BrokerProcess) -> None:
    """An interrupt at the entry of the first function a sleeper calls once woken (it was
    _hold, which took _cond again): the caller gets KeyboardInterrupt (a RuntimeError for
    releasing a lock it did not hold, before), its sleeper is not left registered, and
    the reader goes on."""
    client = equeue.connect(broker.url, timeout=600)
    try:
        client.create_topic("t", 1)
        reader, reader_out = _polling(client, "t", 0, 2.0, "reader")
        assert _until(lambda: client._reading)  # the reader holds the turn in its long poll
        trap = _EntryTrap("", after="_sleep")
        failure = trap.run(client.ping)
        assert trap.fired and isinstance(failure, KeyboardInterrupt), repr(failure)
        reader.join(20)
        assert reader_out == {"reader": None}
        assert not client._sleepers and not client._reading
        assert client.topics() == ["t"]
    finally:
        client.close()


def test_a_request_left_undone_on_a_broken_connection_fails(broker: BrokerProcess) -> None:
    """A sleeper whose request is left undone on a connection marked broken (what a
    close cut short leaves): it gets ConnectionLostError with its request as unanswered,
    where it looped at 100 % CPU before (taking the turn, reading nothing, again)."""
    client = equeue.connect(broker.url, timeout=600)
    try:
        client.create_topic("u", 2)
        reader, _ = _polling(client, "u", 0, 2.0, "reader")
        assert _until(lambda: client._reading)  # the reader holds the turn
        sleeper, sleeper_out = _polling(client, "u", 1, 2.0, "sleeper")
        assert _until(lambda: client._sleepers)  # asleep behind it
        conn = client._conn
        assert conn is not None and client._sleepers
        with client._cond:  # broken, its requests not failed, the sleeper woken
            conn.broken = True
            for waiter in client._sleepers.values():
                waiter.release()
            client._sleepers.clear()
        sleeper.join(20)
        reader.join(20)
        assert not sleeper.is_alive() and not reader.is_alive()
        failure = sleeper_out["sleeper"]
        assert isinstance(failure, equeue.ConnectionLostError), failure
        assert failure.unanswered == []  # (a pull: no messages of the caller's)
    finally:
        client.close()


def test_an_interrupt_at_the_entry_of_the_break_after_a_cut_write_leaves_no_orphan(
    broker: BrokerProcess,
) -> None:
    """An interrupt after the request was registered (its write not done), then another
    at the entry of the close that follows: the close is done anyway, so no request is
    left registered on a connection still in use."""
    client = equeue.connect(broker.url, timeout=600)
    trap = _Trap(("submit",), client)
    client._cond = _Cond(trap)  # type: ignore[assignment]
    outcome: list[BaseException | None] = []

    def victim() -> None:
        outcome.append(_EntryTrap("_break").run(client.ping))

    try:
        conn = client._conn
        assert conn is not None
        thread = threading.Thread(target=victim, name="victim", daemon=True)
        thread.start()
        thread.join(20)
        assert len(outcome) == 1 and isinstance(outcome[0], KeyboardInterrupt), outcome
        assert not trap.points
        assert conn.broken and not conn.pending
        assert client.topics() == []  # the next call goes on (reconnecting)
    finally:
        client.close()
