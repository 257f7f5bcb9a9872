"""``df.write.format("equeue")`` and ``df.writeStream.format("equeue")``: rows into a store.

A store has one writer, so tasks never append: each stages its rows (checked as
``send`` would check them) in an Arrow IPC file under ``STORE/incoming/<job>/``, and the
driver's commit appends every task's file through one MessageStore handle, all or
nothing, recorded in a ledger so that a re-run of the job (``jobId``) or of a streaming
epoch appends nothing twice. The commit protocol and what a crash leaves at each step:
docs/spark-sink.md; the files: ledger.py.
"""

from __future__ import annotations

import heapq
import os
import signal
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import repeat
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
from equeue.atomicfile import write_json
from equeue.chunks.chunk import fsync_directory
from equeue.errors import (
    EQueueError,
    SinkCommitError,
    SparkOptionError,
    SparkSchemaError,
    StoreLockedError,
)
from equeue.safepath import check_dir, check_file, open_fd, open_file
from equeue.spark.datasource import store_path
from equeue.spark.ledger import (
    INTENT_FILE,
    KEEP_FILE,
    STAGED_SUFFIX,
    Incoming,
    Intent,
    Job,
    valid_job_id,
)
from equeue.store.config import StoreConfig
from equeue.store.meta import LOCK_FILE
from equeue.store.store import MessageStore
from equeue.store.types import Message, OutgoingMessage

_INTS: Final = (ByteType, ShortType, IntegerType, LongType)
ACCEPTED: Final = (
    "body (binary or string, required), key (string), tag (string), "
    "properties (map<string,string>), queue_id (an integer type)"
)
STAGED_SCHEMA: Final = pa.schema(
    [
        ("body", pa.binary()),
        ("tag", pa.string()),
        ("key", pa.string()),
        ("properties", pa.map_(pa.string(), pa.string())),
        ("queue_id", pa.int32()),
    ]
)
# Tests only (tests/sink_child.py): the commit SIGKILLs its process once it appended this
# many rows; "P:N": the first attempt of partition P's task SIGKILLs its Python worker once
# it staged N rows (its temp file written in part).
KILL_AFTER_ENV: Final = "EQUEUE_SINK_KILL_AFTER_ROWS"
KILL_TASK_ENV: Final = "EQUEUE_SINK_KILL_TASK"
_PULL: Final = 1024


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
        topic = _option(options, "topic")
        if not topic:
            raise SparkOptionError(
                'the equeue sink needs option("topic", NAME): the topic the rows are sent to'
            )
        self.topic = topic
        self.config, self.queue_count = _store_facts(self.store, topic)

    # --- tasks ----------------------------------------------------------------

    def stage(self, job: Job, batches: Iterator[pa.RecordBatch]) -> StagedFile:
        """Write this task's rows to ``incoming/<job>/``: a temp file, fsynced, renamed."""
        from pyspark import TaskContext

        context = TaskContext.get()
        partition = context.partitionId() if context is not None else 0
        attempt = context.taskAttemptId() if context is not None else 0
        kill = _task_kill(context)
        incoming = Incoming(self.store)
        name = f"{partition}-{attempt}-{uuid.uuid4().hex}{STAGED_SUFFIX}"
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
                    directory = incoming.make_job_dir(job)
                    fd = open_fd(directory / (name + ".tmp"), os.O_WRONLY | os.O_CREAT | os.O_EXCL)
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
        finally:
            if out is not None:
                out.close()
        return StagedFile(name, rows, size)

    def _checked(self, batch: pa.RecordBatch, partition: int, first: int) -> pa.RecordBatch:
        """The batch in the staged layout, every row checked as ``send`` checks it (so a
        bad row fails its task, and the job appends nothing)."""
        from equeue.store import validate

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
        queue_id = (
            column("queue_id", pa.int32()) if "queue_id" in names else pa.nulls(n, pa.int32())
        )
        staged = pa.RecordBatch.from_arrays(
            [body, tag, key, properties, queue_id], schema=STAGED_SCHEMA
        )
        if staged.column(0).null_count:
            index = staged.column(0).is_null().to_pylist().index(True)
            raise SparkSchemaError(
                f"the equeue sink cannot send row {first + index} of partition {partition} to "
                f"topic {self.topic!r}: its body is null; every message needs a body"
            )
        config, topic, count = self.config, self.topic, self.queue_count

        def check(message: object) -> object:
            return validate.check_message(config, topic, count, *validate.outgoing(message))

        messages = _outgoing(staged)
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
        return staged

    # --- the driver -------------------------------------------------------------

    def commit_job(self, job: Job, messages: list[WriterCommitMessage | None]) -> None:
        files = [(m.name, m.rows) for m in messages if isinstance(m, StagedFile) and m.name]
        try:
            commit(self.store, job, self.topic, files)
        except SinkCommitError as exc:
            # Spark calls abort() next, in another process: a file tells it to keep them.
            incoming = Incoming(self.store)
            if check_dir(incoming.job_dir(job)):
                write_json(incoming.job_dir(job) / KEEP_FILE, {"reason": str(exc)})
            raise

    def abort_job(self, job: Job) -> None:
        """Remove the job's staged files, unless its commit began appending (an intent: they
        stay for the next commit to finish it, all or nothing) or could not open the store
        (they stay for a re-run of the job, whose commit replaces them)."""
        incoming = Incoming(self.store)
        directory = incoming.job_dir(job)
        if check_file(directory / INTENT_FILE) or check_file(directory / KEEP_FILE):
            return
        incoming.remove_job_dir(job)


