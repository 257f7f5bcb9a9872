"""Consumer groups at the edges, through a real broker: retention deleting the chunks a
group's committed offset and a member's held pull point into (the member gets the next
message, a late group starts at the first retained offset and the broker counts what it
skipped; no builtin exception, no wrong message), and a member process SIGKILLed while
its queues are drained and long-polled (its queues move after its session timeout;
every message sent after the kill reaches the survivor). Controls: no retention; the
member leaves cleanly."""

from __future__ import annotations

import asyncio
import datetime as dt
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import test_groups_kill as gk
from server_helpers import short_home

import equeue
import equeue.aio
from equeue import Message, MessageStore, StoreConfig
from equeue.format.chunk import MIN_CHUNK_DATA_SIZE
from equeue.server import BrokerThread

BOUND_S = 20.0  # every wait below ends by then


def _until(ready: object, what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not ready():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


class Polling:
    """A member of ``group`` on a client of its own (``kind``: the blocking one, or the
    asyncio one in an event loop of its own), polled by a thread: what it got, and what
    it raised."""

    def __init__(self, url: str, group: str, topic: str, kind: str = "sync") -> None:
        self.got: list[Message] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        args = (url, group, topic)
        if kind == "sync":
            self._thread = threading.Thread(target=self._run, args=args)
        else:
            self._thread = threading.Thread(target=asyncio.run, args=(self._run_aio(*args),))
        self._thread.start()

    def _run(self, url: str, group: str, topic: str) -> None:
        try:
            with equeue.connect(url) as client, client.consumer(group, topic, **OPTIONS) as c:
                while not self._stop.is_set():
                    self._got(c.poll(0.1))
        except BaseException as exc:
            self.errors.append(exc)

    async def _run_aio(self, url: str, group: str, topic: str) -> None:
        try:
            client = await equeue.aio.connect(url)
            async with client, client.consumer(group, topic, **OPTIONS) as consumer:
                while not self._stop.is_set():
                    self._got(await consumer.poll(0.1))
        except BaseException as exc:
            self.errors.append(exc)

    def _got(self, message: Message | None) -> None:
        if message is not None:
            self.got.append(message)

    def offsets(self) -> list[int]:
        return [m.queue_offset for m in self.got]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(BOUND_S)


OPTIONS: dict[str, Any] = {"session_timeout": 5.0, "batch_size": 8}


home = pytest.fixture(short_home, name="home")


@pytest.mark.parametrize("kind", ["sync", "aio"])
@pytest.mark.parametrize("retained", [False, True], ids=["control", "retention"])
def test_retention_under_a_held_pull_and_a_committed_offset(
    home: Path, retained: bool, kind: str
) -> None:
    """Group g consumes quiet/0 (50 messages) and long-polls it, drained; group late
    committed at 10 and is away. Then 400 sends to busy complete every chunk holding
    quiet's messages and retention (1 s, applied as of an hour later) removes them all:
    quiet/0 is (50, 50), g's held pull points into removed chunks. 20 more to quiet: g
    gets offsets 50..69 exactly; late starts at 50, 40 offsets counted as skipped."""
    config = StoreConfig(chunk_data_size=MIN_CHUNK_DATA_SIZE, retention=dt.timedelta(seconds=1))
    store = MessageStore.open(home / "s", config)
    store.create_topic("quiet", 1)
    store.create_topic("busy", 1)
    broker = BrokerThread(store).start()
    url = broker.urls[0]
    try:
        with equeue.connect(url) as client:
            for i in range(50):
                client.send("quiet", b"quiet %d" % i)
            client.commit_offset("late", "quiet", 0, 10)
            g = Polling(url, "g", "quiet", kind)
            try:
                _until(lambda: len(g.got) == 50, "g to consume 50")
                _until(lambda: client.committed_offset("g", "quiet", 0) == 50, "g's commit")
                time.sleep(0.3)  # its pull is held now (drained queue)
                for _ in range(400):
                    client.send("busy", b"b" * 100)
                if retained:
                    assert store.apply_retention(time.time() + 3600) > 0
                    assert client.queue_range("quiet", 0) == (50, 50)
                for i in range(50, 70):
                    client.send("quiet", b"quiet %d" % i)
                _until(lambda: len(g.got) >= 70 or g.errors, "g to consume 20 more")
                time.sleep(0.2)  # (nothing more may come)
                assert not g.errors, g.errors
                assert g.offsets() == list(range(70))
                assert [m.body for m in g.got] == [b"quiet %d" % i for i in range(70)]
                late = Polling(url, "late", "quiet", kind)
                try:
                    _until(lambda: len(late.got) >= (20 if retained else 60), "late to consume")
                    time.sleep(0.2)
                    assert not late.errors, late.errors
                    first = 50 if retained else 10
                    assert late.offsets() == list(range(first, 70))
                    assert [m.body for m in late.got] == [b"quiet %d" % i for i in range(first, 70)]
                finally:
                    late.close()
            finally:
                g.close()
            skipped = client.stats("late")["groups"].get("late", {}).get("skipped")
        if retained:
            assert skipped == {"quiet/0": {"count": 40, "ranges": [[10, 50]]}}
        else:
            assert skipped is None
    finally:
        broker.stop()
        store.close()


@pytest.mark.parametrize("kill", [False, True], ids=["control", "sigkill"])
def test_a_member_killed_while_long_polling_loses_nothing(home: Path, kill: bool) -> None:
    """Two member processes on 4 queues, every queue drained and long-polled; one is
    SIGKILLed (control: leaves by its stdin closing); 40 messages sent right after all
    reach the survivor, once its session timeout (1 s) moved the queues."""
    with MessageStore.open(home / "s") as created:
        created.create_topic(gk.TOPIC, 4)
    broker = BrokerThread(home / "s").start()
    url = broker.urls[0]
    members: list[gk.Member] = []
    try:
        members = [
            gk.Member(url, "victim", 0.0, 1.0, home / "victim.log"),
            gk.Member(url, "survivor", 0.0, 6.0, home / "survivor.log"),
        ]
        victim, survivor = members
        gk.wait_for(lambda: all("READY" in m.lines for m in members), "the joins", members)
        with equeue.connect(url) as client:

            def held() -> list[int]:
                group = client.stats(gk.GROUP)["coordinator"].get(gk.GROUP, {})
                members = group.get("members", {}).values()  # (the retry topic's too)
                return sorted(sum(q[0] == gk.TOPIC for q in m["queues"]) for m in members)

            gk.wait_for(lambda: held() == [2, 2], "the queues to be divided", members, BOUND_S)
            before = {client.send(gk.TOPIC, b"before %d" % i, queue_id=i % 4).message_id
                      for i in range(8)}  # fmt: skip

            def seen() -> set[str]:
                return {mid for m in members for _, _, mid in m.messages()}

            gk.wait_for(lambda: before <= seen(), "the first 8 to be consumed", members, BOUND_S)
            assert {q for q, _, _ in victim.messages()}, "the victim holds no queue"
            time.sleep(0.5)  # committed (idle 0.1 s), and every queue's pull held
            if kill:
                victim.process.send_signal(signal.SIGKILL)
            else:
                assert victim.process.stdin is not None
                victim.process.stdin.close()
            assert victim.process.wait(BOUND_S) == (-9 if kill else 0)
            after = {client.send(gk.TOPIC, b"after %d" % i, queue_id=i % 4).message_id
                     for i in range(40)}  # fmt: skip

            def got() -> set[str]:
                return {mid for _, _, mid in survivor.messages()}

            gk.wait_for(lambda: after <= got(), "the survivor to get all 40", members, BOUND_S)
            assert held() == [4]
            assert survivor.process.poll() is None  # no traceback
    finally:
        for member in members:
            member.stop()
        broker.stop()


def test_a_compaction_under_a_long_polling_group(home: Path, spark: object) -> None:
    """A compacted topic (10 keys, 300 messages) consumed by group g, which then
    long-polls it drained; a compaction job (Spark, this process) rewrites its completed
    chunks under the live broker, which adopts them. 10 more sends: g gets offsets 300..309
    exactly; group late, joining afterwards from 0, gets no offset the job removed, each
    key's last value, and the new ones, in order, without an error."""
    from equeue.compaction.job import compact

    config = StoreConfig(chunk_data_size=16 * 1024, flush="async", flush_interval_ms=20)
    store = MessageStore.open(home / "s", config)
    store.create_topic("k", 1, cleanup="compact")
    broker = BrokerThread(store).start()
    try:
        with equeue.connect(broker.urls[0]) as client:
            for i in range(300):
                client.send("k", b"v%03d" % i + b"." * 100, key=f"k{i % 10}")
            g = Polling(broker.urls[0], "g", "k")
            try:
                _until(lambda: len(g.got) == 300, "g to consume 300")
                store.flush()
                report = compact(home / "s", spark=spark)  # type: ignore[arg-type]
                assert report.records_removed > 200

                def adopted() -> bool:  # offset 0 (k0's first value) is gone from a pull
                    return store.pull("k", 0, 0, 1).messages[0].queue_offset > 0

                _until(adopted, "the broker to adopt the job's chunks")
                for i in range(300, 310):
                    client.send("k", b"v%03d" % i + b"." * 100, key=f"k{i % 10}")
                _until(lambda: len(g.got) >= 310 or g.errors, "g to consume 10 more")
                time.sleep(0.2)
                assert not g.errors, g.errors
                assert g.offsets() == list(range(310))
                late = Polling(broker.urls[0], "late", "k")
                try:
                    _until(lambda: late.offsets()[-1:] == [309], "late to reach the end")
                    assert not late.errors, late.errors
                    offsets = late.offsets()
                    assert offsets == sorted(set(offsets)) and len(offsets) < 100
                    last = {m.key: m.body for m in late.got}
                    assert last == {f"k{i % 10}": b"v%03d" % i + b"." * 100
                                    for i in range(300, 310)}  # fmt: skip
                    assert set(range(290, 310)) <= set(offsets)  # each key's last two
                finally:
                    late.close()
            finally:
                g.close()
    finally:
        broker.stop()
        store.close()
