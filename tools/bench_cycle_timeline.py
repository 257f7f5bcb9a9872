"""The durable group-commit cycle, step by step, from the kernel's own timestamps (issue 23).

For each ``--src`` tree in turn, alternated ``--rounds`` times: an ``equeue serve --flush
sync`` of that tree on a Unix socket (tools/bench_broker_cpu.py's broker) and
``DURABLE_PEERS`` asyncio tasks in this process, each on its own connection with one 100 B
``send`` in flight (the durable rows' *a connection per task*), ``--count`` sends each
after an untimed warm-up. During the measured part ``perf record`` takes the system-call
tracepoints of both processes (the flusher's fdatasync and eventfd write; the loop's
``epoll_pwait``, ``read`` of each request and ``sendto`` of each answer; the clients'
``epoll_wait``, ``recvfrom`` and ``sendto``) with the CPU each ran on. No instrumented
copy: the broker and the clients run as shipped.

A cycle runs from one fdatasync's start to the next one's. Per cycle, in µs after the
fdatasync returned (its duration apart): when the loop woke, wrote its first and last
answer, the clients read their first answer and wrote their last send, the loop read its
last request, and the next fdatasync started; how long the loop and the clients ran
(outside their epoll waits); and whether the loop and the clients ran on one CPU for the
whole cycle (*one CPU*: the Unix socket's wake-ups are synchronous, which lets the
scheduler put the woken task on the waker's CPU; the two then take turns instead of
overlapping). ``--pin broker`` runs the broker's threads on CPU 0; ``--pin both`` the
clients on CPU 1 as well.

``--shared``: the other reading, one client shared by the ``DURABLE_PEERS`` tasks (their
sends of a loop turn go as one ``send_bodies`` request, one answer), and ``--flush
async`` its ceiling (each send answered after its append). A cycle then runs from one
answer the loop writes to the next, and its steps are the spans between: the clients
read the answer, stepped their tasks and wrote the next request, the loop read it, and
(under sync) handed it to the fdatasync, which ended, and the loop woke and answered.

The tracepoints cost each system call ~1 µs: the rate under ``perf record`` is below the
benchmark's, and the steps, not the rate, are the thing.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import itertools
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, fields
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_broker_cpu import DURABLE_PEERS, _broker
from bench_broker_kern import _drive, _drive_shared, ab_arguments, alternated

SYSCALLS = (
    "fdatasync", "read", "sendto", "recvfrom", "write", "epoll_pwait", "epoll_wait", "futex",
)  # fmt: skip
TRACEPOINTS = [f"syscalls:sys_{edge}_{name}" for name in SYSCALLS for edge in ("enter", "exit")]
FLUSHER_NAME = "equeue-flush"  # cext/flusher.c's thread
DASH = "\u2013"  # a range's, and an empty cell


@dataclass(frozen=True)
class Event:
    time: float  # seconds (perf's clock)
    tid: int
    cpu: int
    name: str  # "enter_read", "exit_fdatasync", ...


@dataclass
class Cycle:
    """One cycle's steps, µs after its fdatasync returned (fdatasync: its duration)."""

    fdatasync: float
    loop_woke: float
    first_answer: float
    last_answer: float
    answers: int
    clients_first_read: float
    clients_last_send: float
    loop_last_read: float
    next_fdatasync: float
    loop_ran: float
    clients_ran: float
    one_cpu: bool


def parse(text: str) -> list[Event]:
    """``perf script -F tid,cpu,time,event --ns`` lines as events."""
    events = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 4 or not parts[3].startswith("syscalls:sys_"):
            continue
        name = parts[3].rstrip(":").removeprefix("syscalls:sys_")
        events.append(Event(float(parts[2].rstrip(":")), int(parts[0]), int(parts[1][1:-1]), name))
    return events


def _ran(events: list[Event], tid: int, wait: str, start: float, end: float) -> float:
    """Seconds ``tid`` spent outside its ``wait`` system call from start to end: running at
    start if the first of its edges seen is the wait's entry."""
    edges = [e for e in events if e.tid == tid and e.name in (f"enter_{wait}", f"exit_{wait}")]
    ran, waiting, since = 0.0, not edges or edges[0].name != f"enter_{wait}", start
    for event in edges:
        if event.name == f"exit_{wait}":
            waiting, since = False, event.time
        elif event.name == f"enter_{wait}" and not waiting:
            ran += event.time - since
            waiting = True
    return ran + (0.0 if waiting else end - since)


