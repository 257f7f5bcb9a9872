"""``--busy-poll-us`` (equeue/server/busypoll.py): the setting is checked; a real ``equeue
serve`` that polled during a burst of durable sends (its stats say so) sleeps again once
the window passes (its CPU over a second of idleness, from /proc, and no poll counted
meanwhile); with it on, a SIGKILLed broker lost no acknowledged send (read back by a
read_only store in another process) and SIGTERM drains (the control: every acknowledged
send is there)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from server_helpers import short_home
from test_server_kill import acknowledged, start_broker

import equeue.aio
from equeue.errors import ConfigError
from equeue.server.config import MAX_BUSY_POLL_US, ServerConfig

HERE = Path(__file__).parent
CONNECTIONS = 16
PRODUCERS = 3
home = pytest.fixture(short_home, name="home")

READ_BACK = """
import json, sys
from equeue import MessageStore
wanted = json.load(sys.stdin)
found = 0
with MessageStore.open(sys.argv[1], read_only=True) as store:
    for message_id, body in wanted:
        found += store.get(message_id).body == body.encode()
print(found)
"""


@pytest.mark.parametrize("value", [-1, MAX_BUSY_POLL_US + 1, "100", 1.5, True])
def test_bad_values_are_refused_naming_the_setting(value: object) -> None:
    with pytest.raises(ConfigError, match="busy_poll_us"):
        ServerConfig(flush="sync", busy_poll_us=value)  # type: ignore[arg-type]


def test_it_is_refused_without_the_group_commit() -> None:
    for flush in ("async", "os"):
        with pytest.raises(ConfigError, match=r"busy_poll_us=50 \(--busy-poll-us\)"):
            ServerConfig(flush=flush, busy_poll_us=50)
    assert ServerConfig(flush="async", busy_poll_us=0).busy_poll_us == 0
    assert ServerConfig(flush="sync", busy_poll_us=MAX_BUSY_POLL_US).busy_poll_us == 10_000
    # with no group-commit wait nothing counts the sends expected back: it would never start
    with pytest.raises(ConfigError, match=r"group_commit_wait_us=0"):
        ServerConfig(flush="sync", busy_poll_us=50, group_commit_wait_us=0)
    assert ServerConfig(flush="sync", busy_poll_us=50, group_commit_wait_us=1).busy_poll_us == 50


def test_the_command_line_refuses_a_bad_value(home: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "equeue", "serve", str(home / "s"), "--flush", "sync",
         "--busy-poll-us", "-3"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0
    assert "busy_poll_us=-3" in done.stderr
    assert not (home / "s").exists()  # refused before the store was created


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start(store: Path, *extra: str) -> tuple[subprocess.Popen[bytes], str]:
    return start_broker(store, "--flush", "sync", *extra)


@contextlib.contextmanager
def served(store: Path, *extra: str) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """``equeue serve --flush sync`` for the block, which then stops it with SIGTERM and
    requires a clean exit; killed if the block failed before."""
    broker, url = start(store, *extra)
    try:
        yield broker, url
        broker.send_signal(signal.SIGTERM)
        assert broker.wait(60) == 0
    finally:
        if broker.poll() is None:
            broker.kill()
            broker.wait()


async def burst(url: str, sends: int) -> dict[str, int]:
    """A durable burst from CONNECTIONS connections: the broker's stats after it."""
    return (await burst_then_stats(url, sends, stats_for=0.0))[1]


async def burst_then_stats(
    url: str, sends: int, stats_for: float = 0.4
) -> tuple[dict[str, int], dict[str, int]]:
    """A durable burst, then a stats request every 2 ms for ``stats_for`` seconds: the
    broker's stats ~0.1 s after the burst (empty if sooner) and at the end."""
    clients = await asyncio.gather(*(equeue.aio.connect(url) for _ in range(CONNECTIONS)))

    async def lane(client: equeue.aio.AsyncClient) -> None:
        for _ in range(sends):
            await client.send("t", b"x" * 100)

    try:
        await asyncio.gather(*(lane(c) for c in clients))
        began = time.monotonic()
        first: dict[str, int] = {}
        for _ in range(1000):  # bounded in count and time
            stats = await clients[0].stats()
            elapsed = time.monotonic() - began
            if not first and elapsed >= 0.1:
                first = stats
            if elapsed >= stats_for:
                return first, stats
            await asyncio.sleep(0.002)
        return first, await clients[0].stats()
    finally:
        for client in clients:
            await client.close()


