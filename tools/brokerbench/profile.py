"""Where the broker's time goes under the unbatched load: py-spy samples the broker process
(with native frames, so msgpack's C code is seen as itself) while 4 producer processes
send 100 B messages one per request; the samples are summed by the leaf frame's part
(msgpack, asyncio and sockets, the protocol, the server, the store) and by the parts on
the stack (inclusive)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from brokerbench import report

if TYPE_CHECKING:
    from bench_broker import Bench

    from brokerbench.servers import Server

PARTS = [  # (part, substrings of a frame that mark it), the first match wins
    ("msgpack", ("msgpack",)),
    ("store (equeue/store, chunks, C accelerator)", ("equeue/store/", "equeue/chunks/",
                                                      "_speedups", "equeue/format/")),
    ("protocol (equeue/protocol)", ("equeue/protocol/",)),
    ("server (equeue/server)", ("equeue/server/",)),
    ("asyncio event loop, selectors, sockets", ("asyncio/", "selectors.py", "socket.py",
                                                "libc.so", "epoll", "sendmsg", "recvmsg",
                                                "sock_", "_ssl")),
]  # fmt: skip


def py_spy() -> str | None:
    return os.environ.get("PY_SPY") or shutil.which("py-spy")


def part_of(frame: str) -> str:
    for part, marks in PARTS:
        if any(mark in frame for mark in marks):
            return part
    return "other (interpreter, GC, the rest)"


def summarize(collapsed: str) -> tuple[int, Counter[str], Counter[str]]:
    """Samples in all, by the leaf frame's part (self), by the parts on the stack."""
    total = 0
    leaf: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    for line in collapsed.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        total += count
        leaf[part_of(frames[-1])] += count
        for part in {part_of(frame) for frame in frames}:
            inclusive[part] += count
    return total, leaf, inclusive


def profile_broker(bench: Bench, broker: Server) -> list[str]:
    """Run the unbatched 4-producer case once more under py-spy; the lines for the report."""
    binary = py_spy()
    if binary is None:
        return ["--profile: py-spy not found (pip install py-spy, or PY_SPY=path): no profile"]
    report.progress("profile: 4 producers, 100 B, unbatched, py-spy on the broker")
    out = Path(tempfile.mkdtemp(prefix="spy", dir=bench.base)) / "broker.txt"
    seconds = max(2, int(bench.cap))
    spy = subprocess.Popen(
        [
            binary,
            "record",
            "--pid",
            str(broker.pid),
            "--duration",
            str(seconds),
            "--rate",
            "250",
            "--format",
            "raw",
            "--native",
            "--nonblocking",
            "--output",
            str(out),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        jobs = [
            {"kind": "broker_produce", "url": broker.url, "topic": bench.name("prof")}
            | {"body": 100, "count": 10_000_000, "batch": 1, "window": 100}
            | {"style": bench.args.unbatched, "cap": float(seconds)}
            for _ in range(4)
        ]
        bench.pool.run(jobs, seconds)
    finally:
        try:
            _, err = spy.communicate(timeout=seconds + 60)
        except subprocess.TimeoutExpired:
            spy.kill()
            _, err = spy.communicate()
    if spy.returncode != 0 or not out.exists():
        return [f"--profile: py-spy failed ({spy.returncode}): {err.strip()[-500:]}"]
    total, leaf, inclusive = summarize(out.read_text())
    if not total:
        return ["--profile: py-spy took no samples of the broker"]
    lines = [
        f"Profile of the broker (py-spy, {total:,} samples of its busy time over {seconds} s, "
        "4 producer processes, 100 B, unbatched): by the frame on top of the stack — "
        + ", ".join(f"{part} {n / total:.0%}" for part, n in leaf.most_common())
        + "; on the stack at all — "
        + ", ".join(f"{part} {n / total:.0%}" for part, n in inclusive.most_common())
    ]
    return lines
