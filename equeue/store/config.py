from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Literal, NamedTuple

from equeue.chunks.config import MiB, check_int
from equeue.errors import ConfigError
from equeue.format.chunk import MAX_CHUNK_DATA_SIZE, MIN_CHUNK_DATA_SIZE
from equeue.format.message import QUEUE_RECORD_SIZE
from equeue.store.queuecache import FILES_PER_QUEUE
from equeue.store.validate import MAX_QUEUES, check_span

FlushPolicy = Literal["sync", "async", "os"]
DEFAULT_CHUNK_DATA_SIZE = 256 * MiB
DEFAULT_QUEUE_CHUNK_RECORDS = 1_000_000


class Layout(NamedTuple):
    """The file shape of a configuration, unset values read as a new store's defaults."""

    chunk_data_size: int
    queue_chunk_records: int


@dataclass(frozen=True, kw_only=True)
class StoreConfig:
    """Settings of a message store; every field has a documented default.

    ``chunk_data_size`` and ``queue_chunk_records`` shape the files and are
    fixed when the store is created. Left unset (None), a new store gets the
    defaults (256 MiB, 1,000,000 records) and an existing one keeps its own;
    an explicit value that differs from the store's is refused (ConfigError).
    ``store.config`` holds the values in use.

    Durability (``flush``), by what each policy risks:

    * ``"sync"``: ``send`` returns after the message record, which holds its
      queue entry's content, is on stable storage; concurrent senders share
      one fdatasync (group commit). Nothing acknowledged is lost, even on
      power loss.
    * ``"async"`` (default): a background thread flushes every
      ``flush_interval_ms`` when at least ``flush_least_pages`` pages are
      unflushed, and everything every ``flush_thorough_interval_ms``. A
      process crash loses nothing (the bytes are in the OS page cache); a
      power loss or kernel crash can lose the sends of the last
      ``flush_thorough_interval_ms`` at worst, typically ``flush_interval_ms``.
    * ``"os"``: equeue never flushes by itself; the OS writes back when it
      likes (typically within 30 s). A power loss can lose everything since
      the last ``flush()`` or ``close()``.

    docs/durability.md says exactly what each policy can lose.

    ``alloc_step`` (bytes) is how far ahead of the writer the log's disk blocks
    are allocated (queue chunks: 32 KiB at most), so the disk holds the data
    plus a few MiB, and a full disk is a ``DiskFullError`` before anything is
    written. 0 allocates every chunk whole at creation (256 MiB for the first
    message); ChunkManagerConfig.alloc_step says what each choice risks.
    """

    chunk_data_size: int | None = None  # DEFAULT_CHUNK_DATA_SIZE for a new store
    queue_chunk_records: int | None = None  # DEFAULT_QUEUE_CHUNK_RECORDS for a new store
    default_queue_count: int = 4
    auto_create_topics: bool = True
    # Topics a create_topic or a first send may make (None: no limit); the broker's own
    # (equeue.*) are not counted. Past it: LimitExceededError, nothing made.
    max_topics: int | None = None
    flush: FlushPolicy = "async"
    flush_interval_ms: int = 500
    flush_least_pages: int = 4  # async: flush a file once this many 4 KiB pages are unflushed
    flush_thorough_interval_ms: int = 10_000  # flush everything and write a checkpoint
    max_message_size: int = 4 * MiB
    max_properties_size: int = 32 * 1024
    retention: dt.timedelta | None = None
    max_store_bytes: int | None = None
    retention_respects_consumers: bool = False
    max_open_chunks: int = 8
    # Descriptors the store may hold (queuecache.py): the log's, the key index's and, for
    # the rest, the queues' (3 per open queue). 256 leaves 768 of the common default
    # `ulimit -n` of 1,024 to the application (a broker's connections) and keeps 79
    # queues open; more queues than that are closed and reopened, least recently used
    # first. A round robin over more queues than stay open pays a reopen per send.
    max_open_files: int = 256
    key_index_batch: int = 10_000  # keys buffered before one index transaction
    alloc_step: int = 4 * MiB

    @property
    def layout(self) -> Layout:
        """The chunk sizes as ints (``store.config``'s are those of the store)."""
        return Layout(
            DEFAULT_CHUNK_DATA_SIZE if self.chunk_data_size is None else self.chunk_data_size,
            DEFAULT_QUEUE_CHUNK_RECORDS
            if self.queue_chunk_records is None
            else self.queue_chunk_records,
        )

    def __post_init__(self) -> None:
        if self.chunk_data_size is not None:
            check_int(
                "chunk_data_size", self.chunk_data_size, MIN_CHUNK_DATA_SIZE, MAX_CHUNK_DATA_SIZE
            )
        if self.queue_chunk_records is not None:
            check_int(
                "queue_chunk_records",
                self.queue_chunk_records,
                -(-MIN_CHUNK_DATA_SIZE // QUEUE_RECORD_SIZE),  # rounded up: chunks >= the minimum
                MAX_CHUNK_DATA_SIZE // QUEUE_RECORD_SIZE,
            )
        check_int("default_queue_count", self.default_queue_count, 1, MAX_QUEUES)
        check_int("flush_interval_ms", self.flush_interval_ms, 1, 3_600_000)
        check_int("flush_least_pages", self.flush_least_pages, 0, 1 << 20)
        check_int("flush_thorough_interval_ms", self.flush_thorough_interval_ms, 1, 3_600_000)
        check_int("max_message_size", self.max_message_size, 1, 1 << 30)
        check_int("max_properties_size", self.max_properties_size, 0, 1 << 20)
        check_int("max_open_chunks", self.max_open_chunks, 1, 1 << 16)
        check_int("key_index_batch", self.key_index_batch, 1, 1 << 24)
        check_int("max_open_files", self.max_open_files, 1, 1 << 20)
        if self.max_open_files < min_open_files(self.max_open_chunks):
            raise ConfigError(
                f"max_open_files={self.max_open_files}; it must be at least "
                f"{min_open_files(self.max_open_chunks)}: the log's "
                f"{log_files(self.max_open_chunks)} (max_open_chunks + 2), {STORE_FILES} for "
                f"the store's other files and {MIN_OPEN_QUEUES} open queues of {FILES_PER_QUEUE}"
            )
        check_int("alloc_step", self.alloc_step, 0, MAX_CHUNK_DATA_SIZE)
        if self.flush not in ("sync", "async", "os"):
            raise ConfigError(f"flush={self.flush!r}; it must be 'sync', 'async' or 'os'")
        for name in ("auto_create_topics", "retention_respects_consumers"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.retention is not None:
            check_span("StoreConfig.retention", self.retention)
        if self.max_store_bytes is not None:
            check_int("max_store_bytes", self.max_store_bytes, 1, 1 << 62)
        if self.max_topics is not None:
            check_int("max_topics", self.max_topics, 1, 1 << 24)


# Descriptors the store holds besides the log's chunks and its queues: the lock file, the
# live tail, the key index (its database and journal), and the short-lived ones of a
# metadata write (the file and its directory, for fsync).
STORE_FILES = 8
MIN_OPEN_QUEUES = 4  # a send_batch over a topic of 4 queues keeps them all open


def log_files(max_open_chunks: int) -> int:
    """The log's descriptors at most: its mapped chunks, the ongoing one's descriptor and
    mapping."""
    return max_open_chunks + 2


def min_open_files(max_open_chunks: int) -> int:
    return log_files(max_open_chunks) + STORE_FILES + MIN_OPEN_QUEUES * FILES_PER_QUEUE


def open_queue_limit(config: StoreConfig) -> int:
    """How many queues may be open at once under ``max_open_files``."""
    spare = config.max_open_files - log_files(config.max_open_chunks) - STORE_FILES
    return max(MIN_OPEN_QUEUES, spare // FILES_PER_QUEUE)
