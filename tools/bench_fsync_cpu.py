"""CPU per fdatasync of a file written like a log chunk, by how the window ahead of the
writer is faulted in (issue 23: which populate mode costs the broker's flusher least).

A file fallocated (unwritten extents, as a chunk) and mapped, ``MADV_RANDOM`` as
Chunk.open_for_write sets; each round writes ``--bytes`` in 100 B records through the
mapping, then fdatasyncs. Per round: the fdatasync's thread CPU, the writer's (its page
faults), the populate calls' (``MADV_WILLNEED`` then the mode's advice on a 512 KiB window
every half window, as equeue/cext/prefault.c does), the kernel workers' run time (the
ext4 extent conversion and writeback; anyone's on the machine), and the device's KiB
written (/sys/block/DEV/stat). Modes: ``write`` (MADV_POPULATE_WRITE, the store's),
``read`` (MADV_POPULATE_READ), ``none``, and ``zread``/``zwrite`` (the file zero-written a
page per pwrite and synced beforehand, its CPU per round's share counted). ``--zap``: the
CPU of a madvise(MADV_DONTNEED) from the start to a window behind after every round (what
the broker's log_synced did before round 9).
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_broker_kern import kernel_threads, sectors_written

WINDOW = 512 << 10
PAGE = 4096
RECORD = b"x" * 100
MADV_POPULATE_READ, MADV_POPULATE_WRITE = 22, 23


def run(mode: str, rounds: int, size: int, directory: Path, zap: bool) -> str:
    length = rounds * size + (4 << 20)
    path = directory / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    zeroing = 0.0
    try:
        os.ftruncate(fd, length)
        if mode.startswith("z"):
            workers, began = kernel_threads(), time.thread_time()
            zeros = bytes(PAGE)
            for offset in range(0, length, PAGE):  # a page a pwrite: 4 KiB folios (round 8)
                os.pwrite(fd, zeros, offset)
                if offset % (1 << 20) == 0:
                    os.fdatasync(fd)
            os.fdatasync(fd)
            zeroing = time.thread_time() - began + kernel_threads() - workers
            os.posix_fadvise(fd, 0, length, os.POSIX_FADV_DONTNEED)
        else:
            os.posix_fallocate(fd, 0, length)
        os.fsync(fd)
        advice = {"write": MADV_POPULATE_WRITE, "zwrite": MADV_POPULATE_WRITE}.get(
            mode, MADV_POPULATE_READ
        )
        with mmap.mmap(fd, length) as mm:
            mm.madvise(mmap.MADV_RANDOM)
            offset, mark = 0, -1
            populate = write = sync = zapped = 0.0
            workers, sectors = kernel_threads(), sectors_written(directory)
            for _ in range(rounds):
                if mode != "none" and offset > mark:
                    start = offset // PAGE * PAGE
                    began = time.thread_time()
                    mm.madvise(mmap.MADV_WILLNEED, start, WINDOW)
                    mm.madvise(advice, start, WINDOW)
                    populate += time.thread_time() - began
                    mark = offset + WINDOW // 2
                began = time.thread_time()
                for _ in range(size // len(RECORD)):
                    mm[offset : offset + len(RECORD)] = RECORD
                    offset += len(RECORD)
                write += time.thread_time() - began
                began = time.thread_time()
                os.fdatasync(fd)
                sync += time.thread_time() - began
                stop = (offset - WINDOW) // PAGE * PAGE
                if zap and stop > 0:
                    began = time.thread_time()
                    mm.madvise(mmap.MADV_DONTNEED, 0, stop)
                    zapped += time.thread_time() - began
            workers = kernel_threads() - workers
            written = (sectors_written(directory) - sectors) / 2 / rounds
    finally:
        os.close(fd)
        path.unlink()
    per = 1e6 / rounds
    share = zeroing * size / length * 1e6
    total = (sync + write + populate + workers) * per + share
    return (
        f"{mode:6s} a flush of {size} B: fdatasync {sync * per:5.1f} µs, "
        f"writer {write * per:5.1f}, populate {populate * per:4.1f}, "
        f"kernel workers {workers * per:5.1f}, zeroing {share:4.1f}"
        f", sum {total:6.1f}; {written:.1f} KiB written"
        + (f"; madvise(DONTNEED) {zapped * per:.2f} µs" if zap else "")
        + f" (load {os.getloadavg()[0]:.1f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modes", nargs="*", default=["write", "read", "none"])
    parser.add_argument("--rounds", type=int, default=1500, help="fdatasyncs a run")
    parser.add_argument("--bytes", type=int, default=6400, help="written a round")
    parser.add_argument("--repeat", type=int, default=2, help="alternations")
    parser.add_argument("--dir", type=Path, help="where the file goes (default: /tmp)")
    parser.add_argument("--zap", action="store_true", help="madvise(DONTNEED) after each")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="eqfs", dir=options.dir or "/tmp") as scratch:
        for _ in range(options.repeat):
            for mode in options.modes:
                print(run(mode, options.rounds, options.bytes, Path(scratch), options.zap))


if __name__ == "__main__":
    main()
