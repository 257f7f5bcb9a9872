"""What a store keeps mapped stays bounded by a window, not by what it wrote or read:
each chunk's resident pages, read from /proc/self/smaps, before and after."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from equeue import MessageStore, OutgoingMessage, StoreConfig
from equeue.chunks import ChunkManager, ChunkManagerConfig, ChunkReader, ChunkWriter
from equeue.chunks.prefault import WINDOW, Prefaulter

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


def write_unflushed(writer: ChunkWriter, size: int) -> None:
    record = os.urandom(4000)
    for _ in range(size // len(record)):
        writer.write(record)


@pytest.mark.parametrize("release", [True, False])
def test_writer_keeps_a_window_of_what_it_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, release: bool
) -> None:
    """Pages a window behind the writer leave its resident set, flushed or not (under
    "async" a writer outruns the disk); without the release (the control) all stay."""
    if not release:
        monkeypatch.setattr("equeue.chunks.chunk.Chunk._release", lambda *a: None)
    config = ChunkManagerConfig(chunk_data_size=64 * MiB)
    with ChunkManager(tmp_path, config) as manager:
        writer = ChunkWriter(manager)
        write_unflushed(writer, 40 * MiB)
        chunk = manager.last_chunk
        assert chunk is not None and chunk.data_end > 39 * MiB
        assert chunk.unflushed_bytes == chunk.data_end
        held = resident(chunk.path)
        if release:
            assert held <= 3 * WINDOW, held
        else:
            assert held >= 36 * MiB, held
        writer.complete()  # hashes the whole chunk: a step at a time, each step released
        if release:
            assert resident(chunk.path) <= 3 * WINDOW
        else:
            assert resident(chunk.path) >= 39 * MiB


@pytest.mark.parametrize("release", [True, False])
def test_released_unflushed_pages_keep_their_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, release: bool
) -> None:
    """MADV_DONTNEED on a shared file mapping only unmaps: the dirty pages stay in the page
    cache, so 40 MiB written and released before any flush reads back intact, in this
    process and after a reopen. The control keeps every page mapped."""
    if not release:
        monkeypatch.setattr("equeue.chunks.chunk.Chunk._release", lambda *a: None)
    config = ChunkManagerConfig(chunk_data_size=64 * MiB)
    records = [os.urandom(4000) for _ in range(64)]
    count = 40 * MiB // 4000
    with ChunkManager(tmp_path, config) as manager:
        writer = ChunkWriter(manager)
        for i in range(count):
            writer.write(records[i % 64])
        chunk = manager.last_chunk
        assert chunk is not None and chunk.flushed_end == 0
        assert (resident(chunk.path) <= 3 * WINDOW) == release
        assert [r for _, r in ChunkReader(manager).iter_from(0)] == [
            records[i % 64] for i in range(count)
        ]
    with ChunkManager(tmp_path, config) as reopened:
        assert reopened.recovery_cuts == []
        assert [r for _, r in ChunkReader(reopened).iter_from(0)] == [
            records[i % 64] for i in range(count)
        ]


def test_a_new_prefault_request_replaces_the_older_one_of_its_mapping() -> None:
    """A writer that outruns the prefault thread must not have it fault in the windows
    it already passed (and released): only each mapping's newest request is kept."""
    prefaulter = Prefaulter()
    prefaulter.enabled = True
    prefaulter._thread = threading.current_thread()  # never start the real one
    prefaulter.request(0x1000, 0x1000, WINDOW)
    prefaulter.request(0x9000, 0x9000, WINDOW)
    prefaulter.request(0x1000, 0x1000 + WINDOW // 2, WINDOW)
    assert list(prefaulter._requests.items()) == [
        (0x9000, (0x9000, WINDOW)),
        (0x1000, (0x1000 + WINDOW // 2, WINDOW)),
    ]


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


def test_importing_the_store_leaves_numpy_and_spark_out() -> None:
    """The store process pays for what it uses: numpy (12 MiB resident) and pyspark
    belong to the compaction job, whose modules the store imports only for types."""
    code = "import sys, equeue; print(sorted(m for m in ('numpy', 'pyspark') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
