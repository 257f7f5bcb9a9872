"""The sink through a broker: ``df.write.format("equeue").option("broker", URL)`` (and
``writeStream``). Each task sends its rows to the broker itself, in ``send_batch``
requests that fit the broker's frame limit; the driver's commit has nothing left to do.

At least once, as Spark's Kafka sink: a task attempt that fails after some of its
requests were answered leaves those rows in the store, and Spark's retry of the task (or
a streaming epoch run again after a restart) sends them again. The path sink (sink.py)
keeps its exactly-once ledger; through a broker there is no place for one that the
tasks' sends and the driver's commit could share (docs/spark.md, "Through a broker").
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Final

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import StructType

from equeue.chunks.fileops import write_error
from equeue.errors import EQueueError, MessageTooLargeError, SparkOptionError
from equeue.protocol.bounded import SEND_BATCH_OBJECTS, max_objects
from equeue.protocol.frames import DEFAULT_MAX_BATCH_MESSAGES
from equeue.spark.sink import check_schema, checked_rows
from equeue.spark.viabroker import (
    BROKER,
    CA_FILE,
    CONNECT_TIMEOUT,
    TIMEOUT,
    TOKEN_FILE,
    BrokerAddress,
    option,
)
from equeue.store.config import StoreConfig
from equeue.store.types import OutgoingMessage

if TYPE_CHECKING:
    from equeue.client.sync import Client

log = logging.getLogger(__name__)

BATCH_OPTIONS: Final = (BROKER, TOKEN_FILE, CA_FILE, CONNECT_TIMEOUT, TIMEOUT, "topic")
# checkpointLocation is Spark's own (the query's); the sink keeps nothing there.
STREAM_OPTIONS: Final = (
    BROKER, TOKEN_FILE, CA_FILE, CONNECT_TIMEOUT, TIMEOUT, "topic", "checkpointLocation",
    "queryName",
)  # fmt: skip
# A send_batch request carries at most this many bytes of messages (and half the
# broker's max_frame_bytes): large enough that a request's round trip is small beside
# its work, small enough that one refused or lost request is little to send again.
CHUNK_BYTES: Final = 4 << 20
CHUNK_ROWS: Final = 16384
MESSAGE_OVERHEAD: Final = 64  # msgpack map keys and headers of one message, at most
# A SendResult on the wire besides its topic: the answer to a request must fit a frame too.
RESULT_BYTES: Final = 80
# The rows are checked for their shape (tag, key, properties, queue_id) before any is
# sent; size limits are the broker's store's, which it enforces (a row past them fails
# its task when its request is refused). These are only the loosest values possible.
_LOOSE: Final = StoreConfig(
    chunk_data_size=1 << 30, max_message_size=1 << 30, max_properties_size=1 << 20
)
_MAX_QUEUES: Final = 1 << 16  # a topic not created yet: its count is the broker's store's
# A message's objects in a send_batch (bounded.message_objects) with every field of
# OutgoingMessage on the wire, its properties map aside: at least what it counts.
_OBJECTS_MOST: Final = 2 + 2 * len(OutgoingMessage._fields)


@dataclass
class SentRows(WriterCommitMessage):
    rows: int
    requests: int


def _known(options: dict[str, str], names: tuple[str, ...], where: str) -> None:
    known = {name.lower() for name in names}
    for key in options:
        if key.lower() == "jobid":
            raise SparkOptionError(
                f"{where}.format('equeue'): option jobId is not taken through a broker: this "
                "path is at-least-once (a task Spark runs again sends its rows again) and "
                "keeps no ledger of jobs; write by the store's path for exactly once"
            )
        if key.lower() not in known and key.lower() != "path":  # path: BrokerAddress says
            raise SparkOptionError(
                f"{where}.format('equeue') through a broker: unknown option {key!r}; the "
                "options are " + ", ".join(names)
            )


def chunks(
    messages: list[OutgoingMessage],
    budget: int,
    max_rows: int = CHUNK_ROWS,
    request_objects: int = max_objects(DEFAULT_MAX_BATCH_MESSAGES),
) -> Iterator[list[OutgoingMessage]]:
    """``messages`` in runs of at most ``budget`` bytes (as estimated), ``max_rows`` rows
    and ``request_objects`` msgpack objects in the request as the broker counts them
    (equeue/protocol/bounded.py); a message past the budget or the objects goes alone
    (the client refuses it if no frame holds it, FrameTooLargeError naming the broker's
    limit)."""
    run: list[OutgoingMessage] = []
    size = 0
    objects = room = request_objects - SEND_BATCH_OBJECTS
    for message in messages:
        body, tag, key, properties = message[0], message[1], message[2], message[3]
        # Text by its UTF-8 bytes (reviewc F9: characters undercounted 4-byte ones 4
        # times); ASCII, the common case, without encoding it (isascii reads a flag).
        cost = MESSAGE_OVERHEAD + len(body) + len(tag if tag.isascii() else tag.encode())
        if key:
            cost += len(key if key.isascii() else key.encode())
        count = _OBJECTS_MOST
        if properties:
            for k, v in properties.items():
                text = k + v
                cost += 10 + len(text if text.isascii() else text.encode())
            count += 2 * len(properties) + 1
        if run and (size + cost > budget or len(run) >= max_rows or count > objects):
            yield run
            run, size, objects = [], 0, room
        run.append(message)
        size += cost
        objects -= count
    if run:
        yield run


class _BrokerSink:
    def __init__(self, options: dict[str, str], schema: StructType, overwrite: bool) -> None:
        check_schema(schema)
        if overwrite:
            raise SparkOptionError(
                "the equeue sink only appends: a message log cannot be overwritten "
                '(use mode("append"), or outputMode("append"/"update") for a stream)'
            )
        self.address = BrokerAddress(options)
        topic = option(options, "topic")
        if not topic:
            raise SparkOptionError(
                'the equeue sink needs option("topic", NAME): the topic the rows are sent to'
            )
        from equeue.store import validate

        try:
            validate.check_topic(topic)
        except EQueueError as exc:
            raise SparkOptionError(f"option topic={topic!r}: {exc}") from None
        self.topic = topic
        # On the driver, before any task: the broker answers, takes the token, and says how
        # many queues the topic has (a row's queue_id is checked against it in the tasks).
        with self.address.connect() as client:
            self.queue_count = (
                len(client.queue_ids(topic)) if topic in client.topics() else _MAX_QUEUES
            )

    def send(self, batches: Iterator[pa.RecordBatch]) -> SentRows:
        from pyspark import TaskContext

        context = TaskContext.get()
        partition = context.partitionId() if context is not None else 0
        attempt = context.attemptNumber() if context is not None else 0
        if attempt == 0:
            return self._send(batches, partition, attempt, None)
        # A retry: every row checked before any is sent, against the broker's store's size
        # limits too (its welcome's), so a row the check refuses fails it with nothing
        # sent, instead of storing the rows before it once more per attempt (reviewc F3).
        # The first attempt streams: no disk write of every row.
        client = self.address.connect()
        try:
            with tempfile.TemporaryDirectory(prefix="equeue-sink-", dir=spill_root()) as spill:
                try:
                    checked = self._checked_first(
                        batches, partition, Path(spill) / "rows.arrow", _limits(client)
                    )
                except EQueueError as exc:
                    _name_the_limits(exc, _limits(client))
                    exc.add_note(
                        f"the equeue sink's task for partition {partition} (attempt "
                        f"{attempt}) checks every row before it sends any, and sent none; "
                        "the first attempt sent the rows before this one"
                    )
                    raise
                return self._send(checked, partition, attempt, client)
        finally:
            client.close()

    def _checked_first(
        self, batches: Iterator[pa.RecordBatch], partition: int, spill: Path, config: StoreConfig
    ) -> Iterator[pa.RecordBatch]:
        """Every batch checked, kept in ``spill`` (Arrow IPC), then read back from it."""
        seen = 0
        writer: pa.ipc.RecordBatchStreamWriter | None = None
        try:
            try:
                for batch in batches:
                    checked_rows(batch, config, self.topic, self.queue_count, partition, seen)
                    seen += batch.num_rows
                    if writer is None:
                        writer = pa.ipc.new_stream(str(spill), batch.schema)
                    writer.write_batch(batch)
            finally:
                if writer is not None:
                    writer.close()
            if writer is None:
                return iter(())
            return iter(pa.ipc.open_stream(pa.memory_map(str(spill))))
        except OSError as exc:  # (pyarrow's IOError too)
            raise write_error(exc, "keeping a retried task's checked rows", spill) from exc

    def _send(
        self,
        batches: Iterator[pa.RecordBatch],
        partition: int,
        attempt: int,
        client: Client | None,
    ) -> SentRows:
        """The rows sent; ``client`` (else one made at the first row) closed after."""
        rows = requests = 0
        config = _LOOSE if client is None else _limits(client)
        try:
            for batch in batches:
                if batch.num_rows == 0:
                    continue
                if client is None:
                    client = self.address.connect()
                    config = _limits(client)
                # Each Arrow batch is checked whole before any of it is sent, against the
                # broker's store's size limits (its welcome's) where the broker says them.
                _, messages = checked_rows(
                    batch, config, self.topic, self.queue_count, partition, rows
                )
                budget = _budget(client)
                # The answer holds a SendResult per row, with the topic in each; the
                # broker takes at most its welcome's max_batch_messages rows a request.
                most = _max_batch_messages(client)
                answers = budget // (RESULT_BYTES + len(self.topic.encode()))
                rows_max = max(1, min(CHUNK_ROWS, most, answers))
                for run in chunks(messages, budget, rows_max, max_objects(most)):
                    client.send_batch(self.topic, run)
                    rows += len(run)
                    requests += 1
        except EQueueError as exc:
            _name_the_limits(exc, config)
            exc.add_note(
                f"the equeue sink's task for partition {partition} (attempt {attempt}) had "
                f"sent {rows} rows to topic {self.topic!r} through {self.address.url}; they "
                "stay in the store, and a retry of the task sends them again (at-least-once)"
            )
            raise
        finally:
            if client is not None:
                client.close()
        return SentRows(rows, requests)

    def sent(self, messages: list[WriterCommitMessage | None], what: str) -> None:
        rows = sum(m.rows for m in messages if isinstance(m, SentRows))
        log.info("%s: %d rows sent to %r through %s", what, rows, self.topic, self.address.url)

    def aborted(self, messages: list[WriterCommitMessage | None], what: str) -> None:
        # A lower bound: Spark may run the abort before a finished task's message is
        # recorded (reviewc F7: 0 said, 1,000 stored, 1 run of 4), and a failed task's
        # error, not this, says what it had sent.
        reported = [m for m in messages if isinstance(m, SentRows)]
        log.warning(
            "%s failed; at least %d rows are in topic %r through %s, as far as Spark reported "
            "(%d of %d tasks reported their count; a failed task's error says how many rows it "
            "had sent): the broker path cannot take them back (at-least-once)",
            what, sum(m.rows for m in reported), self.topic, self.address.url, len(reported),
            len(messages),
        )  # fmt: skip


def _budget(client: Client) -> int:
    welcome = client.welcome
    frame = welcome.limits["max_frame_bytes"] if welcome is not None else CHUNK_BYTES
    return max(1, min(CHUNK_BYTES, frame // 2))


def spill_root() -> str | None:
    """Where a retried task keeps its checked rows: the executor's Spark local directory
    (SPARK_LOCAL_DIRS, which Spark's workers set and which is sized for its own shuffle
    spills), else None, tempfile's (review3: /tmp is often small, or a tmpfs in memory)."""
    for entry in os.environ.get("SPARK_LOCAL_DIRS", "").split(","):
        if entry and os.path.isdir(entry):
            return entry
    return None


