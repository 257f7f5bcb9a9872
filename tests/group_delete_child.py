"""The child process of tests/test_group_delete.py: open STORE and delete group "g",
SIGKILLing itself at a chosen file-system call of the deletion.

    python tests/group_delete_child.py STORE MODE K

The calls (rename, replace, unlink, rmdir, fsync, fdatasync) are numbered and printed by
compaction_crash_child's kill switch (``CALL <n> <name> <path>``); MODE ``after`` kills
just after call K returned, ``never`` does not kill. A run that got through prints
``DONE``."""

from __future__ import annotations

import sys
from pathlib import Path

import compaction_crash_child
from compaction_crash_child import _install_kill_switch

from equeue import MessageStore, StoreConfig


def main(argv: list[str]) -> int:
    path, mode, k = Path(argv[0]), argv[1], int(argv[2])
    if mode not in ("after", "never"):
        raise SystemExit(f"unknown mode {mode!r}")
    store = MessageStore.open(path, StoreConfig(flush="os"))
    compaction_crash_child.WRAPPED += ("fdatasync",)  # type: ignore[assignment]
    _install_kill_switch(mode, k)  # after the open: only the deletion's calls count
    store.delete_group("g")
    sys.stdout.write("DONE\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
