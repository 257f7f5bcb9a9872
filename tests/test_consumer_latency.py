"""The blocking group consumer, busy on one queue, takes what arrives on its idle queue at
once (its pull held by the broker meanwhile), not at the next re-check: counted in
messages of the busy queue handled in between and in pulls of the idle queue, against
a real broker."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from client_helpers import BrokerProcess, temporary_broker

import equeue
from equeue import OutgoingMessage
from equeue.client.consumer import GroupConsumer
from equeue.client.sync import Client

BUSY, IDLE = 0, 1
PRELOAD = 2400
BATCH, PREFETCH = 8, 2
ROUNDS, EVERY = 5, 400  # a message to the idle queue after every EVERY busy ones


@pytest.fixture
def broker() -> Iterator[BrokerProcess]:
    with temporary_broker() as running:
        yield running


class Counting:
    """The client, counting the pulls of each queue (the consumer's Requester)."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.url = client.url
        self.pulls: Counter[tuple[str, int]] = Counter()
        self.lock = threading.Lock()

    def request(self, op: str, arguments: dict[str, Any]) -> Any:
        if op == "pull_columns":
            with self.lock:
                self.pulls[arguments["topic"], arguments["queue_id"]] += 1
        return self.client.request(op, arguments)


def test_a_message_on_an_idle_queue_reaches_a_busy_consumer_at_once(
    broker: BrokerProcess,
) -> None:
    producer = equeue.connect(broker.url)
    client = equeue.connect(broker.url)
    counting = Counting(client)
    consumer: GroupConsumer | None = None
    try:
        producer.create_topic("t", 2)
        for _ in range(PRELOAD // 200):
            producer.send_batch("t", [OutgoingMessage(b"busy", queue_id=BUSY)] * 200)
        consumer = GroupConsumer(counting, "g", "t", batch_size=BATCH, prefetch=PREFETCH)
        assert {("t", BUSY), ("t", IDLE)} <= set(consumer.assignment())  # (and a retry queue)
        handled = 0  # messages of the busy queue
        sent_at: int | None = None
        delays: list[int] = []
        idle_pulls_at_start: int | None = None
        started = 0.0
        for _ in range(PRELOAD + ROUNDS + 10):
            message = consumer.poll(10.0)
            assert message is not None, (handled, delays)
            if message.queue_id == IDLE:
                assert sent_at is not None
                delays.append(handled - sent_at)
                sent_at = None
                if len(delays) == ROUNDS:
                    break
                continue
            handled += 1
            time.sleep(0.0005)  # the handler's work (a 50 ms re-check: ~100 of these)
            if handled == EVERY // 2:  # the idle queue's first empty pull is behind
                idle_pulls_at_start = counting.pulls["t", IDLE]
                started = time.monotonic()
            if handled % EVERY == 0 and sent_at is None and len(delays) < ROUNDS:
                producer.send("t", b"now", queue_id=IDLE)
                sent_at = handled
        assert handled < PRELOAD, "the busy queue ran dry: the consumer was not busy"
        busy_seconds = time.monotonic() - started
        assert idle_pulls_at_start is not None and len(delays) == ROUNDS
        # Behind at most the busy queue's prefetched batches (PREFETCH x BATCH, one more
        # in flight), plus what is handled while the broker's answer travels.
        assert max(delays) <= 4 * BATCH, delays
        # Not bought with polling: about one held pull a second, and one a message.
        idle_pulls = counting.pulls["t", IDLE] - idle_pulls_at_start
        assert idle_pulls <= ROUNDS + 2 + busy_seconds, (idle_pulls, busy_seconds)
    finally:
        if consumer is not None:
            consumer.close()
        client.close()
        producer.close()
