"""An asyncio client made before a fork is closed in the child, and the parent's
connection is left to the parent: the child, running the inherited loop, reads none of
the parent's answers (reviewk F1: each process was handed the other's SendResults)."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from client_helpers import BrokerProcess, temporary_broker

import equeue
import equeue.aio
from equeue.errors import ClosedError

TASKS = 8
SENDS = 100


@pytest.fixture
def broker() -> Iterator[BrokerProcess]:
    with temporary_broker() as running:
        yield running


async def _sends(client: equeue.aio.AsyncClient, tag: bytes) -> list[tuple[str, bytes]]:
    async def one_task(k: int) -> list[tuple[str, bytes]]:
        sent = []
        for i in range(SENDS):
            body = b"%s-%d-%d" % (tag, k, i)
            sent.append(((await client.send("t", body)).message_id, body))
        return sent

    done = await asyncio.gather(*(one_task(k) for k in range(TASKS)))
    return [pair for task in done for pair in task]


async def _refused(client: equeue.aio.AsyncClient) -> int:
    """Every send of the child refused as closed: the number refused, or 0 if one was
    answered (the parent's connection used)."""
    refused = 0
    for i in range(TASKS * SENDS):
        try:
            await asyncio.wait_for(client.send("t", b"child-%d" % i), 10)
        except ClosedError as exc:
            if "before this process forked" not in str(exc):
                return 0
            refused += 1
        else:
            return 0
        await asyncio.sleep(0)  # the loop runs: the inherited socket is looked at
    return refused


def _new_loop(kind: str) -> asyncio.AbstractEventLoop:
    if kind == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        return uvloop.new_event_loop()  # type: ignore[no-any-return]
    return asyncio.new_event_loop()  # the client's own transport (rawconn) on it


@pytest.mark.parametrize("kind", ["selector", "uvloop"])
def test_an_asyncio_client_is_closed_in_a_forked_child_and_the_parent_keeps_its_own(
    broker: BrokerProcess, kind: str
) -> None:
    forked_sends(broker.url, kind)


def forked_sends(
    url: str, kind: str, on: Callable[[Any], bool] = lambda client: True, **options: Any
) -> None:
    """A client connected with ``options`` (test_shm_fork.py: shm=True; ``on`` says the
    connection is what they asked for), then a fork: the child's every send on it
    refused, the parent's stored as sent."""
    checker = equeue.connect(url)
    checker.create_topic("t", queue_count=4)
    loop = _new_loop(kind)
    try:
        client = loop.run_until_complete(equeue.aio.connect(url, timeout=20.0, **options))
        loop.run_until_complete(client.send("t", b"warm"))
        assert on(client)
        pid = os.fork()
        if pid == 0:  # the child: the inherited loop and client, as a pre-fork server has
            code = 3
            try:
                signal.alarm(60)
                refused = loop.run_until_complete(_refused(client))
                code = 0 if refused == TASKS * SENDS else 1
            finally:
                os._exit(code)
        sent = loop.run_until_complete(_sends(client, b"parent"))
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the child's sends were not all refused"
        assert len(sent) == TASKS * SENDS
        wrong = [(mid, body) for mid, body in sent if checker.get(mid).body != body]
        assert wrong == []
        assert loop.run_until_complete(client.send("t", b"after")).topic == "t"
        loop.run_until_complete(client.close())
    finally:
        loop.close()
        checker.close()
