"""The compaction job: two passes with Spark, then an atomic commit on the driver.

Pass 1 reads only metadata and decides the removed positions (decide.py): one
Python task per chunk file streams it and settles what it alone can
(retention, expired tombstones); the keyed rows of compacted topics, hashed
by key, cross one shuffle to Python tasks that find each key's newest
position, and the positions that go cross a second one to a partition per
chunk file. Only these small rows are shuffled; no record value ever is.

The driver reads a last partition of a few rows per chunk (how many records
and bytes it would lose) and plans the replacement files (plan.py). Pass 2
runs one task per rewritten chunk on that chunk's partition (the shuffle's
files are kept between the jobs: pass 1 is not run again), streams the chunk
once and writes its survivors into the staging directory (rewrite.py): a
replacement of one chunk whole, a merged one in the regions the plan gives
each of its chunks, which the driver then finishes (header, footer,
checksum). The driver checks each replacement against the plan, and commits
(commit.py).
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from equeue.chunks.opening import retention_took
from equeue.chunks.stream import ChunkFile
from equeue.compaction import commit
from equeue.compaction.plan import (
    ConditionalTombstone,
    Group,
    Removals,
    Snapshot,
    plan_groups,
    settle_tombstones,
    take_snapshot,
    tombstone_needs,
)
from equeue.compaction.rewrite import (
    Part,
    PartResult,
    RewriteResult,
    finish_merged,
    rewrite_group,
    write_part,
)
from equeue.errors import CompactionError
from equeue.format.chunk import (
    HEADER_SIZE,
    MAP_ENTRY_SIZE,
    ChunkHeader,
    ChunkType,
    chunk_file_name,
)
from equeue.protocol.retries import is_internal_topic
from equeue.safepath import open_file
from equeue.store.meta import MESSAGES_DIR

if TYPE_CHECKING:
    from pyspark import RDD
    from pyspark.sql import SparkSession

    from equeue.compaction.decide import ChunkScan

Progress = Callable[[str], None]


@dataclass(slots=True)
class CompactionReport:
    store: str
    now: float
    dry_run: bool
    chunks_read: int = 0  # pass 1: every chunk file, the ongoing one included
    bytes_read: int = 0  # their data bytes
    chunks_eligible: int = 0
    groups: list[RewriteResult] = field(default_factory=list)  # planned (dry run) or installed
    # Chunk files retention removed while the job ran, and the replacements it then did not
    # install (commit.installable): their own chunks, or ones they needed, are gone.
    retention_removed: list[str] = field(default_factory=list)
    dropped: list[RewriteResult] = field(default_factory=list)
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
    quiet: bool = False,
    config: dict[str, str] | None = None,
    py_files: list[str] | None = None,
    ship_equeue: bool = False,
) -> CompactionReport:
    """Compact the completed chunks of ``store``; safe beside a running writer and readers.

    ``spark`` is used as given; otherwise a session is made for ``master`` (None:
    what spark-submit set, else ``local[*]``; ``quiet``: its JVM's output out of sight,
    ``config``: Spark settings; see equeue.spark.session). ``py_files`` (.py, .zip,
    .egg) are added to the executors' Python path, and with ``ship_equeue`` a zip of
    this equeue package (see equeue.spark.preflight.ship_equeue). Before pass 1 a
    preflight checks that the executors import equeue, run the driver's Python minor
    version, see the store and can write its compaction/ directory (SparkClusterError
    otherwise). ``now`` (seconds since the epoch) is when retention and tombstone expiry
    are measured from.
    """
    say = progress or (lambda _: None)
    started = time.monotonic()
    # Absolute once, here: every path the tasks get is made from it, and executors run
    # in other working directories. Not resolved (symlinks kept): the path the user gave
    # is the one every node mounts.
    store = Path(os.path.abspath(store))
    report = CompactionReport(str(store), time.time() if now is None else now, dry_run)
    # A dry run creates and changes nothing in the store, lock files included: it only
    # reads, like any read-only open, and leaves an interrupted install to the next job.
    with contextlib.nullcontext() if dry_run else commit.job_lock(store):
        for line in [] if dry_run else commit.recover(store, holding_job_lock=True):
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

            if ship_equeue:
                # A local master's workers are forked by equeue's daemon (see session),
                # which would import equeue before the zip reaches their path (with each
                # task); pyspark's own daemon needs none.
                config = {"spark.python.daemon.module": "pyspark.daemon", **(config or {})}
            spark = session(master, app_name="equeue-compact", config=config, quiet=quiet)
        else:
            from equeue.spark import register

            register(spark)
        _ship(spark, py_files or [], ship_equeue, say)
        from equeue.spark.preflight import preflight, summary

        # A dry run writes nothing, so it needs no write access.
        where = None if dry_run else str(commit.compaction_dir(store))
        say(f"preflight: {summary(preflight(spark, store, write_dir=where))}")
        tick = time.monotonic()
        say(
            f"pass 1: reading the metadata of {_mib(report.bytes_read)} "
            f"({len(snapshot.chunks)} chunks)"
        )
        removed = _decide(spark, snapshot, report.now)
        with _unless_chunks_removed(snapshot):
            settled, tombstones = _removals_per_chunk(spark, removed, len(snapshot.chunks))
        # Retention removes the oldest chunks first: what pass 1 decided for the others
        # holds without them (commit.installable), as for a job that never saw them.
        gone = _gone_by_retention(snapshot)
        if gone:
            say(f"retention removed {commit.file_names(sorted(gone))} during pass 1: left out")
        planned = _without(snapshot, gone)
        removals, kept = settle_tombstones(planned, settled, tombstones, frozenset(gone.values()))
        groups = plan_groups(planned, removals, merge=merge)
        needs = tombstone_needs(planned, tombstones, kept)
        report.pass1_seconds = time.monotonic() - tick
        say(
            f"pass 1 done in {report.pass1_seconds:.1f} s: "
            f"{sum(r.count for r in removals.values())} records to remove from "
            f"{len(removals)} chunks; {len(groups)} replacement files planned"
        )
        report.retention_removed = sorted(gone)
        if dry_run or not groups:
            report.groups = [_planned(g) for g in groups]
            report.seconds = time.monotonic() - started
            return report
        staging = commit.new_staging(store)
        try:
            tick = time.monotonic()
            say(f"pass 2: rewriting {sum(len(g.chunks) for g in groups)} chunks")
            with _unless_chunks_removed(snapshot):
                results, lost = _rewrite(spark, removed, snapshot, groups, staging, kept)
            report.pass2_seconds = time.monotonic() - tick
            report.worker_peak_rss = max((rss for _, _, rss in results), default=0)
            _check_against_plan([r for _, r, _ in results], [g for g, _, _ in results])
            say(f"pass 2 done in {report.pass2_seconds:.1f} s")
            tick = time.monotonic()
            gone.update(_gone_by_retention(snapshot))  # a task's report, checked here
            names = {c.start_number: Path(c.path).name for c in snapshot.chunks}
            outcome = commit.install(
                store,
                staging,
                [result for _, result, _ in results],
                [Path(c.path).name for group, _, _ in results for c in group.chunks],
                [_needs(group, needs, names) for group, _, _ in results],
                sorted(gone),
            )
            report.commit_seconds = time.monotonic() - tick
            report.groups = outcome.installed
            report.dropped = [_planned(g) for g in lost] + outcome.dropped
            report.retention_removed = outcome.gone
            if report.dropped:
                say(
                    f"retention removed {commit.file_names(outcome.gone)} while the job ran: "
                    f"{commit.file_names([r.file_name for r in report.dropped], 'replacement')}"
                    " not installed"
                )
            say(
                f"installed {len(report.groups)} replacement files in {report.commit_seconds:.2f} s"
            )
        except BaseException:
            if not (staging / commit.MANIFEST_FILE).exists():
                commit.discard(staging)
            raise
    report.seconds = time.monotonic() - started
    return report


@contextlib.contextmanager
def _unless_chunks_removed(snapshot: Snapshot) -> Iterator[None]:
    """A task that finds its chunk file gone other than by retention (which it reports)
    fails with a FileNotFoundError buried in a worker's traceback, which Spark raises
    here as its own exception. Said instead as the commit says it (review f F4)."""
    try:
        yield
    except Exception as exc:
        if any(not os.path.exists(c.path) for c in snapshot.chunks):
            _gone_by_retention(snapshot, cause=exc)
        raise


def _gone_by_retention(snapshot: Snapshot, cause: Exception | None = None) -> dict[str, int]:
    """The snapshot's chunk files retention removed since (name: start number); raises
    CompactionError if any other is gone (the job then installs nothing)."""
    messages = Path(snapshot.store) / MESSAGES_DIR
    missing = [c for c in snapshot.chunks if not os.path.exists(c.path)]
    if not missing:
        return {}
    listing = os.listdir(messages)
    names = {Path(c.path).name: c.start_number for c in missing}
    alien = [n for n in names if not commit.removed_by_retention(messages, n, listing)]
    if alien:
        raise commit.chunks_vanished_error(Path(snapshot.store), alien) from cause
    return names


def _needs(group: Group, needs: dict[int, frozenset[int]], names: dict[int, str]) -> frozenset[str]:
    """The chunk files outside ``group`` its replacement needs (plan.tombstone_needs)."""
    return frozenset(
        names[n]
        for c in group.chunks
        for n in needs.get(c.start_number, ())
        if not group.start_number <= n <= group.end_number
    )


def _without(snapshot: Snapshot, gone: dict[str, int]) -> Snapshot:
    """The snapshot with the chunks in ``gone`` no longer eligible (never rewritten)."""
    if not gone:
        return snapshot
    numbers = set(gone.values())
    return replace(
        snapshot,
        chunks=[
            replace(c, eligible=False) if c.start_number in numbers else c for c in snapshot.chunks
        ],
    )


def _ship(spark: SparkSession, py_files: list[str], equeue: bool, say: Progress) -> None:
    for path in py_files:
        spark.sparkContext.addPyFile(os.path.abspath(path))
        say(f"shipping {path} to the executors")
    if equeue:
        from equeue.spark.preflight import ship_equeue

        shipped = ship_equeue(spark)
        say(f"shipping equeue as {shipped} (executors run its pure-Python paths)")


def _decide(spark: SparkSession, snapshot: Snapshot, now: float) -> RDD[tuple[int, bytes]]:
    """The removed positions, one partition per chunk file (in the snapshot's order),
    and a last partition summing them up per file (decide.py's two steps, the second
    shuffling its result straight to these partitions). Nothing runs until the plan
    reads the summary; pass 2 then reads the partitions of the chunks it rewrites from
    the same shuffle's files, so pass 1 never runs twice and nothing is cached."""
    from equeue.compaction.decide import RemovedRows, shuffle_partition

    scan = chunk_scan(snapshot, now, spark.sparkContext.defaultParallelism)
    return (
        spark.sparkContext.parallelize(range(len(scan.chunks)), len(scan.chunks))
        .mapPartitions(scan)
        .partitionBy(scan.partitions, shuffle_partition)
        .mapPartitions(RemovedRows([c.number for c in scan.chunks], snapshot.chunk_data_size))
        .partitionBy(len(scan.chunks) + 2, shuffle_partition)
    )


def chunk_scan(snapshot: Snapshot, now: float, slots: int) -> ChunkScan:
    """Step 1's function for ``snapshot`` (element i scans its chunk i): the topics' rules
    at ``now`` (seconds since the epoch), and the partitions of key hashes for ``slots``
    task slots."""
    from equeue.compaction.decide import ChunkScan, ScanChunk, TopicRule

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
        # The broker's retry topics keep their retries whatever an older topics.json
        # says (create_topic refuses a policy there now): review f F7.
        if not is_internal_topic(topic)
    }
    chunks = [ScanChunk(c.path, c.data_end, c.start_number, c.eligible) for c in snapshot.chunks]
    # Partitions of key hashes: one per task slot, more where one would hold more than
    # about _DECIDE_ROWS rows on average (hashing spreads them; fewer where not every
    # record is sent on): a worker holds its partition, 32 bytes a row, and the sort's
    # columns, about 100 bytes a row in all. More partitions than that only add tasks,
    # each costing the JVM tens of ms of CPU that a local job's Python workers need (see
    # docs/benchmarks.md, "Compaction").
    records = sum(c.record_count for c in snapshot.chunks)
    return ChunkScan(chunks, rules, max(slots, -(-records // _DECIDE_ROWS)))


_DECIDE_ROWS: Final = 1 << 18


def _summary_rows(pairs: Iterable[tuple[int, bytes]]) -> Iterator[tuple[int, bytes]]:
    return iter(pairs)


def _removals_per_chunk(
    spark: SparkSession, removed: RDD[tuple[int, bytes]], files: int
) -> tuple[dict[int, Removals], list[ConditionalTombstone]]:
    """Runs pass 1, reading back only its summary partitions: a chunk's rows went to
    several partitions of key hashes, a summary row from each to add up; and the
    conditional tombstones, a row per file holding an older record of the key."""
    import numpy as np

    from equeue.compaction.decide import CONDITIONAL, SUMMARY

    blobs = spark.sparkContext.runJob(removed, _summary_rows, [files, files + 1])
    summary = b"".join(blob for index, blob in blobs if index == files)
    conditional = np.frombuffer(
        b"".join(blob for index, blob in blobs if index == files + 1), CONDITIONAL
    )
    older: dict[tuple[int, int], set[int]] = {}
    for position, size, number in zip(
        conditional["position"].tolist(),
        conditional["size"].tolist(),
        conditional["older"].tolist(),
        strict=True,
    ):
        older.setdefault((position, size), set()).add(number)
    tombstones = [
        ConditionalTombstone(position, size, frozenset(numbers))
        for (position, size), numbers in sorted(older.items())
    ]
    rows = np.frombuffer(summary, SUMMARY)
    totals: dict[int, tuple[int, int]] = {}
    for chunk, count, size in zip(
        rows["number"].tolist(), rows["count"].tolist(), rows["size"].tolist(), strict=True
    ):
        before = totals.get(chunk, (0, 0))
        totals[chunk] = (before[0] + count, before[1] + size)
    return {chunk: Removals(count, size) for chunk, (count, size) in totals.items()}, tombstones


@dataclass(frozen=True, slots=True)
class _Whole:
    """A replacement of one chunk, written start to end by one task."""

    path: str
    data_end: int
    version: int
    kept_bytes: int  # as planned


_Task = _Whole | Part


@dataclass(frozen=True, slots=True)
class _Rewriter:
    """The pass-2 task: one chunk (by its partition of pass 1's output, the chunk file's
    index), its removed positions from every partition of key hashes, less the
    tombstones that stay (``kept``, by the same index; plan.settle_tombstones)."""

    tasks: dict[int, _Task]
    staging: str
    kept: dict[int, list[int]]

    def __call__(
        self, index: int, pairs: Iterable[tuple[int, bytes]]
    ) -> Iterator[tuple[int, RewriteResult | PartResult | None, int]]:
        import numpy as np

        removed = np.sort(np.frombuffer(b"".join(blob for _, blob in pairs), "<i8"))
        if index in self.kept:
            removed = np.setdiff1d(removed, np.asarray(self.kept[index], np.int64))
        task = self.tasks[index]
        result: RewriteResult | PartResult | None
        try:
            result = self._write(task, removed)
        except FileNotFoundError:
            # None: retention removed the chunk since the snapshot, and its replacement is
            # not installed (the driver checks it too); anything else fails the job.
            if not retention_took(task.path):
                raise
            result = None
        yield index, result, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def _write(self, task: _Task, removed: Any) -> RewriteResult | PartResult:
        if not isinstance(task, _Whole):
            return write_part(task, removed)
        # Each attempt writes its own file (its header has its own chunk id) and renames
        # it into place: a retried or duplicated task never mixes two attempts' bytes.
        staging = Path(self.staging)
        chunk = ChunkFile.open(task.path, task.data_end)
        attempt = Path(tempfile.mkdtemp(dir=staging, prefix="attempt-"))
        try:
            whole = rewrite_group([chunk], removed, attempt, task.version)
            os.replace(attempt / whole.file_name, staging / whole.file_name)
        finally:
            shutil.rmtree(attempt, ignore_errors=True)
        return whole


def _rewrite(
    spark: SparkSession,
    removed: RDD[tuple[int, bytes]],
    snapshot: Snapshot,
    groups: list[Group],
    staging: Path,
    kept: dict[int, list[int]],
) -> tuple[list[tuple[Group, RewriteResult, int]], list[Group]]:
    """One task per rewritten chunk, on its partition of pass 1's output. A replacement
    of one chunk is written whole by its task; a merged one is made by the driver at its
    final size, each of its chunks' tasks writes its regions, and the driver finishes it
    (finish_merged). Returns each group with its replacement and its tasks' peak RSS, and
    the groups not written because retention removed one of their chunks."""
    data_size = snapshot.chunk_data_size
    partition = {c.start_number: i for i, c in enumerate(snapshot.chunks)}
    tasks: dict[int, _Task] = {}
    for group in groups:
        if len(group.chunks) == 1:
            (chunk,) = group.chunks
            tasks[partition[chunk.start_number]] = _Whole(
                chunk.path, chunk.data_end, group.version, group.kept_bytes
            )
            continue
        file = staging / chunk_file_name(group.start_number, group.version)
        with open_file(file, "xb") as f:
            f.truncate(group.bytes_after)
        base = group.start_number * data_size
        data_at, map_at = 0, HEADER_SIZE + group.kept_bytes
        for chunk, (kept_bytes, kept_count) in zip(group.chunks, group.kept, strict=True):
            tasks[partition[chunk.start_number]] = Part(
                chunk.path,
                chunk.data_end,
                str(file),
                chunk.start_number * data_size - base,
                data_at,
                map_at,
                kept_bytes,
                kept_count,
            )
            data_at += kept_bytes
            map_at += kept_count * MAP_ENTRY_SIZE
    # A job's tasks start in the order of its partitions: the longest first (a chunk's
    # read, and more for its survivors' writes), so no long one starts last while slots
    # idle.
    order = sorted(tasks, key=lambda i: _cost(tasks[i]), reverse=True)
    done = spark.sparkContext.runJob(
        removed.mapPartitionsWithIndex(
            _Rewriter(tasks, str(staging), {partition[n]: p for n, p in kept.items()})
        ),
        _results,
        order,
    )
    by_task = {index: (result, rss) for index, result, rss in done}
    results: list[tuple[Group, RewriteResult, int]] = []
    lost: list[Group] = []
    for group in groups:
        indices = [partition[c.start_number] for c in group.chunks]
        missing = [c.start_number for c in group.chunks if partition[c.start_number] not in by_task]
        if missing:
            raise CompactionError(f"pass 2 returned nothing for chunks {missing}", file=staging)
        rss = max(by_task[i][1] for i in indices)
        written = [by_task[i][0] for i in indices]
        if isinstance(written[0], RewriteResult):
            results.append((group, written[0], rss))
            continue
        try:
            if any(w is None for w in written):
                raise FileNotFoundError(group.chunks[0].path)  # a task's report: below
            parts = [w for w in written if isinstance(w, PartResult)]
            results.append((group, _finish(group, parts, staging), rss))
        except FileNotFoundError:
            # Retention removed one of its chunks, seen by a task or by _finish here
            gone = [c.path for c in group.chunks if not os.path.exists(c.path)]
            if not gone or not all(retention_took(path) for path in gone):
                raise
            lost.append(group)
            (staging / chunk_file_name(group.start_number, group.version)).unlink(missing_ok=True)
    return results, lost


def _results(
    rows: Iterable[tuple[int, RewriteResult | PartResult | None, int]],
) -> Iterable[tuple[int, RewriteResult | PartResult | None, int]]:
    return rows


def _cost(task: _Task) -> int:
    return task.data_end + 4 * task.kept_bytes


def _finish(group: Group, parts: list[PartResult], staging: Path) -> RewriteResult:
    first = ChunkFile.open(group.chunks[0].path, group.chunks[0].data_end)
    last = ChunkFile.open(group.chunks[-1].path, group.chunks[-1].data_end)
    header = ChunkHeader(
        chunk_type=ChunkType.VARIABLE,
        chunk_start_number=group.start_number,
        chunk_end_number=group.end_number,
        chunk_data_size=first.header.chunk_data_size,
        chunk_id=uuid.uuid4(),
        compacted=True,
        timestamp_offset=first.header.timestamp_offset,
        created_at_ns=time.time_ns(),
    )
    name = chunk_file_name(group.start_number, group.version)
    logical_end = last.header.start_position - first.header.start_position + last.logical_end
    size = finish_merged(staging / name, header, parts, logical_end)
    return RewriteResult(
        file_name=name,
        start_number=group.start_number,
        end_number=group.end_number,
        version=group.version,
        bytes_before=group.bytes_before,
        bytes_after=size,
        records_kept=sum(p.kept_count for p in parts),
        records_removed=sum(p.removed_count for p in parts),
    )


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
