"""One queue of a topic: a chunk directory of 12-byte QueueLogRecords."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from equeue.chunks import ChunkManager, ChunkManagerConfig, ChunkWriter
from equeue.chunks.chunk import Chunk
from equeue.chunks.identity import check_same_files
from equeue.chunks.recovery import TailCut
from equeue.errors import ChunkRemovedError, ClosedError, PositionNotFoundError
from equeue.format.chunk import HEADER_SIZE, ChunkHeader
from equeue.format.message import QUEUE_RECORD, QUEUE_RECORD_SIZE
from equeue.safepath import check_dir
from equeue.store.queuecache import QueueFiles
from equeue.store.queuecache import ticks as _ticks

_unpack = QUEUE_RECORD.unpack_from
# A queue chunk's disk is allocated this far ahead of its entries (2,730 of them): with
# its header and footer blocks, under 64 KiB of slack per queue written to.
QUEUE_ALLOC_STEP = 32 << 10
_pack = QUEUE_RECORD.pack


class Queue:
    """Offsets are dense: offset q is the q-th message sent to this queue.

    Its files are opened on first use and may be closed again by the store's cache of
    open queues (``QueueFiles``: queuecache.py); ``first_offset`` and ``next_offset``
    stay in memory, so an idle queue holds no file and no ChunkManager."""

    __slots__ = (
        "__weakref__",
        "_alloc_step",
        "_expected",
        "_files",
        "_manager",
        "_max_open_chunks",
        "_read_only",
        "_records",
        "_seen",
        "_writer",
        "checked",
        "closed",
        "directory",
        "first_offset",
        "last_used",
        "next_offset",
        "queue_id",
        "rebuilt",
        "topic",
    )  # fmt: skip

    def __init__(
        self,
        directory: Path,
        topic: str,
        queue_id: int,
        records_per_chunk: int,
        *,
        max_open_chunks: int,
        read_only: bool = False,
        alloc_step: int = QUEUE_ALLOC_STEP,
        files: QueueFiles | None = None,
        ends: tuple[int, int] | None = None,
    ) -> None:
        self.topic = topic
        self.queue_id = queue_id
        self.directory = directory
        self.closed = False
        self.rebuilt = False  # its chunks were set aside at open: re-dispatch rebuilds it
        self.last_used = 0
        self.checked = False  # opened once in this process (QueueFiles.open's checks done)
        self._files = files if files is not None else QueueFiles(None, 0)
        self._records = records_per_chunk
        self._max_open_chunks = max_open_chunks
        self._read_only = read_only
        self._alloc_step = alloc_step
        self._manager: ChunkManager | None = None
        self._writer: ChunkWriter | None = None
        # A read-only queue's last chunk when its files were last closed: opened again,
        # they must be the same files (identity.check_same_files), not a topic's made
        # again under its name.
        self._seen: ChunkHeader | None = None
        # Where the queue is known to start and end without its files (the checkpoint of
        # a clean store, or a queue just created): the first open checks its files
        # against it (QueueFiles.check_ends). None: known once the files are opened.
        self._expected = ends
        self.first_offset, self.next_offset = ends or (0, 0)
        if ends is None:
            self.manager  # noqa: B018 (opened now: its ends come from its files)

    @property
    def is_open(self) -> bool:
        return self._manager is not None

    @property
    def deferred(self) -> bool:
        """Not opened since its ends were known: its files are checked against them when
        it is (QueueFiles._check_ends), not by the store's open."""
        return self._manager is None and self._expected is not None

    @property
    def manager(self) -> ChunkManager:
        """The queue's chunks, opened (through the store's cache of open queues) if the
        queue's files are closed."""
        manager = self._manager
        if manager is None:
            manager = self._files.open(self)
        self.last_used = next(_ticks)
        return manager

    def load(self) -> ChunkManager:
        """QueueFiles.open, with its lock held: the ChunkManager of the queue's files."""
        if self.closed:
            raise ClosedError(f"queue {self.topic}/{self.queue_id} in {self.directory} is closed")
        check_dir(self.directory.parent)  # the topic's: ChunkManager would create under a link
        manager = ChunkManager(
            self.directory,
            ChunkManagerConfig(
                chunk_data_size=self._records * QUEUE_RECORD_SIZE,
                record_size=QUEUE_RECORD_SIZE,
                max_open_chunks=self._max_open_chunks,
                alloc_step=min(self._alloc_step, QUEUE_ALLOC_STEP),  # 0: whole chunks
            ),
            read_only=self._read_only,
        )
        if self._seen is not None:
            try:
                check_same_files(manager, self._seen, self.directory)
            except BaseException:
                manager.close()
                raise
        manager.before_create = self._files.before_create
        self._manager = manager
        if self._expected is None:
            self.first_offset = max(self.first_offset, manager.first_position // QUEUE_RECORD_SIZE)
            # A plain attribute, raised only after an entry is in place, so readers may use it.
            self.next_offset = manager.committed_position // QUEUE_RECORD_SIZE
        return manager

    def release(self, unsynced: Callable[[str], None] | None = None) -> bool:
        """QueueFiles, with its lock (the store's write lock) held: close the queue's files.
        Mappings a reader still holds stay valid until it drops them. True if entries
        written since the last flush are not known durable: their file goes to
        ``unsynced`` (the cache syncs it later) before the close, so that a checkpoint's
        flush that finds the file closed (``Chunk.flush`` skips it) finds it there."""
        manager, self._manager, self._writer = self._manager, None, None
        # A writer's queue changes only through this handle; a read-only one reads its
        # files again when reopened (the writer appended since).
        self._expected = None if self._read_only else (self.first_offset, self.next_offset)
        if manager is None:
            return False
        last = manager.last_chunk
        if self._read_only and last is not None:
            self._seen = last.header
        dirty = last is not None and not last.is_completed and last.flushed_end < last.data_end
        if dirty and unsynced is not None and last is not None:
            unsynced(str(last.path))
        manager.release_files()
        return dirty

    @property
    def writer(self) -> ChunkWriter:
        if self._writer is None:
            manager = self.manager  # (an open that rebuilds the queue makes the writer)
            if self._writer is None:
                self._writer = ChunkWriter(manager)
        return self._writer

    def append(self, message_position: int, tag_hash: int) -> int:
        """Add an entry; the caller holds the store's write lock. Returns its offset."""
        offset = self.next_offset
        self.writer.unlocked_write(_pack(message_position + 1, tag_hash))
        self.next_offset = offset + 1
        return offset

    def current_chunk(self) -> Chunk | None:
        """The chunk the next entry goes to, if it has room for one; the writer's."""
        chunk = self._writer._chunk if self._writer is not None else None
        if chunk is None or chunk.data_end + QUEUE_RECORD_SIZE > chunk.data_size:
            return None
        return chunk

    def advance(self, count: int) -> None:
        """Publish ``count`` entries written past the current chunk's end (batch appends)."""
        chunk = self.writer._chunk
        assert chunk is not None, "entries were written to the current chunk"
        chunk.publish(chunk.data_end + count * QUEUE_RECORD_SIZE, count)
        self.next_offset += count

    def entry_location(self, offset: int) -> tuple[str, int]:
        """(queue chunk file, file offset) of the entry at ``offset``, for error messages."""
        chunk = self.manager.get_chunk_for(offset * QUEUE_RECORD_SIZE)
        return str(chunk.path), HEADER_SIZE + offset * QUEUE_RECORD_SIZE - chunk.base

    def make_room(self) -> None:
        """Under the write lock, before the message record is written: make sure the
        entry has a slot, creating the next queue chunk now if need be. A chunk that
        cannot be created (disk full) then fails the send before anything is written."""
        writer = self.writer
        chunk = writer._chunk
        if chunk is None or chunk.data_end + QUEUE_RECORD_SIZE > chunk.data_size:
            writer.complete()
            chunk = writer.add_new_chunk()
        if chunk.data_end + QUEUE_RECORD_SIZE > chunk.writable_end:
            chunk.reserve(chunk.data_end + QUEUE_RECORD_SIZE)  # its disk blocks, the same way

    def free_slots(self) -> int:
        """Entries the current queue chunk still has room for (0 if there is none yet)."""
        chunk = self._writer._chunk if self._writer is not None else None
        if chunk is None:
            return 0
        return (chunk.writable_end - chunk.data_end) // QUEUE_RECORD_SIZE

    def refresh(self) -> None:
        """Read-only: see the entries the writer appended since."""
        manager = self.manager
        manager.refresh()
        self.first_offset = max(self.first_offset, manager.first_position // QUEUE_RECORD_SIZE)
        self.next_offset = manager.committed_position // QUEUE_RECORD_SIZE

    def entry(self, offset: int) -> tuple[int, int]:
        """(message position, tag hash) at ``offset``."""
        if not self.first_offset <= offset < self.next_offset:
            raise PositionNotFoundError(
                f"offset {offset} is outside queue {self.topic}/{self.queue_id} "
                f"[{self.first_offset}, {self.next_offset})"
            )
        chunk = self.manager.get_chunk_for(offset * QUEUE_RECORD_SIZE)
        mm = chunk.mapping()
        stored, tag = _unpack(mm, HEADER_SIZE + offset * QUEUE_RECORD_SIZE - chunk.base)
        return stored - 1, tag

    def entries(self, offset: int, count: int) -> list[tuple[int, int]]:
        """Up to ``count`` consecutive (message position, tag hash) from ``offset`` on."""
        result: list[tuple[int, int]] = []
        end = min(self.next_offset, offset + count)
        while offset < end:
            try:
                chunk = self.manager.get_chunk_for(offset * QUEUE_RECORD_SIZE)
            except ChunkRemovedError:
                offset = self.first_offset
                continue
            mm = chunk.mapping()
            start = HEADER_SIZE + offset * QUEUE_RECORD_SIZE - chunk.base
            stop_offset = min(end, (chunk.base + chunk.data_end) // QUEUE_RECORD_SIZE)
            if stop_offset <= offset:
                break
            block = mm[start : start + (stop_offset - offset) * QUEUE_RECORD_SIZE]
            result.extend((stored - 1, tag) for stored, tag in QUEUE_RECORD.iter_unpack(block))
            chunk.release_behind(start - HEADER_SIZE, start - HEADER_SIZE + len(block))
            offset = stop_offset
        return result

    def first_offset_at_or_after(
        self, message_position: int, lo: int | None = None, hi: int | None = None
    ) -> int:
        """The first offset (in [``lo``, ``hi``): the queue's by default) whose message
        position is >= ``message_position`` (binary search), ``hi`` if none is.

        A damaged entry (a negative position) is no evidence either way: when the search
        meets one, the range is scanned instead, skipping such entries, so one bad entry
        cannot move the answer past the good entries before it."""
        lo = self.first_offset if lo is None else lo
        hi = self.next_offset if hi is None else hi
        start, stop = lo, hi
        while lo < hi:
            mid = (lo + hi) // 2
            position = self.entry(mid)[0]
            if position < 0:
                return self._first_offset_by_scan(message_position, start, stop)
            if position < message_position:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def _first_offset_by_scan(self, message_position: int, offset: int, stop: int) -> int:
        while offset < stop:
            block = self.entries(offset, min(4096, stop - offset))
            if not block:
                break
            for i, (position, _) in enumerate(block):
                if position >= message_position:
                    return offset + i
            offset += len(block)
        return stop

    def cut_from(self, offset: int) -> list[TailCut]:
        """Recovery: remove the entries at and after ``offset`` (copied to side files)."""
        cuts = self.manager.truncate_after(offset * QUEUE_RECORD_SIZE)
        self.next_offset = self.manager.committed_position // QUEUE_RECORD_SIZE
        return cuts

    def remove_chunks_below(self, message_position: int | None) -> int:
        """Retention: drop completed queue chunks whose entries all point below
        ``message_position``, or, with None, those wholly below ``first_offset`` (of an
        open queue only: retention's every turn must not open every queue)."""
        if message_position is None and self._manager is None:
            return 0
        removed = 0
        for chunk in list(self.manager)[:-1]:
            last_offset = (chunk.base + chunk.data_end) // QUEUE_RECORD_SIZE - 1
            if last_offset < 0:
                break
            # Below first_offset, every entry points at a removed message (the entries
            # there are out of entry()'s range): so after a crash between the removal
            # of the log chunks and of these, once the open moved first_offset past them.
            if last_offset >= self.first_offset and (
                message_position is None or self.entry(last_offset)[0] >= message_position
            ):
                break
            removed += len(self.manager.remove_chunks_before(chunk.end_number + 1))
        self.first_offset = max(self.first_offset, self.manager.first_position // QUEUE_RECORD_SIZE)
        return removed

    def flush(self, least_bytes: int = 0) -> None:
        """Flush this queue's entries if at least ``least_bytes`` are unflushed."""
        if self._writer is not None:
            self._writer.flush(least_bytes)

    def close(self) -> None:
        self.closed = True  # (a send that waited for the lock checks it: delete_topic)
        self._files.forget(self)
        manager, self._manager = self._manager, None
        if manager is not None:
            manager.close()
