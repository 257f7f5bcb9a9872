"""A real ``equeue serve --flush sync`` with the group-commit wait at its largest
(``--group-commit-wait-us 100000``, so a kill or a SIGTERM most likely finds the flusher
waiting) and several producer processes, each one send in flight (the case the wait is
for): after a SIGKILL every acknowledged send is in the store; a SIGTERM drains at once
(drain cuts the wait short) and keeps every acknowledged send. test_server_kill.py has
the same at the default wait and explains what a SIGKILL does and does not show."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from server_helpers import short_home
from test_server_kill import acknowledged, start_broker

import equeue
from equeue import MessageStore

PRODUCERS = 6
HERE = Path(__file__).parent

home = pytest.fixture(short_home, name="home")


def _run(home: Path, stop: signal.Signals) -> dict[str, int]:
    store = home / "s"
    broker, url = start_broker(store, "--flush", "sync", "--group-commit-wait-us", "100000")
    producers: list[subprocess.Popen[bytes]] = []
    outputs: list[str] = []
    try:
        for number in range(PRODUCERS):
            producers.append(subprocess.Popen(
                [sys.executable, str(HERE / "broker_producer.py"), url, f"p{number}",
                 "--window", "1"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            ))  # fmt: skip
        with equeue.connect(url) as client:  # until every producer sends (≤ ~30 s)
            for _ in range(600):
                stats = client.stats()
                if stats["connections"] > PRODUCERS and stats["sends"] >= 100 * PRODUCERS:
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
    counts: dict[str, int] = {}
    with MessageStore.open(store) as reopened:
        for number, output in enumerate(outputs):
            acks = acknowledged(output)
            assert output.rstrip().splitlines()[-1].startswith("END ")
            assert acks, f"producer {number} saw nothing acknowledged"
            for seq, message_id in acks.items():
                assert reopened.get(message_id).body == f"p{number}:{seq}".encode()
            counts[f"p{number}"] = len(acks)
    return counts


def test_sigkill_during_waits_loses_no_acknowledged_send(home: Path) -> None:
    counts = _run(home, signal.SIGKILL)
    assert len(counts) == PRODUCERS


def test_sigterm_during_waits_drains_every_answer(home: Path) -> None:
    counts = _run(home, signal.SIGTERM)
    assert len(counts) == PRODUCERS
