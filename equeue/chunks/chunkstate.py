"""What a Chunk knows of its file in memory (its fields, set in one place) and its
identity. The base of the Chunk's parts (mapping.py, appends.py, completion.py,
reads.py, chunk.py): each part's methods read these fields, and mypy checks them
against this one __init__. No field may become a class attribute: the C Sender reads
``_mm``, ``data_end``, ``writable_end``, ``record_count``, ``_prefault_mark`` and
``base`` from the instance dict only while no class in the MRO defines them
(equeue/cext/sendstate.c, seen_fill)."""

from __future__ import annotations

import itertools
import mmap
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from equeue.chunks.prefault import WINDOW
from equeue.chunks.runninghash import RunningHash
from equeue.errors import StoreWriteError
from equeue.format.chunk import (
    FOOTER_SIZE,
    HEADER_SIZE,
    MAP_ENTRY_SIZE,
    ChunkFooter,
    ChunkHeader,
    chunk_file_size,
)

if TYPE_CHECKING:
    from equeue.chunks.chunk import Chunk

_PAGE = mmap.PAGESIZE
# The window of chunks of fixed-size records. Not smaller: without the C accelerator
# each prefault request costs the writer two GIL hand-offs (prefault.py). Allocated in
# steps, their window is a step (32 KiB for a queue): a request per 2,730 entries.
_FIXED_WINDOW = 256 << 10
# A chunk's first allocation step (ChunkManagerConfig.alloc_step); each later one is as
# large as the chunk's data so far, up to alloc_step: few fallocate calls, little slack.
_MIN_STEP = 64 << 10
_ticks = itertools.count(1)  # recency for the LRU of read maps; next() is atomic in CPython


class ChunkState:
    """The fields of a Chunk (chunk.py) and its identity.

    ``data_end`` is the committed end of the data area: readers never look past
    it, and the writer raises it only after a record's bytes are in place.
    """

    def __init__(
        self,
        path: Path,
        header: ChunkHeader,
        footer: ChunkFooter | None,
        *,
        version: int,
        data_end: int,
        record_count: int,
        max_record_size: int,
        on_map: Callable[[Chunk], None],
        alloc_step: int = 0,
    ) -> None:
        # 30 fields: CPython 3.11's most for an instance's inline values. A 31st slows every
        # attribute read on a chunk (callgrind: 500 instructions a loop iteration reading two
        # at 30 fields, 824 at 32); keep new state beside the class (completion.py's names).
        self.path = path
        self.header = header
        # Plain attributes for the hot paths (the header's are properties).
        self.base = header.start_position
        self.data_size = header.chunk_data_size
        self.footer = footer
        self.version = version
        self.data_end = data_end
        self.flushed_end = data_end
        # Up to where this chunk is known durable: an fdatasync of this process covered it,
        # or (the ongoing chunk at open) a checkpoint's tail hint said so. Not flushed_end,
        # which at open also covers what recovery found in the page cache.
        self.synced_end = data_end
        self.record_count = record_count
        # The data offset up to which the file's blocks are allocated, for the writer:
        # every write stays below it, and reserve() moves it before a write would not.
        self.writable_end = data_end
        self._alloc_step = alloc_step  # 0: the whole chunk at once
        self.last_used = 0
        self.scan_problem: str | None = None  # why recovery's scan stopped, if not at a clean end
        self.map_checked = False  # a compacted chunk's position map, before its first lookup
        self._max_record_size = max_record_size
        self._on_map = on_map
        self._mm: mmap.mmap | None = None
        self._writable = False
        # The writable chunk keeps its file open to fdatasync it: unlike mmap.flush
        # (msync), os.fdatasync lets other threads run, which group commit relies on.
        self._fd = -1
        self._flush_lock = threading.Lock()  # one fdatasync at a time; close waits for it
        # After a failed fdatasync: the data offset from which nothing was known durable,
        # the OS's reason, and the error raised; no later flush can vouch for that data.
        self._failed: tuple[int, str, StoreWriteError] | None = None
        self._address = 0  # of the writable mapping, for the prefaulter
        self._prefault_mark = 1 << 62  # data offset past which to prefault the next window
        self._hashed: RunningHash | None = None  # the footer's checksum as the writer goes
        # The writer's manager keeps this file until it removes the chunk itself
        # (retention, a compaction's replacement): a file gone meanwhile is damage, not
        # a removal. A read-only view's chunk (in_view) is judged from the directory
        # (missing.py): the writer removes files under it, oldest first or replaced.
        self.kept = False
        self.in_view = False
        # Queue chunks hold 12-byte entries: a log-sized window would keep a MiB or two of
        # each resident for a few hundred KiB of entries a second.
        self._window = WINDOW if not header.record_size else _FIXED_WINDOW
        if header.record_size and alloc_step:
            # Faulted in no further than a step ahead: the queue's slack on disk stays a step.
            self._window = min(_FIXED_WINDOW, max(_round_page(alloc_step), 2 * _PAGE))
        # Called under the write lock each time the writer passes a half window (the
        # store's LiveTailWriter.advance, for the log's chunks).
        self.on_advance: Callable[[Chunk], None] | None = None
        # Called when an fdatasync of this chunk fails (the store's LiveTailWriter.invalidate).
        self.on_sync_failure: Callable[[], None] | None = None

    def __repr__(self) -> str:
        state = "ongoing" if self.footer is None else "completed"
        return f"<Chunk {self.path.name} {state} data_end={self.data_end}>"

    # --- identity ------------------------------------------------------------

    @property
    def start_number(self) -> int:
        return self.header.chunk_start_number

    @property
    def end_number(self) -> int:
        return self.header.chunk_end_number

    @property
    def start_position(self) -> int:
        return self.header.start_position

    @property
    def end_position(self) -> int:
        return self.header.end_position

    @property
    def is_completed(self) -> bool:
        return self.footer is not None

    @property
    def file_size(self) -> int:
        if self.header.compacted and self.footer is not None:
            map_bytes = self.footer.map_entry_count * MAP_ENTRY_SIZE
            return HEADER_SIZE + self.footer.physical_data_size + map_bytes + FOOTER_SIZE
        return chunk_file_size(self.header.chunk_data_size)


def _round_page(n: int) -> int:
    return -(-n // _PAGE) * _PAGE
