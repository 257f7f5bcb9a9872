"""A coalesced group's callers, woken by its answer, send next as one group: none of their
next sends goes alone at once (the direct path, or the coalescer's lone send) with the
rest in a second request, which the broker then often covers by an fdatasync of its own.
With the C accelerator (the callers run inside the read) and without it
(EQUEUE_PURE_PYTHON=1, in a child process: they run in the loop's next pass), and on
uvloop (asyncio Futures, woken through call_soon).

A fake broker answers a turn's two requests (the lone first send and the group of the
rest) in one write, as the real one does when one fdatasync covers both; the requests
the client writes next are recorded."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
from client_helpers import WELCOME, FakeBroker, Peer, run_pure_python
from hypothesis import given, settings
from hypothesis import strategies as st

import equeue.aio
from equeue import speedups
from equeue.protocol.frames import BODIES_VERSION, STATUS_OK, encode
from equeue.store.types import SendResult

BOUND = 10.0  # seconds the client's run may take: past it, a hang


def _answer(request: list[Any], offset: int) -> list[Any]:
    """The OK answer to a send or send_bodies, each body at its own offset (from
    ``offset``): its id names the body, so a caller given another's result shows."""
    request_id, op, args = request
    bodies = [args["body"]] if op == "send" else args["bodies"]
    ids = [body.decode() for body in bodies]
    offsets = list(range(offset, offset + len(bodies)))
    if op == "send":
        return [request_id, STATUS_OK, [ids[0], "t", 0, offsets[0], offsets[0], 1.0]]
    count = len(bodies)
    return [request_id, STATUS_OK, ["t", ids, [0] * count, offsets, offsets, [1.0] * count]]


def _script(tasks: int, rounds: int, seen: list[list[tuple[str, int]]]) -> Callable[[Peer], None]:
    """Welcome the client (protocol version 2), then per round: read requests until they
    hold ``tasks`` sends, record them (op, sends) and answer them all in one write."""

    def script(peer: Peer) -> None:
        peer.recv()
        peer.send({**WELCOME, "version": BODIES_VERSION})
        offset = 0
        for _ in range(rounds):
            requests: list[list[Any]] = []
            while sum(_sends(r) for r in requests) < tasks:
                requests.append(peer.recv())
            seen.append([(r[1], _sends(r)) for r in requests])
            answers = b""
            for request in requests:
                answers += encode(_answer(request, offset))
                offset += _sends(request)
            peer.raw(answers)
        peer.recv()  # until the client closes

    return script


def _request(sends: int) -> tuple[str, int]:
    """A coalesced request of ``sends`` as recorded (a group of one goes as a send)."""
    return ("send" if sends == 1 else "send_bodies", sends)


def _sends(request: list[Any]) -> int:
    return 1 if request[1] == "send" else len(request[2]["bodies"])


async def _produce(url: str, tasks: int, rounds: int) -> list[list[SendResult]]:
    """``tasks`` tasks sharing one client, each ``rounds`` sends one at a time."""
    client = await equeue.aio.connect(url, timeout=BOUND, connect_timeout=5)
    try:
        protocol = client._protocol
        assert protocol is not None
        # heard from "now" for the whole run: the first send goes alone, at once (the
        # direct path), whatever the machine's load (HEARD_RECENTLY is 20 ms)
        protocol.heard = time.monotonic() + 3600

        async def one(task: int) -> list[SendResult]:
            return [await client.send("t", b"%d.%d" % (task, n)) for n in range(rounds)]

        async with asyncio.timeout(BOUND):
            return list(await asyncio.gather(*(one(task) for task in range(tasks))))
    finally:
        await client.close()


def _run(tasks: int, rounds: int, make_loop: Callable[[], asyncio.AbstractEventLoop]) -> None:
    seen: list[list[tuple[str, int]]] = []
    with FakeBroker(_script(tasks, rounds, seen)) as fake:
        loop = make_loop()
        try:
            results = loop.run_until_complete(_produce(fake.url, tasks, rounds))
        finally:
            loop.close()
    # The first round: the first send alone, at once, the rest in the turn's group.
    assert seen[0] == [("send", 1), _request(tasks - 1)], seen
    # Every later round: the woken callers' sends in one request.
    assert seen[1:] == [[_request(tasks)]] * (rounds - 1), seen
    # Each caller got its own result, in its own order.
    for task, own in enumerate(results):
        assert [r.message_id for r in own] == [f"{task}.{n}" for n in range(rounds)]


