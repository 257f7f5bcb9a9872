"""The Spark sink: rows of a DataFrame or a stream appended to a store through one writer,
all or nothing, exactly once across task kills, a killed commit, aborted jobs and a
restarted streaming query."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from sink_child import frame

from equeue import MessageStore, StoreConfig
from equeue.atomicfile import write_json
from equeue.chunks.config import MiB
from equeue.errors import SinkCommitError, SparkOptionError
from equeue.spark import ledger
from equeue.spark.aborted import ABORTED_DIR
from equeue.spark.ledger import INCOMING_DIR, Incoming, Job
from equeue.spark.sink import KILL_TASK_ENV
from equeue.spark.sinkcommit import KILL_AFTER_ENV, commit
from equeue.store.types import Message

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

HERE = Path(__file__).parent


def stored(path: Path, topic: str) -> list[Message]:
    """Every message of ``topic``, queue by queue, in offset order."""
    with MessageStore.open(path, read_only=True) as store:
        if topic not in store.topics():
            return []
        found: list[Message] = []
        for queue_id in store.queue_ids(topic):
            offset, end = store.queue_range(topic, queue_id)
            for _ in range(end - offset + 1):  # bounded: one pull returns one message at least
                pulled = store.pull(topic, queue_id, offset, max_count=8192)
                if not pulled:
                    break
                found += pulled.messages
                offset = pulled.next_offset
        return found


def new_store(path: Path) -> Path:
    MessageStore.open(path).close()
    return path


def incoming(path: Path) -> list[str]:
    root = path / INCOMING_DIR
    return sorted(os.listdir(root)) if root.exists() else []


def save(df: DataFrame, path: Path, topic: str = "t", **options: str) -> None:
    writer = df.write.format("equeue").option("topic", topic).mode("append")
    for name, value in options.items():
        writer = writer.option(name, value)
    writer.save(str(path))


def test_rows_from_four_partitions_across_chunk_rollovers_are_each_stored_once(
    tmp_path: Path, spark: SparkSession
) -> None:
    """200,000 rows (20 Arrow batches of Spark's default 10,000) into a store of 1 MiB
    log chunks and 8,192-entry queue chunks: the commit's appends cross a dozen log and
    five queue chunk boundaries in every queue. (A million rows into the default 256 MiB
    chunks crossed none, and took five times as long.)"""
    store = tmp_path / "s"
    MessageStore.open(store, StoreConfig(chunk_data_size=MiB, queue_chunk_records=8192)).close()
    rows = 200_000
    df = spark.range(0, rows, numPartitions=4).selectExpr(
        "cast(id as string) as body", "concat('g', cast(id % 3 as string)) as tag"
    )
    save(df, store)
    seen = bytearray(rows)  # one byte per row: how often it was read back
    wrong = []
    with MessageStore.open(store, read_only=True) as opened:
        for queue_id in opened.queue_ids("t"):
            offset, end = opened.queue_range("t", queue_id)
            while offset < end:  # bounded: every pull returns at least one message
                pulled = opened.pull("t", queue_id, offset, max_count=1024)
                for m in pulled:
                    n = int(m.body)
                    seen[n] += 1
                    if m.tag != f"g{n % 3}" or m.key is not None:
                        wrong.append(m)
                offset = pulled.next_offset
    assert seen == bytearray([1]) * rows and wrong == []
    assert incoming(store) == ["ledger.json"]  # the staged files went with the commit
    assert len(list((store / "messages").glob("chunk-*"))) >= 10
    assert all(len(list(q.glob("chunk-*"))) >= 5 for q in (store / "queues" / "t").iterdir())


def test_every_column_reaches_the_store(tmp_path: Path, spark: SparkSession) -> None:
    store = new_store(tmp_path / "s")
    df = spark.createDataFrame(
        [
            (bytearray(b"\x00\xffraw"), "k1", "a", {"p": "1", "q": "2"}, 2),
            (bytearray(b"plain"), None, None, None, None),
            (bytearray(b""), "k3", "c", {}, 0),
        ],
        "body binary, key string, tag string, properties map<string,string>, queue_id int",
    ).coalesce(1)
    save(df, store, topic="cols")
    got = sorted(stored(store, "cols"), key=lambda m: m.position)
    assert [(m.body, m.key, m.tag, m.properties) for m in got] == [
        (b"\x00\xffraw", "k1", "a", {"p": "1", "q": "2"}),
        (b"plain", None, "", {}),
        (b"", "k3", "c", {}),
    ]
    assert got[0].queue_id == 2 and got[2].queue_id == 0
    strings = spark.createDataFrame([("héllo",)], "body string")
    save(strings, store, topic="text")
    assert [m.body for m in stored(store, "text")] == ["héllo".encode()]


@pytest.mark.parametrize(
    ("schema", "options", "expected"),
    [
        ("key string", {}, "SparkSchemaError: the equeue sink needs a body column"),
        ("body string, value string", {}, "column 'value' of type string is not a column"),
        ("body string, key int", {}, "column 'key' of type int has a type the sink cannot"),
        (
            "body binary, properties map<string,int>",
            {},
            "column 'properties' of type map<string,int> has a type",
        ),
        ("body binary, topic string", {}, 'the topic is an option: .option("topic", T)'),
        ("body binary", {"topic": ""}, 'SparkOptionError: the equeue sink needs option("topic"'),
        ("body binary", {"jobId": "../x"}, "SparkOptionError: option jobId='../x'"),
        ("body binary", {"mode": "overwrite"}, "a message log cannot be overwritten"),
        ("body binary", {"job_id": "j"}, "unknown option 'job_id'; the options are path, topic"),
        ("body binary", {"checkpointLocation": "/c"}, "unknown option 'checkpointlocation'"),
    ],
)
def test_rows_of_other_shapes_are_refused_before_any_task_runs(
    tmp_path: Path, spark: SparkSession, schema: str, options: dict[str, str], expected: str
) -> None:
    store = new_store(tmp_path / "s")
    df = spark.createDataFrame([], schema)
    writer = df.write.format("equeue").mode(options.pop("mode", "append"))
    writer = writer.option("topic", options.pop("topic", "t"))
    for name, value in options.items():
        writer = writer.option(name, value)
    with pytest.raises(Exception) as caught:
        writer.save(str(store))
    assert expected in str(caught.value)
    assert incoming(store) == []  # no task ran: nothing was staged


def test_a_failing_task_aborts_the_job_and_appends_nothing(
    tmp_path: Path, spark: SparkSession
) -> None:
    store = new_store(tmp_path / "s")
    # Row 39_999 (the last partition) has a tag longer than a tag may be: its task fails
    # after the other partitions staged their rows.
    df = spark.range(0, 40_000, numPartitions=4).selectExpr(
        "cast(id as string) as body", "if(id = 39999, repeat('x', 300), 'ok') as tag"
    )
    with pytest.raises(Exception) as caught:
        save(df, store, jobId="bad")
    assert "InvalidMessageError: the equeue sink cannot send row 9999 of partition 3" in str(
        caught.value
    )
    assert "tag is 300 bytes UTF-8" in str(caught.value)
    assert stored(store, "t") == []
    # abort() removed the staged files of the other tasks, leaving the run's abort marker
    assert incoming(store) == [ABORTED_DIR]
    # Control: the same job without the bad row commits every row.
    save(df.where("id < 39999"), store, jobId="bad")
    assert len(stored(store, "t")) == 39_999


def test_a_rerun_of_a_job_id_appends_nothing_twice(tmp_path: Path, spark: SparkSession) -> None:
    store = new_store(tmp_path / "s")
    df = spark.range(0, 5000, numPartitions=2).selectExpr("cast(id as string) as body")
    save(df, store, jobId="daily-2026-11-25")
    save(df, store, jobId="daily-2026-11-25")
    assert len(stored(store, "t")) == 5000
    save(df, store)  # no jobId: a job of its own
    assert len(stored(store, "t")) == 10_000


def test_a_task_killed_mid_write_and_a_commit_killed_mid_append(
    tmp_path: Path, spark: SparkSession
) -> None:
    """One driver subprocess (local[2,4]: tasks are retried): partition 1's Python worker
    is SIGKILLed after staging 4000 of its rows, and its retry stages them again; the
    commit's process is SIGKILLed after appending 12_000 of the 40_000 rows. Re-running
    the job (same jobId, here) appends the rest: every row exactly once."""
    store = new_store(tmp_path / "s")
    rows = 40_000
    env = dict(os.environ, **{KILL_TASK_ENV: "1:4000", KILL_AFTER_ENV: "12000"})
    child = subprocess.run(
        [sys.executable, str(HERE / "sink_child.py"), str(store), "j1", str(rows)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode != 0 and "Python worker exited unexpectedly" in child.stderr
    job_dir = store / INCOMING_DIR / "batch-j1"
    intent = json.loads((job_dir / "intent.json").read_text())["body"]
    assert sorted(n for _, n in intent["files"]) == [10_000] * 4
    # The killed attempt's temp file (its first 4000 rows) is there, never appended.
    (temp,) = [n for n in os.listdir(job_dir) if n.endswith(".tmp")]
    assert temp.startswith("1-") and temp.removesuffix(".tmp") not in dict(intent["files"])
    partial = len(stored(store, "t"))
    assert 12_000 <= partial < rows  # the commit died part way
    save(frame(spark, rows), store, jobId="j1")
    messages = stored(store, "t")
    assert Counter(int(m.body) for m in messages) == Counter(range(rows))
    assert all(m.key == f"k{int(m.body) % 97}" for m in messages)
    # the temp file went with the job's directory; Spark aborted the first run (its marker)
    assert incoming(store) == [ABORTED_DIR, "ledger.json"]


def test_a_store_open_for_writing_elsewhere_fails_the_commit_in_one_line(
    tmp_path: Path, spark: SparkSession
) -> None:
    store = new_store(tmp_path / "s")
    df = spark.range(0, 1000, numPartitions=2).selectExpr("cast(id as string) as body")
    with MessageStore.open(store) as held:
        held.send("t", b"held")
        with pytest.raises(Exception) as caught:
            save(df, store, jobId="locked")
    said = str(caught.value).splitlines()
    lines = [line for line in said if line.startswith("equeue.errors.SinkCommitError: ")]
    assert (
        lines
        and (
            f"the store at {store} is open for writing by another process (pid {os.getpid()}): "
            "the sink appends through its own writer"
        )
        in lines[0]
    )
    assert "nothing of the job locked was appended" in lines[0]
    assert "run the write again (its rows are staged anew)" in lines[0]
    assert [m.body for m in stored(store, "t")] == [b"held"]
    assert incoming(store) == [ABORTED_DIR]  # abort() removed the staged files (a marker left)
    save(df, store)  # the writer is gone: a re-run (here a job of its own) commits
    assert len(stored(store, "t")) == 1001
    assert incoming(store) == [ABORTED_DIR, "ledger.json"]


def test_a_streaming_query_restarted_from_its_checkpoint_stores_every_row_once(
    tmp_path: Path, spark: SparkSession
) -> None:
    store = new_store(tmp_path / "s")
    source, checkpoint = tmp_path / "in", tmp_path / "checkpoint"
    source.mkdir()

    def add_file(number: int) -> None:
        lines = "".join(f"{number * 1000 + i}\n" for i in range(1000))
        (source / f"{number:03d}.txt").write_text(lines)

    def run() -> None:
        query = (
            spark.readStream.option("maxFilesPerTrigger", 1)
            .text(str(source))
            .selectExpr("value as body")
            .writeStream.format("equeue")
            .option("topic", "s")
            .option("checkpointLocation", str(checkpoint))
            .trigger(availableNow=True)
            .start(str(store))
        )
        assert query.awaitTermination(120)
        assert query.exception() is None

    for number in range(2):
        add_file(number)
    run()  # epochs 0 and 1
    assert len(stored(store, "s")) == 2000
    # As if the driver died after the sink's commit but before Spark recorded it: Spark
    # runs epoch 1 again on restart, and the sink's ledger lets nothing in twice.
    (checkpoint / "commits" / "1").unlink()
    (checkpoint / "commits" / ".1.crc").unlink(missing_ok=True)  # (Hadoop's checksum)
    add_file(2)
    run()
    assert (checkpoint / "commits" / "1").exists()  # epoch 1 was run again
    bodies = Counter(int(m.body) for m in stored(store, "s"))
    assert bodies == Counter(range(3000))
    body = json.loads((store / INCOMING_DIR / "ledger.json").read_text())["body"]
    (entry,) = body["streams"].values()
    assert entry["batch"] == 2 and entry["checkpoint"] == str(checkpoint)


def test_a_streaming_query_started_over_in_a_deleted_checkpoint_stores_its_rows(
    tmp_path: Path, spark: SparkSession
) -> None:
    """``rm -rf`` of the checkpoint starts a new query (a new id in its metadata) at the
    same location: its epochs 0.. are its own, not the old query's, and every row is
    stored. The location is a file: URI, which Spark takes as the path it names."""
    store = new_store(tmp_path / "s")
    source, checkpoint = tmp_path / "in", tmp_path / "ck"
    source.mkdir()

    def run(location: str) -> None:
        query = (
            spark.readStream.text(str(source))
            .selectExpr("value as body")
            .writeStream.format("equeue")
            .option("topic", "t")
            .option("checkpointLocation", location)
            .trigger(availableNow=True)
            .start(str(store))
        )
        assert query.awaitTermination(120)
        assert query.exception() is None

    (source / "a.txt").write_text("".join(f"a{i}\n" for i in range(5)))
    run(checkpoint.as_uri())  # file:///...
    first = json.loads((checkpoint / "metadata").read_text())["id"]
    assert sorted(m.body for m in stored(store, "t")) == [b"a%d" % i for i in range(5)]
    shutil.rmtree(checkpoint)
    (source / "b.txt").write_text("".join(f"b{i}\n" for i in range(5)))
    run(checkpoint.as_uri())  # its epoch 0 reads both files
    assert json.loads((checkpoint / "metadata").read_text())["id"] != first
    bodies = Counter(m.body.decode() for m in stored(store, "t"))
    assert bodies == Counter([f"a{i}" for i in range(5)] * 2 + [f"b{i}" for i in range(5)])
    streams = json.loads((store / INCOMING_DIR / "ledger.json").read_text())["body"]["streams"]
    assert sorted(e["checkpoint"] for e in streams.values()) == [str(checkpoint)] * 2


def _checkpoint(path: Path, query: str) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "metadata").write_text(json.dumps({"id": query}) + "\n")  # as Spark writes it
    return path


def test_the_stream_writer_is_the_query_in_its_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without Spark: the writer's key is the query's id, however the location is spelled
    and wherever the driver runs; another id (a checkpoint started over) is another key."""
    from pyspark.sql.types import StringType, StructField, StructType

    from equeue.spark.sink import EqueueStreamWriter, checkpoint_dir

    store = new_store(tmp_path / "s")
    schema = StructType([StructField("body", StringType())])
    ck = _checkpoint(tmp_path / "ck", "8f7a3c4e-1b2d-4e5f-9a6b-7c8d9e0f1a2b")

    def key(location: str) -> str:
        options = {"path": str(store), "topic": "t", "checkpointLocation": location}
        return EqueueStreamWriter(options, schema, False).writer_key

    monkeypatch.chdir(tmp_path)
    spellings = [
        str(ck),
        f"{ck}/",
        "ck",
        "./ck/",
        ck.as_uri(),
        f"file:{ck}",
        f"file://localhost{ck}",
    ]
    assert checkpoint_dir(f"file://{ck}/x%20y") == f"{ck}/x y"
    keys = {key(location) for location in spellings}
    monkeypatch.chdir(store)
    keys.add(key(str(ck)))
    assert len(keys) == 1
    _checkpoint(ck, "0b6c1f7e-2a3d-4c5e-8f9a-1b2c3d4e5f60")  # rm -rf ck, a new query
    assert key(str(ck)) not in keys
    for location, expected in [
        ("hdfs://nn:8020/ck", "needs the checkpoint on a filesystem the driver reads"),
        ("s3a://bucket/ck", "needs the checkpoint on a filesystem the driver reads"),
        ("file://otherhost/ck", "a file: URI names host 'otherhost'"),
    ]:
        with pytest.raises(SparkOptionError, match=expected):
            key(location)
    with pytest.raises(
        SinkCommitError, match="cannot read the streaming query's id in " + re.escape(str(tmp_path))
    ):
        key(str(tmp_path / "nothing"))
    with pytest.raises(SparkOptionError, match="unknown option 'jobid'"):
        EqueueStreamWriter(
            {"path": str(store), "topic": "t", "checkpointLocation": str(ck), "jobid": "x"},
            schema,
            False,
        )


def test_a_checkpoint_replaced_while_the_query_runs_fails_the_commit(tmp_path: Path) -> None:
    from pyspark.sql.types import StringType, StructField, StructType

    from equeue.spark.sink import EqueueStreamWriter

    store = new_store(tmp_path / "s")
    ck = _checkpoint(tmp_path / "ck", "8f7a3c4e-1b2d-4e5f-9a6b-7c8d9e0f1a2b")
    options = {"path": str(store), "topic": "t", "checkpointLocation": str(ck)}
    writer = EqueueStreamWriter(options, StructType([StructField("body", StringType())]), False)
    writer.commit([], 0)  # control: the same query commits (an epoch without rows)
    _checkpoint(ck, "0b6c1f7e-2a3d-4c5e-8f9a-1b2c3d4e5f60")
    with pytest.raises(SinkCommitError, match="it was replaced while the query ran"):
        writer.commit([], 1)
    assert Incoming(store).read_ledger()["streams"][writer.writer_key]["batch"] == 0


def test_the_ledger_keeps_the_latest_jobs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ledger, "LEDGER_JOBS", 3)
    files = Incoming(tmp_path)
    for number in range(5):
        files.record(Job(f"job{number}"))
    for number in range(5):
        files.record(Job("00000000000000a" + str(number), batch=number, checkpoint="/c"))
    files.record(Job("00000000000000a4", batch=2, checkpoint="/c"))  # an older epoch
    assert [files.committed(Job(f"job{n}")) for n in range(5)] == [False, False, True, True, True]
    body = files.read_ledger()
    assert len(body["streams"]) == 3 and body["streams"]["00000000000000a4"]["batch"] == 4


