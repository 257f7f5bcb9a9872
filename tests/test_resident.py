"""What a store keeps mapped stays bounded by a window, not by what it wrote or read:
each chunk's resident pages, read from /proc/self/smaps, before and after."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from equeue import MessageStore, OutgoingMessage, StoreConfig
from equeue.chunks import ChunkManager, ChunkManagerConfig, ChunkWriter
from equeue.chunks.prefault import WINDOW

MiB = 1 << 20
SMAPS = Path("/proc/self/smaps")
pytestmark = pytest.mark.skipif(not SMAPS.exists(), reason="needs /proc/self/smaps (Linux)")


def resident(path: Path) -> int:
    """Bytes of ``path`` resident in this process's mappings of it."""
    total, inside = 0, False
    for line in SMAPS.read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's first line
            inside = len(fields) >= 6 and fields[5] == str(path)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


@pytest.mark.parametrize("flushed", [True, False])
def test_writer_keeps_a_window_of_flushed_pages(tmp_path: Path, flushed: bool) -> None:
    """Pages a window behind the writer leave its resident set once flushed; unflushed
    ones stay mapped (a failed flush rewrites them from the mapping): the control."""
    record = os.urandom(4000)
    config = ChunkManagerConfig(chunk_data_size=64 * MiB)
    with ChunkManager(tmp_path, config) as manager:
        writer = ChunkWriter(manager)
        for i in range(40 * MiB // len(record)):
            writer.write(record)
            if flushed and i % 256 == 0:
                writer.flush()
        chunk = manager.last_chunk
        assert chunk is not None and chunk.data_end > 39 * MiB
        held = resident(chunk.path)
        if flushed:
            assert held <= 3 * WINDOW, held
        else:
            assert held >= 36 * MiB, held


@pytest.mark.parametrize("release", [True, False])
def test_pulls_keep_a_window_of_what_they_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, release: bool
) -> None:
    """A consumer reading through a 48 MiB completed chunk and the ongoing one keeps
    a few windows of each resident; without the release (the control) all it read."""
    config = StoreConfig(chunk_data_size=48 * MiB, flush="os")
    body = os.urandom(1000)
    with MessageStore.open(tmp_path, config) as store:
        store.create_topic("t", 1)
        for _ in range(70):
            store.send_batch("t", [OutgoingMessage(body)] * 1000)
        store.flush()
        paths = [c.path for c in store._messages]
        assert len(paths) == 2
        for path in paths:  # the writer's own pages: dropped by flush() and the window
            if release:
                assert resident(path) <= 3 * WINDOW
        if not release:
            monkeypatch.setattr("equeue.chunks.chunk.Chunk.release_behind", lambda *a: None)
        offset, pulled = 0, 0
        while True:
            messages, offset = store.pull("t", 0, offset, max_count=256)
            if not messages:
                break
            pulled += len(messages)
        assert pulled == 70_000
        held = [resident(path) for path in paths]
        if release:
            assert all(h <= 3 * WINDOW for h in held), held
        else:
            assert held[0] >= 40 * MiB, held  # the completed chunk, read end to end
