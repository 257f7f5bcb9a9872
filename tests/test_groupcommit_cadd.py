"""The group commit's add in C (cext/commitadd.c, what the send lane calls) against the
Python add (equeue/server/groupcommit.py) as the model: the same sequences of adds, flush
ends (ok or failed), bounds passing, drains give the same state, the same flusher calls
(start, arm, disarm) and the same released batches. C adds only where the Python add
would decide nothing; the tests also check that it did add some, and that a subclass
changing the policy always gets its own add."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from equeue import speedups
from equeue.server import groupcommit
from equeue.server.groupcommit import CrossClientCommit, Entry

fast = speedups.SPEEDUPS
pytestmark = pytest.mark.skipif(fast is None, reason="needs the C accelerator")

# every slot but the loop, the callables and the Event: what a decision depends on or moves
STATE = tuple(
    name
    for name in CrossClientCommit.__slots__
    if name
    not in ("_loop", "_flush_log", "_release_batch", "_sync", "_released_one", "__weakref__")
)


class Clock:
    """groupcommit's time: _overlap reads time.monotonic(); both commits see one clock."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


class FakeSync:
    """The flusher: its calls logged, the bound's callback kept for the test to fire."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.expired: Callable[[], None] | None = None
        self.ended = 0
        self.synced_s = self.woke_s = 0.0

    def start(self) -> None:
        self.calls.append(("start",))

    def arm(self, seconds: float, expired: Callable[[], None]) -> None:
        self.calls.append(("arm", seconds))
        self.expired = expired

    def disarm(self) -> None:
        self.calls.append(("disarm",))
        self.expired = None

    def close(self) -> None:
        self.calls.append(("close",))


class Peer:
    def __init__(self, name: str) -> None:
        self.name = name

    def finish(self, request_id: int, outcome: object) -> None:
        raise AssertionError("the test's release records the batches")


def make(
    loop: asyncio.AbstractEventLoop, wait_us: int, per: float, overlap: float,
    cls: type[CrossClientCommit] = CrossClientCommit,
) -> tuple[CrossClientCommit, FakeSync, list[tuple[list[Entry], str | None]]]:  # fmt: skip
    released: list[tuple[list[Entry], str | None]] = []

    def release(batch: list[Entry], error: BaseException | None) -> None:
        released.append((list(batch), None if error is None else str(error)))

    commit = cls(loop, lambda: None, release, wait_us, per, overlap)
    commit._sync.close()  # the ThreadSync it made (no store: not the C flusher)
    commit._sync = sync = FakeSync()
    return commit, sync, released


def state(commit: CrossClientCommit) -> dict[str, Any]:
    got = {name: getattr(commit, name) for name in STATE}
    got["_waiting"] = list(commit._waiting)
    got["_flushing"] = None if commit._flushing is None else list(commit._flushing)
    return got


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    try:
        yield loop
    finally:
        loop.close()


class CommitMachine(RuleBasedStateMachine):
    """Two commits, the model driven by its Python add, the other by commit_add."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.clock = Clock()
        self.saved_time = vars(groupcommit)["time"]
        setattr(groupcommit, "time", self.clock)  # noqa: B010  # (mypy: not exported)
        self.peers = [Peer(f"p{i}") for i in range(4)]
        self.request = 0
        self.in_c = 0
        self.pairs: list[Any] = []

    @precondition(lambda self: not self.pairs)
    @rule(
        wait_us=st.sampled_from([0, 300, 60_000_000]),
        per=st.sampled_from([0.0, 2.0, 1e12]),
        overlap=st.sampled_from([0.0, 1.0, 4.0]),
    )
    def configure(self, wait_us: int, per: float, overlap: float) -> None:
        self.pairs = [make(self.loop, wait_us, per, overlap) for _ in range(2)]

    @precondition(lambda self: bool(self.pairs))
    @rule(
        peers=st.lists(st.integers(0, 3), min_size=1, max_size=4),
        messages=st.sampled_from([1, 1, 1, 40]),
    )
    def add(self, peers: list[int], messages: int) -> None:  # a burst: one add a peer
        (model, _, _), (c, _, _) = self.pairs
        assert fast is not None
        for peer in peers:
            self.request += 1
            args = (self.peers[peer], self.request, f"r{self.request}")
            model.add(*args, messages)
            self.in_c += fast.commit_add(c, *args, messages)

    @precondition(lambda self: bool(self.pairs) and self.pairs[0][0]._flushing is not None)
    @rule(
        took=st.sampled_from([0.0, 0.0001, 0.002]), fail=st.integers(0, 7), step=st.floats(0, 0.01)
    )
    def flush_ends(self, took: float, fail: int, step: float) -> None:
        self.clock.now += step
        for commit, _, _ in self.pairs:  # (1 in 8 fails: a failure drops the expectation)
            commit._released(OSError(5, "EIO from the test") if fail == 0 else None, took)

    @precondition(lambda self: bool(self.pairs) and self.pairs[0][1].expired is not None)
    @rule()
    def bound_passes(self) -> None:
        for _, sync, _ in self.pairs:
            expired, sync.expired = sync.expired, None
            assert expired is not None
            expired()

    @precondition(lambda self: bool(self.pairs))
    @rule(step=st.floats(0, 0.005))
    def time_passes(self, step: float) -> None:
        self.clock.now += step

    @precondition(lambda self: bool(self.pairs) and not self.pairs[0][0]._hurry)
    @rule(now=st.integers(0, 9))
    def drain_begins(self, now: int) -> None:  # drain()'s first step, without its await
        if now:  # (1 in 10: no wait after it)
            return
        for commit, _, _ in self.pairs:
            commit._hurry = True
            if commit._flushing is None and commit._due():
                commit._start()

    @precondition(lambda self: bool(self.pairs) and not self.pairs[0][0]._closing)
    @rule(now=st.integers(0, 9))
    def close(self, now: int) -> None:  # (1 in 10)
        if now:
            return
        for commit, _, _ in self.pairs:
            commit.close()

    @invariant()
    def the_same(self) -> None:
        if not self.pairs:
            return
        (model, model_sync, model_released), (c, c_sync, c_released) = self.pairs
        assert state(c) == state(model)
        assert c_sync.calls == model_sync.calls
        assert c_released == model_released

    def teardown(self) -> None:
        setattr(groupcommit, "time", self.saved_time)  # noqa: B010
        self.loop.close()


CommitMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
test_c_add_makes_the_python_adds_decisions = CommitMachine.TestCase


def test_c_adds_while_a_flush_is_in_progress_or_the_bound_armed(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """Not vacuous: the machine's agreement could come from C always handing over."""
    assert fast is not None
    commit, sync, released = make(loop, 60_000_000, 1e12, 0.0)
    a, b, c, d = (Peer(name) for name in "abcd")
    assert not fast.commit_add(commit, a, 1, "r1", 1)  # starts a flush: Python's
    assert sync.calls == [("start",)]
    for peer, rid in ((b, 2), (c, 3), (d, 4)):  # a flush in progress: C's
        assert fast.commit_add(commit, peer, rid, f"r{rid}", 1)
    assert commit._waiting == [(b, 2, "r2"), (c, 3, "r3"), (d, 4, "r4")]
    assert commit._messages == 3 and commit._arrived == 4
    commit._released(None, 0.001)  # a answered; b, c, d's flush started before it
    assert released == [([(a, 1, "r1")], None)] and sync.calls == [("start",)] * 2
    commit._released(None, 0.001)  # three connections answered: three sends expected
    assert commit.expecting == 3
    assert not fast.commit_add(commit, b, 5, "r5", 1)  # arms the bound: Python's
    assert sync.calls[-1] == ("arm", 60.0) and commit.waits == 1
    assert fast.commit_add(commit, c, 6, "r6", 1)  # the bound armed, 1 still expected: C's
    assert commit.expecting == 1 and commit._waiting == [(b, 5, "r5"), (c, 6, "r6")]
    assert not fast.commit_add(commit, d, 7, "r7", 1)  # the count reached: Python starts
    assert sync.calls[-2:] == [("disarm",), ("start",)]
    assert commit.waits == commit.waits_full == 1 and commit._flushing is not None
    assert len(commit._flushing) == 3 and commit._waiting == []


def test_a_count_past_c_long_long_is_not_wrapped(loop: asyncio.AbstractEventLoop) -> None:
    # review 34a: the sum was not checked, so a huge count stored a wrapped negative
    assert fast is not None
    commit, _, _ = make(loop, 60_000_000, 1e12, 0.0)
    fast.commit_add(commit, Peer("a"), 1, "r1", 1)  # starts a flush: then C adds
    commit._messages = (1 << 62) - 1
    fast.commit_add(commit, Peer("b"), 2, "r2", (1 << 63) - 1)
    assert commit._messages == (1 << 62) - 1 + (1 << 63) - 1


def test_a_subclass_changing_the_policy_gets_its_own_add(loop: asyncio.AbstractEventLoop) -> None:
    assert fast is not None

    class Counting(CrossClientCommit):
        __slots__ = ("adds",)

        def add(self, peer: Any, request_id: int, result: object, messages: int = 1) -> None:
            self.adds = getattr(self, "adds", 0) + 1
            super().add(peer, request_id, result, messages)

    class Eager(CrossClientCommit):
        __slots__ = ()

        def _due(self) -> bool:
            return bool(self._waiting) and not self._closing

    class Same(CrossClientCommit):
        __slots__ = ()

    counting, _, _ = make(loop, 60_000_000, 1e12, 0.0, Counting)
    assert isinstance(counting, Counting)
    fast.commit_add(counting, Peer("a"), 1, "r1", 1)  # a flush in progress from here
    assert not fast.commit_add(counting, Peer("b"), 2, "r2", 1)
    assert counting.adds == 2
    eager, _, _ = make(loop, 60_000_000, 1e12, 0.0, Eager)
    fast.commit_add(eager, Peer("a"), 1, "r1", 1)
    assert not fast.commit_add(eager, Peer("b"), 2, "r2", 1)
    same, _, _ = make(loop, 60_000_000, 1e12, 0.0, Same)
    fast.commit_add(same, Peer("a"), 1, "r1", 1)
    assert fast.commit_add(same, Peer("b"), 2, "r2", 1)


def test_a_commit_without_the_slots_gets_its_add_called(loop: asyncio.AbstractEventLoop) -> None:
    """(a test's stand-in commit, or another type: the send lane calls its add)"""
    assert fast is not None
    calls: list[tuple[Any, ...]] = []

    class Spy:
        def add(self, *args: Any) -> None:
            calls.append(args)

    peer = Peer("a")
    assert not fast.commit_add(Spy(), peer, 7, "r", 1)
    assert calls == [(peer, 7, "r", 1)]


def counting_add(calls: list[int]) -> Callable[..., None]:
    """CrossClientCommit's add, each request id noted in calls first."""
    original = CrossClientCommit.add

    def counting(self: Any, peer: Any, request_id: int, result: object, messages: int = 1) -> None:
        calls.append(request_id)
        original(self, peer, request_id, result, messages)

    return counting


def test_an_add_patched_on_the_class_after_it_was_made_is_called(
    loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The C add mirrors CrossClientCommit's own add and _due: replaced on the class (or a
    base) after the class and the commit were made, each add is the replacement's; put
    back, C adds again."""
    assert fast is not None
    calls: list[int] = []
    counting = counting_add(calls)

    def due(self: Any) -> bool:
        calls.append(0)
        return original_due(self)

    original_due = CrossClientCommit._due

    class Same(CrossClientCommit):
        __slots__ = ()

    for cls in (CrossClientCommit, Same):
        for patched in ("add", "_due"):
            calls.clear()
            commit, _, _ = make(loop, 60_000_000, 1e12, 0.0, cls)
            fast.commit_add(commit, Peer("a"), 1, "r1", 1)  # a flush in progress from here
            assert fast.commit_add(commit, Peer("b"), 2, "r2", 1)  # C's
            if patched == "add":
                monkeypatch.setattr(CrossClientCommit, "add", counting)
            else:
                monkeypatch.setattr(CrossClientCommit, "_due", due)
            assert not fast.commit_add(commit, Peer("c"), 3, "r3", 1)  # the class's
            assert calls == ([3] if patched == "add" else [])  # (_due: not asked mid-flush)
            monkeypatch.undo()
            assert fast.commit_add(commit, Peer("d"), 4, "r4", 1)  # C's again
            assert [rid for _, rid, _ in commit._waiting] == [2, 3, 4]


def test_the_brokers_lane_calls_an_add_patched_after_it_was_made(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The send lane (sendlane.c) finds the commit's slots when a connection is made: an
    add set on the class later is still the one called, for every send, and C adds again
    once it is removed (a real BrokerThread under --flush sync, 8 asyncio connections
    each one send at a time, so that adds find a flush in progress)."""
    import equeue.aio
    from equeue.server import BrokerThread

    assert fast is not None
    calls: list[int] = []
    counting = counting_add(calls)

    async def sends(url: str, each: int) -> int:
        clients = [await equeue.aio.connect(url) for _ in range(8)]
        try:

            async def one(client: Any) -> None:
                for n in range(each):
                    await client.send("t", b"%d" % n)

            before = fast.commit_adds_in_c()
            await asyncio.wait_for(asyncio.gather(*(one(c) for c in clients)), 60)
            return int(fast.commit_adds_in_c() - before)
        finally:
            for client in clients:
                await client.close()

    base = tmp_path_factory.mktemp("lane")
    with BrokerThread(base / "s", flush="sync", listen=[f"unix:{base}/b.sock"]) as broker:
        broker.store.create_topic("t", 4)
        url = broker.urls[0]
        assert asyncio.run(sends(url, 50)) > 0  # C adds before
        monkeypatch.setattr(CrossClientCommit, "add", counting)
        in_c = asyncio.run(sends(url, 50))
        assert in_c == 0 and len(calls) == 8 * 50
        monkeypatch.undo()
        assert asyncio.run(sends(url, 50)) > 0  # and again after
