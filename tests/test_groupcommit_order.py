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

    def __init__(self, appended: list[int], flushes: int = 3) -> None:
        self.appended = appended
        self.durable = 0  # sends [0, durable) are covered by a finished flush
        self.calls = 0
        self.started = [threading.Event() for _ in range(flushes)]
        self.proceed = [threading.Event() for _ in range(flushes)]

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
    assert not commit._sync._thread.is_alive()  # type: ignore[attr-defined]


async def _waiting_scenario() -> tuple[list[Peer], HeldFlush, CrossClientCommit]:
    """The group-commit wait (a bound no test reaches): after a flush that answered several
    connections, the next starts once no more sends are expected than came during that
    flush; sends added during the wait join it; a send added while it runs waits for the
    next."""
    loop = asyncio.get_running_loop()
    appended: list[int] = []
    flush = HeldFlush(appended, 5)
    a, b, c = Peer(flush), Peer(flush), Peer(flush)
    commit = CrossClientCommit(
        loop, flush, wait_us=60_000_000, wait_per_fdatasync=1e12, overlap_per_fdatasync=1.0
    )

    def send(peer: Peer) -> None:
        appended.append(len(appended))  # the append comes before the answer is handed over
        commit.add(peer, appended[-1], "ok")

    try:
        send(a)  # 0
        assert await asyncio.to_thread(flush.started[0].wait, WAIT_S)
        send(b)  # 1
        send(c)  # 2
        flush.proceed[0].set()  # flush 0 answered a alone: no wait before flush 1 (b, c)
        assert await asyncio.to_thread(flush.started[1].wait, WAIT_S)
        await _until(lambda: a.answers, "a's first answer")
        send(a)  # 3, during flush 1 (which answers b and c: two sends are expected back)
        flush.proceed[1].set()
        # one send (3) came during flush 1: the next starts once at most one is expected
        await _until(lambda: commit.waits == 1, "the flusher to wait")
        await asyncio.sleep(0.05)  # room for a wrong flush to start
        assert not flush.started[2].is_set() and commit.pending == 1
        send(b)  # 4: one expected is left, flush 2 starts after it (3, 4)
        assert await asyncio.to_thread(flush.started[2].wait, WAIT_S)
        send(c)  # 5, while flush 2 runs: for flush 3
        flush.proceed[2].set()
        await _until(lambda: commit.waits == 2, "the flusher to wait again")
        await asyncio.sleep(0.05)  # room for a wrong release of send 5, or a wrong flush
        assert [x[0] for x in c.answers] == [2], c.answers
        assert not flush.started[3].is_set() and commit.pending == 1
        send(a)  # 6: flush 3 (5, 6)
        assert await asyncio.to_thread(flush.started[3].wait, WAIT_S)
        flush.proceed[3].set()
        await asyncio.wait_for(commit.drain(), WAIT_S)
    finally:
        for event in flush.proceed:
            event.set()
        commit.close()
    return [a, b, c], flush, commit


def test_sends_added_during_the_wait_join_the_flush_after_it_and_no_earlier() -> None:
    peers, flush, commit = asyncio.run(_waiting_scenario())
    assert [[x[0] for x in p.answers] for p in peers] == [[0, 3, 6], [1, 4], [2, 5]]
    for peer in peers:
        for seq, outcome, durable in peer.answers:
            assert outcome == "ok" and seq < durable, f"send {seq} answered at {durable}"
    assert flush.calls == 4 and commit.waits == commit.waits_full == 2
