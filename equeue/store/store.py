"""MessageStore: topics split into queues over message chunks and queue chunks."""

from __future__ import annotations

import datetime as dt
import fcntl
import os
import threading
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import Any

import xxhash

from equeue.atomicfile import read_json, remove_temp_files, write_json
from equeue.chunks import ChunkManager, ChunkManagerConfig, ChunkReader, ChunkWriter
from equeue.errors import (
    ChunkRemovedError,
    ClosedError,
    CompactedAwayError,
    ConfigError,
    CorruptionError,
    CorruptRecordError,
    InvalidMessageError,
    InvalidTypeError,
    MessageNotFoundError,
    PositionNotFoundError,
    StoreLockedError,
    TopicNotFoundError,
)
from equeue.format.chunk import FRAME_OVERHEAD
from equeue.format.message import (
    FLAG_HAS_KEY,
    MESSAGE_HEAD,
    MESSAGE_HEAD_SIZE,
    STORED_TIME_OFFSET,
    decode_message_id,
    decode_properties,
    message_length,
    pack_message,
    tag_hash,
)
from equeue.store import validate
from equeue.store.config import StoreConfig
from equeue.store.keyindex import KeyIndex
from equeue.store.queue import Queue
from equeue.store.recovery import RecoveryReport, redispatch
from equeue.store.types import Message, OutgoingMessage, PullResult, SendResult

STORE_FORMAT = 1
# A send after _check: body, tag bytes, tag hash, key bytes, key, properties bytes, code, queue id.
_Checked = tuple[bytes, bytes, int, bytes, str | None, bytes, int, int | None]
_MAX_NAME = validate.MAX_NAME_BYTES


