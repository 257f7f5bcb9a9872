"""Review 36's F7 and F8, through a real broker (BrokerThread on a Unix socket): a member
commits only what it processed (a new member's idle poll sends no commit_offset), the
commits a poll makes stop at its timeout (the rest go at the next polls), and a member
holds at most the broker's max_in_flight - 2 long polls (both loops)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from server_helpers import short_home

import equeue
import equeue.aio
from equeue import MessageStore
from equeue.client.consumer import GroupConsumer
from equeue.client.consumer_aio import AsyncGroupConsumer
from equeue.client.groupstate import long_polls
from equeue.protocol.handshake import Welcome
from equeue.server import BrokerThread

TOPIC = "wide"
QUEUES = 16
SLOW_COMMIT_S = 0.05  # a commit_offset of the slow wrappers: a busy broker's fsync


@contextlib.contextmanager
def _broker(topic: str = TOPIC, queues: int = QUEUES, **settings: Any) -> Iterator[BrokerThread]:
    """A broker over a new store holding ``topic``, with one message in each of its
    ``queues`` where ``topic`` is not TOPIC."""
    with contextlib.contextmanager(short_home)() as directory:
        with MessageStore.open(directory / "s") as store:
            store.create_topic(topic, queues)
            if topic != TOPIC:
                for q in range(queues):
                    store.send(topic, b"x", queue_id=q)
        thread = BrokerThread(directory / "s", **settings).start()
        try:
            yield thread
        finally:
            thread.stop()


@pytest.fixture
def url() -> Iterator[str]:
    with _broker() as thread:
        yield thread.urls[0]


class Counting:
    """The client, counting requests by op; commit_offset takes SLOW_COMMIT_S once slow."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.url: str = client.url
        self.ops: Counter[str] = Counter()
        self.slow = False

    def request(self, op: str, arguments: dict[str, Any]) -> Any:
        self.ops[op] += 1
        if op == "commit_offset" and self.slow:
            time.sleep(SLOW_COMMIT_S)
        return self.client.request(op, arguments)


class AsyncCounting:
    def __init__(self, client: Any) -> None:
        self.client = client
        self.url: str = client.url
        self.ops: Counter[str] = Counter()
        self.slow = False

    async def request(self, op: str, arguments: dict[str, Any]) -> Any:
        self.ops[op] += 1
        if op == "commit_offset" and self.slow:
            await asyncio.sleep(SLOW_COMMIT_S)
        return await self.client.request(op, arguments)


def _committed(client: Any, group: str) -> dict[int, int | None]:
    return {q: client.committed_offset(group, TOPIC, q) for q in range(QUEUES)}


def test_a_new_member_commits_each_queue_start_once_then_only_what_it_processed(
    url: str,
) -> None:
    """A queue the group never committed has its start committed (what tells retention
    with retention_respects_consumers that the group reads it: taking the start as
    committed without a request left a joined member's unread messages unprotected,
    review 36-2 H2), once; after that only what is processed."""
    with equeue.connect(url) as client:
        counting = Counting(client)
        with GroupConsumer(counting, "g", TOPIC) as consumer:
            for _ in range(50):  # bounded: each idle poll commits a window at least
                assert consumer.poll(0.3) is None
                if not consumer.state.to_commit():
                    break
            assert _committed(client, "g") == dict.fromkeys(range(QUEUES), 0)
            starts = counting.ops["commit_offset"]
            assert consumer.poll(0.3) is None
            assert counting.ops["commit_offset"] == starts  # nothing new: nothing sent
            client.send(TOPIC, b"one", queue_id=5)
            got = consumer.poll(10.0)  # bounded: a long poll's round is ~1 s
            assert got is not None and got.body == b"one"
            assert consumer.poll(0.3) is None  # processed, then the idle commit
            assert counting.ops["commit_offset"] == starts + 1
        assert counting.ops["commit_offset"] == starts + 1  # close(): nothing more
        assert _committed(client, "g") == {q: 1 if q == 5 else 0 for q in range(QUEUES)}


