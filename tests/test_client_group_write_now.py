"""A coalesced group's callers, woken at once inside the read of its answer (the C
accelerator on asyncio's own loop), have their next sends written at the end of that
read when nothing else waits in the loop's pass (equeue/cext/groupanswer.c): no
``call_soon`` of the turn's ``_flush`` and no loop pass for it. When a callback does wait
in the pass (here: a task one caller made), the write is scheduled as before, so a send
that callback makes still joins the same request.

Against a real broker (its answers are the ones read in C); each coalesced request's
bodies recorded as the client makes it (the broker's request count varies with how the
first round's lone send and group are answered under load)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from client_helpers import temporary_broker

import equeue
import equeue.aio
from equeue import speedups
from equeue.client import aio

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


def _run(extra_at: int | None) -> tuple[int, list[list[bytes]], list[bytes]]:
    """(the _flush call_soon calls, each coalesced request's bodies, the bodies stored)."""
    requests: list[list[bytes]] = []
    put = aio._Protocol.put

    def recording(self: Any, request_id: int, frame: bytes, answer: Any) -> None:
        requests.append(list(answer.bodies))
        put(self, request_id, frame, answer)

    with temporary_broker() as broker, pytest.MonkeyPatch.context() as patch:
        patch.setattr(aio._Protocol, "put", recording)
        with equeue.connect(broker.url) as admin:
            admin.create_topic("t", 1)
        loop = _FlushCounting()
        try:
            loop.run_until_complete(_produce(broker.url, extra_at))
        finally:
            loop.close()
        with equeue.connect(broker.url) as admin:
            stored = [m.body for m in admin.pull("t", 0, 0, TASKS * ROUNDS + 10)]
    return loop.flushes, requests, stored


def _expected_bodies(extra: bool) -> list[bytes]:
    bodies = [b"%d.%d" % (t, n) for t in range(TASKS) for n in range(ROUNDS)]
    return sorted(bodies + [b"extra"] * extra)


def test_a_woken_groups_next_sends_are_written_inside_the_read() -> None:
    flushes, _, stored = _run(None)
    assert sorted(stored) == _expected_bodies(False)
    # Only a group not made inside an answer's read (the first round's, made by the
    # tasks' first steps; a send answered alone under load) waits for a scheduled _flush;
    # main: one a round (31 for 30 rounds).
    assert flushes <= ROUNDS // 3, flushes


def test_a_callback_waiting_in_the_pass_keeps_the_write_scheduled() -> None:
    extra_at = ROUNDS // 2
    _, requests, stored = _run(extra_at)
    assert sorted(stored) == _expected_bodies(True)
    # the extra task's send, made in the loop's next pass, joined the request of the
    # send its maker made in the same turn (with the write made inside the read, it went
    # in a request of its own)
    (joined,) = [bodies for bodies in requests if b"extra" in bodies]
    assert b"0.%d" % extra_at in joined, requests


def test_an_error_of_the_write_now_goes_to_the_loops_handler_as_a_callbacks_would() -> None:
    # _flush raising where the read called it: reported to the loop's exception handler
    # (as Handle._run reports a scheduled _flush's), and the answered group not put back
    # in pending (its callers have their results: a stale entry would time out later)
    seen: list[dict[str, Any]] = []
    flush = aio._Protocol._flush
    calls, raised = [0], [0]

    def flaky(self: Any) -> None:
        flush(self)  # (the group written: the run goes on)
        calls[0] += 1
        if calls[0] == ROUNDS // 2:  # (a round's write made inside the read)
            raised[0] += 1
            raise RuntimeError("the write failed (from the test)")

    async def run(url: str) -> int:
        asyncio.get_running_loop().set_exception_handler(lambda _, context: seen.append(context))
        client = await equeue.aio.connect(url, timeout=BOUND, connect_timeout=5)
        try:

            async def one(task: int) -> None:
                for n in range(ROUNDS):
                    await client.send("t", b"%d.%d" % (task, n))

            async with asyncio.timeout(BOUND):
                await asyncio.gather(*(one(task) for task in range(TASKS)))
            assert client._protocol is not None
            return len(client._protocol.pending)
        finally:
            await client.close()

    with temporary_broker() as broker, pytest.MonkeyPatch.context() as patch:
        with equeue.connect(broker.url) as admin:
            admin.create_topic("t", 1)
        patch.setattr(aio._Protocol, "_flush", flaky)
        loop = _FlushCounting()
        try:
            left = loop.run_until_complete(run(broker.url))
        finally:
            loop.close()
        with equeue.connect(broker.url) as admin:
            stored = [m.body for m in admin.pull("t", 0, 0, TASKS * ROUNDS + 10)]
    assert sorted(stored) == _expected_bodies(False)
    assert raised == [1]
    assert [str(c.get("exception")) for c in seen] == ["the write failed (from the test)"], seen
    assert left == 0  # nothing in flight once every send is answered
