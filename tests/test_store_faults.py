"""Disk full and I/O errors: ENOSPC and EIO injected at each OS call the store makes
when it writes, plus one test against a real file size limit.

The calls are replaced where the store's modules look them up: a stand-in for
the ``os`` module inside the chunk's and the manager's modules (equeue.chunks.chunk,
fileops, mapping, completion, opening, refresh, removal), equeue.chunks.recovery
and equeue.atomicfile (open, posix_fallocate, ftruncate,
write, pwrite, pwritev, fsync, fdatasync, rename, replace), a wrapped built-in ``open``
in the modules that write through file objects, an ``mmap.mmap`` subclass in
equeue.chunks.mapping (its creation and its flush, the msync), ``os.mkdir`` (the
queue directories of a new topic) and a wrapped SQLite connection (the key
index). A rule fails (or, in a control, only records) the calls of one kind
on one file, made by the test's own thread; so every fault hits exactly one
step of one send, and the control proves that step is on that send's path.

For every fault on the send path:

* the send raises a StoreWriteError (DiskFullError for ENOSPC, not for EIO)
  whose errno is the injected one and whose message names the error and the file;
* nothing of the message is visible: every queue's next offset is unchanged,
  no pull, read or key lookup finds it;
* everything acknowledged before still reads back byte-identical;
* once the fault is removed, the same store object sends again (the new
  message is readable), and after close and reopen everything acknowledged is
  there, nothing unacknowledged is, and recovery has nothing to report.

Each case has a control: the same steps with the rule only recording; the
send succeeds and nothing is reported.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import json
import mmap
import os
import re
import sqlite3
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pytest
from code_paths import code_path  # noqa: F401 - the fixture
from store_helpers import Sent, assert_all_readable, frame_size, pull_all, send, send_batch

import equeue.atomicfile
import equeue.chunks.chunk
import equeue.chunks.completion
import equeue.chunks.fileops
import equeue.chunks.manager
import equeue.chunks.mapping
import equeue.chunks.opening
import equeue.chunks.recovery
import equeue.chunks.refresh
import equeue.chunks.removal
import equeue.chunks.space
import equeue.safepath
import equeue.store.keyindex
import equeue.store.topicsfile
from equeue import MessageStore, OutgoingMessage, SendResult, StoreConfig
from equeue.errors import DiskFullError, MessageNotFoundError, StoreWriteError, TopicNotFoundError

CHUNK = 4096
RECORDS = 342  # entries per queue chunk
CONFIG = StoreConfig(
    chunk_data_size=CHUNK, queue_chunk_records=RECORDS, default_queue_count=2, flush="sync"
)
ERRORS = [
    pytest.param(errno.ENOSPC, id="ENOSPC"),
    pytest.param(errno.EIO, id="EIO"),
    pytest.param(None, id="control"),
]
FAILED_BODY = b"FAILED: this message was never acknowledged"
RETRY_BODY = b"RETRIED: sent once the fault was removed..."
FAILED_KEY = "key-failed"
RETRY_KEY = "key-retry!"
assert len(FAILED_BODY) == len(RETRY_BODY) and len(FAILED_KEY) == len(RETRY_KEY)


# --- fault injection ---------------------------------------------------------------------


def fd_path(fd: int) -> Path:
    return Path(os.readlink(f"/proc/self/fd/{fd}"))


@dataclass
class Rule:
    kind: str
    match: Callable[[Path], bool]
    error: int | None  # the errno to fail with; None records the call only
    thread: int | None  # only calls made by this thread; None: any
    hits: list[Path] = field(default_factory=list)
    hit_threads: list[int] = field(default_factory=list)  # the thread of each hit


class Faults:
    """The armed rules; every wrapped call asks ``check`` first."""

    def __init__(self) -> None:
        self.rules: list[Rule] = []
        self.no_fallocate = False  # posix_fallocate answers EOPNOTSUPP (as on some file systems)

    def add(
        self,
        kind: str,
        match: Callable[[Path], bool],
        error: int | None,
        *,
        any_thread: bool = False,
    ) -> Rule:
        rule = Rule(kind, match, error, None if any_thread else threading.get_ident())
        self.rules.append(rule)
        return rule

    def clear(self) -> None:
        self.rules = []

    def check(self, kind: str, path: str | os.PathLike[str]) -> None:
        resolved = Path(os.path.abspath(path))
        for rule in list(self.rules):
            if rule.kind != kind or rule.thread not in (None, threading.get_ident()):
                continue
            if rule.match(resolved):
                rule.hits.append(resolved)
                rule.hit_threads.append(threading.get_ident())
                if rule.error is not None:
                    raise OSError(rule.error, os.strerror(rule.error), str(resolved))


class OsProxy:
    """Stands in for the ``os`` module inside one equeue module."""

    def __init__(self, faults: Faults) -> None:
        self._faults = faults

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def open(self, path: str | os.PathLike[str], flags: int, mode: int = 0o777, **kw: Any) -> int:
        if flags & os.O_CREAT:
            self._faults.check("create", path)
        elif flags & (os.O_WRONLY | os.O_RDWR) and not os.path.isdir(path):
            self._faults.check("open", path)
        return os.open(path, flags, mode, **kw)

    def posix_fallocate(self, fd: int, offset: int, length: int) -> None:
        if self._faults.no_fallocate:
            raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))
        self._faults.check("allocate", fd_path(fd))
        os.posix_fallocate(fd, offset, length)

    def ftruncate(self, fd: int, length: int) -> None:
        self._faults.check("allocate", fd_path(fd))
        os.ftruncate(fd, length)

    def write(self, fd: int, data: bytes) -> int:
        self._faults.check("write", fd_path(fd))
        return os.write(fd, data)

    def pwrite(self, fd: int, data: bytes, offset: int) -> int:
        self._faults.check("write", fd_path(fd))
        return os.pwrite(fd, data, offset)

    def pwritev(self, fd: int, buffers: list[bytes], offset: int, flags: int = 0) -> int:
        self._faults.check("write", fd_path(fd))
        if flags & getattr(os, "RWF_DSYNC", 0):
            self._sync(fd)
        return os.pwritev(fd, buffers, offset, flags)

    def _sync(self, fd: int) -> None:
        path = fd_path(fd)
        self._faults.check("dirsync" if path.is_dir() else "sync", path)

    def fsync(self, fd: int) -> None:
        self._sync(fd)
        os.fsync(fd)

    def fdatasync(self, fd: int) -> None:
        self._sync(fd)
        os.fdatasync(fd)

    def rename(self, src: str | os.PathLike[str], dst: str | os.PathLike[str], **kw: Any) -> None:
        self._faults.check("rename", src)
        os.rename(src, dst, **kw)

    def replace(self, src: str | os.PathLike[str], dst: str | os.PathLike[str], **kw: Any) -> None:
        self._faults.check("rename", src)
        os.replace(src, dst, **kw)


class FaultyFile:
    """A file object whose writes (and the flush that hands them to the OS) can fail."""

    def __init__(self, file: Any, path: Path, faults: Faults) -> None:
        self._file = file
        self._path = path
        self._faults = faults

    def write(self, data: bytes) -> int:
        self._faults.check("write", self._path)
        return int(self._file.write(data))

    def flush(self) -> None:
        self._faults.check("write", self._path)
        self._file.flush()

    def __enter__(self) -> FaultyFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)


def faulty_open(faults: Faults) -> Callable[..., Any]:
    def open_(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if isinstance(file, int) or not any(c in mode for c in "wax+"):
            return builtins.open(file, mode, *args, **kwargs)
        faults.check("open" if "r" in mode else "create", file)
        return FaultyFile(builtins.open(file, mode, *args, **kwargs), Path(file), faults)

    return open_


class FaultyMmap(mmap.mmap):
    """Writable mappings whose creation and flush (msync) can fail."""

    faults: ClassVar[Faults | None] = None
    fault_path: Path

    def __new__(cls, fileno: int, length: int, *args: Any, **kwargs: Any) -> FaultyMmap:
        path = fd_path(fileno)
        access = kwargs.get("access", mmap.ACCESS_DEFAULT)
        if cls.faults is not None and access != mmap.ACCESS_READ:
            cls.faults.check("map", path)
        self = super().__new__(cls, fileno, length, *args, **kwargs)
        self.fault_path = path
        return self

    def flush(self, *args: int) -> None:
        if self.faults is not None:
            self.faults.check("sync", self.fault_path)
        super().flush(*args)


SQLITE_ERRORS = {
    errno.ENOSPC: (sqlite3.SQLITE_FULL, "database or disk is full"),
    errno.EIO: (sqlite3.SQLITE_IOERR, "disk I/O error"),
}


class FaultyConnection:
    """A SQLite connection whose writes fail as SQLite reports a full disk or an I/O error."""

    def __init__(self, db: sqlite3.Connection, path: Path, faults: Faults) -> None:
        self._db = db
        self._path = path
        self._faults = faults

    def _check(self, sql: str) -> None:
        if sql.lstrip().upper().startswith(("INSERT", "DELETE", "UPDATE")):
            try:
                self._faults.check("sqlite", self._path)
            except OSError as exc:
                code, message = SQLITE_ERRORS[exc.errno or errno.EIO]
                error = sqlite3.OperationalError(message)
                error.sqlite_errorcode = code
                raise error from None

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
        self._check(sql)
        return self._db.execute(sql, *args)

    def executemany(self, sql: str, rows: Any) -> sqlite3.Cursor:
        self._check(sql)
        return self._db.executemany(sql, rows)

    def __enter__(self) -> FaultyConnection:
        self._db.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._db.__exit__(*exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._db, name)


class SqliteProxy:
    def __init__(self, faults: Faults) -> None:
        self._faults = faults

    def __getattr__(self, name: str) -> Any:
        return getattr(sqlite3, name)

    def connect(self, database: str, *args: Any, **kwargs: Any) -> FaultyConnection:
        path = Path(database.removeprefix("file:").split("?")[0])
        return FaultyConnection(sqlite3.connect(database, *args, **kwargs), path, self._faults)


@pytest.fixture
def faults(monkeypatch: pytest.MonkeyPatch) -> Iterator[Faults]:
    # The log's next chunk is made ahead on another thread (equeue/chunks/ahead.py) and a
    # roll-over only renames it; here every roll-over creates its chunk on the sending
    # thread, the path whose every step these rules fail (the made-ahead path's failures:
    # tests/test_chunk_ahead.py).
    monkeypatch.setattr(equeue.chunks.manager.ChunkManager, "_request_ahead", lambda self: None)
    injected = Faults()
    proxy = OsProxy(injected)
    for module in (
        equeue.chunks.chunk, equeue.chunks.fileops, equeue.chunks.mapping,
        equeue.chunks.completion, equeue.chunks.opening, equeue.chunks.refresh,
        equeue.chunks.removal, equeue.chunks.recovery, equeue.chunks.space, equeue.safepath,
    ):  # fmt: skip
        monkeypatch.setattr(module, "os", proxy)
    monkeypatch.setattr(equeue.atomicfile, "os", proxy)
    monkeypatch.setattr(equeue.store.topicsfile, "os", proxy)
    for module in (equeue.chunks.chunk, equeue.atomicfile):
        monkeypatch.setattr(module, "open", faulty_open(injected), raising=False)
    mmap_module = types.SimpleNamespace(**{k: getattr(mmap, k) for k in dir(mmap)})
    mmap_module.mmap = FaultyMmap
    monkeypatch.setattr(equeue.chunks.mapping, "mmap", mmap_module)
    monkeypatch.setattr(FaultyMmap, "faults", injected)
    real_mkdir = os.mkdir

    def mkdir(path: str | os.PathLike[str], mode: int = 0o777, **kw: Any) -> None:
        injected.check("mkdir", path)
        real_mkdir(path, mode, **kw)

    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(equeue.store.keyindex, "sqlite3", SqliteProxy(injected))
    yield injected
    injected.clear()


# --- paths the rules match ---------------------------------------------------------------


@dataclass
class Where:
    """What a scenario's trigger send will touch."""

    store: Path
    topic: str
    queue_id: int
    log_chunk: int  # the ongoing message chunk before the trigger
    queue_chunk: int  # the ongoing chunk of the target queue before the trigger

    @property
    def log_dir(self) -> Path:
        return self.store / "messages"

    @property
    def queue_dir(self) -> Path:
        return self.store / "queues" / self.topic / str(self.queue_id)


