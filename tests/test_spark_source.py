"""The batch source: Arrow columns built in bulk (C and Python, against a record-by-record
reference), the ``columns`` option, filter pushdown (rows against a Python reference,
and the reads it saves), damage reported with file and offset."""

from __future__ import annotations

import datetime as dt
import json
import random
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pytest
from code_paths import code_path  # noqa: F401 - the fixture
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pyspark.sql.datasource import (
    EqualTo,
    Filter,
    GreaterThan,
    GreaterThanOrEqual,
    In,
    IsNotNull,
    LessThan,
    LessThanOrEqual,
    StringStartsWith,
)

from equeue import MessageStore, StoreConfig, speedups
from equeue.chunks.stream import ChunkFile
from equeue.errors import (
    ChunkRemovedError,
    CorruptionError,
    CorruptRecordError,
    DataLossError,
    SparkOptionError,
)
from equeue.format.chunk import FRAME_PREFIX_SIZE, HEADER_SIZE, record_checksum
from equeue.format.message import MessageLogRecord
from equeue.spark import source
from equeue.spark.columns import COLUMN_NAMES, record_bodies_py, record_columns_py

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

TOPICS = ("orders", "payments", "audit")
CONFIG = StoreConfig(chunk_data_size=64 * 1024, default_queue_count=3)
EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


def fill(path: Path, messages: int = 1500, seed: int = 7) -> None:
    rng = random.Random(seed)
    with MessageStore.open(path, CONFIG) as store:
        for _ in range(messages):
            store.send(
                rng.choice(TOPICS),
                rng.randbytes(rng.choice([0, rng.randrange(1, 300)])),
                tag=rng.choice(["", "red", "blue"]),
                key=rng.choice([None, f"k{rng.randrange(25)}", "ключ"]),
                properties=rng.choice([None, {}, {"a": "1", "é": "ü"}]),
            )


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three topics, one of them ("audit") deleted and created again midway: the log
    still holds the deleted topic's records, which no read may return."""
    path = tmp_path_factory.mktemp("source") / "store"
    fill(path, 750)
    with MessageStore.open(path) as opened:
        opened.delete_topic("audit")
    fill(path, 750, seed=8)
    return path


def reference(path: Path) -> dict[int, dict[str, Any]]:
    """Every message as a row, by position: each record unpacked alone, as the store's own
    reads do (MessageLogRecord), not by the code under test."""
    store_id, chunks = source.store_snapshot(str(path))
    with MessageStore.open(path, read_only=True) as opened:
        deleted = opened.deleted_topics()
    rows: dict[int, dict[str, Any]] = {}
    for chunk_path, end in chunks:
        for _, payload in ChunkFile.open(chunk_path, end).records():
            r = MessageLogRecord.unpack(payload)
            if r.log_position < deleted.get(r.topic, 0):
                continue  # the deleted topic's, as pull and query_by_key hide them
            rows[r.log_position] = {
                "topic": r.topic,
                "queue_id": r.queue_id,
                "queue_offset": r.queue_offset,
                "position": r.log_position,
                "message_id": f"{store_id:08x}{r.log_position:016x}",
                "tag": r.tag,
                "key": r.key,
                "properties": r.properties,
                "body": r.body,
                "created_at": r.created_ns // 1000,
                "stored_at": r.stored_ns // 1000,
            }
    return rows


def as_rows(batches: Iterator[pa.RecordBatch]) -> dict[int, dict[str, Any]]:
    rows: dict[int, dict[str, Any]] = {}
    for batch in batches:
        for row in batch.cast(batch.schema).to_pylist():
            for name in ("created_at", "stored_at"):
                if name in row:
                    row[name] = (row[name] - EPOCH) // dt.timedelta(microseconds=1)
            if "properties" in row:
                row["properties"] = dict(row["properties"])
            rows[row.get("position", len(rows))] = row
    return rows


def read_in_process(path: Path, filters: list[Filter], **options: str) -> tuple[list[Filter], Any]:
    """What Spark does with a reader, here: push, plan, read every partition."""
    reader = source.EqueueReader({"path": str(path.resolve()), **options})
    left = list(reader.pushFilters(filters))
    parts = reader.partitions()

    def batches() -> Iterator[pa.RecordBatch]:
        for part in parts:
            yield from reader.read(part)

    return left, (parts, batches())


# --- the columns --------------------------------------------------------------------


