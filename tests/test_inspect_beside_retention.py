"""`equeue verify` and `inspect` beside a writer whose retention removes chunks while they
run (review17 R17-2, R17-3). Retention removes a log chunk, then the queue chunks whose
entries all point into what it removed; a run that listed or walked those files before
sees them go. Here retention runs at the worst moment of each run, deterministically:
between verify's walk of the log and its load of the queues, and between inspect's load of
the queues and its load of the log. The controls: the same runs with nothing removed
report nothing, and a queue chunk deleted by hand (its log chunk still there) is still
reported. `records` walked on past a chunk removed under it likewise."""

from __future__ import annotations

import datetime as dt
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import equeue.inspect.summary as summary_module
from equeue import MessageStore, StoreConfig
from equeue.chunks.reader import ChunkReader
from equeue.cli import main
from equeue.inspect.layout import load_chunk_dir
from equeue.inspect.summary import summarize_store
from equeue.inspect.verify import Verifier, verify_store

CONFIG = StoreConfig(
    chunk_data_size=16384,
    queue_chunk_records=400,
    default_queue_count=2,
    retention=dt.timedelta(hours=1),
)
LATER = 10**7  # seconds ahead: apply_retention's `now`, past every chunk's retention
SENDS = 4000  # ~20 log chunks, 5 queue chunks a queue


@pytest.fixture
def writer(tmp_path: Path) -> Iterator[MessageStore]:
    with MessageStore.open(tmp_path / "store", CONFIG) as store:
        for i in range(SENDS):
            store.send("orders", b"order-%05d" % i, key=f"c{i % 7}", queue_id=i % 2)
        yield store


class RetentionOnce:
    """Runs the writer's retention (every completed log chunk is past it) the first time
    ``when`` says so, then calls through."""

    def __init__(self, writer: MessageStore, original: Callable[..., Any]) -> None:
        self.writer, self.original, self.removed = writer, original, 0

    def call(self, when: bool, *args: Any, **kwargs: Any) -> Any:
        if when and not self.removed:
            self.removed = self.writer.apply_retention(now=time.time() + LATER)
        return self.original(*args, **kwargs)


def test_verify_beside_retention_between_the_log_walk_and_the_queues_reports_nothing(
    writer: MessageStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: "missing chunk: the log holds messages of queue orders/0 at offsets 0..N,
    but the queue has no entries for them: its chunks were deleted" (exit 1)."""
    once = RetentionOnce(writer, Verifier._check_dir)
    monkeypatch.setattr(
        Verifier,
        "_check_dir",
        lambda self, *args, queue, **kw: once.call(queue, self, *args, queue=queue, **kw),
    )
    problems = verify_store(writer.path)
    assert once.removed > 0
    assert problems == [], [str(p) for p in problems]


def test_inspect_beside_retention_between_the_queues_and_the_log_reads_on(
    writer: MessageStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: FileNotFoundError from a queue chunk retention removed, read by the search
    for the first offset whose message still exists (`inspect` printed the errno's text)."""
    messages_dir = writer.path / "messages"
    once = RetentionOnce(writer, load_chunk_dir)
    monkeypatch.setattr(
        summary_module,
        "load_chunk_dir",
        lambda directory, *args: once.call(Path(directory) == messages_dir, directory, *args),
    )
    summary = summarize_store(writer.path)
    assert once.removed > 0
    assert summary.problems == [], [str(p) for p in summary.problems]
    [topic] = summary.topics
    for queue in topic.queues:  # as the writer itself sees the queue after retention
        assert queue.first_offset == writer.queue_range("orders", queue.queue_id)[0]


def test_control_nothing_removed_reports_nothing_and_a_hand_deletion_is_reported(
    writer: MessageStore,
) -> None:
    assert verify_store(writer.path) == []
    assert summarize_store(writer.path).problems == []
    writer.flush()
    first = sorted((writer.path / "queues" / "orders" / "0").glob("chunk-*"))[0]
    first.unlink()  # its log chunk stays: the log holds messages the queue lost
    found = [(p.file, p.kind, p.reason) for p in verify_store(writer.path)]
    assert [kind for file, kind, _ in found if file == str(first.parent)] == ["missing chunk"]
    assert "were deleted" in found[0][2], found


RECORDS = {
    "log": ["--limit", "5000"],
    "queue": ["--topic", "orders", "--queue", "0", "--offset", "0", "--limit", "5000"],
    "key": ["--key", "c3", "--limit", "5000"],
}


def _printed(store: Path, more: list[str], capsys: pytest.CaptureFixture[str]) -> list[int]:
    assert main(["records", str(store), "--json", *more]) == 0, capsys.readouterr()
    return [json.loads(line)["position"] for line in capsys.readouterr().out.splitlines()]


@pytest.mark.parametrize("how", sorted(RECORDS))
def test_records_beside_retention_in_the_middle_of_its_walk_skips_what_was_removed(
    writer: MessageStore,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    how: str,
) -> None:
    """Before: `records` stopped with "chunk ... was removed (by retention or compaction)
    while in use" (exit 1) when retention removed the next chunk of its walk; the docs
    say what retention removes is skipped, as `pull` skips it."""
    original = ChunkReader.iter_from
    read: list[int] = []
    removed: list[int] = []

    def iter_from(self: ChunkReader, position: int = 0) -> Iterator[tuple[int, bytes]]:
        for item in original(self, position):
            read.append(item[0])
            if len(read) == 30:  # mid-walk: every chunk after the current one is unmapped
                removed.append(writer.apply_retention(now=time.time() + LATER))
            yield item

    monkeypatch.setattr(ChunkReader, "iter_from", iter_from)
    printed = _printed(writer.path, RECORDS[how], capsys)
    monkeypatch.undo()
    retained = _printed(writer.path, RECORDS[how], capsys)  # the store as retention left it
    assert removed[0] > 0 and retained
    assert printed == sorted(set(printed))
    gone = [p for p in printed if p not in set(retained)]
    assert gone and max(gone) < retained[0]  # what was printed before retention ran
    assert [p for p in printed if p >= retained[0]] == retained
