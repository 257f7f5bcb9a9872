"""Review 37a A4 through a real broker: a member nacks a message with a 5 s delay, then
consumes and commits ~40 log chunks while retention (1 s, a checkpoint every 300 ms)
removes what was consumed. With ``retention_respects_consumers`` the delayed retry is
kept and delivered as attempt 1; without it, its loss is logged and counted in
``stats`` (``retry`` -> ``lost_to_retention``). Before the fix both lost it silently."""

from __future__ import annotations

import datetime as dt
import logging
import time
from pathlib import Path

import pytest
from server_helpers import short_home

import equeue
from equeue import MessageStore, StoreConfig
from equeue.format.chunk import MIN_CHUNK_DATA_SIZE
from equeue.server import BrokerThread

home = pytest.fixture(short_home, name="home")


@pytest.mark.parametrize("respects", [True, False], ids=["respecting", "plain"])
def test_a_delayed_retry_under_retention(
    home: Path, respects: bool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="equeue.retry")
    config = StoreConfig(
        chunk_data_size=MIN_CHUNK_DATA_SIZE, retention=dt.timedelta(seconds=1),
        retention_respects_consumers=respects, flush_thorough_interval_ms=300,
    )  # fmt: skip
    deliveries: list[str] = []
    with MessageStore.open(home / "s", config) as store:
        store.create_topic("t", 1)
        with BrokerThread(store, listen=[f"unix:{home}/b.sock"]) as broker:
            with equeue.connect(f"unix:{home}/b.sock") as client:
                consumer = client.consumer("g", "t", session_timeout=5.0)
                try:
                    client.send("t", b"nackme")
                    first = consumer.poll(5.0)
                    assert first is not None and first.body == b"nackme"
                    consumer.nack(first, delay=5)  # the 5 s level
                    nacked = time.monotonic()
                    filled = 0
                    held = None
                    deadline = nacked + 30
                    while time.monotonic() < deadline:
                        if filled < 160 and time.monotonic() < nacked + 3:
                            client.send_batch("t", [b"f" * 900] * 8)  # 2 chunks
                            filled += 8
                        elif held is None and time.monotonic() > nacked + 1:
                            # each turn until retention ran (its chunk expires at ~1 s)
                            held = client.stats().get("retention_held")
                        message = consumer.poll(0.05)
                        if message is not None and message.body == b"nackme":
                            deliveries.append(message.properties["equeue.attempt"])
                            break
                        if not respects and time.monotonic() > nacked + 8:
                            break  # due 5 s after the nack: it would have come by now
                    consumer.commit()
                    for _ in range(100):  # retention goes on once the retry was read
                        removed_to = client.queue_range("t", 0)[0]
                        if removed_to > 0:
                            break
                        time.sleep(0.1)
                    stats = client.stats()
                finally:
                    consumer.close()
            del broker
    assert removed_to > 0, "retention never ran"
    if respects:  # held by the mover on the copy's level until it moved it
        assert held is not None
        assert (held["group"], held["queue"], held["committed"]) == (
            "equeue.mover", "equeue.delay/1", False,
        )  # fmt: skip
        assert deliveries == ["1"]
        assert stats["retry"]["lost_to_retention"] == 0
        return
    assert deliveries == []
    assert stats["retry"]["lost_to_retention"] == 1
    said = [r.getMessage() for r in caplog.records if "before they were due" in r.message]
    assert len(said) == 1, said
    assert "equeue.delay/1" in said[0]