def chunk_name(number: int) -> str:
    return f"chunk-{number:012d}.0000"


def is_temp_of(directory: Path, number: int) -> Callable[[Path], bool]:
    return lambda p: (
        p.parent == directory
        and re.fullmatch(re.escape(chunk_name(number)) + r"\..*\.tmp", p.name) is not None
    )


def is_chunk_in(directory: Path) -> Callable[[Path], bool]:
    return lambda p: p.parent == directory and re.fullmatch(r"chunk-\d+\.\d+", p.name) is not None


def is_temp_of_file(directory: Path, name: str) -> Callable[[Path], bool]:
    return lambda p: p.parent == directory and p.name.startswith(name + ".") and p.suffix == ".tmp"


def is_path(path: Path) -> Callable[[Path], bool]:
    return lambda p: p == path


def is_under(path: Path) -> Callable[[Path], bool]:
    return lambda p: p == path or path in p.parents


Matcher = Callable[[Where], Callable[[Path], bool]]


@dataclass(frozen=True)
class Seam:
    scenario: str  # log-rollover, queue-rollover, new-topic, send
    kind: str
    target: Matcher
    what: str
    no_fallocate: bool = False
    # The record was written before the call failed (a failed fdatasync): the send
    # raises, and its message may stay, whole, or not (docs/durability.md).
    may_store: bool = False
    # A failed fdatasync of a chunk in use: no later flush of that chunk is attempted
    # (what it was to make durable may never be), so sending resumes after a reopen.
    final: bool = False


