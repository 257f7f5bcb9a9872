"""What the compaction job's preflight (equeue/spark/preflight.py) costs: the job on copies
of one store, with the preflight and with it replaced by a stub, alternating A/B in one
warm local session (the machine is shared and noisy: compare medians of the same run),
and the preflight job alone.

    python tools/bench_preflight.py [--master 'local[2]'] [--rounds 5] [--messages 20000]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from equeue import MessageStore, StoreConfig
from equeue.compaction.job import compact
from equeue.spark import session
from equeue.spark.preflight import ExecutorReport, preflight


def build(path: Path, messages: int) -> None:
    rng = random.Random(1)
    with MessageStore.open(path, StoreConfig(chunk_data_size=1 << 20, flush="os")) as store:
        store.create_topic("k", 4, cleanup="compact")
        for _ in range(messages):
            store.send("k", os.urandom(rng.randrange(50, 400)), key=f"key-{rng.randrange(2000)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--messages", type=int, default=20_000)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-preflight-"))
    try:
        build(work / "template", args.messages)
        spark = session(args.master, app_name="bench-preflight", quiet=True)
        spark.sparkContext.setLogLevel("ERROR")
        module: Any = sys.modules["equeue.spark.preflight"]  # the module, not the function
        real = module.preflight
        stub = [ExecutorReport("stub", "3", None, False, None, None, None)]
        compact(shutil.copytree(work / "template", work / "warm"), spark=spark, now=time.time())
        timings: dict[str, list[float]] = {"with preflight": [], "stub": [], "preflight alone": []}
        for i in range(args.rounds):
            for name in ("with preflight", "stub") if i % 2 == 0 else ("stub", "with preflight"):
                module.preflight = real if name == "with preflight" else (lambda *a, **k: stub)
                copy = shutil.copytree(work / "template", work / f"{name}-{i}")
                tick = time.perf_counter()
                compact(copy, spark=spark, now=time.time())
                timings[name].append(time.perf_counter() - tick)
            module.preflight = real
            tick = time.perf_counter()
            preflight(spark, work / "template", write_dir=str(work / "template"))
            timings["preflight alone"].append(time.perf_counter() - tick)
        size = sum(f.stat().st_size for f in (work / "template" / "messages").iterdir())
        print(f"store: {args.messages} messages, {size / (1 << 20):.1f} MiB; {args.master}")
        for name, values in timings.items():
            runs = ", ".join(f"{v:.2f}" for v in values)
            print(f"{name:>16}: median {statistics.median(values):.2f} s ({runs})")
        spark.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
