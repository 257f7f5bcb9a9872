"""The writer process of the read-only tests (tests/test_store_readonly.py), driven one
command a line on stdin; it answers each with one line ``ok <json>`` on stdout::

    python tests/readonly_writer.py STORE_DIR '{"chunk_data_size": 4096, ...}' [CLEANUP]

The configuration's ``retention_days`` becomes ``retention``. It creates topic ``t`` (2
queues, ``CLEANUP``: "delete" or "compact"). Commands:

- ``send TOPIC QUEUE COUNT [KEY]`` (``KEY`` ``-``: each message gets ``k<offset % 5>``);
- ``flush``;
- ``retain [DAYS]``: retention as if DAYS days had passed; answers every queue's range;
- ``run ROUNDS``: each round sends 20 keyed messages to every queue of ``t`` and applies
  retention; answers every queue's range once all are done;
- ``close``. The tests SIGKILL it where they need a crash.

Message bodies say where they belong (``t/0/17`` plus padding), so a reader can check
each message it gets without asking the writer.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
import time
from typing import Any

from equeue import MessageStore, StoreConfig

PAD = 600  # bytes of padding per body: small chunks roll over every few messages


def body(topic: str, queue_id: int, offset: int) -> bytes:
    return f"{topic}/{queue_id}/{offset}/".encode() + b"p" * PAD


def key_for(offset: int) -> str:
    return f"k{offset % 5}"


def _send(store: MessageStore, topic: str, queue_id: int, count: int, key: str | None) -> None:
    for _ in range(count):
        offset = store.queue_range(topic, queue_id)[1]
        chosen = key_for(offset) if key == "-" else key
        store.send(topic, body(topic, queue_id, offset), key=chosen, queue_id=queue_id)


def _ranges(store: MessageStore) -> dict[str, list[int]]:
    ranges = {}
    for topic in store.topics():
        for queue_id in store.queue_ids(topic):
            ranges[f"{topic}/{queue_id}"] = list(store.queue_range(topic, queue_id))
    return ranges


def main() -> None:
    config = json.loads(sys.argv[2])
    if "retention_days" in config:
        config["retention"] = dt.timedelta(days=config.pop("retention_days"))
    store = MessageStore.open(sys.argv[1], StoreConfig(**config))
    store.create_topic("t", 2, cleanup="compact" if sys.argv[3:] == ["compact"] else "delete")
    for line in sys.stdin:
        command, *args = line.split()
        answer: Any = None
        if command == "send":
            _send(store, args[0], int(args[1]), int(args[2]), args[3] if len(args) > 3 else None)
        elif command == "flush":
            store.flush()
        elif command == "retain":
            store.apply_retention(time.time() + 86400 * float(args[0]) if args else None)
            answer = _ranges(store)
        elif command == "run":
            for _ in range(int(args[0])):
                for queue_id in store.queue_ids("t"):
                    _send(store, "t", queue_id, 20, "-")
                store.apply_retention()
            answer = _ranges(store)
        elif command == "close":
            store.close()
            print("ok null", flush=True)
            return
        else:
            raise SystemExit(f"unknown command {command!r}")
        print("ok " + json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
