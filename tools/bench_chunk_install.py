"""A roll-over's chunk creation on the writer's thread, in-process: ``time.perf_counter``
and ``time.thread_time`` around ``ChunkManager.add_new_chunk`` while a ``ChunkWriter``
writes 1 KiB records into ``--chunk-bytes`` chunks, ``--rollovers`` times (the first
chunk, which has nothing made ahead, not counted). Works on a tree with or without the
next chunk made ahead (equeue/chunks/ahead.py: ``make_ahead`` set where the config has
it), so that two trees can be compared by running it under each one's PYTHONPATH.

    PYTHONPATH=TREE python tools/bench_chunk_install.py --chunk-bytes 4194304
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from typing import Any

from equeue.chunks.chunk import Chunk
from equeue.chunks.config import ChunkManagerConfig
from equeue.chunks.manager import ChunkManager
from equeue.chunks.writer import ChunkWriter

RECORD = b"x" * 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunk-bytes", type=int, default=4 << 20)
    parser.add_argument("--rollovers", type=int, default=30)
    args = parser.parse_args()
    fields = {f.name for f in dataclasses.fields(ChunkManagerConfig)}
    ahead = "make_ahead" in fields
    extra: dict[str, Any] = {"make_ahead": True} if ahead else {}
    walls: list[float] = []
    cpus: list[float] = []
    create = ChunkManager.add_new_chunk

    def timed(self: ChunkManager, **kwargs: Any) -> Chunk:
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return create(self, **kwargs)
        finally:
            walls.append((time.perf_counter() - wall) * 1e3)
            cpus.append((time.thread_time() - cpu) * 1e3)

    ChunkManager.add_new_chunk = timed  # type: ignore[method-assign]
    with tempfile.TemporaryDirectory(prefix="chunk-install-") as scratch:
        manager = ChunkManager(
            scratch, ChunkManagerConfig(chunk_data_size=args.chunk_bytes, **extra)
        )
        writer = ChunkWriter(manager)
        while len(walls) <= args.rollovers:
            writer.write(RECORD)
        manager.close()
    walls, cpus = walls[1:], cpus[1:]
    print(
        f"{'made ahead' if ahead else 'created'}: {len(walls)} roll-overs, wall median "
        f"{statistics.median(walls):.3f} max {max(walls):.3f} ms, CPU median "
        f"{statistics.median(cpus):.3f} max {max(cpus):.3f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
