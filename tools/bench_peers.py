"""equeue beside the durable queues and stores Python users pick today, in one run on one disk.

Peers: persistqueue.Queue, persistqueue.SQLiteQueue, litequeue.LiteQueue, diskcache.Deque,
queuelib.FifoDiskQueue, stdlib sqlite3 (WAL) and lmdb, plus a plain buffered append log as the
physical reference. Scenarios: append 1,000,000 x 100 B and 200,000 x 1 KiB without a
per-message fsync; durable 1 KiB appends from 1 and 16 threads; a sequential consume of what
was appended; reopen (+ first read) after a SIGKILL of a 1 GiB store; peak memory of each case.

Every case runs in its own process (this script, re-invoked with ``--case``) in a fresh
directory, repeated; the report gives the median and min-max over the repeats and writes the
peers section of docs/benchmarks.md and the docs/peers*.png charts. Slow peers run fewer
messages (or a smaller store to reopen), and the report says so. ``--smoke`` is a tiny run of
seconds that writes nothing under docs/ unless asked to; ``--from-json`` rewrites the report
and charts from a saved run without measuring.
"""

from __future__ import annotations

import argparse
import compileall
import datetime as dt
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the peers package beside this file

from peers.child import run_case
from peers.meta import ROOT, file_system, load_average, python_build, source_state, versions
from peers.output import load_results, write_report
from peers.runner import Runner, progress
from peers.scenarios import PEER, SCENARIO

DOCS = ROOT / "docs"


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1G, 64M, 4096)")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[match.group(2)]
    return int(float(match.group(1)) * scale)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat: seconds")
    parser.add_argument("--repeat", type=int, help="repeats per case (default 3; smoke 1)")
    parser.add_argument(
        "--dir",
        type=Path,
        default=ROOT / ".bench-scratch",
        help="where the case directories go (default: .bench-scratch in the repository, on "
        "the same disk as the repository); removed afterwards",
    )
    parser.add_argument(
        "--reopen-size",
        type=parse_size,
        default=1 << 30,
        help="bytes of messages in the store that is killed and reopened (default 1G; slow "
        "peers use less)",
    )
    parser.add_argument(
        "--scale", type=float, default=1.0, help="multiply the full run's message counts"
    )
    parser.add_argument("--peers", default=",".join(PEER), help="comma-separated peer keys")
    parser.add_argument(
        "--scenarios", default=",".join(SCENARIO), help="comma-separated scenario keys"
    )
    parser.add_argument(
        "--doc",
        type=Path,
        help="the markdown file whose peers section to "
        "rewrite (default docs/benchmarks.md; none with --smoke)",
    )
    parser.add_argument(
        "--charts",
        type=Path,
        help="where to write the PNG charts (default docs/; none with --smoke)",
    )
    parser.add_argument("--json", type=Path, help="also write every result here")
    parser.add_argument("--case-timeout", type=float, help="seconds per case process")
    parser.add_argument(
        "--jobs", type=int, help="cases run side by side (default 1; smoke 3, timings moot)"
    )
    parser.add_argument(
        "--from-json",
        type=Path,
        metavar="FILE",
        help="measure nothing: write the report and charts from a run saved with --json",
    )
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.case:
        return args
    if args.repeat is None:
        args.repeat = 1 if args.smoke else 3
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    if args.jobs is None:
        args.jobs = 3 if args.smoke else 1
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    if args.case_timeout is None:
        args.case_timeout = 120.0 if args.smoke else 900.0
    args.peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    args.scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [p for p in args.peers if p not in PEER] + [
        s for s in args.scenarios if s not in SCENARIO
    ]
    if unknown:
        parser.error(f"unknown peer or scenario: {', '.join(unknown)}")
    if args.smoke:
        args.reopen_size = min(args.reopen_size, SCENARIO["reopen"].smoke)
    else:
        args.doc = args.doc or DOCS / "benchmarks.md"
        args.charts = args.charts or DOCS
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.case:
        print(json.dumps(run_case(json.loads(args.case))), flush=True)
        return 0
    if args.from_json:
        outcomes, meta = load_results(args.from_json)
        return write_report(args, outcomes, meta)
    args.dir.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="bench-peers-", dir=args.dir))
    load_before = load_average()
    started = time.perf_counter()
    runner = Runner(args, base)
    # The peers come from wheels, whose bytecode pip compiled at install; equeue is an
    # editable install, compiled at its first import unless the environment forbids
    # writing bytecode (PYTHONDONTWRITEBYTECODE, set on this machine). Then every case
    # process compiled it from source: 50 to 100 ms of its reopen time and about 1 MiB
    # of its peak RSS (measured). Compiled here, as pip does.
    compileall.compile_dir(ROOT / "equeue", quiet=1)
    try:
        progress(f"benchmark directory: {base} ({file_system(base)})")
        runner.run()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    meta = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "repeat": args.repeat,
        "smoke": args.smoke,
        "python": platform.python_version(),
        "python_build": python_build(),
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "directory": str(args.dir.resolve()),
        "directory_shown": _shown(args.dir),
        "file_system": file_system(args.dir),
        "source": source_state(),
        "versions": versions(),
        "load_before": load_before,
        "load_after": load_average(),
        "wall_seconds": time.perf_counter() - started,
    }
    return write_report(args, runner.outcomes, meta)


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT)) + "/"
    except ValueError:
        return str(path)


if __name__ == "__main__":
    sys.exit(main())
