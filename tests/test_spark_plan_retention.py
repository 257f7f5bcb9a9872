"""A batch read planned while the writer's retention removes chunks (review17 R17-4). The
plan lists the store's chunks on a read-only handle, then opens each: chunks retention
removed in between (the oldest first) held messages removed before the plan and are left
out; before, the whole read failed at planning with ChunkRemovedError. A chunk gone after
one that was found is no retention's (a compaction install replaced it): that still
raises, as does a task's read of a chunk removed after planning (tests/test_spark_source.py).
No Spark session: plan() runs on the driver in plain Python."""

from __future__ import annotations

import datetime as dt
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import equeue.spark.source as source_module
from equeue import MessageStore, StoreConfig
from equeue.errors import ChunkRemovedError
from equeue.spark.filters import Pushed
from equeue.spark.source import plan

CONFIG = StoreConfig(chunk_data_size=16384, default_queue_count=2, retention=dt.timedelta(hours=1))
LATER = 10**7  # seconds ahead: apply_retention's `now`, past every completed chunk's retention
SENDS = 3000


@pytest.fixture
def writer(tmp_path: Path) -> Iterator[MessageStore]:
    with MessageStore.open(tmp_path / "store", CONFIG) as store:
        for i in range(SENDS):
            store.send("orders", b"order-%05d" % i, key=f"c{i % 7}")
        yield store


def _chunks(store: MessageStore) -> list[str]:
    return sorted(str(p) for p in (store.path / "messages").glob("chunk-*"))


def test_chunks_retention_removes_while_the_read_is_planned_are_left_out(
    writer: MessageStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = source_module._open_chunk
    removed: list[int] = []

    def open_after_retention(path: str, data_end: int) -> object:
        if not removed:  # after the listing, before the first open: the worst moment
            removed.append(writer.apply_retention(now=time.time() + LATER))
        return original(path, data_end)

    before = _chunks(writer)
    monkeypatch.setattr(source_module, "_open_chunk", open_after_retention)
    parts = plan(str(writer.path), Pushed())
    assert removed[0] > 0 and len(before) > removed[0]
    read = [part.path for part in parts]  # type: ignore[attr-defined]
    assert read == _chunks(writer) == before[removed[0] :]


def test_a_chunk_gone_after_one_was_found_still_fails_the_plan(
    writer: MessageStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = source_module._open_chunk
    opened: list[str] = []

    def open_with_the_second_replaced(path: str, data_end: int) -> object:
        opened.append(path)
        if len(opened) == 2:  # as a compaction install's rename leaves it, seen from here
            os.rename(path, path + ".moved")
        return original(path, data_end)

    monkeypatch.setattr(source_module, "_open_chunk", open_with_the_second_replaced)
    with pytest.raises(ChunkRemovedError, match="re-run the query"):
        plan(str(writer.path), Pushed())


def test_control_a_plan_with_nothing_removed_reads_every_chunk(writer: MessageStore) -> None:
    assert [part.path for part in plan(str(writer.path), Pushed())] == _chunks(writer)  # type: ignore[attr-defined]


def test_a_first_chunk_a_compaction_replaced_while_the_read_is_planned_fails_the_plan(
    writer: MessageStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """review18 R18-2: the first fix took any first chunk found gone for retention's, so a
    compaction installing a new version of the oldest chunk (which it does as often as
    any) had its survivors left out of the read, with no error. A new version of the same
    chunk there: not retention's; the plan fails as before ("re-run the query")."""
    original = source_module._open_chunk
    replaced: list[str] = []

    def open_after_a_replacement(path: str, data_end: int) -> object:
        if not replaced:  # as an install leaves it: version 1 of chunk 0, version 0 gone
            os.rename(path, path[: -len(".0000")] + ".0001")
            replaced.append(path)
        return original(path, data_end)

    monkeypatch.setattr(source_module, "_open_chunk", open_after_a_replacement)
    with pytest.raises(ChunkRemovedError, match="re-run the query"):
        plan(str(writer.path), Pushed())
    assert replaced[0].endswith("chunk-000000000000.0000")
