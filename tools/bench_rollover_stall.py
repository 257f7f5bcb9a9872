"""How long a chunk roll-over holds a broker's clients (docs/broker.md, "Chunk roll-over
runs on the loop").

A store of ``--chunk-bytes`` log chunks, ``equeue serve --flush F`` in a child process
with ``Chunk.complete`` and ``ChunkManager.add_new_chunk`` timed (CLOCK_MONOTONIC start and
end, the thread's CPU), and ``--clients`` processes each sending 1 KiB messages one at a
time for ``--seconds``, noting when each answer came. Printed per run: the message log's
completions and creations on the loop thread (wall and CPU), and the gaps between two
answers of one client, those spanning a roll-over apart from the others. In a tree with
the next chunk made ahead (equeue/chunks/ahead.py) also how many roll-overs installed
the file made ahead, and on which thread each new name's directory fsync ran (the chunk
maker's, or the loop's, which then waited for it in ``log_synced``). ``--flush``
may be repeated: the runs alternate, ``--rounds`` times.

    python tools/bench_rollover_stall.py --flush sync --flush async --rounds 2
"""

from __future__ import annotations

import argparse
import atexit
import itertools
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

BODY = b"x" * 1024
MAX_SENDS = 2_000_000  # per client: the loop's bound beside --seconds
Event = tuple[str, str, int, int, int, str]  # name, file, start ns, end ns, CPU ns, thread


def _broker_child(events_file: str, serve_args: list[str]) -> int:
    """``equeue serve`` with the two calls timed; the events written at exit."""
    from equeue.chunks.chunk import Chunk
    from equeue.chunks.manager import ChunkManager
    from equeue.cli import main

    events: list[Event] = []

    def timed(cls: type, name: str) -> None:
        original = getattr(cls, name)

        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            start, cpu = time.monotonic_ns(), time.thread_time_ns()
            try:
                return original(self, *args, **kwargs)
            finally:
                where = str(getattr(self, "path", getattr(self, "directory", "")))
                name_ = threading.current_thread().name
                spent = time.thread_time_ns() - cpu
                events.append((name, where, start, time.monotonic_ns(), spent, name_))

        setattr(cls, name, wrapper)

    timed(Chunk, "complete")
    timed(ChunkManager, "add_new_chunk")
    if hasattr(ChunkManager, "_install_made_ahead"):  # (a tree with equeue/chunks/ahead.py)
        install = ChunkManager._install_made_ahead

        def installed(self: Any, number: int) -> Any:
            chunk = install(self, number)
            what = "made ahead" if chunk else "not made ahead"
            events.append((what, str(self.directory), 0, 0, 0, ""))
            return chunk

        ChunkManager._install_made_ahead = installed  # type: ignore[method-assign]
        durable = Chunk.make_name_durable

        def name_durable(self: Any) -> None:
            if not self.name_pending:
                return
            start, cpu = time.monotonic_ns(), time.thread_time_ns()
            durable(self)
            spent = time.thread_time_ns() - cpu
            thread = threading.current_thread().name
            events.append(("name fsync", str(self.path), start, time.monotonic_ns(), spent, thread))

        Chunk.make_name_durable = name_durable  # type: ignore[method-assign]
    atexit.register(lambda: Path(events_file).write_text(json.dumps(events)))
    return main(["serve", *serve_args])


def _client(store: str, seconds: float, out: str) -> None:
    import equeue

    answered: list[int] = []
    with equeue.connect(store) as client:
        client.send("t", BODY)  # (connected, the topic's queues open)
        end = time.monotonic_ns() + int(seconds * 1e9)
        while len(answered) < MAX_SENDS and (not answered or answered[-1] < end):
            client.send("t", BODY)
            answered.append(time.monotonic_ns())
    Path(out).write_text(json.dumps(answered))


def _quantile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))]


