"""``equeue records --follow`` tells what retention removed before it was printed: one
stderr line a run of offsets (review17's note: it used to skip them in silence). The
follower is driven in this process (equeue.inspect.follow.Follower) so that retention
runs exactly between two of its pulls; the CLI's line is checked through ``main``."""

from __future__ import annotations

import datetime as dt
import threading
import time
from pathlib import Path

import pytest

from equeue import MessageStore, StoreConfig
from equeue.cli import main
from equeue.inspect.follow import Follower
from equeue.inspect.records import Filters

CONFIG = StoreConfig(
    chunk_data_size=4096,
    queue_chunk_records=400,
    default_queue_count=1,
    retention=dt.timedelta(hours=1),
)


def _send(store: MessageStore, count: int, start: int) -> list[int]:
    return [
        store.send("t", b"message %d " % i * 8).queue_offset for i in range(start, start + count)
    ]


def _follow(follower: Follower, count: int) -> list[int]:
    records = follower.records(-1, Filters())
    return [next(records).message.queue_offset for _ in range(count)]


def test_follower_reports_the_offsets_retention_removed_before_it_read_them(
    tmp_path: Path,
) -> None:
    path = tmp_path / "s"
    skipped: list[tuple[str, int, int, int]] = []
    with MessageStore.open(path, CONFIG) as writer:
        writer.create_topic("t")
        _send(writer, 3, 0)
        follower = Follower(path, None, None, skipped=lambda *gap: skipped.append(gap))
        try:
            _send(writer, 60, 3)  # several log chunks the follower has not read
            assert writer.apply_retention(now=time.time() + 7200) > 0
            first = writer.queue_range("t", 0)[0]
            assert 3 < first < 63
            later = _send(writer, 5, 63)
            assert _follow(follower, 63 - first + 5) == [*range(first, 63), *later]
            assert skipped == [("t", 0, 3, first)]
        finally:
            follower.close()


def test_follower_reports_nothing_when_nothing_was_removed(tmp_path: Path) -> None:
    """The control: retention removes only what the follower had read."""
    path = tmp_path / "s"
    skipped: list[tuple[str, int, int, int]] = []
    with MessageStore.open(path, CONFIG) as writer:
        writer.create_topic("t")
        follower = Follower(path, None, None, skipped=lambda *gap: skipped.append(gap))
        try:
            sent = _send(writer, 60, 0)
            assert _follow(follower, 60) == sent
            assert writer.apply_retention(now=time.time() + 7200) > 0
            later = _send(writer, 5, 60)
            assert _follow(follower, 5) == later
            assert skipped == []
        finally:
            follower.close()


def test_the_command_prints_the_gap_on_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The follower's first pull waits for a writer that sends, lets retention remove the
    first chunks, then sends the one message ``--tag end --limit 1`` stops at."""
    path = tmp_path / "s"
    with MessageStore.open(path, CONFIG) as writer:
        writer.create_topic("t")
    written = threading.Event()
    first: list[int] = []

    def write() -> None:
        with MessageStore.open(path, CONFIG) as writer:
            _send(writer, 60, 0)
            assert writer.apply_retention(now=time.time() + 7200) > 0
            first.append(writer.queue_range("t", 0)[0])
            writer.send("t", b"last", tag="end")
        written.set()

    pull = Follower._pull

    def pull_after_the_writer(self: Follower, queues: list[tuple[str, int]]) -> object:
        if not written.is_set():
            thread = threading.Thread(target=write)
            thread.start()
            thread.join(60)
        return pull(self, queues)

    monkeypatch.setattr(Follower, "_pull", pull_after_the_writer)
    args = ["records", str(path), "--follow", "--json", "--tag", "end", "--limit", "1"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert [line.count('"tag": "end"') for line in out.splitlines()] == [1]
    assert 0 < first[0] < 60
    assert err == (
        f"equeue: t/0 offsets 0..{first[0] - 1} were removed (retention or compaction) "
        "before being printed\n"
    )