def cycles(events: list[Event], loop: int, clients: int, flusher: int) -> list[Cycle]:
    """Every whole cycle in ``events`` (sorted by time) whose answers and sends were seen."""
    times = [event.time for event in events]
    starts = [e.time for e in events if e.tid == flusher and e.name == "enter_fdatasync"]
    found = []
    for start, next_start in itertools.pairwise(starts):
        window = events[bisect.bisect_right(times, start) : bisect.bisect_left(times, next_start)]
        ended = next(
            (e.time for e in window if e.tid == flusher and e.name == "exit_fdatasync"), None
        )
        if ended is None:
            continue
        after = [e for e in window if e.time >= ended]

        def at(tid: int, name: str, after: list[Event] = after) -> list[float]:
            return [e.time for e in after if e.tid == tid and e.name == name]

        woke = at(loop, "exit_epoll_pwait")
        answers = at(loop, "enter_sendto")
        reads = at(loop, "enter_read")
        client_reads = at(clients, "enter_recvfrom")
        client_sends = at(clients, "enter_sendto")
        if not (woke and answers and client_reads and client_sends and reads):
            continue
        loop_cpus = {e.cpu for e in window if e.tid == loop}
        client_cpus = {e.cpu for e in window if e.tid == clients}
        found.append(
            Cycle(
                fdatasync=(ended - start) * 1e6,
                loop_woke=(woke[0] - ended) * 1e6,
                first_answer=(answers[0] - ended) * 1e6,
                last_answer=(answers[-1] - ended) * 1e6,
                answers=len(answers),
                clients_first_read=(client_reads[0] - ended) * 1e6,
                clients_last_send=(client_sends[-1] - ended) * 1e6,
                loop_last_read=(reads[-1] - ended) * 1e6,
                next_fdatasync=(next_start - ended) * 1e6,
                loop_ran=_ran(after, loop, "epoll_pwait", ended, next_start) * 1e6,
                clients_ran=_ran(after, clients, "epoll_wait", ended, next_start) * 1e6,
                one_cpu=len(loop_cpus) == 1 and loop_cpus == client_cpus,
            )
        )
    return found


# A shared client's cycle, answer to answer: its spans in order (µs), each from the step
# before it; under async the four spans of the fdatasync are 0 and the loop's append and
# answer are all in "loop read -> handed over".
SPANS = (
    "answer written -> clients read it",
    "clients read -> next request written (the clients' turn)",
    "request written -> loop read it",
    "loop read -> handed over (appends; the loop's last futex call before the fdatasync)",
    "handed over -> fdatasync start (the flusher thread's wake-up)",
    "fdatasync",
    "fdatasync end -> loop woke",
    "loop woke -> answer written (bookkeeping, answers)",
)


@dataclass
class AnswerCycle:
    spans: tuple[float, ...]  # SPANS' values
    requests: int  # the clients' writes in the cycle (1: the whole turn went as one)
    fdatasyncs: int

    @property
    def total(self) -> float:
        return sum(self.spans)


def answer_cycles(
    events: list[Event], loop: int, clients: int, flusher: int | None
) -> list[AnswerCycle]:
    """The cycles of a shared client (``--shared``), from one answer the loop writes to the
    next, whose steps were all seen in order. The loop's request read is the first
    ``read`` after the clients' write (its eventfd read comes after the fdatasync)."""
    answers = [
        i
        for i, e in enumerate(events)
        if e.tid == loop and e.name in ("enter_write", "enter_sendto")
    ]
    found = []
    for begin, end in itertools.pairwise(answers):
        window = events[begin : end + 1]
        marks = [window[0].time]
        wanted = [(clients, "enter_recvfrom"), (clients, "enter_sendto"), (loop, "enter_read")]
        if flusher is not None:
            wanted += [(flusher, "enter_fdatasync"), (flusher, "exit_fdatasync")]
            wanted += [(loop, "exit_epoll_pwait")]
        at = 0
        for tid, name in wanted:
            while at < len(window) and not (window[at].tid == tid and window[at].name == name):
                at += 1
            if at == len(window):
                break
            if name == "enter_fdatasync":  # the hand-over: the loop's last futex call before
                handed = [e.time for e in window[:at] if e.tid == loop and e.name == "enter_futex"]
                marks.append(max([marks[-1], *handed]))
            marks.append(window[at].time)
        else:
            # under async the loop read -> its answer is one span; no fdatasync, no wake-up
            marks += [window[-1].time] * (5 if flusher is None else 1)
            spans = tuple((b - a) * 1e6 for a, b in itertools.pairwise(marks))
            requests = sum(1 for e in window if e.tid == clients and e.name == "enter_sendto")
            syncs = sum(1 for e in window if e.tid == flusher and e.name == "enter_fdatasync")
            found.append(AnswerCycle(spans, requests, syncs))
    return found


