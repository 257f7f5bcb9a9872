"""The compaction job: two passes with Spark, then an atomic commit on the driver.

Pass 1 reads only metadata and decides the removed positions (decide.py): one
Python task per chunk file streams it and settles what it alone can
(retention, expired tombstones); the keyed rows of compacted topics, hashed
by key, cross one shuffle to Python tasks that find each key's newest
position. Only these small rows are shuffled; no record value ever is.

The driver collects one row per chunk (how many records and bytes it would
lose) and plans the replacement files (plan.py). Pass 2 sends each group's
removed positions, sorted, to one task, which streams the group's chunks once
and writes the compacted replacement into the staging directory (rewrite.py).
The driver collects one row per group, checks it against the plan, and
commits (commit.py).
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from itertools import groupby
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from equeue.compaction import commit
from equeue.compaction.plan import Group, Removals, Snapshot, plan_groups, take_snapshot
from equeue.compaction.rewrite import RewriteResult, rewrite_group
from equeue.errors import CompactionError

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame, SparkSession

RESULT_SCHEMA: Final = (
    "file_name string, start_number long, end_number long, version int, bytes_before long, "
    "bytes_after long, records_kept long, records_removed long, worker_rss long"
)

_INT_FIELDS: Final = [f.split()[0] for f in RESULT_SCHEMA.split(", ")[1:]]

Progress = Callable[[str], None]


@dataclass(slots=True)
class CompactionReport:
    store: str
    now: float
    dry_run: bool
    chunks_read: int = 0  # pass 1: every chunk file, the ongoing one included
    bytes_read: int = 0  # their data bytes
    chunks_eligible: int = 0
    groups: list[RewriteResult] = field(default_factory=list)  # planned (dry run) or written
    pass1_seconds: float = 0.0
    pass2_seconds: float = 0.0
    commit_seconds: float = 0.0
    seconds: float = 0.0
    worker_peak_rss: int = 0  # bytes; the largest of the pass-2 Python workers

    @property
    def chunks_rewritten(self) -> int:
        return sum(g.end_number - g.start_number + 1 for g in self.groups)

    @property
    def bytes_before(self) -> int:
        return sum(g.bytes_before for g in self.groups)

    @property
    def bytes_after(self) -> int:
        return sum(g.bytes_after for g in self.groups)

    @property
    def records_kept(self) -> int:
        return sum(g.records_kept for g in self.groups)

    @property
    def records_removed(self) -> int:
        return sum(g.records_removed for g in self.groups)

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for name in (
            "chunks_rewritten",
            "bytes_before",
            "bytes_after",
            "records_kept",
            "records_removed",
        ):
            data[name] = getattr(self, name)
        return data


def compact(
    store: str | Path,
    *,
    spark: SparkSession | None = None,
    master: str | None = None,
    now: float | None = None,
    dry_run: bool = False,
    merge: bool = True,
    progress: Progress | None = None,
) -> CompactionReport:
    """Compact the completed chunks of ``store``; safe beside a running writer and readers.

    ``spark`` is used as given; otherwise a session is made for ``master`` (None:
    what spark-submit set, else ``local[*]``). ``now`` (seconds since the epoch)
    is when retention and tombstone expiry are measured from.
    """
    say = progress or (lambda _: None)
    started = time.monotonic()
    store = Path(store)
    report = CompactionReport(str(store), time.time() if now is None else now, dry_run)
    with commit.job_lock(store):
        for line in commit.recover(store, holding_job_lock=True):
            say(line)
        snapshot = take_snapshot(store)
        report.chunks_read = len(snapshot.chunks)
        report.bytes_read = sum(c.data_end for c in snapshot.chunks)
        report.chunks_eligible = len(snapshot.eligible)
        say(
            f"store {snapshot.store}: {len(snapshot.chunks)} chunk files, "
            f"{report.chunks_eligible} completed and checkpointed (eligible)"
        )
        if not snapshot.eligible:
            say("nothing to do: no eligible chunk")
            report.seconds = time.monotonic() - started
            return report
        if spark is None:
            from equeue.spark import session

            spark = session(master, app_name="equeue-compact")
        else:
            from equeue.spark import register

            register(spark)
        tick = time.monotonic()
        say(
            f"pass 1: reading the metadata of {_mib(report.bytes_read)} "
            f"({len(snapshot.chunks)} chunks)"
        )
        removed = _decide(spark, snapshot, report.now)
        removals = _removals_per_chunk(removed)
        groups = plan_groups(snapshot, removals, merge=merge)
        report.pass1_seconds = time.monotonic() - tick
        say(
            f"pass 1 done in {report.pass1_seconds:.1f} s: "
            f"{sum(r.count for r in removals.values())} records to remove from "
            f"{len(removals)} chunks; {len(groups)} replacement files planned"
        )
        if dry_run or not groups:
            report.groups = [_planned(g) for g in groups]
            removed.unpersist()
            report.seconds = time.monotonic() - started
            return report
        staging = commit.new_staging(store)
        try:
            tick = time.monotonic()
            say(f"pass 2: rewriting {sum(len(g.chunks) for g in groups)} chunks")
            results = _rewrite(spark, removed, groups, staging)
            report.pass2_seconds = time.monotonic() - tick
            report.worker_peak_rss = max(rss for _, rss in results)
            report.groups = [r for r, _ in results]
            _check_against_plan(report.groups, groups)
            say(f"pass 2 done in {report.pass2_seconds:.1f} s")
            tick = time.monotonic()
            read = [Path(c.path).name for g in groups for c in g.chunks]
            commit.install(store, staging, report.groups, read)
            report.commit_seconds = time.monotonic() - tick
            say(
                f"installed {len(report.groups)} replacement files in {report.commit_seconds:.2f} s"
            )
        except BaseException:
            if not (staging / commit.MANIFEST_FILE).exists():
                commit.discard(staging)
            raise
        finally:
            removed.unpersist()
    report.seconds = time.monotonic() - started
    return report


def _decide(spark: SparkSession, snapshot: Snapshot, now: float) -> DataFrame:
    """(chunk, position, size) of every record to remove, persisted: the plan and
    pass 2 both read it. See decide.py for the two steps."""
    from pyspark import StorageLevel

    from equeue.compaction.decide import (
        REMOVED_SCHEMA,
        SCAN_SCHEMA,
        ChunkScan,
        RemovedRows,
        ScanChunk,
        TopicRule,
    )

    now_ns = int(now * 1e9)
    rules = {
        topic: TopicRule(
            compact=policy.compact,
            retention_cutoff=None
            if policy.retention is None
            else now_ns - int(policy.retention.total_seconds() * 1e9),
            tombstone_cutoff=now_ns - int(policy.delete_retention.total_seconds() * 1e9),
        )
        for topic, policy in snapshot.policies.items()
    }
    chunks = [ScanChunk(c.path, c.data_end, c.start_number, c.eligible) for c in snapshot.chunks]
    # Partitions of key hashes small enough for one worker to sort in memory: 32 bytes
    # a row, about _DECIDE_ROWS rows on average (hashing spreads them; fewer where not
    # every record is sent on).
    records = sum(c.record_count for c in snapshot.chunks)
    partitions = max(
        int(spark.conf.get("spark.sql.shuffle.partitions") or 1), -(-records // _DECIDE_ROWS)
    )
    return (
        spark.range(0, len(chunks), 1, len(chunks))
        .mapInArrow(ChunkScan(chunks, rules), SCAN_SCHEMA)
        .repartition(partitions, "hi")
        .mapInArrow(
            RemovedRows(sorted(c.number for c in chunks), snapshot.chunk_data_size), REMOVED_SCHEMA
        )
        .persist(StorageLevel.MEMORY_AND_DISK)
    )


_DECIDE_ROWS: Final = 1 << 20


def _removals_per_chunk(removed: DataFrame) -> dict[int, Removals]:
    from pyspark.sql import functions as F

    rows = removed.groupBy("chunk").agg(F.count("*").alias("n"), F.sum("size").alias("b"))
    return {int(r["chunk"]): Removals(int(r["n"]), int(r["b"])) for r in rows.collect()}


def _rewrite(
    spark: SparkSession, removed: DataFrame, groups: list[Group], staging: Path
) -> list[tuple[RewriteResult, int]]:
    import pyarrow as pa
    from pyspark.sql import functions as F

    # From an Arrow table: the JVM reads it as is, where a Python list would need
    # Python workers just to be pickled over.
    assignment = spark.createDataFrame(
        pa.table(
            {
                "chunk": pa.array([c.start_number for g in groups for c in g.chunks], pa.int64()),
                "grp": pa.array([g.index for g in groups for _ in g.chunks], pa.int32()),
            }
        )
    )
    work = (
        removed.join(F.broadcast(assignment), "chunk")
        .select("grp", "position")
        .repartitionByRange(len(groups), "grp")
        .sortWithinPartitions("grp", "position")
    )
    rows = work.mapInArrow(_rewriter(groups, staging), RESULT_SCHEMA).collect()
    results = []
    for row in rows:
        data = row.asDict()
        rss = int(data.pop("worker_rss"))
        results.append((RewriteResult(**data), rss))
    results.sort(key=lambda r: r[0].start_number)
    return results


def _rewriter(
    groups: list[Group], staging: Path
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The pass-2 task: each group's removed positions arrive sorted, group after group."""
    by_index = {g.index: g for g in groups}

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import pyarrow as pa

        schema = pa.schema(
            [(name, pa.int32() if name == "version" else pa.int64()) for name in _INT_FIELDS]
        ).insert(0, pa.field("file_name", pa.string()))

        def rows() -> Iterator[tuple[int, int]]:
            for batch in batches:
                yield from zip(
                    batch.column(0).to_pylist(), batch.column(1).to_pylist(), strict=True
                )

        for index, positions in groupby(rows(), key=lambda row: row[0]):
            group = by_index[index]
            result = rewrite_group(
                group.open_chunks(), (p for _, p in positions), staging, group.version
            )
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            yield pa.RecordBatch.from_pylist([{**asdict(result), "worker_rss": rss}], schema)

    return run


def _check_against_plan(results: list[RewriteResult], groups: list[Group]) -> None:
    """What the workers wrote must be what pass 1 decided, group by group."""
    planned = {(g.start_number, g.end_number): g for g in groups}
    written = {(r.start_number, r.end_number): r for r in results}
    if planned.keys() != written.keys():
        raise CompactionError(
            f"pass 2 wrote replacements for {sorted(written)}, the plan had {sorted(planned)}"
        )
    for key, result in written.items():
        group = planned[key]
        if (result.records_removed, result.bytes_after) != (group.removed_count, group.bytes_after):
            raise CompactionError(
                f"replacement {result.file_name} removed {result.records_removed} records "
                f"({result.bytes_after} bytes), the plan said {group.removed_count} "
                f"({group.bytes_after} bytes): the chunks changed under the job"
            )


def _planned(group: Group) -> RewriteResult:
    from equeue.format.chunk import chunk_file_name

    return RewriteResult(
        file_name=chunk_file_name(group.start_number, group.version),
        start_number=group.start_number,
        end_number=group.end_number,
        version=group.version,
        bytes_before=group.bytes_before,
        bytes_after=group.bytes_after,
        records_kept=group.kept_count,
        records_removed=group.removed_count,
    )


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"
