"""Disk use and write cost of allocating chunks in steps (StoreConfig.alloc_step) against
allocating them whole at creation (alloc_step=0), measured side by side in one run.

Disk: the blocks a store holds (st_blocks * 512 over its files) for the issue's examples,
beside the data they hold (``equeue inspect``'s data figure). Cost: ``send``,
``send_batch`` and ``pull`` of 100-byte bodies, alternating steps and full run by run, each timed by
the wall clock and by the process's CPU time (all its threads, the prefaulter's too),
which a busy machine disturbs less. ``--quick`` is a smoke run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from equeue import MessageStore, OutgoingMessage, StoreConfig
from equeue.inspect.summary import summarize_store

MODES = {"steps": StoreConfig(flush="os"), "full": StoreConfig(flush="os", alloc_step=0)}
BODY = os.urandom(100)


def one_message(store: MessageStore, count: int) -> None:
    store.send("t", b"hello")


def hundred_messages(store: MessageStore, count: int) -> None:
    for t in range(25):
        store.create_topic(f"topic-{t}", 4)
    for i in range(100):
        store.send(f"topic-{i % 25}", BODY, queue_id=i // 25)


def sends(store: MessageStore, count: int) -> None:
    send = store.send
    for _ in range(count):
        send("bench", BODY)


def batches(store: MessageStore, count: int) -> None:
    batch = [OutgoingMessage(BODY)] * 1000
    for _ in range(count // 1000):
        store.send_batch("bench", batch)


def pulls(store: MessageStore, count: int) -> None:
    for queue_id in range(4):
        offset = 0
        while batch := store.pull("bench", queue_id, offset, max_count=256).messages:
            offset = batch[-1].queue_offset + 1


def nothing(store: MessageStore, count: int) -> None:
    pass


EXAMPLES: dict[str, Callable[[MessageStore, int], None]] = {
    "1 message": one_message,
    "100 messages, 25 topics x 4 queues": hundred_messages,
}
Work = Callable[[MessageStore, int], None]
COSTS: dict[str, tuple[Work, Work]] = {  # (untimed preparation, timed work)
    "send": (nothing, sends),
    "send_batch": (nothing, batches),
    "pull": (batches, pulls),
}


def run(workdir: Path, mode: str, work: Callable[[MessageStore, int], None], count: int) -> Path:
    path = Path(tempfile.mkdtemp(prefix="equeue-du-", dir=workdir)) / "store"
    with MessageStore.open(path, MODES[mode]) as store:
        work(store, count)
    return path


def timed(workdir: Path, mode: str, prepare: Work, work: Work, count: int) -> tuple[float, float]:
    path = Path(tempfile.mkdtemp(prefix="equeue-du-", dir=workdir)) / "store"
    try:
        with MessageStore.open(path, MODES[mode]) as store:
            store.create_topic("bench", 4)
            prepare(store, count)
            cpu, wall = time.process_time(), time.perf_counter()
            work(store, count)
            return time.perf_counter() - wall, time.process_time() - cpu
    finally:
        shutil.rmtree(path.parent, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=21, help="runs per mode and case")
    parser.add_argument("--count", type=int, default=200_000, help="messages per run")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()
    repeat, count = (3, 10_000) if args.quick else (args.repeat, args.count)
    print("| example | prealloc | data | on disk |\n|---|---|---|---|")
    for name, work in EXAMPLES.items():
        for mode in MODES:
            path = run(args.dir, mode, work, 0)
            try:
                summary = summarize_store(path)
                print(
                    f"| {name} | {mode} | {summary.data_bytes:,} B | "
                    f"{summary.allocated_bytes:,} B ({summary.allocated_bytes / 2**20:,.1f} MiB) |"
                )
            finally:
                shutil.rmtree(path.parent, ignore_errors=True)
    print(
        "\n| case | prealloc | runs | msg/s median (min-max), wall | CPU µs/msg median |"
        "\n|---|---|---|---|---|"
    )
    for name, (prepare, work) in COSTS.items():
        results: dict[str, list[tuple[float, float]]] = {mode: [] for mode in MODES}
        for i in range(repeat):
            order = list(MODES) if i % 2 == 0 else list(reversed(MODES))
            for mode in order:  # alternating, each mode first half the time
                results[mode].append(timed(args.dir, mode, prepare, work, count))
        for mode, runs in results.items():
            rates = [count / wall for wall, _ in runs]
            cpu = statistics.median(c for _, c in runs) / count * 1e6
            print(
                f"| {name} | {mode} | {len(runs)} | {statistics.median(rates):,.0f} "
                f"({min(rates):,.0f}-{max(rates):,.0f}) | {cpu:.3f} |"
            )


if __name__ == "__main__":
    main()
