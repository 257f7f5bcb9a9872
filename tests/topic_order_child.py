"""The child of tests/test_topic_flush_order_broker.py, run under tests/fdatasync_shim.c.

``python topic_order_child.py STORE``: a broker (``--flush sync``, the C flusher) and two
clients: one sends to topic "t" without pause (so the flusher is busy when the topics
are made), the other makes topics while it runs: "auto" by its first send, "made" by
the create_topic op and then a send. Prints, as JSON, each creation's topic and when
(time.monotonic_ns(), the shim's clock) its first request left and its send's answer
came, and how many sends "t" had answered.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import equeue
from equeue.server import BrokerThread

BACKGROUND_SENDS, LIMIT_S = 400, 30.0


def main() -> None:
    path = Path(sys.argv[1])
    sock = path.parent / "b.sock"
    creations: list[tuple[str, int, int]] = []
    with BrokerThread(path, flush="sync", listen=[f"unix:{sock}"]) as broker:
        flusher = type(broker.broker.commit._sync).__name__  # type: ignore[union-attr]
        url = broker.urls[0]
        with equeue.connect(url) as client:
            client.create_topic("t", 2)
        answered = 0
        stop = threading.Event()

        def background() -> None:
            nonlocal answered
            deadline = time.monotonic() + LIMIT_S
            with equeue.connect(url) as client:
                while answered < BACKGROUND_SENDS and time.monotonic() < deadline:
                    if stop.is_set() and answered >= 50:
                        break
                    client.send("t", b"t" * 200)
                    answered += 1

        thread = threading.Thread(target=background)
        thread.start()
        time.sleep(0.05)
        with equeue.connect(url) as client:
            begin = time.monotonic_ns()
            client.send("auto", b"first")  # created by its first send
            creations.append(("auto", begin, time.monotonic_ns()))
            time.sleep(0.02)
            begin = time.monotonic_ns()
            client.create_topic("made", 3)
            client.send("made", b"first", queue_id=2)
            creations.append(("made", begin, time.monotonic_ns()))
        stop.set()
        thread.join(LIMIT_S)
    print(json.dumps({"flusher": flusher, "creations": creations, "answered": answered}))


if __name__ == "__main__":
    main()