def _task_kill(context: Any) -> int:
    """The row count after which this task attempt SIGKILLs itself (KILL_TASK_ENV), or 0."""
    hook = os.environ.get(KILL_TASK_ENV)
    if not hook or context is None or context.attemptNumber() != 0:
        return 0
    partition, rows = (int(part) for part in hook.split(":"))
    return rows if context.partitionId() == partition else 0


class EqueueWriter(_Sink, DataSourceArrowWriter):
    def __init__(self, options: dict[str, str], schema: StructType, overwrite: bool) -> None:
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
        super().__init__(options, schema, overwrite)
        checkpoint = _option(options, "checkpointLocation")
        if not checkpoint:
            raise SparkOptionError(
                "the equeue sink needs the query's checkpoint location as an option: "
                'writeStream.option("checkpointLocation", DIR); it names the query, so that '
                "an epoch re-run after a restart appends nothing twice"
            )
        self.checkpoint = os.path.abspath(checkpoint)
        self.writer_key = xxhash.xxh64_hexdigest(self.checkpoint.encode())

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
        self.commit_job(self._job(batchId), messages)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        self.abort_job(self._job(batchId))


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


# --- the commit ---------------------------------------------------------------------


@dataclass
class _Row:
    body: bytes | None
    tag: str
    key: str | None
    properties: dict[str, str] | None
    queue_id: int | None

    def matches(self, message: Message) -> bool:
        return (
            message.body == self.body
            and message.tag == self.tag
            and message.key == self.key
            and message.properties == (self.properties or {})
            and (self.queue_id is None or message.queue_id == self.queue_id)
        )


def _rows(batch: pa.RecordBatch) -> Iterator[_Row]:
    columns = [batch.column(i).to_pylist() for i in range(5)]
    for body, tag, key, properties, queue_id in zip(*columns, strict=True):
        props = None if properties is None else dict(properties)
        yield _Row(body, tag, key, props, queue_id)


def _outgoing(batch: pa.RecordBatch) -> list[OutgoingMessage]:
    bodies, tags, keys, properties, queue_ids = (_values(c) for c in batch.columns)
    properties = [None if p is None else dict(p) for p in properties]
    return list(map(OutgoingMessage, bodies, tags, keys, properties, repeat(0), queue_ids))


def _values(column: pa.Array) -> list[Any]:
    if column.null_count == len(column):  # an absent column: no conversion (most of the time)
        return [None] * len(column)
    return column.to_pylist()  # type: ignore[no-any-return]


