"""``df.write.format("equeue")`` and ``df.writeStream.format("equeue")``: rows into a store.

A store has one writer, so tasks never append: each stages its rows (checked as
``send`` would check them) in an Arrow IPC file under ``STORE/incoming/<job>/``, and the
driver's commit appends every task's file through one MessageStore handle, all or
nothing, recorded in a ledger so that a re-run of the job (``jobId``) or of a streaming
epoch appends nothing twice. The commit protocol and what a crash leaves at each step:
docs/spark.md ("Sink"); the commit: sinkcommit.py; the files: ledger.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import urllib.parse
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import pyarrow as pa
import xxhash
from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import (
    BinaryType,
    ByteType,
    DataType,
    IntegerType,
    LongType,
    MapType,
    ShortType,
    StringType,
    StructType,
)

from equeue import speedups
from equeue.chunks.fileops import fsync_directory, write_error
from equeue.errors import (
    EQueueError,
    QueueNotFoundError,
    SinkCommitError,
    SparkOptionError,
    SparkSchemaError,
)
from equeue.safepath import check_file
from equeue.spark.aborted import aborted, mark_aborted, new_run, tidy
from equeue.spark.datasource import store_path
from equeue.spark.ledger import (
    INTENT_FILE,
    STAGED_SUFFIX,
    Incoming,
    Job,
    valid_job_id,
)
from equeue.spark.sinkcommit import STAGED_SCHEMA, commit, outgoing
from equeue.spark.viabroker import served_at, served_error
from equeue.store.config import StoreConfig
from equeue.store.store import MessageStore
from equeue.store.types import OutgoingMessage

_INTS: Final = (ByteType, ShortType, IntegerType, LongType)
ACCEPTED: Final = (
    "body (binary or string, required), key (string), tag (string), "
    "properties (map<string,string>), queue_id (an integer type)"
)
# Tests only (tests/sink_child.py): "P:N": the first attempt of partition P's task SIGKILLs
# its Python worker once it staged N rows (its temp file written in part).
KILL_TASK_ENV: Final = "EQUEUE_SINK_KILL_TASK"
# The options each writer takes (Spark hands them lower-cased; it adds ``path`` from
# save(), and ``queryName`` for a named query).
BATCH_OPTIONS: Final = ("path", "topic", "jobId")
STREAM_OPTIONS: Final = ("path", "topic", "checkpointLocation", "queryName")
_SCHEME: Final = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")


def check_schema(schema: StructType) -> None:
    """SparkSchemaError unless the rows have the shape a message has."""
    names = [f.name for f in schema.fields]
    if "body" not in names:
        raise SparkSchemaError(
            f"the equeue sink needs a body column; the rows have {names or 'no columns'} "
            f"(accepted: {ACCEPTED})"
        )
    for field in schema.fields:
        if not _accepts(field.name, field.dataType):
            what = (
                "is not a column of a message"
                if field.name not in ("body", "key", "tag", "properties", "queue_id", "topic")
                else "has a type the sink cannot store"
            )
            hint = ' (the topic is an option: .option("topic", T))' if field.name == "topic" else ""
            raise SparkSchemaError(
                f"column {field.name!r} of type {field.dataType.simpleString()} {what}{hint}; "
                f"the equeue sink accepts {ACCEPTED}"
            )


def _accepts(name: str, kind: DataType) -> bool:
    if name == "body":
        return isinstance(kind, (BinaryType, StringType))
    if name in ("key", "tag"):
        return isinstance(kind, StringType)
    if name == "properties":
        return (
            isinstance(kind, MapType)
            and isinstance(kind.keyType, StringType)
            and isinstance(kind.valueType, StringType)
        )
    if name == "queue_id":
        return isinstance(kind, _INTS)
    return False


def _option(options: dict[str, str], name: str) -> str | None:
    """Spark hands options over case-insensitively (lower-cased keys)."""
    for key, value in options.items():
        if key.lower() == name.lower():
            return value
    return None


def _known(options: dict[str, str], names: tuple[str, ...], where: str) -> None:
    """SparkOptionError for an option the writer does not take (a misspelled ``jobId``
    would otherwise make each run a job of its own)."""
    known = {name.lower() for name in names}
    for key in options:
        if key.lower() not in known:
            raise SparkOptionError(
                f"{where}.format('equeue'): unknown option {key!r}; the options are "
                + ", ".join(names)
            )


@dataclass
class StagedFile(WriterCommitMessage):
    name: str  # "" for a task that had no rows
    rows: int
    bytes: int


class _Sink:
    """What the batch and the streaming writer share: the checks on the driver, the
    staging in tasks, the commit."""

    def __init__(self, options: dict[str, str], schema: StructType, overwrite: bool) -> None:
        check_schema(schema)
        if overwrite:
            raise SparkOptionError(
                "the equeue sink only appends: a message log cannot be overwritten "
                '(use mode("append"), or outputMode("append"/"update") for a stream)'
            )
        self.store = store_path(options)
        served = served_at(self.store)
        if served is not None:
            raise served_error(self.store, served)
        topic = _option(options, "topic")
        if not topic:
            raise SparkOptionError(
                'the equeue sink needs option("topic", NAME): the topic the rows are sent to'
            )
        self.topic = topic
        self.config, self.queue_count = _store_facts(self.store, topic)
        # This run's token: the tasks and the commit or abort get it with the pickled
        # writer; abort() marks the run with it (aborted.py).
        self.run = new_run()

    # --- tasks ----------------------------------------------------------------

    def stage(self, job: Job, batches: Iterator[pa.RecordBatch]) -> StagedFile:
        """Write this task's rows to ``incoming/<job>/``: a temp file, fsynced, renamed."""
        from pyspark import TaskContext

        context = TaskContext.get()
        partition = context.partitionId() if context is not None else 0
        attempt = context.taskAttemptId() if context is not None else 0
        kill = _task_kill(context)
        incoming = Incoming(self.store)
        if aborted(incoming, job, self.run):  # (Spark aborted the run before it started)
            return StagedFile("", 0, 0)
        name = f"{partition}-{attempt}-{self.run}-{uuid.uuid4().hex}{STAGED_SUFFIX}"
        rows = 0
        directory: Path | None = None
        out: Any = None
        writer: pa.ipc.RecordBatchFileWriter | None = None
        try:
            for batch in batches:
                staged = self._checked(batch, partition, rows)
                if staged.num_rows == 0:
                    continue
                if writer is None:
                    directory, fd = incoming.create_staged(job, name + ".tmp")
                    out = os.fdopen(fd, "wb")
                    writer = pa.ipc.new_file(out, STAGED_SCHEMA)
                writer.write_batch(staged)
                rows += staged.num_rows
                if kill and rows >= kill:
                    out.flush()
                    os.kill(os.getpid(), signal.SIGKILL)
            if writer is None or directory is None:
                return StagedFile("", 0, 0)
            writer.close()
            out.flush()
            os.fsync(out.fileno())
            size = out.tell()
            out.close()
            out = None
            os.rename(directory / (name + ".tmp"), directory / name)
            fsync_directory(directory)
        except OSError as exc:  # (a StorePathError is no OSError: it goes as it is)
            if aborted(incoming, job, self.run):  # abort() removed the temp file under it
                incoming.remove_staged(job, name)
                return StagedFile("", 0, 0)
            raise write_error(exc, "staging the task's rows", incoming.root / job.dir_name) from exc
        finally:
            if out is not None:
                out.close()
        if aborted(incoming, job, self.run):  # the run was aborted while this task staged
            incoming.remove_staged(job, name)
            return StagedFile("", 0, 0)
        return StagedFile(name, rows, size)

    def _checked(self, batch: pa.RecordBatch, partition: int, first: int) -> pa.RecordBatch:
        """The batch in the staged layout, every row checked as ``send`` checks it (so a
        bad row fails its task, and the job appends nothing)."""
        config, topic, count = self.config, self.topic, self.queue_count
        return checked_rows(batch, config, topic, count, partition, first)[0]

    # --- the driver -------------------------------------------------------------

    def commit_job(self, job: Job, messages: list[WriterCommitMessage | None]) -> None:
        files = [(m.name, m.rows) for m in messages if isinstance(m, StagedFile) and m.name]
        commit(self.store, job, self.topic, files)

    def abort_job(self, job: Job) -> None:
        """Remove the job's staged files, unless its commit began appending (an intent: they
        stay for the next commit to finish it, all or nothing). Without an intent nothing of
        the job is in the log, and a re-run stages its rows anew: the files are of no use.
        First the run's abort marker, for its tasks still staging (aborted.py)."""
        incoming = Incoming(self.store)
        mark_aborted(incoming, job, self.run)
        tidy(incoming)
        directory = incoming.job_dir(job)
        if check_file(directory / INTENT_FILE):
            return
        incoming.remove_job_dir(job)


