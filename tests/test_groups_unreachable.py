"""Group members of both loops whose broker (`equeue serve`, a subprocess) is SIGKILLed:
``poll(timeout)`` ends (the rejoin's ConnectionLostError, or None once the caller's time
passed) within its timeout plus one connect_timeout, ``poll(None)`` raises after the
first failed rejoin, and the member reads on once the broker is back; a broker restarted
within connect_timeout is ridden through with no error (docs/groups.md, "A broker that
is gone"). Each wait is bounded by a watchdog (a thread, asyncio.wait_for), not timed."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from server_helpers import short_home

import equeue
import equeue.aio
from equeue.errors import ConnectionLostError

TOPIC = "t"
CONNECT_TIMEOUT = 1.0
POLL_TIMEOUT = 1.0
# How long a poll may take before the watchdog calls it stuck: its timeout, one
# connect_timeout, and room for a loaded machine (the bug never returned at all).
WATCHDOG_S = POLL_TIMEOUT + CONNECT_TIMEOUT + 20.0

home = pytest.fixture(short_home, name="home")


class ServedStore:
    """`equeue serve STORE` in a subprocess, killed and started again by the test."""

    def __init__(self, store: Path) -> None:
        self.store = store
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, *, wait: bool = True) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "equeue", "serve", str(self.store), "--quiet"],
            stdout=subprocess.PIPE,
        )
        if wait:
            self.wait_listening()

    def wait_listening(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        line = self.process.stdout.readline().decode()
        assert line.startswith("listening on "), line

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process is not None and self.process.stdout is not None:
            self.process.stdout.close()


@pytest.fixture
def served(home: Path) -> Iterator[ServedStore]:
    served = ServedStore(home / "store")
    served.start()
    try:
        with equeue.connect(str(served.store)) as client:
            client.create_topic(TOPIC, 2)
            client.send_batch(TOPIC, [b"%d" % i for i in range(10)])
        yield served
    finally:
        served.stop()


def bounded(served: ServedStore, call: Callable[[], Any]) -> tuple[str, Any]:
    """``call()`` in a thread: ("returned", value) or ("raised", error) once it ends; if it
    has not ended within WATCHDOG_S the broker is started again (the old loop then
    returned) and the test fails."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["returned"] = call()
        except BaseException as exc:
            box["raised"] = exc

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(WATCHDOG_S)
    if worker.is_alive():
        served.start()  # frees the stuck poll, so that the test ends
        worker.join(60)
        pytest.fail(f"poll did not end within {WATCHDOG_S} s with the broker gone")
    ((outcome, value),) = box.items()
    return outcome, value


def collect(consumer: Any, done: Callable[[list[bytes]], bool]) -> list[bytes]:
    """The bodies polled until ``done(bodies)``, at most 200 polls of 0.2 s."""
    bodies: list[bytes] = []
    for _ in range(200):
        if done(bodies):
            break
        if (message := consumer.poll(0.2)) is not None:
            bodies.append(message.body)
    return bodies


async def collect_aio(consumer: Any, done: Callable[[list[bytes]], bool]) -> list[bytes]:
    bodies: list[bytes] = []
    for _ in range(200):
        if done(bodies):
            break
        if (message := await consumer.poll(0.2)) is not None:
            bodies.append(message.body)
    return bodies


def ten(bodies: list[bytes]) -> bool:
    return len(bodies) == 10


def after(bodies: list[bytes]) -> bool:
    return b"after" in bodies


def test_a_blocking_members_poll_ends_while_its_broker_is_gone(served: ServedStore) -> None:
    client = equeue.connect(str(served.store), connect_timeout=CONNECT_TIMEOUT)
    consumer = client.consumer("g", TOPIC, session_timeout=2.0)
    try:
        assert len(collect(consumer, ten)) == 10
        served.kill()
        # poll(timeout): the rejoin's error, not a wait for ever
        outcome, error = bounded(served, lambda: consumer.poll(POLL_TIMEOUT))
        assert outcome == "raised" and isinstance(error, ConnectionLostError), (outcome, error)
        assert "connect_timeout" in str(error)
        # poll(None) too: after the first failed rejoin, not silently for ever
        outcome, error = bounded(served, lambda: consumer.poll(None))
        assert outcome == "raised" and isinstance(error, ConnectionLostError), (outcome, error)
        # the consumer stays usable: once the broker is back it joins again and reads on
        served.start()
        with equeue.connect(str(served.store)) as producer:
            producer.send(TOPIC, b"after")
        assert after(collect(consumer, after))
    finally:
        consumer.close()
        client.close()


def test_a_blocking_member_rides_through_a_broker_restarted_in_time(
    served: ServedStore,
) -> None:
    """The control: a broker back within connect_timeout is joined again inside the same
    poll, which returns a message (every uncommitted one comes again: at least once)."""
    client = equeue.connect(str(served.store), connect_timeout=30.0)
    consumer = client.consumer("g", TOPIC, session_timeout=2.0, auto_commit=False)
    try:
        assert len(collect(consumer, ten)) == 10
        served.kill()
        served.start(wait=False)  # the poll below finds it down, then back
        outcome, message = bounded(served, lambda: consumer.poll(25.0))
        assert outcome == "returned" and message is not None, (outcome, message)
        served.wait_listening()
    finally:
        consumer.close()
        client.close()


def test_an_asyncio_members_poll_ends_while_its_broker_is_gone(served: ServedStore) -> None:
    async def main() -> None:
        client = await equeue.aio.connect(str(served.store), connect_timeout=CONNECT_TIMEOUT)
        consumer = client.consumer("g", TOPIC, session_timeout=2.0)
        try:
            await consumer.start()
            assert len(await collect_aio(consumer, ten)) == 10
            served.kill()
            for timeout in (POLL_TIMEOUT, None):  # poll(None): after the first failed rejoin
                try:
                    found = await asyncio.wait_for(consumer.poll(timeout), WATCHDOG_S)
                except TimeoutError:
                    served.start()  # (the old loop returns once the broker is back)
                    pytest.fail(f"poll({timeout}) did not end within {WATCHDOG_S} s")
                except ConnectionLostError as exc:
                    assert "connect_timeout" in str(exc)
                else:
                    pytest.fail(f"poll({timeout}) returned {found!r} with the broker gone")
            served.start()
            with equeue.connect(str(served.store)) as producer:
                producer.send(TOPIC, b"after")
            assert after(await collect_aio(consumer, after))
        finally:
            await consumer.close()
            await client.close()

    asyncio.run(main())


def test_an_asyncio_member_rides_through_a_broker_restarted_in_time(
    served: ServedStore,
) -> None:
    async def main() -> None:
        client = await equeue.aio.connect(str(served.store), connect_timeout=30.0)
        consumer = client.consumer("g", TOPIC, session_timeout=2.0, auto_commit=False)
        try:
            await consumer.start()
            assert len(await collect_aio(consumer, ten)) == 10
            served.kill()
            served.start(wait=False)
            message = await asyncio.wait_for(consumer.poll(25.0), WATCHDOG_S + 25.0)
            assert message is not None
            served.wait_listening()
        finally:
            await consumer.close()
            await client.close()

    asyncio.run(main())
