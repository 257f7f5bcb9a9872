"""The child process of tests/test_store_retention_crash.py: run ``apply_retention`` on a
store and SIGKILL itself inside it.

    python tests/retention_crash_child.py STORE MODE K NOW

The store is opened with ``retention`` of one hour and retention applied as of NOW
(seconds since the epoch, past every chunk's expiry). MODE ``before``/``after`` kills
the process just before, or just after, the K-th file-system call retention makes
(numbered and printed as ``CALL <n> <name> <path>`` by compaction_crash_child's kill
switch: unlinks of message and queue chunks, directory fsyncs, the checkpoint's
writes); ``never`` prints them and does not kill. MODE ``sends`` sends, after retention's checkpoint
and before its deletions, ``K`` messages to queue t/0 and enough to queue f/0 to
complete the log chunk holding them, so that retention removes them too; each
acknowledged send is printed as ``A <topic> <queue> <offset>``, and the process kills
itself once retention returned. A run that got through prints ``DONE``.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

from compaction_crash_child import _install_kill_switch

from equeue import MessageStore, StoreConfig


def config() -> StoreConfig:
    import datetime as dt

    return StoreConfig(
        chunk_data_size=4096,
        queue_chunk_records=342,
        default_queue_count=1,
        flush="os",
        retention=dt.timedelta(hours=1),
    )


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main(argv: list[str]) -> int:
    path, mode, k, now = Path(argv[0]), argv[1], int(argv[2]), float(argv[3])
    if mode not in ("before", "after", "never", "sends"):
        raise SystemExit(f"unknown mode {mode!r}")
    store = MessageStore.open(path, config())
    if mode == "sends":
        retain = store._retain

        def sends_then_retain(now: float | None) -> int:
            for _ in range(k):
                result = store.send("t", b"between the checkpoint and the deletion", queue_id=0)
                _say(f"A t 0 {result.queue_offset}")
            chunk = store._messages.last_chunk
            assert chunk is not None
            while store._messages.last_chunk is chunk:  # complete the chunk they are in
                store.send("f", b"x" * 500, queue_id=0)
            removed = retain(now)
            _say(f"REMOVED {removed}")
            os.kill(os.getpid(), signal.SIGKILL)
            return removed

        store._retain = sends_then_retain  # type: ignore[method-assign]
    else:  # "never" numbers and prints the calls too
        _install_kill_switch(mode, k)
    removed: Any = store.apply_retention(now=now)
    _say(f"REMOVED {removed}")
    _say("DONE")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
