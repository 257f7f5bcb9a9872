"""The child process of tests/test_compaction_commit.py: install a staged compaction and
SIGKILL itself at a chosen filesystem call.

    python tests/compaction_crash_child.py STORE STAGING JOB_JSON MODE K

JOB_JSON holds ``{"results": [RewriteResult as a dict, ...], "read": [chunk file names]}``,
the arguments the job passed to ``commit.install``. Every call that changes or syncs
the file system (``os.rename``, ``os.replace``, ``os.unlink``, ``os.rmdir``,
``os.fsync``; ``Path.unlink``, ``shutil.rmtree``, ``fsync_directory`` and
``write_json`` all go through these) is numbered from 1 and, before it runs, printed
on stdout as ``CALL <n> <name> <path>``. MODE ``before`` kills the process just before
call K runs, ``after`` just after it returned, ``never`` does not kill; a run that got
through ``install`` prints ``DONE``. The calls of a store's chunk-maker thread are not
numbered.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from equeue.compaction import commit
from equeue.compaction.rewrite import RewriteResult

WRAPPED = ("rename", "replace", "unlink", "rmdir", "fsync")


def _describe(name: str, args: tuple[Any, ...]) -> str:
    if name == "fsync":
        try:
            return os.readlink(f"/proc/self/fd/{args[0]}")
        except OSError:
            return f"fd {args[0]}"
    return " -> ".join(str(a) for a in args)


def _install_kill_switch(mode: str, kill_at: int) -> None:
    calls = 0

    def wrap(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            if threading.current_thread().name == "equeue-chunk-maker":
                # A store's next log chunk made ahead (equeue/chunks/ahead.py): not data,
                # and when its calls come is the scheduler's, so numbering them would make
                # a run's calls differ from the control's (its steps: test_chunk_ahead.py)
                return real(*args, **kwargs)
            calls += 1
            sys.stdout.write(f"CALL {calls} {name} {_describe(name, args)}\n")
            sys.stdout.flush()
            if mode == "before" and calls == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            result = real(*args, **kwargs)
            if mode == "after" and calls == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return result

        return call

    for name in WRAPPED:
        setattr(os, name, wrap(name, getattr(os, name)))


def main(argv: list[str]) -> int:
    store, staging, job_file, mode, kill_at = argv
    if mode not in ("before", "after", "never"):
        raise SystemExit(f"unknown mode {mode!r}")
    job = json.loads(Path(job_file).read_text())
    results = [RewriteResult(**r) for r in job["results"]]
    read = [str(name) for name in job["read"]]
    _install_kill_switch(mode, int(kill_at))
    commit.install(Path(store), Path(staging), results, read)
    sys.stdout.write("DONE\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
