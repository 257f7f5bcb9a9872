"""How a read-only handle follows the writer, which runs in another process (or not at
all, or was killed): new records and chunks, chunks removed by retention or replaced by
compaction, and the key index, whose newest part may be only in SQLite's WAL or only in
the log. A read-only handle never changes a file of the store.
"""

from __future__ import annotations

import contextlib
import errno
import sqlite3
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from equeue.chunks import ChunkManager, ChunkReader
from equeue.errors import (
    ChunkRemovedError,
    ChunkReplacedError,
    CorruptionError,
    CorruptRecordError,
    EQueueError,
    PositionError,
    StoreReadError,
    TopicNotFoundError,
)
from equeue.format.chunk import FRAME_OVERHEAD
from equeue.format.message import FLAG_HAS_KEY, MESSAGE_HEAD, MESSAGE_HEAD_SIZE
from equeue.store.keyindex import NO_BOUND, KeyIndex
from equeue.store.keysread import KeysState, keys_state, keys_uri
from equeue.store.meta import KEYS_FILE, OFFSETS_FILE
from equeue.store.queue import Queue
from equeue.store.types import PullResult

if TYPE_CHECKING:
    from equeue.store.store import MessageStore

T = TypeVar("T")

# Retention may remove chunks again while a pull catches up with the last removal.
_ATTEMPTS = 8
# How often pulls look for chunks retention removed (a stat: 5% of a pull of 32); the
# same as a waiting pull's polling. Meanwhile a pull reads what its mappings still hold.
_LOOK_EVERY = 0.01


def refresh(store: MessageStore) -> None:
    """``MessageStore.refresh`` of a read-only handle."""

    def step() -> None:
        store._load_topics()
        store._offsets = store._read_meta(OFFSETS_FILE, store._offsets)
        follow_log(store, loaded=True)

    again_if_deleted(step)
    keys = store._keys
    if isinstance(keys, FollowedKeys):
        keys.reconnect()


def again_if_deleted(step: Callable[[], None]) -> None:
    """``step`` (reading topics.json and opening or following queues), again when a
    queue's directory went away under it: its topic was deleted since topics.json was
    read (delete_topic records the mark, then removes the directories), so the next
    reading drops the topic, or opens it anew if it was made again (reviewl M2). Not a
    deletion (gone every time): the error, as StoreReadError. A queue chunk's file found
    to be another (ChunkReplacedError: the topic made again since, its directory too) is
    the same deletion, seen later."""
    for attempt in range(1, _ATTEMPTS + 1):
        try:
            step()
            return
        except ChunkReplacedError:
            if attempt == _ATTEMPTS:
                raise
        except OSError as exc:
            if exc.errno != errno.ENOENT or attempt == _ATTEMPTS:
                raise _read_error(exc) from None


def follow_log(store: MessageStore, only: Queue | None = None, *, loaded: bool = False) -> None:
    """Catch up with the writer's log and queues (or just ``only``): records and chunks
    added, chunks removed by retention or replaced by compaction. A queue's first offset
    then moves, as the writer's retention moves it, past the entries whose messages are
    gone. ``loaded``: the caller has just read topics.json (refresh, again_if_deleted)."""
    store._messages.refresh()
    log_first = store._messages.first_position
    # A closed queue reads its ends from its files when opened again (reader_opened).
    open_now = [q for qs in store._queues.values() for q in qs if q.is_open]
    for queue in [only] if only is not None else open_now:
        try:
            queue.refresh()
        except ChunkReplacedError:
            # Its tail's file is another's: its topic deleted and made again, or files
            # replaced by hand. Closed; with topics.json just read (no newer deletion
            # mark explains it) its next use opens the files as they are now, and the
            # error goes to the caller, which reads again. Else the queue keeps what it
            # saw, so its own next use finds the files other again and reads topics.json
            # (deleted_meanwhile: TopicNotFoundError), and a catch-up of every queue (a
            # look of another queue's read) goes on with the others: one queue's
            # replaced files are not another read's error (review16 R16-1).
            store._files.reopen_later(queue, forget=loaded)
            if only is not None or loaded:
                raise
            continue
        _skip_removed(queue, log_first)


