"""Durable sends under flush="sync" (group commit) with 1, 4 and 16 producer threads,
beside a plain append + fdatasync loop and the least group commit 16 Python threads
can run (no store), measured in the same run, and recovery time after a kill for
stores of growing size.

``--quick`` is a smoke run of a few seconds.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from equeue import MessageStore, StoreConfig
from equeue.atomicfile import read_json, write_json
from equeue.store.config import FlushPolicy
from equeue.store.meta import CHECKPOINT_FILE

BODY = os.urandom(1024)


def bench_fdatasync_loop(directory: Path, seconds: float) -> float:
    """The physical reference: one buffered append and one fdatasync per message."""
    header = len(BODY).to_bytes(4, "little")
    fd = os.open(directory / "ref.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        count = 0
        started = time.perf_counter()
        while time.perf_counter() - started < seconds:
            os.write(fd, header + BODY)
            os.fdatasync(fd)
            count += 1
        return count / (time.perf_counter() - started)
    finally:
        os.close(fd)


def bench_fdatasync_preallocated(directory: Path, seconds: float) -> float:
    """The same into a preallocated file (as chunk files are): no size change to journal."""
    record = len(BODY).to_bytes(4, "little") + BODY
    fd = os.open(directory / "ref.log", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.posix_fallocate(fd, 0, 64 << 20)
        os.fsync(fd)
        count = 0
        started = time.perf_counter()
        while time.perf_counter() - started < seconds:
            os.pwrite(fd, record, (count * len(record)) % (63 << 20))
            os.fdatasync(fd)
            count += 1
        return count / (time.perf_counter() - started)
    finally:
        os.close(fd)


def _run_producers(
    produce: Callable[[int], None], threads: int, seconds: float, stop: threading.Event
) -> float:
    """Run ``produce(i)`` in ``threads`` threads for ``seconds``, then set ``stop`` and
    wait for them: the seconds it all took."""
    workers = [threading.Thread(target=produce, args=(i,)) for i in range(threads)]
    started = time.perf_counter()
    for worker in workers:
        worker.start()
    time.sleep(seconds)
    stop.set()
    for worker in workers:
        worker.join()
    return time.perf_counter() - started


def bench_group_floor(
    directory: Path, threads: int, seconds: float, *, mapped: bool
) -> tuple[float, float]:
    """(sends/s, sends per flush) of the least a group commit of blocking Python threads
    does, with no store around it: each producer writes 1 KiB under a lock (``pwrite``,
    or into a shared mapping as equeue does), queues its own lock and sleeps on it; one
    flusher thread takes every queued lock, runs one fdatasync and releases them. What
    equeue's 16-thread rate can be held against on this machine."""
    size = 256 << 20
    record = len(BODY).to_bytes(4, "little") + BODY
    wrap = size - len(record)
    fd = os.open(directory / "floor.log", os.O_RDWR | os.O_CREAT, 0o644)
    os.posix_fallocate(fd, 0, size)
    os.fsync(fd)
    mm = mmap.mmap(fd, size) if mapped else None
    write_lock = threading.Lock()
    queued = threading.Condition()
    pending: list[threading.Lock] = []
    counts = [0] * threads
    flushes = 0
    position = 0
    stop = threading.Event()
    done = False

    def flush_loop() -> None:
        nonlocal flushes
        while True:
            with queued:
                while not pending and not done:
                    queued.wait()
                if not pending:
                    return
                batch = pending[:]
                pending.clear()
            os.fdatasync(fd)
            flushes += 1
            for waiter in batch:
                waiter.release()

    def produce(i: int) -> None:
        nonlocal position
        me = threading.Lock()
        me.acquire()
        n = 0
        while not stop.is_set():
            with write_lock:
                at = position % wrap
                position += len(record)
                if mm is not None:
                    mm[at : at + len(record)] = record
                else:
                    os.pwrite(fd, record, at)
            with queued:
                pending.append(me)
                queued.notify()
            me.acquire()
            n += 1
        counts[i] = n

    flusher = threading.Thread(target=flush_loop)
    flusher.start()
    elapsed = _run_producers(produce, threads, seconds, stop)
    with queued:
        done = True
        queued.notify()
    flusher.join()
    if mm is not None:
        mm.close()
    os.close(fd)
    total = sum(counts)
    return total / elapsed, total / max(flushes, 1)


def bench_sync_sends(
    directory: Path, threads: int, seconds: float, policy: FlushPolicy = "sync"
) -> tuple[float, float]:
    """(sends/s, sends per flush) with ``threads`` producers sending for ``seconds``."""
    config = StoreConfig(flush=policy, chunk_data_size=64 << 20)
    with MessageStore.open(directory, config) as store:
        store.create_topic("bench", 16)
        counts = [0] * threads
        stop = threading.Event()

        def produce(i: int) -> None:
            send = store.send
            n = 0
            while not stop.is_set():
                send("bench", BODY, queue_id=i % 16)
                n += 1
            counts[i] = n

        flushes_before = store._group.flushes if store._group else 0
        elapsed = _run_producers(produce, threads, seconds, stop)
        flushes = (store._group.flushes if store._group else 0) - flushes_before
        total = sum(counts)
        return total / elapsed, total / max(flushes, 1)


_FILL = """
import sys
from equeue import MessageStore, OutgoingMessage, StoreConfig
store = MessageStore.open(sys.argv[1])  # flush="async", the default
store.create_topic("bench", 4)
batch = [OutgoingMessage(b"x" * 4000)] * 256
target = int(sys.argv[2])
written = 0
while written < target:
    store.send_batch("bench", batch)
    written += 256 * 4100
for _ in range(100):  # a last stretch of sends, then the kill
    store.send_batch("bench", batch[:16])
print("ready", flush=True)
import time
time.sleep(60)
"""


