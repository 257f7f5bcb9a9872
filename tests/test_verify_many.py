"""``equeue inspect`` and ``equeue verify`` over many queues (issue 25): an ongoing queue
chunk is read in one small read, not mapped; damage anywhere in it is still found, in
its leading bytes or far out in its hole; progress is drawn only on a terminal, and
only once a run has lasted."""

from __future__ import annotations

import io
import itertools
import mmap
import os
from pathlib import Path
from typing import Any

import pytest

from equeue import MessageStore, StoreConfig
from equeue.format.chunk import HEADER_SIZE
from equeue.format.message import QUEUE_RECORD_SIZE
from equeue.inspect.leading import LEADING_MAX
from equeue.inspect.render import ProgressBar
from equeue.inspect.summary import summarize_store
from equeue.inspect.verify import verify_store

TOPICS = 40  # 160 queues, more than the default cache keeps open (79)


def _build(path: Path) -> None:
    with MessageStore.open(path, StoreConfig(flush="os")) as store:
        for i in range(TOPICS):
            store.create_topic(f"t{i:02d}", 4)
            for q in range(4):
                store.send(f"t{i:02d}", f"t{i:02d}/{q}".encode(), queue_id=q)
        for n in range(300):  # one queue with a few pages of entries
            store.send("t00", b"more %d" % n, queue_id=0)


def _chunk(path: Path, topic: str, queue_id: int) -> Path:
    (found,) = (path / "queues" / topic / str(queue_id)).glob("chunk-*")
    return found


def _write(file: Path, offset: int, data: bytes) -> None:
    fd = os.open(file, os.O_WRONLY)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_queue_chunks_are_read_without_a_mapping(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: every queue chunk was mapped (and its preallocated tail scanned through
    the mapping) by both commands: 10,000 mappings for 10,000 queues."""
    _build(tmp_path)
    mapped: list[str] = []
    real = mmap.mmap

    class Counting(real):  # type: ignore[valid-type,misc]
        def __new__(cls, fileno: int, length: int, *args: Any, **kwargs: Any) -> Any:
            mapped.append(os.readlink(f"/proc/self/fd/{fileno}"))
            return real.__new__(cls, fileno, length, *args, **kwargs)

    monkeypatch.setattr(mmap, "mmap", Counting)
    assert verify_store(tmp_path) == []
    summary = summarize_store(tmp_path)
    assert summary.problems == []
    queues = {(t.topic, q.queue_id): q.messages for t in summary.topics for q in t.queues}
    assert len(queues) == TOPICS * 4 and queues["t00", 0] == 301
    assert mapped, "the message chunk is still mapped (the spy sees mappings)"
    assert [p for p in mapped if f"{os.sep}queues{os.sep}" in p] == []


def test_damage_in_leading_bytes_and_in_the_hole_is_found(tmp_path: Path) -> None:
    _build(tmp_path)
    assert verify_store(tmp_path) == []  # the control: the undamaged store
    far = _chunk(tmp_path, "t01", 0)  # a byte far out in the hole: the general path
    _write(far, HEADER_SIZE + 2 * LEADING_MAX, b"\x07")
    near = _chunk(tmp_path, "t02", 1)  # bytes after the last entry, in the first page
    _write(near, HEADER_SIZE + 3 * QUEUE_RECORD_SIZE, b"\x09" * 5)
    wrong = _chunk(tmp_path, "t03", 2)  # an entry pointing at another queue's message
    with open(_chunk(tmp_path, "t03", 3), "rb") as f:
        f.seek(HEADER_SIZE)
        other = f.read(QUEUE_RECORD_SIZE)
    _write(wrong, HEADER_SIZE, other)
    many = _chunk(tmp_path, "t00", 0)  # the 200th entry of the queue of 301, emptied
    _write(many, HEADER_SIZE + 200 * QUEUE_RECORD_SIZE, bytes(QUEUE_RECORD_SIZE))
    header = _chunk(tmp_path, "t04", 0)
    _write(header, 40, b"\xff\xff")  # the header's checksum no longer matches
    problems = verify_store(tmp_path)
    found = {(Path(p.file), p.kind) for p in problems}
    assert found == {
        (far, "torn tail"),
        (near, "torn tail"),
        (wrong, "queue entry"),
        (many, "torn tail"),
        (header, "header"),
    }, problems
    by_file = {Path(p.file): p for p in problems}
    assert by_file[far].offset == HEADER_SIZE + QUEUE_RECORD_SIZE
    assert f"{2 * LEADING_MAX + 1 - QUEUE_RECORD_SIZE} bytes" in by_file[far].reason
    assert by_file[near].offset == HEADER_SIZE + QUEUE_RECORD_SIZE
    assert "t03/2 offset 0 points at position" in by_file[wrong].reason
    assert by_file[many].offset == HEADER_SIZE + 200 * QUEUE_RECORD_SIZE
    assert "which holds the message of t03/3 offset 0" in by_file[wrong].reason
    # The summary reads the same files the same way: what it counts is what is there.
    summary = summarize_store(tmp_path)
    queues = {(t.topic, q.queue_id): q.messages for t in summary.topics for q in t.queues}
    assert queues["t00", 0] == 200 and queues["t01", 0] == 1 and queues["t02", 1] == 1


def test_progress_is_drawn_on_a_terminal_once_a_run_has_lasted(tmp_path: Path) -> None:
    _build(tmp_path)
    seen: list[tuple[int, int]] = []
    summarize_store(tmp_path, lambda done, total: seen.append((done, total)))
    assert seen[-1] == (TOPICS * 4, TOPICS * 4)
    assert all(a[0] < b[0] for a, b in itertools.pairwise(seen))
    late, soon, pipe = _Terminal(), _Terminal(), io.StringIO()
    for stream, delay in ((late, 3600.0), (soon, 0.0), (pipe, 0.0)):
        bar = ProgressBar(stream, "inspecting", noun="queues", delay=delay)
        bar(1_000, 10_000)
        bar(10_000, 10_000)
        bar.close()
    assert late.getvalue() == pipe.getvalue() == ""  # a quick run draws nothing
    assert "10,000 of 10,000 queues" in soon.getvalue()
