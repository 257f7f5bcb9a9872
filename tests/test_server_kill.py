"""`equeue serve` as a real process: SIGTERM drains (every acknowledged send stored,
socket removed, exit 0); a SIGKILLed broker loses no acknowledged send and its stale socket
is replaced by the next one. Producers are real processes speaking the protocol
(tests/broker_producer.py).

A SIGKILL leaves the page cache: it shows what the broker process kept, not that an answer
waited for its fdatasync. That ordering is tested by test_server_commit.py (a flush spy,
and a power cut under the power-loss model, which a broker answering before its
fdatasync fails)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from server_helpers import short_home

import equeue
from equeue import MessageStore
from equeue.protocol.frames import MESSAGE_OVERHEAD

PRODUCERS = 3
SEEN_SECONDS = 300  # at most, for the producers' sends to show what a test waits for
HERE = Path(__file__).parent


home = pytest.fixture(short_home, name="home")


def start_broker(store: Path, *extra: str) -> tuple[subprocess.Popen[bytes], str]:
    broker = subprocess.Popen(
        [sys.executable, "-m", "equeue", "serve", str(store), "--quiet", *extra],
        stdout=subprocess.PIPE,
    )
    assert broker.stdout is not None
    line = broker.stdout.readline().decode()
    if not line.startswith("listening on "):
        broker.kill()
        broker.wait()
        raise AssertionError(f"the broker did not start: {line!r}")
    return broker, line.split()[-1]


def acknowledged(output: str) -> dict[int, str]:
    acks: dict[int, str] = {}
    for line in output.splitlines():
        if line.startswith("A "):
            _, seq, message_id = line.split()
            acks[int(seq)] = message_id
    return acks


def run_until(
    home: Path,
    stop: signal.Signals,
    flush: str,
    broker_args: tuple[str, ...] = (),
    producer_args: tuple[str, ...] = (),
    seen: Callable[[dict[str, Any]], bool] = lambda stats: True,
) -> None:
    """``seen``: what the broker's stats must show (besides every producer answered)
    before the signal."""
    store = home / "s"
    broker, url = start_broker(store, "--flush", flush, *broker_args)
    producers: list[subprocess.Popen[bytes]] = []
    outputs: list[str] = []
    # Their output goes to files, not pipes: nothing reads a pipe before the signal, and a
    # full one (64 KiB: 2,082 "A seq id" lines each) stopped every producer at 6,246 sends
    # in all, after which no stats could change (seen() false for good; found at load 23
    # with the broker idle and each producer blocked in anon_pipe_write).
    outs = [home / f"out-{number}" for number in range(PRODUCERS)]
    errs = [home / f"err-{number}" for number in range(PRODUCERS)]
    try:
        for number in range(PRODUCERS):
            with open(outs[number], "wb") as out, open(errs[number], "wb") as err:
                producers.append(subprocess.Popen(
                    [sys.executable, str(HERE / "broker_producer.py"), url, f"p{number}",
                     "--ready", str(home / f"ready-{number}"), *producer_args],
                    stdout=out, stderr=err,
                ))  # fmt: skip
        # Let them send a while (the sends, not the time, are what is checked): until every
        # producer had a send answered (its ready file) and sends were answered (at most
        # SEEN_SECONDS; a loaded machine can take seconds to start a producer, so not a
        # fixed sleep; the sends counted in total alone once let one producer be killed
        # before its first).
        ready = [home / f"ready-{number}" for number in range(PRODUCERS)]
        deadline = time.monotonic() + SEEN_SECONDS
        with equeue.connect(url) as client:
            while time.monotonic() < deadline:
                stats = client.stats()
                if (
                    all(path.exists() for path in ready)
                    and stats["sends"] >= 200 * PRODUCERS
                    and seen(stats)
                ):
                    break
                time.sleep(0.05)
            assert all(path.exists() for path in ready), [p.name for p in ready if p.exists()]
            assert seen(stats), stats
        broker.send_signal(stop)
        code = broker.wait(60)
        for number, producer in enumerate(producers):
            assert producer.wait(60) == 0, errs[number].read_text()
            outputs.append(outs[number].read_text())
    finally:
        for process in [broker, *producers]:
            if process.poll() is None:
                process.kill()
                process.wait()
    if stop == signal.SIGTERM:
        assert code == 0
        assert not (store / "broker.sock").exists()
    else:
        assert code == -signal.SIGKILL
    total = 0
    with MessageStore.open(store) as reopened:
        for number, output in enumerate(outputs):
            acks = acknowledged(output)
            assert output.rstrip().splitlines()[-1].startswith("END ")
            assert acks, f"producer {number} saw nothing acknowledged"
            total += len(acks)
            for seq, message_id in acks.items():
                assert reopened.get(message_id).body == f"p{number}:{seq}".encode()
    assert total >= PRODUCERS
    if stop == signal.SIGKILL:  # a killed broker's socket is stale: the next one replaces it
        again, url = start_broker(store)
        again.send_signal(signal.SIGTERM)
        assert again.wait(60) == 0


def test_sigterm_drains_and_keeps_every_acknowledged_send(home: Path) -> None:
    run_until(home, signal.SIGTERM, "sync")


def test_sigkill_loses_no_acknowledged_send(home: Path) -> None:
    run_until(home, signal.SIGKILL, "sync")


def test_the_command_line_limits_reach_the_welcome(home: Path) -> None:
    from server_helpers import raw

    broker, url = start_broker(
        home / "s", "--max-in-flight", "7", "--max-connections", "3",
        "--max-frame-bytes", "100000", "--listen", f"unix:{home / 'b.sock'}",
    )  # fmt: skip
    try:
        assert url == f"unix:{home / 'b.sock'}"
        with raw(url) as c:
            assert c.welcome["limits"] == {
                "max_in_flight": 7, "max_connections": 3, "max_frame_bytes": 100000,
                "max_batch_messages": 65536, "max_pull_count": 65536,
                # the served store's: what a frame carries beside the properties' limit
                "max_message_size": 100000 - 32 * 1024 - MESSAGE_OVERHEAD,
                "max_properties_size": 32 * 1024,
            }  # fmt: skip
        broker.send_signal(signal.SIGINT)  # as SIGTERM
        assert broker.wait(60) == 0
        assert not (home / "b.sock").exists()
    finally:
        if broker.poll() is None:
            broker.kill()
            broker.wait()
