"""``offset_for_time`` on a read-only handle whose view retention left behind: the
answer is a fresh handle's, and the log is read O(log n) times, not once per offset of
the removed chunks (fixrecov, round 19: 5,699 log reads for 256 removed chunks). Log
reads are counted by wrapping the handle's ``ChunkReader.read``; retention runs in the
writer before the call (the handle looked a moment before: its every-10-ms look would
not see it) or during the search (at the handle's n-th log read)."""

from __future__ import annotations

import datetime as dt
import math
import time
from collections.abc import Callable
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from store_helpers import killed_store

from equeue import MessageStore, StoreConfig

RETENTION = dt.timedelta(hours=1)
CONFIG = StoreConfig(flush="os", chunk_data_size=4096, retention=RETENTION)
BODY = b"b" * 100  # ~22 messages a 4 KiB chunk


def _fill(path: Path, count: int) -> MessageStore:
    writer = MessageStore.open(path, CONFIG)
    writer.create_topic("x", 1)
    for _ in range(count):
        writer.send("x", BODY)
    writer.flush()
    return writer


def _remove_through(writer: MessageStore, chunk_index: int) -> int:
    """Retention of the log's chunks up to ``chunk_index`` (by their last stored time);
    returns how many it removed."""
    chunks = list(writer._messages)
    last = chunks[min(chunk_index, len(chunks) - 2)].footer
    assert last is not None and last.last_timestamp is not None
    now = last.last_timestamp / 1e9 + RETENTION.total_seconds() + 1e-6
    return writer.apply_retention(now=now)


def _counted(reader: MessageStore, at_read: Callable[[int], None] | None = None) -> list[int]:
    """A counter of ``reader``'s log reads; ``at_read(n)`` runs before the n-th."""
    count = [0]
    read = reader._reader.read

    def counting(position: int) -> bytes:
        count[0] += 1
        if at_read is not None:
            at_read(count[0])
        return read(position)

    reader._reader.read = counting  # type: ignore[method-assign]
    return count


def _stale_reader(path: Path) -> MessageStore:
    reader = MessageStore.open(path, read_only=True)
    reader.queue_range("x", 0)  # its queue and log viewed now
    return reader


def _fresh_answer(path: Path, when: float) -> int:
    with MessageStore.open(path, read_only=True) as fresh:
        return fresh.offset_for_time("x", 0, when)


def _times(writer: MessageStore) -> list[float]:
    first, end = writer.queue_range("x", 0)
    return [m.stored_at for m in writer.pull("x", 0, first, end - first).messages]


def test_a_stale_view_after_256_chunks_removed_reads_the_log_log_n_times(
    tmp_path: Path,
) -> None:
    # Before: 12,290 log reads (the first offset past the removed chunks, 9.0 s of CPU).
    path = tmp_path / "s"
    with _fill(path, 8000) as writer, _stale_reader(path) as reader:
        assert _remove_through(writer, 255) == 256
        count = _counted(reader)
        first, end = writer.queue_range("x", 0)
        retained = _times(writer)
        for when in (0, retained[len(retained) // 2], time.time() + 60):
            count[0] = 0
            reader._messages.looked_at = time.monotonic()  # as a look just before left it
            answer = reader.offset_for_time("x", 0, when)
            assert answer == _fresh_answer(path, when)
            assert count[0] <= math.ceil(math.log2(end - first + 1)) + 2


def test_chunks_removed_during_the_search_cost_a_log_read_each_at_most(tmp_path: Path) -> None:
    # Retention removes 256 chunks at the search's first log read: each later probe below
    # the new first chunk steps past a removed chunk at a time, by the queue's entries.
    # Before: 12,290 log reads.
    path = tmp_path / "s"
    with _fill(path, 8000) as writer, _stale_reader(path) as reader:
        removed: list[int] = []

        def retention(n: int) -> None:
            if n == 1:
                removed.append(_remove_through(writer, 255))

        count = _counted(reader, retention)
        answer = reader.offset_for_time("x", 0, 0)
        assert removed == [256]
        assert answer == writer.queue_range("x", 0)[0] == _fresh_answer(path, 0)
        assert count[0] <= 256 + 2 * math.ceil(math.log2(8000)) + 2


@settings(max_examples=25, deadline=None)
@given(
    count=st.integers(1, 700),
    before=st.integers(-1, 40),
    during=st.integers(-1, 40),
    at_read=st.integers(1, 12),
    pick=st.floats(0, 1),
    shift=st.sampled_from([-1e-3, 0.0, 1e-6, 1e-3]),
)
def test_a_stale_view_answers_as_a_fresh_handle(
    tmp_path_factory: object,
    count: int,
    before: int,
    during: int,
    at_read: int,
    pick: float,
    shift: float,
) -> None:
    # Retention up to chunk ``before`` ahead of the call (-1: none) and up to ``during``
    # at the handle's ``at_read``-th log read; the time asked is a message's own (picked
    # among all sent, removed or not) shifted a little, or before or after every one.
    path = Path(str(tmp_path_factory.mktemp("s"))) / "s"  # type: ignore[attr-defined]
    with _fill(path, count) as writer, _stale_reader(path) as reader:
        stored = _times(writer)
        when = stored[min(int(pick * len(stored)), len(stored) - 1)] + shift
        chunks = len(list(writer._messages))
        if before >= 0 and chunks > 1:
            _remove_through(writer, before)

        ran: list[int] = []

        def retention(n: int) -> None:
            if n == at_read and during >= 0 and len(list(writer._messages)) > 1:
                ran.append(_remove_through(writer, during))

        at_start = _fresh_answer(path, when)
        log_reads = _counted(reader, retention)
        reader._messages.looked_at = time.monotonic()
        answer = reader.offset_for_time("x", 0, when)
        if not ran or not ran[0]:
            assert answer == at_start
        else:
            # Retention during the call: the answer of a state it went through (what the
            # view held mapped may still be read; never below what it found removed).
            assert at_start <= answer <= _fresh_answer(path, when)
        assert log_reads[0] <= chunks + 2 * math.ceil(math.log2(count + 1)) + 2


WRITER = """
import os, signal, sys, datetime as dt
from equeue import MessageStore, StoreConfig
store = MessageStore.open(sys.argv[1], StoreConfig(
    flush="os", chunk_data_size=4096, retention=dt.timedelta(hours=1)))
last = list(store._messages)[127].footer
assert store.apply_retention(now=last.last_timestamp / 1e9 + 3600 + 1e-6) == 128
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_stale_view_beside_a_writer_killed_after_its_retention(tmp_path: Path) -> None:
    # Two processes: a writer process removes 128 chunks and is SIGKILLed; the stale
    # handle's answers are a fresh handle's at O(log n) log reads, and again after the
    # next writable open's recovery.
    path = tmp_path / "s"
    _fill(path, 4000).close()
    with _stale_reader(path) as reader:
        killed_store(WRITER, path)
        count = _counted(reader)
        for when in (0, time.time() + 60):
            count[0] = 0
            reader._messages.looked_at = time.monotonic()
            assert reader.offset_for_time("x", 0, when) == _fresh_answer(path, when)
            assert count[0] <= math.ceil(math.log2(4000)) + 2
        with MessageStore.open(path, CONFIG) as writer:
            assert writer.recovery.problems == []
            first = writer.queue_range("x", 0)[0]
            assert writer.offset_for_time("x", 0, 0) == first
        reader.refresh()
        assert reader.offset_for_time("x", 0, 0) == first
