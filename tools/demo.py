"""The main job of `make demo`: a realistic workload on a store under ./demo-store.

Several topics with tags and keys are sent, one consumer group consumes them
and commits offsets, the store is closed and reopened, and the consumer
resumes where it left off. Prints what it did. The "prices" topic is compacted
(newest price per item): `make demo` then runs `equeue compact` on the store.
The store's path is deleted first, so it must be absent, empty or a store.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import time
from pathlib import Path

from equeue import MessageStore, OutgoingMessage, StoreConfig
from equeue.atomicfile import read_json
from equeue.errors import EQueueError
from equeue.store.meta import IDENTITY_FILE

TOPICS = {"orders": ["created", "paid", "shipped"], "payments": ["card", "transfer"], "audit": [""]}


def produce(store: MessageStore, count: int, rng: random.Random) -> dict[str, int]:
    sent = dict.fromkeys([*TOPICS, "prices"], 0)
    for i in range(count):
        topic = rng.choice(list(TOPICS))
        tag = rng.choice(TOPICS[topic])
        key = f"customer-{rng.randrange(500)}" if topic != "audit" else None
        body = f'{{"n": {i}, "topic": "{topic}", "tag": "{tag}"}}'.encode()
        store.send(topic, body, tag=tag, key=key, properties={"source": "demo"})
        sent[topic] += 1
    for start in range(0, count // 2, 1000):  # price updates: most are superseded later
        store.send_batch(
            "prices",
            [
                OutgoingMessage(
                    f'{{"price": {rng.randrange(100, 999)}}}'.encode(), key=f"item-{n % 300}"
                )
                for n in range(start, start + 1000)
            ],
        )
    sent["prices"] = count // 2 // 1000 * 1000
    batch = [OutgoingMessage(f"audit line {i}".encode()) for i in range(count // 10)]
    store.send_batch("audit", batch)
    sent["audit"] += len(batch)
    return sent


def consume(store: MessageStore, group: str, topic: str, tags: list[str] | None) -> int:
    """The consumer loop, from the group's committed offsets until none is left."""
    with store.consumer(group, topic, tags=tags, batch_size=256, timeout=0) as consumer:
        return sum(1 for _ in consumer)


def why_not_replace(path: Path) -> str | None:
    """Why the demo must not delete ``path`` to start afresh; None if it is absent, an
    empty directory, or an equeue store (a store.json that checks out)."""
    if not os.path.lexists(path):
        return None
    if path.is_symlink() or not path.is_dir():
        return f"{path} exists and is not a directory: refusing to delete it"
    if not any(path.iterdir()):
        return None
    try:
        identity = read_json(path / IDENTITY_FILE)
    except (OSError, EQueueError):
        identity = None
    if isinstance(identity, dict) and "store_id" in identity:
        return None
    return (
        f"{path} is neither empty nor an equeue store (no valid {IDENTITY_FILE}): refusing "
        "to delete it; name an absent or empty directory, or a store to replace"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("store", type=Path, nargs="?", default=Path("demo-store"))
    parser.add_argument("--messages", type=int, default=200_000)
    args = parser.parse_args()
    refused = why_not_replace(args.store)
    if refused:
        sys.exit(f"demo: {refused}")
    shutil.rmtree(args.store, ignore_errors=True)
    rng = random.Random(7)
    config = StoreConfig(chunk_data_size=16 << 20, queue_chunk_records=100_000)

    started = time.perf_counter()
    with MessageStore.open(args.store, config) as store:
        store.create_topic("prices", 2, cleanup="compact")
        sent = produce(store, args.messages, rng)
        produced = time.perf_counter() - started
        total = sum(sent.values())
        print(f"sent {total:,} messages in {produced:.2f} s ({total / produced:,.0f} msg/s)")
        for topic, n in sent.items():
            print(f"  {topic:<9} {n:>8,} messages over queues {store.queue_ids(topic)}")
        paid = consume(store, "billing", "orders", ["paid"])
        print(f"consumer group 'billing' read {paid:,} 'paid' orders and committed its offsets")
        customer = store.query_by_key("orders", "customer-42", limit=3)
        print(f"query_by_key('orders', 'customer-42'): newest {len(customer)} of that customer:")
        for message in customer:
            print(
                f"  offset {message.queue_offset:>6} tag {message.tag:<8} {message.body.decode()}"
            )

    started = time.perf_counter()
    with MessageStore.open(args.store, config) as store:
        reopened = time.perf_counter() - started
        print(f"reopened in {reopened * 1000:.1f} ms; recovery clean: {store.recovery.clean}")
        store.send("orders", b'{"n": "after restart"}', tag="paid", key="customer-42")
        more = consume(store, "billing", "orders", ["paid"])
        print(f"'billing' resumed from its committed offsets and read {more} new 'paid' order")
        for topic in store.topics():
            ranges = [store.queue_range(topic, q) for q in store.queue_ids(topic)]
            print(f"  {topic:<9} queue ranges {ranges}")
    size = sum(f.stat().st_size for f in args.store.rglob("*") if f.is_file())
    print(f"store {args.store} holds {size / 2**20:.1f} MiB on disk")


if __name__ == "__main__":
    main()
