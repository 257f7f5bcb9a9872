"""A member joining a group whose queues another member holds, with a ``timeout=``
shorter than a heartbeat interval (both loops). review19 R19-5: it learned its queues
only at its first heartbeat (session_timeout / 3 after the join), so its iteration ended
with nothing while messages waited. Now the broker's answer counts the queues it awaits;
meanwhile it heartbeats more often and its idle clock waits (docs/groups.md, "A joiner's
timeout")."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest
from group_helpers import broker_thread

import equeue
import equeue.aio
from equeue.client.consumer_aio import AsyncGroupConsumer
from equeue.client.groupstate import GroupState

TOPIC = "four"
COUNT = 400
SESSION = 3.0  # heartbeats every 1 s: longer than b's timeout
TIMEOUT = 0.5


@pytest.fixture
def url() -> Iterator[str]:
    with broker_thread(TOPIC, 4) as url:
        with equeue.connect(url) as client:
            client.send_many(TOPIC, [b"m-%d" % i for i in range(COUNT)])
        yield url


def test_a_joiner_with_a_short_timeout_gets_its_share_from_a_busy_holder(url: str) -> None:
    handled: dict[str, list[tuple[int, int]]] = {"a": [], "b": []}
    a_started, stop = threading.Event(), threading.Event()

    def consume_as_a() -> None:
        with (
            equeue.connect(url) as client,
            client.consumer("g", TOPIC, consumer_id="a", session_timeout=SESSION) as a,
        ):
            deadline = time.monotonic() + 60
            while not stop.is_set() and time.monotonic() < deadline:
                message = a.poll(0.2)
                if message is not None:
                    handled["a"].append((message.queue_id, message.queue_offset))
                    a_started.set()
                    time.sleep(0.02)  # busy: 400 messages would take it 8 s

    thread = threading.Thread(target=consume_as_a)
    thread.start()
    try:
        assert a_started.wait(30)  # a holds every queue
        with (
            equeue.connect(url) as client,
            client.consumer(
                "g", TOPIC, consumer_id="b", session_timeout=SESSION, timeout=TIMEOUT
            ) as b,
        ):
            for message in b:  # ends once its share gave nothing for TIMEOUT
                handled["b"].append((message.queue_id, message.queue_offset))
                if len(handled["b"]) == COUNT:
                    break
    finally:
        stop.set()
        thread.join(30)
    # before: b's iteration ended after 0.5 s with nothing (it heard of its queues 1 s
    # after the join)
    assert handled["b"]
    assert not set(handled["a"]) & set(handled["b"])  # a clean handover: none twice


def test_an_asyncio_joiner_with_a_short_timeout_gets_its_share(url: str) -> None:
    async def consume() -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        handled_a: list[tuple[int, int]] = []
        handled_b: list[tuple[int, int]] = []
        stop = asyncio.Event()

        async def consume_as_a(started: asyncio.Event) -> None:
            client = await equeue.aio.connect(url)
            a = AsyncGroupConsumer(client, "g", TOPIC, consumer_id="a", session_timeout=SESSION)
            async with a:
                deadline = time.monotonic() + 60
                while not stop.is_set() and time.monotonic() < deadline:
                    message = await a.poll(0.2)
                    if message is not None:
                        handled_a.append((message.queue_id, message.queue_offset))
                        started.set()
                        await asyncio.sleep(0.02)
            await client.close()

        started = asyncio.Event()
        task = asyncio.create_task(consume_as_a(started))
        try:
            await asyncio.wait_for(started.wait(), 30)
            client = await equeue.aio.connect(url)
            b = AsyncGroupConsumer(
                client, "g", TOPIC, consumer_id="b", session_timeout=SESSION, timeout=TIMEOUT
            )
            async with b:
                async for message in b:
                    handled_b.append((message.queue_id, message.queue_offset))
                    if len(handled_b) == COUNT:
                        break
            await client.close()
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)
        return handled_a, handled_b

    handled_a, handled_b = asyncio.run(consume())
    assert handled_b
    assert not set(handled_a) & set(handled_b)


def test_a_joiner_s_idle_clock_waits_for_a_stuck_holder_one_session_at_most(url: str) -> None:
    # a holds every queue and its caller never comes back (its heartbeat keeps the session:
    # max_poll_interval 300 s), so b's share is never released: b's iteration still ends,
    # its idle clock held for one session timeout (1 s) at most, then TIMEOUT
    with (
        equeue.connect(url) as client,
        client.consumer("g", TOPIC, consumer_id="a", session_timeout=SESSION) as a,
    ):
        assert a.poll(5.0) is not None  # a holds every queue, and stops polling
        with equeue.connect(url) as other:
            b = other.consumer("g", TOPIC, consumer_id="b", session_timeout=1.0, timeout=TIMEOUT)
            with b:
                got: list[equeue.Message] = []
                thread = threading.Thread(target=lambda: got.extend(b))
                thread.start()
                thread.join(30)
                assert not thread.is_alive()  # (before the bound: until a's session ended)
                assert got == [] and b.state.awaiting() == 2  # (of 4 queues and the retry one)


def _state(session_timeout: float) -> GroupState:
    return GroupState(
        "unix:x", "g", TOPIC, tags=None, batch_size=32, auto_commit=True,
        auto_commit_interval=1.0, session_timeout=session_timeout, max_poll_interval=300.0,
        max_retries=None, consumer_id="b",
    )  # fmt: skip


def _answer(interval_ms: int, assignment: list[list[object]], **more: object) -> dict[str, object]:
    return {"generation": 2, "assignment": assignment, "heartbeat_interval_ms": interval_ms, **more}


def test_the_heartbeat_interval_and_the_idle_clock_follow_the_awaiting_count() -> None:
    state = _state(10.0)
    state.take(_answer(3333, []))  # a broker from before the count: as before
    assert (state.awaiting(), state.interval()) == (0, 3.333)
    assert state.hold_idle_clock(100.0, 2.0, 102.0) == 102.0
    state.take(_answer(3333, [], awaiting=2))  # a joiner holding nothing: 10x as often
    assert state.awaiting() == 2 and state.interval() == pytest.approx(0.3333)
    state.take(_answer(3333, [[TOPIC, 0]], awaiting=1))  # holds one: its own interval
    assert state.interval() == 3.333
    state.take(_answer(300, [], awaiting=1))  # never more often than the broker's tick
    assert state.interval() == 0.1
    # the idle clock restarts while awaiting, up to one session after the poll's start
    now = time.monotonic()
    held = state.hold_idle_clock(now, 2.0, now + 2.0)
    assert held is not None and held >= now + 2.0
    assert state.hold_idle_clock(now - 60, 2.0, now - 58) == now - 60 + 10.0 + 2.0
    assert state.hold_idle_clock(now, None, None) is None  # (no timeout: blocks anyway)
    for wrong in (-1, "2", True, None):  # not a count: none awaited
        state.take(_answer(3333, [], awaiting=wrong))
        assert state.awaiting() == 0
