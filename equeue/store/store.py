"""MessageStore: topics split into queues over message chunks and queue chunks."""

from __future__ import annotations

import datetime as dt
import logging
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import Any

import xxhash

from equeue import speedups
from equeue.atomicfile import remove_temp_files
from equeue.chunks import ChunkManager, ChunkManagerConfig, ChunkReader, ChunkWriter
from equeue.chunks.config import MiB
from equeue.chunks.recovery import TailHint
from equeue.compaction import commit as compaction_commit
from equeue.errors import (
    ChunkRemovedError,
    ClosedError,
    CompactedAwayError,
    CompactionError,
    CorruptRecordError,
    InvalidTypeError,
    MessageNotFoundError,
    PositionNotFoundError,
    ReadOnlyError,
    StoreWriteError,
    TopicNotFoundError,
)
from equeue.format.chunk import HEADER_SIZE
from equeue.format.message import (
    MAX_NAME_BYTES,
    MESSAGE_HEAD_SIZE,
    STORED_TIME_OFFSET,
    decode_message_id,
    message_id_prefix,
)
from equeue.store import bodies, deletion, follow, pulling, times, topics, validate
from equeue.store import offsets as group_offsets
from equeue.store.append import Appender
from equeue.store.bodies import Append, Appended
from equeue.store.checkpoint import write_checkpoint
from equeue.store.config import StoreConfig
from equeue.store.consumer import Consumer, Start
from equeue.store.flush import GroupCommit, flush_recorded, record_flush_failure, run_service
from equeue.store.keyindex import KeyIndex, open_writer_index
from equeue.store.livetail import LiveTailWriter, current_boot_id, read_live_tail
from equeue.store.losses import losses_at_open, read_topics
from equeue.store.meta import (
    CHECKPOINT_FILE,
    KEYS_FILE,
    MESSAGES_DIR,
    OFFSETS_FILE,
    open_identity,
    read_meta,
    take_lock,
)
from equeue.store.offsets import GroupFiles
from equeue.store.queue import Queue
from equeue.store.queuecache import reentered
from equeue.store.queuerebuild import open_queue, queue_files
from equeue.store.reads import LogReader, tag_filter
from equeue.store.recovery import (
    RecoveryReport,
    tail_hint,
)
from equeue.store.reopen import reconcile_at_open, release_files
from equeue.store.topics import (
    UNSET,
    Cleanup,
    TopicPolicy,
    _Unset,
    deletions,
    topic_entries,
)
from equeue.store.topicsfile import TopicsFile, save_topic
from equeue.store.types import Message, OutgoingMessage, PullResult, SendResult
from equeue.store.validate import Checked

log = logging.getLogger("equeue.recovery")

_MAX_NAME = MAX_NAME_BYTES
# Recovery re-dispatches what was written after the last checkpoint; one is written
# whenever this much log has been written since, so that work stays bounded.
_CHECKPOINT_BYTES = 32 * MiB


