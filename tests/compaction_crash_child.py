"""The child process of tests/test_compaction_commit.py: install a staged compaction and
SIGKILL itself at a chosen filesystem call. The test forks it (``forked``); by hand:

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
import selectors
import signal
import sys
import threading
import time
import traceback
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


def forked(argv: list[str], timeout: float = 60.0) -> tuple[int, list[str]]:
    """``main(argv)`` in a forked child of this process, as the tests run it: its exit
    status (-9 for the SIGKILL) and its stdout lines. A fork, not a new interpreter: the
    child is as real a process, SIGKILLed as it would be, without the 0.3 s of CPU that
    starting Python and importing equeue cost, 54 times a test run."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller (a test runner's process)
        status = 1
        try:
            os.close(read_end)
            sys.stdout = os.fdopen(write_end, "w")
            status = main(argv)
        except BaseException:
            traceback.print_exc(file=sys.stdout)
        finally:
            sys.stdout.flush()
            os._exit(status)
    os.close(write_end)
    out = bytearray()
    deadline = time.monotonic() + timeout
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(read_end, selectors.EVENT_READ)
            while time.monotonic() < deadline:
                if selector.select(deadline - time.monotonic()):
                    data = os.read(read_end, 65536)
                    if not data:
                        break
                    out += data
            else:
                os.kill(pid, signal.SIGKILL)
    finally:
        os.close(read_end)
        _, status = os.waitpid(pid, 0)
    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    return code, out.decode().splitlines()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