@pytest.mark.usefixtures("code_path")
def test_batches_equal_the_record_by_record_reference(store: Path) -> None:
    left, (parts, batches) = read_in_process(store, [])
    assert left == [] and len(parts) == len(source.store_snapshot(str(store))[1]) > 3
    assert as_rows(batches) == reference(store)


def test_c_and_python_build_the_same_bytes(store: Path) -> None:
    fast = speedups.SPEEDUPS
    if fast is None:
        pytest.skip("the C accelerator is not built")
    blocks = 0
    for path, end in source.store_snapshot(str(store))[1]:
        for _, buf, offsets, _ in ChunkFile.open(path, end).frame_blocks():
            blocks += 1
            assert fast.record_columns(buf, offsets, "0badcafe") == record_columns_py(
                buf, offsets, "0badcafe"
            )
            assert fast.record_bodies(buf, offsets) == record_bodies_py(buf, offsets)
            # A frame whose head's lengths do not add up: both stop at it.
            third = struct.unpack_from("<q", offsets, 16)[0]
            bad = bytearray(buf)
            bad[third + FRAME_PREFIX_SIZE + 52] ^= 1  # the body length
            got = fast.record_columns(bytes(bad), offsets, "0badcafe")
            assert got[0] == 2 and got == record_columns_py(bytes(bad), offsets, "0badcafe")
            assert fast.record_bodies(bytes(bad), offsets)[0] == 2
            assert record_bodies_py(bytes(bad), offsets)[0] == 2
    assert blocks > 3


def _forge(path: Path, offset: int, payload: bytes) -> None:
    """Rewrite the frame at data ``offset`` with this payload (same length) and a checksum
    that matches it: damage no frame check can see."""
    with open(path, "r+b") as f:
        f.seek(HEADER_SIZE + offset + FRAME_PREFIX_SIZE)
        f.write(payload + struct.pack("<I", record_checksum(payload)))


@pytest.mark.usefixtures("code_path")
def test_damage_is_reported_with_file_and_offset(tmp_path: Path) -> None:
    fill(tmp_path, 200)
    store_id, chunks = source.store_snapshot(str(tmp_path))
    path, end = chunks[0]
    chunk = ChunkFile.open(path, end)
    assert len(as_rows(source.scan(chunk, store_id, COLUMN_NAMES, None))) > 10  # the control
    records = list(chunk.records())
    offset, payload = records[5]
    forged = bytearray(payload)
    forged[52] ^= 1  # the body length: the head's lengths no longer add up
    _forge(Path(path), offset, bytes(forged))
    with pytest.raises(CorruptRecordError, match="do not add up") as forged_error:
        list(source.scan(ChunkFile.open(path, end), store_id, COLUMN_NAMES, None))
    assert forged_error.value.file == path and forged_error.value.offset == HEADER_SIZE + offset
    with pytest.raises(CorruptRecordError, match="do not add up") as forged_error:  # one frame
        list(source.records_at(ChunkFile.open(path, end), [offset], store_id, ["body"], None))
    assert forged_error.value.file == path and forged_error.value.offset == HEADER_SIZE + offset
    # A flipped body byte: the frame's checksum catches it (frame_blocks), never a row.
    _forge(Path(path), offset, payload)
    with open(path, "r+b") as f:
        f.seek(HEADER_SIZE + offset + FRAME_PREFIX_SIZE + len(payload) - 1)
        last = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([last[0] ^ 0xFF]))
    with pytest.raises(CorruptionError) as raised:
        list(source.scan(ChunkFile.open(path, end), store_id, COLUMN_NAMES, None))
    assert raised.value.file == path and raised.value.offset == HEADER_SIZE + offset
    # Through an index (a key filter) the same frame is read alone, and checked alike.
    with pytest.raises(CorruptionError) as raised:
        list(source.records_at(ChunkFile.open(path, end), [offset], store_id, ["body"], None))
    assert raised.value.file == path and raised.value.offset == HEADER_SIZE + offset


