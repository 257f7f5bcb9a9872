"""The key index: (topic, key) -> message positions, kept in SQLite beside the chunks.

It is derived from the message log: sends buffer their keys and one
transaction writes a batch together with ``indexed_position``, the log
position up to which every key is in the table. Recovery re-indexes what the
log holds past that position, so a crash loses no key and adds none twice.
SQLite's page cache bounds the memory, whatever the store's size.
"""

from __future__ import annotations

import errno
import os
import resource
import sqlite3
import threading
import time
from pathlib import Path
from typing import Final

from equeue.errors import CorruptionError, DiskFullError, StoreWriteError
from equeue.safepath import check_file
from equeue.store.meta import CHECKPOINT_FILE, move_to_recovered

NO_BOUND: Final = (1 << 63) - 1  # above every log position (SQLite's largest integer)
_SQLITE_FULL = 13  # the primary result code for "database or disk is full"
_SQLITE_BUSY = (5, 6)  # SQLITE_BUSY, SQLITE_LOCKED: in use, not damaged
_SIDE_FILES = ("-wal", "-shm")  # SQLite's, beside the database: they go with it
# The most a write of SQLite can add to a file: a WAL frame of the largest page size.
_LARGEST_WRITE = 65536 + 24
_SCHEMA = """
CREATE TABLE IF NOT EXISTS keys (topic TEXT NOT NULL, key TEXT NOT NULL, position INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS keys_by_key ON keys (topic, key, position);
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""


class KeyIndex:
    def __init__(self, path: Path) -> None:
        self.path = path
        if str(path) != ":memory:":
            # SQLite follows links and opens what it finds: check the files it may write.
            for name in (path.name, f"{path.name}-wal", f"{path.name}-shm", f"{path.name}-journal"):
                check_file(path.with_name(name))
        uri = f"file:{path}"
        self._db = sqlite3.connect(uri, uri=True, check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        self._pending: list[tuple[str, str, int]] = []
        self._pending_end = 0
        # The position of the first key of the batch commit() is writing, until it is in.
        self._committing_from: int | None = None
        try:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
            row = self._db.execute(
                "SELECT value FROM meta WHERE name='indexed_position'"
            ).fetchone()
            # A cheap probe of both b-trees: a damaged root page fails here, not in a query.
            self._db.execute("SELECT max(rowid) FROM keys").fetchone()
            self._db.execute("SELECT 1 FROM keys INDEXED BY keys_by_key LIMIT 1").fetchone()
        except BaseException:
            self._db.close()
            raise
        self.indexed_position: int = row[0] if row else 0

    def add(self, topic: str, key: str, position: int) -> None:
        """Buffer one key; the caller holds the store's write lock."""
        self._pending.append((topic, key, position))

    def mark(self, log_end: int) -> None:
        """Every key of a message before ``log_end`` has been added."""
        self._pending_end = log_end

    @property
    def pending(self) -> int:
        return len(self._pending)

    def all_committed_before(self, position: int) -> bool:
        """Every key added for a message before ``position`` is in the table. The caller
        holds the store's write lock, so no key is added meanwhile; commit() may run."""
        # The list first: commit() names its batch's first key before it takes the list,
        # and forgets it only once the batch is in.
        pending = self._pending
        if pending and pending[0][2] < position:
            return False
        committing = self._committing_from
        return committing is None or committing >= position

    def commit(self) -> None:
        """Write the buffered keys and the indexed position in one transaction."""
        with self._lock:
            batch = self._pending
            if batch:
                self._committing_from = batch[0][2]
            self._pending = []
            end = self._pending_end
            if not batch and end <= self.indexed_position:
                return
            try:
                with self._db:
                    self._db.execute("BEGIN")
                    self._db.executemany("INSERT INTO keys VALUES (?, ?, ?)", batch)
                    self._db.execute(
                        "INSERT OR REPLACE INTO meta VALUES ('indexed_position', ?)", (end,)
                    )
            except sqlite3.Error as exc:
                # Kept for the next commit, in order; _committing_from stays until one succeeds.
                self._pending[:0] = batch
                raise self._write_error(exc) from exc
            self._committing_from = None
            self.indexed_position = end

    def _write_error(self, exc: sqlite3.Error) -> StoreWriteError:
        """The error for a failed write: DiskFullError when the disk is full (SQLITE_FULL,
        or no free block) or a file of the index reached RLIMIT_FSIZE (SQLite reports
        EFBIG as a plain I/O error: the sizes tell)."""
        code = errno.EIO
        if getattr(exc, "sqlite_errorcode", 0) & 0xFF == _SQLITE_FULL or _no_space(self.path):
            code = errno.ENOSPC
        elif _at_size_limit(self.path):
            code = errno.EFBIG
        if code == errno.EIO:
            return StoreWriteError(
                code, f"writing the key index {self.path} failed: {exc} ({os.strerror(code)})"
            )
        return DiskFullError(
            code,
            f"writing the key index {self.path} failed: {exc} ({os.strerror(code)}); free "
            "space on its file system"
            + (" or raise the file size limit (ulimit -f)" if code == errno.EFBIG else "")
            + ": the keys are kept and the next flush or checkpoint writes them",
        )

    def positions(self, topic: str, key: str, limit: int, before: int = NO_BOUND) -> list[int]:
        """Newest first, below ``before``."""
        self.commit()
        with self._lock:
            try:
                rows = self._db.execute(
                    "SELECT position FROM keys WHERE topic=? AND key=? AND position < ? "
                    "ORDER BY position DESC LIMIT ?",
                    (topic, key, before, limit),
                ).fetchall()
            except sqlite3.DatabaseError as exc:
                raise _damaged(self.path, exc) from exc
        return [row[0] for row in rows]

    def forget_from(self, position: int) -> None:
        """Recovery: drop rows at or after ``position`` (committed early by a query, or
        pointing past a cut in the log); they are re-indexed from the log."""
        with self._lock:
            self._pending = []
            self._committing_from = None
            statements = [("DELETE FROM keys WHERE position >= ?", (position,))]
            # An open after a clean close forgets nothing: the row is left as it is, so
            # that an open (a refused command's, a reader's that became a writer) changes
            # no byte of keys.sqlite; a DELETE of no rows dirties no page.
            if position != self.indexed_position:
                statements.append(
                    ("INSERT OR REPLACE INTO meta VALUES ('indexed_position', ?)", (position,))
                )
            self._write(*statements)
        self.indexed_position = position

    def forget_below(self, position: int) -> None:
        """Retention removed the log below ``position``."""
        with self._lock:
            self._write(("DELETE FROM keys WHERE position < ?", (position,)))

    def _write(self, *statements: tuple[str, tuple[int]]) -> None:
        """One transaction; the caller holds ``_lock``."""
        try:
            with self._db:
                self._db.execute("BEGIN")
                for sql, parameters in statements:
                    self._db.execute(sql, parameters)
        except sqlite3.Error as exc:
            raise self._write_error(exc) from exc

    def close(self) -> None:
        self.commit()
        self._db.close()

    def discard(self) -> None:
        """Closed with the keys it buffered not written (a refused open's)."""
        self._db.close()


