"""The asyncio client's ring groups (equeue/client/shmconn.py) over their life: what a
group holds after its connections close, what an exec'd child inherits, what a forked
child is left with when its at-fork hook cannot make a socket."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import time
import warnings
import weakref
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import pytest
from test_shm import _broker, _url, _wait_for

import equeue.aio
from equeue.client import forks, shmconn
from equeue.protocol import shmrings
from equeue.server import BrokerThread

pytestmark = pytest.mark.skipif(not shmrings.AVAILABLE, reason="needs the C accelerator, Linux")


@pytest.fixture(name="broker")
def _default_broker() -> Iterator[BrokerThread]:
    yield from _broker()


@pytest.fixture(name="second")
def _second_broker() -> Iterator[BrokerThread]:
    yield from _broker()


# What a client's rings, groups and loops open: sockets, the ring regions, epoll sets
_KINDS = ("socket:", "/memfd:", "anon_inode:")
SETTLE_S = 20.0


def _descriptors() -> set[tuple[str, int]]:
    """This process's open descriptors as (what /proc names, inode): identities, not a
    count, so that descriptors other code closes meanwhile (the broker thread's of
    earlier connections) cannot hide one added (review9 R9-3: 124 against 126 passed a
    check of "no more than before")."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # (closed meanwhile; the listing's own)
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(_KINDS):
                found.add((target, os.stat(f"/proc/self/fd/{fd}").st_ino))
    return found


