"""ChunkWriter: the one appender of a chunk directory."""

from __future__ import annotations

import threading
from collections.abc import Iterable

from equeue.chunks.chunk import Chunk
from equeue.chunks.manager import ChunkManager
from equeue.errors import ClosedError, InvalidRecordError, RecordTooLargeError
from equeue.format.chunk import FRAME_OVERHEAD


class ChunkWriter:
    """Appends records under one lock. ``write`` returns the record's global position.

    When a record does not fit in the current chunk, the chunk is completed
    (data flushed, footer written and flushed), the next chunk is added and the
    record goes there. With ``sync_flush`` each write is flushed before it
    returns; otherwise ``flush()`` makes everything written so far durable.
    """

    def __init__(self, manager: ChunkManager, lock: threading.RLock | None = None) -> None:
        manager._attach_writer(self)
        self.manager = manager
        config = manager.config
        # A caller's RLock (the store's: it opens queues under the lock it writes under).
        self._lock: threading.Lock | threading.RLock = lock or threading.Lock()
        self._sync = config.sync_flush
        self._fixed = config.record_size
        # write()'s fast path checks only type and length; fixed-size records (which must
        # also not be all zero) always take the full check.
        self._min_length = 1 if config.timestamp_offset is None else config.timestamp_offset + 8
        self._max_length = config.largest_record
        if self._fixed:
            self._min_length = self._max_length + 1
        last = manager.last_chunk
        self._chunk: Chunk | None = last if last is not None and not last.is_completed else None

    @property
    def lock(self) -> threading.Lock | threading.RLock:
        """The write lock; hold it to make several writes one atomic step."""
        return self._lock

    @property
    def committed_position(self) -> int:
        return self.manager.committed_position

    @property
    def flushed_position(self) -> int:
        chunk = self._chunk
        if chunk is None:
            return self.manager.committed_position
        return chunk.start_position + chunk.flushed_end

    def write(self, record: bytes) -> int:
        if type(record) is not bytes or not self._min_length <= len(record) <= self._max_length:
            record = self._check(record)
        # acquire()/release() rather than `with`: on CPython 3.11 it costs half as much,
        # a fifth of an append.
        lock = self._lock
        lock.acquire()
        try:
            chunk = self._chunk
            if chunk is not None and not self._fixed:  # the common case, inlined
                offset = chunk.try_append(record)
                if offset >= 0:
                    if self._sync:
                        chunk.flush()
                    return chunk.base + offset
            position = self._append(record)
            if self._sync:
                self._chunk.flush()  # type: ignore[union-attr]
            return position
        finally:
            lock.release()

    def write_many(self, records: Iterable[bytes]) -> list[int]:
        """Write several records under one lock acquisition (and one flush with sync_flush).

        Every record is checked before the first is written, so a bad one
        rejects the whole batch and writes nothing.
        """
        batch = [self._check(record) for record in records]
        with self._lock:
            positions = [self._append(record) for record in batch]
            if self._sync and self._chunk is not None:
                self._chunk.flush()
            return positions

    def position_for(self, length: int) -> int:
        """Where a checked record of ``length`` bytes would land if written now.

        For records that carry their own position; the caller holds ``lock``
        from here through ``unlocked_write``.
        """
        chunk = self._chunk
        size = self._fixed or length + FRAME_OVERHEAD
        if chunk is not None and chunk.data_end + size <= chunk.data_size:
            return chunk.base + chunk.data_end
        if chunk is not None:
            return chunk.end_position
        last = self.manager.last_chunk
        return last.end_position if last is not None else 0

    def unlocked_write(self, record: bytes) -> int:
        """``write`` for a caller that already holds ``lock`` and checked the record."""
        return self._append(record)

    def _append(self, record: bytes) -> int:
        chunk = self._chunk
        if chunk is None:
            chunk = self.add_new_chunk()
        offset = chunk.try_append_fixed(record) if self._fixed else chunk.try_append(record)
        if offset < 0:
            self.complete()
            chunk = self.add_new_chunk()
            offset = chunk.try_append_fixed(record) if self._fixed else chunk.try_append(record)
            assert offset >= 0, "a checked record always fits an empty chunk"
        return chunk.base + offset

    def complete(self) -> None:
        """Complete the current chunk; the next write starts a new one."""
        chunk = self._chunk
        if chunk is not None:
            chunk.complete()
            self._chunk = None

    def add_new_chunk(self) -> Chunk:
        if self.manager._closed:
            raise ClosedError(f"chunk manager for {self.manager.directory} is closed")
        self._chunk = self.manager.add_new_chunk()
        return self._chunk

    def flush(self, least_bytes: int = 0) -> None:
        """Make what was written durable; with ``least_bytes``, only once that much
        is unflushed (the async service's threshold)."""
        chunk = self._chunk
        if chunk is not None and chunk.unflushed_bytes >= max(least_bytes, 1):
            chunk.flush()

    def _check(self, record: bytes | bytearray | memoryview) -> bytes:
        """The record as bytes, or a clear error; the slow path of ``write``."""
        if not isinstance(record, bytes | bytearray | memoryview):
            raise InvalidRecordError(f"a record must be bytes, got {type(record).__name__}")
        record = bytes(record)
        config = self.manager.config
        n = len(record)
        if self._fixed:
            if n != self._fixed:
                raise InvalidRecordError(
                    f"record of {n} bytes in a fixed-size chunk directory {self.manager.directory} "
                    f"whose record_size={self._fixed}"
                )
            if not any(record):
                raise InvalidRecordError(
                    "an all-zero fixed-size record cannot be stored: zero slots mean 'empty'"
                )
            return record
        if n == 0:
            raise InvalidRecordError("an empty record cannot be stored: length 0 marks end of data")
        if n < self._min_length:
            raise InvalidRecordError(
                f"record of {n} bytes is too short to hold the timestamp at "
                f"timestamp_offset={config.timestamp_offset}"
            )
        if n > config.max_record_size:
            raise RecordTooLargeError(
                f"record of {n} bytes exceeds max_record_size={config.max_record_size}; "
                "raise ChunkManagerConfig.max_record_size to store it"
            )
        if n + FRAME_OVERHEAD > config.chunk_data_size:
            raise RecordTooLargeError(
                f"record of {n} bytes (+{FRAME_OVERHEAD} framing) does not fit a chunk of "
                f"chunk_data_size={config.chunk_data_size}; "
                "raise ChunkManagerConfig.chunk_data_size"
            )
        return record