@pytest.mark.parametrize(
    "files",
    [[["../../escape.arrow", 1]], [["0-0-" + "0" * 32 + ".arrow/../x", 1]], [["a", -1]]],
)
def test_an_intent_naming_files_outside_its_directory_is_refused(
    tmp_path: Path, files: list[list[object]]
) -> None:
    store = new_store(tmp_path / "s")
    job = Job("forged")
    Incoming(store).make_job_dir(job)
    intent = {"job": job.to_json(), "topic": "t", "files": files, "offsets": []}
    write_json(store / INCOMING_DIR / job.dir_name / "intent.json", intent)
    directory = store / INCOMING_DIR / job.dir_name
    with pytest.raises(SinkCommitError) as caught:
        commit(str(store), Job("other"), "t", [])
    said = str(caught.value)
    assert f"cannot read the sink intent {directory / 'intent.json'}" in said
    assert "sink intent is malformed" in said and f"move its directory {directory} out" in said
    assert stored(store, "t") == []
    # Doing as it says: the next commit goes through.
    directory.rename(tmp_path / "aside")
    commit(str(store), Job("other"), "t", [])
    assert incoming(store) == ["ledger.json"]


@pytest.mark.parametrize("damage", ["not json", "dir", "link"])
def test_an_unreadable_ledger_or_intent_names_itself_and_the_remedy(
    tmp_path: Path, damage: str
) -> None:
    """A corrupt ledger.json or an unchecksummed intent of another job: every commit fails
    with a SinkCommitError naming the file and what to do; control: moved aside, it commits."""
    store = new_store(tmp_path / "s")
    root = store / INCOMING_DIR
    root.mkdir()
    bad = root / "ledger.json"
    if damage == "not json":
        bad.write_text("{not json")
    elif damage == "dir":
        bad.mkdir()
    else:
        bad.symlink_to(tmp_path / "elsewhere.json")
    forged = root / "batch-forged" / "intent.json"
    forged.parent.mkdir()
    forged.write_text(json.dumps({"job": Job("forged").to_json(), "topic": "t"}))
    with pytest.raises(SinkCommitError, match=r"cannot read the sink intent .*move its direct"):
        commit(str(store), Job("j"), "t", [])
    forged.parent.rename(tmp_path / "aside")
    with pytest.raises(SinkCommitError) as caught:
        commit(str(store), Job("j"), "t", [])
    assert f"cannot read the sink ledger {bad} (" in str(caught.value)
    assert "move it out of the store" in str(caught.value)
    bad.rename(tmp_path / "ledger-aside")
    commit(str(store), Job("j"), "t", [])
    assert Incoming(store).committed(Job("j")) and stored(store, "t") == []