def new_log_temp(w: Where) -> Callable[[Path], bool]:
    return is_temp_of(w.log_dir, w.log_chunk + 1)


def new_log_chunk(w: Where) -> Callable[[Path], bool]:
    return is_path(w.log_dir / chunk_name(w.log_chunk + 1))


def old_log_chunk(w: Where) -> Callable[[Path], bool]:
    return is_path(w.log_dir / chunk_name(w.log_chunk))


def new_queue_temp(w: Where) -> Callable[[Path], bool]:
    return is_temp_of(w.queue_dir, w.queue_chunk + 1)


def new_queue_chunk(w: Where) -> Callable[[Path], bool]:
    return is_path(w.queue_dir / chunk_name(w.queue_chunk + 1))


def old_queue_chunk(w: Where) -> Callable[[Path], bool]:
    return is_path(w.queue_dir / chunk_name(w.queue_chunk))


def creation_seams(
    scenario: str, temp: Matcher, final: Matcher, old: Matcher, directory: Matcher
) -> dict[str, Seam]:
    return {
        f"{scenario}/create-temp-file": Seam(scenario, "create", temp, "creating the chunk file"),
        f"{scenario}/fallocate": Seam(scenario, "allocate", temp, "preallocating (fallocate)"),
        f"{scenario}/ftruncate": Seam(
            scenario, "allocate", temp, "sizing the file (ftruncate)", no_fallocate=True
        ),
        f"{scenario}/write-header": Seam(scenario, "write", temp, "writing the chunk header"),
        f"{scenario}/fsync-temp-file": Seam(scenario, "sync", temp, "fsync of the new chunk"),
        f"{scenario}/rename": Seam(scenario, "rename", temp, "renaming the chunk into place"),
        f"{scenario}/fsync-directory": Seam(
            scenario, "dirsync", directory, "fsync of the directory"
        ),
        f"{scenario}/open-new-chunk": Seam(scenario, "open", final, "opening the new chunk"),
        f"{scenario}/map-new-chunk": Seam(scenario, "map", final, "mapping the new chunk"),
        f"{scenario}/sync-completed-chunk": Seam(
            scenario, "sync", old, "flushing the completed chunk and its footer", final=True
        ),
    }


FRESH = "fresh"  # the topic the new-topic scenario creates by sending to it


def fresh_dir(w: Where) -> Path:
    return w.store / "queues" / FRESH


SEAMS: dict[str, Seam] = {
    **creation_seams(
        "log-rollover", new_log_temp, new_log_chunk, old_log_chunk, lambda w: is_path(w.log_dir)
    ),
    **creation_seams(
        "queue-rollover",
        new_queue_temp,
        new_queue_chunk,
        old_queue_chunk,
        lambda w: is_path(w.queue_dir),
    ),
    "new-topic/mkdir": Seam(
        "new-topic", "mkdir", lambda w: is_under(fresh_dir(w)), "creating the queue directories"
    ),
    "new-topic/fsync-topic-directory": Seam(
        "new-topic", "dirsync", lambda w: is_under(fresh_dir(w)), "fsync of the topic directory"
    ),
    "new-topic/create-queue-chunk": Seam(
        "new-topic", "create", lambda w: is_under(fresh_dir(w)), "creating the first queue chunk"
    ),
    "new-topic/fallocate-queue-chunk": Seam(
        "new-topic", "allocate", lambda w: is_under(fresh_dir(w)), "preallocating a queue chunk"
    ),
    # The topic's commit point: one record appended to topics.journal and fdatasynced
    # (topics.json is rewritten only by a fold: equeue/store/topicsfile.py).
    "new-topic/write-topics-journal": Seam(
        "new-topic", "write", lambda w: is_path(w.store / "topics.journal"), "topics.journal"
    ),
    "new-topic/fsync-topics-journal": Seam(
        "new-topic", "sync", lambda w: is_path(w.store / "topics.journal"), "topics.journal"
    ),
    "send/sync-log": Seam(
        "send",
        "sync",
        lambda w: is_chunk_in(w.log_dir),
        "flushing the message log (flush=sync)",
        may_store=True,
        final=True,
    ),
}


