"""The C send writes the readers' counters (Chunk.data_end and record_count of the log
and queue chunks, Queue.next_offset) into their int objects in place when nothing else
holds those ints (equeue/cext/sendstate.c, int_overwrite), and skips storing the round
robin turn that is already there. Here every value a reader holds stays what it read,
and every value read afterwards is the new one, as with a new int stored each time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from equeue import MessageStore, StoreConfig, speedups

needs_c = pytest.mark.skipif(speedups.SPEEDUPS is None, reason="the C accelerator is not built")
CONFIG = StoreConfig(chunk_data_size=1 << 20, queue_chunk_records=4096, flush="os")


def counters(store: MessageStore) -> tuple[int, int, int, int, int]:
    log = store._writer._chunk
    queue = store._queues["t"][0]
    assert queue._writer is not None
    entries = queue._writer._chunk
    assert log is not None and entries is not None
    return (log.data_end, log.record_count, entries.data_end, entries.record_count,
            queue.next_offset)  # fmt: skip


@needs_c
def test_held_counters_keep_their_values(tmp_path: Path) -> None:
    """Past the small-int cache (300 sends), a reader holding each counter across the
    next send still has the value it read, the attributes have the new values, and they
    add up to what the sends wrote."""
    with MessageStore.open(tmp_path / "s", CONFIG) as store:
        store.create_topic("t", 1)
        for _ in range(300):
            store.send("t", b"x" * 100)
        for i in range(200):
            held = counters(store)
            copies = tuple(int(str(v)) for v in held)  # equal values, other objects
            sent = store.send("t", b"y" * (i % 50))
            assert held == copies
            now = counters(store)
            assert now[1:] == (held[1] + 1, held[2] + 12, held[3] + 1, held[4] + 1)
            assert now[0] > held[0] and sent.queue_offset == held[4]
        # Not held: the next sends may write into the same objects; read again they
        # show the new values, and a pull sees every message.
        before = counters(store)[1]
        del held, now
        for _ in range(50):
            store.send("t", b"z")
        assert counters(store)[1] == before + 50 and counters(store)[4] == before + 50
        assert len(store.pull("t", 0, 0, 10_000).messages) == 550


@needs_c
def test_counters_equal_the_pure_python_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def run(path: Path) -> tuple[Any, ...]:
        with MessageStore.open(path, CONFIG) as store:
            store.create_topic("t", 1)
            for i in range(400):
                store.send("t", b"w" * (i % 90))
            return counters(store)

    fast = run(tmp_path / "c")
    monkeypatch.setattr(speedups, "SPEEDUPS", None)
    assert fast == run(tmp_path / "py")


@needs_c
def test_round_robin_turn_set_from_python_is_followed(tmp_path: Path) -> None:
    """One queue: the turn stays 1, not stored again; a turn Python sets is read by the
    next send and replaced by that send's. Three queues: the sends go round."""
    with MessageStore.open(tmp_path / "s", CONFIG) as store:
        store.create_topic("t", 1)
        store.create_topic("three", 3)
        turns = store._round_robin
        for _ in range(3):
            store.send("t", b"a")
        assert turns["t"] == 1
        turns["t"] = 7
        assert store.send("t", b"b").queue_id == 0 and turns["t"] == 1
        assert [store.send("three", b"c").queue_id for _ in range(6)] == [0, 1, 2, 0, 1, 2]
        turns["three"] = 2
        assert [store.send("three", b"d").queue_id for _ in range(2)] == [2, 0]
        assert turns["three"] == 1
