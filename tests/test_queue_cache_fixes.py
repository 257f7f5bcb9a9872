"""Review fixes of the cache of open queues (issue 25): a failed fdatasync of a closed
queue chunk sticks, a send re-entered on the thread holding the write lock is refused,
a queue closed during a checkpoint's flush is synced by it, the C-bound send keeps its
signature."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
from code_paths import code_path  # noqa: F401 - the fixture
from many_queues_child import body, low_config

from equeue import MessageStore
from equeue.errors import StoreWriteError
from equeue.store.meta import CHECKPOINT_FILE


def _evict_many(store: MessageStore, rounds: int = 2) -> None:
    for r in range(rounds):
        for i in range(20):  # more queues than stay open: most are closed, unflushed
            store.send(f"t{i}", body(f"t{i}", 0, r), queue_id=0)


def test_a_failed_fdatasync_of_a_closed_queue_chunk_sticks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first closed chunk's fdatasync fails: that file and the ones after it stay
    listed, every later flush fails too, and no checkpoint is written after it (the code
    before dropped them all and the next flush wrote a checkpoint)."""
    store = MessageStore.open(tmp_path / "s", low_config(flush="os"))
    try:
        _evict_many(store)
        files = store._files
        listed = sorted(files._unsynced)
        assert len(listed) >= 3
        real = os.fdatasync
        seen: list[str] = []

        def failing(fd: int) -> None:
            name = os.readlink(f"/proc/self/fd/{fd}")
            if name == listed[0]:
                seen.append(name)
                raise OSError(5, "Input/output error")
            real(fd)

        checkpoint = tmp_path / "s" / CHECKPOINT_FILE
        before = checkpoint.read_bytes() if checkpoint.exists() else b""
        monkeypatch.setattr(os, "fdatasync", failing)
        with pytest.raises(StoreWriteError, match="flushing a closed queue chunk"):
            store.flush()
        monkeypatch.setattr(os, "fdatasync", real)
        assert seen == [listed[0]]
        assert sorted(files._unsynced) == listed  # none of them vouched for
        with pytest.raises(StoreWriteError, match="reopen the store"):
            store.flush()
        assert (checkpoint.read_bytes() if checkpoint.exists() else b"") == before
        assert sorted(files._unsynced) == listed
    finally:
        with contextlib.suppress(StoreWriteError):  # the close's flush fails as well
            store.close()
    with MessageStore.open(tmp_path / "s", low_config(flush="os")) as again:
        for i in range(20):
            got = [m.body for m in again.pull(f"t{i}", 0, 0, 10).messages]
            assert got == [body(f"t{i}", 0, r) for r in range(2)]
