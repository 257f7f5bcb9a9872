"""A real ``equeue serve --flush sync`` under 64 ``equeue.aio`` connections, one send in
flight each (the shape the group commit's add in C is for: cext/commitadd.c, its stats
show it made adds): after a SIGKILL every acknowledged send is in the store, read back by
a ``read_only`` store in this process (not the broker's); the control, a SIGTERM after a
fixed count, finds every send acknowledged and stored.

A SIGKILL leaves the page cache: test_server_kill.py says what that shows and where the
answer-after-fdatasync ordering is tested."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from server_helpers import short_home
from test_server_kill import start_broker

import equeue.aio
from equeue import MessageStore, speedups
from equeue.errors import EQueueError
from equeue.server.groupcommit import CrossClientCommit

pytestmark = pytest.mark.skipif(speedups.SPEEDUPS is None, reason="needs the C accelerator")

home = pytest.fixture(short_home, name="home")

CONNECTIONS = 64
TOPIC = "t"
KILL_AFTER = 4000  # acknowledged sends in all before the SIGKILL
MOST = 400  # sends a connection makes at most (the loops' bound)
LIMIT_S = 60.0


def loaded_speedups(pid: int) -> set[str]:
    maps = Path(f"/proc/{pid}/maps").read_text()
    return {line.split()[-1] for line in maps.splitlines() if "_speedups" in line}


async def produce(
    url: str, broker: subprocess.Popen[bytes], kill: bool, count: int
) -> tuple[dict[bytes, str], dict[str, Any]]:
    """Each connection sends up to ``count`` (one in flight); with ``kill`` the broker is
    SIGKILLed once KILL_AFTER are acknowledged. The acknowledged bodies and their ids, and
    the broker's stats just before the signal."""
    clients = [await equeue.aio.connect(url) for _ in range(CONNECTIONS + 1)]
    acked: dict[bytes, str] = {}
    stats: dict[str, Any] = {}
    enough = asyncio.Event()

    async def lane(number: int, client: Any) -> None:
        for i in range(count):
            body = b"c%d:%d" % (number, i)
            try:
                result = await client.send(TOPIC, body)
            except EQueueError:  # the broker is gone: this one's answer never came
                return
            acked[body] = result.message_id
            if len(acked) >= KILL_AFTER:
                enough.set()

    try:
        lanes = [asyncio.create_task(lane(n, c)) for n, c in enumerate(clients[:-1])]
        if kill:
            await asyncio.wait_for(enough.wait(), LIMIT_S)
            stats = await clients[-1].stats()
            broker.send_signal(signal.SIGKILL)
        await asyncio.wait_for(asyncio.gather(*lanes), LIMIT_S)
        if not kill:
            stats = await clients[-1].stats()
    finally:
        for client in clients:
            with contextlib.suppress(EQueueError):  # (the broker killed under it)
                await client.close()
    return acked, stats


def stored(store: Path) -> dict[bytes, str]:
    with MessageStore.open(store, read_only=True) as reader:
        found: dict[bytes, str] = {}
        for queue_id in reader.queue_ids(TOPIC):
            offset = 0
            while True:
                got = reader.pull(TOPIC, queue_id, offset, 1000)
                if not got.messages:
                    break
                found.update((m.body, m.message_id) for m in got.messages)
                offset = got.next_offset
        return found


@pytest.mark.parametrize("kill", [True, False], ids=["sigkill", "control"])
def test_64_connections_lose_no_acknowledged_send(home: Path, kill: bool) -> None:
    # the broker's commit is the one C adds to
    assert CrossClientCommit._c_policy == (CrossClientCommit.add, CrossClientCommit._due)
    store = home / "s"
    broker, url = start_broker(store, "--flush", "sync")
    try:
        fast = speedups.SPEEDUPS
        assert fast is not None and fast.__file__ is not None
        # the broker runs this tree's accelerator (PYTHONPATH inherited)
        assert str(Path(fast.__file__).resolve()) in loaded_speedups(broker.pid)
        count = MOST if kill else 50
        acked, stats = asyncio.run(produce(url, broker, kill, count))
        if not kill:
            broker.send_signal(signal.SIGTERM)
        code = broker.wait(60)
    finally:
        if broker.poll() is None:
            broker.kill()
            broker.wait()
    assert stats["group_commit_adds_in_c"] > 0, stats  # the C path was taken
    assert stats["answers_written_directly"] > 0, stats  # and answers sent by C (answerwrite.c)
    assert code == (-signal.SIGKILL if kill else 0)
    found = stored(store)
    missing = [body for body in acked if body not in found]
    assert not missing, f"{len(missing)} acknowledged sends missing, e.g. {missing[:3]}"
    assert all(found[body] == message_id for body, message_id in acked.items())
    if kill:
        assert len(acked) >= KILL_AFTER
        assert len(found) <= CONNECTIONS * MOST
    else:  # the control: every send answered, every one stored, nothing else
        assert len(acked) == CONNECTIONS * count == len(found) == stats["sends"]
