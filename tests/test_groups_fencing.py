"""One member per consumer id (a join of a live id fences the older member) and a broker
stall not charged to the members' sessions (docs/groups.md, "Membership and
allocation"), through real broker and member processes (SIGSTOP/SIGCONT), and the
clients' side of fencing. The coordinator's side, with an injected clock: the end of
tests/test_groups.py."""

from __future__ import annotations

import asyncio
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from client_helpers import BrokerProcess, temporary_broker
from group_helpers import broker_thread

import equeue
import equeue.aio
from equeue.client.consumer import GroupConsumer
from equeue.client.consumer_aio import AsyncGroupConsumer
from equeue.client.groupstate import GroupState
from equeue.errors import FencedMemberError, GroupError, ProtocolError

HERE = Path(__file__).resolve().parent
TOPIC = "orders"


# --- real processes --------------------------------------------------------------------


class Member:
    """tests/group_consumer_child.py: ``M queue offset id`` per message, ``E class text``
    on an error it stopped for."""

    def __init__(self, url: str, name: str, session: float = 2.0) -> None:
        self.lines: list[str] = []
        self.process: subprocess.Popen[bytes]
        self.process = subprocess.Popen(
            [sys.executable, str(HERE / "group_consumer_child.py"), url, "g", TOPIC, name,
             "--session", str(session)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )  # fmt: skip
        self.partial = b""
        self.wait_for(lambda: "READY" in self.lines, 30)

    def read(self, seconds: float = 0.0) -> None:
        out = self.process.stdout
        assert out is not None
        while select.select([out], [], [], seconds)[0]:
            chunk = os.read(out.fileno(), 1 << 16)  # (not readline: select sees no buffer)
            if not chunk:
                return
            *lines, self.partial = (self.partial + chunk).split(b"\n")
            self.lines += [line.decode() for line in lines]
            seconds = 0.0

    def wait_for(self, condition: Any, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not condition():
            assert time.monotonic() < deadline, self.lines[-5:]
            assert self.process.poll() is None or self.process.stdout is not None
            self.read(0.1)

    def ids(self) -> set[str]:
        return {line.split()[3] for line in self.lines if line.startswith("M ")}

    def errors(self) -> list[str]:
        return [line for line in self.lines if line.startswith("E ")]

    def stop(self) -> int:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
        try:
            code = self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait(10)
        self.read()
        return code


def committed(url: str) -> int:
    with equeue.connect(url) as client:
        return sum(client.committed_offset("g", TOPIC, q) or 0 for q in range(4))


def test_two_processes_with_one_consumer_id_the_older_is_fenced() -> None:
    with temporary_broker() as broker, equeue.connect(broker.url) as client:
        client.create_topic(TOPIC, 4)
        older = Member(broker.url, "worker-1")
        newer: Member | None = None
        try:
            client.send_batch(TOPIC, [b"a%d" % i for i in range(200)])
            older.wait_for(lambda: len(older.ids()) == 200, 30)
            deadline = time.monotonic() + 20
            while committed(broker.url) < 200:  # idle: it commits what it processed
                assert time.monotonic() < deadline
                time.sleep(0.05)
            newer = Member(broker.url, "worker-1")
            client.send_batch(TOPIC, [b"b%d" % i for i in range(200)])
            older.wait_for(lambda: older.errors(), 10)
            newer.wait_for(lambda: len(newer.ids()) == 200, 30)
            assert older.errors()[0].startswith("E FencedMemberError ")
            assert "joined again from another connection or process" in older.errors()[0]
            assert older.stop() == 3
            assert newer.errors() == []
            assert len(older.ids()) == 200 and not older.ids() & newer.ids()
            members = client.stats("g")["coordinator"]["g"]["members"]
            assert list(members) == ["worker-1"] and len(members["worker-1"]["queues"]) == 5
        finally:
            older.stop()
            if newer is not None:
                newer.stop()
        log = (broker.store.parent / "broker.log").read_text()
        assert "'worker-1' of group 'g' joined again while its session was live" in log


def coordinator(url: str) -> dict[str, Any]:
    with equeue.connect(url) as client:
        found: dict[str, Any] = client.stats("g")["coordinator"]["g"]
        return found


def test_a_broker_stopped_past_the_session_timeout_expires_nobody() -> None:
    """SIGSTOP of the broker for 2.5 session timeouts, then SIGCONT: both member
    processes stay members (the generation does not move); the control, one member
    SIGSTOPped as long, is expired."""
    with temporary_broker() as broker, equeue.connect(broker.url) as client:
        client.create_topic(TOPIC, 4)
        members = [Member(broker.url, name, session=2.0) for name in ("m1", "m2")]
        try:
            client.send_batch(TOPIC, [b"a%d" % i for i in range(100)])
            deadline = time.monotonic() + 20
            while len(members[0].ids() | members[1].ids()) < 100:
                assert time.monotonic() < deadline
                for member in members:
                    member.read(0.05)
            time.sleep(1.0)  # their assignments settled, the last handover released
            before = coordinator(broker.url)
            assert set(before["members"]) == {"m1", "m2"}
            process = broker.process
            assert process is not None
            os.kill(process.pid, signal.SIGSTOP)
            try:
                time.sleep(5.0)
            finally:
                os.kill(process.pid, signal.SIGCONT)
            time.sleep(3.0)  # longer than a session timeout after the resume
            after = coordinator(broker.url)
            assert set(after["members"]) == {"m1", "m2"}
            assert after["generation"] == before["generation"]
            for member in members:
                member.read()
                assert member.errors() == []
            log = (broker.store.parent / "broker.log").read_text()
            assert "missed its session timeout" not in log
            assert "tick came" in log and "late" in log

            # the control: a member process stopped as long is expired
            os.kill(members[0].process.pid, signal.SIGSTOP)
            try:
                deadline = time.monotonic() + 20
                while set(coordinator(broker.url)["members"]) != {"m2"}:
                    assert time.monotonic() < deadline
                    time.sleep(0.1)
            finally:
                os.kill(members[0].process.pid, signal.SIGCONT)
        finally:
            for member in members:
                member.stop()


def test_a_fixed_id_member_reads_on_across_a_broker_restart_and_its_own_reconnect() -> None:
    """Neither a broker restart (the member's next request: 'no consumer', it joins again)
    nor the client's own lost connection (it joins again over the new one, replacing its
    own earlier membership) fences the member."""
    with temporary_broker() as broker:
        with equeue.connect(broker.url) as client:
            client.create_topic(TOPIC, 4)
            client.send_batch(TOPIC, [b"a%d" % i for i in range(10)])
        with equeue.connect(broker.url) as client:
            consumer = GroupConsumer(client, "g", TOPIC, session_timeout=2.0, consumer_id="w")
            got: set[bytes] = set()
            try:
                consume(consumer, got, 10)
                restart(broker)
                client.send_batch(TOPIC, [b"b%d" % i for i in range(10)])
                consume(consumer, got, 20)
                conn = client._conn
                assert conn is not None
                conn.sock.shutdown(2)  # the client's own connection lost
                with equeue.connect(broker.url) as producer:  # (a send on it would fail)
                    producer.send_batch(TOPIC, [b"c%d" % i for i in range(10)])
                consume(consumer, got, 30)
                assert list(client.stats("g")["coordinator"]["g"]["members"]) == ["w"]
            finally:
                consumer.close()
    assert got == {b"%s%d" % (p, i) for p in (b"a", b"b", b"c") for i in range(10)}


def restart(broker: BrokerProcess) -> None:
    broker.stop()
    broker.start()


def consume(consumer: GroupConsumer, got: set[bytes], total: int, limit: float = 30.0) -> None:
    """poll (a FencedMemberError would escape) until ``got`` holds ``total`` bodies."""
    deadline = time.monotonic() + limit
    while len(got) < total:
        assert time.monotonic() < deadline, sorted(got)
        message = consumer.poll(0.2)
        if message is not None:
            got.add(message.body)


# --- the clients' side ---------------------------------------------------------------


def member_state() -> GroupState:
    return GroupState(
        "test", "g", TOPIC, tags=None, batch_size=8, auto_commit=True,
        auto_commit_interval=1.0, session_timeout=3.0, max_poll_interval=300.0,
        max_retries=None, consumer_id="w",
    )  # fmt: skip


def assignment(join_id: int | None, generation: int = 1) -> dict[str, Any]:
    answer: dict[str, Any] = {"generation": generation, "assignment": [[TOPIC, 0]]}
    if join_id is not None:
        answer["join_id"] = join_id
    return answer


def test_the_state_carries_its_join_id_and_ignores_an_earlier_memberships_answers() -> None:
    state = member_state()
    state.joined(assignment(7))
    assert state.member_args() == {"group": "g", "consumer": "w", "join_id": 7}
    assert state.heartbeat_args()["join_id"] == 7
    state.add((TOPIC, 0), None, [0, 0])
    assert state.pull_args((TOPIC, 0), 0)["join_id"] == 7
    # a heartbeat answer of an earlier join (the loop joined again meanwhile): ignored
    current = state.answer
    assert state.take(assignment(6, generation=9)) is False
    assert state.answer is current
    assert state.take(assignment(7, generation=2)) is True
    # a fence of a request of that earlier join: nothing to do
    error = FencedMemberError("fenced")
    assert state.fenced(error, {"join_id": 6}) is False and state.failure is None
    assert state.fenced(error, state.heartbeat_args()) is True and state.failure is error
    with pytest.raises(ProtocolError, match="join_id"):
        member_state().joined({**assignment(1), "join_id": "x"})


def test_a_broker_without_join_ids_gets_none_sent() -> None:
    state = member_state()
    state.joined(assignment(None))
    assert state.member_args() == {"group": "g", "consumer": "w"}
    assert state.take(assignment(None, generation=2)) is True
    state.reset()
    assert state.join_id is None


def test_lose_raises_a_fence_and_marks_other_losses_for_a_join() -> None:
    state = member_state()
    state.lost = False
    state.lose(GroupError("expired"))
    assert state.lost and state.failure is None
    error = FencedMemberError("fenced")
    with pytest.raises(FencedMemberError):
        state.lose(error)
    assert state.failure is error


@pytest.fixture
def thread_broker() -> Iterator[str]:
    with broker_thread(TOPIC, 4) as url:
        yield url


def test_blocking_members_of_one_id_the_older_raises_and_closes_without_leaving(
    thread_broker: str,
) -> None:
    with equeue.connect(thread_broker) as first, equeue.connect(thread_broker) as second:
        older = GroupConsumer(first, "g", TOPIC, session_timeout=1.0, consumer_id="w")
        newer = GroupConsumer(second, "g", TOPIC, session_timeout=1.0, consumer_id="w")
        try:
            first.send(TOPIC, b"m", queue_id=0)
            deadline = time.monotonic() + 10
            with pytest.raises(FencedMemberError, match="joined again"):
                while time.monotonic() < deadline:
                    older.poll(0.1)
            with pytest.raises(FencedMemberError):  # and at every later call
                older.poll(0)
            with pytest.raises(FencedMemberError):
                older.commit()
            older.close()  # no leave: the newer member stays
            assert list(first.stats("g")["coordinator"]["g"]["members"]) == ["w"]
            got = newer.poll(5.0)
            assert got is not None and got.body == b"m"
        finally:
            older.close()
            newer.close()


def test_asyncio_members_of_one_id_the_older_raises(thread_broker: str) -> None:
    async def main() -> None:
        first = await equeue.aio.connect(thread_broker)
        second = await equeue.aio.connect(thread_broker)
        older = AsyncGroupConsumer(first, "g", TOPIC, session_timeout=1.0, consumer_id="w")
        newer = AsyncGroupConsumer(second, "g", TOPIC, session_timeout=1.0, consumer_id="w")
        try:
            await older.start()
            await newer.start()
            await first.send(TOPIC, b"m", queue_id=0)
            with pytest.raises(FencedMemberError, match="joined again"):
                for _ in range(100):  # (bounded: about 10 s)
                    await older.poll(0.1)
            with pytest.raises(FencedMemberError):
                await older.poll(0)
            await older.close()
            stats = await second.stats("g")
            assert list(stats["coordinator"]["g"]["members"]) == ["w"]
            got = await newer.poll(5.0)
            assert got is not None and got.body == b"m"
        finally:
            await older.close()
            await newer.close()
            await first.close()
            await second.close()

    asyncio.run(main())
