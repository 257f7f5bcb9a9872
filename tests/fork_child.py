"""Child processes forked from one that imported them once (not a test module).

The SIGKILL-after-each-call tests start a child per file-system call of the operation
they cut, dozens a test; each child's own work (open a store, run the operation) takes
~0.2 s, and a new interpreter importing equeue first costs as much again on a quiet host
and 2 s at a load of 15 (round 21: test_group_delete's 27 children spent 62 of its 78 s
there). A ``ForkServer`` starts ``python fork_child.py`` once; the server imports the
child modules, and for each run forks: the fork calls ``MODULE.main(argv)`` with its own
stdin, stdout and stderr, then exits the way the child's own interpreter would have
(``SystemExit`` up through the fork's stack: atexit handlers, non-daemon threads joined,
finalizers), so a store it left open is closed as before, with the same calls. The
server answers with the exit status as ``subprocess`` gives it: -9 for a SIGKILL.

    python fork_child.py        requests on stdin, one JSON line each:
                                {"module": M, "argv": [...], "timeout": seconds};
                                answers on stdout: {"returncode", "stdout", "stderr"},
                                or {"timeout": true} (the fork SIGKILLed).
"""

from __future__ import annotations

import importlib
import json
import os
import random
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO, Any

HERE = Path(__file__).resolve().parent


class ForkServer:
    """The test side: one server process, a run at a time."""

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path])}
        self._process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )

    def run(
        self, module: str, argv: list[str], timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        assert self._process.stdin is not None and self._process.stdout is not None
        request = {"module": module, "argv": argv, "timeout": timeout}
        self._process.stdin.write(json.dumps(request) + "\n")
        self._process.stdin.flush()
        line = self._process.stdout.readline()
        if not line:
            raise RuntimeError(f"fork server exited ({self._process.wait()})")
        answer = json.loads(line)
        args = [module, *argv]
        if answer.get("timeout"):
            raise subprocess.TimeoutExpired(args, timeout)
        return subprocess.CompletedProcess(
            args, answer["returncode"], answer["stdout"], answer["stderr"]
        )

    def close(self) -> None:
        if self._process.stdin is not None:
            self._process.stdin.close()
        self._process.wait(30)
        if self._process.stdout is not None:
            self._process.stdout.close()


def _wait(pid: int, timeout: float) -> int | None:
    """The fork's status as subprocess reports it; None if it ran past ``timeout``."""
    pidfd = os.pidfd_open(pid)
    try:
        ready, _, _ = select.select([pidfd], [], [], timeout)
    finally:
        os.close(pidfd)
    if not ready:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return None
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _child(module: Any, argv: list[str], out: IO[bytes], err: IO[bytes]) -> int:
    """In the fork: the child's main with fds 0-2 its own. Returns its exit code."""
    stdin = os.open(os.devnull, os.O_RDONLY)
    os.dup2(stdin, 0)
    os.close(stdin)
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 (the process's own, never closed)
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
    sys.argv = [str(module.__file__), *argv]
    random.seed()  # a new interpreter's own seed, not the server's state
    code = module.main(argv)
    return code if isinstance(code, int) else 0


def serve() -> int:
    for line in sys.stdin:
        request = json.loads(line)
        name = request["module"]
        module = importlib.import_module(name)  # the first run's import serves the rest
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                # The fork leaves by SystemExit from here, through the server's frames (whose
                # exits only close its copies of files), and Python's usual shutdown.
                raise SystemExit(_child(module, request["argv"], out, err))
            code = _wait(pid, request["timeout"])
            out.seek(0)
            err.seek(0)
            answer: dict[str, Any] = (
                {"timeout": True}
                if code is None
                else {
                    "returncode": code,
                    "stdout": out.read().decode(errors="replace"),
                    "stderr": err.read().decode(errors="replace"),
                }
            )
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(serve())