def bench_recovery(directory: Path, size: int) -> tuple[float, int]:
    """(seconds to reopen, messages re-dispatched) for a store of ``size`` bytes after a
    SIGKILL mid-write."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _FILL, str(directory), str(size)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    started = time.perf_counter()
    store = MessageStore.open(directory)
    elapsed = time.perf_counter() - started
    redispatched = store.recovery.redispatched
    store.close()
    return elapsed, redispatched


def bench_clean_reopen(directory: Path, repeat: int = 5) -> tuple[float, float]:
    """Median seconds to reopen the (closed) store at ``directory``: as it is, and with
    the checkpoint's ``log_tail`` taken out, so that recovery scans the ongoing chunk
    from its first record, as it did before checkpoints carried it (the reference, in
    the same run)."""
    checkpoint = directory / CHECKPOINT_FILE
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(repeat):
        for hint in (True, False):
            if not hint:
                body = read_json(checkpoint)
                body.pop("log_tail", None)
                write_json(checkpoint, body)
            started = time.perf_counter()
            store = MessageStore.open(directory)
            times[hint].append(time.perf_counter() - started)
            store.close()
    return statistics.median(times[True]), statistics.median(times[False])


def _median(values: list[float]) -> str:
    return f"{statistics.median(values):,.0f} ({min(values):,.0f}-{max(values):,.0f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dir", type=Path, default=Path.cwd())
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--only-recovery", action="store_true", help="only the reopen cases")
    args = parser.parse_args()
    repeat, seconds = args.repeat, args.seconds
    sizes = [100 << 20, 1 << 30, 4 << 30]
    if args.quick:
        repeat, seconds, sizes = 1, 0.5, [8 << 20]

    def fresh() -> Path:
        return Path(tempfile.mkdtemp(prefix="equeue-bench-", dir=args.dir))

    def send_rows() -> list[str]:
        rows = [
            "| case | sends/s median (min-max) | vs fdatasync loop | sends per flush |",
            "|---|---|---|---|",
        ]
        reference: list[float] = []
        for _ in range(repeat):
            directory = fresh()
            try:
                reference.append(bench_fdatasync_loop(directory, seconds))
            finally:
                shutil.rmtree(directory, ignore_errors=True)
        ref = statistics.median(reference)
        rows.append(f"| REF append + fdatasync, 1 KiB | {_median(reference)} | 1.00 | 1 |")
        prealloc: list[float] = []
        for _ in range(repeat):
            directory = fresh()
            try:
                prealloc.append(bench_fdatasync_preallocated(directory, seconds))
            finally:
                shutil.rmtree(directory, ignore_errors=True)
        rows.append(
            f"| REF pwrite + fdatasync, preallocated file, 1 KiB | {_median(prealloc)} | "
            f"{statistics.median(prealloc) / ref:.2f} | 1 |"
        )
        for threads in (1, 4, 16):
            rates, batches = [], []
            for _ in range(repeat):
                directory = fresh()
                try:
                    rate, batch = bench_sync_sends(directory, threads, seconds)
                finally:
                    shutil.rmtree(directory, ignore_errors=True)
                rates.append(rate)
                batches.append(batch)
            rows.append(
                f'| send, flush="sync", 1 KiB, {threads} thread{"s" if threads > 1 else ""} | '
                f"{_median(rates)} | {statistics.median(rates) / ref:.2f} | "
                f"{statistics.median(batches):.1f} |"
            )
        for mapped in (False, True):
            rates, batches = [], []
            for _ in range(repeat):
                directory = fresh()
                try:
                    rate, batch = bench_group_floor(directory, 16, seconds, mapped=mapped)
                finally:
                    shutil.rmtree(directory, ignore_errors=True)
                rates.append(rate)
                batches.append(batch)
            how = "mmap writes" if mapped else "pwrite"
            rows.append(
                f"| REF least group commit (no store), {how}, 1 KiB, 16 threads | "
                f"{_median(rates)} | {statistics.median(rates) / ref:.2f} | "
                f"{statistics.median(batches):.1f} |"
            )
        # The ceiling: the same 16 threads with no flush at all, bounded by the Python
        # work per send and thread hand-offs under the GIL.
        ceiling = []
        for _ in range(repeat):
            directory = fresh()
            try:
                ceiling.append(bench_sync_sends(directory, 16, seconds, "os")[0])
            finally:
                shutil.rmtree(directory, ignore_errors=True)
        rows.append(
            f'| send, flush="os" (no flush: the CPU ceiling), 1 KiB, 16 threads | '
            f"{_median(ceiling)} | {statistics.median(ceiling) / ref:.2f} | - |"
        )
        return rows

    rows = [] if args.only_recovery else send_rows()
    rows += [
        "",
        "| store size | reopen after SIGKILL, s | messages re-dispatched "
        "| reopen after close, s (median of 5) | same, scanning the ongoing chunk "
        "from its first record (reference) |",
        "|---|---|---|---|---|",
    ]
    for size in sizes:
        directory = fresh()
        try:
            seconds_taken, redispatched = bench_recovery(directory, size)
            clean, from_first = bench_clean_reopen(directory)
            rows.append(
                f"| {size / 2**30:.2f} GiB | {seconds_taken:.3f} | {redispatched:,} "
                f"| {clean:.3f} | {from_first:.3f} |"
            )
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    table = "\n".join(rows)
    print(table)
    if args.markdown:
        args.markdown.write_text(table + "\n")


if __name__ == "__main__":
    main()
