"""MessageStore: topics split into queues over message chunks and queue chunks.

This module holds the class, its opening (the files, recovery, the C Sender, the service
thread), its closing and the writer lock. The rest of its methods live in one module per
concept, bound into the class here: storetopics.py (topics and queues), storesend.py
(sending), storereads.py (pulls, reads, key queries), storeoffsets.py (consumer offsets)
and storeupkeep.py (flushes, checkpoints, retention, compaction's chunks, refresh)."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import xxhash

from equeue import speedups
from equeue.atomicfile import remove_temp_files
from equeue.chunks import ChunkManager, ChunkManagerConfig, ChunkReader, ChunkWriter
from equeue.chunks.recovery import TailHint
from equeue.compaction import commit as compaction_commit
from equeue.errors import ClosedError, ReadOnlyError, StoreWriteError
from equeue.format.chunk import HEADER_SIZE
from equeue.format.message import (
    MAX_NAME_BYTES,
    MESSAGE_HEAD_SIZE,
    STORED_TIME_OFFSET,
    message_id_prefix,
)
from equeue.store import (
    deletion,
    follow,
    groupdeletion,
    grouprecord,
    offsetcuts,
    storeoffsets,
    storereads,
    storesend,
    storetopics,
    storeupkeep,
    validate,
)
from equeue.store.append import Appender
from equeue.store.config import StoreConfig
from equeue.store.dirguard import DirectoryGuard
from equeue.store.flush import GroupCommit, flush_recorded, run_service
from equeue.store.keyindex import KeyIndex, open_writer_index
from equeue.store.livetail import LiveTailWriter, current_boot_id, read_live_tail
from equeue.store.losses import losses_at_open
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
from equeue.store.queuerebuild import queue_files
from equeue.store.reads import LogReader
from equeue.store.recovery import RecoveryReport, tail_hint
from equeue.store.reopen import reconcile_at_open, release_files, release_refused
from equeue.store.topics import TopicPolicy
from equeue.store.topicsfile import TopicsFile
from equeue.store.types import SendResult

log = logging.getLogger("equeue.recovery")

_MAX_NAME = MAX_NAME_BYTES


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
        self._guard: DirectoryGuard | None = None  # a writer's: STORE still the one it locked
        if not read_only:
            validate.make_store_dir(path)
            self._lock_file = take_lock(path)
        try:
            if self._lock_file is not None:
                self._guard = DirectoryGuard(path, self._lock_file.fileno())
            self.store_id, self.config = open_identity(path, config, create=not read_only)
            self._open()
        except BaseException:
            release_refused(self)
            if self._lock_file is not None:
                self._lock_file.close()
            raise

    def _open(self) -> None:
        config, path, read_only = self.config, self.path, self.read_only
        compactions: list[str] = []
        if not read_only:
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
        if not read_only:
            self._files.before_create = self._check_directory
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
        # After the scan: a damaged file it moved aside is reported as that, not as lost.
        self._meta_problems += grouprecord.problems_at_open(self, checkpoint)
        self._keys = self._open_keys()
        self.recovery = RecoveryReport(
            cuts=list(self._messages.recovery_cuts),
            problems=self._meta_problems + self._messages.recovery_problems,
            compactions=compactions,
        )
        self.recovery.cuts += self._files.cuts
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
        # The message log's end as entrycheck last found it: it only grows while a handle
        # is open, so an entry below it needs no look at the log (queue_positions).
        self._known_log_end = 0
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
        # Past every check that can refuse the open: a refused one leaves both files.
        self._topics_file.finish_open()
        self.recovery.cuts += self._topics_file.cuts
        # The temp files of atomic writes a crash left (checked at the open's start:
        # check_store), also past the checks, and before the service thread's first
        # atomic write, whose temp file this must not take for a leftover.
        remove_temp_files(path)
        # Before anything is served: an offset a group committed past what the log
        # recovered to would make it skip the messages sent next (offsetcuts.py).
        with self._lock:
            self.recovery.problems += offsetcuts.lower_past_ends(self)
        # Not settled: what recovery found past the tail is synced by the next
        # checkpoint (the service's within flush_thorough_interval_ms), off this path.
        self._checkpoint(flush=True, settle=False)
        self._files.opened_store()
        self._service_stop = threading.Event()
        self._service = threading.Thread(
            target=run_service, args=(self, self._service_stop), name="equeue-service", daemon=True
        )
        self._service.start()
        # A group deletion a crash interrupted after its commit point (its topics need the
        # store open); what fails is said and tried again at the next open.
        self.recovery.problems += groupdeletion.finish_group_deletions(self)
        # Last: the open succeeded, so a crash's made-ahead log file may go now (a refused
        # open leaves the store as it was) and the next one be made.
        self._messages.start_making_ahead()

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
                make_ahead=True,  # the log rolls over under sends (queues: docs/format.md)
            ),
            read_only=self.read_only,
            tail_hint=hint,
            live_hint=live,
        )
        if not self.read_only:  # no chunk file made in a store that replaced this one
            self._messages.before_create = self._check_directory
        self._reader = ChunkReader(self._messages)
        self._log = LogReader(self._messages, self._id_prefix, read_only=self.read_only)

    def _read_meta(self, name: str, default: Any) -> Any:
        return read_meta(
            self.path, name, default, self._meta_problems, move_aside=not self.read_only
        )

    def _open_keys(self) -> KeyIndex:
        if self.read_only:
            return follow.FollowedKeys(self.path, self._messages)
        return open_writer_index(self.path / KEYS_FILE, self._meta_problems)

    # --- the rest of the API: functions of one module per concept, bound here -------
    # Bound by assignment, not inherited from mixins: each is in this class's own dict as a
    # def in its body would be (no lookup added on the hot paths, the C Sender's
    # ``_wake`` and ``MessageStore.send`` are what they were), and each one's
    # ``self: MessageStore`` is checked by mypy against the fields _open() sets.

    # topics and queues: equeue/store/storetopics.py
    create_topic = storetopics.create_topic
    delete_topic = storetopics.delete_topic
    topic_policy = storetopics.topic_policy
    topics = storetopics.topics
    queue_ids = storetopics.queue_ids
    queue_range = storetopics.queue_range
    queue_positions = storetopics.queue_positions
    chunk_files = storetopics.chunk_files
    deleted_topics = storetopics.deleted_topics
    _load_topics = storetopics._load_topics
    _open_queues = storetopics._open_queues
    _save_topics = storetopics._save_topics
    _topic = storetopics._topic
    _queue = storetopics._queue
    _queues_and_count = storetopics._queues_and_count
    _count_for_new = storetopics._count_for_new
    _check_room_for_topic = storetopics._check_room_for_topic
    _create_for_send = storetopics._create_for_send

    # sending: equeue/store/storesend.py
    send = storesend.send
    send_batch = storesend.send_batch
    _store = storesend._store
    _locked = storesend._locked
    _wake = storesend._wake

    # reading: equeue/store/storereads.py
    pull = storereads.pull
    read = storereads.read
    get = storereads.get
    query_by_key = storereads.query_by_key
    key_positions = storereads.key_positions
    offset_for_time = storereads.offset_for_time

    # consumer offsets: equeue/store/storeoffsets.py
    commit_offset = storeoffsets.commit_offset
    committed_offset = storeoffsets.committed_offset
    consumer_groups = storeoffsets.consumer_groups
    delete_group = storeoffsets.delete_group
    consumer = storeoffsets.consumer

    # flushes, checkpoints, retention, compaction's chunks, refresh: equeue/store/storeupkeep.py
    flush = storeupkeep.flush
    flush_log = storeupkeep.flush_log
    _flush_log = storeupkeep._flush_log
    _flush_queues = storeupkeep._flush_queues
    _start_flush = storeupkeep._start_flush
    _set_flush_error = storeupkeep._set_flush_error
    _checkpoint = storeupkeep._checkpoint
    _check_directory = storeupkeep._check_directory
    _checkpoint_due = storeupkeep._checkpoint_due
    _adopt_compacted = storeupkeep._adopt_compacted
    _adopt_compacted_locked = storeupkeep._adopt_compacted_locked
    apply_retention = storeupkeep.apply_retention
    _retain = storeupkeep._retain
    _apply_retention_in_service = storeupkeep._apply_retention_in_service
    refresh = storeupkeep.refresh
    _chunk_managers = storeupkeep._chunk_managers
