"""A broker process that SIGKILLs itself at a chosen point of the retry mover's first
move, for tests/test_retry_mover.py.

    python tests/mover_kill_child.py STORE POINT

The store must hold due copies in ``equeue.delay``. POINT: ``appended`` (on the loop,
once the move's first send_batch returned), ``flush`` (on the committer thread, before
the log's fdatasync), ``cursor`` (after the fdatasync, before the cursor file's write),
``written`` (after that write). The process prints ``KILLING POINT`` and kills itself;
if the point never comes within 20 s it prints ``NOT KILLED`` and exits 1.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from equeue import MessageStore
from equeue.protocol.retries import RETRY_PREFIX
from equeue.server import BrokerThread
from equeue.server.retry import Retries

POINTS = ("appended", "flush", "cursor", "written")


def kill(point: str) -> None:
    print("KILLING", point, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def main(path: Path, point: str) -> int:
    assert point in POINTS, point
    real_persist = Retries._persist
    real_commit = Retries.commit_cursors

    def persist(self: Retries, cursors: dict[tuple[str, int], int], marker: int | None) -> None:
        if point == "flush":
            kill(point)
        real_persist(self, cursors, marker)

    def commit(self: Retries, cursors: dict[tuple[str, int], int], marker: int | None) -> None:
        if point == "cursor":
            kill(point)
        real_commit(self, cursors, marker)
        if point == "written":
            kill(point)

    Retries._persist = persist  # type: ignore[method-assign]
    Retries.commit_cursors = commit  # type: ignore[method-assign]
    with MessageStore.open(path) as store:
        real_send_batch = store.send_batch

        def send_batch(topic: str, messages: Any) -> Any:
            results = real_send_batch(topic, messages)
            if point == "appended" and topic.startswith(RETRY_PREFIX):
                kill(point)
            return results

        store.send_batch = send_batch  # type: ignore[method-assign]
        with BrokerThread(store):
            time.sleep(20.0)
    print("NOT KILLED", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2]))
