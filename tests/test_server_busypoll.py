"""``--busy-poll-us`` (equeue/server/busypoll.py): the setting is checked; a real ``equeue
serve`` that polled during a burst of durable sends sleeps again once the window passes
(its CPU over a second of idleness, from /proc); with it on, a SIGKILLed broker lost no
acknowledged send (read back by a read_only store in another process) and SIGTERM drains
(the control: every acknowledged send is there, and the log says the poll ran)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from server_helpers import short_home
from test_server_kill import acknowledged

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


def test_the_command_line_refuses_a_bad_value(home: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "equeue", "serve", str(home / "s"), "--flush", "sync",
         "--busy-poll-us", "-3"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0
    assert "busy_poll_us=-3" in done.stderr
    assert not (home / "s").exists()  # refused before the store was created


def start(store: Path, *extra: str) -> tuple[subprocess.Popen[bytes], str]:
    """A broker that logs (its exit line says how often it polled) to a file beside it."""
    log = (store.parent / "broker.log").open("ab")
    try:
        broker = subprocess.Popen(
            [sys.executable, "-m", "equeue", "serve", str(store), "--flush", "sync", *extra],
            stdout=subprocess.PIPE, stderr=log,
        )  # fmt: skip
    finally:
        log.close()
    assert broker.stdout is not None
    line = broker.stdout.readline().decode()
    if not line.startswith("listening on "):
        broker.kill()
        broker.wait()
        raise AssertionError(f"the broker did not start: {line!r}")
    return broker, line.split()[-1]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def burst(url: str, sends: int) -> int:
    clients = await asyncio.gather(*(equeue.aio.connect(url) for _ in range(CONNECTIONS)))

    async def lane(client: equeue.aio.AsyncClient) -> None:
        for _ in range(sends):
            await client.send("t", b"x" * 100)

    try:
        await asyncio.gather(*(lane(c) for c in clients))
        return int((await clients[0].stats())["flushes"])
    finally:
        for client in clients:
            await client.close()


def test_an_idle_broker_stops_polling_after_the_window(home: Path) -> None:
    # A 5 ms window: well past any round, so the poll surely ran during the burst
    broker, url = start(home / "s", "--busy-poll-us", "5000")
    try:
        assert asyncio.run(burst(url, 200)) > 0
        time.sleep(0.2)  # the window (5 ms) passed
        before, began = cpu_seconds(broker.pid), time.monotonic()
        time.sleep(1.0)
        idle = (cpu_seconds(broker.pid) - before) / (time.monotonic() - began)
        # A poll that never stopped would be a whole core (~1.0); the broker's own 100 ms
        # tick is ~0. A behaviour check, not a speed assertion.
        assert idle < 0.05, f"the idle broker used {idle:.0%} of a core"
        broker.send_signal(signal.SIGTERM)
        assert broker.wait(60) == 0
    finally:
        if broker.poll() is None:
            broker.kill()
            broker.wait()
    log = (home / "broker.log").read_text()
    hit = re.search(r"busy-poll: started (\d+) times, (\d+) polls", log)
    assert hit, log
    started, count = int(hit.group(1)), int(hit.group(2))
    assert started >= 1 and count > started, hit.group(0)  # it polled, and stopped between


def kill_or_drain(home: Path, stop: signal.Signals) -> tuple[int, int]:
    """Producers (tests/broker_producer.py, 8 in flight each) against a broker with the
    poll on, then ``stop``; every acknowledged send looked up by a read_only store in
    another process: (acknowledged, found)."""
    store = home / "s"
    broker, url = start(store, "--busy-poll-us", "200")
    producers: list[subprocess.Popen[bytes]] = []
    outputs: list[str] = []
    try:
        for number in range(PRODUCERS):
            producers.append(subprocess.Popen(
                [sys.executable, str(HERE / "broker_producer.py"), url, f"p{number}"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            ))  # fmt: skip
        with equeue.connect(url) as client:
            for _ in range(600):  # until every producer sent (at most ~30 s)
                stats = client.stats()
                if stats["connections"] > PRODUCERS and stats["sends"] >= 300 * PRODUCERS:
                    break
                time.sleep(0.05)
        broker.send_signal(stop)
        code = broker.wait(60)
        for producer in producers:
            out, err = producer.communicate(timeout=60)
            assert producer.returncode == 0, err.decode()
            outputs.append(out.decode())
    finally:
        for process in [broker, *producers]:
            if process.poll() is None:
                process.kill()
                process.wait()
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
    return len(wanted), int(found)


def test_sigkill_with_the_poll_on_loses_no_acknowledged_send(home: Path) -> None:
    acknowledged_count, found = kill_or_drain(home, signal.SIGKILL)
    assert acknowledged_count >= 300 * PRODUCERS
    assert found == acknowledged_count


def test_sigterm_with_the_poll_on_drains(home: Path) -> None:
    acknowledged_count, found = kill_or_drain(home, signal.SIGTERM)
    assert acknowledged_count >= 300 * PRODUCERS and found == acknowledged_count
    assert not (home / "s" / "broker.sock").exists()
    assert "busy-poll: started" in (home / "broker.log").read_text()
