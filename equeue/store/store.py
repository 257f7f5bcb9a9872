"""MessageStore: topics split into queues over message chunks and queue chunks."""

from __future__ import annotations

import datetime as dt
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import Any

import xxhash

from equeue.atomicfile import remove_temp_files, write_json
from equeue.chunks import ChunkManager, ChunkManagerConfig, ChunkReader, ChunkWriter
from equeue.errors import (
    ChunkRemovedError,
    ClosedError,
    CompactedAwayError,
    ConfigError,
    CorruptRecordError,
    InvalidMessageError,
    InvalidTypeError,
    MessageNotFoundError,
    PositionNotFoundError,
    ReadOnlyError,
    StoreWriteError,
    TopicNotFoundError,
)
from equeue.format.chunk import FRAME_OVERHEAD
from equeue.format.message import (
    FLAG_HAS_KEY,
    MESSAGE_HEAD,
    MESSAGE_HEAD_SIZE,
    STORED_TIME_OFFSET,
    TAG_HASH,
    TAG_HASH_OFFSET,
    decode_message_id,
    decode_properties,
    message_length,
    pack_message,
    tag_hash,
)
from equeue.store import validate
from equeue.store.config import StoreConfig
from equeue.store.flush import GroupCommit, run_service
from equeue.store.keyindex import KeyIndex
from equeue.store.meta import (
    CHECKPOINT_FILE,
    KEYS_FILE,
    MESSAGES_DIR,
    OFFSETS_FILE,
    QUEUES_DIR,
    TOPICS_FILE,
    open_identity,
    read_meta,
    take_lock,
    writer_running,
)
from equeue.store.queue import Queue
from equeue.store.recovery import RecoveryReport, recovery_start, redispatch
from equeue.store.types import Message, OutgoingMessage, PullResult, SendResult

# A send after _check: body, tag bytes, tag hash, key bytes, key, properties bytes, code, queue id.
_Checked = tuple[bytes, bytes, int, bytes, str | None, bytes, int, int | None]
_MAX_NAME = validate.MAX_NAME_BYTES


