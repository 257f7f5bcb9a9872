"""What the consumer-group tests share: a clock to step by hand, and a broker thread on
a fresh store."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator

from server_helpers import short_dir

import equeue
from equeue import MessageStore
from equeue.server import BrokerThread


class Clock:
    """time.monotonic (or time.time) for a GroupCoordinator: ``now`` is set by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@contextlib.contextmanager
def broker_thread(topic: str, queues: int) -> Iterator[str]:
    """A BrokerThread on a new store holding ``topic`` with ``queues`` queues, in a
    directory short enough for its socket: its URL; stopped and removed afterwards."""
    directory = short_dir()
    try:
        with MessageStore.open(directory / "s") as store:
            store.create_topic(topic, queues)
        thread = BrokerThread(directory / "s").start()
        try:
            yield thread.urls[0]
        finally:
            thread.stop()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def filled_broker_thread(topic: str, count: int) -> Iterator[str]:
    """broker_thread with one queue holding ``count`` messages b"m-0", b"m-1", ...: its
    URL."""
    with broker_thread(topic, 1) as url:
        with equeue.connect(url) as client:
            for i in range(count):
                client.send(topic, b"m-%d" % i)
        yield url
