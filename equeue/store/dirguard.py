"""The writer's check that STORE is still the directory it opened and STORE/LOCK the file
it locked.

Metadata (checkpoint.json, topics.json, offsets.json, consumers/) is written by path. A
store directory removed and made again, or moved, under a running writer would take
those writes: its checkpoint then claims records the new store never had. The lock
cannot see it (the flock is on the old LOCK's inode), so the writer compares
(st_dev, st_ino) of both with what it opened before each metadata write and at every
checkpoint: two stat calls, against the fsyncs each of those writes does anyway. A
mismatch is sticky: the handle writes nothing more by path, and sends are refused."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from equeue.errors import StoreReplacedError
from equeue.store.meta import LOCK_FILE

_Id = tuple[int, int]


def _id(st: os.stat_result) -> _Id:
    return st.st_dev, st.st_ino


def _stat_id(path: str) -> _Id | None:
    try:
        return _id(os.stat(path))
    except OSError:  # gone (or unreadable): not the one opened either way
        return None


def _say(ids: _Id | None) -> str:
    return "nothing" if ids is None else f"device {ids[0]} inode {ids[1]}"


class DirectoryGuard:
    def __init__(self, path: Path, lock_fd: int) -> None:
        self.path = path
        self._paths = str(path), str(path / LOCK_FILE)  # (stat takes a str fastest)
        self._directory = _id(os.stat(path))
        self._lock = _id(os.fstat(lock_fd))
        self.failure: StoreReplacedError | None = None

    def check(self) -> None:
        """StoreReplacedError (the same one from the first mismatch on) unless STORE and
        STORE/LOCK are still what this writer opened."""
        if self.failure is None:
            directory, lock = _stat_id(self._paths[0]), _stat_id(self._paths[1])
            if directory == self._directory and lock == self._lock:
                return
            self.failure = self._replaced(directory, lock)
        raise _copy(self.failure)

    def _replaced(self, directory: _Id | None, lock: _Id | None) -> StoreReplacedError:
        lock_path = self.path / LOCK_FILE
        error = StoreReplacedError(
            errno.ESTALE,
            f"the store directory {self.path} is no longer the one this writer opened "
            f"(removed and made again, or moved, while open): expected {self.path} "
            f"({_say(self._directory)}) with {lock_path} ({_say(self._lock)}), found "
            f"{self.path} ({_say(directory)}) with {lock_path} ({_say(lock)}); this handle "
            f"writes nothing more there (the checkpoint and metadata of another store would "
            f"be overwritten) and refuses sends: close it and open {self.path} again",
        )
        error.expected = (self._directory, self._lock)
        error.found = (directory, lock)
        return error


def _copy(error: StoreReplacedError) -> StoreReplacedError:
    # A fresh instance per raise: one raised again and again would grow its traceback.
    copy = StoreReplacedError(*error.args)
    copy.expected, copy.found = error.expected, error.found
    return copy
