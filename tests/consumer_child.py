"""A consumer process of the consumer-loop tests (tests/test_consumer.py)::

    python tests/consumer_child.py STORE_DIR GROUP OUT_FILE BATCH_SIZE IDLE_SECONDS [DELAY]

It opens the store read-only and consumes topic ``t`` as group ``GROUP`` with the
consumer loop (auto commit), appending ``QUEUE_ID OFFSET`` to OUT_FILE for each message
once it is processed (one write, flushed, per line: a SIGKILL loses no line half
written), sleeping DELAY seconds per message (so a test can kill it mid-batch). It
stops once no message arrived for IDLE_SECONDS, and prints ``done``.
"""

from __future__ import annotations

import sys
import time

from equeue import MessageStore


def main() -> None:
    path, group, out_file, batch, idle = sys.argv[1:6]
    delay = float(sys.argv[6]) if len(sys.argv) > 6 else 0.0
    with (
        MessageStore.open(path, read_only=True) as store,
        open(out_file, "a", buffering=1) as out,
        store.consumer(group, "t", batch_size=int(batch), timeout=float(idle)) as consumer,
    ):
        for message in consumer:
            expected = f"t/{message.queue_id}/{message.queue_offset}".encode()
            assert message.body == expected, (message.body, expected)
            out.write(f"{message.queue_id} {message.queue_offset}\n")
            if delay:
                time.sleep(delay)
    print("done", flush=True)


if __name__ == "__main__":
    main()
