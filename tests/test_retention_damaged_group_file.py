"""retention_respects_consumers with a consumer group file damaged while the store is
open (review f F9): the group's commit must still hold retention back. It was left out
of the scan, so the next turn removed everything the group had not consumed."""

from __future__ import annotations

import datetime as dt
import time
from pathlib import Path

from equeue import MessageStore, StoreConfig
from equeue.format.chunk import MIN_CHUNK_DATA_SIZE
from equeue.store.meta import CONSUMERS_DIR
from equeue.store.offsets import commit_group

CONFIG = StoreConfig(
    chunk_data_size=MIN_CHUNK_DATA_SIZE,
    retention=dt.timedelta(seconds=1),
    retention_respects_consumers=True,
    flush="os",
)
LATER = time.time() + 3600  # every chunk past retention


def _store(path: Path) -> MessageStore:
    store = MessageStore.open(path, CONFIG)
    store.create_topic("t", 1)
    for i in range(400):
        store.send("t", b"m%d" % i * 10)
    return store


def test_a_group_file_damaged_after_it_was_read_keeps_its_hold(tmp_path: Path) -> None:
    with _store(tmp_path) as store:
        commit_group(store, "g", {("t", 0): 20})  # as the broker commits for a group
        store.apply_retention(now=LATER)
        first = store.queue_range("t", 0)[0]
        assert first <= 20
        (tmp_path / CONSUMERS_DIR / "g.json").write_text("junk")
        assert store.apply_retention(now=LATER) == 0
        assert store.queue_range("t", 0)[0] == first
        assert [m.queue_offset for m in store.pull("t", 0, 20, 1)] == [20]


def test_a_group_file_never_read_holds_every_chunk(tmp_path: Path) -> None:
    with _store(tmp_path) as store:
        commit_group(store, "g", {("t", 0): 390})
        (tmp_path / CONSUMERS_DIR / "h.json").write_text("junk")  # whose offsets nobody knows
        assert store.apply_retention(now=LATER) == 0
        assert store.queue_range("t", 0)[0] == 0
        # The remedy: the damaged file moved out, retention goes on up to g's commit.
        (tmp_path / CONSUMERS_DIR / "h.json").rename(tmp_path / "h.json.damaged")
        assert store.apply_retention(now=LATER) > 0
        assert 0 < store.queue_range("t", 0)[0] <= 390
