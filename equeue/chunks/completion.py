"""Making a chunk durable: flush (fdatasync, one at a time, and why after one failure
no later flush is claimed) and completion (the checksum, the footer, the blocks
allocated ahead given back). Apart from the appends: these run beside the writer (the
flusher thread, group commit) or once per chunk, never per record."""

from __future__ import annotations

import os
import threading

from equeue.chunks.chunkstate import _PAGE, _round_page
from equeue.chunks.fileops import fsync_directory, write_error
from equeue.chunks.footer import footer_timestamps
from equeue.chunks.mapping import ChunkMapping
from equeue.chunks.prefault import PREFAULTER
from equeue.chunks.runninghash import chunk_checksum
from equeue.chunks.space import allocate as _allocate  # (patched by tests, by that name)
from equeue.chunks.space import punch_hole
from equeue.errors import StoreWriteError, location
from equeue.format.chunk import FOOTER_SIZE, HEADER_SIZE, ChunkFooter

# The chunks installed from a file made ahead (ahead.py) whose new name's directory fsync
# has not run yet: the first fdatasync that vouches for a chunk's data does it first
# (make_name_durable), or finds the chunk maker's done. Not a field of the chunk: a Chunk
# has 30 attributes, CPython 3.11's most for an instance's inline values; past them every
# attribute read on a chunk costs more (callgrind, a loop reading two of them: 500
# instructions an iteration at 30 attributes, 824 at 32).
_NAMES_PENDING: set[ChunkCompletion] = set()
_NAMES_LOCK = threading.Lock()  # one directory fsync at a time: once per roll-over


class ChunkCompletion(ChunkMapping):
    @property
    def unflushed_bytes(self) -> int:
        return self.data_end - self.flushed_end

    def flush(self, *, settle: bool = False) -> None:
        """Make everything up to ``data_end`` durable.

        Safe beside the writing thread: it flushes at least what was committed
        when it was called. Several callers queue on one fdatasync at a time,
        and a caller whose data a previous fdatasync covered returns at once.
        ``settle`` also syncs what recovery found at open and counted as flushed
        (past ``synced_end``): not on the open's path, where it would write back
        every dirty page a crashed writer left, but soon after.
        """
        end = self.data_end
        if end <= (self.synced_end if settle else self.flushed_end):
            return
        with self._flush_lock:
            if end <= (self.synced_end if settle else self.flushed_end) or self._fd < 0:
                return
            end = self.data_end  # everything committed by now is covered too
            self._fdatasync("flushing a chunk")
            self.flushed_end = self.synced_end = end
        self._release(end)  # now flushed: a window behind it may go

    def _fdatasync(self, what: str) -> None:
        """fdatasync, under ``_flush_lock``; after one failure, every later call fails.

        After a failed fdatasync Linux may mark the pages clean without having written
        them, drop them, or (ext4, in a preallocated file like every chunk) leave their
        blocks unwritten, so that a later write of the same bytes and an fdatasync that
        succeeds still read back zeros once the page cache is dropped (a review showed it
        on a real failing ext4; docs/durability.md). No later flush of this
        chunk can vouch for the range, so none is claimed: the store is to be reopened,
        and recovery verifies every record written since the last checkpoint (no later
        one can be written) and cuts at the first damaged one. PostgreSQL
        made the same choice after "fsyncgate"."""
        if self._failed is not None:
            start, reason, failure = self._failed
            # The same class and errno: a full disk stays a DiskFullError.
            raise type(failure)(
                failure.errno,
                f"{what} refused for {self.path}: an earlier fdatasync of it failed "
                f"({reason}) with the data from offset {start:#x} on (or its footer) not "
                "yet durable, and no later flush can make them durable; close and reopen "
                "the store (recovery verifies every record written since the last checkpoint "
                "and cuts at the first damaged one)",
            )
        try:
            if _NAMES_PENDING and self in _NAMES_PENDING:
                self.make_name_durable()
            os.fdatasync(self._fd)
        except OSError as exc:
            failure = write_error(exc, what, self.path)
            self._failed = (self.flushed_end, exc.strerror or str(exc), failure)
            if self.on_sync_failure is not None:
                self.on_sync_failure()
            raise failure from exc

    def make_name_durable(self) -> None:
        """The fsync of the directory after a file made ahead was renamed to this chunk's
        name (ahead.py): before it, a power loss may take the name, and every record in
        the file with it. Raises the OSError; a caller vouching for data treats it as a
        failed fdatasync of the chunk."""
        if self not in _NAMES_PENDING:
            return
        with _NAMES_LOCK:  # the chunk maker's and a flush's: one fsync, the other waits
            if self in _NAMES_PENDING:
                fsync_directory(self.path.parent)
                _NAMES_PENDING.discard(self)

    @property
    def name_pending(self) -> bool:
        """Renamed from a file made ahead, its directory not yet fsynced."""
        return bool(_NAMES_PENDING) and self in _NAMES_PENDING

    def _name_renamed(self, pending: bool) -> None:
        """Whether the chunk's name awaits its directory's fsync (ahead.py's install;
        False: the chunk is closed, and nothing more of it is claimed durable)."""
        if pending:
            _NAMES_PENDING.add(self)
        else:
            _NAMES_PENDING.discard(self)

    def complete(self) -> ChunkFooter:
        """Flush the data, then write and flush the footer; the chunk is immutable after."""
        if self.footer is not None:
            return self.footer
        mm = self._mm
        assert mm is not None and self._writable, "complete() on a chunk not open for writing"
        self.flush()
        checksum = chunk_checksum(
            self._hashed,
            mm,
            HEADER_SIZE + self.data_end,
            self._window,
            lambda at: self._release(at - HEADER_SIZE),
        )
        first, last = footer_timestamps(mm, self.header, self.data_end, self.record_count)
        footer = ChunkFooter(
            completed=True,
            physical_data_size=self.data_end,
            logical_data_size=self.data_end,
            map_entry_count=0,
            record_count=self.record_count,
            first_timestamp=first,
            last_timestamp=last,
            checksum=checksum,
        )
        at = len(mm) - FOOTER_SIZE
        try:  # the footer's block (a hole until now), so writing it cannot meet a full disk
            _allocate(self._fd, at, FOOTER_SIZE)
        except OSError as exc:
            what = f"allocating the footer {location(None, at)}"
            raise write_error(exc, what, self.path) from exc
        mm[at:] = footer.pack()
        with self._flush_lock:
            try:
                self._fdatasync("writing a chunk footer")
            except StoreWriteError:
                mm[at:] = bytes(FOOTER_SIZE)
                raise
        self.synced_end = self.data_end
        self.footer = footer
        if self._alloc_step:
            # The blocks allocated ahead of the data are not needed any more (space.py);
            # first the prefaulter lets go, so it cannot fault the hole back in.
            if self._address:
                PREFAULTER.forget(self._address)
            start = _round_page(HEADER_SIZE + self.data_end)
            punch_hole(self._fd, start, (at // _PAGE * _PAGE) - start)
        return footer