# --- scenarios -----------------------------------------------------------------------------


def base_traffic(store: MessageStore) -> list[Sent]:
    store.create_topic("t", 2)
    store.create_topic("u", 1)
    acked = []
    for i in range(12):
        acked.append(
            send(
                store,
                "t",
                b"t%02d " % i + bytes(range(i * 7 % 200, i * 7 % 200 + 40)),
                tag=f"tag{i % 3}",
                key=f"key{i % 4}",
                properties={"i": str(i)} if i % 2 else None,
                code=i,
                queue_id=i % 2,
            )
        )
        acked.append(send(store, "u", b"u%02d" % i * (1 + i % 5)))
    return acked


def last_end(acked: list[Sent]) -> tuple[int, int]:
    """(number of the chunk holding the last record, bytes left in it after the record)."""
    last = max(acked, key=lambda s: s.position)
    number, local = divmod(last.position, CHUNK)
    return number, CHUNK - local - last.frame_size


def fill_log(store: MessageStore, acked: list[Sent], topic: str, queue_id: int, room: int) -> None:
    """Send fillers as large as the trigger until the log chunk has ``room`` trigger-sized
    slots left (0: the next trigger-sized record starts the next chunk)."""
    frame = trigger_frame(topic)
    while True:
        _, left = last_end(acked)
        if room * frame <= left < (room + 1) * frame:
            return
        acked.append(
            send(store, topic, b"f" * len(FAILED_BODY), key="key-filler", queue_id=queue_id)
        )


def trigger_frame(topic: str) -> int:
    return frame_size(topic, FAILED_BODY, key=FAILED_KEY)


def prepare(store: MessageStore, scenario: str, acked: list[Sent]) -> Where:
    """Bring the store to the brink of what the trigger send will do."""
    topic, queue_id = {"queue-rollover": ("u", 0), "new-topic": (FRESH, 0)}.get(scenario, ("t", 0))
    if scenario == "log-rollover":
        fill_log(store, acked, topic, queue_id, 0)
    elif scenario == "queue-rollover":
        missing = -store.queue_range("u", 0)[1] % RECORDS
        acked += send_batch(store, "u", [OutgoingMessage(b"q%03d" % i) for i in range(missing)])
        assert store.queue_range("u", 0)[1] % RECORDS == 0
        if last_end(acked)[1] < trigger_frame(topic):
            fill_log(store, acked, "t", 1, 1)  # keep this send from starting a log chunk too
    log_chunk = last_end(acked)[0]
    next_offset = store.queue_range(topic, queue_id)[1] if topic in store.topics() else 0
    return Where(
        store.path.resolve(), topic, queue_id, log_chunk, max(next_offset - 1, 0) // RECORDS
    )


def queue_ranges(store: MessageStore) -> dict[tuple[str, int], tuple[int, int]]:
    return {(t, q): store.queue_range(t, q) for t in store.topics() for q in store.queue_ids(t)}


def check_error(exc: BaseException, error: int, hit: Path) -> None:
    assert isinstance(exc, StoreWriteError), f"raised {exc!r}, not a StoreWriteError"
    assert isinstance(exc, DiskFullError) == (error == errno.ENOSPC), repr(exc)
    assert exc.errno == error, repr(exc)
    message = str(exc)
    assert os.strerror(error) in message, message
    assert str(hit) in message or str(hit.parent) in message, f"{message!r} does not name {hit}"


def stored_whole_or_not(
    store: MessageStore,
    before: dict[tuple[str, int], tuple[int, int]],
    where: Where,
    failed: OutgoingMessage,
) -> list[Sent]:
    """A send that raised after its record was written: its queue moved by at most one,
    and if it did, the entry holds exactly that message, which then counts as stored
    (``before`` is updated to match)."""
    place = (where.topic, where.queue_id)
    first, end = before[place]
    now = store.queue_range(*place)
    assert now in ((first, end), (first, end + 1)), f"queue {place} moved: {now}"
    if now[1] == end:
        return []
    (message,) = store.pull(*place, end).messages
    assert (message.body, message.key) == (failed.body, failed.key), message
    before[place] = now
    result = SendResult(
        message.message_id,
        message.topic,
        message.queue_id,
        message.queue_offset,
        message.position,
        message.stored_at,
    )
    return [Sent(result, failed.body, key=failed.key)]


