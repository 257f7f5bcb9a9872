"""A power-loss model: what the flushes made durable, and the disk a power cut leaves.

``recording(root)`` patches the lowest flush seams of the process, whoever calls
them: ``os.fsync``, ``os.fdatasync``, ``os.pwritev`` and ``mmap.mmap`` (every mapping created
while it is active is a ``RecordingMmap``, whose ``flush`` is msync). For files
and directories under ``root`` a flush does not reach the device; instead the
recorder notes what it made durable:

* fsync/fdatasync of a file: the whole file as it is now (its data and size);
* msync of a mapped range, or a write with ``RWF_DSYNC``: those bytes;
* fsync of a directory: its entries as they are now (name -> inode), so a file
  created, renamed over or removed since the directory's last fsync reverts.

Whatever is under ``root`` when recording starts counts as durable. The power
fails either at a chosen flush of the test thread (``cut_at``: the
recorder captures the files as they are and raises ``PowerCut`` in the test
thread, before or after that flush took effect), or when the test calls
``cut()``. With ``snapshot_at`` the power never fails: at each flush of the test thread
it names, the recorder captures the files as a cut there would have (before or after the
flush took effect) and hands the image to ``on_snapshot``, and the run goes on; a test
that cuts a deterministic workload at every flush in turn runs it once instead of once
a cut. ``materialize`` then writes the disk a power loss could leave: for
every file, every page whose content differs from the durable content has
its non-durable bytes replaced (``Damage.pages``) by zeros, random bytes, their
old durable content, their new content (written back before the power
failed), or a mix page by page (torn at 512-byte sectors, too); each
directory either keeps its current entries or reverts to the entries of its
last fsync (``Damage.entries``; a directory never fsynced has none). Bytes
that were durable and not written since are never changed.

Out of the model: SQLite's files (``keys.sqlite*``: its fsyncs happen in C, out
of reach of these seams; they are kept as the page cache holds them) and the
``LOCK`` file, which holds no data. The store's root directory is assumed to
exist (creating its parent entry durably is the caller's business).
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
import random
import stat
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Ident = tuple[int, int]  # (st_dev, st_ino)

PAGE = mmap.PAGESIZE
SECTOR = 512
PAGE_KINDS = ("none", "old", "new", "zeros", "random", "mixed")
ENTRY_KINDS = ("keep", "revert", "mixed")

_REAL_FSYNC = os.fsync
_REAL_FDATASYNC = os.fdatasync
_REAL_PWRITEV = os.pwritev
_ACTIVE: FlushRecorder | None = None


class PowerCut(BaseException):  # not an Exception: store code must not catch it
    """Raised in the test thread at the chosen flush: the power failed there."""


def outside_model(name: str) -> bool:
    return name == "LOCK" or name.startswith("keys.sqlite")


@dataclass(frozen=True)
class Damage:
    """How a power loss treats what was not durable (see the module docstring)."""

    pages: str = "old"
    entries: str = "revert"
    seed: int = 0

    def __post_init__(self) -> None:
        assert self.pages in PAGE_KINDS and self.entries in ENTRY_KINDS, self

    @property
    def control(self) -> bool:
        """Nothing replaced: the disk holds exactly what the page cache held."""
        return self.pages == "none" and self.entries == "keep"

    def __str__(self) -> str:
        return f"pages={self.pages} entries={self.entries} seed={self.seed}"


@dataclass
class DiskImage:
    """The files under the root at the power cut, and what of them was durable."""

    root: Ident
    dirs: dict[Ident, dict[str, Ident]]  # every directory's entries now
    files: dict[Ident, bytes]  # every file's content now (removed ones still referenced too)
    durable_dirs: dict[Ident, dict[str, Ident]]  # entries as of each directory's last fsync
    durable_files: dict[Ident, bytes]  # content as of the flushes
    where: str  # at which flush the power failed


@dataclass
class DamageReport:
    counts: Counter[str] = field(default_factory=Counter)


class FlushRecorder:
    """The seams' state: what is durable, and the power cut (see the module docstring)."""

    def __init__(
        self,
        root: Path,
        *,
        cut_at: int | None = None,
        cut_after: bool = False,
        snapshot_at: Callable[[int], bool | None] | None = None,
        on_snapshot: Callable[[DiskImage, list[str]], None] | None = None,
    ) -> None:
        self.root = Path(os.path.realpath(root))
        self._prefix = str(self.root) + os.sep
        self.cut_at = cut_at
        self.cut_after = cut_after
        # flush number -> None (no snapshot), False (before it took effect), True (after)
        self.snapshot_at = snapshot_at
        self.on_snapshot = on_snapshot
        self.events = 0  # flushes by the test thread so far
        self.trail: list[str] = []  # "n: op path" of the test thread's flushes
        self.image: DiskImage | None = None
        self._test_thread = threading.get_ident()
        self._lock = threading.Lock()
        self._recording = True
        self._durable_files: dict[Ident, bytearray] = {}
        self._durable_dirs: dict[Ident, dict[str, Ident]] = {}
        self._pins: dict[Ident, int] = {}  # open fds: a recorded inode number is never reused
        self._record_existing()

    # --- the seams ---------------------------------------------------------------------

    def fsync(self, fd: Any) -> None:
        self._on_sync(fd, "fsync", _REAL_FSYNC)

    def fdatasync(self, fd: Any) -> None:
        self._on_sync(fd, "fdatasync", _REAL_FDATASYNC)

    def pwritev(self, fd: int, buffers: Sequence[Any], offset: int, flags: int = 0) -> int:
        """A write with RWF_DSYNC is durable by itself: its bytes, at once."""
        written = _REAL_PWRITEV(fd, buffers, offset, flags)
        path = _fd_path(fd)
        if flags & getattr(os, "RWF_DSYNC", 0) and path is not None and self.tracks(path):
            st = os.fstat(fd)
            data = b"".join(bytes(b) for b in buffers)[:written]
            self._flush_event(
                "pwritev(RWF_DSYNC)",
                path,
                lambda: self._record_range((st.st_dev, st.st_ino), offset, data),
            )
        return written

    def _on_sync(self, fd: Any, op: str, real: Callable[[int], None]) -> None:
        fd = fd if isinstance(fd, int) else fd.fileno()
        path = _fd_path(fd)
        if path is None or not self.tracks(path):
            real(fd)
            return
        self._flush_event(op, path, lambda: self._record_fd(fd))

    def tracks(self, path: str) -> bool:
        return path == str(self.root) or path.startswith(self._prefix)

    def on_map(self, mm: RecordingMmap, fileno: int, offset: int) -> None:
        path = _fd_path(fileno)
        if path is None or not self.tracks(path):
            return
        st = os.fstat(fileno)
        ident = (st.st_dev, st.st_ino)
        with self._lock:
            self._pin(ident, lambda: os.open(f"/proc/self/fd/{fileno}", os.O_RDONLY))
        mm._eq_recorder, mm._eq_ident, mm._eq_offset, mm._eq_path = self, ident, offset, path

    def on_msync(self, mm: RecordingMmap, offset: int, size: int) -> None:
        assert mm._eq_ident is not None

        def record() -> None:
            assert mm._eq_ident is not None
            self._record_range(mm._eq_ident, mm._eq_offset + offset, mm[offset : offset + size])

        self._flush_event("msync", mm._eq_path, record)

    def _flush_event(self, op: str, path: str, record: Callable[[], None]) -> None:
        if threading.get_ident() != self._test_thread:
            with self._lock:  # blocks while the test thread captures the image
                if self._recording:
                    record()
            return
        if not self._recording:
            return  # the power is off: nothing becomes durable any more
        self.events += 1
        where = f"{self.events}: {op} {os.path.relpath(path, self.root)}"
        self.trail.append(where)
        if self.events == self.cut_at:
            if self.cut_after:
                with self._lock:
                    record()
            self.cut(_cut_where(where, self.cut_after))
            raise PowerCut(self.image.where if self.image else where)
        after = None if self.snapshot_at is None else self.snapshot_at(self.events)
        with self._lock:  # the image and the test's own state taken as at a cut
            if after is False:
                self._snapshot(where, after)
            record()
            if after:
                self._snapshot(where, after)

    def _snapshot(self, where: str, after: bool) -> None:
        assert self.on_snapshot is not None
        self.on_snapshot(self._capture(_cut_where(where, after)), list(self.trail))

    def while_powered(self, call: Callable[[], None]) -> bool:
        """Run ``call`` (bookkeeping of another thread, e.g. noting an acknowledgement)
        if the power is still on, atomically with respect to the cut; True if it ran."""
        with self._lock:
            if self._recording:
                call()
                return True
        return False

    # --- recording ---------------------------------------------------------------------

    def _pin(self, ident: Ident, opener: Callable[[], int]) -> None:
        if ident not in self._pins:
            with contextlib.suppress(OSError):
                self._pins[ident] = opener()

    def _record_fd(self, fd: int) -> None:
        st = os.fstat(fd)
        ident = (st.st_dev, st.st_ino)
        if stat.S_ISDIR(st.st_mode):
            entries: dict[str, Ident] = {}
            with os.scandir(f"/proc/self/fd/{fd}") as scan:
                for entry in scan:
                    child = (st.st_dev, entry.inode())
                    entries[entry.name] = child
                    if not outside_model(entry.name):  # closing an fd drops SQLite's locks
                        self._pin(child, functools.partial(os.open, entry.path, os.O_RDONLY))
            self._durable_dirs[ident] = entries
            return
        self._pin(ident, lambda: os.open(f"/proc/self/fd/{fd}", os.O_RDONLY))
        self._durable_files[ident] = bytearray(_read_fd(self._pins.get(ident, fd)))

    def _record_existing(self) -> None:
        """What is under the root when recording starts is on disk: durable as it is."""
        for directory, _, names in os.walk(self.root):
            for name in [".", *(n for n in names if not outside_model(n))]:
                fd = os.open(os.path.join(directory, name), os.O_RDONLY)
                try:
                    self._record_fd(fd)
                finally:
                    os.close(fd)

    def _record_range(self, ident: Ident, start: int, data: bytes) -> None:
        durable = self._durable_files.setdefault(ident, bytearray())
        if len(durable) < start + len(data):
            durable.extend(bytes(start + len(data) - len(durable)))
        durable[start : start + len(data)] = data

    # --- the power cut -----------------------------------------------------------------

    def cut(self, where: str = "at the end of the run") -> DiskImage:
        """The power fails now: capture the files; nothing becomes durable after this."""
        with self._lock:
            if self.image is None:
                self.image = self._capture(where)
            self._recording = False
        return self.image

    def _capture(self, where: str) -> DiskImage:
        root_stat = os.stat(self.root)
        root = (root_stat.st_dev, root_stat.st_ino)
        dirs: dict[Ident, dict[str, Ident]] = {}
        files: dict[Ident, bytes] = {}
        stack = [(self.root, root)]
        while stack:
            directory, ident = stack.pop()
            entries: dict[str, Ident] = {}
            with os.scandir(directory) as scan:
                for entry in scan:
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:  # renamed away (a temp file) since the listing
                        continue
                    child = (st.st_dev, st.st_ino)
                    if stat.S_ISDIR(st.st_mode):
                        stack.append((Path(entry.path), child))
                    elif stat.S_ISREG(st.st_mode):
                        try:
                            files[child] = Path(entry.path).read_bytes()
                        except FileNotFoundError:
                            continue
                    entries[entry.name] = child
            dirs[ident] = entries
        for ident, fd in self._pins.items():
            if ident not in files and ident not in dirs and stat.S_ISREG(os.fstat(fd).st_mode):
                files[ident] = _read_fd(fd)  # removed since: a durable entry may name it
        return DiskImage(
            root,
            dirs,
            files,
            {k: dict(v) for k, v in self._durable_dirs.items()},
            {k: bytes(v) for k, v in self._durable_files.items()},
            where,
        )

    def close(self) -> None:
        with self._lock:
            self._recording = False
            for fd in self._pins.values():
                os.close(fd)
            self._pins.clear()


