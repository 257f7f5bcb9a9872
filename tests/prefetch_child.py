"""A group member that takes one message and then holds the rest it prefetched,
unhandled, until it is killed (tests/test_pull_columns.py).

    python tests/prefetch_child.py URL GROUP TOPIC

Prints ``GOT <queue_id> <offset> HOLDS <n>`` once it has handed out its first message
and the next pull of that queue has come back (n: the messages it holds unhandled),
then sleeps until killed (or 60 s).
"""

from __future__ import annotations

import sys
import time

import equeue
from equeue.client.consumer import GroupConsumer


def main() -> int:
    url, group, topic = sys.argv[1:4]
    with equeue.connect(url) as client:
        consumer = GroupConsumer(
            client, group, topic, batch_size=5, prefetch=3, session_timeout=1.0,
            consumer_id="victim",
        )  # fmt: skip
        first = None
        for _ in range(100):  # bounded: the topic was filled before it started
            first = consumer.poll(0.2)
            if first is not None:
                break
        assert first is not None
        deadline = time.monotonic() + 10
        # the first batch, and (prefetch) the next pull of that queue, taken in
        while consumer.state.held() < 9 and time.monotonic() < deadline:
            consumer._refill()
            time.sleep(0.01)
        held = consumer.state.held()
        print(f"GOT {first.queue_id} {first.queue_offset} HOLDS {held}", flush=True)
        time.sleep(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