def reader_opened(store: MessageStore) -> Callable[[Queue], None]:
    """What a read-only handle's cache does to a queue it opens (its ends just read from
    its files): the first offset moved past entries whose messages retention removed."""

    def opened(queue: Queue) -> None:
        _skip_removed(queue, store._messages.first_position)

    return opened


def fresh(store: MessageStore, queue: Queue) -> Queue:
    """``queue``, opened if it is a read-only handle's and closed: a closed queue's ends
    are those of when it was closed, its files' now once opened."""
    if store.read_only and not queue.is_open:
        try:
            queue.refresh()
        except (OSError, CorruptionError) as exc:
            raise deleted_meanwhile(store, queue, exc) from None
    return queue


# What a read-only handle's read of a queue raises when the writer deletes its topic.
READ_FAILURES = (OSError, CorruptionError, PositionError)


def beside_deletion(store: MessageStore, queue: Queue, read: Callable[[], T]) -> T:
    """``read`` of ``queue``'s entries (queue_positions, offset_for_time), again after it
    failed on a read-only handle: a failure that the topic's deletion meanwhile explains
    is TopicNotFoundError, as a pull's is (review7 F2: an emptied index's position -1, a
    removed index chunk)."""
    for attempt in range(1, _ATTEMPTS + 1):
        try:
            if attempt > 1:
                # A topic made again: its index (opened anew) may name records past this
                # handle's view of the log (as may entries the writer appended between
                # the log's refresh and the queue's): both caught up, it is read again.
                follow_log(store, queue)
            return read()
        except READ_FAILURES as exc:
            error = deleted_meanwhile(store, queue, exc)
            if attempt == _ATTEMPTS or isinstance(error, TopicNotFoundError | ChunkReplacedError):
                raise error from None
    raise StoreReadError(errno.EIO, f"reading {queue.topic}/{queue.queue_id}: no attempt made")


def deleted_meanwhile(
    store: MessageStore, queue: Queue, error: OSError | CorruptionError | PositionError
) -> EQueueError:
    """A read-only handle's read of ``queue`` failed: ``TopicNotFoundError`` if the writer
    deleted its topic since this handle read topics.json (a newer deletion mark; the
    topic's queues are then dropped, as ``refresh`` drops them), else ``error`` (a builtin
    one as ``StoreReadError``). The queue's entries and files are the old topic's while
    its directory is removed, or the new one's if made again: a position past the file's
    end, a chunk gone are the deletion's doing, not damage (reviewl M3)."""
    topic = queue.topic
    before = store._deleted.get(topic)
    with contextlib.suppress(EQueueError, OSError):
        store._load_topics()
    mark = store._deleted.get(topic)
    if mark != before or queue not in store._queues.get(topic, ()):
        return TopicNotFoundError(
            f"topic {topic!r} was deleted in {store.path} while queue {queue.queue_id} was "
            f"read (its deletion at log position {mark}"
            + (", and it was created again" if topic in store._queues else "")
            + "): refresh() and read it anew"
        )
    if isinstance(error, ChunkReplacedError):
        # Not a deletion this handle can see (files replaced by hand, or a writer's open
        # that set the queue's damaged files aside and rebuilt them): said once; the next
        # read opens the queue's files anew, as a new handle would.
        store._files.reopen_later(queue)
    return error if isinstance(error, EQueueError) else _read_error(error)


def _read_error(exc: OSError) -> StoreReadError:
    if isinstance(exc, StoreReadError):
        return exc
    return StoreReadError(
        exc.errno or errno.EIO, f"reading {exc.filename} failed: {exc.strerror or exc}"
    )


def look(store: MessageStore) -> None:
    """A read-only handle's reads (pull, read, get, query_by_key, offset_for_time) first
    look, every ``_LOOK_EVERY`` at most, whether retention removed the first chunk: if so
    they follow the log and every queue (the next look finds the new first chunk), so a
    removed message is reported as removed, as the writer's reads report it, rather than
    read from a mapping this handle kept."""
    if not store.read_only:
        return
    log = store._messages
    now = time.monotonic()
    if now - log.looked_at >= _LOOK_EVERY:
        log.looked_at = now
        first = log.first_chunk
        if first is not None and not first.path.exists():
            follow_log(store)  # retention ran: start where the writer's pull would


