"""The end of a group commit's flush in C (cext/flushend.c's Released, the flusher's done)
against CrossClientCommit._released as the model: test_groupcommit_cadd's machine with
every flush end of its second commit made by Released (its adds by C's commit_add) gives
the same state, flusher calls and released batches after every step. Then that C did end
flushes (the agreement is not C always handing over), that a subclass overriding
_released gets it called, that a release raising an Exception is logged and the next
flush still starts, that a BaseException gets out as from _released, and that a real
broker's flushes end in C."""

from __future__ import annotations

import asyncio
import logging
import shutil
import threading

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule
from server_helpers import short_dir
from test_groupcommit_cadd import CommitMachine, Peer, make

from equeue import speedups
from equeue.server import groupcommit
from equeue.server.groupcommit import CrossClientCommit, Entry
from equeue.server.serve import BrokerThread

fast = speedups.SPEEDUPS
pytestmark = pytest.mark.skipif(fast is None, reason="needs the C accelerator")


class EndMachine(CommitMachine):
    """CommitMachine, the second commit's flush ends by Released."""

    @precondition(lambda self: bool(self.pairs) and self.pairs[0][0]._flushing is not None)
    @rule(
        took=st.sampled_from([0.0, 0.0001, 0.002]), fail=st.integers(0, 7), step=st.floats(0, 0.01)
    )
    def flush_ends(self, took: float, fail: int, step: float) -> None:
        assert fast is not None
        self.clock.now += step
        (model, _, _), (c, _, _) = self.pairs
        error = OSError(5, "EIO from the test") if fail == 0 else None
        model._released(error, took)
        fast.Released(c, groupcommit._release_failed)(error, took)


EndMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
test_c_flush_end_makes_the_python_released_decisions = EndMachine.TestCase


def test_the_common_flush_end_is_made_in_c() -> None:
    """Not vacuous: a flush's end with sends expected, and one with sends waiting, in C."""
    assert fast is not None
    loop = asyncio.new_event_loop()
    try:
        commit, sync, released = make(loop, 60_000_000, 1e12, 0.0)
        done = fast.Released(commit, groupcommit._release_failed)
        assert done.in_c
        a, b, c = (Peer(name) for name in "abc")
        commit.add(a, 1, "r1")  # starts a flush
        commit.add(b, 2, "r2")
        commit.add(c, 3, "r3")  # b's and c's wait for the next
        before = fast.flush_ends_in_c()
        done(None, 0.001)  # a's released; b's and c's started
        assert fast.flush_ends_in_c() == before + 1
        assert released == [([(a, 1, "r1")], None)] and sync.calls == [("start",)] * 2
        assert commit.flushes == 1 and commit.sends_flushed == 1 and commit._took == 0.001
        done(None, 0.002)  # two connections answered: two sends expected, nothing waits
        assert fast.flush_ends_in_c() == before + 2
        assert commit.expecting == 2 and commit._flushing is None and commit._arrived == 0
        assert sync.calls == [("start",)] * 2 and commit.flushes == 2
        assert released[-1] == ([(b, 2, "r2"), (c, 3, "r3")], None)
    finally:
        loop.close()


def test_a_subclass_overriding_released_gets_it_called() -> None:
    assert fast is not None
    calls: list[tuple[BaseException | None, float]] = []

    class Own(CrossClientCommit):
        def _released(self, error: BaseException | None, took: float) -> None:
            calls.append((error, took))
            super()._released(error, took)

    loop = asyncio.new_event_loop()
    try:
        commit, _, released = make(loop, 0, 2.0, 0.0, Own)
        done = fast.Released(commit, groupcommit._release_failed)
        assert not done.in_c
        commit.add(Peer("a"), 1, "r1")
        done(None, 0.001)
        assert calls == [(None, 0.001)] and len(released) == 1
    finally:
        loop.close()


def _raising_commit(
    loop: asyncio.AbstractEventLoop, raised: BaseException
) -> tuple[CrossClientCommit, list[str], list[list[Entry]]]:
    """A commit whose release raises ``raised`` the first time."""
    commit, sync, _ = make(loop, 0, 2.0, 0.0)
    batches: list[list[Entry]] = []

    def release(batch: list[Entry], error: BaseException | None) -> None:
        batches.append(list(batch))
        if len(batches) == 1:
            raise raised

    commit._release_batch = release
    return commit, [c[0] for c in sync.calls], batches


def test_a_release_raising_is_logged_and_the_next_flush_starts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert fast is not None
    loop = asyncio.new_event_loop()
    try:
        commit, _, batches = _raising_commit(loop, ValueError("a defect in a release"))
        done = fast.Released(commit, groupcommit._release_failed)
        a, b = Peer("a"), Peer("b")
        commit.add(a, 1, "r1")
        commit.add(b, 2, "r2")  # waits for the next flush
        before = fast.flush_ends_in_c()
        with caplog.at_level(logging.ERROR, logger="equeue.server"):
            done(None, 0.001)  # b's flush starts before a's release raises
        assert fast.flush_ends_in_c() == before + 1
        assert batches == [[(a, 1, "r1")]] and commit._flushing == [(b, 2, "r2")]
        (record,) = [r for r in caplog.records if "durable answers failed" in r.message]
        assert record.message == "releasing 1 durable answers failed"
        assert record.exc_info is not None and str(record.exc_info[1]) == "a defect in a release"
        done(None, 0.001)
        assert batches[-1] == [(b, 2, "r2")] and commit.flushes == 2
    finally:
        loop.close()


def test_a_base_exception_from_a_release_gets_out_as_from_released() -> None:
    assert fast is not None
    loop = asyncio.new_event_loop()
    try:
        for end in ("python", "c"):
            commit, _, batches = _raising_commit(loop, KeyboardInterrupt())
            commit.add(Peer("a"), 1, "r1")
            with pytest.raises(KeyboardInterrupt):
                if end == "c":
                    fast.Released(commit, groupcommit._release_failed)(None, 0.001)
                else:
                    commit._released(None, 0.001)
            assert len(batches) == 1 and commit.flushes == 1 and commit._flushing is None
    finally:
        loop.close()


def test_a_brokers_durable_sends_end_their_flushes_in_c() -> None:
    """The broker's flusher calls Released (its CSync's done): a real broker's flush ends
    go through C, and every send is answered."""
    from equeue.client import connect

    assert fast is not None
    directory = short_dir()
    try:
        with BrokerThread(directory / "s", flush="sync") as broker:
            before = fast.flush_ends_in_c()
            answered: list[int] = []

            def sender(n: int) -> None:
                with connect(broker.urls[0]) as client:
                    for i in range(20):
                        client.send("t", b"x%d" % (n * 100 + i))
                answered.append(n)

            threads = [threading.Thread(target=sender, args=(n,)) for n in range(4)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
            assert sorted(answered) == [0, 1, 2, 3]
            assert fast.flush_ends_in_c() > before
    finally:
        shutil.rmtree(directory, ignore_errors=True)
