"""A writer for tests/test_edges_*.py: a store of 1 MiB log chunks (the footer's running
hash follows the writer every 256 KiB) written with 1 KiB messages, alternately to
topic ``t`` (kept) and ``d`` (30 s retention: a compaction as of a minute later removes
them), then closed, SIGKILLed, or held open.

    python tests/edges_writer.py STORE MODE COUNT

MODE ``close``: send COUNT messages, close the store, print DONE. ``kill``: send COUNT,
SIGKILL itself (mid-chunk: COUNT is chosen so). ``hold``: send COUNT, print READY,
wait for a line on stdin, then SIGKILL itself (a live writer beside a test's read-only
view). Each acknowledged send prints ``A <i> <topic> <queue offset> <position>``.
"""

from __future__ import annotations

import datetime as dt
import os
import signal
import sys
import threading
from pathlib import Path

from equeue import MessageStore, StoreConfig

CHUNK = 1 << 20  # log chunk data size: 4 follows of the running hash (every 256 KiB)


def config(**overrides: object) -> StoreConfig:
    settings: dict[str, object] = {
        "chunk_data_size": CHUNK,
        "queue_chunk_records": 1024,
        "default_queue_count": 1,
        "flush": "os",
    }
    settings.update(overrides)
    return StoreConfig(**settings)  # type: ignore[arg-type]


def body(i: int) -> bytes:
    return (b"edges message %06d " % i) * 50  # 1050 bytes


def topic_of(i: int) -> str:
    return "t" if i % 2 == 0 else "d"


def prepare(store: MessageStore) -> None:
    if "t" not in store.topics():
        store.create_topic("t", 1)
        store.create_topic("d", 1, retention=dt.timedelta(seconds=30))


class Retaining:
    """``store.apply_retention()`` in a loop on a thread of its own until ``stop()``:
    retention running underneath a test's writes. ``removed``: what each call removed."""

    def __init__(self, store: MessageStore, pause: float = 0.002) -> None:
        self.removed: list[int] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(store, pause), daemon=True)
        self._thread.start()

    def _run(self, store: MessageStore, pause: float) -> None:
        try:
            while not self._stop.is_set():
                self.removed.append(store.apply_retention())
                self._stop.wait(pause)
        except BaseException as exc:
            self.errors.append(exc)

    def stop(self) -> int:
        """Stop; the chunks removed in all (a failure of the loop raised here)."""
        self._stop.set()
        self._thread.join(20)
        assert not self.errors, self.errors
        return sum(self.removed)


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main(argv: list[str]) -> int:
    path, mode, count = Path(argv[0]), argv[1], int(argv[2])
    store = MessageStore.open(path, config())
    prepare(store)
    for i in range(count):
        topic = topic_of(i)
        result = store.send(topic, body(i), queue_id=0)
        _say(f"A {i} {topic} {result.queue_offset} {result.position}")
    if mode == "close":
        store.close()
        _say("DONE")
        return 0
    if mode == "hold":
        _say("READY")
        sys.stdin.readline()
    os.kill(os.getpid(), signal.SIGKILL)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