def test_a_commit_killed_before_its_ledger_entry_is_finished_by_any_later_commit(
    tmp_path: Path,
) -> None:
    """Without Spark: a staged job whose intent is written (as a killed commit leaves it) is
    rolled forward by the next commit of another job, and appended once."""
    import pyarrow as pa

    from equeue.spark.ledger import Intent
    from equeue.spark.sinkcommit import STAGED_SCHEMA

    store = new_store(tmp_path / "s")
    job = Job("interrupted")
    directory = Incoming(store).make_job_dir(job)
    name = "0-7-" + "ab" * 16 + ".arrow"
    batch = pa.RecordBatch.from_pydict(
        {"body": [b"a", b"b", b"c"], "tag": ["", "", ""], "key": [None, None, None],
         "properties": [None, None, None], "queue_id": [0, 0, 0]},
        schema=STAGED_SCHEMA,
    )  # fmt: skip
    with pa.OSFile(str(directory / name), "wb") as out, pa.ipc.new_file(out, batch.schema) as w:
        w.write_batch(batch)
    with MessageStore.open(store) as opened:
        opened.create_topic("t", 2)
        opened.send("t", b"before", queue_id=0)
        offsets = [opened.queue_range("t", q)[1] for q in opened.queue_ids("t")]
        opened.send("t", b"a", queue_id=0)  # the killed commit's first row made it
    Incoming(store).write_intent(Intent(job, "t", [(name, 3)], offsets))
    commit(str(store), Job("next"), "t", [])
    assert [m.body for m in stored(store, "t")] == [b"before", b"a", b"b", b"c"]
    assert Incoming(store).committed(job) and incoming(store) == ["ledger.json"]
    commit(str(store), job, "t", [])  # the job itself, again: nothing twice
    assert len(stored(store, "t")) == 4