def checked_rows(
    batch: pa.RecordBatch,
    config: StoreConfig,
    topic: str,
    count: int,
    partition: int,
    first: int,
) -> tuple[pa.RecordBatch, list[OutgoingMessage]]:
    """``batch`` in the staged layout and as messages, every row checked as ``send`` checks
    it against ``config``'s limits and ``count`` queues; the first bad row raises, named."""
    from equeue.store import validate

    staged = staged_rows(batch, topic, count, partition, first)

    def check(message: object) -> object:
        return validate.check_message(config, topic, count, *validate.outgoing(message))

    messages = outgoing(staged)
    try:
        fast = speedups.SPEEDUPS
        if fast is None:
            for message in messages:
                check(message)
        else:  # as send_batch checks: the common cases in C, the rest by check()
            fast.check_batch(
                messages, OutgoingMessage, check, validate.check_tag,
                config.max_message_size, config.layout.chunk_data_size, count,
            )  # fmt: skip
    except EQueueError:  # which row: check them one by one
        for i, message in enumerate(messages):
            try:
                check(message)
            except EQueueError as exc:
                raise type(exc)(
                    f"the equeue sink cannot send row {first + i} of partition {partition} "
                    f"to topic {topic!r}: {exc}"
                ) from None
        raise
    return staged, messages