def _skip_removed(queue: Queue, log_first: int) -> None:
    if log_first == 0 or queue.first_offset >= queue.next_offset:
        return
    try:
        if queue.entry(queue.first_offset)[0] >= log_first:
            return
        queue.first_offset = max(queue.first_offset, queue.first_offset_at_or_after(log_first))
    except ChunkRemovedError:
        return  # removed again meanwhile: the next refresh moves it


def pull(
    store: MessageStore,
    queue: Queue,
    offset: int,
    max_count: int,
    wanted: dict[int, set[str]] | None,
    wait: float,
    max_bytes: int | None = None,
) -> PullResult:
    """A read-only pull: it polls for new entries, and a chunk retention removed under
    it makes it follow the log and go on from the queue's new first offset."""
    try:
        look(store)
        if offset >= queue.next_offset:
            offset = _wait_for_entries(store, queue, offset, wait)
        attempts = 1
        while True:
            try:
                messages, next_offset = store._log.pull_run(
                    queue, max(offset, queue.first_offset), max_count, wanted, max_bytes
                )
                return PullResult(messages, next_offset)
            except ChunkRemovedError:
                if attempts == _ATTEMPTS:
                    raise
                attempts += 1
                follow_log(store)
    except (OSError, CorruptionError, ChunkRemovedError) as exc:
        raise deleted_meanwhile(store, queue, exc) from None


def _wait_for_entries(store: MessageStore, queue: Queue, offset: int, wait: float) -> int:
    """Poll the files (the writer is another process) until an entry past ``offset``
    (the queue's end at most: past it, the next message) shows up or ``wait`` passes;
    returns the offset to read from."""
    deadline = time.monotonic() + wait
    queue.refresh()
    # Past the end, the end (as the writer's pull): else the caller would go on from
    # there and skip the messages sent up to it.
    offset = min(offset, queue.next_offset)
    while True:
        if offset < queue.next_offset:
            follow_log(store, queue)
            return offset
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return offset
        time.sleep(min(remaining, 0.01))
        store._check_open()  # closed meanwhile: ClosedError naming the store, not a file
        queue.refresh()


