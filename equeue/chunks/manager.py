"""ChunkManager: the chunk files of one directory, loaded, recovered and looked up by position.

Its parts, each a base class: chunkset.py (the fields and lookups), opening.py (the
directory's scan at open), refresh.py (a view's refresh, compaction's replacements)
and removal.py (retention, cuts). Here: creation of chunks, writers, closing."""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING

from equeue.chunks.ahead import (
    MAKER,
    AheadFile,
    check_ahead_file,
    discard,
    make_ahead_file,
    remove_leftover,
)
from equeue.chunks.chunk import Chunk
from equeue.chunks.refresh import ChunkRefresh
from equeue.chunks.removal import ChunkRemoval
from equeue.errors import ConfigError, CorruptionError, EQueueError, WriterExistsError
from equeue.format.chunk import ChunkHeader

if TYPE_CHECKING:
    from equeue.chunks.writer import ChunkWriter

log = logging.getLogger("equeue.chunks")


class ChunkManager(ChunkRefresh, ChunkRemoval):
    """The chunks of one directory, in number order, with at most
    ``config.max_open_chunks`` completed chunks mapped at once.

    Opening loads every chunk header, checks each completed chunk's footer,
    scans the last chunk for its valid end and cuts any torn tail (copied to
    ``recovered/`` first; see ``recovery_cuts``). A read-only manager changes
    nothing on disk and can ``refresh()`` to see what a writer added since.
    """

    # Called before a chunk file is created (the store's directory guard: a writer whose
    # STORE was moved or made again under it must not create files in the other store;
    # review3 R2). None: nothing to check.
    before_create: Callable[[], None] | None = None

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
                self._drop_ahead()
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
            self._drop_ahead()

    # --- changes -------------------------------------------------------------

    def add_new_chunk(self, *, start_number: int | None = None) -> Chunk:
        """Create the next chunk. The last chunk must be completed first.

        ``start_number`` may only be given for an empty directory (a queue that
        starts past offset 0, for example).
        """
        with self._lock:
            self._check_writable()
            if self.before_create is not None:
                self.before_create()
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
            if last is not None and last.is_mapped:
                last.release_mapping()  # completed: it joins the LRU of read maps
            chunk = self._install_made_ahead(number)
            if chunk is None:
                chunk = Chunk.create(
                    self.directory,
                    self._next_header(number),
                    version=0,
                    max_record_size=config.max_record_size,
                    on_map=self._mapped,
                    alloc_step=config.alloc_step,
                )
            chunk.on_advance = self.on_advance
            self._install(chunk)
            self._start_ahead()
            return chunk

    def _next_header(self, number: int) -> ChunkHeader:
        config = self.config
        return ChunkHeader(
            chunk_type=config.chunk_type,
            chunk_start_number=number,
            chunk_end_number=number,
            chunk_data_size=config.chunk_data_size,
            chunk_id=uuid.uuid4(),
            record_size=config.record_size,
            timestamp_offset=config.timestamp_offset,
            created_at_ns=time.time_ns(),
        )

    # --- the next chunk made ahead (ahead.py) --------------------------------

    def start_making_ahead(self) -> None:
        """The owner's open succeeded: remove the made-ahead files a stopped writer left
        and (``make_ahead``) have the next chunk's file made. Until then, or the first
        roll-over, nothing made ahead is touched or made, so an open refused after this
        directory was read leaves it as it was. Nothing for a read-only manager."""
        with self._lock:
            if not self.read_only and not self._closed:
                self._start_ahead()

    def _start_ahead(self) -> None:
        """Under ``_lock``, writable."""
        if not self._ahead_started:
            self._ahead_started = True
            leftovers, self._leftovers = self._leftovers, []
            for path in leftovers:
                remove_leftover(path)
        self._request_ahead()

    def _request_ahead(self) -> None:
        """Under ``_lock``: have the chunk maker make the file of the chunk after the
        ongoing one, unless one is ready or being made (at most one per directory). A
        file made for a chunk that exists by now is removed first: the maker finished it
        while the roll-over was creating that chunk itself, and read the last chunk
        before the install (its own check, ``_make_ahead``, sees only later installs)."""
        last = self.last_chunk
        if (
            not self.config.make_ahead
            or not self._ahead_started
            or self.read_only
            or self._closed
            or last is None
            or last.is_completed
        ):
            return
        with self._ahead_cond:
            stale = self._ahead
            if stale is not None and stale.header.chunk_start_number > last.end_number:
                stale = None
            if (
                self._ahead_closed
                or self._ahead_busy
                or (self._ahead is not None and stale is None)
            ):
                return
            self._ahead, self._ahead_busy, self._ahead_pid = None, True, os.getpid()
        if stale is not None:
            made_for = stale.header.chunk_start_number
            discard(stale.path, f"a roll-over made chunk {made_for} first", logging.INFO)
        header = self._next_header(last.end_number + 1)
        MAKER.submit(lambda: self._make_ahead(header))

    def _make_ahead(self, header: ChunkHeader) -> None:
        """On the chunk maker's thread."""
        made: AheadFile | None = None
        try:
            with self._ahead_cond:
                closed = self._ahead_closed
            if not closed:
                if self.before_create is not None:
                    self.before_create()
                made = make_ahead_file(self.directory, header, self.config.alloc_step)
        except (OSError, EQueueError) as exc:  # the roll-over makes the file, as before
            log.warning(
                "could not make chunk %d of %s ahead (%s); the roll-over will make it",
                header.chunk_start_number,
                self.directory,
                exc,
            )
        finally:
            with self._ahead_cond:
                self._ahead_busy = False
                if made is not None and self._ahead_closed:
                    made.path.unlink(missing_ok=True)
                    made = None
                self._ahead = made
                self._ahead_cond.notify_all()
        last = self.last_chunk
        if (
            made is not None
            and last is not None
            and made.header.chunk_start_number <= last.end_number
        ):
            # A roll-over came first and made its chunk itself: this file is for a chunk that
            # exists, so the next one is made instead (busy cleared first: close waits on it)
            if not self._lock_unless_closing():
                return  # close deletes the file made ahead (_drop_ahead)
            try:
                with self._ahead_cond:
                    stale = self._ahead is made
                    if stale:
                        self._ahead = None
                if stale:
                    discard(
                        made.path,
                        f"a roll-over made chunk {header.chunk_start_number} first",
                        logging.INFO,
                    )
                    self._request_ahead()
            finally:
                self._lock.release()

    def _lock_unless_closing(self) -> bool:
        """On the chunk maker's thread: ``_lock`` taken (True), or False once a close has
        begun. A close holds the lock while it waits for the maker's queued job, which
        cannot start before this one returns: waiting for the lock then would deadlock
        (suite-core, round 21: a request had queued the next job between this job's
        ``finally`` and its lock)."""
        while not self._lock.acquire(timeout=0.01):
            with self._ahead_cond:
                if self._ahead_closed:
                    return False
        return True

    def _install_made_ahead(self, number: int) -> Chunk | None:
        """Under ``_lock``: chunk ``number`` from the file made ahead, if there is one and
        it is intact; None for ``Chunk.create`` to make it (a hostile entry under the
        made-ahead name is left or unlinked, never written through: ahead.discard)."""
        with self._ahead_cond:
            ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        if ahead.header.chunk_start_number != number:
            made_for = ahead.header.chunk_start_number
            discard(ahead.path, f"made for chunk {made_for}, not {number}", logging.INFO)
            return None
        problem = check_ahead_file(ahead)
        if problem is not None:
            discard(ahead.path, problem)
            return None
        try:
            chunk = Chunk.install_made_ahead(
                ahead,
                max_record_size=self.config.max_record_size,
                on_map=self._mapped,
                alloc_step=self.config.alloc_step,
            )
        except OSError as exc:
            log.warning("installing the chunk file made ahead %s failed: %s", ahead.path, exc)
            return None
        MAKER.submit(lambda: _name_durable(chunk))  # before any flush needs it, most often
        return chunk

    def _drop_ahead(self) -> None:
        """At close: no file is made ahead from now on, and the one made is deleted. In a
        child forked from the process that asked for it, the job (which no thread of the
        child runs: waiting for it hung the close) and the file are the parent's: left."""
        with self._ahead_cond:
            self._ahead_closed = True
            ours = self._ahead_pid == os.getpid()
            while self._ahead_busy and ours:
                self._ahead_cond.wait()
            ahead, self._ahead = self._ahead, None
        if not ours:
            return
        if ahead is not None and check_ahead_file(ahead) is None:
            ahead.path.unlink(missing_ok=True)

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

    # --- internals -----------------------------------------------------------

    def _attach_writer(self, writer: ChunkWriter) -> None:
        with self._lock:
            self._check_writable()
            if self._writer is not None:
                raise WriterExistsError(f"{self.directory} already has a ChunkWriter")
            self._writer = writer
            self._request_ahead()


def _name_durable(chunk: Chunk) -> None:
    """The chunk maker's fsync of a made-ahead chunk's directory, right after the
    rename: a failure is left to the flush that needs the name (it fails the same way)."""
    try:
        chunk.make_name_durable()
    except OSError as exc:
        log.warning(
            "fsync of %s after installing %s failed: %s", chunk.path.parent, chunk.path, exc
        )


def _ignore_map(chunk: Chunk) -> None:
    return None
