"""An asyncio client made before a fork is closed in the child, and the parent's
connection is left to the parent: the child, running the inherited loop, reads none of
the parent's answers (reviewk F1: each process was handed the other's SendResults).

Under uvloop the child never runs (nor closes) the inherited loop: libuv's loop shares
its epoll set and its io_uring submission ring (epoll_ctl batching) with the parent's
copy until uv_loop_fork(), which uvloop neither calls nor exposes; a child running it
aborted either process about 1 run in 30 (libuv's "uv__epoll_ctl_flush: Assertion
`*ctl->sqhead != *ctl->sqtail' failed"; docs/client.md "fork"). The uvloop child does
what it is told to: a loop of its own, the parent's client refused there, and a client
of its own connected there."""

from __future__ import annotations

import asyncio
import os
import signal
import traceback
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


# (loop kind, the child's loop): no ("uvloop", "inherited"), see the module's words
CHILD_LOOPS = [("selector", "inherited"), ("selector", "fresh"), ("uvloop", "fresh")]


@pytest.mark.parametrize(("kind", "child_loop"), CHILD_LOOPS)
def test_an_asyncio_client_is_closed_in_a_forked_child_and_the_parent_keeps_its_own(
    broker: BrokerProcess, kind: str, child_loop: str
) -> None:
    forked_sends(broker.url, kind, child_loop)


def forked_sends(
    url: str,
    kind: str,
    child_loop: str,
    on: Callable[[Any], bool] = lambda client: True,
    **options: Any,
) -> None:
    """A client connected with ``options`` (test_shm_fork.py: shm=True; ``on`` says the
    connection is what they asked for), then a fork: the child's every send on it
    refused, on the inherited loop or on a ``fresh`` one of its own (where a client it
    connects stores its sends), the parent's stored as sent."""
    checker = equeue.connect(url)
    checker.create_topic("t", queue_count=4)
    loop = _new_loop(kind)
    try:
        client = loop.run_until_complete(equeue.aio.connect(url, timeout=20.0, **options))
        loop.run_until_complete(client.send("t", b"warm"))
        assert on(client)
        pid = os.fork()
        if pid == 0:  # the child: the inherited client, as a pre-fork server has
            code = 3
            try:
                signal.alarm(60)
                inherited = loop if child_loop == "inherited" else None
                code = _in_the_child(url, kind, inherited, client, on, options)
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        sent = loop.run_until_complete(_sends(client, b"parent"))
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        assert code == 0, CHILD_FAILED.get(code, f"the child ended with {code}")
        assert len(sent) == TASKS * SENDS
        wrong = [(mid, body) for mid, body in sent if checker.get(mid).body != body]
        assert wrong == []
        assert loop.run_until_complete(client.send("t", b"after")).topic == "t"
        loop.run_until_complete(client.close())
    finally:
        loop.close()
        checker.close()


CHILD_FAILED = {
    1: "the child's sends on the parent's client were not all refused",
    2: "the child's own client, on its own loop, did not store its sends as sent",
    3: "the child raised (its traceback is on stderr)",
}


def _in_the_child(
    url: str,
    kind: str,
    inherited: asyncio.AbstractEventLoop | None,
    client: equeue.aio.AsyncClient,
    on: Callable[[Any], bool],
    options: dict[str, Any],
) -> int:
    """The child's exit code (CHILD_FAILED). With no ``inherited`` loop it makes one
    of its own, as docs/client.md tells a child to, and leaves the parent's alone."""
    loop = inherited if inherited is not None else _new_loop(kind)
    if loop.run_until_complete(_refused(client)) != TASKS * SENDS:
        return 1
    if inherited is not None:
        return 0
    try:
        return 0 if loop.run_until_complete(_own_client_stores(url, on, options)) else 2
    finally:
        loop.close()


async def _own_client_stores(url: str, on: Callable[[Any], bool], options: dict[str, Any]) -> bool:
    own = await equeue.aio.connect(url, timeout=20.0, **options)
    try:
        sent = await _sends(own, b"child") if on(own) else []
    finally:
        await own.close()
    checker = equeue.connect(url)  # (made in this process)
    try:
        stored = [mid for mid, body in sent if checker.get(mid).body == body]
    finally:
        checker.close()
    return len(sent) == len(stored) == TASKS * SENDS
