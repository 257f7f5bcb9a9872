"""Where a real broker's CPU per durable send goes, by thread and by kernel cause (issue 23).

For each ``--src`` tree in turn, alternated ``--rounds`` times (A/B, B/A, ...): an ``equeue
serve --flush sync`` of that tree on a Unix socket (tools/bench_broker_cpu.py's broker) and
``DURABLE_PEERS`` asyncio tasks in this process, each on its own connection with one 100 B
``send`` in flight, ``--count`` sends each after an untimed warm-up. Per send, for each of
the broker's threads (by name: the loop's, ``equeue-flush``, ``equeue-prefault``): user and
system CPU (``/proc/PID/task/TID/stat``, clock ticks), run time (``sched``'s
sum_exec_runtime, ns), voluntary and involuntary context switches, and migrations; and
minor page faults per fdatasync (field 10, minflt: under ``--flush sync`` the loop's appends
fault on the log pages each fdatasync's writeback write-protected).

``--shared``: the other reading, one client shared by the ``DURABLE_PEERS`` tasks (their
sends of a loop turn go as one ``send_bodies`` request); ``--flush async``: the same
producers against a ``--flush async`` broker (no fdatasync waited for).

``--syscalls``: ``perf trace -s`` attached to the broker for the measured part, the system
calls per send by thread (perf trace's own cost slows the broker: the counts per send are
the thing, not the rate). ``--env NAME=VALUE`` sets a variable in the broker's environment
(a tree's switch, for an A/B within one tree).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_broker_cpu import BODY, DURABLE_PEERS, _broker

Threads = dict[str, dict[str, float]]  # thread name -> figure -> value
# perf stat --stat's events: TLB flushes (tlb:tlb_flush, all reasons: a local one, or one
# this CPU does for another's shootdown), context switches, migrations, page faults, and
# the system calls a flush makes besides fdatasync (counted by tracepoint: cheap, unlike
# perf trace, which slows every call and so changes who waits for whose lock)
PERF_EVENTS = ",".join(
    [
        "tlb:tlb_flush",
        "context-switches",
        "cpu-migrations",
        "page-faults",
        *(
            f"syscalls:sys_enter_{name}"
            for name in (
                "futex",
                "read",
                "write",
                "timerfd_settime",
                "madvise",
                "epoll_wait",
                "epoll_pwait",
                "fdatasync",
            )
        ),
    ]
)
# --record's events (EQ_RECORD_EVENTS: perf record's -e list; default: its cpu clock)
RECORD_EVENTS = ["-e", os.environ["EQ_RECORD_EVENTS"]] if os.environ.get("EQ_RECORD_EVENTS") else []
# Kernel threads whose work a durable send causes but no broker thread is charged for: the
# ext4 unwritten-extent conversion and writeback (kworker), soft interrupts.
KERNEL_THREADS = ("kworker", "ksoftirqd", "jbd2")


def kernel_threads() -> float:
    """The run time (s) of every kernel worker thread on the machine (anyone's work)."""
    total = 0.0
    for task in Path("/proc").glob("[0-9]*/task/[0-9]*"):
        try:
            if not (task / "comm").read_text().startswith(KERNEL_THREADS):
                continue
            sched = (task / "sched").read_text()
            hit = re.search(r"^se.sum_exec_runtime\s*:\s*([\d.]+)", sched, re.MULTILINE)
        except OSError:
            continue
        if hit:
            total += float(hit.group(1)) / 1e3
    return total


def _interrupts() -> list[float]:
    """Rescheduling, function-call and TLB-shootdown IPIs since boot, all CPUs (anyone's)."""
    counts = dict.fromkeys(("RES:", "CAL:", "TLB:"), 0.0)
    for line in Path("/proc/interrupts").read_text().splitlines():
        fields = line.split()
        if fields and fields[0] in counts:
            counts[fields[0]] = float(sum(int(v) for v in fields[1:] if v.isdigit()))
    return list(counts.values())


def sectors_written(directory: Path) -> int:
    """Sectors written to the device holding ``directory`` since boot (anyone's)."""
    device = os.stat(directory).st_dev
    block = Path(f"/sys/dev/block/{os.major(device)}:{os.minor(device)}").resolve()
    for stat in (block / "stat", block.parent / "stat"):
        try:
            return int(stat.read_text().split()[6])
        except (OSError, IndexError, ValueError):
            continue
    return 0


def _machine() -> float:
    """Busy CPU seconds of the whole machine (/proc/stat: all but idle and iowait)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def _threads(pid: int) -> Threads:
    """The broker's threads' counters, summed by name (the loop's thread is the process's)."""
    tick = os.sysconf("SC_CLK_TCK")
    found: Threads = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
            sched = (task / "sched").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        name = "loop" if task.name == str(pid) else stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        figures = found.setdefault(name, {})

        def add(key: str, value: float, figures: dict[str, float] = figures) -> None:
            figures[key] = figures.get(key, 0.0) + value

        add("user", int(fields[11]) / tick)
        add("minflt", int(fields[7]))
        add("system", int(fields[12]) / tick)
        for key, label in (
            ("se.sum_exec_runtime", "run"),
            ("nr_voluntary_switches", "vcs"),
            ("nr_involuntary_switches", "ics"),
            ("se.nr_migrations", "migr"),
        ):
            hit = re.search(rf"^{re.escape(key)}\s*:\s*([\d.]+)", sched, re.MULTILINE)
            if hit:
                add(label, float(hit.group(1)) / (1e3 if label == "run" else 1))  # ms -> s
    return found


async def _drive(url: str, sends: int, measured: Any) -> tuple[float, int]:
    """Warm-up, then ``measured`` (a context manager) around ``sends`` sends a peer: the
    measured part's wall seconds and the broker's fdatasyncs in it."""
    import equeue.aio

    clients = await asyncio.gather(*(equeue.aio.connect(url) for _ in range(DURABLE_PEERS)))

    async def lane(client: Any, count: int) -> None:
        for _ in range(count):
            await client.send("t", BODY)

    try:
        await asyncio.gather(*(lane(c, 40) for c in clients))
        flushes = int((await clients[0].stats())["flushes"])
        with measured:
            started = time.perf_counter()
            await asyncio.gather(*(lane(c, sends) for c in clients))
            wall = time.perf_counter() - started
        return wall, int((await clients[0].stats())["flushes"]) - flushes
    finally:
        for client in clients:
            await client.close()


async def _drive_shared(url: str, sends: int, measured: Any) -> tuple[float, int]:
    """``_drive`` for ``--shared``: the DURABLE_PEERS tasks on one client."""
    import equeue.aio

    client = await equeue.aio.connect(url)

    async def lane(count: int) -> None:
        for _ in range(count):
            await client.send("t", BODY)

    try:
        await asyncio.gather(*(lane(40) for _ in range(DURABLE_PEERS)))
        flushes = int((await client.stats())["flushes"])
        with measured:
            started = time.perf_counter()
            await asyncio.gather(*(lane(sends) for _ in range(DURABLE_PEERS)))
            wall = time.perf_counter() - started
        return wall, int((await client.stats())["flushes"]) - flushes
    finally:
        await client.close()


class Measured:
    def __init__(
        self, pid: int, syscalls: Path | None, record: Path | None = None, stat: Path | None = None
    ) -> None:
        self.pid = pid
        self.home = Path(f"/proc/{pid}/cwd").resolve()
        self.stat = stat
        self.syscalls = syscalls
        self.record = record
        self.extra: list[float] = []
        self.before: Threads = {}
        self.after: Threads = {}
        self._trace: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Measured:
        if self.syscalls is not None:
            self._trace = subprocess.Popen(
                ["perf", "trace", "-s", "-p", str(self.pid), "-o", str(self.syscalls)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
        if self.record is not None:  # kernel call stacks too (root, or perf_event_paranoid -1)
            self._trace = subprocess.Popen(
                ["perf", "record", "-g", *RECORD_EVENTS, "-p", str(self.pid),
                 "-o", str(self.record)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
        if self.stat is not None:
            self._trace = subprocess.Popen(
                ["perf", "stat", "--per-thread", "-x", ",", "-o", str(self.stat),
                 "-e", PERF_EVENTS, "-p", str(self.pid)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
        if self._trace is not None:
            time.sleep(1.0)  # attached before the measured sends
        self.before = _threads(self.pid)
        self.extra = [
            kernel_threads(),
            _machine(),
            time.process_time(),
            *_interrupts(),
            sectors_written(self.home),
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        self.after = _threads(self.pid)
        now = [
            kernel_threads(),
            _machine(),
            time.process_time(),
            *_interrupts(),
            sectors_written(self.home),
        ]
        self.extra = [b - a for a, b in zip(self.extra, now, strict=True)]
        if self._trace is not None:
            self._trace.send_signal(signal.SIGINT)
            try:
                self._trace.wait(60)
            except subprocess.TimeoutExpired:
                self._trace.kill()
                self._trace.wait(10)


def _stat_table(path: Path, sends: int) -> str:
    """perf stat --per-thread's counts per 100 sends, by thread (threads that counted)."""
    rows: dict[str, dict[str, float]] = {}
    for line in path.read_text().splitlines():
        fields = line.split(",")
        if len(fields) < 4 or not fields[1].replace(".", "").isdigit():
            continue
        rows.setdefault(fields[0], {})[fields[3]] = float(fields[1])
    out = []
    for thread, counts in sorted(rows.items()):
        if any(counts.values()):
            shown = ", ".join(
                f"{k.replace('syscalls:sys_enter_', '')} {v * 100 / sends:.2f}"
                for k, v in counts.items()
                if v
            )
            out.append(f"  {thread:24s} per 100 sends: {shown}")
    return "\n".join(out)


def _syscall_table(path: Path, sends: int) -> str:
    """perf trace -s's summary as calls per send, by thread."""
    lines = []
    thread = ""
    for line in path.read_text().splitlines():
        head = re.match(r"\s*(\S.*?) \((\d+)\), (\d+) events", line)
        if head:
            thread = f"{head.group(1)}({head.group(2)})"
            continue
        row = re.match(r"\s+(\w+)\s+(\d+)\s+(\d+)\s+([\d.]+)", line)
        if row and thread and row.group(1) != "syscall":
            calls = int(row.group(2))
            lines.append(
                f"  {thread:24s} {row.group(1):18s} {calls / sends:7.3f} a send "
                f"({calls} calls, {float(row.group(4)) * 1e3 / sends:.2f} us a send in them)"
            )
    return "\n".join(lines)


def run(
    src: Path,
    sends: int,
    env: dict[str, str],
    syscalls: bool,
    record: Path | None = None,
    stat: bool = False,
    pin: bool = False,
    shared: bool = False,
    flush: str = "sync",
) -> str:
    directory = Path(tempfile.mkdtemp(prefix="eqkn", dir="/tmp"))
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        # --pin: the broker's threads on CPU 0, this process's clients on CPU 1
        broker, url = _broker(src, directory, ["taskset", "-c", "0"] if pin else [], flush)
        cpus = os.sched_getaffinity(0)
        if pin:
            os.sched_setaffinity(0, {1})
    finally:
        os.environ.clear()
        os.environ.update(saved)
    try:
        measured = Measured(
            broker.pid,
            directory / "trace.txt" if syscalls else None,
            record,
            directory / "stat.txt" if stat else None,
        )
        drive = _drive_shared if shared else _drive
        wall, flushes = asyncio.run(drive(url, sends, measured))
        reading = f" ({'shared, ' if shared else ''}--flush {flush})"
        stats = f"{src}{reading} {' '.join(f'{k}={v}' for k, v in env.items())}".strip()
    finally:
        broker.terminate()
        broker.wait(60)
        os.sched_setaffinity(0, cpus)
    total = DURABLE_PEERS * sends
    out = [
        f"{stats}: {total / wall:,.0f} sends/s, {total / max(flushes, 1):.1f} sends per "
        f"fdatasync, load {os.getloadavg()[0]:.1f}"
    ]
    sums = dict.fromkeys(("user", "system", "run", "vcs", "ics", "migr", "minflt"), 0.0)
    for name in sorted(measured.after):
        delta = {
            k: v - measured.before.get(name, {}).get(k, 0.0)
            for k, v in measured.after[name].items()
        }
        for key in sums:
            sums[key] += delta.get(key, 0.0)
        if delta.get("run", 0.0) * 1e6 / total < 0.05:
            continue
        out.append(_row(name, delta, total, flushes))
    out.append(_row("all", sums, total, flushes))
    workers, machine, clients = (v * 1e6 / total for v in measured.extra[:3])
    res, cal, tlb = (v * 100 / total for v in measured.extra[3:6])
    written = measured.extra[6] / 2 / max(flushes, 1)
    out.append(
        f"  kernel workers (anyone's) {workers:.2f} us/send; the clients' process "
        f"{clients:.2f}; the whole machine {machine:.2f}; IPIs per 100 sends (anyone's): "
        f"rescheduling {res:.1f}, function call {cal:.1f}, TLB shootdown {tlb:.1f}; "
        f"KiB written to the device per fdatasync (anyone's) {written:.1f}"
    )
    if syscalls:
        out.append(_syscall_table(directory / "trace.txt", total))
    if stat:
        out.append(_stat_table(directory / "stat.txt", total))
    shutil.rmtree(directory, ignore_errors=True)
    return "\n".join(out)


def _row(name: str, d: dict[str, float], total: int, flushes: int) -> str:
    per = 1e6 / total
    return (
        f"  {name:16s} user {d.get('user', 0) * per:5.2f} system {d.get('system', 0) * per:5.2f}"
        f" run {d.get('run', 0) * per:5.2f} us/send; per 100 sends: voluntary switches "
        f"{d.get('vcs', 0) * 100 / total:5.1f}, involuntary {d.get('ics', 0) * 100 / total:4.1f}, "
        f"migrations {d.get('migr', 0) * 100 / total:4.1f}; minor faults per "
        f"{DURABLE_PEERS} sends {d.get('minflt', 0) * DURABLE_PEERS / total:.2f}, per fdatasync "
        f"{d.get('minflt', 0) / flushes if flushes else 0:.2f}"
    )


def ab_arguments(parser: argparse.ArgumentParser, count: int, rounds: int) -> None:
    """--src (repeatable), --count sends per connection, --rounds of A/B."""
    parser.add_argument("--src", type=Path, action="append", help="a tree holding equeue/")
    parser.add_argument("--count", type=int, default=count, help="sends per connection")
    parser.add_argument("--rounds", type=int, default=rounds, help="A/B rounds")


def alternated(sources: list[Path] | None, rounds: int) -> Iterator[Path]:
    """Each tree once a round, every other round in the reverse order (A/B, B/A, ...); no
    --src: this tree."""
    trees = sources or [Path(__file__).resolve().parent.parent]
    for round_ in range(rounds):
        yield from trees if round_ % 2 == 0 else trees[::-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ab_arguments(parser, count=1000, rounds=2)
    parser.add_argument("--syscalls", action="store_true", help="perf trace -s, per send")
    parser.add_argument(
        "--env", action="append", default=[], help="NAME=VALUE for the broker (repeatable)"
    )
    parser.add_argument("--pin", action="store_true", help="the broker on CPU 0, clients on 1")
    parser.add_argument("--shared", action="store_true", help="one client shared by the tasks")
    parser.add_argument("--flush", choices=("sync", "async"), default="sync")
    parser.add_argument("--record", type=Path, help="perf record -g of the broker to FILE")
    parser.add_argument(
        "--stat", action="store_true", help=f"perf stat --per-thread: {PERF_EVENTS}"
    )
    options = parser.parse_args()
    env = dict(item.split("=", 1) for item in options.env)
    for src in alternated(options.src, options.rounds):
        print(
            run(
                src,
                options.count,
                env,
                options.syscalls,
                options.record,
                options.stat,
                options.pin,
                options.shared,
                options.flush,
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