def answer_summary(found: list[AnswerCycle]) -> str:
    """Median, p90 and mean of each span and of the cycle: the means add up to the
    mean cycle, which is what the rate sees."""
    lines = ["| span | median | p90 | mean |", "|---|--:|--:|--:|"]
    rows = [(name, [c.spans[i] for c in found]) for i, name in enumerate(SPANS)]
    rows.append(("the cycle", [c.total for c in found]))
    for name, values in rows:
        values.sort()
        if not values:
            continue
        p90 = values[len(values) * 9 // 10]
        mean = sum(values) / len(values)
        lines.append(f"| {name} | {statistics.median(values):.0f} | {p90:.0f} | {mean:.0f} |")
    single = sum(1 for c in found if c.requests == 1)
    lines.append(
        f"\n{len(found)} cycles; the clients' turn went as one request in {single}; "
        f"fdatasyncs a cycle: {sum(c.fdatasyncs for c in found) / max(len(found), 1):.2f}"
    )
    return "\n".join(lines)


def summary(found: list[Cycle]) -> str:
    """Median (p10 to p90) of each step, over all cycles and split by one CPU / two."""
    groups = {
        "all": found,
        "one CPU": [c for c in found if c.one_cpu],
        "two CPUs": [c for c in found if not c.one_cpu],
    }
    names = [f.name for f in fields(Cycle) if f.name != "one_cpu"]
    head = ["step"] + [f"{label} ({len(group)} cycles)" for label, group in groups.items()]
    lines = ["| " + " | ".join(head) + " |", "|---" + "|--:" * len(groups) + "|"]
    for name in names:
        cells = [name]
        for group in groups.values():
            values = sorted(float(getattr(c, name)) for c in group)
            if not values:
                cells.append(DASH)
                continue
            low, high = values[len(values) // 10], values[len(values) * 9 // 10]
            cells.append(f"{statistics.median(values):.0f} ({low:.0f}{DASH}{high:.0f})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _threads(pid: int) -> dict[str, int]:
    """The broker's loop thread (the process's own) and its flusher thread, by tid."""
    found = {"loop": pid}
    for task in Path(f"/proc/{pid}/task").iterdir():
        if (task / "comm").read_text().strip() == FLUSHER_NAME:
            found["flusher"] = int(task.name)
    return found


class PerfRecord:
    """``perf record`` (``argv``) around the measured part: started and given a second to
    set up on entry, stopped (SIGINT: it writes its file) on exit."""

    def __init__(self, argv: list[str]) -> None:
        self.argv = argv
        self.perf: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> PerfRecord:
        self.perf = subprocess.Popen(
            self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        time.sleep(1.0)  # perf's set-up, not the broker's cycle
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.perf is not None
        self.perf.send_signal(signal.SIGINT)
        self.perf.wait(60)


def run(src: Path, sends: int, pin: str, shared: bool = False, flush: str = "sync") -> str:
    directory = Path(tempfile.mkdtemp(prefix="eqtl", dir="/tmp"))
    cpus = os.sched_getaffinity(0)
    prefix = ["taskset", "-c", "0"] if pin != "none" else []
    broker, url = _broker(src, directory, prefix, flush)
    try:
        if pin == "both":
            os.sched_setaffinity(0, {1})
        data = directory / "perf.data"
        events = [arg for point in TRACEPOINTS for arg in ("-e", point)]
        pids = f"{broker.pid},{os.getpid()}"
        record = ["perf", "record", "-q", *events, "-p", pids, "-o", str(data)]
        threads = _threads(broker.pid)
        drive = _drive_shared if shared else _drive
        wall, flushes = asyncio.run(drive(url, sends, PerfRecord(record)))
    finally:
        os.sched_setaffinity(0, cpus)
        broker.terminate()
        broker.wait(60)
    script = ["perf", "script", "--ns", "-F", "tid,cpu,time,event", "-i", str(data)]
    text = subprocess.run(script, capture_output=True, text=True, check=True).stdout
    shutil.rmtree(directory, ignore_errors=True)
    total = DURABLE_PEERS * sends
    head = (
        f"{src} (pin {pin}{', shared' if shared else ''}, --flush {flush}): "
        f"{total / wall:,.0f} sends/s under perf record, "
        f"{total / max(flushes, 1):.1f} sends per fdatasync, load {os.getloadavg()[0]:.1f}"
    )
    if shared:
        flusher = threads.get("flusher") if flush == "sync" else None
        found = answer_cycles(parse(text), threads["loop"], os.getpid(), flusher)
        return f"{head}\n{answer_summary(found)}"
    return (
        f"{head}\n{summary(cycles(parse(text), threads['loop'], os.getpid(), threads['flusher']))}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ab_arguments(parser, count=300, rounds=1)
    parser.add_argument("--pin", choices=("none", "broker", "both"), default="none")
    parser.add_argument("--shared", action="store_true", help="one client shared by the tasks")
    parser.add_argument("--flush", choices=("sync", "async"), default="sync")
    options = parser.parse_args()
    if options.flush == "async" and not options.shared:
        parser.error("--flush async: with --shared only (a cycle is then answer to answer)")
    for src in alternated(options.src, options.rounds):
        print(run(src, options.count, options.pin, options.shared, options.flush), flush=True)


if __name__ == "__main__":
    main()