def _batches(incoming: Incoming, intent: Intent) -> Iterator[pa.RecordBatch]:
    directory = incoming.job_dir(intent.job)
    for name, rows in intent.files:
        path = directory / name
        with open_file(path, "rb") as f:
            reader = pa.ipc.open_file(f)
            found = 0
            for i in range(reader.num_record_batches):
                batch = reader.get_batch(i)
                found += batch.num_rows
                yield batch
        if found != rows:
            raise SinkCommitError(
                f"staged file {path} holds {found} rows, its task reported {rows}: "
                "it was changed after the task wrote it"
            )


def commit(store: str, job: Job, topic: str, files: list[tuple[str, int]]) -> None:
    """Append ``job``'s staged ``files`` to ``topic`` through one writer, all or nothing;
    first finish every commit a crash interrupted (their intents)."""
    incoming = Incoming(store)
    with _open_writer(store, job) as opened:
        for path in incoming.pending_intents():
            intent = Intent.read(path)
            if intent.job != job:
                _finish(opened, incoming, intent)
        if incoming.committed(job):
            incoming.remove_job_dir(job)  # a re-run: its rows are in the store already
            return
        intent_path = incoming.job_dir(job) / INTENT_FILE
        if intent_path.exists():  # an earlier run of this job began appending: finish it
            intent = Intent.read(intent_path)
        else:
            if not files:
                incoming.record(job)
                incoming.remove_job_dir(job)
                return
            offsets = []
            if topic in opened.topics():
                offsets = [opened.queue_range(topic, q)[1] for q in opened.queue_ids(topic)]
            intent = Intent(job, topic, files, offsets)
            incoming.make_job_dir(job)
            incoming.write_intent(intent)
        _finish(opened, incoming, intent)


def _open_writer(store: str, job: Job) -> MessageStore:
    try:
        return MessageStore.open(store)
    except StoreLockedError:
        holder = "?"
        try:
            with open_file(Path(store) / LOCK_FILE, "rb") as f:
                holder = f.read().decode(errors="replace").strip() or "?"
        except OSError:
            pass
        raise SinkCommitError(
            f"the store at {store} is open for writing by another process (pid {holder}): the "
            "sink appends through its own writer; stop that writer (or open it read_only=True) "
            f"and run the {job.describe()} again; its staged rows stay in "
            f"{Incoming(store).job_dir(job)}"
        ) from None


def _finish(opened: MessageStore, incoming: Incoming, intent: Intent) -> None:
    """Append what of ``intent`` the log does not hold yet, flush, record, clean up."""
    done = _appended(opened, incoming, intent)
    kill_after = int(os.environ.get(KILL_AFTER_ENV, "0") or 0)
    appended = 0
    for batch in _batches(incoming, intent):
        if done >= batch.num_rows:
            done -= batch.num_rows
            continue
        messages = _outgoing(batch.slice(done))
        done = 0
        opened.send_batch(intent.topic, messages)
        appended += len(messages)
        if kill_after and appended >= kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
    opened.flush()
    incoming.record(intent.job)
    incoming.remove_job_dir(intent.job)


def _appended(opened: MessageStore, incoming: Incoming, intent: Intent) -> int:
    """How many of the intent's rows lead the log after its recorded queue offsets:
    the topic's messages since then, merged in log order, compared with the rows in
    order up to the first that differs."""
    if intent.topic not in opened.topics():
        return 0
    total = sum(rows for _, rows in intent.files)

    def queue(queue_id: int) -> Iterator[Message]:
        offset = intent.offsets[queue_id] if queue_id < len(intent.offsets) else 0
        seen = 0
        while seen < total:
            pulled = opened.pull(intent.topic, queue_id, offset, min(_PULL, total - seen))
            if not pulled:
                return
            yield from pulled
            seen += len(pulled)
            offset = pulled.next_offset

    stored = heapq.merge(
        *(queue(q) for q in opened.queue_ids(intent.topic)), key=lambda m: m.position
    )
    matched = 0
    rows = (row for batch in _batches(incoming, intent) for row in _rows(batch))
    for row, message in zip(rows, stored, strict=False):
        if not row.matches(message):
            break
        matched += 1
    return matched
