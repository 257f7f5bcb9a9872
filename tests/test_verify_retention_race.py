"""``equeue verify`` beside a writer whose retention removes chunks between verify's
listing of a directory and its later opens of a listed chunk (review 37a A9): a chunk
gone below the directory's first chunk is "removed since the listing", not a problem
and not a raw OSError; a chunk gone from the middle is a problem naming it."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from equeue import MessageStore, StoreConfig
from equeue.format.chunk import MIN_CHUNK_DATA_SIZE
from equeue.inspect import verify
from equeue.inspect.layout import ChunkFile, data_checksum, load_chunk_file

RETENTION_HOURS = 1


@pytest.fixture
def live(tmp_path: Path) -> Iterator[MessageStore]:
    """A live writer with a 64 KiB log: 6 completed message chunks and an ongoing one,
    one queue whose entries all sit in one queue chunk (so it outlives retention)."""
    config = StoreConfig(
        chunk_data_size=MIN_CHUNK_DATA_SIZE,
        retention=dt.timedelta(hours=RETENTION_HOURS),
    )
    with MessageStore.open(tmp_path / "s", config) as store:
        store.create_topic("t", 1)
        while len(list((tmp_path / "s" / "messages").glob("chunk-*"))) < 7:
            store.send_batch("t", [b"x" * 1000] * 20)
        store.flush()
        yield store


def _retain_all_but_the_last(store: MessageStore) -> int:
    return store.apply_retention(now=time.time() + 2 * 3600 * RETENTION_HOURS)


def _chunks(store: MessageStore) -> list[Path]:
    return sorted((store.path / "messages").glob("chunk-*"))


def test_a_message_chunk_removed_before_its_checksum_is_read(
    live: MessageStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    removed: list[int] = []
    real = data_checksum

    def retention_first(cf: ChunkFile, *args: Any) -> int:
        if not removed:
            removed.append(_retain_all_but_the_last(live))
        return real(cf, *args)

    monkeypatch.setattr(verify, "data_checksum", retention_first)
    problems = verify.verify_store(live.path)
    assert removed and removed[0] >= 6, removed
    assert problems == []


def test_a_message_chunk_removed_before_a_queue_entry_is_checked_against_it(
    live: MessageStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    removed: list[int] = []
    real = load_chunk_file

    def retention_at_the_queue(path: Path, *, last: bool = True) -> ChunkFile:
        if not removed and path.parent.parent.name == "t":
            removed.append(_retain_all_but_the_last(live))
        return real(path, last=last)

    monkeypatch.setattr(verify, "load_chunk_file", retention_at_the_queue)
    problems = verify.verify_store(live.path)
    assert removed and removed[0] >= 6, removed
    assert len(list((live.path / "queues" / "t" / "0").glob("chunk-*"))) == 1
    assert problems == []


def test_a_chunk_gone_from_the_middle_of_the_log_is_a_problem_naming_it(
    live: MessageStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    victim = _chunks(live)[2]
    real = data_checksum

    def vanish(cf: ChunkFile, *args: Any) -> int:
        if cf.path == victim:
            victim.unlink()
        return real(cf, *args)

    monkeypatch.setattr(verify, "data_checksum", vanish)
    problems = verify.verify_store(live.path)
    gone, entries = problems
    assert (gone.file, gone.kind) == (str(victim), "missing chunk")
    assert "removed while verify ran (chunk chunk-000000000000.0000 before it" in gone.reason
    assert entries.kind == "queue entry"
    assert f"into message chunk {victim.name}, which was removed while verify ran" in (
        entries.reason
    )
