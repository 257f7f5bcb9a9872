"""The streaming tests' producer: a separate process writing into a store while a query reads.

    python tests/stream_producer.py STORE --first 0 --count 600 [--gate FILE --gate-at 300]
        [--gate-timeout SECONDS] [--max-store-bytes N] [--pause-every 20 --pause-ms 5]

Message ``i`` (``first <= i < first + count``) goes to ``TOPICS`` round-robin by ``i``
(``topic_of``, ``queue_of``) with body ``body_of(i)``, key ``k<i % 7>`` and a ``seq`` property; a
checker knows every message from the store alone. With ``--gate``, after ``--gate-at``
messages it prints ``GATE`` and waits (``--gate-timeout`` seconds at most, default 600, else
exit 4) until FILE exists, so a test can act while the producer is known to be mid-way.
With ``--max-store-bytes`` the store keeps at most that many bytes of log and the producer
applies retention after every ``--pause-every`` messages. It prints ``DONE <count>`` and
exits 0 at the end.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from equeue import MessageStore, StoreConfig
from equeue.format.chunk import MIN_CHUNK_DATA_SIZE

TOPICS: tuple[str, ...] = ("orders", "orders", "orders", "payments", "payments")
QUEUES: dict[str, int] = {"orders": 3, "payments": 2}
CHUNK_DATA_SIZE = MIN_CHUNK_DATA_SIZE  # small chunks: retention and compaction bite early
EXIT_GATE_TIMEOUT = 4
GATE_TIMEOUT = 600.0  # seconds at the gate at most (a test passes its own, above its wait)


def topic_of(i: int) -> str:
    return TOPICS[i % len(TOPICS)]


def body_of(i: int) -> bytes:
    return b"message %d " % i + b"x" * (i % 50)


def config(max_store_bytes: int | None = None) -> StoreConfig:
    return StoreConfig(chunk_data_size=CHUNK_DATA_SIZE, flush="os", max_store_bytes=max_store_bytes)


def create(path: Path) -> None:
    """The store the tests stream from: ``QUEUES``' topics, and one no query reads."""
    with MessageStore.open(path, config()) as store:
        for topic, count in QUEUES.items():
            store.create_topic(topic, count)
        store.create_topic("other", 1)
        store.send("other", b"not read")


def queue_of(i: int) -> int:
    """Each topic's queues in turn: 500 messages put 100 in each queue."""
    return TOPICS[: i % len(TOPICS)].count(topic_of(i))


def produce(store: MessageStore, first: int, count: int) -> None:
    for i in range(first, first + count):
        store.send(
            topic_of(i),
            body_of(i),
            key=f"k{i % 7}",
            properties={"seq": str(i)},
            queue_id=queue_of(i),
        )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("store", type=Path)
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--gate", type=Path)
    parser.add_argument("--gate-at", type=int, default=0)
    parser.add_argument("--gate-timeout", type=float, default=GATE_TIMEOUT)
    parser.add_argument("--max-store-bytes", type=int)
    parser.add_argument("--pause-every", type=int, default=20)
    parser.add_argument("--pause-ms", type=float, default=0.0)
    args = parser.parse_args()
    with MessageStore.open(args.store, config(args.max_store_bytes)) as store:
        sent = 0
        while sent < args.count:
            if args.gate is not None and sent == args.gate_at:
                store.flush()
                print("GATE", flush=True)
                deadline = time.monotonic() + args.gate_timeout
                while not args.gate.exists():
                    if time.monotonic() > deadline:
                        return EXIT_GATE_TIMEOUT
                    time.sleep(0.02)
            step = min(args.pause_every, args.count - sent)
            if args.gate is not None and sent < args.gate_at:
                step = min(step, args.gate_at - sent)
            produce(store, args.first + sent, step)
            sent += step
            if args.max_store_bytes is not None:
                store.apply_retention()
            store.flush()
            time.sleep(args.pause_ms / 1000)
    print(f"DONE {sent}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