def check_nothing_visible(
    store: MessageStore,
    expected: dict[tuple[str, int], tuple[int, int]],
    acked: list[Sent],
    topic: str,
    unacked: list[OutgoingMessage],
) -> None:
    """No trace of messages whose send failed: every queue's range is as ``expected``, and no
    pull, read or key lookup finds them."""
    after = queue_ranges(store)
    for place, (first, end) in after.items():
        assert expected.get(place, (0, 0)) == (first, end), f"queue {place} moved: {after}"
        assert store.pull(*place, end).messages == []
    bodies = {m.body for m in unacked}
    for messages in pull_all(store).values():
        assert not [m for m in messages if m.body in bodies]
    last = max(acked, key=lambda s: s.position)
    following = last.position + last.frame_size
    for position in (following, (following // CHUNK + 1) * CHUNK):
        with pytest.raises(MessageNotFoundError):
            store.read(position)
    for key in {m.key for m in unacked if m.key is not None}:
        with contextlib.suppress(TopicNotFoundError):
            found = [m.position for m in store.query_by_key(topic, key)]
            assert found == sorted((s.position for s in acked if s.key == key), reverse=True)


def reopen_and_check(path: Path, acked: list[Sent], config: StoreConfig = CONFIG) -> None:
    """After close and reopen: recovery has nothing to report, every acknowledged message
    is there exactly (and the queues hold nothing else), every key finds its messages."""
    with MessageStore.open(path, config) as store:
        report = store.recovery
        assert (report.cuts, report.problems) == ([], []), report
        assert report.clean, report
        assert_all_readable(store, acked)
        check_keys(store, acked)


def check_keys(store: MessageStore, acked: list[Sent]) -> None:
    """query_by_key finds exactly the acknowledged messages with each key (and nothing for
    the key of a send that failed, unless it was acknowledged)."""
    keyed: dict[tuple[str, str], list[Sent]] = {}
    for s in acked:
        if s.key is not None:
            keyed.setdefault((s.topic, s.key), []).append(s)
    for topic in store.topics():
        keyed.setdefault((topic, FAILED_KEY), [])
    for (topic, key), expected in keyed.items():
        found = store.query_by_key(topic, key, limit=10_000)
        assert [m.position for m in found] == sorted((s.position for s in expected), reverse=True)


@contextlib.contextmanager
def opened(path: Path, config: StoreConfig = CONFIG) -> Iterator[MessageStore]:
    """The store, closed at the end if the test did not close it (after a failure)."""
    store = MessageStore.open(path, config)
    try:
        yield store
    finally:
        with contextlib.suppress(Exception):
            store.close()


# --- the send path ---------------------------------------------------------------------------


@pytest.mark.parametrize("error", ERRORS)
@pytest.mark.parametrize("seam", SEAMS)
def test_send_when_a_write_fails(
    tmp_path: Path, faults: Faults, seam: str, error: int | None
) -> None:
    spec = SEAMS[seam]
    path = tmp_path / "store"
    faults.no_fallocate = spec.no_fallocate
    with opened(path) as store:
        acked = base_traffic(store)
        where = prepare(store, spec.scenario, acked)
        before = queue_ranges(store)
        rule = faults.add(spec.kind, spec.target(where), error)
        raised: BaseException | None = None
        try:
            acked.append(
                send(store, where.topic, FAILED_BODY, key=FAILED_KEY, queue_id=where.queue_id)
            )
        except Exception as exc:
            raised = exc
        faults.clear()
        if not rule.hits:
            pytest.fail(f"the send made no {spec.kind} call for {spec.what} ({spec.scenario})")
        if error is None:
            assert raised is None, f"the control send failed: {raised!r}"
        else:
            assert raised is not None, f"the send succeeded although {spec.what} failed"
            check_error(raised, error, rule.hits[0])
            failed = OutgoingMessage(FAILED_BODY, key=FAILED_KEY)
            stored = stored_whole_or_not(store, before, where, failed) if spec.may_store else []
            acked += stored
            check_nothing_visible(store, before, acked, where.topic, [] if stored else [failed])
            assert_all_readable(store, acked)
        if error is not None and spec.final:
            # The fault is gone, but the chunk whose fdatasync failed is not flushed again:
            # sends are refused until the store is reopened, and the reopen recovers.
            before = queue_ranges(store)
            with pytest.raises(StoreWriteError, match="close and reopen the store"):
                send(store, where.topic, RETRY_BODY, key=RETRY_KEY, queue_id=where.queue_id)
            # close() refuses too if the chunk holds anything unflushed, and releases the
            # files all the same.
            with contextlib.suppress(StoreWriteError):
                store.close()
            store = MessageStore.open(path, CONFIG)
            # The refused send's record was written before its flush was refused.
            refused = OutgoingMessage(RETRY_BODY, key=RETRY_KEY)
            acked += stored_whole_or_not(store, before, where, refused)
            assert_all_readable(store, acked)
        # The fault is gone: the store sends again (the same object, unless reopened).
        # A new topic whose creation failed does not exist: the retry creates it.
        created = where.topic in store.topics()
        next_offset = store.queue_range(where.topic, where.queue_id)[1] if created else 0
        retry = send(store, where.topic, RETRY_BODY, key=RETRY_KEY, queue_id=where.queue_id)
        assert retry.offset == next_offset
        acked.append(retry)
        acked.append(send(store, "t", b"and one more", queue_id=1))
        assert_all_readable(store, acked)
        check_keys(store, acked)
        store.close()
    reopen_and_check(path, acked)


@pytest.mark.parametrize("error", ERRORS)
def test_send_batch_across_a_log_rollover(
    tmp_path: Path, faults: Faults, error: int | None
) -> None:
    """A batch whose second message needs a new log chunk that cannot be created: the
    messages stored before the failure are whole, readable and listed in the error's
    ``sent``; none after it is visible (docs/durability.md, "Disk full and I/O errors")."""
    path = tmp_path / "store"
    with opened(path) as store:
        acked = base_traffic(store)
        fill_log(store, acked, "t", 0, 1)  # room for exactly one more trigger-sized record
        where = prepare(store, "send", acked)
        before = queue_ranges(store)
        batch = [
            OutgoingMessage(b"BATCH %d " % i + FAILED_BODY[8:], key=f"batchkey-{i}", queue_id=0)
            for i in range(3)
        ]
        assert {len(m.body) for m in batch} == {len(FAILED_BODY)}
        rule = faults.add("create", new_log_temp(where), error)
        try:
            acked += send_batch(store, "t", batch)
            raised: BaseException | None = None
        except Exception as exc:
            raised = exc
        faults.clear()
        assert rule.hits, "the batch did not start a new log chunk"
        if error is None:
            assert raised is None, raised
        else:
            assert raised is not None
            check_error(raised, error, rule.hits[0])
            assert isinstance(raised, StoreWriteError)
            stored = len(raised.sent)
            assert stored < len(batch)
            acked += [
                Sent(result, m.body, key=m.key)
                for result, m in zip(raised.sent, batch[:stored], strict=True)
            ]
            first, end = before[("t", 0)]
            before[("t", 0)] = (first, end + stored)
            check_nothing_visible(store, before, acked, "t", batch[stored:])
            assert_all_readable(store, acked)
            again = [m._replace(body=b"RETRY" + m.body[5:]) for m in batch[stored:]]
            acked += send_batch(store, "t", again)
        assert_all_readable(store, acked)
        store.close()
    reopen_and_check(path, acked)


# --- the background service, close and consumer offsets ------------------------------------

BACKGROUND_CONFIG = StoreConfig(
    chunk_data_size=CHUNK,
    queue_chunk_records=RECORDS,
    default_queue_count=2,
    flush="async",
    flush_interval_ms=5,
    key_index_batch=1,  # every keyed send makes the service write the key index and a checkpoint
)
BACKGROUND: dict[str, tuple[str, Callable[[Path], Callable[[Path], bool]]]] = {
    "log-flush": ("sync", lambda store: is_chunk_in(store / "messages")),
    "queue-flush": ("sync", lambda store: is_chunk_in(store / "queues" / "t" / "0")),
    "checkpoint-write": ("rename", lambda store: is_temp_of_file(store, "checkpoint.json")),
    "key-index-write": ("sqlite", lambda store: is_path(store / "keys.sqlite")),
}


def wait_for(condition: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


@pytest.mark.parametrize("error", ERRORS)
@pytest.mark.parametrize("seam", BACKGROUND)
def test_background_flush_fails(
    tmp_path: Path, faults: Faults, seam: str, error: int | None
) -> None:
    """A failed background flush, checkpoint or key-index write: flush() reports it, the
    service keeps running, and everything works again once the fault is gone."""
    path = tmp_path / "store"
    kind, target = BACKGROUND[seam]
    with opened(path, BACKGROUND_CONFIG) as store:
        acked = base_traffic(store)
        store.flush()
        match = target(store.path.resolve())
        rule = faults.add(kind, match, error, any_thread=True)
        i = 0

        def send_until_hit() -> bool:
            nonlocal i
            i += 1
            offset = store.queue_range("t", 0)[1]
            try:
                acked.append(send(store, "t", b"during %d" % i, key=f"key{i % 4}", queue_id=0))
            except StoreWriteError:  # refused while the store knows a flush failed
                assert store.queue_range("t", 0)[1] == offset
            return bool(rule.hits)

        assert wait_for(send_until_hit), f"the background service made no {kind} call ({seam})"
        if error is not None:
            try:
                store.flush()
            except Exception as exc:
                check_error(exc, error, rule.hits[0])
            else:
                pytest.fail("flush() succeeded while the disk was failing")
        faults.clear()
        if error is not None and kind == "sync":
            # A chunk whose fdatasync failed is never flushed again: flush() refuses until
            # the store is reopened (close() refuses too, and releases the files).
            with pytest.raises(StoreWriteError, match="close and reopen the store"):
                store.flush()
            with contextlib.suppress(StoreWriteError):
                store.close()
            store = MessageStore.open(path, BACKGROUND_CONFIG)
            assert_all_readable(store, acked)
        store.flush()  # the fault is gone: flushing works again ...
        acked.append(send(store, "t", b"after", key="key1", queue_id=0))  # ... and sending
        # ... and the service still runs: it reaches the same step again by itself. A
        # keyed send makes a checkpoint due, but one already under way may commit its key
        # after flushing the file, and then none is due before flush_thorough_interval_ms
        # (longer than wait_for): so send until a checkpoint flushes it. Only the service
        # thread counts (this thread flushes the files when a send fills a chunk).
        again = faults.add(kind, match, None, any_thread=True)
        test_thread = threading.get_ident()
        j = 0

        def send_until_service_step() -> bool:
            nonlocal j
            j += 1
            acked.append(send(store, "t", b"after %d" % j, key=f"key{j % 4}", queue_id=0))
            return any(thread != test_thread for thread in again.hit_threads)

        assert wait_for(send_until_service_step), "the background service stopped"
        faults.clear()
        assert_all_readable(store, acked)
        check_keys(store, acked)
        store.close()
    reopen_and_check(path, acked, BACKGROUND_CONFIG)


CLOSE_CONFIG = StoreConfig(
    chunk_data_size=CHUNK, queue_chunk_records=RECORDS, default_queue_count=2, flush="os"
)


@pytest.mark.parametrize("error", ERRORS)
@pytest.mark.parametrize("seam", ["log-flush", "checkpoint-write"])
def test_close_when_disk_full(tmp_path: Path, faults: Faults, seam: str, error: int | None) -> None:
    """close() that cannot flush says so; once space is freed, closing again finishes and
    the same process can reopen the store (the writer lock was released)."""
    path = tmp_path / "store"
    kind, target = BACKGROUND[seam]
    with opened(path, CLOSE_CONFIG) as store:
        acked = base_traffic(store)
        rule = faults.add(kind, target(store.path.resolve()), error, any_thread=True)
        try:
            store.close()
            raised: BaseException | None = None
        except Exception as exc:
            raised = exc
        faults.clear()
        assert rule.hits, f"close() made no {kind} call ({seam})"
        if error is None:
            assert raised is None, raised
        else:
            assert raised is not None, "close() succeeded although it could not flush"
            check_error(raised, error, rule.hits[0])
            store.close()
    reopen_and_check(path, acked, CLOSE_CONFIG)


@pytest.mark.parametrize("error", ERRORS)
@pytest.mark.parametrize("kind", ["create", "write", "sync", "rename", "dirsync"])
def test_commit_offset_when_disk_full(
    tmp_path: Path, faults: Faults, kind: str, error: int | None
) -> None:
    path = tmp_path / "store"
    with opened(path) as store:
        base_traffic(store)
        store.commit_offset("g", "t", 0, 2)
        root = store.path.resolve()
        match = is_path(root) if kind == "dirsync" else is_temp_of_file(root, "offsets.json")
        rule = faults.add(kind, match, error)
        try:
            store.commit_offset("g", "t", 0, 5)
            raised: BaseException | None = None
        except Exception as exc:
            raised = exc
        faults.clear()
        assert rule.hits
        if error is None:
            assert raised is None, raised
            assert store.committed_offset("g", "t", 0) == 5
        else:
            assert raised is not None
            check_error(raised, error, rule.hits[0])
            assert store.committed_offset("g", "t", 0) == 2, "a failed commit changed the offset"
            assert store.consumer_groups() == {"g": {"t": {0: 2}}}
            store.commit_offset("g", "t", 0, 5)
        store.close()
    with MessageStore.open(path, CONFIG) as store:
        assert store.recovery.clean
        assert store.committed_offset("g", "t", 0) == 5


# --- an allocation step ------------------------------------------------------------------------

# Chunks far larger than a step: the log and the queue chunks allocate their disk a page at
# a time (StoreConfig.alloc_step), so the trigger send is the one that needs a new step.
STEP_CONFIG = StoreConfig(
    chunk_data_size=1 << 20,
    queue_chunk_records=100_000,
    default_queue_count=2,
    flush="os",
    alloc_step=4096,
)
STEP_ERRORS = [
    pytest.param(errno.ENOSPC, id="ENOSPC"),
    pytest.param(errno.EFBIG, id="EFBIG"),
    pytest.param(errno.EIO, id="EIO"),
    pytest.param(None, id="control"),
]


@pytest.mark.usefixtures("code_path")
@pytest.mark.parametrize("error", STEP_ERRORS)
@pytest.mark.parametrize("scenario", ["send", "log-batch", "queue-send"])
def test_send_at_an_allocation_step(
    tmp_path: Path, faults: Faults, scenario: str, error: int | None
) -> None:
    """The disk fills up while a chunk is written: every allocation of the log chunk's
    (or queue t/0's chunk's) next blocks fails from now on. The sends go on into what
    was allocated ahead of the writer, then the one that needs more raises DiskFullError
    (ENOSPC and EFBIG; EIO a StoreWriteError) naming the chunk, before anything of it is
    written; nothing acknowledged is lost, and the same store sends again once space
    is freed (a batch: what was stored before the step is in ``sent``)."""
    path = tmp_path / "store"
    with opened(path, STEP_CONFIG) as store:
        store.create_topic("t", 2)
        acked = [send(store, "t", b"first", queue_id=0)]
        target = store._queues["t"][0].manager if scenario == "queue-send" else store._messages
        chunk = target.last_chunk
        assert chunk is not None
        rule = faults.add("allocate", is_path(chunk.path.resolve()), error)
        raised: BaseException | None = None
        failed: list[OutgoingMessage] = []
        before = queue_ranges(store)
        for i in range(3000):  # up to a window's worth of sends (and a step) beyond
            before = queue_ranges(store)
            body = b"F%05d " % i + (b"" if scenario == "queue-send" else b"x" * 1000)
            key = f"step-key-{i}"
            failed = [OutgoingMessage(body + b"%d" % n, key=key, queue_id=0) for n in (1, 2)]
            try:
                if scenario == "log-batch":
                    acked += send_batch(store, "t", failed)
                else:
                    acked.append(send(store, "t", failed[0].body, key=key, queue_id=0))
            except Exception as exc:
                raised = exc
                break
            if error is None and rule.hits and chunk.writable_end > chunk.data_end + 4096:
                break  # the control: it allocated its next blocks, and sends go on
        faults.clear()
        assert rule.hits, f"the sends allocated nothing in {chunk.path} ({scenario})"
        if error is None:
            assert raised is None, f"the control send failed: {raised!r}"
        else:
            assert isinstance(raised, StoreWriteError), f"raised {raised!r}"
            assert isinstance(raised, DiskFullError) == (error != errno.EIO), repr(raised)
            assert raised.errno == error and str(chunk.path.resolve()) in str(raised), raised
            assert "alloc_step" in str(raised), str(raised)
            stored = raised.sent if scenario == "log-batch" else []
            assert len(stored) <= 1, stored
            acked += [Sent(r, m.body, key=m.key) for r, m in zip(stored, failed, strict=False)]
            first, end = before[("t", 0)]
            before[("t", 0)] = (first, end + len(stored))
            unacked = failed[len(stored) :] if scenario == "log-batch" else failed[:1]
            check_nothing_visible(store, before, acked, "t", unacked)
        assert_all_readable(store, acked)
        acked.append(send(store, "t", RETRY_BODY, key=RETRY_KEY, queue_id=0))
        acked.append(send(store, "t", b"and one more", queue_id=1))
        assert_all_readable(store, acked)
        check_keys(store, acked)
        store.close()
    reopen_and_check(path, acked, STEP_CONFIG)


# --- a real limit ------------------------------------------------------------------------------

CHILD = r"""
import errno, json, resource, signal, sys
from pathlib import Path
from equeue import MessageStore, StoreConfig

path = Path(sys.argv[1])
config = StoreConfig(
    chunk_data_size=4096, queue_chunk_records=342, default_queue_count=1, flush="sync"
)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # over the limit, writes fail with EFBIG
out = {}
store = MessageStore.open(path, config)
store.create_topic("t", 1)
acked = []


def send(body):
    result = store.send("t", body, queue_id=0)
    acked.append([result.message_id, body.hex()])


for i in range(10):
    send(b"before-%04d-" % i + b"x" * 60)
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
limit = 4096  # below a chunk file's size (4352 bytes): no further chunk can be created
try:
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
except (ValueError, OSError) as exc:
    store.close()
    print(json.dumps({"skip": f"cannot set RLIMIT_FSIZE: {exc}"}))
    sys.exit(0)
probe = path / "probe"
try:
    with open(probe, "wb") as f:
        f.write(b"\0" * (limit + 1))
    enforced = "no error writing past the limit"
except OSError as exc:
    enforced = None if exc.errno == errno.EFBIG else repr(exc)
probe.unlink()
if enforced is not None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    store.close()
    print(json.dumps({"skip": f"RLIMIT_FSIZE is not enforced here: {enforced}"}))
    sys.exit(0)
failure = None
for i in range(300):
    before = store.queue_range("t", 0)[1]
    body = b"during-%04d-" % i + b"y" * 60
    try:
        send(body)
    except Exception as exc:
        failure = {
            "classes": [c.__name__ for c in type(exc).__mro__],
            "errno": getattr(exc, "errno", None),
            "message": str(exc),
        }
        break
out["failure"] = failure
out["moved"] = store.queue_range("t", 0)[1] - before
out["visible"] = [m.body.hex() for m in store.pull("t", 0, before).messages]
out["readable"] = all(store.get(i).body.hex() == b for i, b in acked)
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))  # space is freed
send(b"after the limit was lifted")
out["after"] = store.pull("t", 0, before).messages[0].body.decode()
store.close()
with MessageStore.open(path, config) as store:
    out["clean"] = store.recovery.clean
    out["report"] = str(store.recovery)
    pulled, offset = [], 0
    while True:
        result = store.pull("t", 0, offset, max_count=100)
        pulled += [m.body.hex() for m in result.messages]
        if result.next_offset == offset:
            break
        offset = result.next_offset
    out["reopened_as_acked"] = pulled == [b for _, b in acked]
print(json.dumps(out))
"""


def test_real_file_size_limit(tmp_path: Path) -> None:
    """RLIMIT_FSIZE below a chunk's size, in a child process: the next chunk cannot be
    created, the send fails with DiskFullError (EFBIG), and lifting the limit is enough."""
    run = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "store")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    if "skip" in out:
        pytest.skip(out["skip"])
    failure = out["failure"]
    assert failure is not None, "300 sends fit under a 4096-byte file size limit"
    assert "DiskFullError" in failure["classes"], failure
    assert "StoreWriteError" in failure["classes"], failure
    assert failure["errno"] == errno.EFBIG, failure
    assert str(tmp_path / "store") in failure["message"], failure
    assert out["moved"] == 0 and out["visible"] == [], out
    assert out["readable"], out
    assert out["after"] == "after the limit was lifted", out
    assert out["clean"], out["report"]
    assert out["reopened_as_acked"], out


KEY_INDEX_CHILD = r"""
import json, resource, signal, sys
from pathlib import Path
from equeue import MessageStore, StoreConfig
from equeue.inspect.verify import verify_store

path, limited = Path(sys.argv[1]), sys.argv[2] == "limited"
config = StoreConfig(
    chunk_data_size=4096, queue_chunk_records=342, default_queue_count=1, flush="os",
    key_index_batch=1_000_000,  # keys are written by flush() only
)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # over the limit, writes fail with EFBIG
store = MessageStore.open(path, config)
store.create_topic("t", 1)
keys = []
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
if limited:
    try:  # chunk files (4352 bytes) fit; the key index's WAL soon does not
        resource.setrlimit(resource.RLIMIT_FSIZE, (65536, hard))
    except (ValueError, OSError) as exc:
        print(json.dumps({"skip": f"cannot set RLIMIT_FSIZE: {exc}"}))
        sys.exit(0)
failure = None
for batch in range(100):
    for i in range(8):
        keys.append(f"key-{len(keys):05d}-" + "x" * 200)
        store.send("t", b"v", key=keys[-1], queue_id=0)
    try:
        store.flush()
    except Exception as exc:
        failure = {
            "classes": [c.__name__ for c in type(exc).__mro__],
            "errno": getattr(exc, "errno", None),
            "message": str(exc),
        }
        break
out = {"failure": failure, "flushes": batch + 1}
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))  # space is freed
store.flush()
out["found"] = all(len(store.query_by_key("t", k)) == 1 for k in keys)
store.close()
with MessageStore.open(path, config) as store:
    out["reopened"] = all(len(store.query_by_key("t", k)) == 1 for k in keys)
    out["clean"] = store.recovery.clean
out["problems"] = [str(p) for p in verify_store(path)]
print(json.dumps(out))
"""


@pytest.mark.parametrize("limited", [True, False], ids=["limited", "control"])
def test_key_index_file_size_limit(tmp_path: Path, limited: bool) -> None:
    """RLIMIT_FSIZE hit by the key index's WAL, in a child process: flush() raises
    DiskFullError (EFBIG) naming keys.sqlite and what to do, not an I/O error; once the
    limit is lifted the next flush writes every key. The control never fails."""
    store = tmp_path / "store"
    run = subprocess.run(
        [sys.executable, "-c", KEY_INDEX_CHILD, str(store), "limited" if limited else "none"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    if "skip" in out:
        pytest.skip(out["skip"])
    assert out["found"] and out["reopened"] and out["clean"], out
    assert out["problems"] == [], out
    failure = out["failure"]
    if not limited:
        assert failure is None and out["flushes"] == 100, out
        return
    assert failure is not None, "800 keys of 200 bytes fit a 64 KiB key index"
    assert "DiskFullError" in failure["classes"], failure
    assert failure["errno"] == errno.EFBIG, failure
    assert str(store / "keys.sqlite") in failure["message"], failure
    assert "ulimit -f" in failure["message"], failure
