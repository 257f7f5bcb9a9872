"""``spark.readStream.format("equeue")``: a store's topics as a Structured Streaming source.

Modelled on Spark's Kafka source. An offset is ``{topic: {queue_id: next_offset}}`` (queue
ids as strings: Spark keeps offsets as JSON in the query's checkpoint), and under ``FROM``
where a batch begins a queue that is not at the start offset (a new queue), so a query
restarted from its checkpoint goes on exactly where its last committed batch ended, and a
batch run again reads the same ranges. A micro-batch has one partition per
(topic, queue, start, end); executors read it through a read-only ``MessageStore``
beside the writer.

Options (names case-insensitive, as Spark passes them):

- ``topics`` (comma-separated names) or ``topicPattern`` (a regular expression the whole
  topic name must match): exactly one. Topics matching the pattern and queues that
  appear while the query runs are read from their first offset, as Kafka reads new
  partitions.
- ``startingOffsets``: ``earliest``, ``latest`` (default) or JSON
  ``{"topic": {"0": 23, "1": -2}}``, -2 for a queue's earliest, -1 for its latest; a queue
  the JSON leaves out starts at its earliest. Only a new query uses it.
- ``maxOffsetsPerTrigger``: at most this many offsets per micro-batch, split fairly over
  the queues that have some; ``minOffsetsPerTrigger`` with ``maxTriggerDelay`` (default
  15 m): wait for at least that many, but no longer than the delay.
- ``failOnDataLoss`` (default true): offsets the query was to read are gone (retention
  removed them, the topic was deleted or re-created) -> DataLossError; false: a warning
  and the query goes on from the first offset there is. Holes compaction leaves in a
  queue's offsets are not data loss: the records compacted away are not read, as a
  consumer's pull skips them.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import pyarrow as pa
from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    ReadMinRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from equeue.errors import (
    AuthenticationError,
    DataLossError,
    EQueueError,
    SparkOptionError,
    SparkSchemaError,
    TopicNotFoundError,
)
from equeue.spark.columns import MESSAGE_FIELDS
from equeue.spark.source import BATCH_ROWS, MESSAGE_SCHEMA
from equeue.spark.streamoffsets import DELETED as DELETED
from equeue.spark.streamoffsets import EARLIEST as EARLIEST
from equeue.spark.streamoffsets import FROM as FROM
from equeue.spark.streamoffsets import LATEST as LATEST
from equeue.spark.streamoffsets import Offsets as Offsets
from equeue.spark.streamoffsets import checked_offset as checked_offset
from equeue.spark.streamoffsets import deleted_of as deleted_of
from equeue.spark.streamoffsets import offsets_json as offsets_json
from equeue.spark.streamoffsets import ordered as ordered
from equeue.spark.viabroker import BrokerQueues
from equeue.store.types import Message

if TYPE_CHECKING:
    from equeue.store.store import MessageStore

log = logging.getLogger(__name__)

PULL_COUNT: Final = 4096  # messages per pull on an executor
DEFAULT_TRIGGER_DELAY: Final = 15 * 60.0  # seconds, as Kafka's maxTriggerDelay
OPTIONS: Final = (
    "path",
    "topics",
    "topicPattern",
    "startingOffsets",
    "maxOffsetsPerTrigger",
    "minOffsetsPerTrigger",
    "maxTriggerDelay",
    "failOnDataLoss",
    "broker",
    "tokenFile",
    "caFile",
    "connectTimeout",
    "timeout",
)
_KNOWN: Final = {name.lower(): name for name in OPTIONS}
_DELAY: Final = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*")
_UNIT: Final = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}

_ARROW: Final = MESSAGE_FIELDS  # the batch source's columns, all of them


class QueueRange(InputPartition):
    """Offsets [start, end) of one queue: what one task of a micro-batch reads."""

    def __init__(
        self, topic: str, queue_id: int, start: int, end: int, deleted: int | None = None
    ) -> None:
        super().__init__((topic, queue_id, start, end))
        self.topic = topic
        self.queue_id = queue_id
        self.start = start
        self.end = end
        # where the topic was last deleted when the batch was planned: -1 never, None not
        # known (an older offset, an older broker)
        self.deleted = deleted


class StreamOptions:
    """The options, checked once (on the driver, and again where a task builds its reader)."""

    def __init__(self, options: Mapping[str, str]) -> None:
        given = {key.lower(): value for key, value in options.items()}
        for key in given:
            if key not in _KNOWN:
                raise SparkOptionError(
                    f"readStream.format('equeue'): unknown option {key!r}; the options are "
                    + ", ".join(OPTIONS)
                )
        from equeue.spark.viabroker import BrokerAddress, broker_url

        # Through a broker (viabroker.py) nothing opens the store: the driver plans and the
        # tasks pull with the client; ``path`` then only names the store in messages.
        self.broker: BrokerAddress | None = None
        path = given.get("path")
        if broker_url(given) is not None:
            self.broker = BrokerAddress(given)
            path = f"the store served at {self.broker.url}"
        if not path:
            raise SparkOptionError(
                'readStream.format("equeue") needs the store directory: .load("/path/to/store")'
                ' (or option("broker", URL) where a broker serves it)'
            )
        self.path = path
        topics, pattern = given.get("topics"), given.get("topicpattern")
        if (topics is None) == (pattern is None):
            raise SparkOptionError(
                "readStream.format('equeue') needs exactly one of the options 'topics' (names, "
                "comma-separated) and 'topicPattern' (a regular expression), got "
                + ("both" if topics is not None else "neither")
            )
        self.topics: list[str] | None = None
        self.pattern: re.Pattern[str] | None = None
        if topics is not None:
            self.topics = sorted({t.strip() for t in topics.split(",") if t.strip()})
            if not self.topics:
                raise SparkOptionError(f"option topics={topics!r}: it names no topic")
        else:
            try:
                self.pattern = re.compile(pattern or "")
            except re.error as exc:
                raise SparkOptionError(
                    f"option topicPattern={pattern!r} is not a regular expression: {exc}"
                ) from None
        self.starting = given.get("startingoffsets", "latest")
        self.starting_json: dict[str, dict[str, int]] | None = None
        if self.starting not in ("earliest", "latest"):
            self.starting_json = offsets_json(self.starting)
        self.max_offsets = _count(given, "maxOffsetsPerTrigger")
        self.min_offsets = _count(given, "minOffsetsPerTrigger")
        self.max_delay = _delay(given.get("maxtriggerdelay"))
        if (
            self.max_offsets is not None
            and self.min_offsets is not None
            and self.min_offsets > self.max_offsets
        ):
            raise SparkOptionError(
                f"option minOffsetsPerTrigger={self.min_offsets} is more than "
                f"maxOffsetsPerTrigger={self.max_offsets}"
            )
        fail = given.get("failondataloss", "true").strip().lower()
        if fail not in ("true", "false"):
            raise SparkOptionError(
                f"option failOnDataLoss={given['failondataloss']!r}: it must be true or false"
            )
        self.fail_on_data_loss = fail == "true"

    def matches(self, topic: str) -> bool:
        if self.topics is not None:
            return topic in self.topics
        assert self.pattern is not None
        return self.pattern.fullmatch(topic) is not None


def _count(given: Mapping[str, str], name: str) -> int | None:
    text = given.get(name.lower())
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise SparkOptionError(f"option {name}={text!r}: it must be a whole number of at least 1")
    return value


def _delay(text: str | None) -> float:
    if text is None:
        return DEFAULT_TRIGGER_DELAY
    match = _DELAY.fullmatch(text)
    if match is None:
        raise SparkOptionError(
            f"option maxTriggerDelay={text!r}: it must be a duration like '15m', '30s', '500ms'"
        )
    seconds = float(match.group(1)) * _UNIT[match.group(2) or "ms"]
    if not math.isfinite(seconds):
        raise SparkOptionError(f"option maxTriggerDelay={text!r}: it is too long to be a duration")
    return seconds


class EqueueStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, options: dict[str, str], schema: StructType) -> None:
        self.options = StreamOptions(options)
        names = [field.name for field in schema.fields]
        if names != _ARROW.names:
            raise SparkSchemaError(
                f"readStream.format('equeue') gives the columns {', '.join(_ARROW.names)} "
                f"(the batch source's: {MESSAGE_SCHEMA}); a schema of {names} was asked for"
            )
        self.schema = schema
        self._store: MessageStore | BrokerQueues | None = None
        self._target: Offsets | None = None  # Trigger.AvailableNow: where the query ends
        self._deleted: dict[str, int] | None = None  # the store's deleted_topics(), as planned
        self._unsure: set[str] = set()  # topics warned of: no DELETED in the start offset
        self._last_batch = time.monotonic()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_store"] = None  # (a task opens its own)
        return state

    # --- the driver ----------------------------------------------------------

    def _ranges(self) -> dict[str, dict[str, tuple[int, int]]]:
        """(first, next) offset of every queue of the topics read, as the store has them now."""
        try:
            return self._ranges_now()
        except AuthenticationError:
            if not isinstance(self._store, BrokerQueues):
                raise
            # The driver's client reconnects with the token it read when it connected; the
            # token file may hold a new one since (rotated with a broker restart, reviewc
            # F5): connect once more, reading it again, as every task does.
            self._store.close()
            self._store = None
            return self._ranges_now()

    def _ranges_now(self) -> dict[str, dict[str, tuple[int, int]]]:
        if self._store is None:
            self._store = open_queues(self.options)
        store = self._store
        store.refresh()  # (also on a new handle: see read_range)
        out: dict[str, dict[str, tuple[int, int]]] = {}
        # (before the topics: a topic created again after this is judged at the next batch)
        self._deleted = store.deleted_topics()
        for topic in store.topics():
            if not self.options.matches(topic):
                continue
            try:
                out[topic] = {str(q): store.queue_range(topic, q) for q in store.queue_ids(topic)}
            except TopicNotFoundError:
                continue  # deleted meanwhile
        return out

    def initialOffset(self) -> dict[str, Any]:
        ranges = self._ranges()
        wanted = self.options.starting_json
        out: Offsets = {}
        for topic, queues in ranges.items():
            out[topic] = {}
            for queue, (first, next_) in queues.items():
                if wanted is not None:
                    offset = wanted.get(topic, {}).get(queue, EARLIEST)
                else:
                    offset = EARLIEST if self.options.starting == "earliest" else LATEST
                if offset > next_:
                    raise SparkOptionError(
                        f"option startingOffsets: offset {offset} of {topic}/{queue} is past the "
                        f"queue's end {next_} in {self.options.path}"
                    )
                if offset == EARLIEST:
                    offset = first
                elif offset == LATEST:
                    offset = next_
                out[topic][queue] = offset
        if wanted is not None:
            for topic, named in wanted.items():
                for queue in named:
                    if queue not in ranges.get(topic, {}):
                        raise SparkOptionError(
                            f"option startingOffsets names {topic}/{queue}, which "
                            f"{self.options.path} does not hold (or the query does not read)"
                        )
        return ordered(self._with_deleted(out))

    def _with_deleted(self, offsets: dict[str, Any]) -> dict[str, Any]:
        """``offsets`` with DELETED for its topics, where the store said."""
        if self._deleted is not None:
            offsets[DELETED] = {t: self._deleted[t] for t in offsets if t in self._deleted}
        return offsets

    def _created_again(self, topic: str, start: Mapping[str, Any]) -> bool:
        """``topic`` was deleted and created again since ``start`` (as far as is known: a
        deletion mark the store no longer has, after a rebuild of topics.json, is not)."""
        then = deleted_of(start, topic)
        now = None if self._deleted is None else self._deleted.get(topic)
        return then is not None and now is not None and now != then

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = {t: {q: r[1] for q, r in qs.items()} for t, qs in self._ranges().items()}

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.options.max_offsets is not None:
            return ReadMaxRows(self.options.max_offsets)
        if self.options.min_offsets is not None:
            return ReadMinRows(self.options.min_offsets)
        return ReadAllAvailable()

    def reportLatestOffset(self) -> dict[str, Any] | None:
        return ordered({t: {q: r[1] for q, r in qs.items()} for t, qs in self._ranges().items()})

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        start = checked_offset(start)
        ranges = self._ranges()
        if DELETED not in start:
            self._warn_unsure(start)
        bases: Offsets = {}  # where each queue's next batch begins
        ends: Offsets = {}  # how far it may go
        moved: Offsets = {}  # queues whose batch does not begin at start's offset
        for topic in sorted((set(start) - {FROM, DELETED}) | set(ranges)):
            known = start.get(topic, {})
            queues = ranges.get(topic)
            if queues is None:
                self._lost_topic(topic, known)
                continue
            if known and self._created_again(topic, start):
                self._recreated(topic, known)
                known = {}  # the new topic's queues: from their start
            for queue in sorted(set(known) | set(queues), key=int):
                if queue not in queues:
                    self._lost_topic(topic, {queue: known[queue]})
                    continue
                first, next_ = queues[queue]
                base = known.get(queue)
                if base is None:
                    base = first  # a new topic or queue: from its start, as Kafka's new partitions
                elif base > next_:
                    base = self._went_back(topic, queue, base, first, next_)
                elif base < first:
                    base = self._removed(topic, queue, base, first)
                if self._target is not None:
                    next_ = max(base, min(next_, self._target.get(topic, {}).get(queue, base)))
                bases.setdefault(topic, {})[queue] = base
                ends.setdefault(topic, {})[queue] = next_
                if base != known.get(queue):
                    moved.setdefault(topic, {})[queue] = base
        available = {(t, q): ends[t][q] - b for t, qs in bases.items() for q, b in qs.items()}
        total = sum(available.values())
        if isinstance(limit, ReadAllAvailable):
            takes = available
        else:
            # Trigger.AvailableNow ends at its target: waiting for more would never end.
            least = None if self._target is not None else self.options.min_offsets
            waited = time.monotonic() - self._last_batch
            if least is not None and total < least and waited < self.options.max_delay:
                return ordered(start)
            most = limit.max_rows if isinstance(limit, ReadMaxRows) else None
            takes = fair_shares(available, most)
        end: dict[str, Any] = {
            t: {q: b + takes[(t, q)] for q, b in qs.items()} for t, qs in bases.items()
        }
        if ordered(end) == ordered({t: qs for t, qs in start.items() if t not in (FROM, DELETED)}):
            return ordered(start)  # nothing new: the same offset, so no batch
        self._last_batch = time.monotonic()
        if moved:
            # Where those queues begin is fixed now, in the batch's end offset (the
            # checkpoint keeps it): a re-run reads the same rows, and what retention
            # removes before the task reads is data loss, not a silent skip.
            end[FROM] = moved
        return ordered(self._with_deleted(end))

    def _warn_unsure(self, start: Mapping[str, Any]) -> None:
        """A start offset without DELETED (an older version's checkpoint, or planned
        through a broker before protocol version 5) of a topic the store has a deletion
        mark for: a re-creation since cannot be ruled out, and would skip the new topic's
        first messages silently (reviewl L4). Said once per topic; not refused, as most
        such marks predate the checkpoint."""
        marks = self._deleted or {}
        for topic in sorted(set(start) - {FROM} - self._unsure):
            if topic in marks:
                self._unsure.add(topic)
                log.warning(
                    "topic %r of %s was deleted at log position %d; the query's checkpoint "
                    "(written before deletion marks were kept, or through a broker before "
                    "protocol version 5) cannot rule out that it was created again since: "
                    "if it was, its first messages up to the checkpoint's offsets %s are "
                    "skipped",
                    topic, self.options.path, marks[topic], dict(start[topic]),
                )  # fmt: skip

    def _lost_topic(self, topic: str, queues: Mapping[str, int]) -> None:
        """Queues the query was reading are gone (their topic was deleted)."""
        what = f"topic {topic!r} (queues {', '.join(sorted(queues, key=int))})"
        self._loss(
            f"{what} was read up to offsets {dict(queues)}, but {self.options.path} no longer "
            "holds it (deleted)"
        )

    def _recreated(self, topic: str, queues: Mapping[str, int]) -> None:
        assert self._deleted is not None
        self._loss(
            f"topic {topic!r} was read up to offsets {dict(queues)}, but it was deleted and "
            f"created again since (at log position {self._deleted[topic]}) in "
            f"{self.options.path}: those offsets are the new topic's"
        )

    def _went_back(self, topic: str, queue: str, base: int, first: int, next_: int) -> int:
        self._loss(
            f"topic {topic!r} queue {queue}: the query was to read from offset {base}, but the "
            f"queue now ends at {next_} (the topic was deleted and created again) in "
            f"{self.options.path}"
        )
        return first

    def _removed(self, topic: str, queue: str, base: int, first: int) -> int:
        self._loss(lost_message(self.options.path, topic, queue, base, first))
        return first

    def _loss(self, message: str) -> None:
        if self.options.fail_on_data_loss:
            raise DataLossError(message + "; set failOnDataLoss=false to skip what is gone")
        log.warning("%s; skipped (failOnDataLoss=false)", message)

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[QueueRange]:
        start, end = checked_offset(start), checked_offset(end)
        out: list[QueueRange] = []
        ranges: dict[str, dict[str, tuple[int, int]]] | None = None
        moved = end.get(FROM, {})
        for topic, queues in end.items():
            if topic in (FROM, DELETED):
                continue
            for queue, stop in queues.items():
                begin = moved.get(topic, {}).get(queue, start.get(topic, {}).get(queue))
                if begin is None or begin > stop:
                    # An end offset without FROM (a checkpoint of an older version) for a
                    # queue that appeared in the batch: from its first offset now.
                    ranges = self._ranges() if ranges is None else ranges
                    begin = min(ranges.get(topic, {}).get(queue, (stop, stop))[0], stop)
                if begin < stop:
                    out.append(QueueRange(topic, int(queue), begin, stop, deleted_of(end, topic)))
        return out

    def commit(self, end: dict[str, Any]) -> None:
        return  # the offsets live in Spark's checkpoint; the store keeps no state for us

    def stop(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None

    # --- the executors -------------------------------------------------------

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, QueueRange)
        return read_range(self.options, partition)


def fair_shares(available: Mapping[tuple[str, str], int], limit: int | None) -> dict[Any, int]:
    """At most ``limit`` offsets in all, each queue an equal share of what is left once the
    queues with less than their share have all they have (a queue with a backlog cannot
    starve the others, as Kafka's proportional split would let it)."""
    if limit is None or sum(available.values()) <= limit:
        return dict(available)
    takes: dict[Any, int] = {}
    left = limit
    order = sorted(available, key=lambda k: (available[k], k))
    for i, key in enumerate(order):
        share = left // (len(order) - i)
        if i == len(order) - 1:
            share = left
        takes[key] = min(available[key], share)
        left -= takes[key]
    return takes


def lost_message(
    path: str, topic: str, queue: str | int, wanted: int, first: int, lost_end: int | None = None
) -> str:
    """Offsets ``wanted`` to ``lost_end`` - 1 (by default to ``first`` - 1) are gone, the
    queue's ``first`` offset is past them (for a range planned wholly below it, its end
    is not the first one available: reviewc F6)."""
    end = first if lost_end is None else lost_end
    return (
        f"topic {topic!r} queue {queue}: offsets {wanted} to {end - 1} were removed "
        f"(retention, or the topic was deleted) before the query read them: it wanted offset "
        f"{wanted}, the first one available is {first}, in {path}"
    )


def read_range(options: StreamOptions, part: QueueRange) -> Iterator[pa.RecordBatch]:
    """The messages of ``part`` as Arrow record batches; offsets compaction removed are left
    out, offsets retention removed are data loss."""

    def loss(message: str) -> None:
        if options.fail_on_data_loss:
            raise DataLossError(message + "; set failOnDataLoss=false to skip what is gone")
        log.warning("%s; skipped (failOnDataLoss=false)", message)

    topic, queue, offset, end = part.topic, part.queue_id, part.start, part.end
    store = open_queues(options)
    try:
        try:
            # Just opened, the handle starts past what retention had removed; the refresh
            # also takes in a retention run since the open (a test runs one there).
            store.refresh()
            first = store.queue_range(topic, queue)[0]
            deleted = store.deleted_topics() if part.deleted is not None else None
        except EQueueError as exc:  # TopicNotFoundError: deleted since the batch was planned
            loss(f"topic {topic!r} queue {queue}: offsets {offset} to {end - 1} are gone: {exc}")
            return
        # (a mark the store no longer has, topics.json rebuilt, is not a re-creation, as
        # for the planning: review6 R6-4)
        now = deleted.get(topic) if deleted is not None else None
        if now is not None and now != part.deleted:
            loss(
                f"topic {topic!r} queue {queue}: offsets {offset} to {end - 1} are gone: the "
                f"topic was deleted and created again since the batch was planned, in "
                f"{options.path}"
            )
            return
        if offset < first:
            loss(lost_message(options.path, topic, queue, offset, first, min(first, end)))
            offset = first
        holes: list[tuple[int, int]] = []  # offsets with no message: compaction's, or lost
        pending: list[Message] = []
        while offset < end:
            try:
                pulled = store.pull(topic, queue, offset, min(end - offset, PULL_COUNT))
            except TopicNotFoundError as exc:  # deleted while this task read it
                loss(
                    f"topic {topic!r} queue {queue}: offsets {offset} to {end - 1} are gone: {exc}"
                )
                holes = []
                break
            if pulled.next_offset <= offset:
                loss(
                    f"topic {topic!r} queue {queue}: offsets {offset} to {end - 1} were planned "
                    f"but the queue ends at {pulled.next_offset} in {options.path} (the writer "
                    "lost messages it had made visible, or the topic was created again)"
                )
                break
            kept = [m for m in pulled.messages if m.queue_offset < end]
            for message in kept:
                if message.queue_offset > offset:
                    holes.append((offset, message.queue_offset))
                offset = message.queue_offset + 1
            pending += kept
            if pulled.next_offset > offset:
                stop = min(pulled.next_offset, end)
                holes.append((offset, stop))
                offset = stop
            while len(pending) >= BATCH_ROWS:
                yield _batch(pending[:BATCH_ROWS])
                del pending[:BATCH_ROWS]
        if pending:
            yield _batch(pending)
        if holes:
            # Retention removes a queue's oldest offsets: a hole now below its first offset
            # may be what retention removed while this task read (a compaction hole there
            # is reported too: the records around it are gone, it cannot be told apart).
            store.refresh()
            try:
                now_first = store.queue_range(topic, queue)[0]
            except TopicNotFoundError:
                now_first = end  # deleted meanwhile: every hole is gone for good
            gone = [(a, min(b, now_first)) for a, b in holes if a < now_first]
            for a, b in gone:
                loss(lost_message(options.path, topic, queue, a, now_first, b))
    finally:
        store.close()


def open_queues(options: StreamOptions) -> MessageStore | BrokerQueues:
    """What the driver plans with and a task reads through: a read-only handle on the
    store, or a client of the broker serving it (the ``broker`` option)."""
    from equeue.store.store import MessageStore

    if options.broker is not None:
        return BrokerQueues(options.broker.connect())
    return MessageStore.open(options.path, read_only=True)


def _batch(messages: list[Message]) -> pa.RecordBatch:
    """The rows of ``messages``: the columns are Message's fields by name, the times its
    int64 nanoseconds floored to µs (``us``), as the batch source builds them."""
    fields = list(zip(*messages, strict=True))
    columns: list[Any] = [fields[_FIELD[name]] for name in _ARROW.names[:-2]]
    columns += [us(fields[_FIELD["created_ns"]]), us(fields[_FIELD["stored_ns"]])]
    return pa.RecordBatch.from_arrays(
        [pa.array(values, field.type) for values, field in zip(columns, _ARROW, strict=True)],
        schema=_ARROW,
    )


_FIELD: Final = {name: i for i, name in enumerate(Message._fields)}


def us(nanoseconds: Sequence[int]) -> np.ndarray[Any, np.dtype[np.int64]]:
    """Int64 nanoseconds to µs, floored: the batch source's conversion (columns.py's
    ``record_columns_py``, the C accelerator's ``floor_us``), so both give equal rows."""
    return np.floor_divide(np.asarray(nanoseconds, np.int64), 1000)


__all__ = ["MESSAGE_SCHEMA", "EqueueStreamReader", "QueueRange", "StreamOptions", "fair_shares"]