def test_columns_option_builds_only_those(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gathered: list[int] = []

    def spy(buf: bytes, offsets: bytes) -> tuple[int, bytes, bytes]:
        gathered.append(len(offsets) // 8)
        return record_bodies_py(buf, offsets)

    monkeypatch.setattr(speedups, "SPEEDUPS", None)  # the Python path, where a spy can sit
    monkeypatch.setattr("equeue.spark.columns.record_bodies_py", spy)
    _, (_, batches) = read_in_process(store, [], columns="topic,queue_offset")
    rows = list(as_rows(batches).values())
    assert gathered == []  # no body gathered
    want = reference(store)
    _, (_, batches) = read_in_process(store, [], columns="body")  # the control
    assert sum(batch.num_rows for batch in batches) == sum(gathered) == len(want)
    assert sorted((r["topic"], r["queue_offset"]) for r in rows) == sorted(
        (r["topic"], r["queue_offset"]) for r in want.values()
    )
    assert source.schema_for({"columns": "body, topic"}) == "body binary, topic string"
    with pytest.raises(SparkOptionError, match=r"unknown 'bodies', 'nope'.*topic, queue_id"):
        source.schema_for({"columns": "bodies,topic,nope"})
    with pytest.raises(SparkOptionError, match="twice"):
        source.schema_for({"columns": "topic,topic"})
    with pytest.raises(SparkOptionError, match="fields"):
        source.schema_for({"columns": "topic", "fields": "meta"})


# --- filter pushdown ----------------------------------------------------------------


def _local(us: int) -> dt.datetime:
    """A Spark timestamp as ``collect()`` hands it to Python: a naive local datetime."""
    return (EPOCH + dt.timedelta(microseconds=us)).astimezone().replace(tzinfo=None)


def _utc(us: int) -> dt.datetime:
    """A Spark timestamp as Spark 4.3 hands a pushed filter's value: aware, in UTC."""
    return EPOCH + dt.timedelta(microseconds=us)


def _value(column: str, v: Any) -> Any:
    return _utc(v) if column in ("stored_at", "created_at") else v


def holds(f: Filter, row: dict[str, Any]) -> bool:
    """Spark's meaning of a filter, on a reference row (NULL compares false)."""
    column = f.attribute[0]  # type: ignore[attr-defined]
    v = row[column]
    if isinstance(f, IsNotNull):
        return v is not None
    if v is None:
        return False
    if column in ("stored_at", "created_at"):
        v = _utc(v)
    if isinstance(f, EqualTo):
        return bool(v == f.value)
    if isinstance(f, In):
        return v in f.value
    if isinstance(f, StringStartsWith):
        return bool(v.startswith(f.value))
    compare: Callable[[Any, Any], bool] = {
        GreaterThan: lambda a, b: a > b,
        GreaterThanOrEqual: lambda a, b: a >= b,
        LessThan: lambda a, b: a < b,
        LessThanOrEqual: lambda a, b: a <= b,
    }[type(f)]
    return compare(v, f.value)  # type: ignore[attr-defined]


def filters_of(rows: list[dict[str, Any]]) -> st.SearchStrategy[list[Filter]]:
    """Random ANDed filters of every kind pushed, with values from the rows (and beside)."""
    near = st.sampled_from(rows)

    def one(column: str) -> st.SearchStrategy[Filter]:
        value = near.map(lambda r: r[column])
        if column in ("topic", "tag", "key"):
            text = st.one_of(value.filter(lambda v: v is not None), st.just("absent"))
            return st.one_of(
                text.map(lambda v: EqualTo((column,), v)),
                st.lists(text, min_size=1, max_size=3).map(lambda vs: In((column,), tuple(vs))),
                text.map(lambda v: StringStartsWith((column,), v[:1])),  # not taken
            )
        shifted = st.tuples(value, st.integers(-1, 1)).map(lambda p: _value(column, p[0] + p[1]))
        kinds: list[Any] = [GreaterThan, GreaterThanOrEqual, LessThan, LessThanOrEqual, EqualTo]
        return st.one_of(
            st.tuples(st.sampled_from(kinds), shifted).map(lambda p: p[0]((column,), p[1])),
            st.lists(shifted, min_size=1, max_size=3).map(lambda vs: In((column,), tuple(vs)))
            if column in ("queue_id", "queue_offset")
            else shifted.map(lambda v: GreaterThan((column,), v)),
        )

    columns = [
        "topic",
        "tag",
        "key",
        "queue_id",
        "queue_offset",
        "position",
        "stored_at",
        "created_at",
    ]
    return st.lists(st.sampled_from(columns).flatmap(one), min_size=1, max_size=4)


_ROWS: dict[Path, dict[int, dict[str, Any]]] = {}


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_pushed_filters_keep_exactly_the_rows_spark_would(store: Path, data: st.DataObject) -> None:
    want = _ROWS.setdefault(store, reference(store))
    filters = data.draw(filters_of(list(want.values())))
    left, (_, batches) = read_in_process(store, filters)
    assert all(any(f is g for g in filters) for f in left)  # returned by reference
    # Only what this reader cannot do comes back: prefixes (and IsNotNull) stay Spark's.
    assert all(isinstance(f, StringStartsWith) for f in left)
    got = {p: r for p, r in as_rows(batches).items() if all(holds(f, r) for f in left)}
    assert got == {p: r for p, r in want.items() if all(holds(f, r) for f in filters)}


def test_a_stored_at_range_skips_chunks_by_their_footers(store: Path) -> None:
    want = reference(store)
    times = sorted(r["stored_at"] for r in want.values())
    cut = times[-len(times) // 10]
    source.READ_BYTES[0] = 0
    left, (parts, batches) = read_in_process(
        store, [GreaterThanOrEqual(("stored_at",), _local(cut))]
    )
    rows = as_rows(batches)
    assert left == [] and rows == {p: r for p, r in want.items() if r["stored_at"] >= cut}
    chunks = source.store_snapshot(str(store))[1]
    assert 1 <= len(parts) <= 3 < len(chunks)
    assert source.READ_BYTES[0] == sum(p.data_end for p in parts)
    # Before every record: nothing skipped; after the last: only the ongoing chunk is read.
    assert len(
        read_in_process(store, [GreaterThan(("stored_at",), _local(times[0] - 1))])[1][0]
    ) == len(chunks)
    _, (parts, batches) = read_in_process(store, [GreaterThan(("stored_at",), _local(times[-1]))])
    assert [p.path for p in parts] == [chunks[-1][0]] and as_rows(batches) == {}


def test_key_and_queue_filters_read_only_indexed_records(store: Path) -> None:
    want = reference(store)
    total = sum(end for _, end in source.store_snapshot(str(store))[1])
    source.READ_BYTES[0] = 0
    left, (parts, batches) = read_in_process(store, [EqualTo(("key",), "k3")])
    rows = as_rows(batches)
    assert left == [] and rows == {p: r for p, r in want.items() if r["key"] == "k3"}
    assert len(parts) == 1 and isinstance(parts[0], source.IndexedPartition)
    frames = sum(len(MessageLogRecord(**_record(r)).pack()) + 12 for r in rows.values())
    assert source.READ_BYTES[0] == frames < total // 10
    source.READ_BYTES[0] = 0
    filters = [
        EqualTo(("topic",), "orders"),
        In(("queue_id",), (1,)),
        GreaterThanOrEqual(("queue_offset",), 20),
        LessThan(("queue_offset",), 30),
    ]
    left, (parts, batches) = read_in_process(store, filters)
    rows = as_rows(batches)
    assert left == [] and sorted(r["queue_offset"] for r in rows.values()) == list(range(20, 30))
    assert {r["topic"] for r in rows.values()} == {"orders"} and len(parts) <= 3
    assert source.READ_BYTES[0] < total // 20
    # Filters no record can pass plan nothing.
    assert read_in_process(store, [EqualTo(("topic",), "a"), EqualTo(("topic",), "b")])[1][0] == []
    assert read_in_process(store, [EqualTo(("key",), "absent")])[1][0] == []


def test_a_deleted_topic_is_left_out_whatever_filter_is_pushed(tmp_path: Path) -> None:
    with MessageStore.open(tmp_path) as opened:
        opened.send("t", b"old1", key="k")
        opened.send("t", b"old2")
        opened.send("u", b"other", key="k")
        opened.delete_topic("t")
        opened.send("t", b"new1", key="k")
        opened.send("t", b"new2", key="")
    with MessageStore.open(tmp_path, read_only=True) as opened:  # what the store's API gives
        assert [m.body for m in opened.query_by_key("t", "k")] == [b"new1"]
        by_key = opened.query_by_key("t", "k")
        assert opened.key_positions("t", "k") == [m.position for m in by_key]
        pulled = [m.body for q in opened.queue_ids("t") for m in opened.pull("t", q, 0).messages]
        assert sorted(pulled) == [b"new1", b"new2"]
    pushes: list[list[Filter]] = [
        [],  # a scan
        [EqualTo(("topic",), "t")],  # a scan, filtered
        [EqualTo(("key",), "k")],  # the key index
        [EqualTo(("topic",), "t"), In(("queue_id",), (0, 1, 2, 3))],  # the queues' index
        [EqualTo(("topic",), "t"), GreaterThan(("queue_id",), -1)],  # a scan: no index
    ]
    for filters in pushes:
        _, (_, batches) = read_in_process(tmp_path, filters, columns="topic,body")
        bodies = sorted(r["body"] for r in as_rows(batches).values())
        want = [b"new1", b"new2"] if filters else [b"new1", b"new2", b"other"]
        assert bodies == (want if filters != pushes[2] else [b"new1", b"other"]), filters


def test_an_index_read_is_batched_by_bytes_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Messages an index names are read a block's bytes at a time, as a scan reads them,
    not BATCH_ROWS whole messages at once (300 keyed 1 MiB bodies were one 255 MiB
    batch)."""
    with MessageStore.open(tmp_path, StoreConfig(chunk_data_size=4 << 20)) as opened:
        for i in range(40):
            opened.send("t", bytes([i]) * 20_000, key="k")
    monkeypatch.setattr(source, "BLOCK_SIZE", 64 * 1024)
    left, (parts, batches) = read_in_process(tmp_path, [EqualTo(("key",), "k")], columns="body")
    assert left == [] and isinstance(parts[0], source.IndexedPartition)
    sizes = [(b.num_rows, sum(len(v) for v in b.column(0).to_pylist())) for b in batches]
    assert sum(n for n, _ in sizes) == 40 and len(sizes) > 1  # the control: every row
    assert max(size for _, size in sizes) <= 64 * 1024 + 20_000  # a block, and a frame


def test_a_chunk_retention_removed_after_planning_is_named(tmp_path: Path) -> None:
    config = StoreConfig(chunk_data_size=64 * 1024, retention=dt.timedelta(seconds=1))
    pushes: list[tuple[str, list[Filter]]] = [("scan", []), ("key", [EqualTo(("key",), "k1")])]
    for name, filters in pushes:
        path = tmp_path / name
        with MessageStore.open(path, config) as opened:
            for i in range(300):
                opened.send("t", bytes(900), key=f"k{i % 3}")
        chunks = source.store_snapshot(str(path))[1]
        reader = source.EqueueReader({"path": str(path), "columns": "key"})
        assert list(reader.pushFilters(filters)) == []
        parts = reader.partitions()
        # The control: the plan reads every row while its chunks are there.
        rows = sum(b.num_rows for p in parts for b in reader.read(p))
        assert rows == (300 if not filters else 100)
        with MessageStore.open(path, config) as opened:
            assert opened.apply_retention(now=time.time() + 60) > 0
            assert len(opened.chunk_files()) == 1 < len(chunks)
        with pytest.raises(ChunkRemovedError, match=r"chunk-0+\.0+ was removed.*re-run") as e:
            for part in parts:
                list(reader.read(part))
        assert chunks[0][0] in str(e.value)


def test_options_are_checked_when_the_reader_is_made(store: Path) -> None:
    given = {"path": str(store)}
    for options, problem in [
        ({"colums": "topic"}, "unknown option 'colums'.*path, fields, columns"),
        ({"jobId": "x"}, "unknown option 'jobId'"),
        ({"store_id": "abc"}, "store_id='abc'"),
        ({"store_id": "²"}, "store_id='²'"),
        ({"store_id": "1" * 5000}, "store_id='1111"),  # (int() raised a builtin ValueError)
        ({"store_id": str(1 << 32)}, "store_id"),
        ({"chunks": "nope"}, "chunks='nope'.*JSON list"),
        ({"chunks": "[[1]]"}, "chunks"),
        ({"chunks": '[["a", -1]]'}, "chunks"),
        ({"chunks": '{"a": 1}'}, "chunks"),
    ]:
        with pytest.raises(SparkOptionError, match=problem):
            source.EqueueReader({**given, **options})
    # The control: known options, in any case (Spark's options are case-insensitive).
    _, chunks = source.store_snapshot(str(store))
    reader = source.EqueueReader(
        {**given, "COLUMNS": "topic", "store_id": "7", "chunks": json.dumps(chunks[:1])}
    )
    assert len(reader.partitions()) == 1


def _record(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "log_position": row["position"],
        "topic": row["topic"],
        "queue_id": row["queue_id"],
        "queue_offset": row["queue_offset"],
        "body": row["body"],
        "stored_ns": 0,
        "created_ns": 0,
        "tag": row["tag"],
        "key": row["key"],
        "properties": row["properties"],
    }


# --- through Spark ------------------------------------------------------------------


def test_spark_pushes_filters_and_prunes_partitions(store: Path, spark: SparkSession) -> None:
    want = reference(store)
    frame = spark.read.format("equeue").load(str(store))
    chunks = len(source.store_snapshot(str(store))[1])
    assert frame.rdd.getNumPartitions() == chunks
    times = sorted(r["stored_at"] for r in want.values())
    cut = _local(times[-len(times) // 10])
    queries: dict[str, Callable[[dict[str, Any]], bool]] = {
        "topic IN ('orders', 'audit') AND tag = 'red'": lambda r: (
            r["topic"] in ("orders", "audit") and r["tag"] == "red"
        ),
        "key = 'k4'": lambda r: r["key"] == "k4",
        "topic = 'payments' AND queue_id = 2 AND queue_offset BETWEEN 5 AND 9": lambda r: (
            r["topic"] == "payments" and r["queue_id"] == 2 and 5 <= r["queue_offset"] <= 9
        ),
    }
    for condition, keep in queries.items():
        got = {r["position"] for r in frame.filter(condition).select("position").collect()}
        assert got == {p for p, r in want.items() if keep(r)}, condition
    late = frame.filter(frame.stored_at > cut)
    assert late.rdd.getNumPartitions() < chunks
    assert {r["position"] for r in late.select("position").collect()} == {
        p for p, r in want.items() if _local(r["stored_at"]) > cut
    }
    # The columns option: count and groupBy on topics alone.
    topics = spark.read.format("equeue").option("columns", "topic").load(str(store))
    assert topics.columns == ["topic"] and topics.count() == len(want)
    counts = {r["topic"]: r["count"] for r in topics.groupBy("topic").count().collect()}
    assert counts == {t: sum(r["topic"] == t for r in want.values()) for t in TOPICS}


def test_a_session_without_pushdown_enabled_says_which_setting(
    store: Path, spark: SparkSession
) -> None:
    spark.conf.set("spark.sql.python.filterPushdown.enabled", "false")
    try:
        with pytest.raises(Exception, match=r"spark\.sql\.python\.filterPushdown\.enabled"):
            spark.read.format("equeue").load(str(store)).count()
    finally:
        spark.conf.set("spark.sql.python.filterPushdown.enabled", "true")
    assert spark.read.format("equeue").option("columns", "topic").load(str(store)).count() > 0


def test_compacted_chunks_read_by_scan_and_by_key(tmp_path: Path, spark: SparkSession) -> None:
    """A compacted chunk's records sit at other data offsets than their positions say: a
    scan takes their positions from the heads, and a key filter reads such a chunk whole."""
    from equeue.compaction.job import compact

    rng = random.Random(3)
    with MessageStore.open(tmp_path, StoreConfig(chunk_data_size=8 * 1024, flush="os")) as s:
        s.create_topic("k", 2, cleanup="compact")
        for _ in range(400):
            s.send("k", rng.randbytes(rng.randrange(1, 60)), key=f"key-{rng.randrange(15)}")
    before = reference(tmp_path)
    # Plans made before the compaction install, read after it (their files replaced).
    pushes: dict[str, list[Filter]] = {"scan": [], "key": [EqualTo(("key",), "key-3")]}
    planned = {name: read_in_process(tmp_path, filters) for name, filters in pushes.items()}
    report = compact(tmp_path, spark=spark, now=time.time() + 1)
    assert report.records_removed > 0
    after = reference(tmp_path)
    assert len(after) < len(before)
    gone = [
        p
        for _, (parts, _) in planned.values()
        for p in parts
        if isinstance(p, source.ChunkPartition) and not Path(p.path).exists()
    ]
    assert gone  # the control: the plans name files the install removed
    assert as_rows(planned["scan"][1][1]) == after  # the survivors, each once
    assert as_rows(planned["key"][1][1]) == {p: r for p, r in after.items() if r["key"] == "key-3"}
    chunks = [ChunkFile.open(p, e) for p, e in source.store_snapshot(str(tmp_path))[1]]
    assert any(c.compacted for c in chunks)
    want = reference(tmp_path)
    _, (_, batches) = read_in_process(tmp_path, [])
    assert as_rows(batches) == want
    left, (parts, batches) = read_in_process(tmp_path, [EqualTo(("key",), "key-3")])
    assert left == [] and as_rows(batches) == {p: r for p, r in want.items() if r["key"] == "key-3"}
    assert any(isinstance(p, source.ChunkPartition) for p in parts)  # a compacted one, whole


# --- startingOffsets / endingOffsets: queue ranges, as Spark's Kafka source reads a batch ---


def pulled(path: Path, ranges: dict[tuple[str, int], tuple[int, int]]) -> set[int]:
    """The positions MessageStore.pull returns for offsets [start, end) of each queue."""
    found: set[int] = set()
    with MessageStore.open(path, read_only=True) as opened:
        for (topic, queue), (start, end) in ranges.items():
            if end > start:
                batch = opened.pull(topic, queue, start, end - start).messages
                found.update(m.position for m in batch if m.queue_offset < end)
    return found


def queue_ends(path: Path, topic: str) -> dict[int, tuple[int, int]]:
    with MessageStore.open(path, read_only=True) as opened:
        opened.refresh()
        return {q: opened.queue_range(topic, q) for q in opened.queue_ids(topic)}


def test_offsets_options_read_those_queue_ranges(store: Path) -> None:
    want = reference(store)
    total = sum(end for _, end in source.store_snapshot(str(store))[1])
    ends = queue_ends(store, "orders")
    assert all(end > 30 for _, end in ends.values())  # the fixture: ranges to cut
    source.READ_BYTES[0] = 0
    starting = json.dumps({"orders": {"0": 5, "1": -2}})
    ending = json.dumps({"orders": {"0": 20, "2": 7}})
    options = {"topics": "orders", "startingOffsets": starting, "endingOffsets": ending}
    _, (parts, batches) = read_in_process(store, [], **options)
    rows = as_rows(batches)
    ranges = {("orders", 0): (5, 20), ("orders", 1): (0, ends[1][1]), ("orders", 2): (0, 7)}
    assert set(rows) == pulled(store, ranges) and rows == {p: want[p] for p in rows}
    assert parts and all(isinstance(p, source.IndexedPartition) for p in parts)
    frames = sum(len(MessageLogRecord(**_record(r)).pack()) + 12 for r in rows.values())
    assert source.READ_BYTES[0] == frames < total // 2  # only those records were read
    # Defaults: earliest to latest of every queue; topics and topicPattern alike.
    for named in ({"topics": "orders"}, {"topicPattern": "ord.*"}, {"TOPICS": "orders"}):
        _, (_, batches) = read_in_process(store, [], **named)
        assert as_rows(batches) == {p: r for p, r in want.items() if r["topic"] == "orders"}
    _, (_, batches) = read_in_process(store, [], topicPattern="orders|audit", columns="topic")
    got = [r["topic"] for r in as_rows(batches).values()]
    assert sorted(got) == sorted(r["topic"] for r in want.values() if r["topic"] != "payments")
    # With a pushed filter too: the rows both allow.
    filters: list[Filter] = [EqualTo(("tag",), "red")]
    _, (_, batches) = read_in_process(store, filters, **options)
    assert as_rows(batches) == {p: r for p, r in rows.items() if r["tag"] == "red"}
    # The control: no offsets option reads the whole store, as before.
    _, (parts, batches) = read_in_process(store, [])
    assert as_rows(batches) == want and all(isinstance(p, source.ChunkPartition) for p in parts)


def test_offsets_options_through_spark(store: Path, spark: SparkSession) -> None:
    ending = json.dumps({"payments": {"1": 10}})
    frame = (
        spark.read.format("equeue")
        .option("topics", "payments")
        .option("startingOffsets", json.dumps({"payments": {"1": 3}}))
        .option("endingOffsets", ending)
        .load(str(store))
    )
    ends = queue_ends(store, "payments")
    ranges = {
        ("payments", q): (3 if q == 1 else 0, 10 if q == 1 else e) for q, (_, e) in ends.items()
    }
    assert {r["position"] for r in frame.select("position").collect()} == pulled(store, ranges)


def test_offsets_options_errors(store: Path, tmp_path: Path) -> None:
    given = {"path": str(store), "topics": "orders"}
    made: list[tuple[dict[str, str], str]] = [
        ({"startingOffsets": "latest"}, "startingOffsets='latest' is not for a batch read"),
        ({"endingOffsets": "earliest"}, "endingOffsets='earliest' is not for a batch read"),
        ({"startingOffsets": "{nope"}, "option startingOffsets=.*not JSON"),
        ({"endingOffsets": '{"orders": {"0": -3}}'}, "option endingOffsets=.*-3"),
        ({"endingOffsets": '{"orders": {"x": 1}}'}, "option endingOffsets=.*queue id 'x'"),
        ({"startingOffsets": '{"orders": {"0": -1}}'}, "startingOffsets: offset -1"),
        ({"endingOffsets": '{"orders": {"0": -2}}'}, "endingOffsets: offset -2"),
        ({"endingOffsets": '{"payments": {"0": 1}}'}, "names topic 'payments'.*not select"),
        ({"topicPattern": "o.*"}, "exactly one of .*got both"),
        ({"chunks": "[]"}, "option chunks does not go with"),
    ]
    for options, problem in made:
        with pytest.raises(SparkOptionError, match=problem):
            source.EqueueReader({**given, **options})
    with pytest.raises(SparkOptionError, match=r"exactly one of .*got neither"):
        source.EqueueReader({"path": str(store), "startingOffsets": "earliest"})
    with pytest.raises(SparkOptionError, match="failOnDataLoss goes with"):
        source.EqueueReader({"path": str(store), "failOnDataLoss": "false"})
    end = queue_ends(store, "orders")[0][1]
    planned: list[tuple[dict[str, str], str]] = [
        ({"topics": "orders,absent"}, "names topic 'absent', which .* does not hold"),
        ({"endingOffsets": '{"orders": {"7": 1}}'}, "orders/7: topic 'orders' .* queues 0 to 2"),
        (
            {"startingOffsets": '{"orders": {"0": 9}}', "endingOffsets": '{"orders": {"0": 4}}'},
            "startingOffsets 9 of orders/0 is past its endingOffsets 4",
        ),
        ({"endingOffsets": f'{{"orders": {{"0": {end + 1}}}}}'}, "past the queue's end"),
    ]
    for options, problem in planned:
        reader = source.EqueueReader({**given, **options})
        with pytest.raises(SparkOptionError, match=problem):
            reader.partitions()
    # Offsets retention removed: DataLossError, or with failOnDataLoss=false what is left.
    config = StoreConfig(chunk_data_size=16 * 1024, retention=dt.timedelta(seconds=1))
    with MessageStore.open(tmp_path, config) as opened:
        for i in range(200):
            opened.send("t", bytes(300), key=f"k{i}")
        assert opened.apply_retention(now=time.time() + 60) > 0
    first, end = queue_ends(tmp_path, "t")[0]
    assert 0 < first < end  # the control: offsets below first are gone, some are left
    lost = {"topics": "t", "startingOffsets": '{"t": {"0": 0}}'}
    with pytest.raises(DataLossError, match=r"offsets 0 to .* removed.*failOnDataLoss=false"):
        source.EqueueReader({"path": str(tmp_path), **lost}).partitions()
    _, (_, batches) = read_in_process(tmp_path, [], **lost, failOnDataLoss="false")
    left = pulled(tmp_path, {("t", q): span for q, span in queue_ends(tmp_path, "t").items()})
    assert set(as_rows(batches)) == left and len(left) < 200


def test_offsets_options_on_a_compacted_store(tmp_path: Path, spark: SparkSession) -> None:
    """Compaction's holes are read as holes: the survivors of the range, as pull gives."""
    from equeue.compaction.job import compact

    rng = random.Random(5)
    with MessageStore.open(tmp_path, StoreConfig(chunk_data_size=8 * 1024, flush="os")) as s:
        s.create_topic("k", 2, cleanup="compact")
        for _ in range(400):
            s.send("k", rng.randbytes(rng.randrange(1, 60)), key=f"key-{rng.randrange(15)}")
    assert compact(tmp_path, spark=spark, now=time.time() + 1).records_removed > 0
    ends = queue_ends(tmp_path, "k")
    ranges = {("k", 0): (10, 150), ("k", 1): (0, ends[1][1])}
    want = pulled(tmp_path, ranges)
    assert len(want) < 140 + ends[1][1]  # the control: the range has holes
    options = {"topics": "k", "startingOffsets": '{"k": {"0": 10}}'}
    _, (parts, batches) = read_in_process(
        tmp_path, [], **options, endingOffsets='{"k": {"0": 150}}'
    )
    assert set(as_rows(batches)) == want
    assert any(isinstance(p, source.ChunkPartition) for p in parts)  # a compacted one, whole
    # The index names the holes too (their entries stay): a superset of the survivors.
    first, end = ends[0]
    with MessageStore.open(tmp_path, read_only=True) as opened:
        positions = source.queue_index_positions(opened, [("k", 0, first, end)])
    survivors = pulled(tmp_path, {("k", 0): (first, end)})
    assert positions is not None and len(positions) == end - first
    assert 0 < len(survivors) < end - first and survivors < set(positions)
