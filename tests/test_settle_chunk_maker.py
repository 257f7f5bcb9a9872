"""store_helpers.settle_chunk_maker, which every test that reads a live store's files
waits on (snapshot, tree): it returns once the chunk maker (equeue/chunks/ahead.py) has
no job queued or running, the log directory's fsync after an install included, and a
snapshot taken after a roll-over inside the compared call sees the file made for it."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from store_helpers import settle_chunk_maker, snapshot

import equeue.chunks.manager
from equeue import MessageStore, StoreConfig
from equeue.chunks.ahead import is_ahead_name
from equeue.chunks.chunk import Chunk

# 4 KiB log chunks: a 400-byte body rolls the log over every 9 sends; async: no
# fdatasync of a send vouches for (and so fsyncs) an installed chunk's name
CONFIG = StoreConfig(chunk_data_size=4096, default_queue_count=1, flush="async")
BODY = b"b" * 400
SLOW = 0.2  # seconds each slowed maker job takes: far beyond a marker job's round trip


def made_ahead(store: MessageStore) -> list[str]:
    return sorted(n for n in os.listdir(store.path / "messages") if is_ahead_name(n))


def slowed(monkeypatch: pytest.MonkeyPatch, name: str) -> list[float]:
    """equeue.chunks.manager's ``name`` (run on the maker's thread) made SLOW seconds
    slower; when each call returned."""
    real = getattr(equeue.chunks.manager, name)
    returned: list[float] = []

    def slow(*args: Any, **kwargs: Any) -> Any:
        assert threading.current_thread().name == "equeue-chunk-maker"
        time.sleep(SLOW)
        try:
            return real(*args, **kwargs)
        finally:
            returned.append(time.monotonic())

    monkeypatch.setattr(equeue.chunks.manager, name, slow)
    return returned


def filled(path: Path) -> None:
    """A store with a log chunk: a fresh store makes its first one at its first send (not
    ahead); the next open has the next chunk's file made."""
    with MessageStore.open(path, CONFIG) as store:
        store.send("t", BODY)


def opened(path: Path) -> MessageStore:
    filled(path)
    return MessageStore.open(path, CONFIG)


def send_until_installed(store: MessageStore) -> Chunk:
    """Sends until the log rolls over into a chunk from a file made ahead; that chunk."""
    first = store._messages.last_chunk
    for _ in range(100):
        store.send("t", BODY)
        last = store._messages.last_chunk
        if last is not first:
            assert last is not None and last.name_pending, "no file made ahead was installed"
            return last
    raise AssertionError("100 sends did not roll the log over")


def test_it_returns_once_the_file_made_at_the_open_is_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    filled(tmp_path / "s")
    returned = slowed(monkeypatch, "make_ahead_file")
    with MessageStore.open(tmp_path / "s", CONFIG) as store:
        settle_chunk_maker()  # the process's maker alone, no store named
        assert len(returned) == 1 and len(made_ahead(store)) == 1
        assert snapshot(store.path) == snapshot(store.path)


def test_it_waits_for_the_directory_fsync_after_an_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job a roll-over queues after installing a file made ahead (the fsync of the
    log directory: a file call beside the tested one) is waited for too. (The helper
    before, which read the manager's job flag, passed this as well, by the order of the
    jobs alone: the next file's job is queued behind the fsync's and keeps the flag up.)"""
    with opened(tmp_path / "s") as store:
        settle_chunk_maker(store)
        returned = slowed(monkeypatch, "_name_durable")
        installed = send_until_installed(store)
        settle_chunk_maker(store)
        assert len(returned) == 1 and not installed.name_pending


def test_a_roll_over_inside_the_compared_call_is_seen_settled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A snapshot after a call that rolled the log over waits for the file the roll-over
    asked for: the chunk after the new one, made ahead, the one before renamed."""
    with opened(tmp_path / "s") as store:
        before = snapshot(store.path)
        (old,) = made_ahead(store)
        returned = slowed(monkeypatch, "make_ahead_file")
        installed = send_until_installed(store)
        after = snapshot(store.path)
        assert len(returned) == 1
        assert f"messages/{old}" in before and f"messages/{old}" not in after
        (new,) = made_ahead(store)
        number = installed.end_number + 1
        assert new.startswith(f"ahead-{number:012d}.") and f"messages/{new}" in after
        assert snapshot(store.path) == after
