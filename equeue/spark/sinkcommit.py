"""The sink's commit, on the driver: a job's staged rows appended through one writer.

1. Open the store for writing (SinkCommitError in one line if another process holds it).
2. Finish every commit a crash interrupted (an ``intent.json`` under ``incoming/``).
3. A job the ledger records as committed (a re-run) appends nothing: its files go.
4. Write the intent (atomic): the job, its staged files in order, each queue's next
   offset. Then append, flush, record the job in the ledger (atomic), remove its files.

Finishing an intent first counts the job's rows already in the log: the topic's messages
past the recorded offsets, merged in log order, compared with the staged rows in order
up to the first that differs; only the rest is appended.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import repeat
from pathlib import Path
from typing import Any, Final

import pyarrow as pa

from equeue.digits import ascii_number
from equeue.errors import (
    CorruptionError,
    EQueueError,
    SinkCommitError,
    StoreLockedError,
    StorePathError,
)
from equeue.safepath import check_file, open_file
from equeue.spark.aborted import tidy
from equeue.spark.ledger import INTENT_FILE, Incoming, Intent, Job
from equeue.store.append import pick_queue
from equeue.store.meta import LOCK_FILE
from equeue.store.store import MessageStore
from equeue.store.types import Message, OutgoingMessage

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
# many rows.
KILL_AFTER_ENV: Final = "EQUEUE_SINK_KILL_AFTER_ROWS"
_PULL: Final = 1024


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


def outgoing(batch: pa.RecordBatch) -> list[OutgoingMessage]:
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
        found = 0
        try:
            with open_file(path, "rb") as f:
                reader = pa.ipc.open_file(f)
                for i in range(reader.num_record_batches):
                    batch = reader.get_batch(i)
                    found += batch.num_rows
                    yield batch
        except (OSError, pa.ArrowException) as exc:
            raise SinkCommitError(
                f"cannot read the staged rows of {intent.job.describe()} in {path} ({exc}); "
                f"the intent {directory / INTENT_FILE} names it: restore the file, or remove "
                "the directory to give up the job's rows not appended yet"
            ) from None
        if found != rows:
            raise SinkCommitError(
                f"staged file {path} holds {found} rows, its task reported {rows}: "
                "it was changed after the task wrote it"
            )


def commit(store: str, job: Job, topic: str, files: list[tuple[str, int]]) -> None:
    """Append ``job``'s staged ``files`` to ``topic`` through one writer, all or nothing;
    first finish every commit a crash interrupted (their intents)."""
    try:
        _commit(store, job, topic, files)
    except OSError as exc:  # listing or removing staged files (writes raise StoreWriteError)
        raise SinkCommitError(
            f"the commit of {job.describe()} to {store} failed: {exc}; what it appended is "
            "recorded in its intent, and the next sink commit to the store appends the rest"
        ) from exc


def _commit(store: str, job: Job, topic: str, files: list[tuple[str, int]]) -> None:
    incoming = Incoming(store)
    with _open_writer(store, job) as opened:
        tidy(incoming)
        for path in incoming.pending_intents():
            intent = _read_intent(path)
            if intent.job != job:
                _finish(opened, incoming, intent)
        if incoming.committed(job):
            incoming.remove_job_dir(job)  # a re-run: its rows are in the store already
            return
        intent_path = incoming.job_dir(job) / INTENT_FILE
        if check_file(intent_path):  # an earlier run of this job began appending: finish it
            intent = _read_intent(intent_path)
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


def _read_intent(path: Path) -> Intent:
    try:
        return Intent.read(path)
    except (CorruptionError, StorePathError) as exc:
        raise SinkCommitError(
            f"cannot read the sink intent {path} ({exc}); every sink commit to the store "
            "finishes the intents under incoming/ first: move its directory "
            f"{path.parent} out of the store (the rows staged there that the log does not "
            "hold yet are then given up) or restore the file"
        ) from None


def _open_writer(store: str, job: Job) -> MessageStore:
    try:
        return MessageStore.open(store)
    except StoreLockedError:
        holder = "?"
        try:
            with open_file(Path(store) / LOCK_FILE, "rb") as f:
                holder = f.read(64).decode(errors="replace").strip() or "?"
        except OSError:
            pass
        again = (
            "run the write again (its rows are staged anew)"
            if job.batch is None
            else "restart the query (it runs the epoch again)"
        )
        raise SinkCommitError(
            f"the store at {store} is open for writing by another process (pid {holder}): the "
            "sink appends through its own writer; nothing of the "
            f"{job.describe()} was appended; stop that writer (or open it read_only=True) "
            f"and {again}, or, if that writer is a broker (equeue serve), write through it "
            '(option "broker", docs/spark.md "Through a broker")'
        ) from None


def _finish(opened: MessageStore, incoming: Incoming, intent: Intent) -> None:
    """Append what of ``intent`` the log does not hold yet, flush, record, clean up."""
    if incoming.committed(intent.job):  # killed after its ledger entry: only clean up
        incoming.remove_job_dir(intent.job)
        return
    try:
        _append_rest(opened, incoming, intent)
    except SinkCommitError:
        raise
    except EQueueError as exc:
        raise SinkCommitError(
            f"appending the rows of {intent.job.describe()} to {opened.path} failed part way "
            f"({exc}); the intent {incoming.job_dir(intent.job) / INTENT_FILE} records the "
            "rows: the next sink commit to this store appends the rest, none twice"
        ) from exc


def _count(text: str) -> int:
    """A failpoint's row count; a value that is not one (set by mistake) disarms it."""
    return ascii_number(text) or 0


