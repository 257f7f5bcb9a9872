"""A coalesced group's callers, woken at once inside the read of its answer (the C
accelerator on asyncio's own loop), have their next sends written at the end of that
read when nothing else waits in the loop's pass (equeue/cext/groupanswer.c): no
``call_soon`` of the turn's ``_flush`` and no loop pass for it. When a callback does wait
in the pass (here: a task one caller made), the write is scheduled as before, so a send
that callback makes still joins the same request.

Against a real broker (its answers are the ones read in C); the requests counted by its
stats."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from client_helpers import temporary_broker

import equeue
import equeue.aio
from equeue import speedups

BOUND = 60.0  # seconds the client's run may take: past it, a hang
TASKS = 16
ROUNDS = 30

pytestmark = pytest.mark.skipif(
    speedups.SPEEDUPS is None, reason="the C accelerator is not built (or EQUEUE_PURE_PYTHON)"
)


class _FlushCounting(asyncio.SelectorEventLoop):
    """asyncio's loop, counting the call_soon calls of a connection's ``_flush``."""

    flushes = 0

    def call_soon(self, callback: Any, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        if getattr(callback, "__name__", "") == "_flush":
            self.flushes += 1
        return super().call_soon(callback, *args, **kwargs)


async def _produce(url: str, extra_at: int | None) -> list[list[str]]:
    """TASKS tasks sharing one client, ROUNDS sends each, one at a time; task 0, woken for
    its send ``extra_at``, first starts a task that sends b"extra" once."""
    client = await equeue.aio.connect(url, timeout=BOUND, connect_timeout=5)
    extra: list[asyncio.Task[Any]] = []
    try:

        async def one(task: int) -> list[str]:
            bodies = []
            for n in range(ROUNDS):
                if task == 0 and n == extra_at:
                    extra.append(asyncio.ensure_future(client.send("t", b"extra")))
                body = b"%d.%d" % (task, n)
                result = await client.send("t", body)
                bodies.append(result)
            return [f"{r.queue_id}:{r.queue_offset}" for r in bodies]

        async with asyncio.timeout(BOUND):
            results = list(await asyncio.gather(*(one(task) for task in range(TASKS))))
            if extra:
                await extra[0]
            return results
    finally:
        await client.close()


def _run(extra_at: int | None) -> tuple[int, int, list[bytes]]:
    """(the _flush call_soon calls, the broker's send requests, the bodies it stored)."""
    with temporary_broker() as broker:
        with equeue.connect(broker.url) as admin:
            admin.create_topic("t", 1)
            before = admin.stats()["send_requests"]
        loop = _FlushCounting()
        try:
            loop.run_until_complete(_produce(broker.url, extra_at))
        finally:
            loop.close()
        with equeue.connect(broker.url) as admin:
            requests = admin.stats()["send_requests"] - before
            stored = [m.body for m in admin.pull("t", 0, 0, TASKS * ROUNDS + 10)]
    return loop.flushes, requests, stored


def _expected_bodies(extra: bool) -> list[bytes]:
    bodies = [b"%d.%d" % (t, n) for t in range(TASKS) for n in range(ROUNDS)]
    return sorted(bodies + [b"extra"] * extra)


def test_a_woken_groups_next_sends_are_written_inside_the_read() -> None:
    flushes, requests, stored = _run(None)
    assert sorted(stored) == _expected_bodies(False)
    # one request a round, as before (the first round two: a lone send and the rest)
    assert requests <= ROUNDS + 2, requests
    # Only the first round's group (its sends made by the tasks' first steps, not inside
    # an answer's read) and the last (tasks ending) wait for a scheduled _flush; main: one
    # a round (31 for 30 rounds).
    assert flushes <= 4, flushes


def test_a_callback_waiting_in_the_pass_keeps_the_write_scheduled() -> None:
    base_flushes, base_requests, _ = _run(None)
    flushes, requests, stored = _run(ROUNDS // 2)
    assert sorted(stored) == _expected_bodies(True)
    # the extra task's send, made in the loop's next pass, joined its round's request:
    # no request more than without it; its round's write was a scheduled one
    assert requests <= base_requests, (requests, base_requests)
    assert flushes > base_flushes, (flushes, base_flushes)
