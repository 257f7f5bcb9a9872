"""The group commit's cohorts in the 4-process shared durable shape (issue 23, round 20).

For each ``--src`` tree and each ``--wait-per`` value in turn, alternated ``--rounds``
times: an ``equeue serve --flush sync`` of that tree on a Unix socket (store under /tmp),
and ``--procs`` producer processes, each one ``equeue.aio`` client shared by ``--tasks``
asyncio tasks, each task one 100 B ``send`` at a time (tools/bench_broker.py's "one client
per process, shared by its tasks" row; ``--conns``: a connection per task, the bench's
other reading), ``--count`` sends a task after 40 untimed.

Per run: the rate; the broker's sends per fdatasync; its group-commit waits and the ones
whose expected sends all came before the bound; the CPU a send of the broker
(``/proc/PID/stat``) and of the clients (their ``time.process_time()``); and, from the
broker's own record of every flush it started (``--record``, off by default: it wraps two
methods of the commit in Python, so costs a call a flush), how many requests each flush
covered and why it started: at a flush's end (``end``), by a send's arrival (``add``:
the expected sends all in, or none expected), or when the bound passed (``bound``).

``--arm "per=X wait=US"`` (repeatable; each is run against each tree): the broker's
``CrossClientCommit`` made with ``wait_per_fdatasync=X`` (set in the broker process before
it starts; absent: the tree's default) and ``--group-commit-wait-us US`` (absent: the
default); ``flush=async`` in an arm: the broker runs ``--flush async`` (the row's
ceiling). ``--env NAME=VALUE``: a variable in the broker's environment (a tree's switch).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

# The broker, started with the commit's bound per fdatasync set and, if asked, each flush
# recorded: (requests covered, the connections they came from, why it started).
BROKER = r"""
import atexit, json, os, sys, time
from equeue.server import groupcommit as g
per = os.environ.get("EQ_COHORT_WAIT_PER", "-")
if per != "-":
    defaults = list(g.CrossClientCommit.__init__.__defaults__)
    defaults[2] = float(per)  # release, wait_us, wait_per_fdatasync, ...
    g.CrossClientCommit.__init__.__defaults__ = tuple(defaults)
out = os.environ.get("EQ_COHORT_RECORD")
if out:
    flushes = []
    why = ["add"]
    ended = [time.monotonic()]
    commit = g.CrossClientCommit
    start, passed, released = commit._start, commit._bound_passed, commit._released
    def _start(self):
        waiting = self._waiting
        since = time.monotonic() - ended[0]
        peers = len({id(e[0]) for e in waiting})
        flushes.append((len(waiting), peers, why[0], since * 1e6, self._took * 1e6))
        start(self)
    def _bound_passed(self):
        why[0] = "bound"
        try:
            passed(self)
        finally:
            why[0] = "add"
    def _released(self, error, took):
        why[0] = "end"
        ended[0] = time.monotonic()
        try:
            released(self, error, took)
        finally:
            why[0] = "add"
    g.CrossClientCommit._start = _start
    g.CrossClientCommit._bound_passed = _bound_passed
    g.CrossClientCommit._released = _released
    def dump():
        with open(out, "w") as f:
            json.dump(flushes, f)
    atexit.register(dump)
from equeue.cli import main
sys.argv[0] = "equeue"
sys.exit(main())
"""

# One producer process: --tasks tasks sharing one client; warm-up, "ready", wait for a
# line on stdin, the timed part, its figures as JSON.
PRODUCER = r"""
import asyncio, json, sys, time
import equeue.aio
url, topic, tasks, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
shared = sys.argv[5] == "shared"
body = b"x" * 100
async def task(send, n):
    for _ in range(n):
        await send(topic, body)
async def main():
    if shared:
        clients = [await equeue.aio.connect(url)] * tasks
    else:
        clients = [await equeue.aio.connect(url) for _ in range(tasks)]
    await asyncio.gather(*(task(c.send, 40) for c in clients))
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    c0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(task(c.send, count) for c in clients))
    t1, c1 = time.perf_counter(), time.process_time()
    for c in set(clients):
        await c.close()
    print(json.dumps({"t0": t0, "t1": t1, "cpu": c1 - c0, "sends": tasks * count}), flush=True)
