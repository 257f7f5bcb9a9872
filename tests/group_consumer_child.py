"""A consumer-group member process for tests/test_groups_kill.py.

    python tests/group_consumer_child.py URL GROUP TOPIC NAME [--session S] [--work-ms W]

Joins GROUP on TOPIC as consumer NAME through the blocking client, prints ``READY``
once it has its first assignment, then one line per message, in one write each:
``M <queue_id> <offset> <message_id>``, then sleeps W ms (its "work": a slow member
falls behind, so it always has messages processed and not yet committed). Runs until
killed or its stdin closes; on an equeue error it stops for, prints ``E <class> <text>``
and exits 3.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import equeue
from equeue.client.consumer import GroupConsumer
from equeue.errors import EQueueError


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("group")
    parser.add_argument("topic")
    parser.add_argument("name")
    parser.add_argument("--session", type=float, default=2.0)
    parser.add_argument("--work-ms", type=float, default=0.0)
    args = parser.parse_args()
    stop = threading.Event()

    def watch_stdin() -> None:  # the test closes our stdin: leave cleanly
        # (os.read, not sys.stdin's buffer: a daemon thread holding that buffer's lock
        # aborts the interpreter's exit, when the loop below ends by itself)
        while os.read(0, 4096):
            pass
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    out = sys.stdout.fileno()
    try:
        with equeue.connect(args.url) as client, GroupConsumer(
            client, args.group, args.topic, session_timeout=args.session,
            consumer_id=args.name, batch_size=16,
        ) as consumer:  # fmt: skip
            os.write(out, b"READY\n")
            while not stop.is_set():
                message = consumer.poll(0.2)
                if message is not None:
                    line = f"M {message.queue_id} {message.queue_offset} {message.message_id}\n"
                    os.write(out, line.encode())
                    if args.work_ms:
                        time.sleep(args.work_ms / 1000)
    except EQueueError as exc:  # (e.g. fenced: another process joined under its name)
        os.write(out, f"E {type(exc).__name__} {exc}\n".encode())
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
