"""The in-memory list of one directory's chunks: the manager's fields, lookups by
number and position, the open/writable checks and the LRU of read maps. The base of
the manager's parts (opening.py, refresh.py, removal.py, manager.py), which change
the list; this module only reads it and adds to it."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from equeue.chunks.ahead import AheadFile
from equeue.chunks.chunk import Chunk
from equeue.chunks.config import ChunkManagerConfig
from equeue.chunks.recovery import TailCut, TailHint
from equeue.errors import ChunkRemovedError, ClosedError, PositionNotFoundError, ReadOnlyError

if TYPE_CHECKING:
    from equeue.chunks.writer import ChunkWriter


class ChunkSet:
    """The fields of a ChunkManager (manager.py) and its lookups."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        config: ChunkManagerConfig | None = None,
        *,
        read_only: bool = False,
        tail_hint: TailHint | None = None,
        live_hint: TailHint | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.config = config or ChunkManagerConfig()
        self.read_only = read_only
        self._tail_hint = tail_hint  # where the scan of the ongoing chunk may start (_load)
        self._live_hint = live_hint  # the same, from this boot's page cache
        # The log position where that scan started, if a hint was taken: the records
        # before it were not walked at open.
        self.scan_started_at: int | None = None
        self.started_at_live_hint = False
        self.synced_hint: TailHint | None = None  # the checkpoint's hint, if it was valid
        # Passed to each chunk opened for writing (Chunk.on_advance), and to every chunk
        # (Chunk.on_sync_failure).
        self.on_advance: Callable[[Chunk], None] | None = None
        self.on_sync_failure: Callable[[], None] | None = None
        self.recovery_cuts: list[TailCut] = []
        self.recovery_problems: list[str] = []  # what recovery found that it could not cut
        self._chunks: list[Chunk] = []  # ordered by start number, contiguous
        self._by_number: dict[int, Chunk] = {}  # a merged chunk fills every number it covers
        # Read-only: the last chunk number the view dropped as removed by retention
        # (refresh.py _forget_removed), so that a lookup of it is ChunkRemovedError even
        # when the view holds no chunk at that moment (-1: none dropped)
        self._removed_through = -1
        self._lock = threading.RLock()
        self._writer: ChunkWriter | None = None
        self._closed = False
        # The next chunk's file made ahead by the chunk maker (ahead.py; make_ahead), and
        # whether a job making one is queued or running; under _ahead_cond, taken after
        # _lock if both are (the maker thread takes it alone).
        self._ahead: AheadFile | None = None
        self._ahead_busy = False
        # The process whose maker thread runs that job (and made that file): a child
        # forked meanwhile has no such thread, and the job and the file stay the parent's.
        self._ahead_pid = os.getpid()
        self._ahead_closed = False
        self._ahead_cond = threading.Condition(threading.Lock())
        # Nothing is made ahead, and a crash's made-ahead files (_leftovers, listed by a
        # writable open) stay, until the owner says its open succeeded (start_making_ahead)
        # or the first roll-over.
        self._ahead_started = False
        self._leftovers: list[Path] = []
        self.looked_at = 0.0  # read-only: when a pull last looked for removed chunks
        self._load()

    if TYPE_CHECKING:

        def _load(self) -> None: ...  # ChunkOpening's (opening.py)

    # --- lookups -------------------------------------------------------------

    def __iter__(self) -> Iterator[Chunk]:
        return iter(list(self._chunks))

    def __len__(self) -> int:
        return len(self._chunks)

    @property
    def first_chunk(self) -> Chunk | None:
        chunks = self._chunks
        return chunks[0] if chunks else None

    @property
    def last_chunk(self) -> Chunk | None:
        chunks = self._chunks
        return chunks[-1] if chunks else None

    @property
    def committed_position(self) -> int:
        """Global position just past the last committed record (0 for an empty directory)."""
        last = self.last_chunk
        if last is None:
            return 0
        if last.is_completed:
            return last.end_position
        return last.start_position + last.data_end

    @property
    def first_position(self) -> int:
        first = self.first_chunk
        return first.start_position if first is not None else 0

    def get_chunk(self, number: int) -> Chunk:
        chunk = self._by_number.get(number)
        if chunk is not None:
            return chunk
        self._check_open()
        first = self.first_chunk
        if number <= self._removed_through or (first is not None and number < first.start_number):
            raise ChunkRemovedError(
                f"chunk {number} lies before the first chunk "
                f"{first.start_number if first is not None else self._removed_through + 1} "
                f"in {self.directory}: removed by retention"
            )
        raise PositionNotFoundError(f"no chunk {number} in {self.directory}")

    def get_chunk_for(self, position: int) -> Chunk:
        if position < 0:
            raise PositionNotFoundError(f"position {position} is negative")
        return self.get_chunk(position // self.config.chunk_data_size)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"chunk manager for {self.directory} is closed")

    def _check_writable(self) -> None:
        self._check_open()
        if self.read_only:
            raise ReadOnlyError(f"chunk manager for {self.directory} was opened read-only")

    def _install(self, chunk: Chunk) -> None:
        chunk.on_sync_failure = self.on_sync_failure
        chunk.kept = not self.read_only
        # A view judges a missing log chunk (missing.py), not a queue's: a topic's deletion
        # removes a queue's files in no order, which the directory cannot tell from damage.
        chunk.in_view = self.read_only and not self.config.record_size
        self._chunks.append(chunk)
        for n in range(chunk.start_number, chunk.end_number + 1):
            self._by_number[n] = chunk

    def _mapped(self, chunk: Chunk) -> None:
        """A completed chunk opened its map: close the least recently used beyond the limit."""
        with self._lock:
            mapped = [c for c in self._chunks if c.is_mapped and c.is_completed]
            excess = len(mapped) - self.config.max_open_chunks
            if excess > 0:
                mapped.sort(key=lambda c: c.last_used)
                for victim in mapped[:excess]:
                    if victim is not chunk:
                        victim.release_mapping()
