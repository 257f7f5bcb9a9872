"""Opening the store's own paths without following what someone else put there.

The store creates every file and directory under its root itself, and never a
symbolic link, so a link there (``LOCK`` -> ``/etc/passwd``, ``messages/recovered``
-> ``/tmp``) was planted: following it would truncate or write a file outside the
store. Every open of a store file goes through ``open_fd`` (``O_NOFOLLOW``, and a
regular file or an error), every directory the store writes into is checked by
``check_dir`` (``lstat``), and a file found where a directory belongs (or the
reverse) is a ``StorePathError`` naming the path, not a raw ``IsADirectoryError``.
The store's root itself is the caller's choice and may be a link.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any, BinaryIO, Literal, overload

from equeue.errors import StorePathError
from equeue.format.chunk import RECOVERED_DIR, TEMP_SUFFIX, parse_chunk_file_name

_LINK = (
    "is a symbolic link; equeue follows no symbolic link inside a store (it could read or "
    "write outside it): put the {kind} itself there"
)


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISREG(mode):
        return "a regular file"
    return "a special file (socket, pipe or device)"


def _refuse(path: Path | str, mode: int, want_dir: bool) -> StorePathError:
    kind = "directory" if want_dir else "file"
    if stat.S_ISLNK(mode):
        return StorePathError(_LINK.format(kind=kind), file=path)
    return StorePathError(f"is {_kind(mode)} where the store keeps a {kind}", file=path)


def _not_a_directory(path: Path | str) -> StorePathError:
    """ENOTDIR: some directory on the way to ``path`` is something else; name it."""
    for parent in Path(path).parents:
        try:
            mode = os.stat(parent).st_mode  # as the lookup saw it: the root may be a link
        except OSError:
            continue
        if not stat.S_ISDIR(mode):
            return _refuse(parent, mode, want_dir=True)
    return StorePathError("a directory on the way to it is not a directory", file=path)


def open_fd(path: Path | str, flags: int, mode: int = 0o644) -> int:
    """``os.open`` of a store file: never through a symbolic link, and only a regular file
    (a directory opens read-only without complaint, and only its reads would fail).
    StorePathError for either; any other OSError is raised as it is."""
    try:
        # O_NONBLOCK: a FIFO planted there must not hang the open (regular files ignore it).
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            try:
                found = os.lstat(path).st_mode
            except OSError:
                raise exc from None
            if stat.S_ISREG(found):
                raise  # not about this entry (a loop of links above it, say)
            raise _refuse(path, found, want_dir=False) from None
        if exc.errno == errno.ENOTDIR:
            raise _not_a_directory(path) from None
        raise
    try:
        found = os.fstat(fd).st_mode
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(found):
        os.close(fd)
        raise _refuse(path, found, want_dir=False)
    return fd


def opener(path: str, flags: int) -> int:
    """For ``open(path, mode, opener=opener)``: the file as ``open_fd`` opens it."""
    return open_fd(path, flags)


@overload
def open_file(path: Path | str, mode: Literal["a+"], buffering: int = -1) -> IO[str]: ...
@overload
def open_file(
    path: Path | str, mode: Literal["rb", "r+b", "xb"], buffering: int = -1
) -> BinaryIO: ...
def open_file(path: Path | str, mode: str, buffering: int = -1) -> IO[Any]:
    """``open(path, mode)`` through ``open_fd``."""
    return open(path, mode, buffering=buffering, opener=opener)


def check_file(path: Path | str) -> bool:
    """Whether the store file ``path`` exists (False: it does not); StorePathError if
    it is a link, a directory or anything but a regular file."""
    return _check_kind(path, want_dir=False)


def check_dir(path: Path | str) -> bool:
    """Whether the store directory ``path`` exists (False: it does not); StorePathError
    if it is a link or not a directory."""
    return _check_kind(path, want_dir=True)


def _check_kind(path: Path | str, *, want_dir: bool) -> bool:
    try:
        found = os.lstat(path).st_mode
    except FileNotFoundError:
        return False
    except NotADirectoryError:
        raise _not_a_directory(path) from None
    if not (stat.S_ISDIR(found) if want_dir else stat.S_ISREG(found)):
        raise _refuse(path, found, want_dir=want_dir)
    return True


def ensure_dir(path: Path) -> bool:
    """Create the store directory ``path`` unless it exists (checked as ``check_dir``);
    True if it was created, so that the caller fsyncs its parent."""
    if check_dir(path):
        return False
    try:
        os.mkdir(path)
    except FileExistsError:  # created meanwhile (another thread): as good, if it is one
        check_dir(path)
        return False
    except NotADirectoryError:
        raise _not_a_directory(path) from None
    return True


def check_chunk_dir(directory: Path, names: Iterable[str]) -> None:
    """The entries of a chunk directory the store opens or removes: chunk files are
    regular files, ``recovered/`` a directory, and a leftover temp file (unlinked at
    open) is no directory."""
    for name in names:
        path = directory / name
        if parse_chunk_file_name(name) is not None:
            check_file(path)
        elif name == RECOVERED_DIR:
            check_dir(path)
        elif name.endswith(TEMP_SUFFIX):
            check_removable(path)


def check_removable(path: Path) -> None:
    """A temp file the store unlinks: a link is removed, not followed, so only a
    directory there is in the way."""
    try:
        found = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(found):
        raise _refuse(path, found, want_dir=False)


def check_store(root: Path, files: Iterable[str], dirs: Iterable[str]) -> None:
    """The store's own entries at its root (``files``, ``dirs``) and its temp files."""
    if not os.path.isdir(root):
        return  # not a store directory: the caller says what it is
    for name in files:
        check_file(root / name)
    for name in dirs:
        check_dir(root / name)
    for name in os.listdir(root):
        if name.endswith(TEMP_SUFFIX):
            check_removable(root / name)


def check_chunk_dirs(directories: Iterable[Path]) -> None:
    """For the inspector, which opens no ChunkManager: each directory as ``check_dir``,
    its entries as ``check_chunk_dir``."""
    for directory in directories:
        if check_dir(directory):
            check_chunk_dir(directory, os.listdir(directory))