def staged_rows(
    batch: pa.RecordBatch, topic: str, queue_count: int | None, partition: int, first: int
) -> pa.RecordBatch:
    """``batch`` in the staged layout (body, tag, key, properties, queue_id); a null body
    or a queue_id past int32 raises naming the row (``first``: the rows before it)."""
    n = batch.num_rows
    names = batch.schema.names

    def column(name: str, kind: pa.DataType) -> pa.Array:
        if name not in names:
            return pa.nulls(n, kind)
        return batch.column(name).cast(kind)

    body = column("body", pa.binary())
    tag = column("tag", pa.string()).fill_null("")
    key = column("key", pa.string())
    properties = column("properties", STAGED_SCHEMA.field("properties").type)
    try:
        queue_id = column("queue_id", pa.int32())
    except pa.ArrowInvalid:  # a long past int32: no queue has that id
        values = batch.column("queue_id").to_pylist()
        index = next(i for i, v in enumerate(values) if v is not None and abs(v) >= 2**31)
        count = "its" if queue_count is None else f"its {queue_count}"
        raise QueueNotFoundError(
            f"the equeue sink cannot send row {first + index} of partition {partition} to "
            f"topic {topic!r}: queue_id {values[index]} is out of range for {count} queues; "
            "create_topic() can raise the queue count"
        ) from None
    staged = pa.RecordBatch.from_arrays(
        [body, tag, key, properties, queue_id], schema=STAGED_SCHEMA
    )
    if staged.column(0).null_count:
        index = staged.column(0).is_null().to_pylist().index(True)
        raise SparkSchemaError(
            f"the equeue sink cannot send row {first + index} of partition {partition} to "
            f"topic {topic!r}: its body is null; every message needs a body"
        )
    return staged


def _task_kill(context: Any) -> int:
    """The row count after which this task attempt SIGKILLs itself (KILL_TASK_ENV), or 0."""
    hook = os.environ.get(KILL_TASK_ENV)
    if not hook or context is None or context.attemptNumber() != 0:
        return 0
    partition, _, rows = hook.partition(":")
    if not (partition + rows).isascii() or not partition.isdigit() or not rows.isdigit():
        return 0  # not "P:N": a value set by mistake disarms the failpoint
    return int(rows) if context.partitionId() == int(partition) else 0


class EqueueWriter(_Sink, DataSourceArrowWriter):
    def __init__(self, options: dict[str, str], schema: StructType, overwrite: bool) -> None:
        _known(options, BATCH_OPTIONS, "write")
        super().__init__(options, schema, overwrite)
        job_id = _option(options, "jobId")
        if job_id is not None and not valid_job_id(job_id):
            raise SparkOptionError(
                f"option jobId={job_id!r}: it must be 1 to 128 letters, digits, '.', '_' or "
                "'-', not starting with '.'"
            )
        self.job = Job(job_id or uuid.uuid4().hex)

    def write(self, iterator: Iterator[pa.RecordBatch]) -> StagedFile:
        return self.stage(self.job, iterator)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        self.commit_job(self.job, messages)

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        self.abort_job(self.job)


