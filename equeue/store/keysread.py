"""How ``keys.sqlite`` is opened without changing a file of the store: by a read-only
handle (equeue/store/follow.py) and by ``equeue verify`` (equeue/inspect/traces.py).

It depends on the writer, so the state is checked again before each use:

- a writer runs: ``mode=ro``; the writer keeps the -wal and -shm files, and the reader
  shares the -shm with it, as every WAL reader must (while the writer opens or closes
  and either file is missing, ``immutable=1``: mode=ro would create them);
- no writer and no -wal file: ``immutable=1``; every commit is in the database file;
- no writer, a -wal and its -shm (a killed writer, or one that closed while a reader
  had the file open): ``readonly_shm=1``; SQLite reads the WAL into private memory and
  writes nothing (``mode=ro`` alone would write the -shm, and create both files when
  they are missing);
- no writer, a -wal but no -shm: the WAL cannot be read without creating the -shm, so
  only the database file is read (``immutable=1``): what the WAL holds is not seen.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

from equeue.store.meta import writer_running


class KeysState(NamedTuple):
    """What decides how SQLite is opened; a change means reopening. ``file``: the database
    file's (inode, size, mtime), None if there is none; True beside a running writer
    (without a writer the file's identity counts: one that starts may change it)."""

    running: bool
    file: tuple[int, int, int] | bool | None
    wal: bool  # a -wal file (without a writer: a non-empty one)
    shm: bool


def _identity(path: Path) -> tuple[int, int, int] | None:
    """(inode, size, mtime) of a file, None if there is none."""
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return None
    return stat.st_ino, stat.st_size, stat.st_mtime_ns


def keys_state(path: Path) -> KeysState:
    """The state of the key index ``path`` (keys.sqlite in a store directory)."""
    running = writer_running(path.parent)
    file = _identity(path)
    if file is None:
        return KeysState(running, None, False, False)
    wal = _identity(path.with_name(path.name + "-wal"))
    shm = _identity(path.with_name(path.name + "-shm")) is not None
    if running:
        # Its -wal and -shm are missing only while it opens or closes; mode=ro would
        # then create them.
        return KeysState(True, True, wal is not None, shm)
    return KeysState(False, file, wal is not None and wal[1] > 0, shm)


def keys_uri(path: Path, state: KeysState, *, fallback: bool = False) -> str:
    """The SQLite URI that reads ``path`` in ``state`` without writing; ``fallback``: the
    database file alone, whatever the state."""
    if state.file is None:
        return "file::memory:"  # a store that never indexed a key (yet)
    if state.wal and state.shm and not fallback:
        return f"file:{path}?mode=ro" + ("" if state.running else "&readonly_shm=1")
    return f"file:{path}?mode=ro&immutable=1"


def wal_unread(state: KeysState, uri: str) -> bool:
    """Whether ``uri`` leaves out a WAL that holds commits (tables, even, in a new store)."""
    return state.wal and "immutable=1" in uri