@pytest.mark.parametrize("compacted", [True, False])
def test_finishing_a_commit_after_compaction_appends_each_row_once(
    tmp_path: Path, spark: SparkSession, compacted: bool
) -> None:
    """A commit killed after 400 of its 600 rows (keys k0..k8, every seventh row keyless,
    some with a queue_id) to a compacted topic; compaction then removes the superseded
    keys of those 400, leaving holes at their offsets; the next commit appends rows
    400.. once. Control (not compacted): every row once."""
    import time

    import pyarrow as pa

    from equeue import StoreConfig
    from equeue.compaction.job import compact
    from equeue.spark.ledger import Intent
    from equeue.spark.sinkcommit import STAGED_SCHEMA, outgoing

    store = tmp_path / "s"
    rows = 600
    keys = [None if i % 7 == 0 else f"k{i % 9}" for i in range(rows)]
    batch = pa.RecordBatch.from_pydict(
        {
            "body": [b"%d:" % i + b"x" * 90 for i in range(rows)],
            "tag": [""] * rows,
            "key": keys,
            "properties": [None] * rows,
            "queue_id": [2 if i % 11 == 0 else None for i in range(rows)],
        },
        schema=STAGED_SCHEMA,
    )
    job = Job("interrupted")
    name = "0-3-" + "ef" * 16 + ".arrow"
    with MessageStore.open(store, StoreConfig(chunk_data_size=8 * 1024)) as opened:
        opened.create_topic("kv", 3, cleanup="compact")
        opened.send("kv", b"before", key="b")
        offsets = [opened.queue_range("kv", q)[1] for q in opened.queue_ids("kv")]
        opened.send_batch("kv", outgoing(batch.slice(0, 400)))  # what the killed commit sent
    directory = Incoming(store).make_job_dir(job)
    with pa.OSFile(str(directory / name), "wb") as out, pa.ipc.new_file(out, batch.schema) as w:
        w.write_batch(batch)
    Incoming(store).write_intent(Intent(job, "kv", [(name, rows)], offsets))
    if compacted:
        compact(store, spark=spark, now=time.time() + 1)
        assert len(stored(store, "kv")) < 300  # holes among the 400
    commit(str(store), Job("next"), "kv", [])
    got = Counter(m.body for m in stored(store, "kv"))
    expected = [i for i in range(rows) if not compacted or i >= 400 or keys[i] is None]
    if compacted:  # the last of each key among the 400 stays too
        last = {keys[i]: i for i in range(400) if keys[i] is not None}
        expected += sorted(last.values())
    assert got == Counter([b"before"] + [b"%d:" % i + b"x" * 90 for i in expected])
    assert Incoming(store).committed(job) and incoming(store) == ["ledger.json"]