def run(flush: str, chunk_bytes: int, seconds: float, clients: int, scratch: Path) -> None:
    from equeue import MessageStore, StoreConfig

    store = scratch / f"store-{flush}-{time.monotonic_ns()}"
    with MessageStore.open(store, StoreConfig(chunk_data_size=chunk_bytes)) as created:
        created.create_topic("t", 4)
    events_file = store.parent / (store.name + ".events.json")
    broker = subprocess.Popen(
        [sys.executable, __file__, "--broker-child", str(events_file), str(store),
         "--flush", flush, "--quiet"],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert broker.stdout is not None
        if not broker.stdout.readline().startswith(b"listening on"):
            raise SystemExit("the broker did not start")
        outs = [str(store.parent / f"{store.name}.answers.{i}") for i in range(clients)]
        workers = [
            multiprocessing.Process(target=_client, args=(str(store), seconds, out)) for out in outs
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(seconds + 60)
    finally:
        broker.terminate()
        broker.wait(60)
    events: list[Event] = [tuple(e) for e in json.loads(events_file.read_text())]
    log = [
        e
        for e in events
        if e[5] == "MainThread" and f"{os.sep}messages" in e[1] and e[0] != "name fsync"
    ]
    print(f"== --flush {flush}, {chunk_bytes} B log chunks, {clients} clients, {seconds:g} s")
    # The log's roll-overs (not its first chunk, which has nothing before it to be made
    # ahead during), and per new chunk the thread that did its name's fsync (a thread that
    # found another one doing it waits, and is not counted).
    installs = [e[0] for e in events if e[0].endswith("made ahead") and e[1].endswith("messages")]
    if installs:
        fsyncs = {e[1]: e for e in events if e[0] == "name fsync" and e[5] != "MainThread"}
        fsyncs |= {e[1]: e for e in events if e[0] == "name fsync" and e[5] == "MainThread"}
        on_loop = sorted((e[3] - e[2]) / 1e6 for e in fsyncs.values() if e[5] == "MainThread")
        print(
            f"  roll-overs that installed a file made ahead: {installs.count('made ahead')} "
            f"of {len(installs) - 1}; the new names' directory fsyncs: "
            f"{len(fsyncs) - len(on_loop)} off the loop, {len(on_loop)} done or waited for on it"
            + (f" (wall max {on_loop[-1]:.2f} ms)" if on_loop else "")
        )
    for name in ("complete", "add_new_chunk"):
        chosen = [e for e in log if e[0] == name]
        if chosen:
            wall = sorted((e[3] - e[2]) / 1e6 for e in chosen)
            cpu = sorted(e[4] / 1e6 for e in chosen)
            print(
                f"  {name}: {len(chosen)} on the loop, wall median {statistics.median(wall):.2f}"
                f" max {wall[-1]:.2f} ms, CPU median {statistics.median(cpu):.2f}"
                f" max {cpu[-1]:.2f} ms"
            )
    windows = [(e[2], e[3]) for e in log]
    spanning: list[float] = []
    others: list[float] = []
    for out in outs:
        answered = json.loads(Path(out).read_text())
        for before, after in itertools.pairwise(answered):
            gap = (after - before) / 1e6
            hit = any(start < after and end > before for start, end in windows)
            (spanning if hit else others).append(gap)
    others.sort()
    spanning.sort()
    print(
        f"  {len(others) + len(spanning)} answers; gaps spanning a roll-over: {len(spanning)}"
        + (
            f", median {statistics.median(spanning):.2f} max {spanning[-1]:.2f} ms"
            if spanning
            else ""
        )
    )
    if others:
        print(
            f"  the other gaps: p50 {_quantile(others, 0.5):.3f} p99.9 "
            f"{_quantile(others, 0.999):.3f} max {others[-1]:.2f} ms"
        )


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--broker-child":
        return _broker_child(sys.argv[2], sys.argv[3:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flush", action="append", choices=["sync", "async", "os"])
    parser.add_argument("--chunk-bytes", type=int, default=4 << 20)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rollover-stall-") as scratch:
        for _ in range(args.rounds):
            for flush in args.flush or ["sync", "async"]:
                run(flush, args.chunk_bytes, args.seconds, args.clients, Path(scratch))
    return 0


if __name__ == "__main__":
    sys.exit(main())
