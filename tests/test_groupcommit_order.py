"""The group commit's one guarantee, step by step (equeue/server/groupcommit.py): an answer
is released only by an fdatasync that started after its append. The flush is held open
by the test, a send is added while it runs, and that send must wait for the next flush;
test_server_commit.py checks the same under load through real connections."""

from __future__ import annotations

import asyncio
import threading

from equeue.server.groupcommit import CrossClientCommit

WAIT_S = 10.0


class HeldFlush:
    """A flush_log the test opens and closes: each call notes how many sends were appended
    when it started, and the sends it made durable when it ends."""

    def __init__(self, appended: list[int]) -> None:
        self.appended = appended
        self.durable = 0  # sends [0, durable) are covered by a finished flush
        self.calls = 0
        self.started = [threading.Event() for _ in range(3)]
        self.proceed = [threading.Event() for _ in range(3)]

    def __call__(self) -> None:
        n = self.calls
        self.calls += 1
        covered = len(self.appended)  # every append before this flush started
        self.started[n].set()
        assert self.proceed[n].wait(WAIT_S)
        self.durable = max(self.durable, covered)


class Peer:
    def __init__(self, flush: HeldFlush) -> None:
        self.flush = flush
        self.answers: list[tuple[int, object, int]] = []  # request id, outcome, durable then

    def finish(self, request_id: int, outcome: object) -> None:
        self.answers.append((request_id, outcome, self.flush.durable))


async def _until(check: object, what: str) -> None:
    for _ in range(int(WAIT_S / 0.005)):
        if callable(check) and check():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


async def _scenario() -> tuple[Peer, HeldFlush, CrossClientCommit]:
    loop = asyncio.get_running_loop()
    appended: list[int] = []
    flush = HeldFlush(appended)
    peer = Peer(flush)
    commit = CrossClientCommit(loop, flush)
    try:
        appended.append(0)  # the store's append comes before the answer is handed over
        commit.add(peer, 0, "a")
        assert await asyncio.to_thread(flush.started[0].wait, WAIT_S)
        appended.append(1)  # appended while the first fdatasync runs
        commit.add(peer, 1, "b")
        appended.append(2)
        commit.add(peer, 2, "c")
        flush.proceed[0].set()
        await _until(lambda: peer.answers, "the first flush's answer")
        assert await asyncio.to_thread(flush.started[1].wait, WAIT_S)  # the flusher goes on
        await asyncio.sleep(0.05)  # room for a wrong release to show
        assert [a[0] for a in peer.answers] == [0], peer.answers
        assert commit.pending == 2
        flush.proceed[1].set()
        await commit.drain()
        assert commit.pending == 0
    finally:
        for event in flush.proceed:
            event.set()
        commit.close()
    return peer, flush, commit


def test_a_send_added_during_a_flush_waits_for_the_next_one() -> None:
    peer, flush, commit = asyncio.run(_scenario())
    assert [(rid, outcome) for rid, outcome, _ in peer.answers] == [(0, "a"), (1, "b"), (2, "c")]
    for request_id, _, durable in peer.answers:
        assert request_id < durable, f"send {request_id} answered with only {durable} durable"
    assert flush.calls == 2  # the two sends added during the first flush shared the second
    assert (commit.flushes, commit.sends_flushed) == (2, 3)


def test_a_failed_flush_answers_its_batch_with_the_error_and_the_next_succeeds() -> None:
    async def scenario() -> list[tuple[int, object]]:
        calls: list[int] = []

        def flush_log() -> None:
            calls.append(1)
            if len(calls) == 1:
                raise OSError(5, "EIO from the test")

        answers: list[tuple[int, object]] = []

        class Recorder:
            def finish(self, request_id: int, outcome: object) -> None:
                answers.append((request_id, outcome))

        commit = CrossClientCommit(asyncio.get_running_loop(), flush_log)
        try:
            commit.add(Recorder(), 1, "first")
            await commit.drain()
            commit.add(Recorder(), 2, "second")
            await commit.drain()
        finally:
            commit.close()
        return answers

    answers = asyncio.run(scenario())
    assert isinstance(answers[0][1], OSError) and answers[0][0] == 1
    assert answers[1] == (2, "second")


def test_close_stops_the_flusher_thread() -> None:
    async def scenario() -> CrossClientCommit:
        commit = CrossClientCommit(asyncio.get_running_loop(), lambda: None)
        commit.close()
        return commit

    commit = asyncio.run(scenario())
    assert not commit._thread.is_alive()
