"""Benchmark of the chunk engine beside a plain-Python reference, measured in the same run.

For 100 B and 1 KiB records it times, in a fresh directory per repeat:

* ``ChunkWriter.write`` per record (default configuration: 256 MiB chunks, no
  ``sync_flush``), against ``open(path, "ab", buffering=1 MiB)`` with one
  ``f.write(len_prefix + payload)`` per record and a final ``f.flush()``;
* a full ``ChunkReader.iter_from(0)`` scan, against ``open(path, "rb",
  buffering=1 MiB)`` with ``read(4)`` + ``read(n)`` per record;
* ``ChunkReader.read(position)`` at known positions in random order, against
  ``os.pread(fd, 4, offset)`` + ``os.pread(fd, n, offset + 4)``.

Nothing is fsynced per record on either side; both sides leave their bytes in
the page cache. The equeue write time includes creating the chunk file (one
fallocate and two fsyncs). Throughput is records/s and MiB/s of payload bytes
(MiB = 2**20); the ratio is equeue/reference, taken per repeat. The order of
equeue and reference alternates between repeats.

Run ``make bench`` or ``.venv/bin/python tools/bench_chunks.py [--quick]``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import platform
import random
import shutil
import statistics
import struct
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the peers package beside this file

from peers.meta import file_system

from equeue.chunks import ChunkManager, ChunkManagerConfig, ChunkReader, ChunkWriter
from equeue.chunks.prefault import PREFAULTER

MiB = 1 << 20
REFERENCE_BUFFER = MiB
PAYLOAD_POOL = 1024  # distinct random payloads per workload, cycled through the records
SEED = 20240601
PREFIX = struct.Struct("<I")
DASH = "\u2013"  # en dash, for ranges
TIMES = "\u00d7"

OPERATIONS = ("write", "scan", "random read")
EQUEUE_CODE = {
    "write": "ChunkWriter.write",
    "scan": "ChunkReader.iter_from",
    "random read": "ChunkReader.read",
}
REFERENCE_CODE = {
    "write": "f.write(prefix + payload)",
    "scan": "f.read(4) + f.read(n)",
    "random read": "os.pread x 2",
}

WRITE_TARGET = 1_000_000  # records/s, 100 B records, no per-record fsync


@dataclass(frozen=True)
class Workload:
    label: str
    payload_size: int
    records: int
    random_reads: int


FULL = (
    Workload("100 B", 100, 1_000_000, 100_000),
    Workload("1 KiB", 1024, 200_000, 100_000),
)
QUICK = (
    Workload("100 B", 100, 50_000, 10_000),
    Workload("1 KiB", 1024, 10_000, 10_000),
)


@dataclass
class Timings:
    """Seconds per repeat, for one workload, operation and implementation."""

    seconds: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Spread:
    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        return cls(statistics.median(values), min(values), max(values))

    def as_dict(self) -> dict[str, float]:
        return {"median": self.median, "min": self.low, "max": self.high}


@dataclass(frozen=True)
class Row:
    workload: Workload
    operation: str
    count: int  # records handled per repeat
    equeue_rate: Spread  # records/s
    reference_rate: Spread
    equeue_mib: Spread  # MiB/s of payload
    reference_mib: Spread
    ratio: Spread  # equeue/reference, per repeat
    equeue_seconds: list[float]
    reference_seconds: list[float]


# --- measurement -------------------------------------------------------------


def make_records(workload: Workload, rng: random.Random) -> list[bytes]:
    pool = [rng.randbytes(workload.payload_size) for _ in range(PAYLOAD_POOL)]
    return [pool[i % PAYLOAD_POOL] for i in range(workload.records)]


def timed(action: Callable[[], None]) -> float:
    gc.collect()
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def measure_equeue(directory: Path, records: list[bytes], picks: list[int]) -> dict[str, float]:
    manager = ChunkManager(directory / "chunks", ChunkManagerConfig())
    try:
        writer = ChunkWriter(manager)
        reader = ChunkReader(manager)

        def write_all() -> None:
            write = writer.write
            for record in records:
                write(record)

        seen = 0

        def scan_all() -> None:
            nonlocal seen
            count = 0
            for _position, _payload in reader.iter_from(0):
                count += 1
            seen = count

        results = {"write": timed(write_all), "scan": timed(scan_all)}
        if seen != len(records):
            raise RuntimeError(f"equeue scan saw {seen} records, {len(records)} were written")

        positions = [position for position, _ in reader.iter_from(0)]  # untimed
        targets = [positions[i] for i in picks]
        del positions
        for i, position in zip(picks[:100], targets, strict=False):
            if reader.read(position) != records[i]:
                raise RuntimeError(f"equeue read({position}) returned the wrong payload")

        def read_all() -> None:
            read = reader.read
            for position in targets:
                read(position)

        results["random read"] = timed(read_all)
        return results
    finally:
        manager.close()


def measure_reference(directory: Path, records: list[bytes], picks: list[int]) -> dict[str, float]:
    path = directory / "reference.log"
    pack, unpack = PREFIX.pack, PREFIX.unpack

    def write_all() -> None:
        with open(path, "ab", buffering=REFERENCE_BUFFER) as f:
            write = f.write
            for record in records:
                write(pack(len(record)) + record)
            f.flush()

    seen = 0

    def scan_all() -> None:
        nonlocal seen
        count = 0
        with open(path, "rb", buffering=REFERENCE_BUFFER) as f:
            read = f.read
            while True:
                head = read(4)
                if not head:
                    break
                (n,) = unpack(head)
                read(n)
                count += 1
        seen = count

    results = {"write": timed(write_all), "scan": timed(scan_all)}
    if seen != len(records):
        raise RuntimeError(f"reference scan saw {seen} records, {len(records)} were written")

    offsets: list[int] = []  # untimed
    offset = 0
    for record in records:
        offsets.append(offset)
        offset += PREFIX.size + len(record)
    targets = [offsets[i] for i in picks]
    del offsets

    fd = os.open(path, os.O_RDONLY)
    try:

        def read_all() -> None:
            pread = os.pread
            for at in targets:
                (n,) = unpack(pread(fd, 4, at))
                pread(fd, n, at + 4)

        results["random read"] = timed(read_all)
    finally:
        os.close(fd)
    return results


def run_workload(
    base: Path,
    workload: Workload,
    repeat: int,
    rng: random.Random,
    progress: Callable[[str], None],
) -> tuple[dict[str, Timings], dict[str, Timings]]:
    records = make_records(workload, rng)
    equeue = {op: Timings() for op in OPERATIONS}
    reference = {op: Timings() for op in OPERATIONS}
    for index in range(repeat):
        picks = rng.sample(range(workload.records), workload.random_reads)
        equeue_first = index % 2 == 0
        order = ("equeue", "reference") if equeue_first else ("reference", "equeue")
        for which in order:
            run_dir = Path(tempfile.mkdtemp(prefix=f"{which}-{index}-", dir=base))
            try:
                if which == "equeue":
                    got = measure_equeue(run_dir, records, picks)
                    into = equeue
                else:
                    got = measure_reference(run_dir, records, picks)
                    into = reference
            finally:
                shutil.rmtree(run_dir)
            for op, seconds in got.items():
                into[op].seconds.append(seconds)
        progress(
            f"  {workload.label} repeat {index + 1}/{repeat}: "
            + "; ".join(
                f"{op} {rate(workload, op, equeue[op].seconds[-1]):,.0f}"
                f" vs {rate(workload, op, reference[op].seconds[-1]):,.0f} rec/s"
                for op in OPERATIONS
            )
        )
    return equeue, reference


def count_of(workload: Workload, operation: str) -> int:
    return workload.random_reads if operation == "random read" else workload.records


def rate(workload: Workload, operation: str, seconds: float) -> float:
    return count_of(workload, operation) / seconds


def summarize(
    workload: Workload, equeue: dict[str, Timings], reference: dict[str, Timings]
) -> list[Row]:
    rows = []
    for op in OPERATIONS:
        count = count_of(workload, op)
        mib = count * workload.payload_size / MiB
        eq_s, ref_s = equeue[op].seconds, reference[op].seconds
        rows.append(
            Row(
                workload=workload,
                operation=op,
                count=count,
                equeue_rate=Spread.of([count / s for s in eq_s]),
                reference_rate=Spread.of([count / s for s in ref_s]),
                equeue_mib=Spread.of([mib / s for s in eq_s]),
                reference_mib=Spread.of([mib / s for s in ref_s]),
                ratio=Spread.of([r / e for e, r in zip(eq_s, ref_s, strict=True)]),
                equeue_seconds=list(eq_s),
                reference_seconds=list(ref_s),
            )
        )
    return rows


# --- targets and environment ---------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    target: str
    met: bool
    detail: str


def verdicts(rows: list[Row]) -> list[Verdict]:
    found: list[Verdict] = []
    by_key = {(row.workload.label, row.operation): row for row in rows}
    small = by_key.get(("100 B", "write"))
    if small is not None:
        median = small.equeue_rate.median
        found.append(
            Verdict(
                f">= {WRITE_TARGET:,} records/s for 100 B writes without per-record fsync",
                median >= WRITE_TARGET,
                f"median {median:,.0f} records/s ({median / WRITE_TARGET:.0%} of the target)",
            )
        )
    for label in dict.fromkeys(row.workload.label for row in rows):
        write, scan = by_key.get((label, "write")), by_key.get((label, "scan"))
        if write is None or scan is None:
            continue
        w, s = write.equeue_rate.median, scan.equeue_rate.median
        found.append(
            Verdict(
                f"reading ({label} scan) at least as fast as writing",
                s >= w,
                f"scan {s:,.0f} vs write {w:,.0f} records/s (scan/write {s / w:.2f})",
            )
        )
    return found


def python_build() -> str:
    """Whether this interpreter was built with PGO/LTO: absolute figures depend on it."""
    args = str(sysconfig.get_config_var("CONFIG_ARGS") or "")
    parts = [
        "PGO" if "--enable-optimizations" in args else "no PGO",
        "LTO" if "--with-lto" in args else "no LTO",
    ]
    if "--enable-shared" in args:
        parts.append("shared libpython")
    return ", ".join(parts)


def source_state() -> str:
    """The commit measured, and which files under equeue/ differ from it (if git can tell)."""
    import equeue

    package = Path(equeue.__file__).resolve().parent
    try:

        def git(*args: str) -> str:
            return subprocess.run(
                ["git", *args], cwd=package, capture_output=True, text=True, check=True, timeout=10
            ).stdout.rstrip("\n")

        commit = git("rev-parse", "--short", "HEAD")
        changed = git("status", "--porcelain", "--", ".").splitlines()
    except (OSError, subprocess.SubprocessError):
        return f"{package} (not a git checkout)"
    if not changed:
        return f"{commit}, equeue/ unmodified"
    names = ", ".join(sorted(line[3:] for line in changed))
    return f"{commit} + uncommitted changes in {names}"


def load_average() -> tuple[float, float, float]:
    try:
        return os.getloadavg()
    except OSError:
        return (float("nan"),) * 3


# --- output --------------------------------------------------------------------


def fmt_rate(value: float) -> str:
    return f"{value:,.0f}"


def fmt_mib(value: float) -> str:
    return f"{value:,.1f}"


def fmt_spread(spread: Spread, fmt: Callable[[float], str]) -> str:
    return f"{fmt(spread.median)} ({fmt(spread.low)}{DASH}{fmt(spread.high)})"


def fmt_ratio(value: float) -> str:
    return f"{value:.2f}"


HEADERS = (
    "Records",
    "Operation",
    "Code",
    "records/s",
    "MiB/s",
    "equeue / reference",
)


def table_rows(rows: list[Row]) -> list[tuple[str, ...]]:
    lines: list[tuple[str, ...]] = []
    for row in rows:
        what = f"{row.count:,} {TIMES} {row.workload.label}"
        lines.append(
            (
                what,
                row.operation,
                f"equeue: {EQUEUE_CODE[row.operation]}",
                fmt_spread(row.equeue_rate, fmt_rate),
                fmt_spread(row.equeue_mib, fmt_mib),
                fmt_spread(row.ratio, fmt_ratio),
            )
        )
        lines.append(
            (
                "",
                "",
                f"reference: {REFERENCE_CODE[row.operation]}",
                fmt_spread(row.reference_rate, fmt_rate),
                fmt_spread(row.reference_mib, fmt_mib),
                "",
            )
        )
    return lines


def text_table(rows: list[Row]) -> str:
    lines = [HEADERS, *table_rows(rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(HEADERS))]
    numeric = {3, 4, 5}

    def render(line: tuple[str, ...]) -> str:
        cells = [
            cell.rjust(widths[i]) if i in numeric else cell.ljust(widths[i])
            for i, cell in enumerate(line)
        ]
        return "  ".join(cells).rstrip()

    out = [render(HEADERS), "  ".join("-" * w for w in widths)]
    out.extend(render(line) for line in lines[1:])
    return "\n".join(out)


def markdown_table(rows: list[Row]) -> str:
    def render(line: tuple[str, ...]) -> str:
        return "| " + " | ".join(cell.replace("|", "\\|") for cell in line) + " |"

    out = [render(HEADERS), "|" + "|".join(("---", "---", "---", "--:", "--:", "--:")) + "|"]
    out.extend(render(line) for line in table_rows(rows))
    return "\n".join(out)


def describe(meta: dict[str, Any]) -> list[str]:
    before, after = meta["load_average_before"], meta["load_average_after"]
    return [
        f"Run: {meta['date']}, {meta['repeat']} repeat(s){' (--quick)' if meta['quick'] else ''}"
        f", Python {meta['python']} ({meta['python_build']}), {meta['cpus']} CPUs"
        f", Linux {meta['kernel']}",
        f"Directory: {meta['directory']} on {meta['file_system']}",
        f"Source: {meta['source']}",
        "Load average (1/5/15 min): before "
        + "/".join(f"{x:.2f}" for x in before)
        + ", after "
        + "/".join(f"{x:.2f}" for x in after),
        "Background prefaulter (MADV_POPULATE_WRITE): "
        + ("enabled" if meta["prefault_enabled"] else "disabled")
        + f" (at start: {'enabled' if meta['prefault_enabled_at_start'] else 'disabled'})",
        f"Wall time: {meta['wall_seconds']:.1f} s",
    ]


def markdown_report(rows: list[Row], found: list[Verdict], meta: dict[str, Any]) -> str:
    lines = [f"- {line}" for line in describe(meta)]
    lines += [
        "",
        f"records/s and MiB/s (payload bytes): median (min{DASH}max) over the repeats; "
        f"equeue / reference: median (min{DASH}max) of the per-repeat ratio.",
        "",
        markdown_table(rows),
        "",
        "Targets:",
        "",
    ]
    lines += [f"- {v.target}: **{'met' if v.met else 'not met'}** — {v.detail}" for v in found]
    return "\n".join(lines) + "\n"


def text_report(rows: list[Row], found: list[Verdict], meta: dict[str, Any]) -> str:
    lines = describe(meta)
    lines += [
        "",
        f"records/s and MiB/s (payload bytes): median (min{DASH}max); "
        f"equeue / reference: median (min{DASH}max) of per-repeat ratios",
        "",
        text_table(rows),
        "",
    ]
    lines += [f"{'MET    ' if v.met else 'NOT MET'}  {v.target}: {v.detail}" for v in found]
    return "\n".join(lines)


def json_report(rows: list[Row], found: list[Verdict], meta: dict[str, Any]) -> str:
    data = {
        "meta": meta,
        "results": [
            {
                "records": row.workload.label,
                "payload_size": row.workload.payload_size,
                "operation": row.operation,
                "count": row.count,
                "equeue_code": EQUEUE_CODE[row.operation],
                "reference_code": REFERENCE_CODE[row.operation],
                "equeue_records_per_s": row.equeue_rate.as_dict(),
                "reference_records_per_s": row.reference_rate.as_dict(),
                "equeue_mib_per_s": row.equeue_mib.as_dict(),
                "reference_mib_per_s": row.reference_mib.as_dict(),
                "ratio": row.ratio.as_dict(),
                "equeue_seconds": row.equeue_seconds,
                "reference_seconds": row.reference_seconds,
            }
            for row in rows
        ],
        "targets": [{"target": v.target, "met": v.met, "detail": v.detail} for v in found],
    }
    return json.dumps(data, indent=2)


# --- main ------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="where to create the temporary benchmark directory (default: the current "
        "directory; keep it on the file system you care about, e.g. not a tmpfs /tmp)",
    )
    parser.add_argument("--repeat", type=int, default=None, help="repeats per case (default 5)")
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes and 1 repeat: a smoke run of seconds"
    )
    parser.add_argument("--markdown", type=Path, metavar="FILE", help="write the results here")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = parser.parse_args(argv)
    if args.repeat is None:
        args.repeat = 1 if args.quick else 5
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    workloads = QUICK if args.quick else FULL
    parent: Path = (args.dir or Path.cwd()).resolve()
    parent.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix=".bench-chunks-", dir=parent))

    def progress(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    prefault_at_start = PREFAULTER.enabled
    source = source_state()
    load_before = load_average()
    started = time.perf_counter()
    rng = random.Random(SEED)
    rows: list[Row] = []
    try:
        progress(f"benchmark directory: {base} ({file_system(base)})")
        for workload in workloads:
            progress(f"{workload.label} records: {workload.records:,} x {args.repeat} repeat(s)")
            equeue, reference = run_workload(base, workload, args.repeat, rng, progress)
            rows.extend(summarize(workload, equeue, reference))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    meta: dict[str, Any] = {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "quick": args.quick,
        "repeat": args.repeat,
        "python": platform.python_version(),
        "python_build": python_build(),
        "source": source,
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "directory": str(parent),
        "file_system": file_system(parent),
        "load_average_before": list(load_before),
        "load_average_after": list(load_average()),
        "prefault_enabled": PREFAULTER.enabled,
        "prefault_enabled_at_start": prefault_at_start,
        "wall_seconds": time.perf_counter() - started,
        "chunk_data_size": ChunkManagerConfig().chunk_data_size,
        "reference_buffer": REFERENCE_BUFFER,
    }
    found = verdicts(rows)
    if args.json:
        print(json_report(rows, found, meta))
    else:
        print(text_report(rows, found, meta))
    if args.markdown is not None:
        args.markdown.write_text(markdown_report(rows, found, meta), encoding="utf-8")
        progress(f"wrote {args.markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