def _damaged(path: Path, exc: sqlite3.Error) -> CorruptionError:
    return CorruptionError(
        f"the key index cannot be read ({exc}); 'equeue verify' checks it, and a writer's "
        "open moves a damaged one to recovered/ and rebuilds it from the log",
        file=path,
    )


def _busy(exc: sqlite3.Error) -> bool:
    return getattr(exc, "sqlite_errorcode", 0) & 0xFF in _SQLITE_BUSY


def open_writer_index(path: Path, problems: list[str]) -> KeyIndex:
    """The writer's key index. One SQLite cannot read is derived data: it is moved to
    ``recovered/`` (with its -wal and -shm) and a new, empty one has indexed_position 0,
    so recovery re-indexes every key from the log (reported in ``problems``)."""
    if not os.path.lexists(path) and os.path.lexists(path.parent / CHECKPOINT_FILE):
        problems.append(
            f"the key index {path} is missing (a writer's open creates it); every key is "
            "re-indexed from the log"
        )
    try:
        return KeyIndex(path)
    except sqlite3.DatabaseError as exc:
        if _busy(exc):
            raise StoreWriteError(errno.EBUSY, f"the key index {path} is in use: {exc}") from exc
        failure = exc
    try:
        stamp = time.time_ns()
        moved = [
            move_to_recovered(side, stamp)
            for side in [path] + [path.with_name(path.name + s) for s in _SIDE_FILES]
            if os.path.lexists(side)
        ]
        index = KeyIndex(path)
    except (OSError, sqlite3.Error) as exc:
        raise StoreWriteError(
            errno.EIO, f"rebuilding the damaged key index {path} failed: {exc}"
        ) from exc
    problems.append(
        f"the key index {path} cannot be read ({failure}); moved to "
        f"{', '.join(map(str, moved)) or 'nowhere (it was gone)'}; every key is re-indexed "
        "from the log"
    )
    return index


def _no_space(path: Path) -> bool:
    try:
        return os.statvfs(path.parent).f_bavail == 0
    except OSError:
        return False


def _at_size_limit(path: Path) -> bool:
    """A file of the index is within one write of the process's file size limit."""
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit == resource.RLIM_INFINITY:
        return False
    for suffix in ("", "-wal", "-journal"):
        try:
            size = os.stat(f"{path}{suffix}").st_size
        except OSError:
            continue
        if size + _LARGEST_WRITE > limit:
            return True
    return False
