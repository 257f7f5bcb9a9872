"""A reader beside the sink's commit (tests/test_spark_sink.py), in a process of its own:

    python tests/sink_reader.py STORE TOPIC ROWS TIMEOUT

It follows TOPIC through a read_only handle until it has read ROWS messages (bodies
"<n>") or TIMEOUT seconds pass, and prints one JSON line: the messages read, how many
bodies came twice, and the distinct totals it saw on the way (a total strictly between 0
and ROWS: it read while the commit appended). It says "ready" once its handle is open.
"""

from __future__ import annotations

import json
import sys
import time

from equeue import MessageStore


def main(argv: list[str]) -> int:
    store, topic, rows, timeout = argv[0], argv[1], int(argv[2]), float(argv[3])
    seen = bytearray(rows)
    read, twice, totals = 0, 0, set()
    deadline = time.monotonic() + timeout
    with MessageStore.open(store, read_only=True) as opened:
        print("ready", flush=True)  # the handle is open: what it reads it followed
        offsets: dict[int, int] = {}
        while read < rows and time.monotonic() < deadline:
            if topic not in opened.topics():
                opened.refresh()
                time.sleep(0.005)
                continue
            for queue_id in opened.queue_ids(topic):
                pulled = opened.pull(topic, queue_id, offsets.get(queue_id, 0), max_count=512)
                for message in pulled:
                    n = int(message.body)
                    twice += seen[n]
                    seen[n] = 1
                read += len(pulled)
                offsets[queue_id] = pulled.next_offset
            totals.add(read)
    print(json.dumps({"read": read, "twice": twice, "totals": sorted(totals)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
