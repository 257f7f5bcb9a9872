"""ChunkManager: the chunk files of one directory, loaded, recovered and looked up by position."""

from __future__ import annotations

import itertools
import logging
import mmap
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Final

from equeue.chunks.chunk import Chunk, fsync_directory, write_error
from equeue.chunks.config import ChunkManagerConfig
from equeue.chunks.footer import read_footer
from equeue.chunks.recovery import (
    TailCut,
    TailHint,
    cut_range,
    frame_ends_at,
    make_side_dir,
    names_chunk,
    scan_fixed,
    scan_variable,
)
from equeue.errors import (
    ChunkRemovedError,
    ClosedError,
    ConfigError,
    CorruptionError,
    MissingChunkError,
    PositionNotFoundError,
    ReadOnlyError,
    WriterExistsError,
    location,
)
from equeue.format.chunk import (
    FOOTER_SIZE,
    FRAME_OVERHEAD,
    HEADER_SIZE,
    RECOVERED_DIR,
    TEMP_SUFFIX,
    ChunkHeader,
    chunk_file_size,
    parse_chunk_file_name,
)
from equeue.safepath import check_chunk_dir, check_dir, ensure_dir, open_fd, open_file

if TYPE_CHECKING:
    from equeue.chunks.writer import ChunkWriter

log = logging.getLogger("equeue.chunks")


# How often a read-only open lists a chunk directory again when a listed file vanished.
_LIST_ATTEMPTS: Final = 8


