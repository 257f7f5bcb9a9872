"""The broker (`equeue serve`) against Redis Streams and the in-process store, in one run.

Cases (issue 23's "Benchmarks"), each a fixed count of messages with a time cap:
producers (1, 4, 16 processes over the Unix socket; 100 B and 1 KiB; batched and unbatched),
consumer-group consumption (1 and 4 consumer processes), send round trip (one request at a
time: p50/p99), durable sends (64 concurrent asyncio producers: ``--flush sync`` against
Redis with ``appendfsync always`` and against an append + fdatasync loop). The systems of a
case run one after the other, their order reversed on every other repeat, because the
machine is shared and noisy: compare within a case, not across runs.

redis-server comes from the system packages (``make bench`` installs it where it can); the
Redis rows are skipped with a note where it is missing. ``--quick`` is a smoke run of
seconds; ``--markdown FILE`` writes the report's tables (``-``: standard output);
``--json FILE`` every run's figures; ``--profile`` samples the broker with py-spy under the
unbatched load and says where its time goes.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # brokerbench beside this file

from brokerbench import report, servers
from brokerbench.cases import BATCH, WINDOW, Bench
from peers.meta import file_system, source_state

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny counts, one repeat")
    parser.add_argument("--repeat", type=int, help="runs per system and case (default 2)")
    parser.add_argument("--cap", type=float, default=5.0, help="seconds per run at most (5)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the message counts")
    parser.add_argument("--durable-producers", type=int, default=64)
    parser.add_argument(
        "--durable-procs",
        type=int,
        default=4,
        help="the durable case also runs its producers spread over this many processes "
        "(besides all in one)",
    )
    parser.add_argument(
        "--sections",
        default="produce,consume,latency,durable",
        help="comma-separated: produce, consume, latency, durable",
    )
    parser.add_argument(
        "--event-loop",
        choices=("auto", "uvloop", "asyncio"),
        help="the broker's --event-loop (default: none given, the broker's own default)",
    )
    parser.add_argument(
        "--group-commit-wait-us",
        type=int,
        help="the --flush sync broker's --group-commit-wait-us (default: its own, 500)",
    )
    parser.add_argument(
        "--group-commit-overlap",
        type=int,
        help="the --flush sync broker's --group-commit-overlap (default: its own, 0: off)",
    )
    parser.add_argument(
        "--busy-poll-us",
        type=int,
        help="the --flush sync broker's --busy-poll-us (default: its own, 0: off)",
    )
    parser.add_argument(
        "--client-loop",
        choices=("uvloop", "asyncio"),
        default="asyncio",
        help="the event loop of the asyncio producers, ours and redis-py's (default asyncio)",
    )
    parser.add_argument("--profile", action="store_true", help="py-spy the broker (unbatched)")
    parser.add_argument(
        "--dir",
        type=Path,
        default=ROOT / ".bench-scratch",
        help="where the stores and sockets go (default .bench-scratch: the repository's disk)",
    )
    parser.add_argument("--markdown", metavar="FILE", help="write the tables here (- : stdout)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write every run here")
    args = parser.parse_args(argv)
    if args.repeat is None:
        args.repeat = 1 if args.quick else 2
    if args.repeat < 1 or args.cap <= 0 or args.durable_procs < 1:
        parser.error("--repeat, --cap and --durable-procs must be positive")
    if args.durable_producers % args.durable_procs:
        parser.error("--durable-producers must be a multiple of --durable-procs")
    args.sections = {s.strip() for s in args.sections.split(",") if s.strip()}
    unknown = args.sections - {"produce", "consume", "latency", "durable"}
    if unknown:
        parser.error(f"unknown section: {', '.join(sorted(unknown))}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    # Short: a Unix socket's path is limited to 107 bytes.
    base = Path(tempfile.mkdtemp(prefix="bb-", dir=args.dir))
    load_before = os.getloadavg()
    started = time.perf_counter()
    bench = Bench(args, base)
    try:
        report.progress(f"benchmark directory: {base}")
        bench.run()
    finally:
        bench.close()
        shutil.rmtree(base, ignore_errors=True)
    meta = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "quick": args.quick,
        "repeat": args.repeat,
        "cap": args.cap,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "file_system": file_system(args.dir),
        "redis": servers.redis_version(),
        "redis_py": servers.redis_py_version(),
        "source": source_state(),
        "batch": BATCH,
        "window": WINDOW,
        "event_loop": args.event_loop or "default (--event-loop not given)",
        "client_loop": args.client_loop,
        "group_commit_wait_us": args.group_commit_wait_us,
        "group_commit_overlap": args.group_commit_overlap,
        "busy_poll_us": args.busy_poll_us,
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "wall_seconds": time.perf_counter() - started,
        "notes": bench.notes,
    }
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "runs": bench.runs}, indent=1))
    text = report.markdown(meta, bench.runs)
    if args.markdown == "-":
        print(text)
    elif args.markdown:
        Path(args.markdown).write_text(text)
    print(report.summary(bench.runs), file=sys.stderr)
    failed = [r for r in bench.runs if "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
