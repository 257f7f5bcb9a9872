"""Many callers sharing one client when the broker goes away (a real ``equeue serve``,
SIGTERMed or SIGKILLed): one reconnect attempt runs at a time, and the callers waiting
behind a failed one get its failure (each its own ConnectionLostError, their message
in ``unsent``) instead of each trying again for the full connect_timeout. The next call
after that tries again: a broker back up is reconnected to. The attempts are counted
at the socket's connect (no timed assertion)."""

from __future__ import annotations

import asyncio
import gc
import logging
import re
import shutil
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from client_helpers import BrokerProcess

import equeue
import equeue.aio
from equeue.errors import ClosedError, ConnectionLostError

CALLERS = 32
CONNECT_TIMEOUT = 0.5


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="eq", dir="/tmp"))  # a socket path must be short
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def connects(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Every connect to a Unix socket made in this process (both clients' and asyncio's
    sock_connect end in socket.connect)."""
    made: list[object] = []
    real = socket.socket.connect

    def counted(sock: socket.socket, address: Any) -> None:
        if sock.family == socket.AF_UNIX:
            made.append(address)
        real(sock, address)

    monkeypatch.setattr(socket.socket, "connect", counted)
    return made


def gone(broker: BrokerProcess, how: str) -> None:
    if how == "sigterm":
        broker.stop()  # the drain: the broker answers what it holds and exits
    else:
        broker.kill()


def attempts_of(error: BaseException) -> int:
    found = re.search(r"\((\d+) attempts\)", str(error))
    assert found is not None, str(error)
    return int(found.group(1))


def check_failures(results: list[Any], bodies: list[bytes], connects: list[object]) -> None:
    assert all(isinstance(r, ConnectionLostError) for r in results), results
    assert len({id(r) for r in results}) == CALLERS  # each caller its own instance
    for error, body in zip(results, bodies, strict=True):
        assert [m.body for m in error.unsent] == [body]  # never written: safe to resend
        assert error.unanswered == []
        assert f"connect_timeout={CONNECT_TIMEOUT:g}s" in str(error)
    # One failed attempt (a few connects, retried with a growing pause) serves them all;
    # before the fix each caller made its own: CALLERS times as many.
    most = max(attempts_of(r) for r in results)
    assert 1 <= len(connects) <= 2 * most, (len(connects), most)


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_aio_tasks_share_one_failed_reconnect(
    base: Path, connects: list[object], how: str, caplog: pytest.LogCaptureFixture
) -> None:
    bodies = [b"m%d" % i for i in range(CALLERS)]

    async def scenario() -> None:
        with BrokerProcess(base / "store") as broker:
            client = await equeue.aio.connect(broker.url, connect_timeout=CONNECT_TIMEOUT)
            await client.send("t", b"before")
            gone(broker, how)
            for _ in range(200):  # the loop reads the end of the stream (bounded)
                if "disconnected" in repr(client):
                    break
                await asyncio.sleep(0.01)
            assert "disconnected" in repr(client)
            connects.clear()
            results = await asyncio.gather(
                *(client.send("t", body) for body in bodies), return_exceptions=True
            )
            check_failures(results, bodies, connects)
            broker.start()
            connects.clear()
            result = await client.send("t", b"after")  # the next call tries again
            assert len(connects) == 1
            assert (await client.get(result.message_id)).body == b"after"
            await client.close()

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio.run(scenario())
        gc.collect()  # (an unretrieved future's error is logged when it is collected)
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_sync_threads_share_one_failed_reconnect(
    base: Path, connects: list[object], how: str
) -> None:
    bodies = [b"s%d" % i for i in range(CALLERS)]
    results: list[Any] = [None] * CALLERS
    with BrokerProcess(base / "store") as broker:
        client = equeue.connect(broker.url, connect_timeout=CONNECT_TIMEOUT)
        client.send("t", b"before")
        gone(broker, how)
        connects.clear()
        start = threading.Barrier(CALLERS)

        def call(index: int) -> None:
            start.wait(30)
            try:
                results[index] = client.send("t", bodies[index])
            except ConnectionLostError as exc:
                results[index] = exc

        threads = [threading.Thread(target=call, args=(i,)) for i in range(CALLERS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert not any(thread.is_alive() for thread in threads)
        check_failures(results, bodies, connects)
        broker.start()
        connects.clear()
        result = client.send("t", b"after")  # the next call tries again
        assert len(connects) == 1
        assert client.get(result.message_id).body == b"after"
        client.close()


def test_control_a_live_broker_is_not_reconnected(base: Path, connects: list[object]) -> None:
    with BrokerProcess(base / "store") as broker:

        async def tasks() -> list[Any]:
            client = await equeue.aio.connect(broker.url, connect_timeout=CONNECT_TIMEOUT)
            try:
                return await asyncio.gather(*(client.send("t", b"a") for _ in range(CALLERS)))
            finally:
                await client.close()

        with equeue.connect(broker.url, connect_timeout=CONNECT_TIMEOUT) as client:
            assert len(connects) == 1
            results: list[Any] = [None] * CALLERS

            def call(index: int) -> None:
                results[index] = client.send("t", b"s")

            threads = [threading.Thread(target=call, args=(i,)) for i in range(CALLERS)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
            assert len(connects) == 1
            assert all(r is not None and r.message_id for r in results)
        sent = asyncio.run(tasks())
        assert len(connects) == 2  # the asyncio client's one connect
        assert len({r.message_id for r in sent}) == CALLERS


def test_aio_a_cancelled_waiter_or_close_ends_no_one_elses_wait(
    base: Path, connects: list[object]
) -> None:
    async def scenario() -> None:
        with BrokerProcess(base / "store") as broker:
            client = await equeue.aio.connect(broker.url, connect_timeout=CONNECT_TIMEOUT)
            broker.kill()
            for _ in range(200):  # the loop reads the end of the stream (bounded)
                if "disconnected" in repr(client):
                    break
                await asyncio.sleep(0.01)
            connects.clear()
            waiting = [asyncio.create_task(client.ping()) for _ in range(4)]
            await asyncio.sleep(0.05)  # (they wait for the one attempt)
            waiting[0].cancel()
            results = await asyncio.gather(*waiting, return_exceptions=True)
            assert isinstance(results[0], asyncio.CancelledError)
            assert all(isinstance(r, ConnectionLostError) for r in results[1:]), results
            first = results[1]
            assert isinstance(first, ConnectionLostError)
            assert len(connects) <= attempts_of(first)  # one attempt, not cancelled
            closing = [asyncio.create_task(client.ping()) for _ in range(4)]
            await asyncio.sleep(0.05)
            await client.close()  # ends the attempt: its waiters learn the client closed
            ended = await asyncio.gather(*closing, return_exceptions=True)
            assert all(isinstance(r, ClosedError) for r in ended), ended

    asyncio.run(scenario())