def _append_rest(opened: MessageStore, incoming: Incoming, intent: Intent) -> None:
    done = _appended(opened, incoming, intent)
    kill_after = _count(os.environ.get(KILL_AFTER_ENV, ""))
    appended = 0
    for batch in _batches(incoming, intent):
        if done >= batch.num_rows:
            done -= batch.num_rows
            continue
        messages = outgoing(batch.slice(done))
        done = 0
        opened.send_batch(intent.topic, messages)
        appended += len(messages)
        if kill_after and appended >= kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
    opened.flush()
    incoming.record(intent.job)
    incoming.remove_job_dir(intent.job)


class _Queue:
    """One queue of the topic past the intent's recorded offset: its next message (pulled
    as needed) and the offset the intent's next row in this queue would have."""

    def __init__(self, opened: MessageStore, topic: str, queue_id: int, offset: int) -> None:
        self.opened, self.topic, self.queue_id = opened, topic, queue_id
        self.expected = offset
        self.end = opened.queue_range(topic, queue_id)[1]
        self._next = offset
        self._pulled: list[Message] = []
        self.head: Message | None = None
        self.advance()

    def advance(self) -> None:
        if not self._pulled:
            pulled = self.opened.pull(self.topic, self.queue_id, self._next, _PULL)
            self._pulled = list(reversed(pulled.messages))
            self._next = pulled.next_offset
        self.head = self._pulled.pop() if self._pulled else None


def _appended(opened: MessageStore, incoming: Incoming, intent: Intent) -> int:
    """How many of the intent's rows lead the log after its recorded queue offsets.

    The rows went in order, each to its queue at the next offset there, and nothing came
    between them (the commit held the writer). So row by row: the first message left in log
    order must be the row, at the offset its queue expects; or the row's queue has nothing
    at that offset but more after it (or its end is past it): a message compaction (or
    retention) removed, which queues keep the offset of. A row's queue is known before
    looking when it has a queue_id or a key (``pick_queue`` hashes the key); the round
    robin's choice is not, but compaction removes a keyless message only past retention,
    never as superseded."""
    if intent.topic not in opened.topics():
        return 0
    ids = opened.queue_ids(intent.topic)
    queues = {
        q: _Queue(opened, intent.topic, q, intent.offsets[q] if q < len(intent.offsets) else 0)
        for q in ids
    }
    matched = 0
    rows = (row for batch in _batches(incoming, intent) for row in _rows(batch))
    for row in rows:
        heads = [queue for queue in queues.values() if queue.head is not None]
        first = min(heads, key=_head_position) if heads else None
        if row.queue_id is None and row.key is None:  # round robin: the next message or none
            queue = first
            if queue is None or queue.head is None or queue.head.queue_offset != queue.expected:
                break
        else:
            queue_id = pick_queue(row.queue_id, row.key, (row.key or "").encode(), len(ids), 0)
            queue = queues.get(queue_id[0])
            if queue is None:
                break
        head = queue.head
        if head is not None and head.queue_offset == queue.expected:
            if queue is not first or not row.matches(head):
                break
            queue.advance()
        elif queue.expected >= (head.queue_offset if head is not None else queue.end):
            break  # nothing stored at or past the offset: the row was not appended
        queue.expected += 1
        matched += 1
    return matched


def _head_position(queue: _Queue) -> int:
    return queue.head.position if queue.head is not None else -1