def test_a_stream_of_stats_does_not_keep_it_polling(home: Path) -> None:
    # review 34a: any request used to open a new window, so a client asking for stats
    # every few ms kept the loop polling (72 % of a core) long after the last send
    with served(home / "s", "--busy-poll-us", "10000") as (_, url):
        first, last = asyncio.run(burst_then_stats(url, 100))
    assert first["busy_poll_starts"] >= 1, first  # it polled during the burst
    assert last["busy_polls"] == first["busy_polls"], (first, last)


def test_an_idle_broker_stops_polling_after_the_window(home: Path) -> None:
    # A 5 ms window: well past any round, so the poll surely ran during the burst
    with served(home / "s", "--busy-poll-us", "5000") as (broker, url):
        stats = asyncio.run(burst(url, 200))
        assert stats["flushes"] > 0
        # it polled, and stopped and started again between rounds
        assert stats["busy_polls"] > stats["busy_poll_starts"] >= 1, stats
        with equeue.connect(url) as client:
            time.sleep(0.2)  # the window (5 ms) passed
            settled = client.stats()  # (a stats request does not start the poll)
            before, began = cpu_seconds(broker.pid), time.monotonic()
            time.sleep(1.0)
            idle = (cpu_seconds(broker.pid) - before) / (time.monotonic() - began)
            after = client.stats()
        # A poll that never stopped would be a whole core (~1.0); the broker's own 100 ms
        # tick is ~0. A behaviour check, not a speed assertion.
        assert idle < 0.05, f"the idle broker used {idle:.0%} of a core"
        assert after["busy_polls"] == settled["busy_polls"], (settled, after)  # none idle


def kill_or_drain(home: Path, stop: signal.Signals) -> tuple[int, int, dict[str, int]]:
    """Producers (tests/broker_producer.py, 8 in flight each) against a broker with the
    poll on, then ``stop``; every acknowledged send looked up by a read_only store in
    another process: (acknowledged, found, the broker's last stats before the stop)."""
    store = home / "s"
    broker, url = start(store, "--busy-poll-us", "200")
    processes = [broker]
    try:
        producer = [sys.executable, str(HERE / "broker_producer.py"), url]
        processes += [
            subprocess.Popen([*producer, f"p{n}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for n in range(PRODUCERS)
        ]
        stats: dict[str, Any] = {}
        with equeue.connect(url) as client:
            for _ in range(600):  # until every producer sent (at most ~30 s)
                stats = client.stats()
                if stats["connections"] > PRODUCERS and stats["sends"] >= 300 * PRODUCERS:
                    break
                time.sleep(0.05)
        broker.send_signal(stop)
        code = broker.wait(60)
        ends = [producer.communicate(timeout=60) for producer in processes[1:]]
    finally:
        for process in processes:  # also when the test failed
            if process.poll() is None:
                process.kill()
                process.wait()
    assert [p.returncode for p in processes[1:]] == [0] * PRODUCERS, [e for _, e in ends]
    outputs = [out.decode() for out, _ in ends]
    assert code == (0 if stop == signal.SIGTERM else -signal.SIGKILL)
    wanted = [
        (message_id, f"p{number}:{seq}")
        for number, output in enumerate(outputs)
        for seq, message_id in acknowledged(output).items()
    ]
    found = subprocess.run(
        [sys.executable, "-c", READ_BACK, str(store)],
        input=json.dumps(wanted), capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    return len(wanted), int(found), stats


def test_sigkill_with_the_poll_on_loses_no_acknowledged_send(home: Path) -> None:
    acknowledged_count, found, stats = kill_or_drain(home, signal.SIGKILL)
    assert acknowledged_count >= 300 * PRODUCERS and stats["busy_poll_starts"] > 0
    assert found == acknowledged_count


def test_sigterm_with_the_poll_on_drains(home: Path) -> None:
    acknowledged_count, found, stats = kill_or_drain(home, signal.SIGTERM)
    assert acknowledged_count >= 300 * PRODUCERS and found == acknowledged_count
    assert not (home / "s" / "broker.sock").exists()
    assert stats["busy_poll_starts"] > 0, stats
