"""The shared-memory rings' prototype against the socket, durable sends (perfshm, round 15).

For each variant in turn, alternated ``--rounds`` times (A/B, B/A, ...): ``equeue serve
--flush sync`` of the variant's tree on a Unix socket, and ``--shape`` client processes x
tasks, each task with its own ``equeue.aio.connect`` and one 100 B ``send`` in flight,
``--count`` sends each after an untimed warm-up. Variants: ``base`` (``--base`` tree, the
socket), ``sock`` (this tree, the socket), ``shm`` (this tree, ``--shm`` and
``connect(url, shm=True)``). Per send: the broker's CPU by thread (/proc/PID/task, as
tools/bench_broker_kern.py), the clients' (each process's ``time.process_time``), the
rate, sends per fdatasync, and an append + fdatasync loop in the same directory right
after (the rate's yardstick).

``--callgrind``: instead, each variant's broker and one client process (the shape's
tasks in one process) under ``valgrind --tool=callgrind``, collecting only while the
measured sends run (callgrind_control): instructions a send, per side. (The difference
of two runs, Ir(2N) - Ir(N), was tried first: on a loaded host it came out negative in
one run; what a slowed process does per unit of time swamps it.)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_broker_cpu import _broker
from bench_broker_kern import _threads
from brokerbench.jobs import FdatasyncLoop

HERE = Path(__file__).resolve().parent.parent

CLIENT = r"""
import asyncio, json, os, sys, time
import equeue.aio
import equeue.client.aio, equeue.client.coalesce

if os.environ.get("BENCH_HEARD_RECENTLY"):  # (--callgrind: see callgrind())
    recent = float(os.environ["BENCH_HEARD_RECENTLY"])
    equeue.client.aio.HEARD_RECENTLY = equeue.client.coalesce.HEARD_RECENTLY = recent

url, tasks, count, warm = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
shm = sys.argv[5] == "1"
body = b"x" * 100

async def main():
    options = {"shm": True} if shm else {}
    clients = [await equeue.aio.connect(url, **options) for _ in range(tasks)]
    async def lane(client, n):
        for _ in range(n):
            await client.send("t", body)
    await asyncio.gather(*(lane(c, warm) for c in clients))
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(lane(c, count) for c in clients))
    used = {"cpu": time.process_time() - cpu, "wall": time.perf_counter() - wall}
    print(json.dumps(used), flush=True)
    for c in clients:
        await c.close()

