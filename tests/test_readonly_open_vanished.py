"""A read-only open whose listed log chunk files vanish while it reads their headers or
opens them, at the moment it reaches chunk 3 (the race made exact: a hook in
``_read_header`` or ``_open_chunk`` deletes the files, as a writer's retention or a
damage would between the listing and the read).

review11 R11-8: taking every vanished file for retention's survived 511 tests, since the
one "missing in the middle" test deleted the file before the open listed it. A middle
chunk that vanishes is MissingChunkError here, with a lower file left, with a hostile
higher-numbered file added, and with retention's removal before it.
review11 R11-4: the files one retention pass removed cost one listing, not one each.
On a real store of 7 (and 40) log chunks of 4 KiB."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from store_helpers import messages_listings

from equeue import MessageStore, StoreConfig
from equeue.chunks.chunk import Chunk
from equeue.chunks.opening import ChunkOpening
from equeue.errors import MissingChunkError
from equeue.format.chunk import ChunkHeader

CONFIG = StoreConfig(chunk_data_size=4096, flush="os", default_queue_count=1)
MESSAGES = 200  # 7 log chunks of 4 KiB


def _build(path: Path, messages: int) -> list[str]:
    with MessageStore.open(path, CONFIG) as store:
        store.create_topic("t", 1)
        for i in range(messages):
            store.send("t", b"m%d" % i + b"x" * 60)
    return sorted(os.listdir(path / "messages"))


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    path = tmp_path_factory.mktemp("vanished") / "store"
    names = _build(path, MESSAGES)
    assert len(names) == 7, names
    return path, names


def _hook(
    monkeypatch: pytest.MonkeyPatch, phase: str, at: str, vanish: Callable[[Path], None]
) -> list[int]:
    """``vanish(messages directory)`` runs once, when the open's ``phase`` reaches ``at``."""
    fired: list[int] = []

    def reached(path: Path) -> None:
        if path.parent.name == "messages" and path.name == at and not fired:
            fired.append(1)
            vanish(path.parent)

    read_header, open_chunk = ChunkOpening._read_header, ChunkOpening._open_chunk

    def hooked_header(self: ChunkOpening, path: Path) -> ChunkHeader:
        if phase == "header":
            reached(path)
        return read_header(self, path)

    def hooked_open(self: ChunkOpening, path: Path, *args: Any, **kwargs: Any) -> Chunk:
        if phase == "open":
            reached(path)
        return open_chunk(self, path, *args, **kwargs)

    monkeypatch.setattr(ChunkOpening, "_read_header", hooked_header)
    monkeypatch.setattr(ChunkOpening, "_open_chunk", hooked_open)
    return fired


def _remove(*names: str) -> Callable[[Path], None]:
    def vanish(directory: Path) -> None:
        for name in names:
            (directory / name).unlink()

    return vanish


PHASES = ["header", "open"]


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("shape", ["middle", "hostile higher file", "retention, then a gap"])
def test_a_chunk_vanishing_in_the_middle_during_a_read_only_open_is_missing(
    built: tuple[Path, list[str]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    phase: str,
    shape: str,
) -> None:
    base, names = built
    path = tmp_path / "store"
    shutil.copytree(base, path)
    if shape == "middle":  # chunks 0-2 are still there: no retention removed chunk 3
        vanish, missing = _remove(names[3]), "chunks 3..3 are missing"
    elif shape == "hostile higher file":  # a file numbered past every chunk cannot hide it

        def vanish(directory: Path) -> None:
            shutil.copy(directory / names[-1], directory / "chunk-000000000099.0000")
            (directory / names[3]).unlink()

        missing = "chunks 3..3 are missing"
    else:  # retention took 0-3 (the open goes on after them), and 5 is gone too
        vanish, missing = _remove(*names[:4], names[5]), "chunks 5..5 are missing"
    fired = _hook(monkeypatch, phase, names[3], vanish)
    with pytest.raises(MissingChunkError, match=missing):
        MessageStore.open(path, CONFIG, read_only=True).close()
    assert fired == [1]


@pytest.mark.parametrize("phase", PHASES)
def test_the_control_chunks_retention_removed_are_skipped(
    built: tuple[Path, list[str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, phase: str
) -> None:
    base, names = built
    path = tmp_path / "store"
    shutil.copytree(base, path)
    fired = _hook(monkeypatch, phase, names[3], _remove(*names[:4]))
    with MessageStore.open(path, CONFIG, read_only=True) as store:
        assert store._reader.manager.first_position == 4 * 4096
        first, end = store.queue_range("t", 0)
        assert end == MESSAGES and 0 < first < end
        pulled = store.pull("t", 0, first, max_count=end - first)
        assert [m.queue_offset for m in pulled] == list(range(first, end))
        assert [m.body[: len(b"m%d" % m.queue_offset)] for m in pulled] == [
            b"m%d" % offset for offset in range(first, end)
        ]
    assert fired == [1]


@pytest.mark.parametrize("phase", PHASES)
def test_one_retention_pass_during_a_read_only_open_costs_one_listing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, phase: str
) -> None:
    """R11-4: 30 of 40 listed files removed at once (one retention pass) were looked for
    with a listing each: 31 listings of the directory more than an open without the race
    (review11's s5: 1,508 listings, 1.4-1.5 s of CPU for 1,500 files). Now one more."""
    base = tmp_path / "base"
    names = _build(base, 1200)
    assert len(names) >= 40, len(names)
    counts = []
    for race in (False, True):
        path = tmp_path / f"store-{race}"
        shutil.copytree(base, path)
        if race:
            fired = _hook(monkeypatch, phase, names[0], _remove(*names[:30]))
        listed = messages_listings(monkeypatch)
        with MessageStore.open(path, CONFIG, read_only=True) as store:
            assert store._reader.manager.first_position == (30 if race else 0) * 4096
            assert store.queue_range("t", 0)[1] == 1200
        counts.append(len(listed))
        monkeypatch.undo()
    assert fired == [1]
    assert counts[1] == counts[0] + 1, counts  # (was: counts[0] + 30)
