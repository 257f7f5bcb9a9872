"""``source.queue_index_positions``: what the queue index entries of a span name, a
superset of the rows (its docstring): offsets of queue chunks retention removed left
out, entries below the first retained offset kept. Compaction's holes in it:
tests/test_spark_source.py::test_offsets_options_on_a_compacted_store."""

from __future__ import annotations

import datetime as dt
import time
from pathlib import Path

from equeue import MessageStore, StoreConfig
from equeue.format.chunk import parse_chunk_file_name
from equeue.spark import source
from equeue.store.meta import QUEUES_DIR

QUEUE_CHUNK_RECORDS = 342  # the smallest queue chunk (4104 B): retention removes whole ones


def pulled_positions(opened: MessageStore, topic: str, queue_id: int, start: int) -> list[int]:
    _, end = opened.queue_range(topic, queue_id)
    messages = opened.pull(topic, queue_id, start, max(end - start, 1)).messages
    return [m.position for m in messages]


def test_retention_leaves_out_removed_queue_chunks_and_keeps_entries_below_the_first(
    tmp_path: Path,
) -> None:
    config = StoreConfig(
        chunk_data_size=16 * 1024,
        queue_chunk_records=QUEUE_CHUNK_RECORDS,
        retention=dt.timedelta(seconds=1),
        flush="os",
    )
    with MessageStore.open(tmp_path, config) as opened:
        opened.create_topic("t", 1)
        for i in range(1500):
            opened.send("t", bytes(200), key=f"k{i}")
        assert opened.apply_retention(now=time.time() + 60) > 0
    queue_dir = tmp_path / QUEUES_DIR / "t" / "0"
    kept = [parse_chunk_file_name(p.name) for p in queue_dir.iterdir()]
    base = min(n for n, _ in filter(None, kept)) * QUEUE_CHUNK_RECORDS
    with MessageStore.open(tmp_path, read_only=True) as opened:
        first, end = opened.queue_range("t", 0)
        assert 0 < base < first < end  # the control: a queue chunk removed, one half below
        retained = pulled_positions(opened, "t", 0, first)
        assert len(retained) == end - first
        # From a removed queue chunk: on from the first retained offset, no error.
        assert source.queue_index_positions(opened, [("t", 0, 0, end)]) == retained
        # From a kept queue chunk below the first retained offset: its entries, naming
        # positions below every retained message (their log chunks are gone).
        below = source.queue_index_positions(opened, [("t", 0, base, end)])
        assert below is not None and below[first - base :] == retained
        assert len(below) == end - base and below[first - base - 1] < retained[0]
