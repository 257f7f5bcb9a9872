"""A writer over more queues than stay open (its open defers the rest, with the
checkpoint's ends), killed after its live tail passed messages sent since the last
checkpoint: recovery starts at the live tail, so re-dispatch meets none of those
messages, and a queue deferred with the checkpoint's end answered pulls and queue_range
at that end (the messages after it unseen until something opened the queue: review20
R20-6), and the open took a group's commit past it for a crash's cut and lowered it
(R20-1). Such an open now opens its queues."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from equeue import MessageStore, StoreConfig

QUEUES = 20
CHILD = """
import os, signal, sys, time
from equeue import MessageStore, StoreConfig
config = StoreConfig(**eval(sys.argv[2]))
store = MessageStore.open(sys.argv[1], config)
for q in range(int(sys.argv[3])):
    for i in range(5):
        store.send("t", f"late-{q}-{i}".encode(), queue_id=q)
    if q % 2 == 0:  # the odd queues: no commit that would make the open look at them
        store.commit_offset("g", "t", q, 10)
for _ in range(40):  # the live tail moves on a slot a 256 KiB of log
    store.send("x", b"f" * 65536, queue_id=0)
time.sleep(1.0)  # the service's flushes (every 50 ms) write the live tail past them
os.kill(os.getpid(), signal.SIGKILL)
"""
# 7 queues stay open (max_open_files 40); no checkpoint but the close's in the window.
SETTINGS = {"max_open_files": 40, "flush_thorough_interval_ms": 3_600_000, "flush_interval_ms": 50}


def _killed_store(tmp_path: Path) -> Path:
    path = tmp_path / "s"
    with MessageStore.open(path, StoreConfig(**SETTINGS)) as store:  # type: ignore[arg-type]
        store.create_topic("t", QUEUES)
        for q in range(QUEUES):
            for i in range(5):
                store.send("t", f"early-{q}-{i}".encode(), queue_id=q)
    run = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), repr(SETTINGS), str(QUEUES)],
        timeout=120,
        capture_output=True,
        cwd=Path(__file__).parent.parent,
    )
    assert run.returncode == -signal.SIGKILL, run.stderr
    return path


def test_after_the_kill_every_queue_ends_past_the_messages_and_commits_stand(
    tmp_path: Path,
) -> None:
    path = _killed_store(tmp_path)
    for reopened in range(2):  # the open after the kill, then a clean close and open
        with MessageStore.open(path, StoreConfig(**SETTINGS)) as store:  # type: ignore[arg-type]
            if not reopened:  # the case: recovery's scan started at the live tail
                assert store._messages.started_at_live_hint
            assert store.recovery.problems == []
            assert store.consumer_groups()["g"]["t"] == {q: 10 for q in range(0, QUEUES, 2)}
            assert [store.queue_range("t", q) for q in range(QUEUES)] == [(0, 10)] * QUEUES
            bodies = [m.body for m in store.pull("t", 3, 5, max_count=10).messages]
            assert bodies == [f"late-3-{i}".encode() for i in range(5)]