def woken_group_sends_as_one(tasks: int, rounds: int) -> None:
    _run(tasks, rounds, asyncio.new_event_loop)


@pytest.mark.parametrize("path", ["c", "python"])
@pytest.mark.parametrize("tasks", [2, 16])
def test_a_woken_groups_callers_send_next_as_one_request(path: str, tasks: int) -> None:
    if path == "python":
        run_pure_python(
            f"import test_client_woken_group as m; m.woken_group_sends_as_one({tasks}, 4)"
        )
    elif speedups.SPEEDUPS is None:
        pytest.skip("the C accelerator is not built (or EQUEUE_PURE_PYTHON is set)")
    else:
        woken_group_sends_as_one(tasks, 4)


def test_a_woken_groups_callers_send_next_as_one_request_on_uvloop() -> None:
    uvloop = pytest.importorskip("uvloop")
    _run(16, 4, uvloop.new_event_loop)


@settings(max_examples=15, deadline=None)
@given(tasks=st.integers(2, 40), rounds=st.integers(2, 6))
def test_any_number_of_woken_callers_send_next_as_one_request(tasks: int, rounds: int) -> None:
    woken_group_sends_as_one(tasks, rounds)


def _script_group_alone(tasks: int, seen: list[list[tuple[str, int]]]) -> Callable[[Peer], None]:
    """The first round's lone send answered first, then (a read of its own) the group of
    the other ``tasks - 1``; their next sends recorded and answered."""

    def script(peer: Peer) -> None:
        peer.recv()
        peer.send({**WELCOME, "version": BODIES_VERSION})
        lone, group = peer.recv(), peer.recv()
        seen.append([(lone[1], _sends(lone)), (group[1], _sends(group))])
        peer.send(_answer(lone, 0))
        time.sleep(0.2)  # (its own read, very likely; both in one read is the test above)
        peer.send(_answer(group, 1))
        requests: list[list[Any]] = []
        while sum(_sends(r) for r in requests) < tasks - 1:
            requests.append(peer.recv())
        seen.append([(r[1], _sends(r)) for r in requests])
        answers = b""
        for request in requests:
            answers += encode(_answer(request, tasks))
        peer.raw(answers)
        peer.recv()  # until the client closes

    return script


async def _first_sends_once(url: str, tasks: int) -> list[list[SendResult]]:
    """Task 0 sends once, the others twice, one at a time, sharing one client."""
    client = await equeue.aio.connect(url, timeout=BOUND, connect_timeout=5)
    try:
        protocol = client._protocol
        assert protocol is not None
        protocol.heard = time.monotonic() + 3600  # (as in _produce)

        async def one(task: int) -> list[SendResult]:
            return [await client.send("t", f"{task}.{n}".encode()) for n in range(1 + (task > 0))]

        async with asyncio.timeout(BOUND):
            return list(await asyncio.gather(*(one(task) for task in range(tasks))))
    finally:
        await client.close()


def group_answered_alone_sends_as_one(tasks: int) -> None:
    seen: list[list[tuple[str, int]]] = []
    with FakeBroker(_script_group_alone(tasks, seen)) as fake:
        results = asyncio.run(_first_sends_once(fake.url, tasks))
    assert seen == [[("send", 1), _request(tasks - 1)], [_request(tasks - 1)]], seen
    for task, own in enumerate(results):
        assert [r.message_id for r in own] == [f"{task}.{n}" for n in range(1 + (task > 0))]


@pytest.mark.parametrize("path", ["c", "python"])
def test_a_group_answered_in_a_read_of_its_own_sends_next_as_one_request(path: str) -> None:
    # Nothing else in flight when the group's answer is read (the lone send answered
    # before, its task done): the group's callers, woken together, still send as one.
    if path == "python":
        run_pure_python(
            "import test_client_woken_group as m; m.group_answered_alone_sends_as_one(8)"
        )
    elif speedups.SPEEDUPS is None:
        pytest.skip("the C accelerator is not built (or EQUEUE_PURE_PYTHON is set)")
    else:
        group_answered_alone_sends_as_one(8)