class MessageStore:
    """An embedded message store. Open with ``MessageStore.open(path, config)``.

    Thread-safe: any number of threads may send and pull. Sends are
    serialised by one lock (message record first, then its queue entry);
    pulls read committed data without taking it.

    One writer per directory: a second writable open, from any process, raises
    StoreLockedError. ``read_only=True`` opens beside a running writer and sees
    what it has written (pulls pick up new messages; ``refresh()`` new topics and
    consumer offsets); it never changes a file and does no recovery.
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
        return cls(Path(path), config, read_only=read_only)

    def __init__(self, path: Path, config: StoreConfig | None, *, read_only: bool = False) -> None:
        self.path = path
        self.read_only = read_only
        self._closed = False
        self._meta_problems: list[str] = []
        self._lock_file = None
        if not read_only:
            path.mkdir(parents=True, exist_ok=True)
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
        if not read_only:
            remove_temp_files(path)
        self._id_prefix = f"{self.store_id:08x}"
        self._messages = ChunkManager(
            path / MESSAGES_DIR,
            ChunkManagerConfig(
                chunk_data_size=config.chunk_data_size,
                max_record_size=config.max_message_size
                + config.max_properties_size
                + MESSAGE_HEAD_SIZE
                + 3 * _MAX_NAME,
                timestamp_offset=STORED_TIME_OFFSET,
                max_open_chunks=config.max_open_chunks,
            ),
            read_only=read_only,
        )
        self._reader = ChunkReader(self._messages)
        self._queues: dict[str, list[Queue]] = {}
        self._topic_bytes: dict[str, bytes] = {}
        self._round_robin: dict[str, int] = {}
        self._load_topics()
        self._offsets: dict[str, dict[str, dict[str, int]]] = self._read_meta(OFFSETS_FILE, {})
        checkpoint = self._read_meta(CHECKPOINT_FILE, {})
        self._keys = self._open_keys()
        self.recovery = RecoveryReport(
            cuts=list(self._messages.recovery_cuts),
            problems=self._meta_problems + self._messages.recovery_problems,
        )
        for queues in self._queues.values():
            for queue in queues:
                self.recovery.cuts += queue.manager.recovery_cuts
                self.recovery.problems += queue.manager.recovery_problems
        self._lock = threading.Lock()  # replaced by the writer's lock below
        self._arrived = threading.Condition(threading.Lock())
        self._waiting = 0
        self._flush_error: StoreWriteError | None = None
        if read_only:
            return
        start = recovery_start(checkpoint, self._messages, self._queues, self.recovery)
        redispatch(self._reader, start, self._queues, self._keys, self.recovery)
        first = self._messages.first_position
        for queues in self._queues.values():
            for queue in queues:  # retention may have removed messages the queue still indexes
                queue.first_offset = queue.first_offset_at_or_after(first)
        self._writer = ChunkWriter(self._messages)
        self._lock = self._writer.lock  # the one write lock: message record, then queue entry
        self._group = (
            GroupCommit(self._lock, self._writer.flush, self._wake)
            if config.flush == "sync"
            else None
        )
        self._checkpoint(flush=True)
        self._service_stop = threading.Event()
        self._service = threading.Thread(
            target=run_service, args=(self, self._service_stop), name="equeue-service", daemon=True
        )
        self._service.start()

    # --- lifecycle -----------------------------------------------------------

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
                with self._lock:
                    self._closed = True
                    self._release_files()
            finally:
                with self._arrived:
                    self._arrived.notify_all()
                if self._lock_file is not None:
                    self._lock_file.close()

    def _release_files(self) -> None:
        """Close every file; the first failure is raised after all were tried."""
        closers = [self._keys.close, self._messages.close]
        closers += [q.close for qs in self._queues.values() for q in qs]
        failure: BaseException | None = None
        for close in closers:
            try:
                close()
            except Exception as exc:
                failure = failure or exc
        if failure is not None:
            raise failure

    def flush(self) -> None:
        """Make everything sent so far durable, under any flush policy, and checkpoint it."""
        self._check_writable()
        self._checkpoint(flush=True)
        self._flush_error = None

    def _flush_log(self, least_bytes: int = 0) -> None:
        chunk = self._writer._chunk
        if chunk is not None and chunk.unflushed_bytes >= max(least_bytes, 1):
            chunk.flush()

    def _flush_queues(self, least_bytes: int = 0) -> None:
        for queues in list(self._queues.values()):
            for queue in queues:
                queue.flush(least_bytes)

    def _set_flush_error(self, error: StoreWriteError | None) -> None:
        self._flush_error = error

    # --- topics --------------------------------------------------------------

    def create_topic(self, topic: str, queue_count: int | None = None) -> None:
        """Create a topic, or grow its queue count (it never shrinks)."""
        validate.check_topic(topic)
        count = validate.check_queue_count(
            self.config.default_queue_count if queue_count is None else queue_count
        )
        with self._lock:
            self._check_writable()
            current = len(self._queues.get(topic, ()))
            if count < current:
                raise ConfigError(
                    f"topic {topic!r} has {current} queues; a queue count can grow, not shrink "
                    f"to {count}"
                )
            if count > current:
                previous = list(self._queues.get(topic, ()))
                try:
                    self._open_queues(topic, count)
                    self._save_topics()
                except BaseException:  # e.g. disk full: the topic stays as it was
                    for queue in self._queues.get(topic, [])[len(previous) :]:
                        queue.close()
                    if previous:
                        self._queues[topic] = previous
                    else:
                        self._queues.pop(topic, None)
                        self._topic_bytes.pop(topic, None)
                        self._round_robin.pop(topic, None)
                    raise

    def topics(self) -> list[str]:
        return sorted(self._queues)

    def queue_ids(self, topic: str) -> list[int]:
        return list(range(len(self._topic(topic))))

    def queue_range(self, topic: str, queue_id: int) -> tuple[int, int]:
        """(first retained offset, next offset) of a queue."""
        queue = self._queue(topic, queue_id)
        return queue.first_offset, queue.next_offset

    def _load_topics(self) -> None:
        for topic, info in sorted(self._read_meta(TOPICS_FILE, {}).items()):
            if int(info["queue_count"]) > len(self._queues.get(topic, ())):
                self._open_queues(topic, int(info["queue_count"]))

    def _open_queues(self, topic: str, count: int) -> None:
        queues = self._queues.get(topic, [])
        for queue_id in range(len(queues), count):
            queues.append(
                Queue(
                    self.path / QUEUES_DIR / topic / str(queue_id),
                    topic,
                    queue_id,
                    self.config.queue_chunk_records,
                    max_open_chunks=self.config.max_open_chunks,
                    read_only=self.read_only,
                )
            )
        self._queues[topic] = queues
        self._topic_bytes[topic] = topic.encode()
        self._round_robin.setdefault(topic, 0)

    def _save_topics(self) -> None:
        write_json(
            self.path / TOPICS_FILE,
            {topic: {"queue_count": len(queues)} for topic, queues in self._queues.items()},
        )

    def _topic(self, topic: str) -> list[Queue]:
        queues = self._queues.get(topic)
        if queues is None and self.read_only:
            self._load_topics()  # the writer may have created it since
            queues = self._queues.get(topic)
        if queues is None:
            validate.check_topic(topic)
            raise TopicNotFoundError(f"no topic {topic!r} in {self.path}")
        return queues

    def _queue(self, topic: str, queue_id: int) -> Queue:
        queues = self._topic(topic)
        return queues[validate.check_queue_id(queue_id, topic, len(queues))]

    def _queues_and_count(self, topic: object) -> tuple[list[Queue] | None, int]:
        """A send's topic: its queues (None if it is new) and their count, or an error."""
        if self.read_only:
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
        self.create_topic(topic, max(self.config.default_queue_count, 1))
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
        queues, count = self._queues_and_count(topic)
        checked = self._check(topic, count, body, tag, key, properties, code, queue_id)
        return self._store(topic, queues, [checked])[0]

    def send_batch(
        self, topic: str, messages: Iterable[bytes | OutgoingMessage | dict[str, Any]]
    ) -> list[SendResult]:
        """Send many messages under one lock acquisition: all are checked first, so one
        bad message rejects the batch and nothing is written."""
        queues, count = self._queues_and_count(topic)
        checked = []
        for message in messages:
            if isinstance(message, bytes | bytearray | memoryview):
                message = OutgoingMessage(bytes(message))
            elif isinstance(message, dict):
                message = OutgoingMessage(**message)
            elif not isinstance(message, OutgoingMessage):
                raise InvalidTypeError(
                    f"send_batch takes bytes, OutgoingMessage or dict items, got "
                    f"{type(message).__name__}"
                )
            checked.append(self._check(topic, count, *message))
        return self._store(topic, queues, checked)

    def _store(
        self, topic: str, queues: list[Queue] | None, checked: list[_Checked]
    ) -> list[SendResult]:
        """Append checked messages under the write lock; under "sync", flush the log and
        only the queues written to before returning."""
        if queues is None:
            queues = self._create_for_send(topic)
        if self._flush_error is not None:
            raise StoreWriteError(
                self._flush_error.errno,
                f"refusing the send: the last background flush failed ({self._flush_error}); "
                "sends resume once a flush succeeds",
            )
        if self._group is not None:  # "sync": appended and flushed in a batch with others
            return self._group.submit(lambda: self._append_all(topic, queues, checked))
        with self._lock:
            results = self._append_all(topic, queues, checked)
        if self._waiting:
            self._wake()
        return results

    def _append_all(
        self, topic: str, queues: list[Queue], checked: list[_Checked]
    ) -> list[SendResult]:
        self._check_open()
        results: list[SendResult] = []
        try:
            i = 0
            while i < len(checked):
                if len(checked) - i > 1:
                    i = self._append_run(topic, queues, checked, i, results)
                if i < len(checked):  # one that starts a new chunk, or a single send
                    results.append(self._append(topic, queues, *checked[i]))
                    i += 1
        except StoreWriteError as exc:
            exc.sent = results  # a batch cut short by the disk: what was stored before it
            raise
        return results

    def _check(
        self,
        topic: str,
        queue_count: int,
        body: object,
        tag: object,
        key: object,
        properties: object,
        code: object,
        queue_id: object,
    ) -> _Checked:
        config = self.config
        if type(body) is not bytes or len(body) > config.max_message_size:
            body = validate.check_body(body, config.max_message_size)
        tag_bytes, hashed = validate.check_tag(tag)
        key_bytes = b"" if key is None else validate.check_key(key)
        props = (
            b""
            if properties is None
            else validate.check_properties(properties, config.max_properties_size)
        )
        if type(code) is not int:
            code = validate.check_code(code)
        elif not -(1 << 31) <= code < 1 << 31:
            validate.check_code(code)
        if queue_id is not None:
            validate.check_queue_id(queue_id, topic, queue_count)
        size = MESSAGE_HEAD_SIZE + len(tag_bytes) + len(key_bytes) + len(props) + len(body) + 255
        if size + FRAME_OVERHEAD > config.chunk_data_size:
            raise InvalidMessageError(
                f"a message of about {size} bytes does not fit a chunk of chunk_data_size="
                f"{config.chunk_data_size}; raise StoreConfig.chunk_data_size"
            )
        return (body, tag_bytes, hashed, key_bytes, key, props, code, queue_id)  # type: ignore[return-value]

    def _append(
        self,
        topic: str,
        queues: list[Queue],
        body: bytes,
        tag_bytes: bytes,
        hashed: int,
        key_bytes: bytes,
        key: str | None,
        props: bytes,
        code: int,
        queue_id: int | None,
    ) -> SendResult:
        """Under the write lock: the message record, then its queue entry."""
        if queue_id is None:
            if key is not None:
                queue_id = xxhash.xxh32_intdigest(key_bytes) % len(queues)
            else:
                queue_id = self._round_robin[topic] % len(queues)
                self._round_robin[topic] = queue_id + 1
        queue = queues[queue_id]
        queue.make_room()  # a queue chunk that cannot be created fails the send before any write
        offset = queue.next_offset
        now = time.time_ns()
        topic_bytes = self._topic_bytes[topic]
        writer = self._writer
        position = writer.position_for(
            message_length(topic_bytes, tag_bytes, key_bytes, props, body)
        )
        record = pack_message(
            position,
            now,
            now,
            offset,
            queue_id,
            code,
            hashed,
            FLAG_HAS_KEY if key is not None else 0,
            topic_bytes,
            tag_bytes,
            key_bytes,
            props,
            body,
        )
        written = writer.unlocked_write(record)
        assert written == position, "position_for() and the write disagree"
        queue.append(position, hashed)
        if key is not None:
            self._keys.add(topic, key, position)
        return SendResult(
            self._id_prefix + format(position, "016x"), topic, queue_id, offset, position, now / 1e9
        )

    def _append_run(
        self,
        topic: str,
        queues: list[Queue],
        checked: list[_Checked],
        i: int,
        results: list[SendResult],
    ) -> int:
        """Under the write lock: ``_append`` for the run of messages from ``checked[i]``
        that fit the current log chunk and their queues' current chunks, written as
        one block: frames first, then one publish, then the queue entries (so no
        entry points at a record readers cannot see yet). Returns where it stopped."""
        chunk = self._writer._chunk
        if chunk is None:
            return i
        topic_bytes = self._topic_bytes[topic]
        base, start, room = chunk.base, chunk.data_end, chunk.data_size
        end = start
        fixed = MESSAGE_HEAD_SIZE + len(topic_bytes) + FRAME_OVERHEAD
        count = len(queues)
        turn = self._round_robin[topic]
        taken: dict[Queue, int] = {}
        entries: list[tuple[Queue, int, int]] = []
        keys: list[tuple[str, int]] = []
        id_prefix = self._id_prefix
        now = time.time_ns()
        stored_at = now / 1e9
        write = chunk.write_frame_at
        first = i
        for body, tag_bytes, hashed, key_bytes, key, props, code, queue_id in checked[i:]:
            if end + fixed + len(tag_bytes) + len(key_bytes) + len(props) + len(body) > room:
                break
            by_turn = queue_id is None and key is None
            if queue_id is None:
                if key is not None:
                    queue_id = xxhash.xxh32_intdigest(key_bytes) % count
                else:
                    queue_id = turn % count
                    turn = queue_id + 1
            queue = queues[queue_id]
            pending = taken.get(queue, 0)
            if pending >= queue.free_slots():
                if by_turn:
                    turn = queue_id  # this one goes through _append, which takes the turn
                break
            taken[queue] = pending + 1
            offset = queue.next_offset + pending
            position = base + end
            end = write(
                end,
                pack_message(
                    position, now, now, offset, queue_id, code, hashed,
                    FLAG_HAS_KEY if key is not None else 0,
                    topic_bytes, tag_bytes, key_bytes, props, body,
                ),
            )  # fmt: skip
            entries.append((queue, position, hashed))
            if key is not None:
                keys.append((key, position))
            results.append(
                SendResult(
                    id_prefix + format(position, "016x"),
                    topic, queue_id, offset, position, stored_at,
                )
            )  # fmt: skip
            i += 1
        if i == first:
            return i
        self._round_robin[topic] = turn
        chunk.publish(end, i - first)
        for queue, position, hashed in entries:
            queue.append(position, hashed)
        for key, position in keys:
            self._keys.add(topic, key, position)
        return i

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
    ) -> PullResult:
        """Up to ``max_count`` messages from ``offset`` on; ``next_offset`` is where to go on.

        ``tags`` keeps only messages with one of these tags (compared by the stored
        hash, then exactly). ``wait > 0`` blocks until a message arrives or the time passes.
        """
        queue = self._queue(topic, queue_id)
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise InvalidMessageError(f"offset must be an int >= 0, got {offset!r}")
        if not isinstance(max_count, int) or max_count < 1:
            raise InvalidMessageError(f"max_count must be an int >= 1, got {max_count!r}")
        wanted = _tag_filter(tags)
        if self.read_only and offset >= queue.next_offset:
            self._refresh_queue(queue, offset, wait)
        offset = max(offset, queue.first_offset)
        if wait > 0 and offset >= queue.next_offset and not self.read_only:
            self._wait_for(queue, offset, wait)
        messages: list[Message] = []
        while len(messages) < max_count:
            entries = queue.entries(offset, max_count if wanted is None else 256)
            if not entries:
                break
            kept = [p for p, hashed in entries if wanted is None or hashed in wanted]
            try:
                found = self._read_run(kept)
            except (PositionNotFoundError, CorruptRecordError) as exc:
                raise self._bad_entry(queue, offset, entries, exc) from exc
            for position, hashed in entries:
                offset += 1
                if wanted is not None and hashed not in wanted:
                    continue
                read = found.get(position)
                if read is None:
                    continue  # removed by retention or compaction
                message, stored_hash = read
                if (
                    message.queue_offset != offset - 1
                    or message.queue_id != queue.queue_id
                    or message.topic != queue.topic
                    or stored_hash != hashed
                ):
                    raise self._wrong_message(queue, offset - 1, message, hashed, stored_hash)
                if wanted is not None and message.tag not in wanted[hashed]:
                    continue  # a hash collision
                messages.append(message)
                if len(messages) == max_count:
                    break
            offset = max(offset, queue.first_offset)
        return PullResult(messages, offset)

    def _wrong_message(
        self, queue: Queue, offset: int, message: Message, hashed: int, stored_hash: int
    ) -> CorruptRecordError:
        file, at = queue.entry_location(offset)
        return CorruptRecordError(
            f"queue {queue.topic}/{queue.queue_id} entry for offset {offset} (tag hash "
            f"{hashed:#x}) points at position {message.position}, which holds "
            f"{message.topic}/{message.queue_id} offset {message.queue_offset} (tag hash "
            f"{stored_hash:#x}): the queue entry is damaged",
            file=file,
            offset=at,
        )

    def _bad_entry(
        self, queue: Queue, first: int, entries: list[tuple[int, int]], exc: Exception
    ) -> CorruptRecordError:
        """The entry of a run whose message cannot be read, named with its queue file."""
        offset, position = first, entries[0][0]
        for offset, (position, _) in enumerate(entries, first):  # noqa: B007 - used below
            try:
                self._read_run([position])
            except (PositionNotFoundError, CorruptRecordError) as found:
                exc = found
                break
        file, at = queue.entry_location(offset)
        return CorruptRecordError(
            f"queue {queue.topic}/{queue.queue_id} entry for offset {offset} names position "
            f"{position}, where no intact message was found ({exc})",
            file=file,
            offset=at,
        )

    def _read_run(self, positions: list[int]) -> dict[int, tuple[Message, int]]:
        """The messages at ``positions`` (ascending, as in a queue), read chunk by chunk,
        each with the tag hash its record holds; a message removed by retention or
        compaction is left out."""
        manager = self._messages
        if self.read_only and positions and positions[-1] >= manager.committed_position:
            manager.refresh()
        found: dict[int, tuple[Message, int]] = {}
        decode, stored_hash = self._decode, TAG_HASH.unpack_from
        i = 0
        while i < len(positions):
            try:
                chunk = manager.get_chunk_for(positions[i])
            except ChunkRemovedError:
                i += 1
                continue
            base, end = chunk.base, chunk.end_position
            j = i + 1
            while j < len(positions) and positions[j] < end:
                j += 1
            run = positions[i:j]
            try:
                payloads: list[bytes | None] = list(chunk.read_many([p - base for p in run]))
            except (ChunkRemovedError, CompactedAwayError):
                payloads = [self._payload_or_none(p) for p in run]
            for position, payload in zip(run, payloads, strict=True):
                if payload is not None:
                    found[position] = (
                        decode(position, payload),
                        stored_hash(payload, TAG_HASH_OFFSET)[0],
                    )
            i = j
        return found

    def _payload_or_none(self, position: int) -> bytes | None:
        try:
            return self._reader.read(position)
        except (ChunkRemovedError, CompactedAwayError):
            return None

    def _wait_for(self, queue: Queue, offset: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._arrived:
            self._waiting += 1
            try:
                while queue.next_offset <= offset and not self._closed:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return
                    self._arrived.wait(remaining)
            finally:
                self._waiting -= 1

    def read(self, position: int) -> Message:
        if not isinstance(position, int) or isinstance(position, bool):
            raise InvalidTypeError(f"position must be an int, got {type(position).__name__}")
        try:
            return (self._read_fresh if self.read_only else self._read_record)(position)
        except (PositionNotFoundError, CorruptRecordError) as exc:
            # A position from a caller (or a message id) that names no record start reads
            # as an invalid frame; the frame check still keeps corrupt bytes from escaping.
            raise MessageNotFoundError(f"no message at position {position}: {exc}") from exc

    def get(self, message_id: str) -> Message:
        decoded = decode_message_id(message_id)
        if decoded is None or decoded[0] != self.store_id:
            raise MessageNotFoundError(f"{message_id!r} is not a message id of this store")
        return self.read(decoded[1])

    def _read_record(self, position: int) -> Message:
        return self._decode(position, self._reader.read(position))

    def _decode(self, position: int, payload: bytes) -> Message:
        (pos, stored, created, qoff, qid, code, _, flags, tl, gl, kl, pl, _) = (
            MESSAGE_HEAD.unpack_from(payload)
        )
        if pos != position:
            raise CorruptRecordError(
                f"the record at position {position} names another position",
                file=str(self._messages.get_chunk_for(position).path),
                expected=position,
                found=pos,
            )
        p = MESSAGE_HEAD_SIZE + tl
        topic = payload[MESSAGE_HEAD_SIZE:p].decode()
        tag = payload[p : p + gl].decode() if gl else ""
        p += gl
        key = payload[p : p + kl].decode() if flags & FLAG_HAS_KEY else None
        p += kl
        props = decode_properties(payload[p : p + pl]) if pl else {}
        return Message(
            self._id_prefix + format(position, "016x"),
            topic,
            qid,
            qoff,
            position,
            tag,
            key,
            props,
            code,
            payload[p + pl :],
            created / 1e9,
            stored / 1e9,
        )

    def query_by_key(self, topic: str, key: str, limit: int = 32) -> list[Message]:
        """Messages of ``topic`` with ``key``, newest first."""
        self._topic(topic)
        validate.check_key(key)
        found: list[Message] = []
        for position in self._keys.positions(topic, key, limit):
            try:
                message = self._read_record(position)
            except (ChunkRemovedError, CompactedAwayError):
                continue
            if message.key == key and message.topic == topic:
                found.append(message)
        return found

    def offset_for_time(self, topic: str, queue_id: int, timestamp: float | dt.datetime) -> int:
        """The first offset stored at or after ``timestamp`` (binary search over the queue)."""
        queue = self._queue(topic, queue_id)
        if isinstance(timestamp, dt.datetime):
            timestamp = timestamp.timestamp()
        lo, hi = queue.first_offset, queue.next_offset
        while lo < hi:
            mid = (lo + hi) // 2
            payload = self._reader.read(queue.entry(mid)[0])
            (stored,) = MESSAGE_HEAD.unpack_from(payload)[1:2]
            # Compare as stored_at is exposed (float seconds), so a message's own
            # stored_at finds that message despite float rounding.
            if stored / 1e9 < timestamp:
                lo = mid + 1
            else:
                hi = mid
        return lo

    # --- consumer offsets ----------------------------------------------------

    def commit_offset(self, group: str, topic: str, queue_id: int, offset: int) -> None:
        """Record that ``group`` consumed ``topic``/``queue_id`` up to ``offset`` (persisted)."""
        if not isinstance(group, str) or not group or len(group.encode()) > _MAX_NAME:
            raise InvalidMessageError(
                f"group must be a non-empty str of at most 255 bytes: {group!r}"
            )
        self._queue(topic, queue_id)
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise InvalidMessageError(f"offset must be an int >= 0, got {offset!r}")
        with self._lock:
            self._check_writable()
            offsets = {g: {t: dict(qs) for t, qs in ts.items()} for g, ts in self._offsets.items()}
            offsets.setdefault(group, {}).setdefault(topic, {})[str(queue_id)] = offset
            write_json(self.path / OFFSETS_FILE, offsets)  # raises: nothing changed
            self._offsets = offsets

    def committed_offset(self, group: str, topic: str, queue_id: int) -> int | None:
        return self._offsets.get(group, {}).get(topic, {}).get(str(queue_id))

    def consumer_groups(self) -> dict[str, dict[str, dict[int, int]]]:
        return {
            g: {t: {int(q): o for q, o in qs.items()} for t, qs in ts.items()}
            for g, ts in self._offsets.items()
        }

    # --- retention -----------------------------------------------------------

    def apply_retention(self, now: float | None = None) -> int:
        """Delete completed message chunks past retention; returns how many were removed."""
        from equeue.store.retention import apply_retention

        with self._lock:
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

    def _read_meta(self, name: str, default: Any) -> Any:
        return read_meta(
            self.path, name, default, self._meta_problems, move_aside=not self.read_only
        )

    # --- read-only handles ---------------------------------------------------

    def refresh(self) -> None:
        """Read-only: pick up topics, consumer offsets and messages the writer added since."""
        self._check_open()
        if not self.read_only:
            return
        self._load_topics()
        self._offsets = self._read_meta(OFFSETS_FILE, self._offsets)
        self._messages.refresh()
        for queues in self._queues.values():
            for queue in queues:
                queue.refresh()
        self._keys.close()
        self._keys = self._open_keys()

    def _open_keys(self) -> KeyIndex:
        path = self.path / KEYS_FILE
        if not self.read_only:
            return KeyIndex(path)
        if not path.exists():
            return KeyIndex(Path(":memory:"))  # a store that never indexed a key
        return KeyIndex(path, read_only=True, immutable=not writer_running(self.path))

    def _read_fresh(self, position: int) -> Message:
        """Read-only: a queue entry may name a message the log view has not seen yet."""
        if position >= self._messages.committed_position:
            self._messages.refresh()
        return self._read_record(position)

    def _refresh_queue(self, queue: Queue, offset: int, wait: float) -> None:
        """Read-only pulls poll the files (the writer is another process) until a
        message past ``offset`` shows up or ``wait`` passes."""
        deadline = time.monotonic() + wait
        while True:
            queue.refresh()
            if offset < queue.next_offset:
                self._messages.refresh()
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            time.sleep(min(remaining, 0.01))

    # --- checkpoints and the service thread ------------------------------------

    def _checkpoint(self, *, flush: bool) -> None:
        """Flush, then record the log position up to which queue entries and keys are
        durable, with each queue's next offset.

        The positions are taken under the write lock, the flushes run after it
        (so sends go on meanwhile), and the file is written last: the checkpoint
        is never ahead of the data it describes. Without ``flush`` (flush="os",
        between explicit flushes) only the key index batch is committed.
        """
        with self._lock:
            self._check_open()
            position = self._messages.committed_position
            queues = {t: [q.next_offset for q in qs] for t, qs in self._queues.items()}
            self._keys.mark(position)
        if flush:
            self._flush_queues()
            self._writer.flush()
        self._keys.commit()
        if flush:
            write_json(
                self.path / CHECKPOINT_FILE,
                {"log_position": position, "queues": queues, "key_index": position},
            )

    def _checkpoint_due(self) -> bool:
        return self._keys.pending >= self.config.key_index_batch

    def _apply_retention_in_service(self) -> None:
        if self.config.retention or self.config.max_store_bytes:
            self.apply_retention()


def _tag_filter(tags: str | Iterable[str] | None) -> dict[int, set[str]] | None:
    """{tag hash: tags} for a tag filter; None means every message."""
    if tags is None or tags == "*":
        return None
    if isinstance(tags, str):
        tags = [tags]
    wanted: dict[int, set[str]] = {}
    for tag in tags:
        if not isinstance(tag, str):
            raise InvalidTypeError(f"tags must be str values, got {type(tag).__name__}")
        wanted.setdefault(tag_hash(tag), set()).add(tag)
    return wanted
