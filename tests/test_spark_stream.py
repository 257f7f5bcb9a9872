"""The streaming source: ``spark.readStream.format("equeue")`` against live stores, with a
producer process writing, queries stopped and restarted from their checkpoints, retention
and compaction running underneath, and one run on ``local-cluster``."""

from __future__ import annotations

import datetime as dt
import json
import logging
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pytest
from code_paths import code_path  # noqa: F401 - the fixture
from stream_producer import EXIT_GATE_TIMEOUT, QUEUES, body_of, create, produce, queue_of, topic_of
from stream_producer import config as producer_config

from equeue import MessageStore, StoreConfig
from equeue.chunks.stream import ChunkFile
from equeue.compaction.job import compact
from equeue.errors import DataLossError, SparkOptionError, SparkSchemaError
from equeue.spark.source import message_batches, store_snapshot
from equeue.spark.stream import (
    DELETED,
    FROM,
    EqueueStreamReader,
    QueueRange,
    StreamOptions,
    fair_shares,
    read_range,
)

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.streaming.query import StreamingQuery

HERE = Path(__file__).parent
PRODUCER = HERE / "stream_producer.py"
WAIT = 120  # seconds any one query may take before the test gives up on it
# The producer waits at its gate longer than the test may wait for the query's first rows
# (a slow Spark start must not end it before the test checks it is still running).
GATE_TIMEOUT = 2 * WAIT

Row = tuple[str, int, int, bytes]  # topic, queue id, queue offset, body
Batches = dict[int, list[Row]]  # batch id -> its rows, as an idempotent sink keeps them


def stored(path: Path, topics: tuple[str, ...] = tuple(QUEUES)) -> dict[tuple[str, int], list[Row]]:
    """Every message of ``topics`` a consumer can pull now, by queue, in offset order."""
    out: dict[tuple[str, int], list[Row]] = {}
    with MessageStore.open(path, read_only=True) as store:
        for topic in topics:
            for queue in store.queue_ids(topic):
                rows: list[Row] = []
                offset = 0
                for _ in range(10_000):
                    pulled = store.pull(topic, queue, offset, 1000)
                    rows += [(m.topic, m.queue_id, m.queue_offset, m.body) for m in pulled]
                    if pulled.next_offset == offset:
                        break
                    offset = pulled.next_offset
                out[(topic, queue)] = rows
    return out


def by_queue(batches: Batches) -> dict[tuple[str, int], list[Row]]:
    """The rows of every batch by queue, in batch order then offset order."""
    out: dict[tuple[str, int], list[Row]] = {}
    for batch_id in sorted(batches):
        for row in sorted(batches[batch_id], key=lambda r: (r[0], r[1], r[2])):
            out.setdefault((row[0], row[1]), []).append(row)
    return out


def assert_in_order(batches: Batches) -> None:
    """Each queue's offsets rise strictly from one batch to the next: nothing read twice,
    nothing out of order."""
    for key, rows in by_queue(batches).items():
        offsets = [r[2] for r in rows]
        assert offsets == sorted(set(offsets)), f"queue {key} read out of order: {offsets}"


def start(
    spark: SparkSession,
    store: Path | str,
    checkpoint: Path,
    batches: Batches,
    *,
    available_now: bool = True,
    parquet: Path | None = None,
    **options: str | int,
) -> StreamingQuery:
    """A query of ``options`` whose foreachBatch keeps each batch's rows by batch id (a batch
    run again replaces what it gave: the idempotent sink Spark's exactly-once needs), and
    with ``parquet`` writes each batch there too, as ``batch=N`` (overwritten on a re-run)."""

    def sink(df: DataFrame, batch_id: int) -> None:
        rows = df.select("topic", "queue_id", "queue_offset", "body").collect()
        if parquet is not None:
            df.write.mode("overwrite").parquet(str(parquet / f"batch={batch_id}"))
        batches[batch_id] = [(r[0], r[1], r[2], bytes(r[3])) for r in rows]

    reader = spark.readStream.format("equeue")
    for name, value in options.items():
        reader = reader.option(name, str(value))
    writer = reader.load(str(store)).writeStream.foreachBatch(sink)
    writer = writer.option("checkpointLocation", str(checkpoint))
    if available_now:
        writer = writer.trigger(availableNow=True)
    else:
        writer = writer.trigger(processingTime="200 milliseconds")
    return writer.start()


def run(spark: SparkSession, store: Path | str, checkpoint: Path, **options: Any) -> Batches:
    """One Trigger.AvailableNow run to its end: the batches it ran."""
    batches: Batches = {}
    query = start(spark, store, checkpoint, batches, **options)
    assert query.awaitTermination(WAIT), "the AvailableNow query did not finish"
    return batches


def rows(batches: Batches) -> list[Row]:
    return sorted(r for b in batches.values() for r in b)


def expected(queues: dict[tuple[str, int], list[Row]]) -> list[Row]:
    return sorted(r for rs in queues.values() for r in rs)


