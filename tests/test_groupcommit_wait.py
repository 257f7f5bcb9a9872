"""The group commit's wait (equeue/server/groupcommit.py, ``group_commit_wait_us``): after a
flush that answered several connections, the next fdatasync waits for as many sends to come
back, bounded; never for a lone sender; drain and close cut it short.

Deterministic: the simulated connections send again from their answer, on the loop, and
the bound is 60 s where a test needs the wait to end only by its count (or by drain/close),
so the flush counts depend on the logic, not on timing; every wait in a test is bounded
(asyncio.wait_for), so a flusher that waits wrongly fails the test instead of hanging it."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from test_groupcommit_order import _until

import equeue
from equeue.errors import ConfigError
from equeue.server import BrokerThread
from equeue.server.config import BrokerFlush, ServerConfig
from equeue.server.groupcommit import CrossClientCommit, expected

LONG_US = 60_000_000  # a bound no test reaches: its wait ends by count, drain or close
LIMIT_S = 20.0


def _commit(flush_log: Callable[[], None], wait_us: int, overlap: float = 0) -> CrossClientCommit:
    # not bounded by the fake flush's duration, only by wait_us
    return CrossClientCommit(
        asyncio.get_running_loop(),
        flush_log,
        wait_us=wait_us,
        wait_per_fdatasync=1e12,
        overlap_per_fdatasync=overlap,
    )


class Flushes:
    """A flush_log counting its calls and the sends each covered."""

    def __init__(self) -> None:
        self.calls = 0
        self.appended = 0  # sends added so far (the loop's count)
        self.covered: list[int] = []  # per flush: sends appended before it started
        self.lock = threading.Lock()
        self.fail = False

    def __call__(self) -> None:
        with self.lock:
            self.calls += 1
            self.covered.append(self.appended)
        if self.fail:
            raise OSError(5, "EIO from the test")


class Sender:
    """A connection with one send in flight (or several): each answer makes it send again,
    ``sends`` times in all (as a durable producer does), ``delay`` seconds after the answer
    (the round trip: spread over the connections, their sends come back one by one)."""

    def __init__(
        self,
        commit: CrossClientCommit,
        flushes: Flushes,
        sends: int,
        delay: float = 0.0,
        spread: int = 1,
    ) -> None:
        self.commit = commit
        self.flushes = flushes
        self.total = sends
        self.sent = 0  # sends made or scheduled
        self.delay = delay
        self.spread = spread
        self.answers: list[object] = []
        self.done = asyncio.Event()

    def send(self) -> None:
        self.sent += 1
        self._add()

    def more(self, sends: int) -> None:
        """``sends`` more, the first one now."""
        self.total += sends
        self.done.clear()
        self.send()

    def _add(self) -> None:
        with self.flushes.lock:
            self.flushes.appended += 1
        self.commit.add(self, len(self.answers), "ok")

    def finish(self, request_id: int, outcome: object) -> None:
        self.answers.append(outcome)
        if len(self.answers) == self.total:
            self.done.set()
        if self.sent == self.total:
            return
        self.sent += 1
        if self.delay:  # a pipelining sender's answers: each a step later than the last
            step = 1 + len(self.answers) % self.spread
            asyncio.get_running_loop().call_later(self.delay * step, self._add)
        else:
            self._add()


async def _rounds(
    connections: int, sends: int, wait_us: int, overlap: float = 0
) -> tuple[Flushes, CrossClientCommit]:
    flushes = Flushes()
    commit = _commit(flushes, wait_us, overlap)
    try:
        # the i-th connection's next send comes 0.3 * i ms after its answer
        senders = [Sender(commit, flushes, sends, 0.0003 * i) for i in range(connections)]
        for sender in senders:  # all in one loop callback; the flusher may take any prefix
            sender.send()
        await asyncio.wait_for(asyncio.gather(*(s.done.wait() for s in senders)), LIMIT_S)
        assert all(s.answers == ["ok"] * sends for s in senders)
    finally:
        commit.close()
    return flushes, commit


def test_several_connections_share_one_flush_a_round_once_the_wait_has_their_count() -> None:
    connections, sends = 16, 30
    flushes, commit = asyncio.run(_rounds(connections, sends, LONG_US))
    # The first flush takes what was added when the flusher woke (1 to 16 sends), the
    # second the others; once a flush answered several connections, the flusher waits for
    # every send in flight (no overlapping cohorts, the default): one flush a round,
    # though their sends come back one by one.
    assert commit.flushes == flushes.calls
    assert sends <= flushes.calls <= sends + 3, flushes.covered
    assert commit.sends_flushed == connections * sends
    assert commit.waits_full == commit.waits  # every wait ended by its count
    steady = [b - a for a, b in zip(flushes.covered, flushes.covered[1:], strict=False)][-5:]
    assert steady == [connections] * 5, flushes.covered


def test_with_overlapping_cohorts_a_round_takes_one_or_two_flushes() -> None:
    connections, sends = 16, 30
    # a 5 ms bound: at the end the last sends wait for ones that finished sending
    flushes, commit = asyncio.run(_rounds(connections, sends, 5_000, overlap=3))
    # Once a flush answered several connections, the next waits until no more sends are
    # expected back than came during that flush (here the fake fdatasync is short: few or
    # none): one or two flushes a round, though the sends come back one by one (with
    # the wait off one run made 133 flushes for these 30 rounds).
    assert commit.flushes == flushes.calls
    assert sends <= flushes.calls <= 2 * sends + 3, flushes.covered
    assert commit.sends_flushed == connections * sends
    assert commit.waits_full >= 1


def test_without_the_wait_the_flusher_never_waits() -> None:
    # (and, the sends coming back one by one, flushes most of them alone: not asserted,
    # it depends on timing: one run of the test above with wait 0 made 133 flushes, not 30)
    flushes, commit = asyncio.run(_rounds(16, 10, 0))
    assert commit.waits == 0
    assert commit.sends_flushed == 160
    assert flushes.calls >= 10


def test_a_lone_sender_is_flushed_without_waiting() -> None:
    flushes, commit = asyncio.run(_rounds(1, 50, LONG_US))
    assert (commit.waits, flushes.calls, commit.sends_flushed) == (0, 50, 50)


def test_one_connection_with_several_sends_in_flight_is_not_waited_for() -> None:
    async def scenario() -> CrossClientCommit:
        flushes = Flushes()
        commit = _commit(flushes, LONG_US)
        try:
            sender = Sender(commit, flushes, 48, 0.0003, spread=8)
            for _ in range(8):  # eight in flight, all of one connection; each answer sends
                # again 0.3 to 2.4 ms later: they come back one by one, and are not waited for
                sender.send()
            await asyncio.wait_for(sender.done.wait(), LIMIT_S)
        finally:
            commit.close()
        return commit

    commit = asyncio.run(scenario())
    assert commit.waits == 0
    assert commit.sends_flushed == 48


def test_the_bound_ends_a_wait_for_senders_that_do_not_come() -> None:
    async def scenario() -> tuple[CrossClientCommit, list[Sender]]:
        flushes = Flushes()
        commit = _commit(flushes, 2_000)
        try:
            # four connections send 3 each, then one of them goes on alone for 5 more
            senders = [Sender(commit, flushes, 3) for _ in range(3)] + [Sender(commit, flushes, 8)]
            for sender in senders:
                sender.send()
            await asyncio.wait_for(asyncio.gather(*(s.done.wait() for s in senders)), LIMIT_S)
        finally:
            commit.close()
        return commit, senders

    commit, senders = asyncio.run(scenario())
    assert [len(s.answers) for s in senders] == [3, 3, 3, 8]
    assert commit.sends_flushed == 17
    assert commit.waits > commit.waits_full  # at least one wait ended by its bound


async def _start_waiting() -> tuple[Flushes, CrossClientCommit, list[Sender]]:
    """Four connections' sends flushed together, then only one sends again: the flusher
    expects more and waits (with a bound no test reaches)."""
    flushes = Flushes()
    commit = _commit(flushes, LONG_US)
    senders = [Sender(commit, flushes, 1) for _ in range(4)]
    for sender in senders:
        sender.send()
    await asyncio.wait_for(asyncio.gather(*(s.done.wait() for s in senders)), LIMIT_S)
    # every sender answered: the last flush covered 2+ connections unless the flusher took
    # them one by one (then it expects nothing and does not wait): go again until it did
    while commit.expecting < 2:
        for sender in senders:
            sender.more(1)
        await asyncio.wait_for(asyncio.gather(*(s.done.wait() for s in senders)), LIMIT_S)
    waits = commit.waits
    senders[0].more(1)  # one of the expected sends: the flusher waits for the others
    await _until(lambda: commit.waits > waits, "the flusher to wait")
    return flushes, commit, senders


def test_drain_flushes_what_waits_without_finishing_the_wait() -> None:
    async def scenario() -> None:
        flushes, commit, senders = await _start_waiting()
        try:
            calls = flushes.calls
            assert not senders[0].done.is_set()
            await asyncio.wait_for(commit.drain(), LIMIT_S)  # not 60 s
            assert senders[0].done.is_set() and flushes.calls == calls + 1
        finally:
            commit.close()

    asyncio.run(scenario())


def test_after_drain_the_flusher_neither_waits_nor_counts_a_wait() -> None:
    """Draining, no expected send will come: a lone send after a flush of several
    connections is flushed at once, and ``waits`` (the stats' group_commit_waits) stays 0
    (before: it counted a wait that did not happen, one per lone send)."""

    async def scenario() -> CrossClientCommit:
        flushes = Flushes()
        commit = _commit(flushes, LONG_US)
        try:
            await asyncio.wait_for(commit.drain(), LIMIT_S)  # from here on the broker stops
            senders = [Sender(commit, flushes, 0) for _ in range(4)]
            for _ in range(5):
                for _ in range(200):  # until a flush answered several connections: it
                    # expects more (the flusher may take the four one by one: go again)
                    for sender in senders:
                        sender.more(1)
                    await asyncio.wait_for(
                        asyncio.gather(*(s.done.wait() for s in senders)), LIMIT_S
                    )
                    if commit.expecting >= 2:
                        break
                else:
                    raise AssertionError("no flush answered several connections in 200 rounds")
                senders[0].more(1)  # alone: flushed without waiting (not in 60 s)
                await asyncio.wait_for(senders[0].done.wait(), LIMIT_S)
        finally:
            commit.close()
        return commit

    commit = asyncio.run(scenario())
    assert (commit.waits, commit.waits_full) == (0, 0)


def test_close_during_a_wait_flushes_and_answers_what_waits() -> None:
    async def scenario() -> Sender:
        flushes, commit, senders = await _start_waiting()
        calls = flushes.calls
        commit.close()  # on the loop, as the broker does
        assert not commit._sync._thread.is_alive()  # type: ignore[attr-defined]
        assert flushes.calls == calls + 1
        await asyncio.wait_for(senders[0].done.wait(), LIMIT_S)  # its answer, on the loop
        return senders[0]

    sender = asyncio.run(scenario())
    assert sender.answers[-1] == "ok"


def test_a_failed_flush_after_a_wait_answers_the_batch_with_the_error() -> None:
    async def scenario() -> list[Sender]:
        flushes, commit, senders = await _start_waiting()
        try:
            flushes.fail = True
            for sender in senders[1:]:  # the expected sends: the wait ends by its count
                sender.more(1)
            await asyncio.wait_for(asyncio.gather(*(s.done.wait() for s in senders)), LIMIT_S)
        finally:
            commit.close()
        return senders

    senders = asyncio.run(scenario())
    assert all(isinstance(s.answers[-1], OSError) for s in senders), senders


def test_expected_counts_a_batch_of_several_connections_and_not_of_one() -> None:
    a, b = object(), object()
    assert expected([(a, 1, None), (a, 2, None)]) == 0  # type: ignore[list-item]
    assert expected([(a, 1, None), (a, 2, None), (b, 1, None)]) == 3  # type: ignore[list-item]
    assert expected([(a, 1, None)]) == 0  # type: ignore[list-item]


@pytest.mark.parametrize("value", [-1, 100_001, 1.5, "500", True])
def test_a_bad_group_commit_wait_is_a_config_error_naming_it(value: object) -> None:
    with pytest.raises(ConfigError, match="group_commit_wait_us"):
        ServerConfig(group_commit_wait_us=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("flush", ["async", "os"])
def test_a_wait_without_flush_sync_is_a_config_error_naming_both(flush: BrokerFlush) -> None:
    # the wait is the broker's group commit's, which only --flush sync has: not ignored
    with pytest.raises(ConfigError, match=f"group_commit_wait_us=500 .*flush='{flush}'"):
        ServerConfig(flush=flush, group_commit_wait_us=500)
    assert ServerConfig(flush=flush, group_commit_wait_us=0).group_commit_wait_us == 0
    assert ServerConfig(flush="sync", group_commit_wait_us=500).group_commit_wait_us == 500


def test_the_default_wait_follows_the_flush_also_through_replace() -> None:
    # None is resolved when read, not stored: replace() with another flush gets its default
    # (a stored 500 made replace(flush="async") a ConfigError, and a stored 0 kept sync at 0).
    sync = ServerConfig(flush="sync")
    assert (sync.commit_wait_us, ServerConfig().commit_wait_us) == (500, 0)
    assert dataclasses.replace(sync, flush="async").commit_wait_us == 0
    assert dataclasses.replace(ServerConfig(), flush="sync").commit_wait_us == 500
    assert ServerConfig(flush="sync", group_commit_wait_us=0).commit_wait_us == 0


def test_the_broker_logs_the_wait_and_counts_its_waits_in_stats(
    caplog: pytest.LogCaptureFixture,
) -> None:
    home = Path(tempfile.mkdtemp(prefix="eq", dir="/tmp"))
    try:
        with caplog.at_level("INFO", logger="equeue.server"):
            broker = BrokerThread(
                home / "s", flush="sync", group_commit_wait_us=700, listen=[f"unix:{home}/b"]
            ).start()
        try:
            with equeue.connect(broker.urls[0]) as client:
                client.send("t", b"m")
                stats = client.stats()
        finally:
            broker.stop()
    finally:
        shutil.rmtree(home)
    assert "(flush=sync, group commit wait 700 µs)" in caplog.text
    # one connection's sends: never waited for, but counted (0) beside flushes
    counted = ["flushes", "group_commit_waits", "group_commit_waits_full"]
    counted.append("group_commit_overlapped")
    assert [stats[name] for name in counted] == [1, 0, 0, 0]


@pytest.mark.parametrize("value", [-1, 1001, 1.5, "3"])
def test_a_bad_group_commit_overlap_is_a_config_error_naming_it(value: object) -> None:
    with pytest.raises(ConfigError, match="group_commit_overlap"):
        ServerConfig(flush="sync", group_commit_overlap=value)  # type: ignore[arg-type]
    assert ServerConfig(flush="sync", group_commit_overlap=3).group_commit_overlap == 3


def test_without_overlap_a_flush_waits_for_every_expected_send() -> None:
    """The default (group_commit_overlap 0): after a flush of several connections, no
    flush starts while any expected send is still out, however many came meanwhile."""

    async def scenario() -> CrossClientCommit:
        flushes, commit, senders = await _start_waiting()  # one expected send came: waits
        try:
            calls = flushes.calls
            for sender in senders[1:]:
                if commit.expecting == 1:  # this one is the last expected
                    break
                sender.more(1)
                await asyncio.sleep(0.05)  # room for a wrong flush to start
                assert flushes.calls == calls and commit.expecting >= 1
            else:
                raise AssertionError("the last expected send was never the next")
            sender.more(1)
            await asyncio.wait_for(asyncio.gather(*(s.done.wait() for s in senders)), LIMIT_S)
            assert flushes.calls >= calls + 1
        finally:
            commit.close()
        return commit

    commit = asyncio.run(scenario())
    assert commit.waits_full >= 1