def _added_since(before: set[tuple[str, int]]) -> set[tuple[str, int]]:
    """The sockets, memfds and epoll sets opened since ``before`` and still open once the
    in-process broker has closed its side of the connections that ended (it does so on
    its own thread, after the client's end): a leak stays past SETTLE_S."""
    deadline = time.monotonic() + SETTLE_S
    while (added := _descriptors() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    return added


def test_a_loop_that_used_rings_leaves_no_group_descriptor_or_loop_behind(
    broker: BrokerThread,
) -> None:
    """An asyncio.run() a job, each connecting on rings: a group kept per loop held its
    loop and its wake-up descriptor for the life of the process (reviewshm2 N7: 50 runs,
    50 descriptors and 50 loops kept; ~1,000 runs and RLIMIT_NOFILE is reached)."""
    loops: list[weakref.ref[asyncio.AbstractEventLoop]] = []

    async def job(i: int) -> None:
        loops.append(weakref.ref(asyncio.get_running_loop()))
        client = await equeue.aio.connect(_url(broker), shm=True, timeout=10)
        try:
            assert (await client.send("t", b"job %d" % i)).queue_offset == i
        finally:
            await client.close()

    asyncio.run(job(0))  # (what the first run opens for good: the client's imports)
    gc.collect()
    before = _descriptors()
    for i in range(1, 21):
        asyncio.run(job(i))
    gc.collect()
    assert _added_since(before) == set()  # (a leak adds one a run)
    assert len(shmconn._groups) == 0
    assert [ref() for ref in loops] == [None] * 21


def _run(factory: Callable[[], asyncio.AbstractEventLoop], job: Coroutine[Any, Any, None]) -> None:
    loop = factory()
    try:
        loop.run_until_complete(job)
    finally:
        loop.close()


@pytest.mark.parametrize("event_loop", ["asyncio", "uvloop"])
def test_clients_a_job_did_not_close_go_with_its_closed_loop(
    broker: BrokerThread, event_loop: str
) -> None:
    """Jobs each on a loop of its own that connect on rings and return without close()
    (one that raised before it, a forgotten one): once the loop is closed and dropped, the
    collector takes the clients, their groups and descriptors, as it does a socket
    connection's (review9 R9-5: the table of groups held each loop, and through it its
    rings: 21 jobs kept 21 loops, 42 sockets and 21 connections at the broker)."""
    factory: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop
    if event_loop == "uvloop":
        factory = pytest.importorskip("uvloop").new_event_loop
    loops: list[weakref.ref[asyncio.AbstractEventLoop]] = []

    async def job(i: int) -> None:
        loops.append(weakref.ref(asyncio.get_running_loop()))
        client = await equeue.aio.connect(_url(broker), shm=True, timeout=10)
        assert (await client.send("t", b"job %d" % i)).queue_offset == i  # and no close()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)  # (the sockets the collector closes)
        _run(factory, job(0))  # (what the first run opens for good: the client's imports)
        gc.collect()
        before = _descriptors()
        for i in range(1, 21):
            _run(factory, job(i))
        gc.collect()
    assert _added_since(before) == set()
    assert len(shmconn._groups) == 0
    assert [ref() for ref in loops] == [None] * 21
    shm = broker.broker.shm
    assert shm is not None
    _wait_for(lambda: not shm.groups, "the broker kept a group of a collected client")


def test_a_group_lives_while_one_of_its_connections_does(broker: BrokerThread) -> None:
    """Two connections, one group; the first closed, the second goes on being woken; the
    second closed, the group and its descriptor go."""

    async def run() -> tuple[bool, int, bool]:
        loop = asyncio.get_running_loop()
        first = await equeue.aio.connect(_url(broker), shm=True, timeout=10)
        second = await equeue.aio.connect(_url(broker), shm=True, timeout=10)
        group = second._protocol.transport.group  # type: ignore[union-attr]
        await first.close()
        kept = shmconn._groups.get(loop) is not None and group.wake_fd >= 0
        offset = (await second.send("t", b"second")).queue_offset
        await second.close()
        return kept, offset, loop in shmconn._groups

    kept, offset, still = asyncio.run(run())
    assert kept and offset == 0 and not still


def test_the_descriptors_of_a_welcome_are_not_inherited_by_an_exec(broker: BrokerThread) -> None:
    """recvmsg without MSG_CMSG_CLOEXEC: the group's wake-up end stayed open in every
    program the client process exec'd (reviewshm2 N3)."""

    async def run() -> bool:
        client = await equeue.aio.connect(_url(broker), shm=True, timeout=10)
        try:
            group = client._protocol.transport.group  # type: ignore[union-attr]
            return os.get_inheritable(group.wake_fd)
        finally:
            await client.close()

    assert asyncio.run(run()) is False


def test_a_forked_child_that_cannot_make_a_socket_still_unmaps_every_group(
    broker: BrokerThread, second: BrokerThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two groups (two brokers); the child's hook cannot make its dead socket (a full
    descriptor table: EMFILE): every ring is unmapped all the same and the groups are
    forgotten (reviewshm2 N8: the first OSError left the second group mapped)."""

    def no_socket(fd: int) -> None:
        raise OSError(24, "Too many open files")

    async def run() -> dict[str, Any]:
        clients = [
            await equeue.aio.connect(_url(b), shm=True, timeout=10) for b in (broker, second)
        ]
        try:
            rings: list[Any] = [c._protocol.transport for c in clients]  # type: ignore[union-attr]
            assert all(ring.room() > 0 for ring in rings)
            monkeypatch.setattr(forks, "point_at_a_dead_socket", no_socket)
            reader, writer = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(reader)
                child = {"groups": len(shmconn._groups), "room": [r.room() for r in rings]}
                os.write(writer, json.dumps(child).encode())
                os._exit(0)
            monkeypatch.undo()
            os.close(writer)
            with os.fdopen(reader, "rb") as got:
                seen: dict[str, Any] = json.loads(got.read())
            assert os.waitpid(pid, 0)[1] == 0
            seen["parent_room"] = [ring.room() for ring in rings]
            seen["parent_sends"] = [(await c.send("t", b"after")).queue_offset for c in clients]
            return seen
        finally:
            for client in clients:
                await client.close()

    seen = asyncio.run(run())
    assert seen["groups"] == 0
    assert seen["room"] == [0, 0]
    assert all(room > 0 for room in seen["parent_room"])
    assert seen["parent_sends"] == [0, 0]