def _limits(client: Client) -> StoreConfig:
    """What a row is checked against: the broker's store's size limits where its welcome
    says them (a broker of this package does), else the loosest (the broker checks)."""
    welcome = client.welcome
    limits = welcome.limits if welcome is not None else {}
    return replace(
        _LOOSE,
        max_message_size=min(limits.get("max_message_size", 1 << 30), _LOOSE.max_message_size),
        max_properties_size=min(
            limits.get("max_properties_size", 1 << 20), _LOOSE.max_properties_size
        ),
    )


def _name_the_limits(exc: EQueueError, config: StoreConfig) -> None:
    if isinstance(exc, MessageTooLargeError) and config is not _LOOSE:
        exc.add_note(
            f"(the limits are the broker's store's, from its welcome: max_message_size="
            f"{config.max_message_size}, max_properties_size={config.max_properties_size}; "
            "equeue serve --max-frame-bytes bounds them)"
        )


def _max_batch_messages(client: Client) -> int:
    welcome = client.welcome
    limits = welcome.limits if welcome is not None else {}
    return int(limits.get("max_batch_messages", DEFAULT_MAX_BATCH_MESSAGES))


class EqueueBrokerWriter(_BrokerSink, DataSourceArrowWriter):
    def __init__(self, options: dict[str, str], schema: StructType, overwrite: bool) -> None:
        _known(options, BATCH_OPTIONS, "write")
        super().__init__(options, schema, overwrite)

    def write(self, iterator: Iterator[pa.RecordBatch]) -> SentRows:
        return self.send(iterator)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        self.sent(messages, "write")

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        self.aborted(messages, "write")


class EqueueBrokerStreamWriter(_BrokerSink, DataSourceStreamArrowWriter):
    def __init__(self, options: dict[str, str], schema: StructType, overwrite: bool) -> None:
        _known(options, STREAM_OPTIONS, "writeStream")
        super().__init__(options, schema, overwrite)

    def write(self, iterator: Iterator[pa.RecordBatch]) -> SentRows:
        return self.send(iterator)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        self.sent(messages, f"epoch {batchId}")

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        self.aborted(messages, f"epoch {batchId}")
