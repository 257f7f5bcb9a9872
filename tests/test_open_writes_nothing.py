"""An open for writing of a cleanly closed store, and a command the store refuses, write
no byte of it (the LOCK file's holder pid aside: taking the lock is the open). The key
index's recovery used to rewrite its ``indexed_position`` row with the same value, so
SQLite's change counter in keys.sqlite moved on every open (review17's note). (Not
covered: a queue that never held a message has no directory until a writable open makes
its empty one.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from store_helpers import snapshot

from equeue import MessageStore, StoreConfig

CONFIG = StoreConfig(flush="os")


def _store(path: Path) -> None:
    with MessageStore.open(path, CONFIG) as store:
        store.create_topic("t", 2)
        for i in range(40):
            store.send("t", b"body %d" % i, key=f"k{i % 5}")
        store.commit_offset("g", "t", 0, 3)


def test_an_open_and_close_of_a_clean_store_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "s"
    _store(path)
    before = snapshot(path)
    for _ in range(2):
        with MessageStore.open(path, CONFIG) as store:
            assert store.recovery.clean, store.recovery
            assert store.query_by_key("t", "k1")  # the key index is there and read
        assert snapshot(path) == before


def test_a_refused_delete_group_command_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "s"
    _store(path)
    before = snapshot(path)
    run = subprocess.run(
        [sys.executable, "-m", "equeue", "delete-group", str(path), "nosuch"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent.parent,
        timeout=60,
    )
    assert run.returncode == 1, run
    assert "no consumer group 'nosuch'" in run.stderr
    assert snapshot(path) == before
