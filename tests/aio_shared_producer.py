"""A producer process for the broker's kill test of the shared-client form: TASKS asyncio
tasks share ONE ``equeue.aio`` client (their sends of a loop turn coalesce into one
``send_bodies`` request), each sending ``NAME:TASK:SEQ`` to topic ``p`` one at a time.

    python tests/aio_shared_producer.py URL NAME [--tasks 32] [--limit 5000]

Prints ``A <body> <message id>`` (one write each) for every send answered OK. A task
stops at its first error (the broker gone) or after LIMIT sends; prints ``END <acked>``
and exits 0 either way, 3 if no send was ever answered or a non-equeue error came.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys

import equeue.aio
from equeue.errors import EQueueError

TOPIC = "p"
CONNECT_TIMEOUT = 0.2  # seconds


async def produce(url: str, name: str, tasks: int, limit: int) -> int:
    # After a SIGTERM the broker's socket is gone, and a send's reconnect retries until
    # connect_timeout; the tasks take the client's reconnect lock one after another, so
    # with the default 5 s the last of 32 would fail 160 s later. The test is about what
    # was acknowledged, not about that wait.
    client = await equeue.aio.connect(url, connect_timeout=CONNECT_TIMEOUT)
    acked = 0

    async def lane(task: int) -> None:
        nonlocal acked
        for seq in range(limit):
            body = f"{name}:{task}:{seq}".encode()
            try:
                sent = await client.send(TOPIC, body)
            except EQueueError:
                return  # the broker is gone: this send's answer never came
            os.write(1, b"A %s %s\n" % (body, sent.message_id.encode()))
            acked += 1

    try:
        await asyncio.gather(*(lane(task) for task in range(tasks)))
    finally:
        with contextlib.suppress(EQueueError):
            await client.close()
    return acked


def main() -> int:
    parser = argparse.ArgumentParser()
    for name in ("url", "name"):
        parser.add_argument(name)
    parser.add_argument("--tasks", type=int, default=32)
    parser.add_argument("--limit", type=int, default=5000)
    given = parser.parse_args()
    acked = asyncio.run(produce(given.url, given.name, given.tasks, given.limit))
    os.write(1, f"END {acked}\n".encode())
    return 0 if acked else 3


if __name__ == "__main__":
    sys.exit(main())
