"""The callers of a coalesced group woken as a direct send's caller is (equeue/cext/
groupwake.c): on asyncio's own loops each caller awaits a Waiter, and the group's answer
runs each caller's task at once inside the read, not through call_soon; in debug mode,
on uvloop, and while a caller waits for a place, through call_soon as before. What a
caller sees is unchanged: its own result, a cancel, a task's KeyboardInterrupt. Against
a real broker."""

from __future__ import annotations

import asyncio
import shutil
from typing import Any

import pytest
from client_helpers import counting_loop
from server_helpers import broker_with_topic_t, short_dir

import equeue.aio
from equeue import speedups
from equeue.server import BrokerThread
from equeue.server.config import ServerConfig
from equeue.store.types import SendResult

needs_c = pytest.mark.skipif(speedups.SPEEDUPS is None, reason="no C accelerator")
TASKS = 20
ROUNDS = 5


broker = pytest.fixture(broker_with_topic_t, scope="module", name="broker")


async def _rounds(client: equeue.aio.AsyncClient) -> list[list[SendResult]]:
    """TASKS tasks on one client, ROUNDS sends each, one at a time: coalesced."""

    async def lane(task: int) -> list[SendResult]:
        return [await client.send("t", b"%d:%d" % (task, n)) for n in range(ROUNDS)]

    async with asyncio.timeout(30):
        return list(await asyncio.gather(*(lane(task) for task in range(TASKS))))


@needs_c
@pytest.mark.parametrize("mode", ["asyncio", "debug", "uvloop"])
def test_a_groups_answer_runs_its_callers_tasks_without_call_soon(
    broker: BrokerThread, mode: str
) -> None:
    loop = counting_loop(mode)

    async def main() -> tuple[list[list[SendResult]], int, int]:
        client = await equeue.aio.connect(broker.urls[0])
        try:
            await client.send("t", b"warm")
            before = loop.soon
            requests = broker.broker.handlers.stats()["send_requests"]
            results = await _rounds(client)
            coalesced = TASKS * ROUNDS - (
                broker.broker.handlers.stats()["send_requests"] - requests
            )
            return results, loop.soon - before, coalesced
        finally:
            await client.close()

    try:
        results, soon, coalesced = loop.run_until_complete(main())
    finally:
        loop.close()
    for task, lane in enumerate(results):
        stored = [broker.store.get(r.message_id).body for r in lane]
        assert stored == [b"%d:%d" % (task, n) for n in range(ROUNDS)]
    assert coalesced >= TASKS * ROUNDS // 2  # (most sends went in groups)
    if mode == "asyncio":
        # each task's first step and its end (gather's callback), a flush a turn: none per
        # coalesced send (48 here; 147 with each caller woken by call_soon)
        assert soon <= 2 * TASKS + 2 * ROUNDS + 10, soon
    else:
        assert soon >= TASKS + coalesced, soon


@needs_c
def test_a_caller_cancelled_while_its_group_is_in_flight_is_cancelled_and_the_rest_answered(
    broker: BrokerThread,
) -> None:
    async def main() -> list[Any]:
        client = await equeue.aio.connect(broker.urls[0])
        try:
            await client.send("t", b"warm")
            tasks = [asyncio.ensure_future(client.send("t", b"c%d" % n)) for n in range(8)]
            await asyncio.sleep(0)  # each task's send made: the group written at turn end
            tasks[3].cancel()
            async with asyncio.timeout(10):
                return list(await asyncio.gather(*tasks, return_exceptions=True))
        finally:
            await client.close()

    outcomes = asyncio.run(main())
    assert type(outcomes[3]) is asyncio.CancelledError
    others = [o for n, o in enumerate(outcomes) if n != 3]
    assert [broker.store.get(o.message_id).body for o in others] == [
        b"c%d" % n for n in range(8) if n != 3
    ]


@needs_c
@pytest.mark.parametrize("raised", [KeyboardInterrupt, SystemExit])
def test_a_woken_task_raising_keyboardinterrupt_leaves_the_rest_of_its_group_answered(
    broker: BrokerThread, raised: type[BaseException]
) -> None:
    loop = asyncio.new_event_loop()
    bodies = [b"k%d" % n for n in range(8)]

    async def send(n: int, client: equeue.aio.AsyncClient) -> SendResult:
        result = await client.send("t", bodies[n])
        if n == 2:
            raise raised
        return result

    try:
        client = loop.run_until_complete(equeue.aio.connect(broker.urls[0]))
        try:
            loop.run_until_complete(client.send("t", b"warm"))
            tasks = [loop.create_task(send(n, client)) for n in range(len(bodies))]
            with pytest.raises(raised):
                loop.run_until_complete(asyncio.wait(tasks, timeout=10))
            # the others of the group were given their results (scheduled): they finish
            loop.run_until_complete(
                asyncio.wait([t for n, t in enumerate(tasks) if n != 2], timeout=10)
            )
            outcomes = [t.result() for n, t in enumerate(tasks) if n != 2]
            assert isinstance(tasks[2].exception(), raised)
            after = loop.run_until_complete(client.send("t", b"after"))
        finally:
            loop.run_until_complete(client.close())
    finally:
        loop.close()
    assert [broker.store.get(o.message_id).body for o in outcomes] == [
        b for n, b in enumerate(bodies) if n != 2
    ]
    assert broker.store.get(after.message_id).body == b"after"


def test_callers_waiting_for_a_place_each_get_their_own_result() -> None:
    # max_in_flight 4: most callers wait for a place; the groups' callers are then woken
    # through call_soon (the first released keeps its turn), each with its own result.
    base = short_dir()
    try:
        with BrokerThread(base / "store", ServerConfig(max_in_flight=4)) as thread:
            thread.store.create_topic("t", 2)

            async def main() -> list[list[SendResult]]:
                async with await equeue.aio.connect(thread.urls[0]) as client:
                    return await _rounds(client)

            results = asyncio.run(main())
            for task, lane in enumerate(results):
                stored = [thread.store.get(r.message_id).body for r in lane]
                assert stored == [b"%d:%d" % (task, n) for n in range(ROUNDS)]
    finally:
        shutil.rmtree(base, ignore_errors=True)