def producer(store: Path, *args: str | int | Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(PRODUCER), str(store), *map(str, args)],
        stdout=subprocess.PIPE,
        text=True,
    )


def finish(process: subprocess.Popen[str]) -> str:
    out, _ = process.communicate(timeout=WAIT)
    assert process.returncode == 0, f"the producer failed ({process.returncode}): {out}"
    return out


def wait_for(condition: Callable[[], bool], what: str, query: StreamingQuery) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert query.exception() is None, query.exception()
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.1)


# --- (a) a producer process, a stop mid-stream, a restart: exactly once, in order --------


def test_restart_from_checkpoint_reads_every_message_once_per_queue_in_order(
    tmp_path: Path, spark: SparkSession
) -> None:
    store, checkpoint, out, gate = (tmp_path / n for n in ("store", "ck", "out", "gate"))
    create(store)
    sending = producer(
        store, "--count", 900, "--gate", gate, "--gate-at", 450, "--gate-timeout", GATE_TIMEOUT,
        "--pause-ms", 20,
    )  # fmt: skip
    first: Batches = {}
    query = start(
        spark, store, checkpoint, first, available_now=False, parquet=out,
        topics="orders,payments", startingOffsets="earliest", maxOffsetsPerTrigger=100,
    )  # fmt: skip
    try:
        wait_for(lambda: sum(map(len, first.values())) >= 100, "100 rows", query)
        assert sending.poll() is None  # mid-stream: the producer is still at work (or gated)
    finally:
        query.stop()
    read_first = sum(map(len, first.values()))
    assert 100 <= read_first < 900
    gate.touch()
    finish(sending)
    second = run(spark, store, checkpoint, parquet=out, topics="orders,payments")
    assert second
    for again in set(first) & set(second):  # the stop cut it short before its commit:
        assert sorted(second[again]) == sorted(first[again])  # run again, the same rows
    batches = {**first, **second}  # (and the idempotent sink keeps them once)
    want = stored(store)
    assert sum(map(len, want.values())) == 900
    assert {r[3] for r in rows(batches)} == {body_of(i) for i in range(900)}
    assert rows(batches) == expected(want)  # each message exactly once
    assert_in_order(batches)
    assert by_queue(batches) == want
    on_disk = spark.read.parquet(str(out)).select("topic", "queue_id", "queue_offset", "body")
    assert sorted((r[0], r[1], r[2], bytes(r[3])) for r in on_disk.collect()) == expected(want)


def test_stream_rows_equal_the_batch_sources_rows(tmp_path: Path, spark: SparkSession) -> None:
    """Every column, as spark.read.format("equeue") gives it (the same schema)."""
    store = tmp_path / "store"
    create(store)
    with MessageStore.open(store, producer_config()) as writer:
        produce(writer, 0, 200)
        writer.send("orders", b"", tag="t", key=None, properties={}, queue_id=1)
    got: list[tuple[Any, ...]] = []
    query = (
        spark.readStream.format("equeue").option("topicPattern", "orders|payments")
        .option("startingOffsets", "earliest").load(str(store))
        .writeStream.foreachBatch(lambda df, _: got.extend(tuple(r) for r in df.collect()))
        .option("checkpointLocation", str(tmp_path / "ck")).trigger(availableNow=True).start()
    )  # fmt: skip
    assert query.awaitTermination(WAIT)
    batch = spark.read.format("equeue").load(str(store)).where("topic != 'other'")
    streamed = spark.readStream.format("equeue").option("topics", "orders").load(str(store))
    assert streamed.schema == batch.schema
    assert sorted(got) == sorted(tuple(r) for r in batch.collect())
    assert len(got) == 201


