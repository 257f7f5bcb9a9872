"""Instructions per `send` and per pulled message under valgrind's callgrind: repeatable
where wall time is not, on a shared machine.

Each case runs twice under ``valgrind --tool=callgrind`` with N and then 2N measured
operations after the same setup; (Ir(2N) - Ir(N)) / N is one operation's cost without
the interpreter's start. ``send-SIZE``: N unbatched ``send`` calls; ``batch-SIZE``: N
messages by ``send_batch`` of 1,000; ``b100-SIZE``: by ``send_batch`` of 100 (the
broker's batch); ``pull-SIZE``: 2N messages stored by ``send_batch``, then N of them
pulled 256 at a time, each batch's bodies listed and the batch kept until the next pull
returns (as tools/bench_peers.py's consume); ``bpull-SIZE``: as pull, 100 at a time with
``max_bytes`` (the broker's pull: its frame limit, each body counted); ``get-SIZE``: as
pull, then N ``get`` by message id. Set EQUEUE_PURE_PYTHON=1 for the Python paths.

``--top K``: also where one operation's instructions go: the K functions whose own
(exclusive) cost grew most from the N run to the 2N run, per operation, and the
inclusive cost of a few named ones (the collector, the decoder, freeing).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CASES = (
    "send-100", "send-1024", "batch-100", "b100-100", "b100-1024", "pull-100", "pull-1024",
    "bpull-100", "get-100",
)  # fmt: skip


def child(case: str, count: int, stored: int, directory: Path) -> None:
    from equeue import MessageStore, StoreConfig
    from equeue.protocol.frames import DEFAULT_MAX_FRAME_BYTES

    op, size = case.split("-")
    body = b"x" * int(size)
    with MessageStore.open(directory, StoreConfig(flush="async")) as store:
        store.create_topic("t", 1)
        if op == "send":
            send = store.send
            for _ in range(count):
                send("t", body)
            return
        if op in ("batch", "b100"):
            step = 1000 if op == "batch" else 100
            for start in range(0, count, step):
                store.send_batch("t", [body] * min(step, count - start))
            return
        sent = []
        for start in range(0, stored, 1000):
            sent += store.send_batch("t", [body] * min(1000, stored - start))
        if op == "get":
            get = store.get
            for result in sent[:count]:
                get(result.message_id)
            return
        del sent
        pull = store.pull
        offset = 0
        step, limit = (100, DEFAULT_MAX_FRAME_BYTES) if op == "bpull" else (256, None)
        while offset < count:  # as bench_peers' consume: a batch lives until the next pull
            batch = pull("t", 0, offset, min(step, count - offset), max_bytes=limit)
            offset = batch.next_offset
            bodies = [m.body for m in batch]
        del batch, bodies


INCLUSIVE = (
    "gcmodule.c:gc_collect_main", "read.c:pull_chunk", "read.c:decode_record",
    "listobject.c:list_dealloc", "message.c:lazy_message", "message.c:message_dealloc",
    "reads.py:pull_run", "tupleobject.c:tupledealloc",
)  # fmt: skip


def annotate(out: Path, inclusive: bool) -> dict[str, int]:
    """Each function's Ir in a callgrind profile, by file basename:function."""
    annotated = subprocess.run(
        ["callgrind_annotate", f"--inclusive={'yes' if inclusive else 'no'}",
         "--threshold=100", "--auto=no", str(out)],
        check=True, capture_output=True, text=True, timeout=600,
    ).stdout  # fmt: skip
    functions: dict[str, int] = {}
    for line in annotated.splitlines():
        row = re.match(r"\s*([\d,]+) \(\s*[\d.]+%\)\s+(\S.*?)(?: \[.*\])?$", line)
        if not row or ":" not in row.group(2):
            continue
        name, level = row.group(2).rsplit("/", 1)[-1], "'" in row.group(2)  # f'2: recursion
        cost = int(row.group(1).replace(",", ""))
        if inclusive and not level:  # (a nested level's inclusive cost is within the outer's)
            functions[name] = max(cost, functions.get(name, 0))
        elif not inclusive:  # every level's own cost is its own
            name = name.split("'")[0]
            functions[name] = functions.get(name, 0) + cost
    return functions


def instructions(case: str, count: int, stored: int) -> tuple[int, dict[str, int]]:
    """The run's total Ir, and each function's own Ir and the inclusive Ir of those
    INCLUSIVE names (keyed "incl NAME")."""
    directory = Path(tempfile.mkdtemp(prefix="eqcg", dir="/tmp"))
    out = directory / "callgrind.out"
    try:
        subprocess.run(
            ["valgrind", "--tool=callgrind", "--dump-instr=no",
             f"--callgrind-out-file={out}", sys.executable,
             __file__, "--child", case, str(count), str(stored), str(directory / "s")],
            check=True, capture_output=True, timeout=1800,
        )  # fmt: skip
        found = re.search(rb"^summary: (\d+)", out.read_bytes(), re.M)
        if found is None:
            raise SystemExit(f"no summary in {out}")
        functions = annotate(out, inclusive=False)
        for name, cost in annotate(out, inclusive=True).items():
            if name.endswith(INCLUSIVE):
                functions["incl " + name] = cost
        return int(found.group(1)), functions
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--child", nargs=4, metavar=("CASE", "N", "STORED", "DIR"))
    parser.add_argument("-n", type=int, default=5_000, help="operations in the short run")
    parser.add_argument("--top", type=int, default=0, help="functions to show per case")
    parser.add_argument("cases", nargs="*", default=list(CASES))
    args = parser.parse_args()
    if args.child:
        case, n, stored, directory = args.child
        child(case, int(n), int(stored), Path(directory))
        return 0
    n, pure = args.n, os.environ.get("EQUEUE_PURE_PYTHON", "")
    print(f"{'case':<10} {'Ir/op':>8}  (EQUEUE_PURE_PYTHON={pure!r}, N={n})")
    for case in args.cases:
        (low, before), (high, after) = (
            instructions(case, n, 2 * n),
            instructions(case, 2 * n, 2 * n),
        )
        print(f"{case:<10} {(high - low) / n:>8.0f}", flush=True)
        grown = sorted(((after[f] - before.get(f, 0)) / n, f) for f in after)
        for per_op, name in reversed(grown[-args.top :] if args.top else []):
            print(f"    {per_op:>8.0f}  {name}")
        for per_op, name in grown if args.top else []:
            if name.startswith("incl "):
                print(f"    {per_op:>8.0f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