class FollowedKeys(KeyIndex):
    """The key index as a read-only handle sees it: what SQLite holds, opened so that
    no file changes, plus the keys of the log past the index's ``indexed_position``,
    read from the log itself (the writer indexes keys in batches, at checkpoints).

    SQLite is opened as equeue/store/keysread.py says, checked again before each query;
    without a -shm a WAL cannot be read without writing, so the log is read from the
    position the database file says is indexed: slower, but every key is found.

    A query that SQLite fails is tried again reopened, then on the database file alone.
    """

    def __init__(self, store_path: Path, messages: ChunkManager) -> None:
        self.path = store_path / KEYS_FILE
        self._log = ChunkReader(messages)
        self._lock = threading.Lock()
        self._pending = []
        self._pending_end = 0
        self._committing_from = None
        self.indexed_position = 0
        # The log's keys from _tail_from (the index's position when they were read) up
        # to _tail_to, by (topic, key), ascending.
        self._tail: dict[tuple[str, str], list[int]] = defaultdict(list)
        self._tail_from = self._tail_to = 0
        self._db, self._state = self._open(fallback=False)

    def _current_state(self) -> KeysState:
        return keys_state(self.path)

    def _open(self, *, fallback: bool) -> tuple[sqlite3.Connection, KeysState]:
        """``fallback``: the database file alone, whatever the state (the log has the rest)."""
        state = self._current_state()
        uri = keys_uri(self.path, state, fallback=fallback)
        try:
            db = sqlite3.connect(uri, uri=True, check_same_thread=False, isolation_level=None)
        except sqlite3.Error as exc:
            raise self._error(exc) from exc
        return db, state

    def _reopen(self, *, fallback: bool = False) -> None:
        db, self._state = self._open(fallback=fallback)
        old, self._db = self._db, db
        old.close()

    def reconnect(self) -> None:
        with self._lock:
            self._reopen()

    def _error(self, exc: sqlite3.Error) -> CorruptionError:
        return CorruptionError(f"the key index cannot be read: {exc}", file=self.path)

    def positions(self, topic: str, key: str, limit: int, before: int = NO_BOUND) -> list[int]:
        with self._lock:
            if self._current_state() != self._state:
                self._reopen()
            try:
                indexed, rows = self._query(topic, key, limit, before)
            except sqlite3.Error:
                # The writer started or stopped meanwhile, or SQLite could not use the
                # -shm read-only: reopened, then the database file alone.
                try:
                    self._reopen()
                    indexed, rows = self._query(topic, key, limit, before)
                except sqlite3.Error:
                    self._reopen(fallback=True)
                    try:
                        indexed, rows = self._query(topic, key, limit, before)
                    except sqlite3.Error as exc:
                        raise self._error(exc) from exc
            self.indexed_position = indexed
            tail = self._read_tail(indexed)
            found = {p for p in tail.get((topic, key), ()) if indexed <= p < before}
            found.update(rows)
        return sorted(found, reverse=True)[:limit]

    def _query(self, topic: str, key: str, limit: int, before: int) -> tuple[int, list[int]]:
        """(indexed position, the newest rows of ``key``), read in one transaction."""
        db = self._db
        db.execute("BEGIN")
        try:
            tables = {
                row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type='table'")
            }
            if not {"keys", "meta"} <= tables:  # created in a WAL not read here
                return 0, []
            row = db.execute("SELECT value FROM meta WHERE name='indexed_position'").fetchone()
            rows = db.execute(
                "SELECT position FROM keys WHERE topic=? AND key=? AND position < ? "
                "ORDER BY position DESC LIMIT ?",
                (topic, key, before, limit),
            ).fetchall()
        finally:
            db.rollback()
        return (int(row[0]) if row else 0), [int(r[0]) for r in rows]

    def _read_tail(self, indexed: int) -> dict[tuple[str, str], list[int]]:
        """The log's keys from ``indexed`` to the committed end, read incrementally."""
        if not self._tail_from <= indexed <= self._tail_to:
            self._tail.clear()  # the index moved past what was read, or back (recovery)
            self._tail_from = self._tail_to = indexed
        elif indexed > self._tail_from:
            kept = {k: [p for p in ps if p >= indexed] for k, ps in self._tail.items()}
            self._tail = defaultdict(list, {k: ps for k, ps in kept.items() if ps})
            self._tail_from = indexed
        manager = self._log.manager
        manager.refresh()  # the walk stops at the end seen here
        end = manager.committed_position
        position = max(self._tail_to, manager.first_position)
        for attempt in range(_ATTEMPTS):
            try:
                for _, payload in self._log.iter_from(position):
                    at = self._add(payload)
                    # The next record starts there (logical positions: also in a
                    # compacted chunk, whose map keeps them).
                    position = at + len(payload) + FRAME_OVERHEAD
                break
            except ChunkRemovedError:
                if attempt == _ATTEMPTS - 1:
                    raise
                manager.refresh()  # retention removed what the walk was in: go on after it
                position = max(position, manager.first_position)
        self._tail_to = max(self._tail_to, end)
        return self._tail

    def _add(self, payload: bytes) -> int:
        """Note the key of the message ``payload``, if it has one; returns its position."""
        if len(payload) < MESSAGE_HEAD_SIZE:
            raise CorruptRecordError(
                f"a record of {len(payload)} bytes in the log is shorter than a message head",
                file=self._log.manager.directory,
            )
        head = MESSAGE_HEAD.unpack_from(payload)
        position, flags, topic_len, tag_len, key_len = head[0], head[7], head[8], head[9], head[10]
        if not flags & FLAG_HAS_KEY:
            return int(position)
        start = MESSAGE_HEAD_SIZE + topic_len + tag_len
        topic = payload[MESSAGE_HEAD_SIZE : MESSAGE_HEAD_SIZE + topic_len].decode(errors="replace")
        key = payload[start : start + key_len].decode(errors="replace")
        self._tail[(topic, key)].append(position)
        return int(position)

    def add(self, topic: str, key: str, position: int) -> None:
        raise AssertionError("a read-only key index takes no keys")

    def commit(self) -> None:
        return  # nothing is ever buffered

    def close(self) -> None:
        with self._lock:
            self._db.close()
