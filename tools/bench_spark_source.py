"""The Spark batch source on ``local[2]`` over a store of about 1.1 GiB (1 KiB bodies,
four topics, 100 000 keys), beside the reference measured in the same run: a plain
single-process Python ``pull`` loop over every queue of the same store.

Queries: ``count()``, ``groupBy("topic").count()``, a full scan with bodies
(``sum(length(body))``), a ``key = ...`` query and a ``stored_at > ...`` query (the last
0.5 % of the messages), each without and with the ``columns`` option (the columns the
query needs). The two forms alternate, the first of them swapped every round; each
figure is the median of ``--rounds`` (default 3), with the range; "CPU s" is the
median CPU time of the whole process tree (driver, JVM, Python workers), which
contention on a shared machine moves far less than wall time. The SparkSession's
start and one warm-up query are not timed. For the pushed-down queries, the chunk bytes
a read takes are counted by running the planned partitions in this process.

    .venv/bin/python tools/bench_spark_source.py [--store DIR] [--size-mib 1100] [--rounds 3]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench_compaction import cpu_seconds

from equeue import MessageStore, OutgoingMessage, StoreConfig

BODY_SIZE = 1024
TOPICS = ("orders", "payments", "clicks", "audit")
KEYS = 100_000
MiB = 1 << 20


def build(path: Path, size_mib: int, chunk_mib: int) -> None:
    record = BODY_SIZE + 110  # head, topic, key, tag, frame: about
    count = size_mib * MiB // record
    body = os.urandom(BODY_SIZE)
    config = StoreConfig(chunk_data_size=chunk_mib * MiB, flush="os")
    with MessageStore.open(path, config) as store:
        for start in range(0, count, 1000):
            topic = TOPICS[(start // 1000) % len(TOPICS)]
            store.send_batch(
                topic,
                [
                    OutgoingMessage(body, tag=f"t{i % 8}", key=f"key-{i % KEYS:06d}")
                    for i in range(start, min(start + 1000, count))
                ],
            )
        store.flush()


def pull_loop(path: Path) -> tuple[int, dict[str, int]]:
    per_topic: Counter[str] = Counter()
    with MessageStore.open(path, read_only=True) as store:
        for topic in store.topics():
            for queue_id in store.queue_ids(topic):
                offset = store.queue_range(topic, queue_id)[0]
                while batch := store.pull(topic, queue_id, offset, max_count=1024):
                    per_topic[topic] += len(batch)
                    offset = batch.next_offset
    return sum(per_topic.values()), dict(per_topic)


def store_bytes(path: Path) -> tuple[int, int]:
    """(the chunks' data bytes, the chunks)."""
    from equeue.spark.source import store_snapshot

    snapshot = store_snapshot(str(path))[1]
    return sum(end for _, end in snapshot), len(snapshot)


def bytes_read(path: Path, filters: list[Any]) -> tuple[int, int]:
    """(chunk bytes a read with these pushed filters takes, its partitions)."""
    from equeue.spark import source

    reader = source.EqueueReader({"path": str(path.resolve())})
    assert not list(reader.pushFilters(filters))
    parts = reader.partitions()
    before = source.READ_BYTES[0]
    for part in parts:
        for _ in reader.read(part):
            pass
    return source.READ_BYTES[0] - before, len(parts)


OTHERS: list[float] = []  # cores the rest of the machine used during each timed run
CPU: list[float] = []  # CPU seconds of this process tree (driver, JVM, workers) in each


def timed(run: Callable[[], Any]) -> tuple[float, Any]:
    """Wall seconds of ``run`` (and, in OTHERS, the CPU the machine spent meanwhile outside
    this process tree: the JVM and its Python workers descend from it)."""
    machine, _, own = cpu_seconds(os.getpid())
    start = time.perf_counter()
    out = run()
    seconds = time.perf_counter() - start
    machine_after, _, own_after = cpu_seconds(os.getpid())
    OTHERS.append(max(0.0, (machine_after - machine) - (own_after - own)) / seconds)
    CPU.append(own_after - own)
    return seconds, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", type=Path, help="reuse (or build here) this store")
    parser.add_argument("--size-mib", type=int, default=1100)
    parser.add_argument("--chunk-mib", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    path = args.store or Path(tempfile.mkdtemp(prefix="bench-spark-source-")) / "store"
    if not (path / "store.json").exists():
        start = time.perf_counter()
        build(path, args.size_mib, args.chunk_mib)
        print(f"built {path} in {time.perf_counter() - start:.0f} s")
    total, chunks = store_bytes(path)

    from pyspark.sql.datasource import EqualTo, GreaterThan

    from equeue.spark import session

    spark = session("local[2]", "bench-spark-source", quiet=True, shuffle_partitions=2)
    spark.sparkContext.setLogLevel("ERROR")
    reader = spark.read.format("equeue")
    store = str(path)
    positions = reader.option("columns", "position,stored_at").load(store)
    last = positions.selectExpr("max(position)").collect()[0][0]
    cut: dt.datetime = positions.selectExpr("percentile_approx(stored_at, 0.995)").collect()[0][0]
    key = "key-004242"

    def df(columns: str | None) -> Any:
        r = spark.read.format("equeue")
        return (r.option("columns", columns) if columns else r).load(store)

    queries: list[tuple[str, str, Callable[[Any], Any]]] = [
        ("count()", "topic", lambda d: d.count()),
        ('groupBy("topic").count()', "topic", lambda d: d.groupBy("topic").count().collect()),
        ("sum(length(body))", "body", lambda d: d.selectExpr("sum(length(body))").collect()[0][0]),
        (f"key = '{key}'", "key,body", lambda d: d.filter(f"key = '{key}'").count()),
        (
            "stored_at > (last 0.5 %)",
            "stored_at,body",
            lambda d: d.filter(d.stored_at > cut).count(),
        ),
    ]
    df(None).count()  # warm-up: the Python workers and the JVM's first query
    load_before = os.getloadavg()[0]
    times: dict[tuple[str, bool], list[float]] = {}
    reference: list[float] = []
    cpu: dict[tuple[str, bool], list[float]] = {}
    answers: dict[tuple[str, bool], Any] = {}
    for round_ in range(args.rounds):
        seconds, (messages, _) = timed(lambda: pull_loop(path))
        reference.append(seconds)
        cpu.setdefault(("pull", False), []).append(CPU[-1])
        for name, columns, query in queries:
            order = [False, True] if round_ % 2 == 0 else [True, False]
            for narrow in order:
                frame = df(columns if narrow else None)
                seconds, answer = timed(lambda q=query, f=frame: q(f))  # type: ignore[misc]
                times.setdefault((name, narrow), []).append(seconds)
                cpu.setdefault((name, narrow), []).append(CPU[-1])
                answers[(name, narrow)] = answer
    for name, _, _ in queries:
        assert answers[(name, False)] == answers[(name, True)], name
    assert answers[("count()", False)] == messages

    key_bytes, key_parts = bytes_read(path, [EqualTo(("key",), key)])
    time_bytes, time_parts = bytes_read(path, [GreaterThan(("stored_at",), cut)])
    share = {
        f"key = '{key}'": (key_bytes, key_parts),
        "stored_at > (last 0.5 %)": (time_bytes, time_parts),
    }

    def cell(values: list[float]) -> str:
        return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"

    print(
        f"\nStore: {total / MiB:.0f} MiB of chunk data, {messages} messages, "
        f"{chunks} chunks, last position {last}; local[2]; "
        f"median (range) of {args.rounds} rounds, s; 1-minute load average "
        f"{load_before:.1f} before the rounds, {os.getloadavg()[0]:.1f} after; other "
        f"processes used {statistics.median(OTHERS):.2f} cores (median over the timed runs; "
        f"{min(OTHERS):.2f} to {max(OTHERS):.2f}) of the machine's 2\n"
    )

    def used(key: tuple[str, bool]) -> str:
        return f"{statistics.median(cpu[key]):.1f}"

    print(
        "| query | all columns, s | CPU s | `columns`, s | CPU s | MiB/s (all) | chunk bytes read |"
    )
    print("|---|---|---|---|---|---|---|")
    print(
        f"| reference: Python `pull` loop, 1 process | {cell(reference)} | "
        f"{used(('pull', False))} | | | "
        f"{total / MiB / statistics.median(reference):.0f} | 100 % |"
    )
    for name, columns, _ in queries:
        full, narrowed = times[(name, False)], times[(name, True)]
        rate = total / MiB / statistics.median(full)
        read = "100 %"
        if name in share:
            got, parts = share[name]
            read = f"{100 * got / total:.3f} % ({got / 1024:,.0f} KiB, {parts} partitions)"
        print(
            f"| {name} | {cell(full)} | {used((name, False))} | {cell(narrowed)} (`{columns}`) "
            f"| {used((name, True))} | {rate:.0f} | {read} |"
        )
    spark.stop()


if __name__ == "__main__":
    main()
