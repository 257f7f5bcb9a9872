"""Worker processes, started once per run and reused by every case: a case hands each of
its workers a job, waits until all are set up (connected, store opened), then starts them
together, so process start-up and connection set-up are never timed.

A job is a dict (``kind`` names its runner in ``brokerbench.jobs``); its result is a dict
with ``count`` (messages done), ``t0`` and ``t1`` (``time.perf_counter()``, one clock for
every process on Linux: CLOCK_MONOTONIC) and whatever else the runner reports.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

SETUP_SECONDS = 60.0
GRACE_SECONDS = 60.0  # past a case's time cap, for the last requests in flight and closing


FAILED = object()  # what _collect holds for a worker that answered an error


class JobError(Exception):
    """A worker's job failed or a worker did not answer in time."""


def _worker(conn: Connection) -> None:
    from brokerbench.jobs import make_runner  # imported in the child: the runners' imports

    while True:
        job = conn.recv()
        if job is None:
            return
        runner = None
        closing: str | None = None
        try:
            runner = make_runner(job)
            conn.send(("ready", None))
            if conn.recv() == "go":
                cpu = time.process_time()
                done = runner.run()
                done["cpu"] = time.process_time() - cpu  # this producer's own CPU seconds
                conn.send(("done", done))
        except Exception as error:  # the parent reports it with the case
            conn.send(("error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))
        finally:
            if runner is not None:
                try:
                    runner.close()
                except Exception as error:
                    closing = f"closing: {type(error).__name__}: {error}"
            conn.send(("closed", closing))


class Pool:
    def __init__(self, size: int) -> None:
        # Forked (a spawned worker imports everything again: ~0.3 s of CPU each): the
        # pool is made before the parent starts a thread or opens a connection.
        context = multiprocessing.get_context("fork")
        self.size = size
        self.broken = False
        self.conns: list[Connection] = []
        self.procs: list[BaseProcess] = []
        for _ in range(size):
            parent, child = context.Pipe()
            proc = context.Process(target=_worker, args=(child,), daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def run(
        self,
        jobs: list[dict[str, Any]],
        cap: float,
        between: Callable[[], None] | None = None,
    ) -> list[dict[str, Any]]:
        """Run one job per worker, started together; their results in the jobs' order.
        ``between`` runs once every worker is set up, before they start (untimed)."""
        if len(jobs) > len(self.conns):
            raise JobError(f"{len(jobs)} jobs for a pool of {len(self.conns)} workers")
        conns = self.conns[: len(jobs)]
        for conn, job in zip(conns, jobs, strict=True):
            conn.send(job)
        errors: list[str] = []
        ready = self._collect(conns, "ready", SETUP_SECONDS, errors)
        started = [c for c, r in zip(conns, ready, strict=True) if r is not FAILED]
        if between is not None and not errors:
            try:
                between()
            except Exception as error:
                errors.append(f"before the start: {type(error).__name__}: {error}")
        for conn in started:
            conn.send("stop" if errors else "go")
        results: list[Any] = []
        if not errors:
            results = self._collect(conns, "done", cap + GRACE_SECONDS, errors)
        # Every worker that got a job says when it has closed it, with close()'s error.
        for closing in self._collect(conns, "closed", GRACE_SECONDS, errors):
            if closing is not None and closing is not FAILED:
                errors.append(closing)
        if errors:
            raise JobError("; ".join(errors))
        return results

    def _collect(
        self, conns: list[Connection], want: str, seconds: float, errors: list[str]
    ) -> list[Any]:
        found: dict[int, Any] = {}
        deadline = time.monotonic() + seconds
        waiting = list(range(len(conns)))
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                self.broken = True  # a worker still busy: the caller starts a new pool
                raise JobError(f"workers {waiting} did not answer {want!r} within {seconds:.0f} s")
            for conn in multiprocessing.connection.wait([conns[i] for i in waiting], left):
                assert isinstance(conn, Connection)
                index = conns.index(conn)
                try:
                    tag, value = conn.recv()
                except EOFError:
                    self.broken = True
                    raise JobError(f"worker {index} exited") from None
                if tag == want:
                    found[index] = value
                elif tag == "error":
                    errors.append(f"worker {index}: {value}")
                    found[index] = FAILED
                    if want == "closed":
                        continue  # its "closed" follows
                else:
                    raise JobError(f"worker {index} answered {tag!r}, expected {want!r}")
                waiting.remove(index)
        return [found[i] for i in range(len(conns))]

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
