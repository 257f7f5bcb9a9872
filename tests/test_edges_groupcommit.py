"""The broker's group-commit wait (--flush sync) with retention deleting log chunks
underneath: 4 connections send concurrently (their fdatasyncs shared, the wait taken)
while retention runs in a loop beside the broker's loop; every send is answered, each
queue's offsets are dense, what retention left reads back exactly, and ``equeue verify``
finds nothing once the store is closed (every footer checksum, running or whole).
Control: the same without retention."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from edges_writer import Retaining
from server_helpers import short_home

import equeue
from equeue import MessageStore, StoreConfig
from equeue.format.chunk import chunk_file_size
from equeue.inspect.verify import verify_store
from equeue.server import BrokerThread

CHUNK = 16 * 1024
SENDERS, EACH = 4, 150


home = pytest.fixture(short_home, name="home")


@pytest.mark.parametrize("retained", [False, True], ids=["control", "retention"])
def test_group_commit_with_retention_underneath(home: Path, retained: bool) -> None:
    limit = 4 * chunk_file_size(CHUNK) if retained else None
    config = StoreConfig(
        chunk_data_size=CHUNK, flush="async", flush_interval_ms=20, max_store_bytes=limit
    )
    store = MessageStore.open(home / "s", config)
    store.create_topic("t", SENDERS)
    broker = BrokerThread(store, flush="sync", group_commit_wait_us=500).start()
    acks: dict[int, list[int]] = {q: [] for q in range(SENDERS)}
    errors: list[BaseException] = []

    def send(q: int) -> None:
        try:
            with equeue.connect(broker.urls[0]) as client:
                for i in range(EACH):
                    body = b"%d/%d " % (q, i) + b"." * 400
                    acks[q].append(client.send("t", body, queue_id=q).queue_offset)
        except BaseException as exc:
            errors.append(exc)

    try:
        retaining = Retaining(store, 0.005) if retained else None
        threads = [threading.Thread(target=send, args=(q,)) for q in range(SENDERS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        removed = retaining.stop() if retaining is not None else 0
        assert not errors, errors
        with equeue.connect(broker.urls[0]) as client:
            stats = client.stats()
            for q in range(SENDERS):
                assert acks[q] == list(range(EACH))
                first, end = client.queue_range("t", q)
                assert end == EACH and (first > 0) == retained
                got = client.pull("t", q, first, EACH).messages
                assert [m.body for m in got] == [
                    b"%d/%d " % (q, i) + b"." * 400 for i in range(first, EACH)
                ]
        assert stats["group_commit_waits"] > 0, stats
        assert (removed > 0) == retained
    finally:
        broker.stop()
        store.close()
    assert verify_store(home / "s") == []
