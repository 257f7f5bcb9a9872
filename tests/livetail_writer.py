"""The writer the live-tail kill tests SIGKILL: 1 KiB messages in batches, forever.

    python tests/livetail_writer.py STORE_DIR [--keys]

Message ``i`` has body ``body(i)``. With ``--keys`` every tenth batch carries keys
(``key(i)``) and is followed by ``flush()``, which commits them to the key index,
so the live tail moves on past them. After each ``send_batch`` returns it prints
``A <count sent so far>``; it is killed in the middle of the batches that follow.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from equeue import MessageStore, OutgoingMessage, StoreConfig
from equeue.chunks.config import MiB

TOPIC = "t"
BATCH = 100
# Chunks of 32 MiB: the tests kill it 10 MB into one, past the start of a chunk, where
# the live tail still names the one before (or nothing yet) and recovery starts at the
# checkpoint instead.
CONFIG = StoreConfig(chunk_data_size=32 * MiB, default_queue_count=1, flush="async")


def body(i: int) -> bytes:
    return i.to_bytes(8, "little") * 128


def key(i: int) -> str:
    return f"k{i % 1000}"


def has_keys(i: int) -> bool:
    """Whether message ``i`` was sent with its key (under ``--keys``)."""
    return i // BATCH % 10 == 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("store", type=Path)
    parser.add_argument("--keys", action="store_true")
    args = parser.parse_args()
    store = MessageStore.open(args.store, CONFIG)
    sent = 0
    while True:
        batch = range(sent, sent + BATCH)
        if args.keys and has_keys(sent):
            store.send_batch(TOPIC, [OutgoingMessage(body(i), key=key(i)) for i in batch])
            store.flush()
        else:
            store.send_batch(TOPIC, [body(i) for i in batch])
        sent += BATCH
        sys.stdout.write(f"A {sent}\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
