"""A reopen from the live tail (a process crash, not a power loss: the live tail is read
only in the boot that wrote it) reads no record of a quiet queue whose records retention
removed: review14 F1, where each of those entries was checked against the log (45,061
record checks for 16 queues of 5,000 entries; here 2 x 1,500 without the fix)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import equeue.store.recovery as recovery
from equeue import MessageStore, StoreConfig

CHUNK = 1 << 20
CONFIG = StoreConfig(chunk_data_size=CHUNK, flush="os", default_queue_count=1)
QUIET, ENTRIES = 2, 1500

WRITER = """
import os, signal, sys
from equeue import MessageStore, StoreConfig
store = MessageStore.open(sys.argv[1], StoreConfig(chunk_data_size=1 << 20, flush="os",
                                                   default_queue_count=1))
for _ in range(int(sys.argv[2])):
    store.send("busy", b"x" * 4000)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_live_tail_reopen_reads_no_record_of_a_quiet_retained_queue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "s"
    with MessageStore.open(path, CONFIG) as store:
        store.create_topic("busy", 1)
        for k in range(QUIET):
            store.create_topic(f"quiet{k}", 1)
            for i in range(ENTRIES):
                store.send(f"quiet{k}", b"%d" % i)
        while store._messages.committed_position < 4 * CHUNK:
            store.send("busy", b"y" * 1000)
    retain = StoreConfig(
        chunk_data_size=CHUNK, flush="os", default_queue_count=1, max_store_bytes=2 * CHUNK
    )
    with MessageStore.open(path, retain) as store:
        assert store.apply_retention() > 0
        first = store._messages.first_position
    killed = subprocess.run([sys.executable, "-c", WRITER, str(path), "12000"], check=False)
    assert killed.returncode == -9

    checks = 0
    backs = recovery._backs

    def counted(*args: object) -> bool | None:
        nonlocal checks
        checks += 1
        return backs(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(recovery, "_backs", counted)
    with MessageStore.open(path, CONFIG) as store:
        assert store._messages.started_at_live_hint  # the path under test
        assert store._messages.first_position >= first
        assert [store.queue_range(f"quiet{k}", 0) for k in range(QUIET)] == [
            (ENTRIES, ENTRIES)
        ] * QUIET
        assert store.recovery.cuts == [] and store.recovery.problems == []
    assert checks == 0