class ChunkManager:
    """The chunks of one directory, in number order, with at most
    ``config.max_open_chunks`` completed chunks mapped at once.

    Opening loads every chunk header, checks each completed chunk's footer,
    scans the last chunk for its valid end and cuts any torn tail (copied to
    ``recovered/`` first; see ``recovery_cuts``). A read-only manager changes
    nothing on disk and can ``refresh()`` to see what a writer added since.
    """

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
        self._lock = threading.RLock()
        self._writer: ChunkWriter | None = None
        self._closed = False
        self.looked_at = 0.0  # read-only: when a pull last looked for removed chunks
        self._load()

    # --- context manager -----------------------------------------------------

    def __enter__(self) -> ChunkManager:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                if self._chunks and not self.read_only:
                    self._chunks[-1].flush()
            finally:  # a failed flush is raised, but the files are released all the same
                for chunk in self._chunks:
                    chunk.kept = chunk.in_view = False  # a pull holding it may see a removal
                    chunk.close()
                self._closed = True
                if self._writer is not None:
                    # Detach the writer from the now-unmapped chunk, so its next write
                    # takes the slow path and raises ClosedError.
                    self._writer._chunk = None

    def release_files(self) -> None:
        """Let go of every chunk's file descriptor and mapping, unflushed, for a cache of
        open directories that opens this one again later: a reader that holds a mapping
        keeps it valid until it drops it (nothing is unmapped here), and a chunk mapped
        again by such a reader belongs to it alone. The manager is not used again."""
        with self._lock:
            for chunk in self._chunks:
                chunk._on_map = _ignore_map  # no reference back: the manager can be freed
                chunk.kept = chunk.in_view = False  # the next manager says what it removes
                chunk.release_mapping()
            if self._writer is not None:
                self._writer._chunk = None
                self._writer = None
            self._closed = True

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
        if first is not None and number < first.start_number:
            raise ChunkRemovedError(
                f"chunk {number} lies before the first chunk {first.start_number} in "
                f"{self.directory}: removed by retention"
            )
        raise PositionNotFoundError(f"no chunk {number} in {self.directory}")

    def get_chunk_for(self, position: int) -> Chunk:
        if position < 0:
            raise PositionNotFoundError(f"position {position} is negative")
        return self.get_chunk(position // self.config.chunk_data_size)

    # --- changes -------------------------------------------------------------

    def add_new_chunk(self, *, start_number: int | None = None) -> Chunk:
        """Create the next chunk. The last chunk must be completed first.

        ``start_number`` may only be given for an empty directory (a queue that
        starts past offset 0, for example).
        """
        with self._lock:
            self._check_writable()
            last = self.last_chunk
            if last is not None and not last.is_completed:
                raise CorruptionError(
                    f"add_new_chunk() while {last.path.name} is still ongoing; complete it first",
                    file=last.path,
                )
            if last is not None:
                if start_number is not None and start_number != last.end_number + 1:
                    raise ConfigError(
                        f"start_number={start_number} would leave a gap after chunk "
                        f"{last.end_number}"
                    )
                number = last.end_number + 1
            else:
                number = start_number or 0
            config = self.config
            header = ChunkHeader(
                chunk_type=config.chunk_type,
                chunk_start_number=number,
                chunk_end_number=number,
                chunk_data_size=config.chunk_data_size,
                chunk_id=uuid.uuid4(),
                record_size=config.record_size,
                timestamp_offset=config.timestamp_offset,
                created_at_ns=time.time_ns(),
            )
            if last is not None and last.is_mapped:
                last.release_mapping()  # completed: it joins the LRU of read maps
            chunk = Chunk.create(
                self.directory,
                header,
                version=0,
                max_record_size=config.max_record_size,
                on_map=self._mapped,
                alloc_step=config.alloc_step,
            )
            chunk.on_advance = self.on_advance
            self._install(chunk)
            return chunk

    def set_on_advance(self, on_advance: Callable[[Chunk], None] | None) -> None:
        """``Chunk.on_advance`` for the ongoing chunk and every chunk created after it."""
        with self._lock:
            self.on_advance = on_advance
            last = self.last_chunk
            if last is not None and not last.is_completed:
                last.on_advance = on_advance

    def set_on_sync_failure(self, on_sync_failure: Callable[[], None] | None) -> None:
        """``Chunk.on_sync_failure`` for every chunk, now and later."""
        with self._lock:
            self.on_sync_failure = on_sync_failure
            for chunk in self._chunks:
                chunk.on_sync_failure = on_sync_failure

    def remove_chunks_before(self, number: int) -> list[Chunk]:
        """Delete completed chunks that end before chunk ``number``, oldest first.

        The last chunk is never removed. Readers that already hold a removed
        chunk's mapping finish reading it; later reads raise ChunkRemovedError.
        """
        removed: list[Chunk] = []
        with self._lock:
            self._check_writable()
            while (
                len(self._chunks) > 1
                and self._chunks[0].end_number < number
                and self._chunks[0].is_completed
            ):
                chunk = self._chunks.pop(0)
                for n in range(chunk.start_number, chunk.end_number + 1):
                    self._by_number.pop(n, None)
                removed.append(chunk)
            for chunk in removed:
                chunk.kept = False  # (before the unlink: a reader holding it is told why)
                chunk.release_mapping()
                chunk.path.unlink(missing_ok=True)
                log.info("removed chunk %s", chunk.path)
            if removed:
                fsync_directory(self.directory)
        return removed

    def truncate_after(self, position: int) -> list[TailCut]:
        """Cut every record at or after ``position`` (recovery of a derived index only).

        Whole chunks past it are moved to ``recovered/``; the chunk holding it
        loses its footer (it is ongoing again) and its data from there on, each
        cut copied to a side file first. Writers must be created afterwards.
        """
        cuts: list[TailCut] = []
        with self._lock:
            self._check_writable()
            if self._writer is not None:
                raise WriterExistsError("truncate_after() needs a manager without a writer")
            if position >= self.committed_position:
                return cuts
            number = max(position // self.config.chunk_data_size, self.first_chunk.start_number)  # type: ignore[union-attr]
            side_dir = self.directory / RECOVERED_DIR
            moved = False
            while self._chunks and self._chunks[-1].start_number > number:
                chunk = self._chunks.pop()
                for n in range(chunk.start_number, chunk.end_number + 1):
                    self._by_number.pop(n, None)
                chunk.kept = False
                chunk.close()
                side_dir = make_side_dir(self.directory)
                side = side_dir / f"{chunk.path.name}.{time.time_ns()}.cut"
                os.rename(chunk.path, side)
                moved = True
                cut = TailCut(
                    str(chunk.path), 0, chunk.file_size, str(side), "whole chunk past the cut"
                )
                log.warning("recovery: %s", cut)
                cuts.append(cut)
            chunk = self._chunks[-1]
            local = max(0, position - chunk.start_position)
            chunk.close()
            fd = open_fd(chunk.path, os.O_RDWR)
            try:
                full = chunk_file_size(chunk.header.chunk_data_size)
                for start, stop, reason in (
                    (full - FOOTER_SIZE, full, "footer of a chunk reopened by a cut"),
                    (HEADER_SIZE + local, full - FOOTER_SIZE, "records past the cut"),
                ):
                    zeroed = cut_range(chunk.path, fd, start, stop, reason)
                    if zeroed is not None:
                        cuts.append(zeroed)
            finally:
                os.close(fd)
            chunk.footer = None
            chunk.data_end = chunk.record_count = 0  # rescan from the start
            self._rescan_tail(chunk)
            chunk.open_for_write()
            fsync_directory(self.directory)
            if moved:
                fsync_directory(side_dir)
            self.recovery_cuts.extend(cuts)
        return cuts

    def refresh(self) -> None:
        """Read-only managers: pick up records and chunks a writer added since."""
        with self._lock:
            self._check_open()
            if not self.read_only:
                return
            if not self.directory.exists():
                return  # opened before any writer created the directory
            self.adopt_replacements()
            self._forget_removed()
            last = self.last_chunk
            if last is not None and not last.is_completed:
                try:
                    self._refresh_tail(last)
                except FileNotFoundError:  # completed, then removed by retention, meanwhile
                    self._forget_removed()
            known = {c.path.name for c in self._chunks}
            for name in sorted(os.listdir(self.directory)):
                parsed = parse_chunk_file_name(name)
                if parsed is None or name in known:
                    continue
                expected = self.last_chunk.end_number + 1 if self.last_chunk else parsed[0]
                if parsed[0] == expected:
                    path = self.directory / name
                    try:
                        header = self._read_header(path)
                        chunk = self._open_chunk(path, header, parsed[1], last=True)
                        prev = self.last_chunk
                        if prev is not None and not prev.is_completed:
                            self._refresh_tail(prev)
                    except FileNotFoundError:
                        break  # removed by retention since the listing: the next refresh
                    self._install(chunk)

    def _forget_removed(self) -> None:
        """Read-only: drop the oldest chunks whose files the writer's retention deleted.
        Readers that hold one's mapping finish with it; later reads of its positions
        raise ChunkRemovedError."""
        gone = 0
        while gone < len(self._chunks) and not self._chunks[gone].path.exists():
            gone += 1
        removed, self._chunks = self._chunks[:gone], self._chunks[gone:]
        # The list first: a lookup that races with this finds a removed chunk's number
        # below the first chunk (ChunkRemovedError), or that chunk without its file.
        for chunk in removed:
            for n in range(chunk.start_number, chunk.end_number + 1):
                self._by_number.pop(n, None)
            chunk.release_mapping()
            log.info("%s was removed by the writer", chunk.path)

    def adopt_replacements(self) -> list[Chunk]:
        """Swap in compacted chunks installed in the directory since we loaded it.

        A replacement is adopted when it covers exactly a run of our completed
        chunks, each of a lower version. The chunks it replaces lose their
        mapping (readers holding it finish with it; ChunkReader.read retries
        with the replacement) and, unless read-only, their files. Returns them.
        """
        replaced: list[Chunk] = []
        with self._lock:
            self._check_open()
            if not self.directory.is_dir():
                return replaced
            current = {c.path.name for c in self._chunks}
            for name in sorted(os.listdir(self.directory)):
                parsed = parse_chunk_file_name(name)
                if parsed is None or name in current:
                    continue
                path = self.directory / name
                try:
                    header = self._read_header(path)
                except FileNotFoundError:
                    continue  # a superseded file deleted meanwhile
                olds = self._replaced_by(header, parsed[1])
                if not olds:
                    continue
                try:
                    chunk = self._open_chunk(path, header, parsed[1], last=False)
                except FileNotFoundError:
                    continue  # superseded, or removed by retention, meanwhile
                chunk.kept = not self.read_only
                at = self._chunks.index(olds[0])
                self._chunks[at : at + len(olds)] = [chunk]
                for n in range(chunk.start_number, chunk.end_number + 1):
                    self._by_number[n] = chunk
                replaced += olds
                log.info("adopted %s in place of %s", name, [c.path.name for c in olds])
            for old in replaced:
                old.kept = False
                old.release_mapping()
                if not self.read_only:
                    old.path.unlink(missing_ok=True)
            if replaced and not self.read_only:
                fsync_directory(self.directory)
        return replaced

    def _replaced_by(self, header: ChunkHeader, version: int) -> list[Chunk]:
        """The chunks a file covers exactly and outranks; [] if it is not a replacement."""
        if not header.compacted:
            return []
        olds: list[Chunk] = []
        for n in range(header.chunk_start_number, header.chunk_end_number + 1):
            chunk = self._by_number.get(n)
            # A read-only view may still see as ongoing a chunk the writer has completed
            # (and compaction replaced) since; the writer never has a stale view.
            completed = chunk is not None and (chunk.is_completed or self.read_only)
            if chunk is None or not completed or chunk.version >= version:
                return []
            if not olds or olds[-1] is not chunk:
                olds.append(chunk)
        if (
            olds[0].start_number != header.chunk_start_number
            or olds[-1].end_number != header.chunk_end_number
        ):
            return []
        return olds

    # --- internals -----------------------------------------------------------

    def _attach_writer(self, writer: ChunkWriter) -> None:
        with self._lock:
            self._check_writable()
            if self._writer is not None:
                raise WriterExistsError(f"{self.directory} already has a ChunkWriter")
            self._writer = writer

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

    def _load(self) -> None:
        if not check_dir(self.directory):
            if self.read_only:
                return
            try:
                # One level at a time, each new entry fsynced in its parent: a
                # queue's topic directory must survive a power loss too.
                missing = [self.directory, *self.directory.parents]
                missing = missing[: next(i for i, d in enumerate(missing) if d.exists())]
                for directory in reversed(missing):
                    ensure_dir(directory)
                    fsync_directory(directory.parent)
            except OSError as exc:
                raise write_error(exc, "creating a chunk directory", self.directory) from exc
        # A read-only open races the writer's retention and compaction's installs, which
        # remove files it has just listed: it lists again (the writer's open cannot race).
        for attempt in range(1 if not self.read_only else _LIST_ATTEMPTS):
            names = sorted(os.listdir(self.directory))
            check_chunk_dir(self.directory, names)  # before anything is opened or removed
            try:
                chunks, superseded = self._open_listed(names)
                break
            except FileNotFoundError:
                if attempt == _LIST_ATTEMPTS - 1 or not self.read_only:
                    raise
        # Everything was checked; only now is anything on disk changed.
        if not self.read_only:
            for name in names:
                if name.endswith(TEMP_SUFFIX):
                    log.warning("removing leftover temp file %s", self.directory / name)
                    (self.directory / name).unlink(missing_ok=True)
            for path in superseded:
                log.info("removing %s: replaced by a newer version", path)
                path.unlink(missing_ok=True)
            if chunks and not chunks[-1].is_completed:
                self._repair_tail(chunks[-1])
        for chunk in chunks:
            self._install(chunk)
        if chunks and not chunks[-1].is_completed and not self.read_only:
            chunks[-1].open_for_write()
        # About the chunk ongoing at open only, not ones a refresh finds.
        self._tail_hint = self._live_hint = None

    def _open_listed(self, names: list[str]) -> tuple[list[Chunk], list[Path]]:
        found: list[tuple[Path, ChunkHeader, int]] = []
        for name in names:
            parsed = parse_chunk_file_name(name)
            if parsed is not None:
                path = self.directory / name
                found.append((path, self._read_header(path), parsed[1]))
        winners, superseded = _resolve_versions(found)
        _check_contiguous(winners, self.directory)
        chunks = [
            self._open_chunk(path, header, version, last=(i == len(winners) - 1))
            for i, (path, header, version) in enumerate(winners)
        ]
        return chunks, superseded

    def _read_header(self, path: Path) -> ChunkHeader:
        with open_file(path, "rb") as f:
            header = ChunkHeader.unpack(f.read(HEADER_SIZE), file=str(path))
        config = self.config
        for setting, expected, found in (
            ("chunk_data_size", config.chunk_data_size, header.chunk_data_size),
            ("record_size", config.record_size, header.record_size),
            ("timestamp_offset", config.timestamp_offset, header.timestamp_offset),
        ):
            if expected != found:
                raise ConfigError(
                    f"{path} was written with {setting}={found}, but the configuration says "
                    f"{setting}={expected}; open it with {setting}={found}"
                )
        return header

    def _open_chunk(self, path: Path, header: ChunkHeader, version: int, *, last: bool) -> Chunk:
        size = path.stat().st_size
        footer = read_footer(path, header, size, last=last)
        if footer is not None:
            return Chunk(
                path,
                header,
                footer,
                version=version,
                data_end=footer.physical_data_size,
                record_count=footer.record_count,
                max_record_size=self.config.max_record_size,
                on_map=self._mapped,
            )
        chunk = Chunk(
            path,
            header,
            None,
            version=version,
            data_end=0,
            record_count=0,
            max_record_size=self.config.max_record_size,
            on_map=self._mapped,
            alloc_step=self.config.alloc_step,
        )
        self._start_at_hint(chunk)
        self._rescan_tail(chunk)
        return chunk

    def _refresh_tail(self, chunk: Chunk) -> None:
        """Read-only refresh of a chunk we saw ongoing: load its footer if the writer
        completed it since, else rescan its committed end.

        Rescanning alone would leave a chunk the writer completed "ongoing" here, and
        ChunkReader.iter_from() would stop at its end, never reaching the chunks after it.
        """
        footer = read_footer(chunk.path, chunk.header, chunk.path.stat().st_size, last=True)
        if footer is None:
            self._rescan_tail(chunk)
            return
        chunk.data_end = chunk.flushed_end = footer.physical_data_size
        chunk.record_count = footer.record_count
        chunk.scan_problem = None
        chunk.footer = footer

    def _start_at_hint(self, chunk: Chunk) -> None:
        """Start the scan of the ongoing chunk where a tail hint says its records ended,
        if the hint is about this very file (its chunk id) and a valid frame ends there.
        Of the two hints, the one further on: the checkpoint's (durable when written)
        or the live one (in the page cache of this boot; see format/livetail.py).
        Otherwise the scan starts at the first record, as without a hint."""
        durable, live = self._tail_hint, self._live_hint
        if self.config.record_size:
            return
        hints = [h for h in (live, durable) if h is not None and self._about(h, chunk)]
        if not hints:
            return
        size = chunk.path.stat().st_size
        available = max(0, min(chunk.header.chunk_data_size, size - HEADER_SIZE))
        with open_file(chunk.path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            valid = [
                h
                for h in hints
                if frame_ends_at(
                    mm, h.data_end, available, chunk.header.chunk_data_size - FRAME_OVERHEAD
                )
            ]
        finally:
            mm.close()
        for hint in hints:
            if hint not in valid:
                log.warning(
                    "%s: no record ends at data offset %d, where the %s says %d records "
                    "ended; not starting the scan there",
                    chunk.path,
                    hint.data_end,
                    "checkpoint" if hint is durable else "live tail",
                    hint.record_count,
                )
        if not valid:
            return
        start = max(valid, key=lambda h: h.data_end)
        chunk.data_end = start.data_end
        chunk.record_count = start.record_count
        # Durable only as far as the checkpoint's hint: the live one's records may
        # still be in the page cache alone.
        if durable in valid and durable is not None and durable.data_end <= start.data_end:
            chunk.synced_end = durable.data_end
            self.synced_hint = durable
        self.scan_started_at = chunk.start_position + start.data_end
        self.started_at_live_hint = start is live

    @staticmethod
    def _about(hint: TailHint, chunk: Chunk) -> bool:
        """The hint names this chunk and a record count records of that size can reach."""
        return names_chunk(hint, chunk.header.chunk_id)  # as verify's scan_start

    def _rescan_tail(self, chunk: Chunk) -> None:
        """Find the valid end of an ongoing chunk without changing the file; a refresh
        scans on from the end found before, since a writer only appends."""
        size = chunk.path.stat().st_size
        available = max(0, min(chunk.header.chunk_data_size, size - HEADER_SIZE))
        start = min(chunk.data_end, available)
        with open_file(chunk.path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            if self.config.record_size:
                result = scan_fixed(mm, available, self.config.record_size, start)
                count = result.record_count
            else:
                # Bound lengths by the chunk, not by config.max_record_size: that
                # setting is not stored on disk, and reopening with a smaller value made
                # recovery cut (move to recovered/) valid records written under a larger one.
                result = scan_variable(
                    mm, available, chunk.header.chunk_data_size - FRAME_OVERHEAD, start
                )
                count = (chunk.record_count if start else 0) + result.record_count
        finally:
            mm.close()
        chunk.data_end = chunk.flushed_end = result.data_end
        chunk.record_count = count
        chunk.scan_problem = result.problem

    def _repair_tail(self, chunk: Chunk) -> None:
        """Cut everything past the valid end of the last chunk and restore its full size."""
        path = chunk.path
        full = chunk_file_size(chunk.header.chunk_data_size)
        data_stop = HEADER_SIZE + chunk.header.chunk_data_size
        try:
            fd = open_fd(path, os.O_RDWR)
            try:
                size = os.fstat(fd).st_size
                reason = chunk.scan_problem or "bytes past the last valid record"
                cut = cut_range(
                    path, fd, HEADER_SIZE + chunk.data_end, min(size, data_stop), reason
                )
                if cut is not None:
                    self.recovery_cuts.append(cut)
                if size >= full:
                    footer = cut_range(path, fd, full - FOOTER_SIZE, full, "torn footer")
                    if footer is not None:
                        self.recovery_cuts.append(footer)
                if size != full:
                    problem = (
                        f"chunk file of {size} bytes instead of {full}, resized to {full} "
                        f"{location(path, size)}"
                        + ("; anything past the end of the file was lost" if size < full else "")
                    )
                    log.warning("recovery: %s", problem)
                    self.recovery_problems.append(problem)
                    if size > full:
                        cut_tail = cut_range(path, fd, full, size, "bytes past the footer")
                        if cut_tail is not None:
                            self.recovery_cuts.append(cut_tail)
                    os.ftruncate(fd, full)
                    os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            raise write_error(exc, "recovering a chunk", path) from exc


def _ignore_map(chunk: Chunk) -> None:
    return None


def _resolve_versions(
    found: list[tuple[Path, ChunkHeader, int]],
) -> tuple[list[tuple[Path, ChunkHeader, int]], list[Path]]:
    """Keep, for every chunk number, the highest-version file that covers it."""
    claimed: dict[int, Path] = {}
    winners: list[tuple[Path, ChunkHeader, int]] = []
    superseded: list[Path] = []
    for path, header, version in sorted(found, key=lambda f: -f[2]):
        numbers = range(header.chunk_start_number, header.chunk_end_number + 1)
        owners = {claimed.get(n) for n in numbers}
        if owners == {None}:
            for n in numbers:
                claimed[n] = path
            winners.append((path, header, version))
        elif None in owners:
            raise CorruptionError(
                f"chunk file covers chunks {numbers.start}..{numbers.stop - 1} only partly "
                f"replaced by {sorted(str(o) for o in owners if o is not None)}",
                file=path,
            )
        else:
            superseded.append(path)
    winners.sort(key=lambda f: f[1].chunk_start_number)
    return winners, superseded


def _check_contiguous(winners: list[tuple[Path, ChunkHeader, int]], directory: Path) -> None:
    for (prev_path, prev, _), (path, header, _) in itertools.pairwise(winners):
        if header.chunk_start_number != prev.chunk_end_number + 1:
            missing = f"{prev.chunk_end_number + 1}..{header.chunk_start_number - 1}"
            raise MissingChunkError(
                f"chunks {missing} are missing from {directory} between {prev_path.name} and "
                f"{path.name}; nothing was changed",
                file=path,
            )