asyncio.run(main())
"""


def broker_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stats(src: Path, url: str) -> dict[str, Any]:
    code = "import json, sys, equeue; print(json.dumps(equeue.connect(sys.argv[1]).stats()))"
    env = dict(os.environ, PYTHONPATH=str(src))
    out = subprocess.run(
        [sys.executable, "-c", code, url], env=env, cwd="/tmp", capture_output=True, check=True
    )
    answer: dict[str, Any] = json.loads(out.stdout)
    return answer


def run(src: Path, arm: str, args: argparse.Namespace) -> dict[str, Any]:
    knobs = dict(item.split("=", 1) for item in arm.split())
    per = knobs.get("per", "-")
    wait = ["--group-commit-wait-us", knobs["wait"]] if "wait" in knobs else []
    directory = Path(tempfile.mkdtemp(prefix="eqcohort", dir="/tmp"))
    record = directory / "flushes.json"
    env = dict(os.environ, PYTHONPATH=str(src), EQ_COHORT_WAIT_PER=per)
    if args.record:
        env["EQ_COHORT_RECORD"] = str(record)
    for item in args.env:
        name, _, value = item.partition("=")
        env[name] = value
    flush = knobs.get("flush", "sync")  # async: the row's ceiling, no fdatasync waited for
    argv = [sys.executable, "-c", BROKER, "serve", str(directory / "s"), "--flush", flush, *wait]
    broker = subprocess.Popen(
        [*argv, "--quiet"], cwd=directory, env=env, stdout=subprocess.PIPE
    )  # fmt: skip
    producers: list[subprocess.Popen[str]] = []
    try:
        assert broker.stdout is not None
        line = broker.stdout.readline().decode()
        if not line.startswith("listening on "):
            raise SystemExit(f"the broker of {src} did not start: {line!r}")
        url = line.split()[-1]
        env_p = dict(os.environ, PYTHONPATH=str(src))
        for _ in range(args.procs):
            argv = [sys.executable, "-c", PRODUCER, url, "t", str(args.tasks), str(args.count)]
            argv.append("conns" if args.conns else "shared")
            producers.append(
                subprocess.Popen(
                    argv,
                    cwd="/tmp",
                    env=env_p,
                    text=True,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                )
            )
        for p in producers:
            assert p.stdout is not None
            if p.stdout.readline().strip() != "ready":
                raise SystemExit("a producer did not get ready")
        before = stats(src, url)
        cpu0 = broker_cpu(broker.pid)
        for p in producers:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        results = []
        for p in producers:
            assert p.stdout is not None
            results.append(json.loads(p.stdout.readline()))
            p.wait(60)
        cpu1 = broker_cpu(broker.pid)
        after = stats(src, url)
    finally:
        for p in producers:
            if p.poll() is None:
                p.kill()
                p.wait(60)
        broker.send_signal(signal.SIGTERM)
        broker.wait(60)
    sends = sum(r["sends"] for r in results)
    wall = max(r["t1"] for r in results) - min(r["t0"] for r in results)
    flushes = after["flushes"] - before["flushes"]
    out: dict[str, Any] = {
        "rate": sends / wall,
        "sends_per_flush": sends / flushes if flushes else 0.0,
        "flushes": flushes,
        "waits": after["group_commit_waits"] - before["group_commit_waits"],
        "waits_full": after["group_commit_waits_full"] - before["group_commit_waits_full"],
        "broker_us": (cpu1 - cpu0) / sends * 1e6,
        "clients_us": sum(r["cpu"] for r in results) / sends * 1e6,
    }
    if args.record and record.exists() and flushes:
        # the timed part only: the last ``flushes`` recorded before the drain
        rows = json.loads(record.read_text())
        rows = [r for r in rows][-(flushes + 2) :]
        out["covered"] = dict(sorted(Counter(r[1] for r in rows).items()))
        out["why"] = dict(sorted(Counter(r[2] for r in rows).items()))
        # µs from the last flush's end to this one's start, by why it started (median)
        for why in ("add", "bound"):
            since = sorted(r[3] for r in rows if r[2] == why)
            if since:
                out[f"since_end_{why}_us"] = since[len(since) // 2]
        took = sorted(r[4] for r in rows)
        out["fdatasync_us"] = took[len(took) // 2]
    shutil.rmtree(directory, ignore_errors=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--src", action="append", type=Path, help="a tree holding equeue/")
    parser.add_argument("--arm", action="append", default=None, help='e.g. "per=4 wait=500"')
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--tasks", type=int, default=16)
    parser.add_argument("--count", type=int, default=1500, help="sends a task, timed")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--record", action="store_true")
    parser.add_argument("--conns", action="store_true", help="a connection per task")
    parser.add_argument("--env", action="append", default=[])
    args = parser.parse_args()
    if not 1 <= args.procs <= 16 or not 1 <= args.tasks <= 256 or not 1 <= args.count <= 100_000:
        parser.error("--procs 1-16, --tasks 1-256, --count 1-100000")
    srcs = args.src or [Path(__file__).resolve().parent.parent]
    arms = [(s, a) for s in srcs for a in args.arm or [""]]
    for r in range(args.rounds):
        for src, arm in arms if r % 2 == 0 else arms[::-1]:
            load = os.getloadavg()[0]
            stamp = time.strftime("%H:%M:%S", time.gmtime())
            figures = run(src, arm, args)
            shown = {k: round(v, 2) if isinstance(v, float) else v for k, v in figures.items()}
            print(f"{stamp} load {load:.2f} {src} [{arm}]: {json.dumps(shown)}", flush=True)


if __name__ == "__main__":
    main()
