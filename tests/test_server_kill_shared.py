"""The shared-client form of durable sends under a SIGKILL of the broker: asyncio tasks
sharing one ``equeue.aio`` client, whose sends of a loop turn coalesce into one
``send_bodies`` request (tests/aio_shared_producer.py), against ``equeue serve --flush
sync``. Every send a task saw acknowledged must be in the store after it is reopened;
the broker's stats before the kill must show the sends coalesced (more messages than send
requests), or the test would only repeat test_server_kill.py's one-send-per-request form.
Control: the same run stopped with SIGTERM (a drain) keeps every acknowledged send too."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from server_helpers import short_home
from test_server_kill import start_broker

import equeue
from equeue import MessageStore
from equeue.errors import EQueueError

PRODUCERS = 2
TASKS = 32  # per producer process, sharing its one client
WAIT_FOR_SENDS = 180.0  # seconds; the producers stop at 5,000 sends a task, far past 2,000
HERE = Path(__file__).parent

home = pytest.fixture(short_home, name="home")


def run_until(home: Path, stop: signal.Signals) -> None:
    store = home / "s"
    broker, url = start_broker(store, "--flush", "sync")
    producers: list[subprocess.Popen[bytes]] = []
    try:
        for number in range(PRODUCERS):
            argv = [sys.executable, str(HERE / "aio_shared_producer.py"), url, f"p{number}"]
            producers.append(subprocess.Popen(
                [*argv, "--tasks", str(TASKS)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            ))  # fmt: skip
        stats: dict[str, object] = {}
        with equeue.connect(url) as client:
            # Until coalesced sends were flushed. The bound is only against a hang, not a
            # speed asserted: ~30 s saw 1,856 sends with -n 3 beside other runs' fsyncs.
            deadline = time.monotonic() + WAIT_FOR_SENDS
            while time.monotonic() < deadline:
                stats = client.stats()
                if int(stats["sends"]) >= 2000 and int(stats["flushes"]) >= 5:  # type: ignore[call-overload]
                    break
                time.sleep(0.05)
        sends, requests = int(stats["sends"]), int(stats["send_requests"])  # type: ignore[call-overload]
        assert sends >= 2000, stats
        assert sends > 2 * requests, f"{sends} sends in {requests} requests: not coalesced"
        broker.send_signal(stop)
        code = broker.wait(60)
        ends = [(p, *p.communicate(timeout=120)) for p in producers]
        assert all(p.returncode == 0 for p, _, _ in ends), [e.decode()[-2000:] for *_, e in ends]
        outputs = [out.decode() for _, out, _ in ends]
    finally:
        for process in [broker, *producers]:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert code == (0 if stop == signal.SIGTERM else -signal.SIGKILL)
    acked: dict[str, bytes] = {}
    for output in outputs:
        lines = output.rstrip().splitlines()
        assert lines[-1].startswith("END "), lines[-3:]
        for line in lines[:-1]:
            _, body, message_id = line.split()
            acked[message_id] = body.encode()
    # The stop came after the broker had stored 2,000 sends; each task has one send in
    # flight, so all but at most one per task of those were answered before it.
    assert len(acked) >= 2000 - PRODUCERS * TASKS
    with MessageStore.open(store) as reopened:
        lost = [m for m, body in acked.items() if _body(reopened, m) != body]
        stored = sum(end - first for first, end in (
            reopened.queue_range("p", q) for q in reopened.queue_ids("p")
        ))  # fmt: skip
    assert lost == [], f"{len(lost)} of {len(acked)} acknowledged sends lost"
    assert stored >= len(acked)  # more: sends stored whose answer the kill cut off
    print(
        f"{stop.name}: {len(acked)} acknowledged, {stored} stored; before the stop "
        f"{sends} sends in {requests} requests"
    )


def test_sigkill_loses_no_acknowledged_coalesced_send(home: Path) -> None:
    run_until(home, signal.SIGKILL)


def test_sigterm_keeps_every_acknowledged_coalesced_send(home: Path) -> None:
    run_until(home, signal.SIGTERM)


def _body(store: MessageStore, message_id: str) -> bytes | None:
    try:
        return store.get(message_id).body
    except EQueueError:
        return None