asyncio.run(main())
"""


def start_broker(
    src: Path, directory: Path, shm: bool, prefix: list[str] | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    return _broker(src, directory, prefix or [], "sync", ("--shm",) if shm else ())


def flushes(url: str) -> int:
    import equeue

    with equeue.connect(url) as client:
        return int(client.stats()["flushes"])


def fdatasync_loop(directory: Path, seconds: float = 2.0) -> float:
    """tools/bench_broker.py's yardstick (100 B appends, each with an fdatasync) for
    ``seconds``: per second."""
    job = {"dir": str(directory), "body": 100, "count": 1 << 30, "cap": seconds}
    loop = FdatasyncLoop(job)
    try:
        done = loop.run()
    finally:
        loop.close()
    return float(done["count"] / (done["t1"] - done["t0"]))


def clients(
    src: Path,
    url: str,
    shape: tuple[int, int],
    count: int,
    shm: bool,
    prefix: list[str],
    env: dict[str, str] | None = None,
) -> list[subprocess.Popen[str]]:
    processes, tasks = shape
    started = []
    for _ in range(processes):
        argv = [sys.executable, "-c", CLIENT, url, str(tasks), str(count), "40", str(int(shm))]
        environ = dict(os.environ, PYTHONPATH=str(src), **(env or {}))
        pipes: dict[str, Any] = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE}
        started.append(subprocess.Popen([*prefix, *argv], cwd="/", env=environ, text=True, **pipes))
    for process in started:
        assert process.stdout is not None
        if process.stdout.readline().strip() != "ready":
            raise SystemExit(f"a client of {src} did not start")
    return started


def count_syscalls(pids: list[int], directory: Path) -> list[subprocess.Popen[bytes]]:
    """perf stat counting every system call of each pid (a tracepoint count: cheap)."""
    counters = [
        subprocess.Popen(
            [
                "perf",
                "stat",
                "-x",
                ",",
                "-e",
                "raw_syscalls:sys_enter",
                "-p",
                str(pid),
                "-o",
                str(directory / f"sys.{index}"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for index, pid in enumerate(pids)
    ]
    time.sleep(1.0)  # attached before the measured sends
    return counters


def counted(counters: list[subprocess.Popen[bytes]], directory: Path) -> list[int]:
    for counter in counters:
        counter.send_signal(signal.SIGINT)
        counter.wait(60)
    found = []
    for index in range(len(counters)):
        lines = (directory / f"sys.{index}").read_text().splitlines()
        found.append(sum(int(line.split(",")[0]) for line in lines if "raw_syscalls" in line))
    return found


def run(
    variant: str, src: Path, shape: tuple[int, int], count: int, syscalls: bool = False
) -> dict[str, Any]:
    shm = variant == "shm"
    directory = Path(tempfile.mkdtemp(prefix="perfshm-b", dir="/tmp"))
    broker, url = start_broker(src, directory, shm)
    try:
        processes = clients(src, url, shape, count, shm, [])
        pids = [broker.pid, *(p.pid for p in processes)]
        counters = count_syscalls(pids, directory) if syscalls else []
        before_flushes = flushes(url)
        before = _threads(broker.pid)
        for process in processes:
            assert process.stdin is not None
            process.stdin.write("go\n")
            process.stdin.flush()
        reports = []
        for process in processes:
            assert process.stdout is not None
            reports.append(json.loads(process.stdout.readline()))
        after = _threads(broker.pid)
        flushed = flushes(url) - before_flushes
        calls = counted(counters, directory) if syscalls else [0, 0]
        for process in processes:
            process.wait(60)
    finally:
        broker.terminate()
        broker.wait(60)
    loop_rate = fdatasync_loop(directory)
    shutil.rmtree(directory, ignore_errors=True)
    sends = shape[0] * shape[1] * count
    wall = max(r["wall"] for r in reports)
    per_thread = {
        name: {k: (v - before.get(name, {}).get(k, 0.0)) * 1e6 / sends for k, v in f.items()}
        for name, f in after.items()
    }
    return {
        "variant": variant,
        "rate": sends / wall,
        "loop": loop_rate,
        "per_fdatasync": sends / max(flushed, 1),
        "broker": sum(t.get("run", 0.0) for t in per_thread.values()),
        "loop_user": per_thread.get("loop", {}).get("user", 0.0),
        "loop_system": per_thread.get("loop", {}).get("system", 0.0),
        "loop_run": per_thread.get("loop", {}).get("run", 0.0),
        "clients": sum(r["cpu"] for r in reports) * 1e6 / sends,
        "load": os.getloadavg()[0],
        "broker_calls": calls[0] / sends,
        "client_calls": sum(calls[1:]) / sends,
    }


def callgrind_total(path_glob: list[Path]) -> int:
    total = 0
    for path in path_glob:
        hit = re.search(r"^totals:\s*(\d+)", path.read_text(), re.MULTILINE)
        if hit:
            total += int(hit.group(1))
    return total


def callgrind_calls(path_glob: list[Path], function: str) -> int:
    """Calls made to ``function`` (its ``cfn=`` lines' ``calls=`` counts)."""
    total = 0
    for path in path_glob:
        names: dict[str, str] = {}
        target = ""
        for line in path.read_text(errors="replace").splitlines():
            named = re.match(r"c?fn=\((\d+)\)(?: (.*))?", line)
            if named:
                if named.group(2):
                    names[named.group(1)] = named.group(2)
                target = names.get(named.group(1), "") if line.startswith("cfn=") else ""
            elif line.startswith("calls=") and target.split("'")[0] == function:
                total += int(line[6:].split()[0])
    return total


# Under callgrind each process runs some 50 times slower, and the client's C send path
# (ClientConn.direct) is only taken on a connection heard from within HEARD_RECENTLY
# (20 ms of wall time, coalesce.py): the rest go the general way (Python's msgpack,
# AsyncClient._call's liveness check, up to 4 loop turns), which a native run never
# takes. Round 15's 45-51 k client instructions a send were that: 5-22 % of the sends
# fell back, by how slow the run was, and the count followed that share (docs/
# benchmarks.md "perfshm2"). Raised here so that callgrind counts the native path.
CALLGRIND_HEARD_RECENTLY = "3600"


def callgrind(
    variant: str, src: Path, shape: tuple[int, int], count: int
) -> tuple[int, int, float]:
    """(broker, client) instructions of the measured sends alone, and the share of the
    client's sends written by the C path: both processes under callgrind with collection
    off, switched on (callgrind_control -i) after the warm-up and off after the last
    answer, so neither start, connects nor end is counted."""
    shm = variant == "shm"
    directory = Path(tempfile.mkdtemp(prefix="perfshm-c", dir="/tmp"))
    grind = [
        "valgrind", "--tool=callgrind", "--separate-threads=yes", "--instr-atstart=no",
        f"--log-file={directory}/vg.%p",
    ]  # fmt: skip
    broker_out = f"--callgrind-out-file={directory}/broker.out"
    broker, url = start_broker(src, directory, shm, [*grind, broker_out])
    try:
        (process,) = clients(
            src, url, (1, shape[0] * shape[1]), count, shm,
            [*grind, f"--callgrind-out-file={directory}/client.out"],
            {"BENCH_HEARD_RECENTLY": CALLGRIND_HEARD_RECENTLY},
        )  # fmt: skip
        assert process.stdin is not None and process.stdout is not None
        pids = [str(broker.pid), str(process.pid)]
        for pid in pids:
            subprocess.run(["callgrind_control", "-i", "on", pid], check=True, capture_output=True)
        process.stdin.write("go\n")
        process.stdin.flush()
        process.stdout.readline()
        for pid in pids:
            subprocess.run(["callgrind_control", "-i", "off", pid], check=True, capture_output=True)
        process.stdin.close()
        process.wait(600)
    finally:
        broker.terminate()
        broker.wait(600)
    sends = shape[0] * shape[1] * count
    client_files = sorted(directory.glob("client.out*"))
    result = (
        callgrind_total(sorted(directory.glob("broker.out*"))),
        callgrind_total(client_files),
        callgrind_calls(client_files, "clientsend_frame") / sends,
    )
    shutil.rmtree(directory, ignore_errors=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, required=True, help="the baseline tree")
    parser.add_argument("--variants", default="base,shm", help="of base, sock, shm")
    parser.add_argument("--shape", default="1x64", help="processes x tasks")
    parser.add_argument("--count", type=int, default=1000, help="sends a task")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--callgrind", action="store_true")
    parser.add_argument("--syscalls", action="store_true", help="system calls a send (perf)")
    options = parser.parse_args()
    processes, tasks = (int(v) for v in options.shape.split("x"))
    shape = (processes, tasks)
    variants = options.variants.split(",")
    for round_ in range(options.rounds):
        for variant in variants if round_ % 2 == 0 else variants[::-1]:
            src = options.base if variant == "base" else HERE
            if options.callgrind:
                broker_ir, client_ir, direct = callgrind(variant, src, shape, options.count)
                sends = processes * tasks * options.count
                print(
                    f"{variant} {options.shape} callgrind: broker {broker_ir / sends:,.0f}, "
                    f"client {client_ir / sends:,.0f} instructions a send; C send path "
                    f"{direct:.2f} a send",
                    flush=True,
                )
                continue
            r = run(variant, src, shape, options.count, options.syscalls)
            print(
                f"{variant} {options.shape}: {r['rate']:,.0f} sends/s, loop {r['loop']:,.0f}/s "
                f"({r['rate'] / r['loop']:.1f}x), {r['per_fdatasync']:.1f} sends/fdatasync; "
                f"us a send: broker {r['broker']:.2f} (loop user {r['loop_user']:.2f} system "
                f"{r['loop_system']:.2f} run {r['loop_run']:.2f}), clients {r['clients']:.2f}, "
                f"sum {r['broker'] + r['clients']:.2f}; load {r['load']:.1f}"
                + (
                    f"; system calls a send: broker {r['broker_calls']:.2f}, clients "
                    f"{r['client_calls']:.2f}"
                    if options.syscalls
                    else ""
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