def test_a_reader_in_another_process_follows_the_commit(
    tmp_path: Path, spark: SparkSession
) -> None:
    store = new_store(tmp_path / "s")
    rows = 200_000
    reader = subprocess.Popen(
        [sys.executable, str(HERE / "sink_reader.py"), str(store), "t", str(rows), "120"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert reader.stdout is not None and reader.stdout.readline() == "ready\n"
        df = spark.range(0, rows, numPartitions=2).selectExpr("cast(id as string) as body")
        save(df, store)
        out, _ = reader.communicate(timeout=150)
    finally:
        reader.kill()
    found = json.loads(out)
    # Its handle was opened before the commit (it said "ready" after opening): it follows
    # the sink's writer, and reads every row once.
    assert reader.returncode == 0 and found["read"] == rows and found["twice"] == 0


@pytest.mark.parametrize(
    ("column", "values", "expected"),
    [
        ("tag", ["ok", "x" * 300, "ok"], "InvalidMessageError: the equeue sink cannot send row 1"),
        ("body", ["a", None, "c"], "SparkSchemaError: the equeue sink cannot send row 1"),
        ("queue_id", [0, 9, 1], "QueueNotFoundError: the equeue sink cannot send row 1"),
        ("queue_id", [0, 2**40, 1], "queue_id 1099511627776 is out of range for its 4 queues"),
    ],
)
def test_a_task_refuses_a_row_send_would_refuse_and_stages_nothing(
    tmp_path: Path, column: str, values: list[object], expected: str
) -> None:
    """In the task (here without Spark): the first bad row is named, nothing is staged."""
    import pyarrow as pa
    from pyspark.sql.types import LongType, StringType, StructField, StructType

    from equeue.spark.sink import EqueueWriter

    store = new_store(tmp_path / "s")
    spark_kind, arrow_kind = (
        (LongType(), pa.int64()) if column == "queue_id" else (StringType(), pa.string())
    )
    schema = StructType([StructField(column, spark_kind)])
    arrays = [pa.array(values, arrow_kind)]
    if column != "body":
        schema = StructType([StructField("body", StringType()), *schema.fields])
        arrays.insert(0, pa.array(["a", "b", "c"]))
    batch = pa.RecordBatch.from_arrays(arrays, names=schema.fieldNames())
    writer = EqueueWriter({"path": str(store), "topic": "t"}, schema, False)
    with pytest.raises(Exception) as caught:
        writer.stage(writer.job, iter([batch]))
    assert expected in f"{type(caught.value).__name__}: {caught.value}"
    assert incoming(store) == []


def test_an_intent_of_a_job_the_ledger_records_is_only_removed(tmp_path: Path) -> None:
    """A commit killed after its ledger entry, before removing its directory: the next
    commit appends nothing of it, whatever the log holds (here retention could have taken
    the job's messages: none are past the recorded offsets)."""
    store = new_store(tmp_path / "s")
    job = Job("done")
    directory = Incoming(store).make_job_dir(job)
    name = "0-1-" + "cd" * 16 + ".arrow"
    (directory / name).write_bytes(b"not read")
    Incoming(store).write_intent(ledger.Intent(job, "t", [(name, 5)], []))
    Incoming(store).record(job)
    commit(str(store), Job("next"), "t", [])
    assert stored(store, "t") == [] and incoming(store) == ["ledger.json"]


def test_no_staged_write_follows_a_link_out_of_the_store(tmp_path: Path) -> None:
    """incoming/ (or a job's directory) replaced by a link to elsewhere: the task refuses
    to stage through it and nothing is written there; control: without the link it stages."""
    import pyarrow as pa
    from pyspark.sql.types import StringType, StructField, StructType

    from equeue.errors import StorePathError
    from equeue.spark.sink import EqueueWriter

    store, elsewhere = new_store(tmp_path / "s"), tmp_path / "elsewhere"
    elsewhere.mkdir()
    schema = StructType([StructField("body", StringType())])
    writer = EqueueWriter({"path": str(store), "topic": "t", "jobId": "j"}, schema, False)
    batch = pa.RecordBatch.from_pydict({"body": ["a", "b"]})
    for link in (store / INCOMING_DIR, store / INCOMING_DIR / "batch-j"):
        link.symlink_to(elsewhere)
        with pytest.raises(StorePathError, match="is a symbolic link"):
            writer.stage(writer.job, iter([batch]))
        assert os.listdir(elsewhere) == []
        link.unlink()
        (store / INCOMING_DIR).mkdir(exist_ok=True)
    staged = writer.stage(writer.job, iter([batch]))
    assert staged.rows == 2 and (store / INCOMING_DIR / "batch-j" / staged.name).is_file()


def test_the_sink_appends_past_what_retention_removed(tmp_path: Path, spark: SparkSession) -> None:
    """After retention removed the first job's chunks, the next job's rows go after the
    last offsets (none reused), each once."""
    import datetime as dt
    import time

    from equeue import StoreConfig

    store = tmp_path / "s"
    with MessageStore.open(store, StoreConfig(chunk_data_size=64 * 1024)) as opened:
        opened.create_topic("t", 2)
    first = spark.range(0, 6000, numPartitions=2).selectExpr("cast(id as string) as body")
    save(first, store, jobId="first")
    with MessageStore.open(store, StoreConfig(retention=dt.timedelta(hours=1))) as opened:
        assert opened.apply_retention(now=time.time() + 7200) > 0
        ends = [opened.queue_range("t", q)[1] for q in opened.queue_ids("t")]
        assert sum(end - opened.queue_range("t", q)[0] for q, end in enumerate(ends)) < 6000
    second = spark.range(6000, 9000, numPartitions=2).selectExpr("cast(id as string) as body")
    save(second, store, jobId="second")
    later = [m for m in stored(store, "t") if int(m.body) >= 6000]
    assert Counter(int(m.body) for m in later) == Counter(range(6000, 9000))
    assert all(m.queue_offset >= ends[m.queue_id] for m in later)