class MessageStore:
    """An embedded message store. Open with ``MessageStore.open(path, config)``.

    Thread-safe: any number of threads may send and pull. Sends are
    serialised by one lock (message record first, then its queue entry);
    pulls read committed data without taking it.

    One writer per directory: a second writable open, from any process, raises
    StoreLockedError. ``read_only=True`` opens beside a running writer and sees
    what it has written (pulls pick up new messages; ``refresh()`` new topics and
    consumer offsets); it does no recovery and changes no file but its consumers'
    commits (``consumers/``, see ``consumer()``).

    ``store.recovery`` (a RecoveryReport) says what opening found and did.
    """

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        config: StoreConfig | None = None,
        *,
        read_only: bool = False,
    ) -> MessageStore:
        """Open (or, unless ``read_only``, create) the store at ``path``.

        Without ``config``, an existing store keeps the chunk sizes it was created with.
        """
        return cls(validate.check_open(path, config, read_only), config, read_only=read_only)

    def __init__(self, path: Path, config: StoreConfig | None, *, read_only: bool = False) -> None:
        self.path = path
        self._deleted: dict[str, int] = {}  # topic: log position of its deletion
        self.read_only = read_only
        self._closed = False
        self._meta_problems: list[str] = []
        self._lock_file = None
        if not read_only:
            validate.make_store_dir(path)
            self._lock_file = take_lock(path)
        try:
            self.store_id, self.config = open_identity(path, config, create=not read_only)
            self._open()
        except BaseException:
            if self._lock_file is not None:
                self._lock_file.close()
            raise

    def _open(self) -> None:
        config, path, read_only = self.config, self.path, self.read_only
        compactions: list[str] = []
        if not read_only:
            remove_temp_files(path)
            # Before the chunks load: a job that committed is rolled forward first, so
            # the log is never seen half old, half compacted.
            compactions = compaction_commit.recover(path)
        self._id_prefix = message_id_prefix(self.store_id)
        checkpoint = self._read_meta(CHECKPOINT_FILE, {})
        if not isinstance(checkpoint, dict):
            checkpoint = {}
        # The recovery scan of the ongoing chunk starts where the checkpoint's records
        # ended, or where the live tail (this boot's page cache) says, not at its first record.
        hint = tail_hint(checkpoint)
        boot = None if read_only else current_boot_id()
        found = None if boot is None else read_live_tail(path, boot)
        live = (
            None if found is None else TailHint(found.chunk_id, found.data_end, found.record_count)
        )
        self._open_log(hint, live)
        self._live_tail: LiveTailWriter | None = None  # created once recovery is done
        self._files = queue_files(self, checkpoint)  # the cache of open queues, the write lock
        self._queues: dict[str, list[Queue]] = {}
        self._topic_bytes: dict[str, bytes] = {}
        self._round_robin: dict[str, int] = {}
        self._policies: dict[str, TopicPolicy] = {}
        self._topics_file = TopicsFile(path, writer=not read_only)
        self._load_topics()
        self._offsets: dict[str, dict[str, dict[str, int]]] = self._read_meta(OFFSETS_FILE, {})
        if not read_only:
            deletion.finish_deletions(self, checkpoint)  # a deletion a crash interrupted
        self._meta_problems += losses_at_open(self, checkpoint)
        self._group_files = GroupFiles(path, self._meta_problems, writer=not read_only)
        self._keys = self._open_keys()
        self.recovery = RecoveryReport(
            cuts=list(self._messages.recovery_cuts),
            problems=self._meta_problems + self._messages.recovery_problems,
            compactions=compactions,
        )
        self.recovery.cuts += self._files.cuts + self._topics_file.cuts
        self._files.cuts, self._files.problems = self.recovery.cuts, self.recovery.problems
        self._lock = self._files.lock  # the one write lock: message record, then queue entry
        self._lock_owned = self._lock._is_owned  # type: ignore[attr-defined]
        self._arrived = threading.Condition(threading.Lock())
        self._waiting = 0
        self._flush_error: StoreWriteError | None = None
        # Flush attempts (service turns, flush() calls) are numbered as they start; the
        # outcome kept is that of the latest-started attempt that has ended (_set_flush_error).
        self._flush_attempts = 0
        self._flush_reported = 0
        self._flush_state_lock = threading.Lock()
        self._checkpointed = 0  # the log position of the last checkpoint written
        self._installed = compaction_commit.installed_marker(path)  # the last install adopted
        self._checkpoint_lock = threading.Lock()
        self._sender: Any = None
        self._check_in_c: Any = None
        if read_only:
            # The writer moved its queues' first offsets past the messages its retention
            # removed; the queue files still hold those entries, so move them here too.
            follow.follow_log(self)
            return
        self._log_tail: dict[str, Any] | None = reconcile_at_open(self, checkpoint)
        self._writer = ChunkWriter(self._messages, self._files.lock)
        self._group = (
            GroupCommit(self._lock, lambda: flush_recorded(self, self._writer.flush), self._wake)
            if config.flush == "sync"
            else None
        )
        fast = speedups.SPEEDUPS
        sender = None
        if fast is not None:
            sender = fast.Sender(
                self, self._lock, self._writer, self._queues, self._topic_bytes,
                self._round_robin, self._keys, self._id_prefix, SendResult,
                validate.check_tag, xxhash.xxh32_intdigest, time, HEADER_SIZE,
                config.max_message_size, config.layout.chunk_data_size, MessageStore.send,
            )  # fmt: skip
        # send() takes the whole C path unless sends must wait for a group commit; the
        # checks are C's whenever it is built.
        self._sender = sender if self._group is None else None
        if self._sender is not None and type(self).send is MessageStore.send:
            # store.send IS the C call (no Python frame), which hands every other send and
            # error to MessageStore.send as given; not where a subclass overrides send.
            self.__dict__["send"] = self._sender.call
        self._check_in_c = sender.check if sender is not None else None
        self._appender = Appender(
            self._writer, self._keys, self._id_prefix, self._topic_bytes, self._round_robin,
            self.path, lambda: self._closed, sender,
        )  # fmt: skip
        if boot is not None:
            try:
                self._live_tail = LiveTailWriter(path, boot, self._keys)
            except OSError as exc:  # only recovery's speed depends on it
                log.warning(
                    "no live tail for %s: %s; recovery will start at checkpoints", path, exc
                )
            else:
                self._messages.set_on_advance(self._live_tail.advance)
                self._files.on_sync_failure = self._live_tail.invalidate
                for manager in self._chunk_managers():
                    manager.set_on_sync_failure(self._live_tail.invalidate)
        # Not settled: what recovery found past the tail is synced by the next
        # checkpoint (the service's within flush_thorough_interval_ms), off this path.
        self._checkpoint(flush=True, settle=False)
        self._files.opened_store()
        self._service_stop = threading.Event()
        self._service = threading.Thread(
            target=run_service, args=(self, self._service_stop), name="equeue-service", daemon=True
        )
        self._service.start()

    # --- lifecycle -----------------------------------------------------------

    def __repr__(self) -> str:  # no I/O: what the handle holds
        mode = "closed" if self._closed else "read-only" if self.read_only else "read-write"
        return f"<MessageStore {str(self.path)!r} {mode}, {len(self._queues)} topics>"

    def __enter__(self) -> MessageStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Flush everything, write a checkpoint, release the files and the writer lock."""
        if self._closed:
            return
        try:
            if not self.read_only:
                self._service_stop.set()
                self._service.join()
                self._checkpoint(flush=True)
        finally:  # a failed final flush still releases the files and the lock, then raises
            try:
                with self._checkpoint_lock, self._lock:  # no checkpoint runs past here
                    self._closed = True
                    self._sender = None  # later sends go straight to ClosedError
                    self.__dict__.pop("send", None)
                    release_files(self)
            finally:
                with self._arrived:
                    self._arrived.notify_all()
                if self._lock_file is not None:
                    self._lock_file.close()

    def _chunk_managers(self) -> list[ChunkManager]:
        return [self._messages, *self._files.managers()]

    def flush(self) -> None:
        """Make everything sent so far durable, under any flush policy, and checkpoint it."""
        self._check_writable()
        attempt = self._start_flush()
        try:
            self._checkpoint(flush=True)
        except StoreWriteError as exc:  # later sends refused (until a reopen: a failed log)
            record_flush_failure(self, exc, attempt)
            raise
        self._set_flush_error(None, attempt)

    def flush_log(self) -> None:
        """fdatasync the message log up to every append so far (safe beside appends): what
        flush="sync" does per batch, for a caller batching acknowledgments (the broker).
        A failure refuses every later send, nothing written, until the store is reopened."""
        self._check_writable()
        flush_recorded(self, self._writer.flush)

    def _flush_log(self, least_bytes: int = 0) -> None:
        self._writer.flush(least_bytes)

    def _flush_queues(self, least_bytes: int = 0) -> None:
        for queues in list(self._queues.values()):
            for queue in queues:
                queue.flush(least_bytes)
        self._files.sync_closed()  # after: what a close left unflushed meanwhile too

    def _start_flush(self) -> int:
        """Number a flush attempt as it starts, for ``_set_flush_error``."""
        with self._flush_state_lock:
            self._flush_attempts += 1
            return self._flush_attempts

    def _set_flush_error(self, error: StoreWriteError | None, attempt: int) -> None:
        """Keep how flush ``attempt`` ended (None: it succeeded), unless an attempt that
        started after it has ended already: a service turn that failed before a later
        flush() succeeded, but reports only after it, must not refuse the sends after it."""
        with self._flush_state_lock:
            if attempt >= self._flush_reported:
                self._flush_reported = attempt
                self._flush_error = error

    # --- topics --------------------------------------------------------------

    def create_topic(
        self,
        topic: str,
        queue_count: int | None = None,
        *,
        cleanup: Cleanup | _Unset = UNSET,
        retention: dt.timedelta | _Unset | None = UNSET,
        delete_retention: dt.timedelta | _Unset = UNSET,
    ) -> None:
        """Create a topic, or change an existing one: its queue count grows (it never
        shrinks), and each cleanup setting given replaces the topic's (see TopicPolicy)."""
        validate.check_topic(topic)
        with self._lock:
            self._check_writable()
            topics.create_or_change(self, topic, queue_count, cleanup, retention, delete_retention)

    def delete_topic(self, topic: str) -> None:
        """Delete ``topic``: its queues and its consumer groups' offsets (crash-safe: a
        crash leaves the topic or none of it). Its records stay in the log until retention
        but are never seen again; a topic created under the name starts empty. Raises
        TopicNotFoundError, ReadOnlyError, StoreWriteError (equeue/store/deletion.py)."""
        deletion.delete_topic(self, topic)

    def topic_policy(self, topic: str) -> TopicPolicy:
        """What the compaction batch may remove from ``topic``."""
        self._topic(topic)
        return self._policies.get(topic, TopicPolicy())

    def topics(self) -> list[str]:
        """The names of the store's topics, sorted. Raises ClosedError once closed."""
        self._check_open()
        return sorted(self._queues)

    def queue_ids(self, topic: str) -> list[int]:
        """The queue ids of ``topic``: 0 to its queue count - 1. Raises TopicNotFoundError."""
        return list(range(len(self._topic(topic))))

    def queue_range(self, topic: str, queue_id: int) -> tuple[int, int]:
        """(first retained offset, next offset) of a queue."""
        queue = self._queue(topic, queue_id)
        return queue.first_offset, queue.next_offset

    def queue_positions(self, topic: str, queue_id: int, offset: int, count: int) -> list[int]:
        """The log positions of up to ``count`` entries of a queue from ``offset`` on, as
        pull reads them (compaction's holes left out), without reading the messages."""
        entries = self._queue(topic, queue_id).entries(offset, count)
        return [position for position, _ in entries if position >= 0]

    def chunk_files(self) -> list[tuple[str, int]]:
        """(path, committed data end) of each message log chunk now, oldest first: for
        readers of whole chunk files (the Spark batch source)."""
        self._check_open()
        follow.look(self)
        return [(str(chunk.path), chunk.data_end) for chunk in self._messages]

    def deleted_topics(self) -> dict[str, int]:
        """Topic: the log position of its deletion. Records of the topic below it are the
        deleted topic's (the log keeps them until retention); pull and query_by_key never
        return them, and neither should a reader of chunk files."""
        self._check_open()
        return dict(self._deleted)

    def _load_topics(self) -> None:
        body = read_topics(self)
        before, self._deleted = self._deleted, deletions(body)
        self._files.plan(self._deleted)  # at a writer's open
        if self.read_only:
            deletion.follow_deletions(self, before)
        for topic, count, policy in topic_entries(body, self.path, self._meta_problems):
            if count > len(self._queues.get(topic, ())):
                self._open_queues(topic, count)
            self._policies[topic] = policy

    def _open_queues(self, topic: str, count: int) -> None:
        queues = self._queues.get(topic, [])
        for queue_id in range(len(queues), count):
            queues.append(open_queue(self, topic, queue_id, self._files.ends(topic, queue_id)))
        self._queues[topic] = queues
        self._topic_bytes[topic] = topic.encode()
        self._round_robin.setdefault(topic, 0)

    def _save_topics(self, topic: str) -> None:
        save_topic(self, topic)  # topics.json's journal (topicsfile.py)

    def _topic(self, topic: str) -> list[Queue]:
        self._check_open()  # every read by topic; one attribute on the pull path
        queues = self._queues.get(topic) if isinstance(topic, str) else None
        if queues is None and self.read_only and isinstance(topic, str):
            self._load_topics()  # the writer may have created it since
            queues = self._queues.get(topic)
        if queues is None:
            validate.check_topic(topic)
            raise TopicNotFoundError(f"no topic {topic!r} in {self.path}")
        return queues

    def _queue(self, topic: str, queue_id: int) -> Queue:
        queues = self._topic(topic)
        return follow.fresh(self, queues[validate.check_queue_id(queue_id, topic, len(queues))])

    def _queues_and_count(self, topic: object) -> tuple[list[Queue] | None, int]:
        """A send's topic: its queues (None if it is new) and their count, or an error."""
        if self.read_only or self._closed:
            self._check_writable()
        queues = self._queues.get(topic) if type(topic) is str else None
        if queues is not None:
            return queues, len(queues)
        return None, self._count_for_new(topic)

    def _count_for_new(self, topic: object) -> int:
        """The queue count an unknown topic would get on its first send, or an error."""
        validate.check_topic(topic)
        if not self.config.auto_create_topics:
            raise TopicNotFoundError(
                f"no topic {topic!r} in {self.path}, and auto_create_topics is off "
                "(StoreConfig.auto_create_topics); create it with create_topic()"
            )
        return self.config.default_queue_count

    def _create_for_send(self, topic: str) -> list[Queue]:
        """Called only after the message was checked, so a rejected send creates nothing."""
        self.create_topic(topic)  # the default count, or what a racing creator chose
        return self._queues[topic]

    # --- sending -------------------------------------------------------------

    def send(
        self,
        topic: str,
        body: bytes,
        *,
        tag: str = "",
        key: str | None = None,
        properties: dict[str, str] | None = None,
        code: int = 0,
        queue_id: int | None = None,
    ) -> SendResult:
        """Append one message to ``topic`` (created on first use unless auto_create_topics
        is off) and return where it went: SendResult (message id, queue id and offset, log
        position, stored_at in seconds). ``queue_id`` None: round robin over the queues.
        Durable as ``StoreConfig.flush`` says when it returns.

        Raises InvalidMessageError/InvalidTypeError for a bad argument,
        MessageTooLargeError past ``max_message_size`` / ``max_properties_size``,
        TopicNotFoundError, QueueNotFoundError, DiskFullError or StoreWriteError (nothing
        written), ReadOnlyError or ClosedError.
        """
        sender = self._sender
        if sender is not None:  # the common case, whole in C: cext/sender.c
            result = sender.send(topic, body, tag, key, properties, code, queue_id)
            if result is not None:
                return result  # type: ignore[no-any-return]
        queues, count = self._queues_and_count(topic)
        check = self._check_in_c
        checked = check(count, body, tag, key, properties, code, queue_id) if check else None
        if checked is None:  # anything unusual, and every error
            checked = validate.check_message(
                self.config, topic, count, body, tag, key, properties, code, queue_id
            )
        return self._store(topic, queues, [checked])[0]

    def send_batch(
        self, topic: str, messages: Iterable[bytes | OutgoingMessage | dict[str, Any]]
    ) -> list[SendResult]:
        """Send many messages under one lock acquisition: all are checked first, so one
        bad message rejects the batch and nothing is written."""
        queues, count = self._queues_and_count(topic)
        items = validate.check_messages(messages)

        def check(message: object) -> Checked:
            fields = validate.outgoing(message)
            return validate.check_message(self.config, topic, count, *fields)

        fast = speedups.SPEEDUPS
        if bodies.plain(self, items):  # bytes alone: one C call per run (store/bodies.py)
            return self._locked(topic, queues, bodies.appending(self, topic, items, "results"))
        if fast is None:
            checked = [check(message) for message in items]
        else:  # the common cases in C, the rest (and every error) by check()
            config = self.config
            checked = fast.check_batch(
                items,  # a private copy: check() runs Python code
                OutgoingMessage, check, validate.check_tag,
                config.max_message_size, config.layout.chunk_data_size, count,
            )  # fmt: skip
        return self._store(topic, queues, checked)

    def _store(
        self, topic: str, queues: list[Queue] | None, checked: list[Checked]
    ) -> list[SendResult]:
        return self._locked(topic, queues, lambda q: self._appender.append_all(topic, q, checked))

    def _locked(self, topic: str, queues: list[Queue] | None, append: Append[Appended]) -> Appended:
        """Append checked messages under the write lock; under "sync", flush the log before
        returning (the queues are a derived index: flush.py)."""
        if self._lock_owned():  # the lock is an RLock: re-entered, it would not block
            raise reentered(self.path, topic)
        if queues is None:
            queues = self._create_for_send(topic)
        if self._flush_error is not None:  # same class: DiskFullError stays DiskFullError
            raise type(self._flush_error)(
                self._flush_error.errno,
                f"refusing the send: the last group-commit or background flush failed "
                f"({self._flush_error}); after a failed fdatasync close and reopen the store to "
                "send again (other errors: sends resume once a flush succeeds)",
            )
        if self._group is not None:  # "sync": appended and flushed in a batch with others
            return self._group.submit(lambda: append(queues), lambda: reentered(self.path, topic))
        with self._lock:
            results = append(queues)
        if self._waiting:
            self._wake()
        return results

    def _wake(self) -> None:
        if not self._waiting:
            return
        with self._arrived:
            self._arrived.notify_all()

    # --- reading -------------------------------------------------------------

    def pull(
        self,
        topic: str,
        queue_id: int,
        offset: int,
        max_count: int = 32,
        tags: str | Iterable[str] | None = None,
        wait: float = 0.0,
        *,
        max_bytes: int | None = None,
    ) -> PullResult:
        """Up to ``max_count`` messages of a queue from ``offset`` on, in offset order, and
        ``next_offset``, where to go on (an offset past the queue's end reads as its end).

        ``tags`` keeps only messages with one of these tags (None or "*": every message;
        an empty list is refused). ``wait`` > 0 (seconds) blocks until a matching message
        arrives or the time passes. ``max_bytes`` stops before the bodies would add up to
        more, but returns the first message whatever its size. Raises TopicNotFoundError,
        QueueNotFoundError, InvalidMessageError/InvalidTypeError for bad arguments, and a
        CorruptionError naming the file if a record is damaged.
        """
        queue = self._queue(topic, queue_id)
        validate.check_pull(offset, max_count, wait, max_bytes)
        wanted = tag_filter(tags)
        deadline = time.monotonic() + wait  # one deadline for every wait of this pull
        result = pulling.pull_once(self, queue, offset, max_count, wanted, wait, max_bytes)
        if wait <= 0 or result:
            return result
        return pulling.wait_on(self, queue, result, max_count, wanted, deadline, max_bytes)

    def read(self, position: int) -> Message:
        """The message at log ``position`` (a byte offset in the message log, as
        SendResult.position and Message.position give it). Raises MessageNotFoundError if
        no message starts there, ChunkRemovedError if retention removed it,
        CompactedAwayError if compaction did, a CorruptionError naming the file if damaged."""
        self._check_open()
        if not isinstance(position, int) or isinstance(position, bool):
            raise InvalidTypeError(f"position must be an int, got {type(position).__name__}")
        follow.look(self)
        try:
            return self._log.read(position)
        except (PositionNotFoundError, CorruptRecordError) as exc:
            # A position from a caller (or a message id) that names no record start reads
            # as an invalid frame; the frame check still keeps corrupt bytes from escaping.
            raise MessageNotFoundError(f"no message at position {position}: {exc}") from exc

    def get(self, message_id: str) -> Message:
        """The message with this id (24 hex digits: this store's id and the log position;
        no index is consulted). Raises MessageNotFoundError for an id of another store or
        of no message, and what ``read`` raises."""
        decoded = decode_message_id(message_id)
        if decoded is None or decoded[0] != self.store_id:
            raise MessageNotFoundError(f"{message_id!r} is not a message id of this store")
        return self.read(decoded[1])

    def query_by_key(self, topic: str, key: str, limit: int = 32) -> list[Message]:
        """Messages of ``topic`` with ``key``, newest first."""
        found: list[Message] = []
        for position in self.key_positions(topic, key, limit):
            try:
                message = self._log.read(position)
            except (ChunkRemovedError, CompactedAwayError):
                continue
            if message.key == key and message.topic == topic:
                found.append(message)
        return found

    def key_positions(self, topic: str, key: str, limit: int = 32) -> list[int]:
        """The log positions of ``topic``'s messages with ``key``, newest first, from the
        key index alone (query_by_key's, no message read): for readers of chunk files,
        which check every record they read. A position may lie in a chunk removed since."""
        self._topic(topic)
        validate.check_key(key)
        validate.check_limit(limit)
        follow.look(self)
        since = self._deleted.get(topic, 0)  # older records: a deleted topic's
        return [p for p in self._keys.positions(topic, key, limit) if p >= since]

    def offset_for_time(self, topic: str, queue_id: int, timestamp: float | dt.datetime) -> int:
        """The first offset of the queue stored at or after ``timestamp``: seconds since the
        epoch or an aware datetime (a naive one is refused: equeue.store.times). The
        queue's next offset if none is. Raises InvalidMessageError, TopicNotFoundError."""
        follow.look(self)  # read-only: a chunk retention removed is reported as removed
        return times.offset_for_time(self, topic, queue_id, timestamp)

    # --- consumer offsets ----------------------------------------------------

    def commit_offset(self, group: str, topic: str, queue_id: int, offset: int) -> None:
        """Set ``group``'s offset on ``topic``/``queue_id`` (persisted), also lower: a reset."""
        self._check_writable()  # before the checks: a read-only handle's end may be stale
        validate.check_commit(group, offset, self._queue(topic, queue_id).next_offset)
        with self._lock:
            self._check_writable()
            group_offsets.set_offset(self, group, topic, queue_id, offset)

    def committed_offset(self, group: str, topic: str, queue_id: int) -> int | None:
        """The offset ``group`` last committed for the queue (the next offset it will
        consume), or None if it never committed one. A read-only handle sees the writer's
        commits as of its last ``refresh()``. Raises InvalidMessageError for a bad name."""
        self._check_open()
        validate.check_names(group, topic, queue_id)
        return group_offsets.committed(self).get(group, {}).get(topic, {}).get(str(queue_id))

    def consumer_groups(self) -> dict[str, dict[str, dict[int, int]]]:
        """Every committed offset: {group: {topic: {queue id: offset}}}."""
        self._check_open()
        return group_offsets.by_queue_id(group_offsets.committed(self))

    def consumer(
        self,
        group: str,
        topics: str | Iterable[str],
        *,
        tags: str | Iterable[str] | None = None,
        start: Start = "committed",
        auto_commit: bool = True,
        batch_size: int = 32,
        timeout: float | None = None,
    ) -> Consumer:
        """A loop over every queue of ``topics`` that commits ``group``'s offsets, at least
        once; also on a read-only handle (equeue/store/consumer.py says how)."""
        return Consumer(
            self, group, topics, tags=tags, start=start, auto_commit=auto_commit,
            batch_size=batch_size, timeout=timeout,
        )  # fmt: skip

    # --- retention -----------------------------------------------------------

    def apply_retention(self, now: float | None = None) -> int:
        """Delete completed message chunks past retention; returns how many were removed."""
        # Checkpoint first: queue entries are flushed lazily, and once the log before
        # them is gone, recovery could no longer rebuild them from it.
        now = validate.check_now(now)
        self._check_writable()
        self._checkpoint(flush=True)
        return self._retain(now)

    def _retain(self, now: float | None) -> int:
        """``apply_retention`` right after a checkpoint."""
        from equeue.store.retention import apply_retention

        # Under the compaction commit lock, after adopting what was installed: else a
        # replacement installed meanwhile would outlive the chunks retention deletes.
        with compaction_commit.commit_lock(self.path):
            self._adopt_compacted_locked()
            with self._checkpoint_lock, self._lock:  # note_retention rewrites the checkpoint
                self._check_writable()
                return apply_retention(self, time.time() if now is None else now)

    # --- internals -----------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"store {self.path} is closed")

    def _check_writable(self) -> None:
        self._check_open()
        if self.read_only:
            raise ReadOnlyError(f"store {self.path} was opened read-only")

    def _open_log(self, hint: TailHint | None, live: TailHint | None) -> None:
        config = self.config
        self._messages = ChunkManager(
            self.path / MESSAGES_DIR,
            ChunkManagerConfig(
                chunk_data_size=config.layout.chunk_data_size,
                max_record_size=config.max_message_size
                + config.max_properties_size
                + MESSAGE_HEAD_SIZE
                + 3 * _MAX_NAME,
                timestamp_offset=STORED_TIME_OFFSET,
                max_open_chunks=config.max_open_chunks,
                alloc_step=config.alloc_step,
            ),
            read_only=self.read_only,
            tail_hint=hint,
            live_hint=live,
        )
        self._reader = ChunkReader(self._messages)
        self._log = LogReader(self._messages, self._id_prefix, read_only=self.read_only)

    def _read_meta(self, name: str, default: Any) -> Any:
        return read_meta(
            self.path, name, default, self._meta_problems, move_aside=not self.read_only
        )

    # --- read-only handles ---------------------------------------------------

    def refresh(self) -> None:
        """Pick up what changed on disk: chunks a compaction installed (the service does
        this by itself every ``flush_interval_ms``) and, read-only, the topics, consumer
        offsets and messages the writer added since."""
        self._check_open()
        if not self.read_only:
            self._adopt_compacted(blocking=True)
            return
        follow.refresh(self)

    def _open_keys(self) -> KeyIndex:
        if self.read_only:
            return follow.FollowedKeys(self.path, self._messages)
        return open_writer_index(self.path / KEYS_FILE, self._meta_problems)

    # --- checkpoints and the service thread ------------------------------------

    def _checkpoint(self, *, flush: bool, settle: bool = True) -> None:
        write_checkpoint(self, flush=flush, settle=settle)

    def _checkpoint_due(self) -> bool:
        """A full key batch, or enough log written since the last checkpoint that
        recovery would otherwise re-dispatch more than ``_CHECKPOINT_BYTES``."""
        if self._keys.pending >= self.config.key_index_batch:
            return True
        if self.config.flush == "os":  # its checkpoints come from flush() and close() only
            return False
        return self._messages.committed_position - self._checkpointed >= _CHECKPOINT_BYTES

    def _adopt_compacted(self, *, blocking: bool) -> None:
        """Adopt chunks a compaction job installed since we last looked (the service
        calls this each turn, without waiting for a job that is installing right now)."""
        if compaction_commit.installed_marker(self.path) == self._installed:
            return
        try:
            with compaction_commit.commit_lock(self.path, blocking=blocking):
                self._adopt_compacted_locked()
        except CompactionError:
            return  # a job is installing: the next turn adopts it all at once

    def _adopt_compacted_locked(self) -> None:
        marker = compaction_commit.installed_marker(self.path)
        if marker != self._installed:
            self._messages.adopt_replacements()
            self._installed = marker

    def _apply_retention_in_service(self) -> None:
        """Called right after the service's checkpoint."""
        if self.config.retention or self.config.max_store_bytes:
            self._retain(None)
