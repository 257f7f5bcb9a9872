"""Opening a chunk directory: listing it (again, for a read-only view that races the
writer), resolving versions, checking headers against the configuration and
contiguity, reading footers, the scan of the ongoing chunk (from a tail hint when one
is valid) and the repair of its torn tail. Apart from the manager's other parts: it
runs once per open (and its scans again on a refresh or a cut)."""

from __future__ import annotations

import errno
import itertools
import logging
import mmap
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Final

from equeue.chunks.ahead import is_ahead_name
from equeue.chunks.chunk import Chunk
from equeue.chunks.chunkset import ChunkSet
from equeue.chunks.fileops import fsync_directory, open_error, write_error
from equeue.chunks.footer import read_footer
from equeue.chunks.identity import check_identity
from equeue.chunks.recovery import (
    TailHint,
    cut_range,
    frame_ends_at,
    names_chunk,
    scan_fixed,
    scan_variable,
)
from equeue.errors import (
    ConfigError,
    CorruptionError,
    EQueueError,
    MissingChunkError,
    location,
)
from equeue.format.chunk import (
    FOOTER_SIZE,
    FRAME_OVERHEAD,
    HEADER_SIZE,
    TEMP_SUFFIX,
    ChunkHeader,
    chunk_file_size,
    parse_chunk_file_name,
)
from equeue.safepath import check_chunk_dir, check_dir, ensure_dir, open_fd, open_file

log = logging.getLogger("equeue.chunks")


# How often a read-only open lists a chunk directory again when a listed file vanished.
_LIST_ATTEMPTS: Final = 8
# How often it lists again when retention removed every file it had listed before it
# could open them (a loaded machine beside a writer whose retention runs often); and how
# often a view's refresh lists again when a file it needed went (refresh.py).
OUTRUN_ATTEMPTS: Final = 64


def retention_floor(path: Path, names: Iterable[str]) -> int:
    """The first chunk number among ``names`` (a listing of ``path``'s directory taken
    after ``path`` was found gone) if retention removed ``path``: every chunk file listed
    starts after it (retention removes the oldest chunks first, and never the last one).
    -1 if not: compaction replaced it, or a file is missing in the middle."""
    parsed = parse_chunk_file_name(path.name)
    if parsed is None:
        return -1
    first = min((p[0] for p in map(parse_chunk_file_name, names) if p), default=-1)
    return first if first > parsed[0] else -1


def retention_took(path: str | Path) -> bool:
    """Whether the chunk file ``path``, found gone, was removed by retention (one listing
    of its directory, taken now: ``retention_floor``). The compaction job's tasks and the
    Spark source's planning ask it."""
    path = Path(path)
    return retention_floor(path, os.listdir(path.parent)) >= 0


class _AllRemoved(FileNotFoundError):
    """Every chunk file a read-only open listed was removed before it could open them."""


class ChunkOpening(ChunkSet):
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
        try:
            chunks, superseded, names = self._list_and_open()
        except EQueueError:
            raise
        except OSError as exc:  # (EMFILE: a broker's clients took every descriptor)
            raise open_error(exc, self.directory, self.read_only) from exc
        # Everything was checked; only now is anything on disk changed.
        if not self.read_only:
            for name in names:
                if is_ahead_name(name):
                    # Kept until the whole open has succeeded (a store refused after this
                    # directory was read changes nothing) or the first roll-over: manager.py
                    self._leftovers.append(self.directory / name)
                elif name.endswith(TEMP_SUFFIX):
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

    def _list_and_open(self) -> tuple[list[Chunk], list[Path], list[str]]:
        attempts = outrun = 0
        while True:
            names = sorted(os.listdir(self.directory))
            check_chunk_dir(self.directory, names)  # before anything is opened or removed
            try:
                chunks, superseded = self._open_listed(names)
                return chunks, superseded, names
            except _AllRemoved:
                # Retention removed every file listed while they were opened: progress
                # by the writer, not a listing at odds with itself; bounded all the same.
                outrun += 1
                if outrun == OUTRUN_ATTEMPTS:
                    raise
            except FileNotFoundError:
                attempts += 1
                if attempts == _LIST_ATTEMPTS or not self.read_only:
                    raise

    def _open_listed(self, names: list[str]) -> tuple[list[Chunk], list[Path]]:
        found: list[tuple[Path, ChunkHeader, int]] = []
        removed = False  # a listed file that retention removed meanwhile was skipped
        # The first chunk number the directory held at the last retention verdict: every
        # listed file below it was gone then (retention removes, no writer brings one
        # back), so it is skipped without a look. One listing per retention pass seen,
        # not one per file it removed (review11 R11-4: 1,508 listings, 1.4-1.5 s of CPU
        # for 1,500 files removed at once, against 0.13-0.15 s without the race).
        floor = -1
        for name in names:
            parsed = parse_chunk_file_name(name)
            if parsed is not None and parsed[0] >= floor:
                path = self.directory / name
                try:
                    found.append((path, self._read_header(path), parsed[1]))
                except FileNotFoundError:
                    floor = self._retention_floor(path)
                    if floor < 0:
                        raise
                    found, removed = [], True  # it and every chunk before it are gone
        winners, superseded = _resolve_versions(found)
        _check_contiguous(winners, self.directory)
        chunks: list[Chunk] = []
        try:
            for i, (path, header, version) in enumerate(winners):
                if header.chunk_start_number < floor:
                    continue
                try:
                    chunks.append(
                        self._open_chunk(path, header, version, last=(i == len(winners) - 1))
                    )
                except FileNotFoundError:
                    floor = self._retention_floor(path)
                    if floor < 0:
                        raise
                    for chunk in chunks:
                        chunk.close()
                    chunks, removed = [], True
        except BaseException:
            for chunk in chunks:
                chunk.close()
            raise
        if removed and not chunks:  # every listed chunk file was removed: list again
            raise _AllRemoved(
                errno.ENOENT, "every listed chunk file was removed", str(self.directory)
            )
        return chunks, superseded

    def _retention_floor(self, path: Path) -> int:
        """A read-only view's listed chunk file is gone: the first chunk number now in
        the directory if retention removed ``path``, -1 if not (one listing)."""
        if not self.read_only:
            return -1
        return retention_floor(path, os.listdir(self.directory))

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
        with open_file(chunk.path, "rb") as f:
            # What is scanned is this chunk's file, not one made under its name since
            # (a view's refresh would take the new file's end for its own: identity.py).
            check_identity(f.fileno(), chunk.path, chunk.header)
            size = os.fstat(f.fileno()).st_size
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        available = max(0, min(chunk.header.chunk_data_size, size - HEADER_SIZE))
        start = min(chunk.data_end, available)
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