class EqueueStreamWriter(_Sink, DataSourceStreamArrowWriter):
    def __init__(self, options: dict[str, str], schema: StructType, overwrite: bool) -> None:
        _known(options, STREAM_OPTIONS, "writeStream")
        super().__init__(options, schema, overwrite)
        checkpoint = _option(options, "checkpointLocation")
        if not checkpoint:
            raise SparkOptionError(
                "the equeue sink needs the query's checkpoint location as an option: "
                'writeStream.option("checkpointLocation", DIR) (the setting '
                "spark.sql.streaming.checkpointLocation does not reach a Python sink); the "
                "query's id there keeps an epoch re-run after a restart from appending twice"
            )
        self.checkpoint = checkpoint_dir(checkpoint)
        # Read here, on the driver (tasks may run where the checkpoint is not), and again
        # at each commit: Spark wrote it when the query started, before this writer.
        self.query_id = query_id(self.checkpoint)
        self.writer_key = xxhash.xxh64_hexdigest(self.query_id.encode())

    def _job(self, batch_id: int) -> Job:
        return Job(self.writer_key, batch_id, self.checkpoint)

    def write(self, iterator: Iterator[pa.RecordBatch]) -> StagedFile:
        from pyspark import TaskContext

        context = TaskContext.get()
        epoch = context.getLocalProperty("streaming.sql.batchId") if context else None
        if epoch is None:
            raise SinkCommitError("the equeue sink's task does not know its streaming epoch")
        return self.stage(self._job(int(epoch)), iterator)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        now = query_id(self.checkpoint)
        if now != self.query_id:
            raise SinkCommitError(
                f"the checkpoint {self.checkpoint} now holds query {now}, not {self.query_id} "
                f"whose epoch {batchId} this is: it was replaced while the query ran; nothing "
                "of the epoch was appended"
            )
        self.commit_job(self._job(batchId), messages)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        self.abort_job(self._job(batchId))


def checkpoint_dir(location: str) -> str:
    """The checkpoint directory as a local path: a ``file:`` URI's path; a path without a
    scheme made absolute (as Spark resolves it, against the driver's working directory).
    SparkOptionError for another scheme: the sink reads the query's id on the driver."""
    scheme = _SCHEME.match(location)
    if scheme is None:
        return os.path.normpath(os.path.abspath(location))
    if scheme.group(1).lower() != "file":
        raise SparkOptionError(
            f"option checkpointLocation={location!r}: the equeue sink needs the checkpoint on a "
            "filesystem the driver reads as local files (a path or a file: URI), to read the "
            "query's id there"
        )
    parsed = urllib.parse.urlsplit(location)
    if parsed.netloc not in ("", "localhost"):
        raise SparkOptionError(
            f"option checkpointLocation={location!r}: a file: URI names host "
            f"{parsed.netloc!r}; the equeue sink needs a local path (file:///dir)"
        )
    return os.path.normpath(urllib.parse.unquote(parsed.path))


def query_id(checkpoint: str) -> str:
    """The id of the streaming query checkpointed in ``checkpoint``: Spark writes it to
    ``metadata`` when the query first starts and keeps it across restarts; a deleted
    checkpoint gives a new query, a new id."""
    path = Path(checkpoint) / "metadata"
    try:
        with open(path, "rb") as f:
            raw = f.read(65536)
        found = json.loads(raw.decode().splitlines()[0])["id"]
    except (OSError, ValueError, KeyError, TypeError, IndexError, RecursionError) as exc:
        raise SinkCommitError(
            f"cannot read the streaming query's id in {path} ({exc}): Spark writes it when "
            "the query starts; the option checkpointLocation must be the query's own"
        ) from None
    if not isinstance(found, str) or not found:
        raise SinkCommitError(f"the streaming query's id in {path} is {found!r}, no id")
    return found


def _store_facts(store: str, topic: str) -> tuple[StoreConfig, int]:
    """The store's limits and the topic's queue count (its default count if it is to be
    created on the first send); SparkOptionError if it cannot be sent to."""
    from equeue.store import validate

    try:
        validate.check_topic(topic)
    except EQueueError as exc:
        raise SparkOptionError(f"option topic={topic!r}: {exc}") from None
    with MessageStore.open(store, read_only=True) as opened:
        if topic in opened.topics():
            return opened.config, len(opened.queue_ids(topic))
        if not opened.config.auto_create_topics:
            raise SparkOptionError(
                f"option topic={topic!r}: no such topic in {store}, and the store's "
                "auto_create_topics is off; create it first (MessageStore.create_topic)"
            )
        return opened.config, opened.config.default_queue_count
