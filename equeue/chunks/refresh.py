"""What changes in a chunk directory after it was opened, taken in: a read-only view's
refresh (records and chunks a writer added, chunks its retention removed) and, for
the writer and views alike, the adoption of compacted chunks installed by a
compaction (adopt_replacements)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

from equeue.chunks.chunk import Chunk
from equeue.chunks.fileops import fsync_directory
from equeue.chunks.footer import read_footer
from equeue.chunks.identity import check_path_identity
from equeue.chunks.opening import OUTRUN_ATTEMPTS, ChunkOpening, retention_floor
from equeue.format.chunk import ChunkHeader, parse_chunk_file_name

log = logging.getLogger("equeue.chunks")


class ChunkRefresh(ChunkOpening):
    def refresh(self) -> None:
        """Read-only managers: pick up records and chunks a writer added since, and drop
        the chunks its retention removed. Afterwards the view reaches the last chunk of a
        listing taken during the call, unless files went missing in that many listings
        running (OUTRUN_ATTEMPTS), or in two running that named the same files with the
        view unchanged: then it is left where the last one got it."""
        with self._lock:
            self._check_open()
            if not self.read_only:
                return
            if not self.directory.exists():
                return  # opened before any writer created the directory
            before: tuple[frozenset[str], list[str]] | None = None
            for _ in range(OUTRUN_ATTEMPTS):
                listing = self._catch_up()
                if listing is None:
                    return
                # The attempts are there for a compaction's install that swaps a file
                # under one. Nothing moved since the attempt before (the same files,
                # the same view): the next would do the same, it is damage (review12
                # F1: a view's last chunk file deleted cost 64 attempts, 128 listings
                # and ~12 ms a refresh, three refreshes a pull). Reads report it.
                now = (listing, [c.path.name for c in self._chunks])
                if now == before:
                    return
                before = now

    def _catch_up(self) -> frozenset[str] | None:
        """One listing's worth of refresh: None when done, else the directory's names
        listed when a file it needed was found gone otherwise than by retention (a
        compaction's install swapped it, or damage): list again, unless nothing moved."""
        self.adopt_replacements()
        swapped = self._forget_removed()
        if swapped is not None:
            return swapped
        last = self.last_chunk
        if last is not None and not last.is_completed:
            lost = self._tail_lost(last)
            if lost is not None:
                return lost
        for path, number, version in self._files_not_in_view():
            last = self.last_chunk
            if last is not None and number != last.end_number + 1:
                continue
            try:
                chunk = self._open_chunk(path, self._read_header(path), version, last=True)
            except FileNotFoundError:
                lost = self._lost_otherwise(path)
                if lost is not None:
                    return lost
                # Retention removed it, and so every chunk of the view (all older): the
                # view starts again from the next file listed, as an open would
                # (before, the refresh stopped here and left the view behind, or empty,
                # until the next one: good entries read as outside the log).
                self._forget_removed()
                continue
            if last is not None and not last.is_completed:
                lost = self._tail_lost(last)
                if lost is not None:
                    chunk.close()
                    return lost
            self._install(chunk)
        return None

    def _files_not_in_view(self) -> Iterator[tuple[Path, int, int]]:
        """(path, first chunk number, version) of each chunk file listed now, in name
        order, that the view held under that name when the listing was taken."""
        known = {c.path.name for c in self._chunks}
        for name in sorted(os.listdir(self.directory)):
            parsed = parse_chunk_file_name(name)
            if parsed is not None and name not in known:
                yield self.directory / name, parsed[0], parsed[1]

    def _tail_lost(self, chunk: Chunk) -> frozenset[str] | None:
        """The view's last chunk, seen ongoing, refreshed now that its successor is
        there (its footer, most often): None, or the listing that shows it gone
        otherwise than by retention. Gone by retention, it and the view's older chunks
        are dropped."""
        try:
            self._refresh_tail(chunk)
        except FileNotFoundError:
            lost = self._lost_otherwise(chunk.path)
            if lost is not None:
                return lost
            self._forget_removed()
        return None

    def _lost_otherwise(self, path: Path) -> frozenset[str] | None:
        """``path`` is gone: None if retention removed it, else the names the directory
        holds now (one listing)."""
        names = frozenset(os.listdir(self.directory))
        return None if retention_floor(path, names) >= 0 else names

    def _forget_removed(self) -> frozenset[str] | None:
        """Read-only: drop the oldest chunks whose files the writer's retention deleted.
        Readers that hold one's mapping finish with it; later reads of its positions
        raise ChunkRemovedError. Returns None, or the directory's names when the oldest
        chunk's file went otherwise than by retention (a compaction's install swapped it
        since the adoption's listing): nothing is dropped, and the refresh lists again
        to adopt the replacement (review13 F2: taken for retention's, its live messages
        read as removed and pulls skipped them)."""
        gone = 0
        while gone < len(self._chunks) and not self._chunks[gone].path.exists():
            gone += 1
        if gone:
            names = frozenset(os.listdir(self.directory))
            if retention_floor(self._chunks[gone - 1].path, names) < 0:
                return names
        removed, self._chunks = self._chunks[:gone], self._chunks[gone:]
        # The list first: a lookup that races with this finds a removed chunk's number
        # below the first chunk (ChunkRemovedError), or that chunk without its file.
        if removed:
            # A view this leaves empty (a refresh outrun) still knows these went: a
            # full suite's run read a pulled message's position as 'no chunk 806'
            # (MessageNotFoundError) where retention had removed it
            self._removed_through = max(self._removed_through, removed[-1].end_number)
        for chunk in removed:
            for n in range(chunk.start_number, chunk.end_number + 1):
                self._by_number.pop(n, None)
            chunk.release_mapping()
            log.info("%s was removed by the writer", chunk.path)
        return None

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
            for path, _, version in self._files_not_in_view():
                try:
                    header = self._read_header(path)
                except FileNotFoundError:
                    continue  # a superseded file deleted meanwhile
                olds = self._replaced_by(header, version)
                if not olds:
                    continue
                try:
                    chunk = self._open_chunk(path, header, version, last=False)
                except FileNotFoundError:
                    continue  # superseded, or removed by retention, meanwhile
                chunk.kept = not self.read_only
                at = self._chunks.index(olds[0])
                self._chunks[at : at + len(olds)] = [chunk]
                for n in range(chunk.start_number, chunk.end_number + 1):
                    self._by_number[n] = chunk
                replaced += olds
                log.info("adopted %s in place of %s", path.name, [c.path.name for c in olds])
            for old in replaced:
                old.kept = False
                old.release_mapping()
                if not self.read_only:
                    old.path.unlink(missing_ok=True)
            if replaced and not self.read_only:
                fsync_directory(self.directory)
        return replaced

    def _replaced_by(self, header: ChunkHeader, version: int) -> list[Chunk]:
        """The chunks a file covers exactly and outranks; [] if it is not a replacement.
        A read-only view behind the writer also takes one that covers its last chunks
        and reaches past its end: the files of the chunks past it may be gone already
        (the job deletes them when no writer runs, the writer once it adopted them), and
        the listing would then hold nothing that follows the view's last chunk."""
        if not header.compacted:
            return []
        olds: list[Chunk] = []
        past_end = False
        for n in range(header.chunk_start_number, header.chunk_end_number + 1):
            chunk = self._by_number.get(n)
            if chunk is None and self.read_only and olds and olds[-1] is self.last_chunk:
                past_end = True
                break
            # A read-only view may still see as ongoing a chunk the writer has completed
            # (and compaction replaced) since; the writer never has a stale view.
            completed = chunk is not None and (chunk.is_completed or self.read_only)
            if chunk is None or not completed or chunk.version >= version:
                return []
            if not olds or olds[-1] is not chunk:
                olds.append(chunk)
        if olds[0].start_number != header.chunk_start_number or (
            olds[-1].end_number != header.chunk_end_number and not past_end
        ):
            return []
        return olds

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
        # Checked after the footer's read: a file unlinked never comes back under its name,
        # so if the name is this chunk's now, the footer read was too.
        check_path_identity(chunk.path, chunk.header)
        chunk.data_end = chunk.flushed_end = footer.physical_data_size
        chunk.record_count = footer.record_count
        chunk.scan_problem = None
        chunk.footer = footer
