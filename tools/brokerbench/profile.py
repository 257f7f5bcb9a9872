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
from typing import TYPE_CHECKING, Any

from brokerbench import report
from brokerbench.pool import JobError

if TYPE_CHECKING:
    from brokerbench.cases import Bench
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


RATE = 100  # samples a second
OTHER = "other (interpreter, GC, the rest)"


def py_spy() -> str | None:
    return os.environ.get("PY_SPY") or shutil.which("py-spy")


def part_of(frame: str) -> str:
    for part, marks in PARTS:
        if any(mark in frame for mark in marks):
            return part
    return OTHER


class Samples:
    """py-spy's collapsed stacks (``--threads``: the first frame names the thread)."""

    def __init__(self, collapsed: str) -> None:
        self.stacks: list[tuple[str, list[str], int]] = []  # (thread, frames, samples)
        for line in collapsed.splitlines():
            stack, _, count_text = line.rpartition(" ")
            if not stack or not count_text.isdigit():
                continue
            frames = stack.split(";")
            thread = ""
            if frames[0].startswith("thread ("):
                thread = frames.pop(0).partition(": ")[2] or frames[0]
            if frames:
                self.stacks.append((thread, frames, int(count_text)))

    def threads(self) -> Counter[str]:
        found: Counter[str] = Counter()
        for thread, _, count in self.stacks:
            found[thread] += count
        return found

    def summarize(self, thread: str | None = None) -> tuple[int, Counter[str], Counter[str]]:
        """Samples in all, by the leaf frame's part (self), by the parts on the stack."""
        total = 0
        leaf: Counter[str] = Counter()
        inclusive: Counter[str] = Counter()
        for name, frames, count in self.stacks:
            if thread is not None and name != thread:
                continue
            total += count
            leaf[part_of(frames[-1])] += count
            for part in {part_of(frame) for frame in frames}:
                inclusive[part] += count
        return total, leaf, inclusive

    def in_kernel(self, thread: str) -> int:
        """Samples whose top frame is in libc: a system call (send, epoll_wait, fsync, a
        futex): time in the kernel, or runnable but waiting for a CPU inside it."""
        return sum(c for name, frames, c in self.stacks if name == thread and _libc(frames[-1]))

    def user(self, thread: str) -> Counter[str]:
        """Of the samples not in libc: each by the innermost frame of a known part (the
        interpreter's own frames are passed over), "all" their number."""
        found: Counter[str] = Counter()
        for name, frames, count in self.stacks:
            if name != thread or _libc(frames[-1]):
                continue
            found["all"] += count
            parts = (part_of(frame) for frame in reversed(frames))
            found[next((p for p in parts if p != OTHER), OTHER)] += count
        return found

    def top_frames(self, thread: str | None = None, count: int = 10) -> list[tuple[str, int]]:
        """The frames most often on top of the stack (self time), with their samples; a
        native frame with the innermost Python frame under it."""
        frames: Counter[str] = Counter()
        for name, stack, samples in self.stacks:
            if thread is None or name == thread:
                top = _short(stack[-1])
                if ".py:" not in stack[-1]:
                    caller = next((f for f in reversed(stack) if ".py:" in f), None)
                    top += f" under {_short(caller)}" if caller else ""
                frames[top] += samples
        return frames.most_common(count)


def summarize(collapsed: str) -> tuple[int, Counter[str], Counter[str]]:
    return Samples(collapsed).summarize()


def _libc(frame: str) -> bool:
    return "(libc.so" in frame


def _short(frame: str) -> str:
    """``name (path/to/file.py:12)`` as ``name (file.py:12)``."""
    name, _, where = frame.partition(" (")
    return f"{name} ({where.rsplit('/', 1)[-1]}" if where else name


UNBATCHED = "4 producer processes, 100 B, asyncio client, 100 in flight each"
DURABLE = "--flush sync, 64 asyncio connections in 4 processes, one send at a time each, 100 B"


def load_jobs(load: str, url: str, topic: str, seconds: float) -> list[dict[str, Any]]:
    job = {"kind": "broker_produce", "url": url, "topic": topic, "body": 100}
    job |= {"count": 10_000_000, "cap": seconds}
    if load == DURABLE:
        job |= {"kind": "broker_durable", "producers": 16}
    else:
        job |= {"batch": 1, "window": 100, "style": "aio"}
    return [job] * 4


def profile_broker(bench: Bench, broker: Server, load: str = UNBATCHED) -> list[str]:
    """Run ``load`` against the broker once more under py-spy; the lines for the report."""
    binary = py_spy()
    if binary is None:
        return ["--profile: py-spy not found (pip install py-spy, or PY_SPY=path): no profile"]
    report.progress(f"profile: py-spy on the broker, {load}")
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
            str(RATE),
            "--format",
            "raw",
            "--native",  # msgpack's C code as itself; native needs blocking samples
            "--threads",
            "--output",
            str(out),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        bench.pool.run(load_jobs(load, broker.url, bench.name("prof"), float(seconds)), seconds)
    except JobError as error:
        return [f"--profile: the load failed: {' '.join(str(error).split())[:500]}"]
    finally:
        try:
            _, err = spy.communicate(timeout=seconds + 60)
        except subprocess.TimeoutExpired:
            spy.kill()
            _, err = spy.communicate()
    if spy.returncode != 0 or not out.exists():
        return [f"--profile: py-spy failed ({spy.returncode}): {err.strip()[-500:]}"]
    samples = Samples(out.read_text())
    threads = samples.threads()
    if not threads:
        return ["--profile: py-spy took no samples of the broker"]
    loop = "MainThread"  # the event loop's
    total = samples.summarize(loop)[0]
    if not total:
        return [f"--profile: no samples of the event loop thread; threads: {dict(threads)}"]
    possible = seconds * RATE
    busy = [f"{name} {n:,} ({n / possible:.0%})" for name, n in threads.most_common()]
    kernel = samples.in_kernel(loop)
    user = samples.user(loop)
    users = user.pop("all", 0)
    parts = [f"{part} {n / max(1, users):.0%}" for part, n in user.most_common()]
    frames = [f"`{frame}` {n / total:.0%}" for frame, n in samples.top_frames(loop, 10)]
    lines = [
        f"Profile of the broker (py-spy --native --threads at {RATE} Hz for {seconds} s; "
        f"{load}). Samples by thread, of {possible:,} a thread could have (py-spy leaves out "
        f"a thread it sees idle, but with --native keeps one waiting in a futex or in "
        f"epoll_wait): {', '.join(busy)}. Of the event loop thread's {total:,}: "
        f"{kernel / total:.0%} in a system call (libc on top: in the kernel, or runnable and "
        f"waiting for a CPU there), {users / total:.0%} in user space; of those, by the "
        f"innermost part on the stack: {', '.join(parts)}.",
        f"The event loop thread's top frames (self samples): {'; '.join(frames)}",
    ]
    for name, n in threads.most_common():
        if name != loop and n >= possible / 20:  # busy at least 5 % of the time
            top = [f"`{frame}` {k / n:.0%}" for frame, k in samples.top_frames(name, 4)]
            lines.append(f"Thread {name}'s top frames: {'; '.join(top)}")
    return lines
