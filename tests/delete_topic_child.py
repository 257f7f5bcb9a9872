"""The child process of tests/test_delete_topic.py: open STORE and delete topic "gone",
SIGKILLing itself at a chosen file-system call of the deletion.

    python tests/delete_topic_child.py STORE MODE K [SENDS]

The calls are numbered and printed by compaction_crash_child's kill switch (``CALL <n>
<name> <path>``); MODE ``after`` kills just after call K returned (``before`` just
before it ran), ``never`` does not kill. A run that got through prints ``DONE``.
With SENDS, the child first sends that many messages to "gone" and writes no checkpoint
(before or after the deletion), so the deleted topic's records lie past the last one.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import compaction_crash_child
from compaction_crash_child import _install_kill_switch

from equeue import MessageStore, StoreConfig


def main(argv: list[str]) -> int:
    path, mode, k = Path(argv[0]), argv[1], int(argv[2])
    if mode not in ("before", "after", "never"):
        raise SystemExit(f"unknown mode {mode!r}")
    store = MessageStore.open(path, StoreConfig(flush="os"))  # checkpoints: the deletion's
    if len(argv) > 3:
        for i in range(int(argv[3])):
            store.send("gone", b"past the checkpoint %d" % i, key="k0", queue_id=0)
        store._checkpoint = lambda **_: None  # type: ignore[method-assign]
    # fdatasync too, named by its file: the deletion's commit point is an append to
    # topics.journal, synced so.
    compaction_crash_child.WRAPPED += ("fdatasync",)  # type: ignore[assignment]
    describe = compaction_crash_child._describe
    compaction_crash_child._describe = lambda name, args: describe(
        "fsync" if name == "fdatasync" else name, args
    )
    _install_kill_switch(mode, k)  # after the open: only the deletion's calls count
    store.delete_topic("gone")
    sys.stdout.write("DONE\n")
    sys.stdout.flush()
    if len(argv) > 3:
        os.kill(os.getpid(), signal.SIGKILL)  # no close(): no checkpoint
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