def test_a_new_asyncio_member_commits_each_queue_start_once(url: str) -> None:
    async def main() -> tuple[int, int, dict[int, int | None]]:
        aclient = await equeue.aio.connect(url)
        try:
            counting = AsyncCounting(aclient)
            async with AsyncGroupConsumer(counting, "h", TOPIC) as consumer:
                for _ in range(50):
                    assert await consumer.poll(0.3) is None
                    if not consumer.state.to_commit():
                        break
                starts = counting.ops["commit_offset"]
                await aclient.send(TOPIC, b"one", queue_id=5)
                got = await consumer.poll(10.0)
                assert got is not None and got.body == b"one"
                assert await consumer.poll(0.3) is None
            committed = {q: await aclient.committed_offset("h", TOPIC, q) for q in range(QUEUES)}
            return starts, counting.ops["commit_offset"], committed
        finally:
            await aclient.close()

    starts, total, committed = asyncio.run(main())
    assert starts >= QUEUES  # every queue's start (and the retry queue's)
    assert total == starts + 1
    assert committed == {q: 1 if q == 5 else 0 for q in range(QUEUES)}


def test_a_member_starting_at_a_commit_commits_only_past_it(url: str) -> None:
    with equeue.connect(url) as client:
        for q in range(QUEUES):
            client.send(TOPIC, b"x", queue_id=q)
        client.commit_offset("g", TOPIC, 3, 1)  # queue 3's message is processed already
        counting = Counting(client)
        with GroupConsumer(counting, "g", TOPIC) as consumer:
            got = [consumer.poll(10.0) for _ in range(QUEUES - 1)]
            assert all(m is not None and m.queue_id != 3 for m in got)
            assert consumer.poll(0.3) is None
        assert counting.ops["commit_offset"] == QUEUES  # QUEUES - 1 and the retry queue's start
        assert _committed(client, "g") == dict.fromkeys(range(QUEUES), 1)


def _fill(client: Any) -> None:
    for q in range(QUEUES):
        client.send(TOPIC, b"x", queue_id=q)


def test_the_commits_a_poll_makes_stop_at_its_timeout(url: str) -> None:
    # before the fix: poll(0.2) made all QUEUES commits (0.8 s of them here) before
    # returning; now it stops at its deadline and the next polls commit the rest
    with equeue.connect(url) as client:
        _fill(client)
        counting = Counting(client)
        consumer = GroupConsumer(counting, "g", TOPIC, auto_commit_interval=3600.0)
        try:
            got = 0
            for _ in range(2000):  # poll(0.05): shorter than the idle commit's 0.1 s
                got += consumer.poll(0.05) is not None
                if got == QUEUES:
                    break
            assert got == QUEUES
            consumer.poll(0.0)  # the last one processed
            pending = len(consumer.state.to_commit())
            # every queue and the retry queue's start (no idle commit: polls of 0.05 s)
            assert pending == QUEUES + 1 and counting.ops["commit_offset"] == 0
            counting.slow = True
            assert consumer.poll(0.2) is None
            first = counting.ops["commit_offset"]
            # 0.2 s of 0.05 s commits, one more started at the deadline; the wrapper
            # sleeps each, so a slower machine sends fewer, never more
            assert 1 <= first <= 0.2 / SLOW_COMMIT_S + 1
            for _ in range(100):
                if not consumer.state.to_commit():
                    break
                assert consumer.poll(0.2) is None
            assert not consumer.state.to_commit()
            assert counting.ops["commit_offset"] == QUEUES + 1
        finally:
            consumer.close()
        assert _committed(client, "g") == dict.fromkeys(range(QUEUES), 1)


def test_the_commits_an_asyncio_poll_makes_stop_at_its_timeout(url: str) -> None:
    async def main() -> tuple[int, int, dict[int, int | None]]:
        aclient = await equeue.aio.connect(url)
        try:
            for q in range(QUEUES):
                await aclient.send(TOPIC, b"x", queue_id=q)
            counting = AsyncCounting(aclient)
            consumer = AsyncGroupConsumer(counting, "h", TOPIC, auto_commit_interval=3600.0)
            await consumer.start()
            try:
                got = 0
                for _ in range(2000):
                    got += await consumer.poll(0.05) is not None
                    if got == QUEUES:
                        break
                assert got == QUEUES
                await consumer.poll(0.0)
                assert len(consumer.state.to_commit()) == QUEUES + 1  # and the retry queue
                assert counting.ops["commit_offset"] == 0
                counting.slow = True
                assert await consumer.poll(0.2) is None
                first = counting.ops["commit_offset"]
                for _ in range(100):
                    if not consumer.state.to_commit():
                        break
                    assert await consumer.poll(0.2) is None
                total = counting.ops["commit_offset"]
            finally:
                await consumer.close()
            committed = {q: await aclient.committed_offset("h", TOPIC, q) for q in range(QUEUES)}
            return first, total, committed
        finally:
            await aclient.close()

    first, total, committed = asyncio.run(main())
    assert 1 <= first <= 0.2 / SLOW_COMMIT_S + 1
    assert total == QUEUES + 1
    assert committed == dict.fromkeys(range(QUEUES), 1)


