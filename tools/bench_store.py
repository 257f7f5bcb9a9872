"""Benchmark of MessageStore.send, send_batch and pull (no per-message fsync).

Each case runs in a fresh store directory, repeated; prints the median and
min-max of messages/s beside a plain buffered-file append of the same bodies
measured in the same run. ``--quick`` is a smoke run of a few seconds.

``--prealloc steps|full|both``: chunks allocated in steps ahead of the writer (the
default, ``StoreConfig.alloc_step``), whole at creation (``alloc_step=0``, as before), or
both, alternating run by run (A, B, A, B, ...) so that the machine's drift hits both alike.
The DISK column is what the store held on disk (st_blocks) at the end of a run.
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

QUEUES = 4


PREALLOC = {"steps": StoreConfig(flush="os"), "full": StoreConfig(flush="os", alloc_step=0)}
_config = PREALLOC["steps"]


def _store(directory: Path) -> MessageStore:
    store = MessageStore.open(directory, _config)
    store.create_topic("bench", QUEUES)
    return store


def on_disk(directory: Path) -> int:
    return sum(
        os.lstat(os.path.join(root, name)).st_blocks * 512
        for root, _, names in os.walk(directory)
        for name in names
    )


def bench_send(directory: Path, body: bytes, count: int) -> float:
    with _store(directory) as store:
        send = store.send
        started = time.perf_counter()
        for _ in range(count):
            send("bench", body)
        return count / (time.perf_counter() - started)


def bench_send_batch(directory: Path, body: bytes, count: int) -> float:
    batch = [OutgoingMessage(body)] * 1000
    with _store(directory) as store:
        started = time.perf_counter()
        for _ in range(count // len(batch)):
            store.send_batch("bench", batch)
        return (count // len(batch) * len(batch)) / (time.perf_counter() - started)


def bench_pull(directory: Path, body: bytes, count: int) -> float:
    with _store(directory) as store:
        store.send_batch("bench", [OutgoingMessage(body)] * count)
        started = time.perf_counter()
        pulled = 0
        for queue_id in range(QUEUES):
            offset = 0
            while True:
                result = store.pull("bench", queue_id, offset, max_count=256)
                if not result.messages:
                    break
                pulled += len(result.messages)
                offset = result.next_offset
        assert pulled == count, (pulled, count)
        return pulled / (time.perf_counter() - started)


def bench_reference(directory: Path, body: bytes, count: int) -> float:
    header = len(body).to_bytes(4, "little")
    with open(directory / "ref.log", "ab", buffering=1 << 20) as f:
        write = f.write
        started = time.perf_counter()
        for _ in range(count):
            write(header + body)
        return count / (time.perf_counter() - started)


CASES: dict[str, Callable[[Path, bytes, int], float]] = {
    "send": bench_send,
    "send_batch": bench_send_batch,
    "pull": bench_pull,
    "REF buffered append": bench_reference,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dir", type=Path, default=Path.cwd())
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--prealloc", choices=["steps", "full", "both"], default="steps")
    args = parser.parse_args()
    global _config
    modes = ["steps", "full"] if args.prealloc == "both" else [args.prealloc]
    sizes = {100: 200_000, 1024: 100_000}
    repeat = args.repeat
    if args.quick:
        sizes, repeat = {100: 5_000, 1024: 2_000}, 1
    rows = [
        "| case | body | messages | prealloc | msg/s median (min-max) | MiB/s | vs REF | DISK |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for size, count in sizes.items():
        body = os.urandom(size)
        reference = 0.0
        for name, case in reversed(CASES.items()):
            reference_case = name.startswith("REF")
            runs = ["-"] if reference_case else modes
            rates: dict[str, list[float]] = {mode: [] for mode in runs}
            disk: dict[str, int] = {}
            for _ in range(repeat):
                for mode in runs:  # alternating: A, B, A, B, ...
                    _config = PREALLOC.get(mode, _config)
                    directory = Path(tempfile.mkdtemp(prefix="equeue-bench-", dir=args.dir))
                    try:
                        rates[mode].append(case(directory, body, count))
                        disk[mode] = on_disk(directory)
                    finally:
                        shutil.rmtree(directory, ignore_errors=True)
            for mode in runs:
                median = statistics.median(rates[mode])
                if reference_case:
                    reference = median
                ratio = median / reference if reference else 0.0
                rows.append(
                    f"| {name} | {size} B | {count:,} | {mode} | {median:,.0f} "
                    f"({min(rates[mode]):,.0f}-{max(rates[mode]):,.0f}) | "
                    f"{median * size / 2**20:,.1f} | {ratio:.2f} | {disk[mode] / 2**20:,.1f} MiB |"
                )
    table = "\n".join(rows)
    print(table)
    if args.markdown:
        args.markdown.write_text(table + "\n")


if __name__ == "__main__":
    main()
