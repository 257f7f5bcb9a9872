"""The broker's flush bookkeeping (equeue/store/flush.py log_synced) releases the log's
mapped pages a window behind once per half window crossed, not after every fdatasync:
at 64 connections a flush covers ~43 sends, and a madvise(MADV_DONTNEED) each time cost
the loop 3-4 µs of CPU and a TLB flush. Real store, real fdatasyncs of the C flusher's
own descriptor, as CSync does on the loop; the resident pages read from smaps."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from test_resident import BOUND, SMAPS, resident

from equeue import MessageStore, StoreConfig
from equeue.chunks.chunk import Chunk
from equeue.chunks.prefault import WINDOW
from equeue.store.flush import OwnDescriptor, log_sync_target, log_synced

pytestmark = pytest.mark.skipif(not SMAPS.exists(), reason="needs /proc/self/smaps (Linux)")
MiB = 1 << 20
BODY = b"r" * 150  # 43 sends a flush, as at 64 connections: about 9 KiB a flush (records)
SENDS_PER_FLUSH = 43
# As the broker opens it under --flush sync ("async": the broker flushes), with no service
# flush during the test
BROKER_LIKE = StoreConfig(
    flush="async",
    chunk_data_size=64 * MiB,
    flush_interval_ms=3_600_000,
    flush_thorough_interval_ms=3_600_000,
)


class Releases:
    """Chunk._release's calls made inside log_synced (their data ends)."""

    def __init__(self) -> None:
        self.inside = False
        self.ends: list[int] = []


def _flush_each_cohort(store: MessageStore, cohorts: int, spy: Releases) -> Chunk:
    """``cohorts`` x 43 sends, each cohort made durable as the broker's CSync does: the
    target taken after the appends, an fdatasync of the own descriptor, log_synced."""
    own = OwnDescriptor()
    try:
        for _ in range(cohorts):
            for _ in range(SENDS_PER_FLUSH):
                store.send("t", BODY)
            target = log_sync_target(store, own)
            assert target is not None
            chunk, fd, end = target
            os.fdatasync(fd)
            spy.inside = True
            log_synced(store, chunk, end, 0)
            spy.inside = False
            assert chunk.flushed_end == end
        return chunk
    finally:
        own.close()


@pytest.fixture
def spied(monkeypatch: pytest.MonkeyPatch) -> Releases:
    spy = Releases()
    real = Chunk._release

    def release(self: Chunk, end: int) -> None:
        if spy.inside:
            spy.ends.append(end)
        real(self, end)

    monkeypatch.setattr(Chunk, "_release", release)
    return spy


def test_a_flush_that_crosses_no_half_window_releases_nothing(
    tmp_path: Path, spied: Releases
) -> None:
    """200 flushes of ~9 KiB: ~1.8 MiB, seven half windows crossed; each crossing
    releases once (the release still happens), no other flush does."""
    config = BROKER_LIKE
    with MessageStore(tmp_path / "s", config) as store:
        chunk = _flush_each_cohort(store, 200, spied)
        crossings = chunk.flushed_end // (WINDOW // 2)
    assert 1 <= len(spied.ends) <= crossings, (spied.ends, crossings)


@pytest.mark.parametrize("release", [True, False])
def test_pages_a_window_behind_the_flushes_still_leave(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, release: bool
) -> None:
    """~18 MiB in flushes of ~9 KiB: the log chunk's resident pages stay within the bound;
    the control (no release at all) keeps them all."""
    if not release:
        monkeypatch.setattr(Chunk, "_release", lambda *a: None)
    config = BROKER_LIKE
    with MessageStore(tmp_path / "s", config) as store:
        chunk = _flush_each_cohort(store, 2000, Releases())
        assert chunk.flushed_end > 15 * MiB
        held = resident(chunk.path)
        if release:
            assert held <= BOUND, held
        else:
            assert held >= 14 * MiB, held