class HeldSampler:
    """The most pulls the broker held at once, sampled every millisecond."""

    def __init__(self, thread: BrokerThread) -> None:
        self.holds = thread.broker.holds
        self.most = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.most = max(self.most, self.holds.count)

    def __enter__(self) -> HeldSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(5.0)


def test_long_polls_leave_two_places_of_max_in_flight() -> None:
    def limit(n: int) -> object:
        class Client:
            welcome = Welcome(1, "equeue", {"max_in_flight": n})

        return Client()

    assert [long_polls(limit(n)) for n in (1, 2, 3, 4, 10, 66, 1024)] == [1, 1, 1, 2, 8, 64, 64]
    assert long_polls(object()) == 64  # a wrapper without a welcome


@pytest.mark.parametrize("loop", ["blocking", "asyncio"])
def test_a_member_holds_at_most_max_in_flight_less_two_long_polls(loop: str) -> None:
    # before the fix: every place of the 4 (16 queues + the retry queue, idle) was held
    # by a long poll, and the member's other requests waited behind them
    with _broker(max_in_flight=4) as thread:
        url = thread.urls[0]
        with HeldSampler(thread) as sampler:
            if loop == "blocking":
                with equeue.connect(url) as client, GroupConsumer(client, "g", TOPIC) as consumer:
                    assert consumer.poll(1.5) is None
                    _fill(client)
                    got = [consumer.poll(10.0) for _ in range(QUEUES)]
            else:

                async def main() -> list[Any]:
                    aclient = await equeue.aio.connect(url)
                    try:
                        async with AsyncGroupConsumer(aclient, "g", TOPIC) as consumer:
                            assert await consumer.poll(1.5) is None
                            for q in range(QUEUES):
                                await aclient.send(TOPIC, b"x", queue_id=q)
                            return [await consumer.poll(10.0) for _ in range(QUEUES)]
                    finally:
                        await aclient.close()

                got = asyncio.run(main())
        assert all(m is not None for m in got)
        assert 1 <= sampler.most <= 2


WIDE = 64  # queues of the pipelined-commit tests


@pytest.mark.parametrize("loop", ["blocking", "asyncio"])
def test_commits_are_pipelined_into_few_fsyncd_writes(loop: str) -> None:
    # before: one commit_offset at a time, each its own offsets-file write and fsync
    # (WIDE writes); now up to COMMIT_WINDOW in flight, written together by the broker
    with _broker("many", WIDE) as thread:
        url, committer = thread.urls[0], thread.broker.offsets
        if loop == "blocking":
            with equeue.connect(url) as client:
                consumer = GroupConsumer(client, "g", "many", auto_commit_interval=3600.0)
                try:
                    got = 0
                    for _ in range(20 * WIDE):  # poll(0.05): no idle commit (0.1 s)
                        got += consumer.poll(0.05) is not None
                        if got == WIDE:
                            break
                    before = committer.writes
                    consumer.commit()
                    writes = committer.writes - before
                finally:
                    consumer.close()
                committed = [client.committed_offset("g", "many", q) for q in range(WIDE)]
        else:

            async def main() -> tuple[int, int, list[int | None]]:
                aclient = await equeue.aio.connect(url)
                try:
                    consumer = AsyncGroupConsumer(aclient, "g", "many", auto_commit_interval=3600.0)
                    await consumer.start()
                    try:
                        got = 0
                        for _ in range(20 * WIDE):
                            got += await consumer.poll(0.05) is not None
                            if got == WIDE:
                                break
                        before = committer.writes
                        await consumer.commit()
                        writes = committer.writes - before
                    finally:
                        await consumer.close()
                    return (
                        got,
                        writes,
                        [await aclient.committed_offset("g", "many", q) for q in range(WIDE)],
                    )
                finally:
                    await aclient.close()

            got, writes, committed = asyncio.run(main())
    assert got == WIDE
    assert committed == [1] * WIDE
    assert 1 <= writes <= WIDE // 4  # (2-3 seen)
