"""The writer the live-tail kill tests SIGKILL: 1 KiB messages in batches, forever.

    python tests/livetail_writer.py STORE_DIR [--keys]

Message ``i`` has body ``body(i)`` (and key ``key(i)`` with ``--keys``). After each
``send_batch`` returns it prints ``A <count sent so far>``; it is killed in the
middle of the batches that follow.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from equeue import MessageStore, OutgoingMessage, StoreConfig
from equeue.chunks.config import MiB

TOPIC = "t"
BATCH = 100
CONFIG = StoreConfig(chunk_data_size=8 * MiB, default_queue_count=1, flush="async")


def body(i: int) -> bytes:
    return i.to_bytes(8, "little") * 128


def key(i: int) -> str:
    return f"k{i % 1000}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("store", type=Path)
    parser.add_argument("--keys", action="store_true")
    args = parser.parse_args()
    store = MessageStore.open(args.store, CONFIG)
    sent = 0
    while True:
        batch = range(sent, sent + BATCH)
        if args.keys:
            store.send_batch(TOPIC, [OutgoingMessage(body(i), key=key(i)) for i in batch])
        else:
            store.send_batch(TOPIC, [body(i) for i in batch])
        sent += BATCH
        sys.stdout.write(f"A {sent}\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
