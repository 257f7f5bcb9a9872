"""The idle bubbles of a durable round, and the broker's busy-poll (issue 23, ``--busy-poll-us``).

For each ``--busy-poll-us`` value in turn (0: off), alternated ``--rounds`` times: an
``equeue serve --flush sync --busy-poll-us N`` of ``--src`` on a Unix socket and
``DURABLE_PEERS`` asyncio tasks in this process, each on its own connection with one 100 B
``send`` in flight (tools/bench_broker_kern.py's drive and per-thread counters). Per run:
sends/s, sends per fdatasync, the machine's idle share over the measured part
(``/proc/stat``: idle + iowait of all CPUs), the broker's threads' CPU and voluntary
switches per 100 sends, this (client) process's CPU and voluntary switches per 100 sends,
how long after each fdatasync's end the loop handled it (the broker's own figure, logged
at its exit), and the broker's CPU over ``IDLE_S`` of idleness after the run (an idle
broker must sleep once the window passes). ``--fsync-loop``: the append + fdatasync loop's
rate before each run (the machine's disk, as docs/benchmarks.md reports it).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_broker_cpu import DURABLE_PEERS
from bench_broker_kern import Measured, _drive

IDLE_S = 1.0
TRACE_EVENTS = ",".join(
    ["sched:sched_switch", "sched:sched_wakeup"]
    + [f"syscalls:sys_{edge}_fdatasync" for edge in ("enter", "exit")]
)
EVENT = re.compile(r"^\s*(.+?)\s+(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+(\S+):\s*(.*)$")
WOKE = re.compile(r"(\d+) fdatasyncs by the \w+, (\d+) µs each, handled on the loop (\d+) µs")


def _cpu_times() -> list[int]:
    return [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]


def _voluntary() -> int:
    text = Path("/proc/self/status").read_text()
    hit = re.search(r"^voluntary_ctxt_switches:\s*(\d+)", text, re.MULTILINE)
    return int(hit.group(1)) if hit else 0


def _broker_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2] if values else 0.0


def bubbles(script: str, loop_pid: int, client_pid: int) -> str:
    """From ``perf script`` of TRACE_EVENTS, all CPUs: the CPUs' idle time during an
    fdatasync and outside one, and the wake-ups of the broker's loop and of the clients:
    how many, how long from the wake-up to running, and how many found their CPU idle
    (a halted vCPU woken by an IPI)."""
    idle_since: dict[int, float] = {}  # cpu -> when it went idle
    idle_spans: list[tuple[float, float]] = []
    syncs: list[tuple[float, float]] = []
    sync_began = 0.0
    woken: dict[int, tuple[float, bool]] = {}  # pid -> (when, its CPU was idle)
    waits: dict[int, list[tuple[float, bool]]] = {loop_pid: [], client_pid: []}
    first = last = 0.0
    for line in script.splitlines():
        hit = EVENT.match(line)
        if not hit:
            continue
        pid, cpu, when, event, rest = (
            int(hit.group(2)), int(hit.group(3)), float(hit.group(4)), hit.group(5), hit.group(6)
        )  # fmt: skip
        first, last = first or when, when
        if event == "sched:sched_switch":
            fields = dict(f.split("=", 1) for f in rest.split() if "=" in f)
            if fields.get("next_pid") == "0":
                idle_since[cpu] = when
            elif fields.get("prev_pid") == "0" and cpu in idle_since:
                idle_spans.append((idle_since.pop(cpu), when))
            nxt = int(fields.get("next_pid", "-1"))
            if nxt in woken and nxt in waits:
                began, was_idle = woken.pop(nxt)
                waits[nxt].append((when - began, was_idle))
        elif event == "sched:sched_wakeup":
            fields = dict(f.split("=", 1) for f in rest.split() if "=" in f)
            target = int(fields.get("pid", "-1"))
            if target in waits:
                woken[target] = (when, int(fields.get("target_cpu", "-1")) in idle_since)
        elif event == "syscalls:sys_enter_fdatasync":
            sync_began = when
        elif event == "syscalls:sys_exit_fdatasync" and sync_began:
            syncs.append((sync_began, when))
            sync_began = 0.0
    total_idle = sum(b - a for a, b in idle_spans)
    in_sync = 0.0
    for a, b in idle_spans:  # the idle spans' overlap with the fdatasyncs (both sorted)
        for s, e in syncs:
            if e > a and s < b:
                in_sync += min(b, e) - max(a, s)
    span = max(last - first, 1e-9)
    synced = sum(e - s for s, e in syncs)
    out = [
        f"  trace {span:.2f} s: CPUs idle {total_idle / span / 2:.1%} of 2 CPUs' time; an "
        f"fdatasync in progress {synced / span:.1%} of the time, the CPUs idle during them "
        f"{in_sync / span / 2:.1%}, idle outside them {(total_idle - in_sync) / span / 2:.1%}"
    ]
    for name, pid in (("loop", loop_pid), ("clients", client_pid)):
        got = waits[pid]
        cold = [w for w, was_idle in got if was_idle]
        out.append(
            f"  {name} wake-ups {len(got) / span:,.0f}/s: wake-up to running median "
            f"{_median([w for w, _ in got]) * 1e6:.1f} us; {len(cold)} of {len(got)} onto an "
            f"idle CPU (median {_median(cold) * 1e6:.1f} us)"
        )
    return "\n".join(out)


def fsync_loop(directory: Path, seconds: float = 0.5) -> float:
    """Appends of 100 B, each followed by an fdatasync, for ``seconds``: their rate."""
    fd = os.open(directory / "loop", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        done, end = 0, time.monotonic() + seconds
        while time.monotonic() < end and done < 100_000:
            os.write(fd, b"x" * 100)
            os.fdatasync(fd)
            done += 1
    finally:
        os.close(fd)
        os.unlink(directory / "loop")
    return done / seconds


def run(src: Path, sends: int, busy_us: int, loop_rate: bool, trace: float = 0.0) -> str:
    directory = Path(tempfile.mkdtemp(prefix="eqsp", dir="/tmp"))
    rate = f", fdatasync loop {fsync_loop(directory):,.0f}/s" if loop_rate else ""
    log = directory / "broker.log"
    argv = [sys.executable, "-m", "equeue", "serve", str(directory / "s"), "--flush", "sync"]
    # cwd: `python -m` puts it first on sys.path, ahead of PYTHONPATH (the tree measured)
    with log.open("wb") as err:
        broker = subprocess.Popen(
            [*argv, "--busy-poll-us", str(busy_us)], cwd=directory,
            env=dict(os.environ, PYTHONPATH=str(src)), stdout=subprocess.PIPE, stderr=err,
        )  # fmt: skip
    try:
        assert broker.stdout is not None
        line = broker.stdout.readline().decode()
        if not line.startswith("listening on "):
            raise SystemExit(f"the broker of {src} did not start: {line!r}")
        maps = Path(f"/proc/{broker.pid}/maps").read_text()
        where = next((x.split()[-1] for x in maps.splitlines() if "_speedups" in x), "?")
        measured = Measured(broker.pid, None)
        tracer = None
        if trace:  # all CPUs, from the start of the warm-up (connects and 40 sends each)
            tracer = subprocess.Popen(
                ["perf", "record", "-a", "-e", TRACE_EVENTS, "-o", str(directory / "t.data"),
                 "--", "sleep", str(trace)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            time.sleep(0.5)  # perf attached
        cpu0, vcs0, self0 = _cpu_times(), _voluntary(), time.process_time()
        wall, flushes = asyncio.run(_drive(line.split()[-1], sends, measured))
        cpu1, vcs1, self1 = _cpu_times(), _voluntary(), time.process_time()
        if tracer is not None:
            tracer.wait(60)
        before = _broker_cpu(broker.pid)
        time.sleep(IDLE_S)  # the broker idle: it must not keep polling
        idle_cpu = (_broker_cpu(broker.pid) - before) / IDLE_S
    finally:
        broker.terminate()
        broker.wait(60)
    total = DURABLE_PEERS * sends
    spent = [b - a for a, b in zip(cpu0, cpu1, strict=False)]
    idle = (spent[3] + spent[4]) / max(sum(spent[:8]), 1)
    out = [
        f"busy-poll {busy_us} us ({where}): {total / wall:,.0f} sends/s, "
        f"{total / max(flushes, 1):.1f} sends per fdatasync, machine idle {idle:.1%}, "
        f"load {os.getloadavg()[0]:.1f}{rate}"
    ]
    after = measured.after
    all_run = 0.0
    for name in sorted(after):
        d = {k: v - measured.before.get(name, {}).get(k, 0.0) for k, v in after[name].items()}
        all_run += d.get("run", 0.0)
        if d.get("run", 0.0) * 1e6 / total >= 0.05:
            out.append(
                f"  {name:16s} run {d['run'] * 1e6 / total:5.2f} us/send, voluntary switches "
                f"{d.get('vcs', 0) * 100 / total:5.1f} / 100 sends, involuntary "
                f"{d.get('ics', 0) * 100 / total:4.1f}"
            )
    out.append(
        f"  broker {all_run * 1e6 / total:.2f} us/send; clients {(self1 - self0) * 1e6 / total:.2f}"
        f" us/send, voluntary switches {(vcs1 - vcs0) * 100 / total:.1f} / 100 sends; "
        f"broker idle afterwards {idle_cpu:.1%} of a core"
    )
    woke = WOKE.search(log.read_text(errors="replace"))
    if woke:
        out.append(
            f"  fdatasync {woke.group(2)} us on average, handled on the loop "
            f"{woke.group(3)} us after its end ({woke.group(1)} in the broker's life)"
        )
    if trace:
        script = subprocess.run(
            ["perf", "script", "-i", str(directory / "t.data")],
            capture_output=True, text=True, check=False,
        ).stdout  # fmt: skip
        out.append(bubbles(script, broker.pid, os.getpid()))
    for path in (directory / "s", directory):
        subprocess.run(["rm", "-rf", str(path)], check=False)
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", type=Path, help="a tree holding equeue/ (default: this one)")
    parser.add_argument("--count", type=int, default=1000, help="sends per connection")
    parser.add_argument("--rounds", type=int, default=2, help="alternations")
    parser.add_argument(
        "--busy-poll-us", type=int, action="append", help="values to alternate (default 0, 200)"
    )
    parser.add_argument("--fsync-loop", action="store_true", help="the fdatasync loop's rate")
    parser.add_argument(
        "--trace", type=float, default=0.0, metavar="S",
        help="perf record -a of the scheduler and fdatasync for S seconds of the run (root)",
    )  # fmt: skip
    options = parser.parse_args()
    src = options.src or Path(__file__).resolve().parent.parent
    values = options.busy_poll_us or [0, 200]
    for round_ in range(options.rounds):
        for value in values if round_ % 2 == 0 else values[::-1]:
            print(run(src, options.count, value, options.fsync_loop, options.trace), flush=True)


if __name__ == "__main__":
    main()
