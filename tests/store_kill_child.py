"""A child process that SIGKILLs itself at a chosen point of a store operation, for
tests/test_store_retention_crash.py and tests/test_store_killed_damage.py.

    python tests/store_kill_child.py STORE MODE K NOW

The store is opened with ``config()`` (4 KiB log chunks, flush="os", so the only
checkpoint is the one the open writes, and ``retention`` of one hour).

Retention, applied as of NOW (seconds since the epoch, past every chunk's expiry):
MODE ``before``/``after`` kills the process just before, or just after, the K-th
file-system call retention makes (numbered and printed as ``CALL <n> <name> <path>``
by compaction_crash_child's kill switch: unlinks of message and queue chunks,
directory fsyncs, the checkpoint's writes); ``never`` prints them and does not kill.
MODE ``sends`` sends, after retention's checkpoint and before its deletions, ``K``
messages to queue t/0 and enough to queue f/0 to complete the log chunk holding them,
so that retention removes them too; the process kills itself once retention returned.

MODE ``killed`` sends ``K`` messages alternately to t/0 and t/1, then ``TAIL`` more to t/1
(message i has body ``body(i)``; all after the open's checkpoint), and kills itself.

Each acknowledged send to t is printed as ``A t <queue> <offset> <position>``; a run
that got through prints ``DONE``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
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


TAIL = 60  # killed: the last messages, all to t/1 (some 8 KiB: two log chunks)


def body(i: int) -> bytes:
    return b"killed-store message %d " % i + bytes([65 + i % 26]) * (40 + i % 90)


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


@dataclass(frozen=True)
class Outcome:
    stdout: str
    returncode: int

    @property
    def killed(self) -> bool:
        return self.returncode == -9

    def acknowledged(self) -> list[tuple[int, int, int]]:
        """(queue id, offset, position) of each acknowledged send."""
        lines = [line.split() for line in self.stdout.splitlines() if line[:2] == "A "]
        return [(int(f[2]), int(f[3]), int(f[4])) for f in lines]


def run_child(store: Path, mode: str, k: int, now: float = 0.0) -> Outcome:
    """Run this child (from a test) and return what it printed."""
    proc = subprocess.run(
        [sys.executable, __file__, str(store), mode, str(k), repr(now)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode in (0, -9), proc.stderr
    return Outcome(proc.stdout, proc.returncode)


def main(argv: list[str]) -> int:
    path, mode, k, now = Path(argv[0]), argv[1], int(argv[2]), float(argv[3])
    if mode not in ("before", "after", "never", "sends", "killed"):
        raise SystemExit(f"unknown mode {mode!r}")
    store = MessageStore.open(path, config())
    if mode == "killed":
        if "t" not in store.topics():
            store.create_topic("t", 2)
        for i in range(k + TAIL):
            queue_id = 1 if i >= k else i % 2
            result = store.send("t", body(i), queue_id=queue_id)
            _say(f"A t {queue_id} {result.queue_offset} {result.position}")
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "sends":
        retain = store._retain

        def sends_then_retain(now: float | None) -> int:
            for _ in range(k):
                result = store.send("t", b"between the checkpoint and the deletion", queue_id=0)
                _say(f"A t 0 {result.queue_offset} {result.position}")
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