class MessageStore:
    """An embedded message store. Open with ``MessageStore.open(path, config)``.

    Thread-safe: any number of threads may send and pull. Sends are
    serialised by one lock (message record first, then its queue entry);
    pulls read committed data without taking it.
    """

    @classmethod
    def open(cls, path: str | os.PathLike[str], config: StoreConfig | None = None) -> MessageStore:
        return cls(Path(path), config or StoreConfig())

    def __init__(self, path: Path, config: StoreConfig) -> None:
        self.path = path
        self.config = config
        self._closed = False
        self._meta_problems: list[str] = []
        path.mkdir(parents=True, exist_ok=True)
        self._lock_file = self._take_lock()
        try:
            self._open()
        except BaseException:
            self._lock_file.close()
            raise

    def _open(self) -> None:
        config, path = self.config, self.path
        remove_temp_files(path)
        self.store_id = self._load_identity()
        self._id_prefix = f"{self.store_id:08x}"
        self._messages = ChunkManager(
            path / "messages",
            ChunkManagerConfig(
                chunk_data_size=config.chunk_data_size,
                max_record_size=config.max_message_size
                + config.max_properties_size
                + MESSAGE_HEAD_SIZE
                + 3 * _MAX_NAME,
                timestamp_offset=STORED_TIME_OFFSET,
                max_open_chunks=config.max_open_chunks,
            ),
        )
        self._reader = ChunkReader(self._messages)
        self._queues: dict[str, list[Queue]] = {}
        self._topic_bytes: dict[str, bytes] = {}
        self._round_robin: dict[str, int] = {}
        for topic, info in sorted(self._read_meta("topics.json", {}).items()):
            self._open_queues(topic, int(info["queue_count"]))
        self._offsets: dict[str, dict[str, dict[str, int]]] = self._read_meta("offsets.json", {})
        checkpoint = self._read_meta("checkpoint.json", {}).get("log_position")
        self._keys = KeyIndex(path / "keys.sqlite")
        self.recovery = RecoveryReport(
            cuts=list(self._messages.recovery_cuts), problems=list(self._meta_problems)
        )
        start = self._messages.first_position
        if isinstance(checkpoint, int):
            start = min(max(checkpoint, start), self._messages.committed_position)
        for queues in self._queues.values():
            for queue in queues:
                self.recovery.cuts += queue.manager.recovery_cuts
        redispatch(self._reader, start, self._queues, self._keys, self.recovery)
        first = self._messages.first_position
        for queues in self._queues.values():
            for queue in queues:  # retention may have removed messages the queue still indexes
                queue.first_offset = queue.first_offset_at_or_after(first)
        self._writer = ChunkWriter(self._messages)
        self._lock = self._writer.lock  # the one write lock: message record, then queue entry
        self._arrived = threading.Condition(threading.Lock())
        self._waiting = 0
        self._sync = config.flush == "sync"
        self._write_checkpoint()
        self._service_stop = threading.Event()
        self._service = threading.Thread(
            target=self._run_service, name="equeue-service", daemon=True
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
        if self._closed:
            return
        self._service_stop.set()
        self._service.join()
        with self._lock:
            self._closed = True
            self._flush_all()
            self._write_checkpoint()
            self._keys.close()
            for queues in self._queues.values():
                for queue in queues:
                    queue.close()
            self._messages.close()
        with self._arrived:
            self._arrived.notify_all()
        self._lock_file.close()

    def flush(self) -> None:
        """Make everything sent so far durable, under any flush policy."""
        self._check_open()
        self._flush_all()

    def _flush_all(self) -> None:
        self._writer.flush()
        for queues in self._queues.values():
            for queue in queues:
                queue.flush()

    # --- topics --------------------------------------------------------------

    def create_topic(self, topic: str, queue_count: int | None = None) -> None:
        """Create a topic, or grow its queue count (it never shrinks)."""
        validate.check_topic(topic)
        count = validate.check_queue_count(
            self.config.default_queue_count if queue_count is None else queue_count
        )
        with self._lock:
            self._check_open()
            current = len(self._queues.get(topic, ()))
            if count < current:
                raise ConfigError(
                    f"topic {topic!r} has {current} queues; a queue count can grow, not shrink "
                    f"to {count}"
                )
            if count > current:
                self._open_queues(topic, count)
                self._save_topics()

    def topics(self) -> list[str]:
        return sorted(self._queues)

    def queue_ids(self, topic: str) -> list[int]:
        return list(range(len(self._topic(topic))))

    def queue_range(self, topic: str, queue_id: int) -> tuple[int, int]:
        """(first retained offset, next offset) of a queue."""
        queue = self._queue(topic, queue_id)
        return queue.first_offset, queue.next_offset

    def _open_queues(self, topic: str, count: int) -> None:
        queues = self._queues.get(topic, [])
        for queue_id in range(len(queues), count):
            queues.append(
                Queue(
                    self.path / "queues" / topic / str(queue_id),
                    topic,
                    queue_id,
                    self.config.queue_chunk_records,
                    max_open_chunks=self.config.max_open_chunks,
                )
            )
        self._queues[topic] = queues
        self._topic_bytes[topic] = topic.encode()
        self._round_robin.setdefault(topic, 0)

    def _save_topics(self) -> None:
        write_json(
            self.path / "topics.json",
            {topic: {"queue_count": len(queues)} for topic, queues in self._queues.items()},
        )

    def _topic(self, topic: str) -> list[Queue]:
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
        with self._lock:
            self._check_open()
            results = [self._append(topic, queues, *c) for c in checked]
            if self._sync:
                self._writer.flush()
                for queue_id in {r.queue_id for r in results}:
                    queues[queue_id].flush()
        if self._waiting:
            self._wake()
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

    def _wake(self) -> None:
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
        offset = max(offset, queue.first_offset)
        if wait > 0 and offset >= queue.next_offset:
            self._wait_for(queue, offset, wait)
        messages: list[Message] = []
        read = self._read_record
        while len(messages) < max_count:
            entries = queue.entries(offset, max_count if wanted is None else 256)
            if not entries:
                break
            for position, hashed in entries:
                offset += 1
                if wanted is not None and hashed not in wanted:
                    continue
                try:
                    message = read(position)
                except (ChunkRemovedError, CompactedAwayError):
                    continue
                if wanted is not None and message.tag not in wanted[hashed]:
                    continue  # a hash collision
                messages.append(message)
                if len(messages) == max_count:
                    break
            offset = max(offset, queue.first_offset)
        return PullResult(messages, offset)

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
            return self._read_record(position)
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
        payload = self._reader.read(position)
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
            self._check_open()
            self._offsets.setdefault(group, {}).setdefault(topic, {})[str(queue_id)] = offset
            write_json(self.path / "offsets.json", self._offsets)

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
            self._check_open()
            return apply_retention(self, time.time() if now is None else now)

    # --- internals -----------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"store {self.path} is closed")

    def _take_lock(self) -> Any:
        lock_path = self.path / "LOCK"
        handle = open(lock_path, "a+")  # noqa: SIM115 - held open for the store's lifetime
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            handle.close()
            raise StoreLockedError(
                f"store {self.path} is open for writing by pid {holder}; open it read-only or "
                "close the other handle"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        return handle

    def _load_identity(self) -> int:
        path = self.path / "store.json"
        config = self.config
        if not path.exists():
            store_id = uuid.uuid4().int & 0xFFFFFFFF
            write_json(
                path,
                {
                    "format": STORE_FORMAT,
                    "store_id": store_id,
                    "chunk_data_size": config.chunk_data_size,
                    "queue_chunk_records": config.queue_chunk_records,
                },
            )
            return store_id
        identity = read_json(path)
        for setting in ("chunk_data_size", "queue_chunk_records"):
            if identity[setting] != getattr(config, setting):
                raise ConfigError(
                    f"store {self.path} was created with {setting}={identity[setting]}, but the "
                    f"configuration says {setting}={getattr(config, setting)}; "
                    f"open it with StoreConfig({setting}={identity[setting]})"
                )
        return int(identity["store_id"])

    def _read_meta(self, name: str, default: Any) -> Any:
        """A metadata file's body; a damaged one is reported, moved aside and replaced."""
        path = self.path / name
        if not path.exists():
            return default
        try:
            return read_json(path)
        except CorruptionError as exc:
            side = self.path / "recovered"
            side.mkdir(exist_ok=True)
            moved = side / f"{name}.{time.time_ns()}.damaged"
            os.replace(path, moved)
            self._meta_problems.append(f"{exc}; moved to {moved}")
            return default

    def _write_checkpoint(self) -> None:
        """Record the log position up to which queue entries and keys are durable.

        Called with the write lock held or before any send; flushes first, so the
        checkpoint is never ahead of the data it describes.
        """
        position = self._messages.committed_position
        self._keys.mark(position)
        self._flush_all()
        self._keys.commit()
        write_json(self.path / "checkpoint.json", {"log_position": position})

    def _run_service(self) -> None:
        """Background work: async flushes, key-index batches, checkpoints, retention."""
        interval = self.config.flush_interval_ms / 1000
        last_checkpoint = time.monotonic()
        while not self._service_stop.wait(interval):
            try:
                if self.config.flush == "async":
                    self._flush_all()
                if self._keys.pending >= self.config.key_index_batch or (
                    time.monotonic() - last_checkpoint > 10
                ):
                    with self._lock:
                        if self._closed:
                            return
                        self._write_checkpoint()
                    last_checkpoint = time.monotonic()
                    if self.config.retention or self.config.max_store_bytes:
                        self.apply_retention()
            except ClosedError:
                return


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