@pytest.mark.usefixtures("code_path")
def test_stream_rows_times_are_the_batch_sources_from_the_messages_ns(tmp_path: Path) -> None:
    """A message's exact stored times (``created_ns``/``stored_ns``, equal on the C and the
    Python read paths) and the stream's rows from them: every column as the batch source
    reads it from the chunk, the times floored to µs as it floors them (no Spark here)."""
    store = tmp_path / "store"
    create(store)
    with MessageStore.open(store, producer_config()) as writer:
        produce(writer, 0, 300)
    with MessageStore.open(store, read_only=True) as opened:
        pulled = opened.pull("orders", 1, 0, 1000).messages
        alone = [opened.read(m.position) for m in pulled[:5]] + [opened.get(pulled[-1].message_id)]
    assert len(pulled) == 60
    store_id, chunks = store_snapshot(str(store))
    columns = ["position", "created_at", "stored_at"]
    table = pa.Table.from_batches(
        [b for path, end in chunks for b in message_batches(ChunkFile.open(path, end), store_id)]
    )
    truth = {r["position"]: r for r in table.to_pylist()}
    epoch = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
    for m in pulled + alone:
        assert (m.created_at, m.stored_at) == (m.created_ns / 1e9, m.stored_ns / 1e9)
        want = truth[m.position]
        assert want["created_at"] == epoch + dt.timedelta(microseconds=m.created_ns // 1000)
        assert want["stored_at"] == epoch + dt.timedelta(microseconds=m.stored_ns // 1000)
    streamed = pa.Table.from_batches(
        list(read_range(reader(store, topics="orders").options, QueueRange("orders", 1, 0, 60)))
    )
    assert streamed.to_pylist() == [truth[m.position] for m in pulled]
    assert len({r[c] for r in streamed.to_pylist() for c in columns[1:]}) > 1


# --- (b) admission control ---------------------------------------------------------------


def test_max_offsets_per_trigger_bounds_every_batch_split_fairly(
    tmp_path: Path, spark: SparkSession
) -> None:
    store = tmp_path / "store"
    create(store)
    with MessageStore.open(store, producer_config()) as writer:
        produce(writer, 0, 500)  # 100 in each of the 5 queues
    batches = run(
        spark, store, tmp_path / "ck", topics="orders,payments", startingOffsets="earliest",
        maxOffsetsPerTrigger=120,
    )  # fmt: skip
    sizes = [len(batches[b]) for b in sorted(batches)]
    assert sizes == [120, 120, 120, 120, 20]
    for b in sorted(batches)[:4]:  # 24 from each queue: none waits behind another
        per_queue = by_queue({b: batches[b]})
        assert sorted(map(len, per_queue.values())) == [24] * 5
    assert rows(batches) == expected(stored(store))


def test_fair_shares_give_the_small_queues_all_and_split_the_rest() -> None:
    available = {("a", "0"): 5, ("a", "1"): 100, ("b", "0"): 100, ("b", "1"): 0}
    assert fair_shares(available, 60) == {
        ("b", "1"): 0,
        ("a", "0"): 5,
        ("a", "1"): 27,
        ("b", "0"): 28,
    }
    assert fair_shares(available, None) == available
    assert fair_shares(available, 1000) == available
    assert sum(fair_shares({("a", str(q)): 10 for q in range(3)}, 1).values()) == 1


def reader(store: Path, **options: str) -> EqueueStreamReader:
    return EqueueStreamReader({"path": str(store), **options}, stream_schema())


def stream_schema() -> Any:
    """The schema Spark hands the reader: the batch source's (MESSAGE_SCHEMA)."""
    from pyspark.sql.types import (
        BinaryType,
        IntegerType,
        LongType,
        MapType,
        StringType,
        StructField,
        StructType,
        TimestampType,
    )

    s, ts = StringType(), TimestampType()
    return StructType(
        [
            StructField("topic", s),
            StructField("queue_id", IntegerType()),
            StructField("queue_offset", LongType()),
            StructField("position", LongType()),
            StructField("message_id", s),
            StructField("tag", s),
            StructField("key", s),
            StructField("properties", MapType(s, s)),
            StructField("body", BinaryType()),
            StructField("created_at", ts),
            StructField("stored_at", ts),
        ]
    )


def test_min_offsets_per_trigger_waits_until_max_trigger_delay(tmp_path: Path) -> None:
    from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMinRows

    store = tmp_path / "store"
    create(store)
    with MessageStore.open(store, producer_config()) as writer:
        produce(writer, 0, 10)
    waiting = reader(store, topics="orders", startingOffsets="earliest", minOffsetsPerTrigger="50")
    begin = waiting.initialOffset()
    assert waiting.latestOffset(begin, ReadMinRows(50)) == begin  # 6 < 50: no batch yet
    assert waiting.latestOffset(begin, ReadAllAvailable()) != begin  # the engine's limit wins
    late = reader(
        store, topics="orders", startingOffsets="earliest", minOffsetsPerTrigger="50",
        maxTriggerDelay="0ms",
    )  # fmt: skip
    assert late.latestOffset(begin, ReadMinRows(50)) == {
        "orders": {"0": 2, "1": 2, "2": 2},
        DELETED: {},
    }
    waiting.stop()
    late.stop()


# --- (c) startingOffsets -----------------------------------------------------------------


def test_starting_offsets_latest_and_json(tmp_path: Path, spark: SparkSession) -> None:
    store = tmp_path / "store"
    create(store)
    with MessageStore.open(store, producer_config()) as writer:
        produce(writer, 0, 500)
    latest = tmp_path / "latest"
    assert rows(run(spark, store, latest, topics="orders,payments")) == []  # latest: default
    with MessageStore.open(store, producer_config()) as writer:
        produce(writer, 500, 50)
    new = rows(run(spark, store, latest, topics="orders,payments"))
    assert sorted(r[3] for r in new) == sorted(body_of(i) for i in range(500, 550))
    starting = {"orders": {"0": 90, "1": -1}, "payments": {"1": -2}}
    picked = run(
        spark, store, tmp_path / "json", topicPattern="ord.*|pay.*",
        startingOffsets=json.dumps(starting),
    )  # fmt: skip
    want = stored(store)
    want[("orders", 0)] = [r for r in want[("orders", 0)] if r[2] >= 90]
    want[("orders", 1)] = []  # latest: nothing until more is sent
    assert by_queue(picked) == {k: v for k, v in want.items() if v}


# --- (d) retention underneath ------------------------------------------------------------


def test_retention_underneath_fails_with_data_loss_or_skips_with_a_warning(
    tmp_path: Path, spark: SparkSession
) -> None:
    """A writer process with retention (6 chunks kept) runs on while a query with
    failOnDataLoss=false reads it too slowly (50 offsets a batch): it skips what retention
    took and ends with every message the store still holds, each once. The same query with
    true, restarted after it, fails naming the queue and offsets."""
    store, checkpoint = tmp_path / "store", tmp_path / "ck"
    create(store)
    with MessageStore.open(store, producer_config()) as writer:
        produce(writer, 0, 100)
    options = {"topics": "orders,payments", "startingOffsets": "earliest"}
    assert len(rows(run(spark, store, checkpoint, **options))) == 100
    skipping = tmp_path / "ck-false"
    shutil.copytree(checkpoint, skipping)
    sending = producer(
        store, "--first", 100, "--count", 1000, "--max-store-bytes", 6 * 4096, "--pause-ms", 20
    )
    rest: Batches = {}
    query = start(
        spark, store, skipping, rest, available_now=False, failOnDataLoss="false",
        maxOffsetsPerTrigger=50, **options,  # type: ignore[arg-type]
    )  # fmt: skip
    try:
        finish(sending)
        kept = stored(store)
        last = {k: v[-1][2] for k, v in kept.items()}

        def caught_up() -> bool:
            read = by_queue(rest)
            return all(k in read and read[k][-1][2] == v for k, v in last.items())

        wait_for(caught_up, "the query to reach the store's end", query)
    finally:
        query.stop()
    got = rows(rest)
    assert len(got) == len(set(got)) < 1000  # nothing twice; what retention took, skipped
    assert set(expected(kept)) <= set(got)  # all that is left
    for topic, queue, _, body in got:  # and only real messages
        i = int(body.split()[1])
        assert (topic_of(i), queue_of(i), body) == (topic, queue, body_of(i))
    assert_in_order(rest)
    assert min(r[2] for r in kept[("orders", 0)]) > 20  # the first query stopped at 20
    from pyspark.errors import StreamingQueryException

    with pytest.raises(StreamingQueryException) as caught:
        run(spark, store, checkpoint, **options)
    said = str(caught.value)
    assert "DataLossError" in said and "failOnDataLoss=false" in said
    assert "it wanted offset 20, the first one available is" in said


def test_data_loss_warnings_name_queue_and_offsets(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """What failOnDataLoss=false logs on the driver (planning) and in a task (reading), and
    the error true raises there: the driver's and the executors' code run here in-process."""
    from pyspark.sql.streaming.datasource import ReadAllAvailable

    store = tmp_path / "store"
    create(store)
    with MessageStore.open(store, producer_config(6 * 4096)) as writer:
        produce(writer, 0, 1000)
        writer.apply_retention()
    with MessageStore.open(store, read_only=True) as opened:
        opened.refresh()  # (a read-only handle's first offsets are right after a refresh)
        first = opened.queue_range("payments", 1)[0]
        end = opened.queue_range("payments", 1)[1]
        old = {"payments": {"0": opened.queue_range("payments", 0)[0], "1": 5}}
    assert first > 5
    failing = reader(store, topics="payments")
    with pytest.raises(DataLossError, match=f"queue 1: offsets 5 to {first - 1} were removed"):
        failing.latestOffset(old, ReadAllAvailable())
    with pytest.raises(DataLossError, match=f"first one available is {first}"):
        list(read_range(failing.options, QueueRange("payments", 1, 5, end)))
    # A planned range wholly below the first offset: its end is not "the first available"
    # (reviewc F6); the queue's first offset is.
    with pytest.raises(DataLossError) as caught:
        list(read_range(failing.options, QueueRange("payments", 1, 2, 4)))
    assert "offsets 2 to 3 were removed" in str(caught.value)
    assert f"it wanted offset 2, the first one available is {first}," in str(caught.value)
    failing.stop()
    skipping = reader(store, topics="payments", failOnDataLoss="false")
    with caplog.at_level(logging.WARNING, logger="equeue.spark.stream"):
        latest = skipping.latestOffset(old, ReadAllAvailable())
        read = list(read_range(skipping.options, QueueRange("payments", 1, 5, end)))
    parts = skipping.partitions(old, latest)
    skipping.stop()
    assert latest["payments"]["1"] == end
    assert latest[FROM] == {"payments": {"1": first}}  # the batch reads from there on
    assert ("payments", 1, first, end) in [(p.topic, p.queue_id, p.start, p.end) for p in parts]
    assert sum(b.num_rows for b in read) == end - first
    said = [r.getMessage() for r in caplog.records]
    assert (
        len([s for s in said if f"it wanted offset 5, the first one available is {first}" in s])
        == 2
    )
    assert all("failOnDataLoss=false" in s for s in said)


def test_retention_while_a_task_reads_is_data_loss_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retention removing offsets between a task's look at the queue's start and its pulls:
    the pull skips them, and the task tells them from compaction's holes by the queue's
    first offset after the read."""
    store = tmp_path / "store"
    create(store)
    writer = MessageStore.open(store, producer_config(6 * 4096))
    produce(writer, 0, 1000)
    writer.flush()
    refresh = MessageStore.refresh
    calls: list[int] = []

    def late(self: MessageStore) -> None:  # retention runs just after the task's first look
        calls.append(1)
        if len(calls) == 1 and self.read_only:
            writer.apply_retention()
        else:
            refresh(self)

    try:
        monkeypatch.setattr(MessageStore, "refresh", late)
        options = reader(store, topics="payments").options
        calls.clear()  # (the driver's reader looked too)
        end = writer.queue_range("payments", 1)[1]
        with pytest.raises(DataLossError, match=r"offsets 5 to [0-9]+ were removed") as raised:
            list(read_range(options, QueueRange("payments", 1, 5, end)))
        first = writer.queue_range("payments", 1)[0]
    finally:
        writer.close()
    assert first > 5
    assert f"offsets 5 to {first - 1} were removed" in str(raised.value)
    assert len(calls) >= 2


def test_deleted_and_recreated_topics_are_data_loss(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from pyspark.sql.streaming.datasource import ReadAllAvailable

    store = tmp_path / "store"
    create(store)
    with MessageStore.open(store, producer_config()) as writer:
        produce(writer, 0, 100)
    strict = reader(store, topics="orders,payments", startingOffsets="latest")
    lenient = reader(store, topics="orders,payments", failOnDataLoss="false")
    begin = strict.initialOffset()
    assert begin["payments"] == {"0": 20, "1": 20}
    with MessageStore.open(store, producer_config()) as writer:
        writer.delete_topic("payments")
    with pytest.raises(DataLossError, match=r"'payments'.*no longer holds it"):
        strict.latestOffset(begin, ReadAllAvailable())
    with caplog.at_level(logging.WARNING, logger="equeue.spark.stream"):
        assert "payments" not in lenient.latestOffset(begin, ReadAllAvailable())
    assert "no longer holds it" in caplog.text
    with MessageStore.open(store, producer_config()) as writer:
        writer.create_topic("payments", 2)
        for i in range(3):
            writer.send("payments", b"again %d" % i, queue_id=0)
    with pytest.raises(DataLossError, match=r"'payments'.*deleted and created again"):
        strict.latestOffset(begin, ReadAllAvailable())
    older = {t: qs for t, qs in begin.items() if t != DELETED}  # an older version's offset
    with pytest.raises(DataLossError, match="queue now ends at 3"):
        strict.latestOffset(older, ReadAllAvailable())
    end = lenient.latestOffset(begin, ReadAllAvailable())
    assert end["payments"] == {"0": 3, "1": 0}  # read again from the new topic's start
    assert end[FROM] == {"payments": {"0": 0, "1": 0}}
    parts = lenient.partitions(begin, end)
    assert [(p.topic, p.queue_id, p.start, p.end) for p in parts if p.topic == "payments"] == [
        ("payments", 0, 0, 3)
    ]
    strict.stop()
    lenient.stop()


def test_a_topic_created_again_past_the_offsets_read_is_data_loss(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """reviewj F1: a topic deleted and created again, whose new queues already hold more
    than the query had read, was read on from the old offsets: the new topic's first
    messages were skipped, with no error and no warning."""
    from pyspark.sql.streaming.datasource import ReadAllAvailable

    store = tmp_path / "store"
    create(store)
    with MessageStore.open(store, producer_config()) as writer:
        produce(writer, 0, 100)
    strict = reader(store, topics="payments", startingOffsets="latest")
    lenient = reader(store, topics="payments", failOnDataLoss="false")
    begin = strict.initialOffset()
    assert begin == {"payments": {"0": 20, "1": 20}, DELETED: {}}
    with MessageStore.open(store, producer_config()) as writer:
        writer.delete_topic("payments")
        writer.create_topic("payments", 2)
        for i in range(50):
            writer.send("payments", b"new %d" % i, queue_id=i % 2)
        position = writer.deleted_topics()["payments"]
    with pytest.raises(DataLossError, match=r"'payments'.*deleted and created again"):
        strict.latestOffset(begin, ReadAllAvailable())
    with caplog.at_level(logging.WARNING, logger="equeue.spark.stream"):
        end = lenient.latestOffset(begin, ReadAllAvailable())
    assert "deleted and created again" in caplog.text
    assert end == {
        "payments": {"0": 25, "1": 25},
        FROM: {"payments": {"0": 0, "1": 0}},  # the new topic: from its start
        DELETED: {"payments": position},
    }
    parts = lenient.partitions(begin, end)
    assert [p.deleted for p in parts] == [position, position]
    bodies = [v.as_py() for p in parts for b in read_range(lenient.options, p) for v in b["body"]]
    assert sorted(bodies) == sorted(b"new %d" % i for i in range(50))
    assert strict.latestOffset(end, ReadAllAvailable()) == end  # the new topic is known now
    strict.stop()
    lenient.stop()


def test_a_topic_created_again_after_its_batch_was_planned_is_data_loss(
    tmp_path: Path,
) -> None:
    """The task that reads a batch finds its topic created again since the batch was
    planned: the offsets are the new topic's, not the ones planned."""
    from pyspark.sql.streaming.datasource import ReadAllAvailable

    store = tmp_path / "store"
    create(store)
    with MessageStore.open(store, producer_config()) as writer:
        produce(writer, 0, 100)
    strict = reader(store, topics="payments", startingOffsets="earliest")
    begin = strict.initialOffset()
    end = strict.latestOffset({"payments": {"0": 0, "1": 0}, DELETED: {}}, ReadAllAvailable())
    parts = strict.partitions({"payments": {"0": 0, "1": 0}}, end)
    assert [p.deleted for p in parts] == [-1, -1]
    control = [b.num_rows for b in read_range(strict.options, parts[0])]
    assert sum(control) == 20  # undamaged: the planned rows
    with MessageStore.open(store, producer_config()) as writer:
        writer.delete_topic("payments")
        writer.create_topic("payments", 2)
        for i in range(60):
            writer.send("payments", b"new %d" % i, queue_id=i % 2)
    with pytest.raises(DataLossError, match="created again since the batch was planned"):
        list(read_range(strict.options, parts[0]))
    assert begin["payments"] == {"0": 0, "1": 0}
    strict.stop()


def test_new_topics_and_queues_are_read_from_their_start(tmp_path: Path) -> None:
    from pyspark.sql.streaming.datasource import ReadAllAvailable

    store = tmp_path / "store"
    create(store)
    with MessageStore.open(store, producer_config()) as writer:
        produce(writer, 0, 50)
    following = reader(store, topicPattern="or.*s", startingOffsets="latest")
    begin = following.initialOffset()
    assert begin == {"orders": {"0": 10, "1": 10, "2": 10}, DELETED: {}}  # not "other"
    with MessageStore.open(store, producer_config()) as writer:
        writer.create_topic("orders", 4)
        writer.send("orders", b"in the new queue", queue_id=3)
        writer.create_topic("oranges", 1)
        writer.send("oranges", b"a new topic")
        writer.send("others", b"not matched")
    end = following.latestOffset(begin, ReadAllAvailable())
    assert end == {
        "oranges": {"0": 1},
        "orders": {"0": 10, "1": 10, "2": 10, "3": 1},
        FROM: {"oranges": {"0": 0}, "orders": {"3": 0}},  # where the new queues begin
        DELETED: {},  # none of them ever deleted
    }
    assert following.latestOffset(end, ReadAllAvailable()) == end  # nothing new: no batch
    parts = following.partitions(begin, end)
    assert sorted((p.topic, p.queue_id, p.start, p.end) for p in parts) == [
        ("oranges", 0, 0, 1),
        ("orders", 3, 0, 1),
    ]
    got = [b for p in parts for b in read_range(following.options, p)]
    assert sorted(v.as_py() for b in got for v in b.column("body")) == [
        b"a new topic",
        b"in the new queue",
    ]
    following.stop()


def test_a_new_queues_start_is_fixed_when_the_batch_is_planned(tmp_path: Path) -> None:
    """A queue new in a batch begins where latestOffset counted from, whatever retention
    does before the batch's partitions are made or made again (a re-run after a restart):
    the same ranges, and what retention took before the task read it is data loss."""
    from pyspark.sql.streaming.datasource import ReadAllAvailable

    store = tmp_path / "store"
    create(store)
    with MessageStore.open(store, producer_config()) as writer:
        produce(writer, 0, 1000)
    strict = reader(store, topics="orders,payments", startingOffsets="earliest")
    begin = {"orders": strict.initialOffset()["orders"]}  # payments: new in the batch
    end = strict.latestOffset(begin, ReadAllAvailable())
    assert end[FROM] == {"payments": {"0": 0, "1": 0}}
    planned = [(p.topic, p.queue_id, p.start, p.end) for p in strict.partitions(begin, end)]
    assert ("payments", 1, 0, 200) in planned
    with MessageStore.open(store, producer_config(6 * 4096)) as writer:
        writer.apply_retention()
        assert writer.queue_range("payments", 1)[0] > 0
    again = strict.partitions(begin, end)
    assert [(p.topic, p.queue_id, p.start, p.end) for p in again] == planned
    part = next(p for p in again if (p.topic, p.queue_id) == ("payments", 1))
    with pytest.raises(DataLossError, match=r"queue 1: offsets 0 to [0-9]+ were removed"):
        list(read_range(strict.options, part))
    strict.stop()
    # control: a queue in the start offset begins there, as before
    assert ("orders", 0, begin["orders"]["0"], end["orders"]["0"]) in planned


def test_a_new_topics_start_goes_through_the_checkpoint(
    tmp_path: Path, spark: SparkSession
) -> None:
    """Spark keeps the end offset's FROM in the checkpoint and hands it back: the new topic
    is read once, from its start, and a run with nothing new runs no batch."""
    store, checkpoint = tmp_path / "store", tmp_path / "ck"
    create(store)
    with MessageStore.open(store, producer_config()) as writer:
        produce(writer, 0, 50)
    first = run(spark, store, checkpoint, topics="orders,fresh", startingOffsets="earliest")
    assert sum(map(len, first.values())) == 30
    with MessageStore.open(store, producer_config()) as writer:
        writer.create_topic("fresh", 1)
        for i in range(3):
            writer.send("fresh", b"fresh %d" % i)
    second = run(spark, store, checkpoint, topics="orders,fresh")
    assert rows(second) == [("fresh", 0, i, b"fresh %d" % i) for i in range(3)]
    (batch,) = second
    logged = (checkpoint / "offsets" / str(batch)).read_text()
    assert '"@from": {"fresh": {"0": 0}}' in logged
    assert run(spark, store, checkpoint, topics="orders,fresh") == {}


def test_a_range_past_the_queues_end_is_data_loss(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A batch planned to an offset the queue no longer reaches (a writer that lost what it
    had shown, a topic created again): the task says so instead of returning short."""
    store = tmp_path / "store"
    create(store)
    with MessageStore.open(store, producer_config()) as writer:
        produce(writer, 0, 50)  # 10 per queue
    strict = reader(store, topics="orders")
    with pytest.raises(DataLossError, match="offsets 10 to 14 were planned but the queue ends"):
        list(read_range(strict.options, QueueRange("orders", 0, 0, 15)))
    lenient = reader(store, topics="orders", failOnDataLoss="false")
    with caplog.at_level(logging.WARNING, logger="equeue.spark.stream"):
        got = list(read_range(lenient.options, QueueRange("orders", 0, 0, 15)))
    assert sum(b.num_rows for b in got) == 10
    assert "offsets 10 to 14 were planned" in caplog.text


# --- (e) compaction underneath -----------------------------------------------------------


def test_compaction_holes_are_not_data_loss(tmp_path: Path, spark: SparkSession) -> None:
    store, checkpoint = tmp_path / "store", tmp_path / "ck"
    small = StoreConfig(chunk_data_size=8 * 1024, flush="os")
    with MessageStore.open(store, small) as writer:
        writer.create_topic("k", 2, cleanup="compact")
        for i in range(100):
            writer.send("k", b"first %d" % i, key=f"key-{i % 10}")
    options = {"topics": "k", "startingOffsets": "earliest", "failOnDataLoss": "true"}
    before = by_queue(run(spark, store, checkpoint, **options))
    assert sum(map(len, before.values())) == 100
    stopped = {k: v[-1][2] + 1 for k, v in before.items()}  # where the checkpoint stands
    with MessageStore.open(store, small) as writer:
        for i in range(600):
            writer.send("k", b"later %d" % i + b"y" * 40, key=f"key-{i % 10}")
    report = compact(store, spark=spark, now=time.time() + 1)
    assert report.records_removed > 100  # unread records too: holes past the checkpoint
    survivors = stored(store, ("k",))
    rest = run(spark, store, checkpoint, **options)
    unread = {k: [r for r in v if r[2] >= stopped[k]] for k, v in survivors.items()}
    assert rows(rest) == expected(unread)
    assert len(rows(rest)) < 600  # there were holes, and they were skipped, not lost
    assert_in_order(rest)


# --- (f) local-cluster, from a relative path: tests/test_spark_cluster.py runs it, in the one
# local-cluster process of the tests (a cluster's start costs about 20 s).


def test_the_producer_waits_at_its_gate_as_long_as_it_is_told(tmp_path: Path) -> None:
    store, gate = tmp_path / "store", tmp_path / "gate"
    create(store)
    timing_out = producer(
        store, "--count", 10, "--gate", gate, "--gate-at", 5, "--gate-timeout", "0.2"
    )
    out, _ = timing_out.communicate(timeout=WAIT)
    assert (timing_out.returncode, out) == (EXIT_GATE_TIMEOUT, "GATE\n")
    gate.touch()  # control: an open gate lets it finish
    assert (
        finish(producer(store, "--count", 10, "--gate", gate, "--gate-at", 5)) == "GATE\nDONE 10\n"
    )
    assert GATE_TIMEOUT >= WAIT


# --- (g) options ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({}, "'topics'"),
        ({"topics": "orders", "topicPattern": "o.*"}, "'topicPattern'"),
        ({"topicPattern": "(unclosed"}, "topicPattern"),
        ({"topics": " , "}, "topics"),
        ({"topics": "orders", "startingOffsets": "newest"}, "startingOffsets"),
        ({"topics": "orders", "startingOffsets": '{"orders": {"x": 1}}'}, "startingOffsets"),
        ({"topics": "orders", "startingOffsets": '{"orders": {"0": -3}}'}, "startingOffsets"),
        ({"topics": "orders", "startingOffsets": '{"orders": {"²": 0}}'}, "queue id '²'"),
        (  # int() refused 5,000 digits with a builtin ValueError
            {"topics": "orders", "startingOffsets": '{"orders": {"%s": 0}}' % ("1" * 5000)},
            "queue id '1111",
        ),
        ({"topics": "orders", "startingOffsets": '{"orders": {"2147483648": 0}}'}, "queue id"),
        (
            {"topics": "orders", "startingOffsets": '{"orders": {"0": 9223372036854775808}}'},
            "offset",
        ),
        ({"topics": "orders", "maxTriggerDelay": "1" + "0" * 400 + "s"}, "maxTriggerDelay"),
        ({"topics": "orders", "maxOffsetsPerTrigger": "0"}, "maxOffsetsPerTrigger"),
        ({"topics": "orders", "maxOffsetsPerTrigger": "ten"}, "maxOffsetsPerTrigger"),
        (
            {"topics": "orders", "maxOffsetsPerTrigger": "5", "minOffsetsPerTrigger": "9"},
            "minOffsetsPerTrigger",
        ),
        ({"topics": "orders", "maxTriggerDelay": "soon"}, "maxTriggerDelay"),
        ({"topics": "orders", "failOnDataLoss": "maybe"}, "failOnDataLoss"),
        ({"topics": "orders", "maxOffsetPerTrigger": "5"}, "maxoffsetpertrigger"),
    ],
)
def test_bad_option_is_refused_naming_it(
    tmp_path: Path, options: dict[str, str], named: str
) -> None:
    with pytest.raises(SparkOptionError, match=named):
        reader(tmp_path, **options)


def test_starting_offsets_outside_the_store_are_refused(tmp_path: Path) -> None:
    store = tmp_path / "store"
    create(store)
    past = reader(store, topics="orders", startingOffsets='{"orders": {"0": 5}}')
    with pytest.raises(SparkOptionError, match="past the queue's end 0"):
        past.initialOffset()
    unknown = reader(store, topics="orders", startingOffsets='{"orders": {"7": 0}}')
    with pytest.raises(SparkOptionError, match="orders/7"):
        unknown.initialOffset()
    past.stop()
    unknown.stop()


def test_a_schema_other_than_the_sources_is_refused(tmp_path: Path) -> None:
    from pyspark.sql.types import StringType, StructField, StructType

    with pytest.raises(SparkSchemaError, match="body"):
        EqueueStreamReader(
            {"path": str(tmp_path), "topics": "a"}, StructType([StructField("body", StringType())])
        )


def test_bad_option_through_spark_names_the_option(tmp_path: Path, spark: SparkSession) -> None:
    store = tmp_path / "store"
    create(store)
    with pytest.raises(Exception) as caught:
        run(spark, store, tmp_path / "ck", topics="orders", topicPattern="o.*")
    assert "SparkOptionError" in str(caught.value)
    assert "exactly one of the options 'topics'" in str(caught.value)


@pytest.fixture(autouse=True)
def _no_stray_queries(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that failed with a query running must not leave it to the next test."""
    yield
    if "spark" in request.fixturenames:
        spark = request.getfixturevalue("spark")
        for query in spark.streams.active:
            query.stop()


def test_docs_table_names_every_option() -> None:
    from equeue.spark.stream import OPTIONS

    text = (HERE.parent / "docs" / "spark.md").read_text()
    section = text[text.index("## Streaming source") :]
    for name in OPTIONS:
        assert name == "path" or f"| `{name}` |" in section, f"docs/spark.md misses {name}"


def test_a_task_takes_a_lost_deletion_mark_for_no_re_creation(tmp_path: Path) -> None:
    """review6 R6-4: a batch planned with the topic's deletion mark, re-run after
    topics.json was rebuilt from the queue directories (which keeps no mark), read its
    rows; it failed as "created again" though nothing was."""
    import os

    store = tmp_path / "store"
    with MessageStore.open(store) as writer:
        writer.create_topic("t", 1)
        writer.send("t", b"old")
        writer.delete_topic("t")
        writer.create_topic("t", 1)
        for i in range(5):
            writer.send("t", b"new %d" % i)
        mark = writer.deleted_topics()["t"]
    options = StreamOptions({"path": str(store), "topics": "t"})
    planned = QueueRange("t", 0, 0, 5, mark)
    assert sum(b.num_rows for b in read_range(options, planned)) == 5  # control
    os.rename(store / "topics.json", tmp_path / "topics.json.aside")
    for name in os.listdir(store):
        if name.startswith("topics.journal"):
            os.rename(store / name, tmp_path / f"{name}.aside")
    with MessageStore.open(store) as rebuilt:  # from the queue directories: no mark
        assert rebuilt.deleted_topics() == {}
    assert sum(b.num_rows for b in read_range(options, planned)) == 5