class RecordingMmap(mmap.mmap):
    """mmap.mmap whose flush (msync) of a mapping under the recorder's root is recorded."""

    _eq_recorder: FlushRecorder | None
    _eq_ident: Ident | None
    _eq_offset: int
    _eq_path: str

    def __new__(cls, fileno: int, length: int, *args: Any, **kwargs: Any) -> RecordingMmap:
        self = super().__new__(cls, fileno, length, *args, **kwargs)
        self._eq_recorder = self._eq_ident = None
        recorder = _ACTIVE
        if recorder is not None and fileno >= 0 and _writable_shared(args, kwargs):
            offset = kwargs.get("offset", args[3] if len(args) > 3 else 0)
            recorder.on_map(self, fileno, offset)
        return self

    def flush(self, offset: int = 0, size: int | None = None) -> None:
        recorder = self._eq_recorder
        if recorder is not None and recorder is _ACTIVE:
            recorder.on_msync(self, offset, len(self) - offset if size is None else size)
        elif size is None:
            super().flush(offset)
        else:
            super().flush(offset, size)


def _writable_shared(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    names = ("flags", "prot", "access")
    given = dict(zip(names, args, strict=False)) | kwargs
    access = given.get("access", mmap.ACCESS_DEFAULT)
    if access != mmap.ACCESS_DEFAULT:
        return bool(access == mmap.ACCESS_WRITE)
    flags = given.get("flags", mmap.MAP_SHARED)
    prot = given.get("prot", mmap.PROT_READ | mmap.PROT_WRITE)
    return bool(flags & mmap.MAP_SHARED and prot & mmap.PROT_WRITE)


def _fd_path(fd: int) -> str | None:
    try:
        path = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    return path.removesuffix(" (deleted)")


def _read_fd(fd: int) -> bytes:
    size = os.fstat(fd).st_size
    chunks = []
    offset = 0
    while offset < size:
        block = os.pread(fd, size - offset, offset)
        if not block:
            break
        chunks.append(block)
        offset += len(block)
    return b"".join(chunks)


def _cut_where(where: str, after: bool) -> str:
    return f"flush {where}, {'after' if after else 'before'} it took effect"


@contextlib.contextmanager
def recording(
    root: Path,
    *,
    cut_at: int | None = None,
    cut_after: bool = False,
    snapshot_at: Callable[[int], bool | None] | None = None,
    on_snapshot: Callable[[DiskImage, list[str]], None] | None = None,
) -> Iterator[FlushRecorder]:
    """Record the flushes of files under ``root`` (see the module docstring)."""
    global _ACTIVE
    assert _ACTIVE is None, "one recorder at a time"
    recorder = FlushRecorder(
        root, cut_at=cut_at, cut_after=cut_after, snapshot_at=snapshot_at, on_snapshot=on_snapshot
    )
    patches: list[tuple[Any, str, Any]] = [
        (os, "fsync", recorder.fsync),
        (os, "fdatasync", recorder.fdatasync),
        (os, "pwritev", recorder.pwritev),
        (mmap, "mmap", RecordingMmap),
    ]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    _ACTIVE = recorder
    for module, name, value in patches:
        setattr(module, name, value)
    try:
        yield recorder
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
        _ACTIVE = None
        recorder.close()


# --- the disk after the power cut ----------------------------------------------------------


def materialize(image: DiskImage, dest: Path, damage: Damage) -> DamageReport:
    """Write into ``dest`` (which must not exist) what the disk holds after the power loss."""
    rng = random.Random(damage.seed)
    report = DamageReport()
    directories = set(image.dirs) | set(image.durable_dirs)

    def build(ident: Ident, out: Path) -> None:
        out.mkdir()
        current = image.dirs.get(ident, {})
        mode = damage.entries if damage.entries != "mixed" else rng.choice(("keep", "revert"))
        chosen = dict(current) if mode == "keep" else dict(image.durable_dirs.get(ident, {}))
        for name in [n for n in chosen if outside_model(n)]:
            del chosen[name]
        chosen.update((n, i) for n, i in current.items() if outside_model(n))
        report.counts["entries lost"] += len(current.keys() - chosen.keys())
        for name, child in current.items():
            if name in chosen and chosen[name] != child:
                report.counts["entries reverted"] += 1
        for name, child in sorted(chosen.items()):
            if child in directories:
                build(child, out / name)
            elif child in image.files or child in image.durable_files:
                (out / name).write_bytes(content(child, name))

    def content(ident: Ident, name: str) -> bytes:
        now = image.files.get(ident)
        durable = image.durable_files.get(ident)
        if outside_model(name):
            return now or b""
        if now is None:
            return durable or b""
        return damage_bytes(now, durable or b"", damage.pages, rng, report)

    build(image.root, dest)
    return report


def damage_bytes(
    now: bytes, durable: bytes, kind: str, rng: random.Random, report: DamageReport | None = None
) -> bytes:
    """The content of one file after the power loss (see the module docstring)."""
    counts = report.counts if report is not None else Counter[str]()
    if kind == "none" or now == durable:
        return now
    size = len(now)
    if len(durable) != len(now) and (kind == "old" or (kind == "mixed" and rng.random() < 0.5)):
        size = len(durable)
    new = now.ljust(size, b"\0")[:size]
    out = bytearray(durable.ljust(size, b"\0")[:size])
    for start in range(0, size, PAGE):
        stop = min(start + PAGE, size)
        if new[start:stop] == out[start:stop]:
            continue
        counts["dirty pages"] += 1
        how = kind if kind != "mixed" else rng.choice(("old", "new", "zeros", "random", "torn"))
        counts[f"pages {how}"] += 1
        if how == "new":
            out[start:stop] = new[start:stop]
        elif how == "torn":
            for sector in range(start, stop, SECTOR):
                if rng.random() < 0.5:
                    out[sector : min(sector + SECTOR, stop)] = new[
                        sector : min(sector + SECTOR, stop)
                    ]
        elif how in ("zeros", "random"):
            noise = rng.randbytes(stop - start) if how == "random" else bytes(stop - start)
            for i in range(start, stop):
                if new[i] != out[i]:
                    out[i] = noise[i - start]
    return bytes(out)
