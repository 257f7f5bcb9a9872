"""equeue beside the durable queues and stores Python users pick today, in one run on one disk.

Peers: persistqueue.Queue, persistqueue.SQLiteQueue, litequeue.LiteQueue, diskcache.Deque,
queuelib.FifoDiskQueue, stdlib sqlite3 (WAL) and lmdb, plus a plain buffered append log as the
physical reference. Scenarios: append 1,000,000 x 100 B and 200,000 x 1 KiB without a
per-message fsync; durable 1 KiB appends from 1 and 16 threads; a sequential consume of what
was appended; reopen (+ first read) after a SIGKILL of a 1 GiB store; peak memory of each case.

Every case runs in its own process (this script, re-invoked with ``--case``) in a fresh
directory, repeated; the report gives the median and min-max over the repeats and writes the
peers section of docs/benchmarks.md and the docs/peers*.png charts. Slow peers run fewer
messages (or a smaller store to reopen), and the report says so. ``--smoke`` is a tiny run of
seconds that writes nothing under docs/ unless asked to; ``--from-json`` rewrites the report
and charts from a saved run without measuring.
"""

from __future__ import annotations

import abc
import argparse
import concurrent.futures
import contextlib
import dataclasses
import datetime as dt
import functools
import importlib.metadata
import json
import operator
import os
import platform
import re
import resource
import select
import shutil
import signal
import sqlite3
import statistics
import struct
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain, cycle, islice, repeat, starmap
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, cast

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from equeue import MessageStore

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
BEGIN = "<!-- peers:begin"
END = "<!-- peers:end -->"
DASH = "\u2013"  # en dash, for ranges
TOPIC = "bench"
BATCH = 1000  # messages per commit for sqlite3 and lmdb, per send_batch call for equeue
DISTINCT_BODIES = 1024  # bodies are cycled: equal work for every store, little memory
LMDB_MAP_SIZE = 8 << 30  # address space only: the file grows with the data
MiB = 1 << 20

# --- the stores --------------------------------------------------------------------


class Store(abc.ABC):
    """One peer behind the operations the scenarios need, each written as a user of that
    library would write it (the timed loops are the store's own calls, nothing more)."""

    # False: the harness serialises durable puts from several threads with a lock.
    threadsafe: ClassVar[bool] = True
    # True: reading a message removes it (so a count taken after first() misses it).
    destructive: ClassVar[bool] = True

    def __init__(self, directory: Path, durable: bool) -> None:
        self.directory = directory
        self.durable = durable

    @abc.abstractmethod
    def append(self, bodies: Iterator[bytes]) -> None:
        """Append every body without a per-message sync (the store's batch mode, if any)."""

    def append_batch(self, bodies: Iterator[bytes]) -> None:
        raise NotImplementedError

    @abc.abstractmethod
    def put_durable(self, body: bytes) -> None:
        """Append one body and return once the store has synced it (as far as it can)."""

    @abc.abstractmethod
    def consume(self, count: int) -> Iterator[bytes | None]:
        """The first ``count`` bodies, in order, read the way a consumer of this store reads."""

    @abc.abstractmethod
    def first(self) -> bytes | None:
        """The oldest message (None: the store is empty)."""

    @abc.abstractmethod
    def count(self) -> int:
        """How many messages the store holds (not timed)."""

    @abc.abstractmethod
    def close(self) -> None: ...

    def note(self) -> str:
        return ""


def chunks(bodies: Iterator[bytes], size: int) -> Iterator[list[bytes]]:
    while chunk := list(islice(bodies, size)):
        yield chunk


class EqueueStore(Store):
    destructive = False

    def __init__(self, directory: Path, durable: bool) -> None:
        super().__init__(directory, durable)
        from equeue import MessageStore, StoreConfig

        # Not durable: the default "async" policy (a background fdatasync every 500 ms).
        self.store: MessageStore = MessageStore.open(
            directory / "equeue", StoreConfig(flush="sync" if durable else "async")
        )
        if TOPIC not in self.store.topics():
            self.store.create_topic(TOPIC, 1)  # one FIFO, as every peer is

    def append(self, bodies: Iterator[bytes]) -> None:
        send = self.store.send
        for body in bodies:
            send(TOPIC, body)

    def append_batch(self, bodies: Iterator[bytes]) -> None:
        send_batch = self.store.send_batch
        for chunk in chunks(bodies, BATCH):
            send_batch(TOPIC, chunk)

    def put_durable(self, body: bytes) -> None:
        self.store.send(TOPIC, body)

    def consume(self, count: int) -> Iterator[bytes]:
        def batches() -> Iterator[list[bytes]]:
            pull = self.store.pull
            offset = 0
            while offset < count:
                messages, offset = pull(TOPIC, 0, offset, min(256, count - offset))
                if not messages:
                    break
                yield [m.body for m in messages]
            self.store.commit_offset("bench-consumer", TOPIC, 0, offset)

        return chain.from_iterable(batches())

    def first(self) -> bytes | None:
        messages = self.store.pull(TOPIC, 0, 0, 1).messages
        return messages[0].body if messages else None

    def count(self) -> int:
        first, end = self.store.queue_range(TOPIC, 0)
        return end - first

    def close(self) -> None:
        self.store.close()

    def note(self) -> str:
        notes = []
        group = self.store._group  # the flush count: how many sends shared one fdatasync
        if group is not None and group.flushes:
            notes.append(f"flushes={group.flushes}")
        report = self.store.recovery
        if report.redispatched or report.cuts:
            notes.append(f"re-dispatched {report.redispatched:,}, {len(report.cuts)} cut(s)")
        return ", ".join(notes)


class PersistQueueFile(Store):
    def __init__(self, directory: Path, durable: bool) -> None:
        super().__init__(directory, durable)
        import persistqueue

        # chunksize=1: every put rolls the chunk over, which is the only fsync it does.
        # tempdir: its info file is written there and renamed; keep it on the same disk.
        self.queue = persistqueue.Queue(
            str(directory / "pq"), chunksize=1 if durable else 100, tempdir=str(directory)
        )

    def append(self, bodies: Iterator[bytes]) -> None:
        put = self.queue.put
        for body in bodies:
            put(body)

    def put_durable(self, body: bytes) -> None:
        self.queue.put(body)

    def consume(self, count: int) -> Iterator[bytes]:
        get, done = self.queue.get_nowait, self.queue.task_done
        left = count
        while left:
            n = min(left, BATCH)
            yield from starmap(get, repeat((), n))
            done()  # saves its info file: the consumed position persists once per 1,000
            left -= n

    def first(self) -> bytes | None:
        import persistqueue

        try:
            body: bytes = self.queue.get_nowait()
        except persistqueue.Empty:
            return None
        return body

    def count(self) -> int:
        return int(self.queue.qsize())

    def close(self) -> None:
        for f in (self.queue.headf, self.queue.tailf):
            f.close()


class PersistQueueSQLite(Store):
    def __init__(self, directory: Path, durable: bool) -> None:
        super().__init__(directory, durable)
        import persistqueue

        self.queue = persistqueue.SQLiteQueue(
            str(directory / "pqs"), auto_commit=durable, multithreading=durable
        )
        if not durable:
            # Its put() commits every message (synchronous=FULL in WAL: an fsync each); it
            # has no batch mode, so this is set on its private connection for the no-fsync run.
            putter = cast(sqlite3.Connection, self.queue._putter)
            putter.execute("PRAGMA synchronous=NORMAL")

    def append(self, bodies: Iterator[bytes]) -> None:
        put = self.queue.put
        for body in bodies:
            put(body)

    def put_durable(self, body: bytes) -> None:
        self.queue.put(body)

    def consume(self, count: int) -> Iterator[bytes]:
        get, done = self.queue.get, self.queue.task_done
        left = count
        while left:
            n = min(left, BATCH)
            for _ in range(n):
                yield get(block=False)
            done()  # auto_commit=False: the deletes commit once per 1,000
            left -= n

    def first(self) -> bytes | None:
        import persistqueue

        try:
            body: bytes = self.queue.get(block=False)
        except persistqueue.Empty:
            return None
        return body

    def count(self) -> int:
        return int(self.queue.qsize())

    def close(self) -> None:
        self.queue.close()


class LiteQueueStore(Store):
    def __init__(self, directory: Path, durable: bool) -> None:
        super().__init__(directory, durable)
        from litequeue import LiteQueue

        # Bytes go in as they are: its data column is TEXT, and SQLite keeps a blob a blob.
        self.queue = LiteQueue(str(directory / "litequeue.db"))
        if durable:
            self.queue.conn.execute("PRAGMA synchronous=FULL")  # its default is NORMAL

    def append(self, bodies: Iterator[bytes]) -> None:
        put = self.queue.put
        for body in bodies:
            put(body)

    def put_durable(self, body: bytes) -> None:
        self.queue.put(body)

    def consume(self, count: int) -> Iterator[bytes]:
        pop, done = self.queue.pop, self.queue.done
        for _ in range(count):
            message = pop()
            if message is None:
                return
            done(message.message_id)
            yield message.data

    def first(self) -> bytes | None:
        message = self.queue.pop()
        return None if message is None else bytes(message.data)

    def count(self) -> int:
        return int(self.queue.qsize())

    def close(self) -> None:
        self.queue.close()


class DiskcacheDeque(Store):
    def __init__(self, directory: Path, durable: bool) -> None:
        super().__init__(directory, durable)
        from diskcache import Cache, Deque

        path = str(directory / "deque")
        if durable:  # the documented setting: synchronous=FULL, an fsync per transaction
            self.deque = Deque.fromcache(Cache(path, eviction_policy="none", sqlite_synchronous=2))
        else:
            self.deque = Deque(directory=path)

    def append(self, bodies: Iterator[bytes]) -> None:
        append = self.deque.append
        for body in bodies:
            append(body)

    def put_durable(self, body: bytes) -> None:
        self.deque.append(body)

    def consume(self, count: int) -> Iterator[bytes]:
        return starmap(self.deque.popleft, repeat((), count))

    def first(self) -> bytes | None:
        try:
            body: bytes = self.deque.popleft()
        except IndexError:
            return None
        return body

    def count(self) -> int:
        return len(self.deque)

    def close(self) -> None:
        self.deque.cache.close()


class QueuelibStore(Store):
    threadsafe = False

    def __init__(self, directory: Path, durable: bool) -> None:
        super().__init__(directory, durable)
        from queuelib import FifoDiskQueue

        self.queue = FifoDiskQueue(str(directory / "queuelib"))

    def append(self, bodies: Iterator[bytes]) -> None:
        push = self.queue.push
        for body in bodies:
            push(body)

    def put_durable(self, body: bytes) -> None:
        # queuelib has no sync of its own: the harness syncs the chunk it wrote to.
        self.queue.push(body)
        os.fdatasync(self.queue.headf.fileno())

    def consume(self, count: int) -> Iterator[bytes | None]:
        return starmap(self.queue.pop, repeat((), count))  # None once empty: a mismatch

    def first(self) -> bytes | None:
        body: bytes | None = self.queue.pop()
        return body

    def count(self) -> int:
        return len(self.queue)

    def close(self) -> None:
        self.queue.close()


class SqliteStore(Store):
    threadsafe = False
    destructive = False
    INSERT = "INSERT INTO q (body) VALUES (?)"

    def __init__(self, directory: Path, durable: bool) -> None:
        super().__init__(directory, durable)
        # Durable: autocommit, so every INSERT is a transaction (an fsync of the WAL).
        self.conn = sqlite3.connect(
            directory / "sqlite.db",
            check_same_thread=False,
            isolation_level=None if durable else "DEFERRED",
        )
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=FULL")
        self.conn.execute("CREATE TABLE IF NOT EXISTS q (id INTEGER PRIMARY KEY, body BLOB)")
        self.conn.commit()

    def append(self, bodies: Iterator[bytes]) -> None:
        execute, commit, insert = self.conn.execute, self.conn.commit, self.INSERT
        for chunk in chunks(bodies, BATCH):
            for body in chunk:
                execute(insert, (body,))
            commit()

    def put_durable(self, body: bytes) -> None:
        self.conn.execute(self.INSERT, (body,))

    def consume(self, count: int) -> Iterator[bytes]:
        rows = self.conn.execute("SELECT body FROM q ORDER BY id LIMIT ?", (count,))
        return map(operator.itemgetter(0), rows)

    def first(self) -> bytes | None:
        row = self.conn.execute("SELECT body FROM q ORDER BY id LIMIT 1").fetchone()
        return None if row is None else bytes(row[0])

    def count(self) -> int:
        return int(self.conn.execute("SELECT count(*) FROM q").fetchone()[0])

    def close(self) -> None:
        self.conn.close()


class LmdbStore(Store):
    destructive = False

    def __init__(self, directory: Path, durable: bool) -> None:
        super().__init__(directory, durable)
        import lmdb

        # The defaults: sync=True, metasync=True, so every commit is an fsync.
        self.env = lmdb.open(str(directory / "lmdb"), map_size=LMDB_MAP_SIZE)
        self.next_key = int(self.env.stat()["entries"])  # keys: 8-byte big-endian sequence

    def append(self, bodies: Iterator[bytes]) -> None:
        key = self.next_key
        for chunk in chunks(bodies, BATCH):
            with self.env.begin(write=True) as txn:
                put = txn.put
                for body in chunk:
                    put(key.to_bytes(8, "big"), body, append=True)
                    key += 1
        self.next_key = key

    def put_durable(self, body: bytes) -> None:
        with self.env.begin(write=True) as txn:  # write transactions are serialised
            txn.put(self.next_key.to_bytes(8, "big"), body, append=True)
            self.next_key += 1

    def consume(self, count: int) -> Iterator[bytes]:
        txn = self.env.begin()
        return islice(txn.cursor().iternext(keys=False, values=True), count)

    def first(self) -> bytes | None:
        with self.env.begin() as txn:
            cursor = txn.cursor()
            return bytes(cursor.value()) if cursor.first() else None

    def count(self) -> int:
        return int(self.env.stat()["entries"])

    def close(self) -> None:
        self.env.close()


class ReferenceLog(Store):
    destructive = False
    HEADER = struct.Struct("<I")

    def __init__(self, directory: Path, durable: bool) -> None:
        super().__init__(directory, durable)
        self.path = directory / "reference.log"
        self.path.touch()
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND) if durable else -1

    def append(self, bodies: Iterator[bytes]) -> None:
        pack = self.HEADER.pack
        with open(self.path, "ab", buffering=MiB) as f:
            write = f.write
            for body in bodies:
                write(pack(len(body)) + body)

    def put_durable(self, body: bytes) -> None:
        # O_APPEND: one write() per record is atomic, so threads need no lock
        os.write(self.fd, self.HEADER.pack(len(body)) + body)
        os.fdatasync(self.fd)

    def _records(self) -> Iterator[bytes]:
        unpack = self.HEADER.unpack
        with open(self.path, "rb", buffering=MiB) as f:
            read = f.read
            while len(head := read(4)) == 4:
                body = read(unpack(head)[0])
                yield body

    def consume(self, count: int) -> Iterator[bytes]:
        return islice(self._records(), count)

    def first(self) -> bytes | None:
        return next(self._records(), None)

    def count(self) -> int:
        return sum(1 for _ in self._records())

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)


# --- what is measured ----------------------------------------------------------------


SMOKE_PEER = {"durable-16": 48}  # the peers' share of the smoke run, where less than equeue's


@dataclass(frozen=True)
class Peer:
    key: str
    name: str
    kind: str  # "equeue", "queue" (a queue library), "engine" (sqlite3, lmdb), "reference"
    store: type[Store]
    dist: str | None  # the distribution whose version is reported
    modes: Mapping[str, str]  # per scenario kind: what it does, and what it fsyncs when
    # Full-run message counts (bytes for "reopen") where this peer runs less than the rest.
    reduced: Mapping[str, int] = field(default_factory=dict)
    smoke_reduced: Mapping[str, int] = field(default_factory=lambda: SMOKE_PEER)


@dataclass(frozen=True)
class Scenario:
    key: str
    kind: str  # "append", "consume", "durable", "reopen"
    label: str
    size: int  # body bytes
    full: int  # messages (bytes of store for "reopen") in the full run
    smoke: int
    threads: int = 1


SCENARIOS = [
    Scenario("append-100", "append", "append 100 B", 100, 1_000_000, 2_000),
    Scenario("append-1k", "append", "append 1 KiB", 1024, 200_000, 1_000),
    Scenario("consume-100", "consume", "consume 100 B", 100, 1_000_000, 2_000),
    Scenario("consume-1k", "consume", "consume 1 KiB", 1024, 200_000, 1_000),
    Scenario("durable-1", "durable", "durable 1 KiB, 1 thread", 1024, 3_000, 40),
    Scenario("durable-16", "durable", "durable 1 KiB, 16 threads", 1024, 32_000, 160, 16),
    Scenario("reopen", "reopen", "reopen after SIGKILL", 1024, 1 << 30, 4 * MiB),
]
SCENARIO = {s.key: s for s in SCENARIOS}
SMOKE_PEER = {"durable-16": 48}  # every peer's share of the smoke run, where less than equeue's

_PEER_DURABLE_16 = {"durable-16": 4_000}
PEERS = [
    Peer(
        "equeue",
        "equeue",
        "equeue",
        EqueueStore,
        None,
        {
            "append": 'flush="async" (the default): a background fdatasync every 500 ms; '
            "`send` per message, or `send_batch` of 1,000",
            "consume": "`pull` 256 at a time (non-destructive), one `commit_offset` at the end",
            "durable": 'flush="sync": `send` returns after an fdatasync of the log, shared '
            "by concurrent senders (group commit)",
            "reopen": 'filled with `send_batch` under flush="async"; open runs recovery',
        },
        smoke_reduced={},
    ),
    Peer(
        "pq_file",
        "persistqueue.Queue",
        "queue",
        PersistQueueFile,
        "persist-queue",
        {
            "append": "defaults (chunksize=100, pickle): per put a pickle + flush and an info "
            "file rewritten and renamed; an fsync only at chunk rollover (every 100 puts)",
            "consume": "`get` per message, `task_done` per 1,000 (saves the info file)",
            "durable": "chunksize=1: every put rolls over to a new chunk file, fsyncing the "
            "last (its only fsync; the info file is renamed, not fsynced)",
            "reopen": "defaults",
        },
        {
            "append-100": 25_000,
            "append-1k": 20_000,
            "consume-100": 25_000,
            "consume-1k": 20_000,
            "reopen": 32 * MiB,
        }
        | _PEER_DURABLE_16,
    ),
    Peer(
        "pq_sqlite",
        "persistqueue.SQLiteQueue",
        "queue",
        PersistQueueSQLite,
        "persist-queue",
        {
            "append": "WAL; `put` commits every message and the library has no batch mode, "
            "so PRAGMA synchronous=NORMAL is set on its connection: no fsync per commit",
            "consume": "auto_commit=False: `get` per message, `task_done` (a commit) per 1,000",
            "durable": "defaults (WAL, synchronous=FULL): a commit and a WAL fsync per put",
            "reopen": "as append",
        },
        {
            "append-100": 200_000,
            "append-1k": 100_000,
            "consume-100": 200_000,
            "consume-1k": 100_000,
            "reopen": 128 * MiB,
        }
        | _PEER_DURABLE_16,
    ),
    Peer(
        "litequeue",
        "litequeue.LiteQueue",
        "queue",
        LiteQueueStore,
        "litequeue",
        {
            "append": "defaults: WAL, synchronous=NORMAL, a transaction per put, no fsync",
            "consume": "`pop` + `done` per message; pop sorts every ready row (O(queue "
            "depth)), so it consumes a smaller queue than it appends",
            "durable": "PRAGMA synchronous=FULL on its connection: a WAL fsync per put",
            "reopen": "defaults",
        },
        {
            "append-100": 120_000,
            "append-1k": 100_000,
            "consume-100": 4_000,
            "consume-1k": 4_000,
            "reopen": 128 * MiB,
        }
        | _PEER_DURABLE_16,
        SMOKE_PEER | {"consume-100": 500, "consume-1k": 500},
    ),
    Peer(
        "diskcache",
        "diskcache.Deque",
        "queue",
        DiskcacheDeque,
        "diskcache",
        {
            "append": "defaults: WAL, synchronous=NORMAL, a transaction per append, no fsync",
            "consume": "`popleft` per message (a transaction each)",
            "durable": "Cache(sqlite_synchronous=2), the documented setting: a WAL fsync per "
            "append",
            "reopen": "defaults",
        },
        {
            "append-100": 60_000,
            "append-1k": 50_000,
            "consume-100": 60_000,
            "consume-1k": 50_000,
            "reopen": 64 * MiB,
        }
        | _PEER_DURABLE_16,
    ),
    Peer(
        "queuelib",
        "queuelib.FifoDiskQueue",
        "queue",
        QueuelibStore,
        "queuelib",
        {
            "append": "defaults: one unbuffered os.write per push; never fsyncs; head and "
            "tail are saved only by close() (a killed queue reopens empty)",
            "consume": "`pop` per message",
            "durable": "offers no sync: the harness calls os.fdatasync on the chunk after "
            "each push, under a lock for threads (still not crash-safe, see append)",
            "reopen": "defaults",
        },
        _PEER_DURABLE_16,
    ),
    Peer(
        "sqlite3",
        "sqlite3 (WAL)",
        "engine",
        SqliteStore,
        None,
        {
            "append": "journal_mode=WAL, synchronous=FULL; one INSERT per message, a commit "
            "(a WAL fsync) per 1,000",
            "consume": "one SELECT ... ORDER BY id, iterated (non-destructive)",
            "durable": "autocommit: a transaction and a WAL fsync per INSERT; one "
            "connection, shared under a lock by threads",
            "reopen": "as append",
        },
        _PEER_DURABLE_16,
    ),
    Peer(
        "lmdb",
        "lmdb",
        "engine",
        LmdbStore,
        "lmdb",
        {
            "append": "defaults (sync=True, metasync=True); 8-byte sequence keys, "
            "put(append=True); a write transaction (an fsync) per 1,000",
            "consume": "one read transaction, cursor iteration (non-destructive)",
            "durable": "a write transaction (an fsync) per put",
            "reopen": "as append",
        },
        _PEER_DURABLE_16,
    ),
    Peer(
        "ref",
        "reference: buffered append log",
        "reference",
        ReferenceLog,
        None,
        {
            "append": "open(path, 'ab', buffering=1 MiB); write(length + body) per message; "
            "never fsyncs",
            "consume": "read(4) + read(n) per message",
            "durable": "os.write(length + body) + os.fdatasync per message, O_APPEND, "
            "threads unlocked",
            "reopen": "as append",
        },
        _PEER_DURABLE_16,
    ),
]
PEER = {p.key: p for p in PEERS}
PEER_NAMES = [p.name for p in PEERS]
QUEUES = [p for p in PEERS if p.kind == "queue"]
ENGINES = [p for p in PEERS if p.kind == "engine"]


def bodies_for(size: int) -> list[bytes]:
    """Deterministic bodies, so a consumer process knows exactly what was appended."""
    import random

    rng = random.Random(size)
    return [rng.randbytes(size) for _ in range(DISTINCT_BODIES)]


def stream(size: int, count: int) -> Iterator[bytes]:
    return islice(cycle(bodies_for(size)), count)


# --- one case, in a child process ------------------------------------------------------


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def anon_rss_mib() -> float:
    """Private (anonymous) resident memory now: ru_maxrss also counts the mapped file pages
    a store touched, which the kernel can drop at will."""
    with contextlib.suppress(OSError), open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def case_append(store: Store, spec: Mapping[str, Any]) -> dict[str, Any]:
    count = spec["count"]
    bodies = stream(spec["size"], count)
    append = store.append_batch if spec["variant"] == "send_batch" else store.append
    started = time.perf_counter()
    append(bodies)
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "rate": count / seconds, "stored": store.count()}


def case_consume(store: Store, spec: Mapping[str, Any]) -> dict[str, Any]:
    count = spec["count"]
    stored = store.count()
    expected = stream(spec["size"], count)
    started = time.perf_counter()
    # map pulls the store's stream first, so it stops at the shorter without losing a message
    mismatches = sum(map(operator.ne, store.consume(count), expected))
    seconds = time.perf_counter() - started
    read = count - sum(1 for _ in expected)
    return {
        "seconds": seconds,
        "rate": read / seconds,
        "stored": stored,
        "read": read,
        "mismatches": mismatches,
    }


def case_durable(store: Store, spec: Mapping[str, Any]) -> dict[str, Any]:
    threads, per_thread = spec["threads"], spec["count"] // spec["threads"]
    bodies = bodies_for(spec["size"])
    put = store.put_durable
    if not store.threadsafe and threads > 1:
        lock = threading.Lock()

        def put(body: bytes, _put: Callable[[bytes], None] = store.put_durable) -> None:
            with lock:
                _put(body)

    start = threading.Barrier(threads + 1)
    failures: list[BaseException] = []

    def produce(i: int) -> None:
        start.wait()
        try:
            for body in islice(cycle(bodies), i, i + per_thread):
                put(body)
        except BaseException as exc:
            failures.append(exc)

    workers = [threading.Thread(target=produce, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    start.wait()
    started = time.perf_counter()
    for worker in workers:
        worker.join()
    seconds = time.perf_counter() - started
    if failures:
        raise failures[0]
    total = per_thread * threads
    return {"seconds": seconds, "rate": total / seconds, "stored": store.count()}


def run_case(spec: Mapping[str, Any]) -> dict[str, Any]:
    peer = PEER[spec["peer"]]
    op = spec["op"]
    directory = Path(spec["dir"])
    if op == "reopen":
        started = time.perf_counter()
        store = peer.store(directory, False)
        body = store.first()
        seconds = time.perf_counter() - started
        found = store.count() + (1 if body is not None and store.destructive else 0)
        result: dict[str, Any] = {
            "seconds": seconds,
            "first_ok": body == bodies_for(spec["size"])[0],
            "empty": body is None,
            "stored": found,
        }
    else:
        store = peer.store(directory, op == "durable")
        if op == "append":
            result = case_append(store, spec)
        elif op == "consume":
            result = case_consume(store, spec)
        elif op == "durable":
            result = case_durable(store, spec)
        elif op == "fill":
            append = store.append_batch if peer.key == "equeue" else store.append
            append(stream(spec["size"], spec["count"]))
            if spec.get("then_wait_for_kill"):
                print(json.dumps({"ready": True}), flush=True)
                while True:  # keep writing, so the kill lands in the middle of an append
                    append(stream(spec["size"], BATCH))
            result = {}
        else:
            raise ValueError(f"unknown case op {op!r}")
    result["note"] = store.note()
    result["anon_mib"] = anon_rss_mib()
    store.close()
    result["rss_mib"] = peak_rss_mib()
    return result


# --- the parent: plan, run, collect ------------------------------------------------


@dataclass
class Outcome:
    scenario: str
    peer: str
    variant: str
    count: int
    results: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def values(self, name: str) -> list[float]:
        return [float(r[name]) for r in self.results if name in r]

    def median(self, name: str) -> float:
        values = self.values(name)
        return statistics.median(values) if values else float("nan")


class Runner:
    def __init__(self, args: argparse.Namespace, base: Path) -> None:
        self.args = args
        self.base = base
        self.outcomes: dict[tuple[str, str, str], Outcome] = {}
        self.done = 0
        self.lock = threading.Lock()

    def count(self, scenario: Scenario, peer: Peer) -> int:
        if self.args.smoke:
            return peer.smoke_reduced.get(scenario.key, scenario.smoke)
        if scenario.kind == "reopen":
            size: int = self.args.reopen_size
            return min(peer.reduced.get("reopen", size), size)
        full = peer.reduced.get(scenario.key, scenario.full)
        return max(1, int(full * float(self.args.scale)))

    def outcome(self, scenario: Scenario, peer: Peer, variant: str, count: int) -> Outcome:
        key = (scenario.key, peer.key, variant)
        with self.lock:
            if key not in self.outcomes:
                self.outcomes[key] = Outcome(scenario.key, peer.key, variant, count)
            return self.outcomes[key]

    def fresh(self) -> Path:
        return Path(tempfile.mkdtemp(prefix="case-", dir=self.base))

    def child(self, spec: dict[str, Any]) -> dict[str, Any]:
        proc = subprocess.run(
            [sys.executable, __file__, "--case", json.dumps(spec)],
            capture_output=True,
            text=True,
            timeout=self.args.case_timeout,
        )
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode != 0 or not lines:
            tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise RuntimeError(f"exit {proc.returncode}: {tail}")
        result: dict[str, Any] = json.loads(lines[-1])
        return result

    def report(self, outcome: Outcome, message: str) -> None:
        label = f"{outcome.scenario} {PEER[outcome.peer].name} {outcome.variant}".rstrip()
        with self.lock:
            self.done += 1
            progress(f"[{self.done}] {label}: {message}")

    def record(
        self, outcome: Outcome, spec: dict[str, Any], check: Callable[[dict[str, Any]], str]
    ) -> bool:
        try:
            result = self.child(spec)
            problem = check(result)
        except (RuntimeError, subprocess.TimeoutExpired, ValueError, KeyError) as exc:
            result, problem = {}, f"{type(exc).__name__}: {exc}"
        if problem:
            outcome.errors.append(problem)
            self.report(outcome, f"FAILED: {problem}")
            return False
        outcome.results.append(result)
        if outcome.scenario == "reopen":
            self.report(outcome, f"{result['seconds']:.3f} s")
        else:
            self.report(outcome, f"{outcome.count:,} msgs, {result['rate']:,.0f} msg/s")
        return True

    def run_size(self, size: int, peer: Peer) -> None:
        """The append cases of one body size, then the consume case on what was appended."""
        append = next((s for s in SCENARIOS if s.kind == "append" and s.size == size), None)
        consume = next((s for s in SCENARIOS if s.kind == "consume" and s.size == size), None)
        keep: Path | None = None
        kept_count = 0
        if append is not None and append.key in self.args.scenarios:
            count = self.count(append, peer)
            for variant in ("send", "send_batch") if peer.key == "equeue" else ("",):
                directory = self.fresh()
                spec: dict[str, Any] = {"op": "append", "peer": peer.key, "dir": str(directory)}
                spec |= {"size": size, "count": count, "variant": variant}

                def check(r: dict[str, Any], count: int = count) -> str:
                    return "" if r["stored"] == count else f"stored {r['stored']:,} of {count:,}"

                ok = self.record(self.outcome(append, peer, variant, count), spec, check)
                if ok and variant in ("", "send_batch"):
                    keep, kept_count = directory, count
                else:
                    shutil.rmtree(directory, ignore_errors=True)
        if consume is not None and consume.key in self.args.scenarios:
            count = self.count(consume, peer)
            outcome = self.outcome(consume, peer, "pull" if peer.key == "equeue" else "", count)
            if keep is None or kept_count != count:
                if keep is not None:
                    shutil.rmtree(keep, ignore_errors=True)
                keep = self.fresh()
                fill = {"op": "fill", "peer": peer.key, "dir": str(keep)}
                try:
                    self.child(fill | {"size": size, "count": count})
                except (RuntimeError, subprocess.TimeoutExpired) as exc:
                    outcome.errors.append(f"fill: {exc}")
                    self.report(outcome, f"fill FAILED: {exc}")
                    shutil.rmtree(keep, ignore_errors=True)
                    return
            spec = {"op": "consume", "peer": peer.key, "dir": str(keep)}

            def check_read(r: dict[str, Any], count: int = count) -> str:
                if r["read"] != count or r["mismatches"] or r["stored"] != count:
                    return (
                        f"read {r['read']:,} of {count:,} (the store held {r['stored']:,}), "
                        f"{r['mismatches']:,} differ from what was appended"
                    )
                return ""

            self.record(outcome, spec | {"size": size, "count": count}, check_read)
        if keep is not None:
            shutil.rmtree(keep, ignore_errors=True)

    def run_durable(self, scenario: Scenario, peer: Peer) -> None:
        count = self.count(scenario, peer)
        count -= count % scenario.threads
        variant = "send" if peer.key == "equeue" else ""
        directory = self.fresh()
        spec: dict[str, Any] = {"op": "durable", "peer": peer.key, "dir": str(directory)}
        spec |= {"size": scenario.size, "count": count, "threads": scenario.threads}

        def check(r: dict[str, Any], count: int = count) -> str:
            return "" if r["stored"] == count else f"stored {r['stored']:,} of {count:,}"

        self.record(self.outcome(scenario, peer, variant, count), spec, check)
        shutil.rmtree(directory, ignore_errors=True)

    def run_reopen(self, scenario: Scenario, peer: Peer) -> None:
        size = self.count(scenario, peer)
        outcome = self.outcome(scenario, peer, "", size)
        directory = self.fresh()
        try:
            written = self.fill_and_kill(peer, directory, scenario.size, size)
        except (RuntimeError, OSError) as exc:
            outcome.errors.append(f"fill: {exc}")
            self.report(outcome, f"fill FAILED: {exc}")
            shutil.rmtree(directory, ignore_errors=True)
            return
        spec = {"op": "reopen", "peer": peer.key, "dir": str(directory), "size": scenario.size}

        def check(r: dict[str, Any], written: tuple[int, int] = written) -> str:
            r["written"], r["disk_bytes"] = written
            return ""

        self.record(outcome, spec, check)
        shutil.rmtree(directory, ignore_errors=True)

    def fill_and_kill(self, peer: Peer, directory: Path, size: int, target: int) -> tuple[int, int]:
        """Fill a store with ``target`` bytes of bodies and SIGKILL the writer in the middle of
        the appends that follow: (messages written before those, bytes on disk)."""
        count = max(1, target // size)
        spec: dict[str, Any] = {"op": "fill", "peer": peer.key, "dir": str(directory)}
        spec["size"] = size
        spec |= {"count": count, "then_wait_for_kill": True}
        with subprocess.Popen(
            [sys.executable, __file__, "--case", json.dumps(spec)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        ) as proc:
            assert proc.stdout is not None and proc.stderr is not None
            try:
                ready, _, _ = select.select([proc.stdout], [], [], self.args.case_timeout)
                line = proc.stdout.readline() if ready else ""
                if '"ready"' in line:
                    time.sleep(0.05)  # into the appends that follow
            finally:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
            if '"ready"' not in line:
                tail = (proc.stderr.read().strip().splitlines() or ["(no output)"])[-1]
                raise RuntimeError(f"the filling process did not get ready: {tail}")
        disk = sum(
            (Path(root) / name).stat().st_blocks * 512
            for root, _, names in os.walk(directory)
            for name in names
        )
        return count, disk

    def units(self) -> list[Callable[[], None]]:
        """One repeat's work, in independent pieces (a piece may hold several cases)."""
        peers = [p for p in PEERS if p.key in self.args.peers]
        wanted = [s for s in SCENARIOS if s.key in self.args.scenarios]
        units: list[Callable[[], None]] = []
        for size in sorted({s.size for s in wanted if s.kind in ("append", "consume")}):
            units += [functools.partial(self.run_size, size, peer) for peer in peers]
        for scenario in wanted:
            if scenario.kind == "durable":
                units += [functools.partial(self.run_durable, scenario, p) for p in peers]
            elif scenario.kind == "reopen":
                units += [functools.partial(self.run_reopen, scenario, p) for p in peers]
        return units

    def run(self) -> None:
        for rep in range(self.args.repeat):
            progress(f"--- repeat {rep + 1} of {self.args.repeat}")
            units = self.units()
            if self.args.jobs == 1:
                for unit in units:
                    unit()
                continue
            # Side by side (the smoke run): the figures then mean nothing, the checks do.
            with concurrent.futures.ThreadPoolExecutor(self.args.jobs) as pool:
                for future in [pool.submit(unit) for unit in units]:
                    future.result()


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --- the report ------------------------------------------------------------------------


def fmt_rate(value: float) -> str:
    return f"{value:,.0f}" if value == value else "-"


def fmt_mib(value: float) -> str:
    if value != value:
        return "-"
    return f"{value:,.1f}" if value < 100 else f"{value:,.0f}"


def fmt_secs(value: float) -> str:
    return f"{value:.3f}" if value == value else "-"


def fmt_ratio(value: float) -> str:
    if value != value:
        return "-"
    return f"{value:.2f}" if value < 10 else f"{value:.1f}" if value < 100 else f"{value:,.0f}"


def spread(outcome: Outcome, name: str, fmt: Callable[[float], str]) -> str:
    values = outcome.values(name)
    if not values:
        return "failed: " + "; ".join(outcome.errors) if outcome.errors else "-"
    text = fmt(statistics.median(values))
    if len(values) > 1:
        text += f" ({fmt(min(values))}{DASH}{fmt(max(values))})"
    if outcome.errors:
        text += f" [{len(outcome.errors)} failed]"
    return text


def fmt_size(n: float) -> str:
    if n >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    return f"{n / MiB:,.0f} MiB" if n >= MiB else f"{n / 1024:,.0f} KiB"


def row_name(outcome: Outcome) -> str:
    if outcome.peer == "equeue":
        return f"**equeue `{outcome.variant}`**" if outcome.variant else "**equeue**"
    return PEER[outcome.peer].name


@dataclass
class Report:
    outcomes: dict[tuple[str, str, str], Outcome]
    meta: dict[str, Any]
    smoke: bool

    def get(self, scenario: str, peer: str, variant: str = "") -> Outcome | None:
        return self.outcomes.get((scenario, peer, variant))

    def rows(self, scenario: str) -> list[Outcome]:
        order = {p.key: i for i, p in enumerate(PEERS)}
        found = [o for o in self.outcomes.values() if o.scenario == scenario]
        return sorted(found, key=lambda o: (order[o.peer], o.variant))

    def reduced(self, outcome: Outcome) -> bool:
        equeue = [o.count for o in self.rows(outcome.scenario) if o.peer == "equeue"]
        return bool(equeue) and outcome.count < max(equeue)

    def equeue_best(self, scenario: str) -> float:
        values = [o.median("rate") for o in self.rows(scenario) if o.peer == "equeue"]
        values = [v for v in values if v == v]
        return max(values) if values else float("nan")

    # -- tables

    def throughput_table(self, scenario: Scenario) -> list[str]:
        equeue_rows = [o for o in self.rows(scenario.key) if o.peer == "equeue"]
        heads = [f"equeue `{o.variant}` ÷ this" for o in equeue_rows]
        lines = [
            f"| store | messages | msg/s median (min{DASH}max) | MiB/s | peak RSS, MiB | "
            + " | ".join(heads)
            + " |",
            "|---|--:|--:|--:|--:|" + "--:|" * len(heads),
        ]
        for outcome in self.rows(scenario.key):
            rate = outcome.median("rate")
            cells = [
                row_name(outcome),
                f"{outcome.count:,}" + (" (reduced)" if self.reduced(outcome) else ""),
                spread(outcome, "rate", fmt_rate),
                fmt_mib(rate * scenario.size / MiB),
                fmt_mib(outcome.median("rss_mib")),
            ]
            for mine in equeue_rows:
                ratio = mine.median("rate") / rate if rate else float("nan")
                cells.append("" if outcome.peer == "equeue" else fmt_ratio(ratio))
            lines.append("| " + " | ".join(cells) + " |")
        return lines

    def durable_table(self) -> list[str]:
        lines = [
            f"| store | messages, 1 / 16 threads | 1 thread: msg/s median (min{DASH}max) | "
            f"16 threads: msg/s median (min{DASH}max) | peak RSS (16 threads), MiB | "
            "equeue 16 threads ÷ this store's best |",
            "|---|--:|--:|--:|--:|--:|",
        ]
        best = self.equeue_best("durable-16")
        for peer in PEERS:
            one, many = self.get("durable-1", peer.key), self.get("durable-16", peer.key)
            if peer.key == "equeue":
                one = self.get("durable-1", "equeue", "send")
                many = self.get("durable-16", "equeue", "send")
            if one is None and many is None:
                continue
            rates = [o.median("rate") for o in (one, many) if o is not None]
            rates = [r for r in rates if r == r]
            ratio = best / max(rates) if rates else float("nan")
            counts = " / ".join(f"{o.count:,}" if o else "-" for o in (one, many))
            name = '**equeue `send`, flush="sync"**' if peer.key == "equeue" else peer.name
            if peer.key == "equeue" and many is not None:
                flushes = [_flushes(r) for r in many.results]
                per_flush = [many.count / f for f in flushes if f]
                if per_flush:
                    name += f" ({statistics.median(per_flush):.1f} sends per fdatasync at 16)"
            lines.append(
                f"| {name} | {counts} | "
                f"{spread(one, 'rate', fmt_rate) if one else '-'} | "
                f"{spread(many, 'rate', fmt_rate) if many else '-'} | "
                f"{fmt_mib(many.median('rss_mib')) if many else '-'} | "
                f"{'' if peer.key == 'equeue' else fmt_ratio(ratio)} |"
            )
        return lines

    def reopen_table(self) -> list[str]:
        lines = [
            "| store | written before the kill | on disk | reopen + first read, s "
            f"median (min{DASH}max) | first message | messages found | peak RSS, MiB | "
            "this ÷ equeue |",
            "|---|--:|--:|--:|---|--:|--:|--:|",
        ]
        equeue = self.get("reopen", "equeue")
        mine = equeue.median("seconds") if equeue else float("nan")
        for outcome in self.rows("reopen"):
            results = outcome.results
            seconds = outcome.median("seconds")
            if results:
                written = int(statistics.median(r["written"] for r in results))
                found = statistics.median(r["stored"] for r in results)
                disk = statistics.median(r["disk_bytes"] for r in results)
                firsts = {
                    "ok" if r["first_ok"] else "empty" if r["empty"] else "wrong" for r in results
                }
                lost = found < written
                first = "/".join(sorted(firsts)) + (" (lost data)" if lost else "")
                notes = {r["note"] for r in results if r.get("note")}
                if notes:
                    first += "; " + "; ".join(sorted(notes))
            else:
                written, found, disk, first = outcome.count, float("nan"), float("nan"), "-"
            size = f"{fmt_size(written * SCENARIO['reopen'].size)}, {written:,} msgs"
            if self.reduced(outcome):
                size += " (reduced)"
            lines.append(
                f"| {row_name(outcome)} | {size} | "
                f"{fmt_size(disk) if disk == disk else '-'} | "
                f"{spread(outcome, 'seconds', fmt_secs)} | {first} | "
                f"{fmt_rate(found)} | {fmt_mib(outcome.median('rss_mib'))} | "
                f"{'' if outcome.peer == 'equeue' else fmt_ratio(seconds / mine)} |"
            )
        return lines

    def memory(self, name: str = "rss_mib") -> dict[str, dict[str, float]]:
        """Medians of ``name`` (MiB) per store label and scenario: the larger of equeue's."""
        table: dict[str, dict[str, float]] = {}
        for outcome in self.outcomes.values():
            label = PEER[outcome.peer].name if outcome.peer != "equeue" else "equeue"
            value = outcome.median(name)
            if value == value:
                cell = table.setdefault(label, {})
                cell[outcome.scenario] = max(cell.get(outcome.scenario, 0.0), value)
        return table

    def memory_table(self) -> list[str]:
        memory, anon, nan = self.memory(), self.memory("anon_mib"), float("nan")
        scenarios = [s for s in SCENARIOS if any(s.key in m for m in memory.values())]
        lines = [
            "| store | " + " | ".join(s.label for s in scenarios) + " | peak |",
            "|---|" + "--:|" * (len(scenarios) + 1),
        ]
        for peer in PEERS:
            label = peer.name if peer.key != "equeue" else "equeue"
            if label not in memory:
                continue
            values, private = memory[label], anon.get(label, {})
            cells = [
                f"{fmt_mib(values.get(s.key, nan))} ({fmt_mib(private.get(s.key, nan))})"
                for s in scenarios
            ]
            name = "**equeue**" if peer.key == "equeue" else label
            lines.append(
                f"| {name} | " + " | ".join(cells) + f" | {fmt_mib(max(values.values()))} |"
            )
        return lines

    # -- targets

    def targets(self) -> list[Target]:
        found: list[Target] = []
        losses, checked = [], 0
        memory = self.memory()
        equeue_peak = max(memory.get("equeue", {}).values(), default=float("nan"))
        for peer in QUEUES:
            for scenario in SCENARIOS:
                outcome = self.get(scenario.key, peer.key)
                if outcome is None or not outcome.results:
                    continue
                if scenario.kind == "reopen":
                    theirs = outcome.median("seconds")
                    equeue = self.get("reopen", "equeue")
                    mine = equeue.median("seconds") if equeue else float("nan")
                    ahead = mine < theirs
                    detail = f"{theirs:.3f} s vs equeue {mine:.3f} s"
                    if any(r["empty"] for r in outcome.results):
                        detail += f" (but {peer.name} reopened empty: it lost every message)"
                else:
                    theirs = outcome.median("rate")
                    mine = self.equeue_best(scenario.key)
                    ahead = mine > theirs
                    detail = (
                        f"{fmt_rate(theirs)} vs equeue {fmt_rate(mine)} msg/s "
                        f"({fmt_ratio(mine / theirs)}x)"
                    )
                checked += 1
                if not ahead:
                    losses.append(f"{scenario.label}: {peer.name} {detail}")
            theirs_peak = max(memory.get(peer.name, {}).values(), default=float("nan"))
            if theirs_peak == theirs_peak:
                checked += 1
                if not equeue_peak < theirs_peak:
                    losses.append(
                        f"peak RSS: {peer.name} {fmt_mib(theirs_peak)} MiB vs equeue "
                        f"{fmt_mib(equeue_peak)} MiB"
                    )
        found.append(
            Target(
                "equeue ahead of every queue library in every scenario",
                checked > 0 and not losses,
                f"behind in {len(losses)} of {checked} comparisons (scenarios x queue "
                "libraries; throughput against the better of `send`/`send_batch`)",
                losses,
            )
        )
        losses, checked = [], 0
        for scenario in (s for s in SCENARIOS if s.kind == "append"):
            batch = self.get(scenario.key, "equeue", "send_batch")
            for peer in ENGINES:
                engine = self.get(scenario.key, peer.key)
                if batch is None or engine is None or not engine.results:
                    continue
                mine, other = batch.median("rate"), engine.median("rate")
                checked += 1
                line = (
                    f"{scenario.label}: {peer.name} {fmt_rate(other)} vs `send_batch` "
                    f"{fmt_rate(mine)} msg/s ({fmt_ratio(mine / other)}x)"
                )
                if not mine > other:
                    losses.append(line)
        found.append(
            Target(
                "with `send_batch`, ahead of sqlite3 and lmdb on append throughput",
                checked > 0 and not losses,
                f"behind in {len(losses)} of {checked} comparisons",
                losses,
            )
        )
        best = self.equeue_best("durable-16")
        ratios = []
        for peer in PEERS:
            if peer.kind not in ("queue", "engine"):
                continue
            rates = [self.get(k, peer.key) for k in ("durable-1", "durable-16")]
            values = [o.median("rate") for o in rates if o is not None and o.results]
            if values:
                ratios.append((best / max(values), peer.name, max(values)))
        ratios.sort()
        found.append(
            Target(
                "durable appends with 16 threads at least 10x every peer's per-message durable "
                "rate",
                bool(ratios) and ratios[0][0] >= 10,
                f"equeue {fmt_rate(best)} msg/s with 16 threads, against each peer's better "
                "rate of 1 and 16 threads",
                [f"{fmt_ratio(r)}x {name} ({fmt_rate(rate)} msg/s)" for r, name, rate in ratios],
            )
        )
        return found

    # -- the whole section

    def markdown(self, charts: Sequence[Path], doc: Path | None) -> str:
        meta = self.meta
        lines = [
            "`tools/bench_peers.py` (part of `make bench`; `--smoke` is a tiny run in `make "
            "test`). Each case runs in its own process and a fresh directory under "
            f"`{meta['directory_shown']}`; the tables give the median and min{DASH}max over "
            f"{meta['repeat']} repeat(s). Bodies are random bytes (1,024 distinct ones, "
            "cycled); MiB/s counts body bytes. Every store holds one FIFO (equeue: one topic "
            "of one queue). Timed: the append or read loop only (open and close are not), "
            "except reopen, which is open + first read in a fresh process. Peak RSS is "
            "`ru_maxrss` of the case's process (it counts the mapped file pages a store "
            "touched; a bare interpreter with the bodies is about the reference row's). "
            "The consume cases read exactly what their append case wrote (checked message "
            "by message). **Compare ratios within one run, not absolute figures across "
            "runs.**",
            "",
        ]
        lines += [f"- {line}" for line in describe(meta)]
        if self.smoke:
            lines += ["- **Smoke run** (`--smoke`): tiny sizes, one repeat; not figures."]
        lines += ["", "Targets of the issue, in this run:", ""]
        for target in self.targets():
            verdict = "met" if target.met else "not met"
            lines.append(f"- {target.name}: **{verdict}**: {target.summary}")
            lines += [f"  - {detail}" for detail in target.details]
        if charts:
            base = doc.parent if doc is not None else Path.cwd()
            lines += [""] + [
                f"![{p.stem}]({os.path.relpath(p, base)})" for p in charts if p.stem != "peers"
            ]
        for scenario in SCENARIOS:
            if scenario.kind not in ("append", "consume") or not self.rows(scenario.key):
                continue
            equeue = next((o for o in self.rows(scenario.key) if o.peer == "equeue"), None)
            n = equeue.count if equeue else scenario.full
            lines += [
                "",
                f"### {scenario.label[0].upper()}{scenario.label[1:]}: {n:,} messages",
                "",
            ]
            if scenario.kind == "append":
                lines += [
                    'No fsync per message (each store\'s mode below). "equeue ÷ this" > 1: '
                    "equeue is faster.",
                    "",
                ]
            else:
                lines += [
                    "Reads what the append case above wrote (litequeue: a smaller queue it "
                    "appended for this, see modes), from the page cache.",
                    "",
                ]
            lines += self.throughput_table(scenario)
        if self.rows("durable-1") or self.rows("durable-16"):
            lines += [
                "",
                "### Durable appends, 1 KiB",
                "",
                "Each message synced before the call returns, where the store offers it "
                "(modes below); 16 threads share one store. Ratio: equeue with 16 threads ÷ "
                "the better of this store's two rates.",
                "",
            ]
            lines += self.durable_table()
        if self.rows("reopen"):
            lines += [
                "",
                "### Reopen after SIGKILL",
                "",
                "A process fills the store with 1 KiB messages, keeps appending and is "
                "SIGKILLed; a fresh process then opens the store and reads its first message "
                '(timed, imports excluded; the page cache is warm). "messages found" is what '
                "the store holds after reopening. Ratio > 1: equeue reopens faster.",
                "",
            ]
            lines += self.reopen_table()
        if self.outcomes:
            lines += [
                "",
                "### Peak memory",
                "",
                "`ru_maxrss` of each case's process, MiB, and in brackets its anonymous "
                "(private) RSS at the end of the case: `ru_maxrss` also counts the pages of "
                "memory-mapped files a store touched (equeue's chunks, lmdb), which are page "
                "cache the kernel can reclaim. Medians over repeats; for equeue the larger of "
                "`send` and `send_batch`. Reduced cases hold less data.",
                "",
            ]
            lines += self.memory_table()
        lines += ["", "### Modes: what each store does, and what it fsyncs", ""]
        for peer in PEERS:
            if not any(o.peer == peer.key for o in self.outcomes.values()):
                continue
            version = meta["versions"].get(peer.key, "")
            lines.append(f"- **{peer.name}**{f' {version}' if version else ''}:")
            for kind in ("append", "consume", "durable", "reopen"):
                lines.append(f"  - {kind}: {peer.modes[kind]}")
        reduced = {
            PEER[o.peer].name
            for o in self.outcomes.values()
            if self.reduced(o) and SCENARIO[o.scenario].kind != "durable"
        }
        if reduced:
            lines += [
                "",
                'Slow peers run fewer messages (marked "reduced") to keep the run within '
                f"about 15 minutes: {', '.join(n for n in PEER_NAMES if n in reduced)}. "
                "In the 16-thread durable case every peer writes fewer messages than equeue "
                "(a per-message fsync each).",
            ]
        return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Target:
    name: str
    met: bool
    summary: str
    details: list[str]


def _flushes(result: Mapping[str, Any]) -> int:
    match = re.search(r"flushes=(\d+)", str(result.get("note", "")))
    return int(match.group(1)) if match else 0


def describe(meta: Mapping[str, Any]) -> list[str]:
    before, after = meta["load_before"], meta["load_after"]
    found = meta["versions"]
    dists = {p.dist: found[p.key] for p in PEERS if p.dist and p.key in found}
    versions = ", ".join(f"{d} {v}" for d, v in dists.items())
    versions += f", sqlite3 (SQLite {sqlite3.sqlite_version})"
    return [
        f"Run: {meta['date']}, Python {meta['python']} ({meta['python_build']}), "
        f"{meta['cpus']} CPUs, Linux {meta['kernel']}",
        f"Directory: {meta['directory']} on {meta['file_system']}",
        f"Source: {meta['source']}",
        f"Peers: {versions}",
        "Load average (1/5/15 min): before "
        + "/".join(f"{x:.2f}" for x in before)
        + ", after "
        + "/".join(f"{x:.2f}" for x in after)
        + " (the machine is shared)",
        f"Wall time: {meta['wall_seconds']:.0f} s",
    ]


# --- charts ----------------------------------------------------------------------------

COLORS = {"equeue": "#d62728", "queue": "#1f77b4", "engine": "#2ca02c", "reference": "#7f7f7f"}


def bar_panel(
    ax: Axes,
    outcomes: Sequence[Outcome],
    metric: str,
    title: str,
    xlabel: str,
    marked: Callable[[Outcome], bool] = lambda outcome: False,
) -> None:
    rows = [o for o in outcomes if o.values(metric)]
    labels, medians, low, high, colors = [], [], [], [], []
    for outcome in reversed(rows):  # barh draws bottom-up: equeue on top
        values = outcome.values(metric)
        median = statistics.median(values)
        name = PEER[outcome.peer].name
        if outcome.peer == "equeue" and outcome.variant:
            name = f"equeue {outcome.variant}"
        if any(r.get("empty") for r in outcome.results):
            name += " (reopened empty)"
        labels.append(f"{name} *" if marked(outcome) else name)
        medians.append(median)
        low.append(median - min(values))
        high.append(max(values) - median)
        colors.append(COLORS[PEER[outcome.peer].kind])
    positions = list(range(len(rows)))
    ax.barh(positions, medians, xerr=[low, high], color=colors, capsize=2)
    ax.set_yticks(positions, labels, fontsize=8)
    log = metric != "rss_mib"  # memory spans a small range: linear reads better
    if log:
        ax.set_xscale("log")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(axis="x", which="major", alpha=0.3)
    for y, value, above in zip(positions, medians, high, strict=True):
        text = (
            f"{value:.3g} s"
            if metric == "seconds"
            else (f"{value:,.0f}" if metric == "rate" else f"{value:,.0f} MiB")
        )
        ax.annotate(  # past the error bar, which it would hide
            text,
            (value + above, y),
            xytext=(4, 0),
            textcoords="offset points",
            va="center",
            fontsize=7,
        )
    if medians:
        top = max(m + h for m, h in zip(medians, high, strict=True))
        ax.set_xlim(min(medians) / 2 if log else 0, top * 6 if log else top * 1.25)


def memory_outcomes(report: Report) -> list[Outcome]:
    """One pseudo-outcome per store: its peak RSS over every case."""
    rows = []
    for peer in PEERS:
        values: list[float] = []
        for outcome in report.outcomes.values():
            if outcome.peer == peer.key:
                values.append(outcome.median("rss_mib"))
        values = [v for v in values if v == v]
        if values:
            rows.append(Outcome("memory", peer.key, "", 0, [{"rss_mib": max(values)}]))
    return rows


def write_charts(report: Report, directory: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    panels: dict[str, tuple[list[Outcome], str, str, str]] = {}
    for scenario in SCENARIOS:
        rows = report.rows(scenario.key)
        if not rows:
            continue
        if scenario.kind == "reopen":
            size = fmt_size(max(o.count for o in rows))
            title = f"Reopen + first read after SIGKILL, {size} store"
            if any(report.reduced(o) for o in rows):
                title += " (* smaller)"
            panels[scenario.key] = (rows, "seconds", title, "seconds (log), lower is better")
        else:
            n = max(o.count for o in rows)
            title = f"{scenario.label[0].upper()}{scenario.label[1:]}, {n:,} msgs"
            if any(report.reduced(o) for o in rows):
                title += " (* fewer)"
            panels[scenario.key] = (rows, "rate", title, "messages/s (log), higher is better")
    memory = memory_outcomes(report)
    if memory:
        panels["memory"] = (
            memory,
            "rss_mib",
            "Peak RSS (ru_maxrss) over all cases",
            "MiB, lower is better",
        )
    groups = {
        "peers-append": ["append-100", "append-1k"],
        "peers-consume": ["consume-100", "consume-1k"],
        "peers-durable": ["durable-1", "durable-16"],
        "peers-reopen": ["reopen", "memory"],
        "peers": [s.key for s in SCENARIOS] + ["memory"],
    }
    written = []
    for name, keys in groups.items():
        keys = [k for k in keys if k in panels]
        if not keys:
            continue
        cols = 2
        nrows = -(-len(keys) // cols)
        fig, axes = plt.subplots(nrows, cols, figsize=(12, 3.6 * nrows), squeeze=False)
        for ax, key in zip(axes.flat, keys, strict=False):
            bar_panel(ax, *panels[key], marked=report.reduced)
        for ax in list(axes.flat)[len(keys) :]:
            ax.set_visible(False)
        title = "equeue beside the Python stores users pick today"
        if report.smoke:
            title += " (smoke run: not figures)"
        fig.suptitle(f"{title}, {report.meta['date'][:10]}", fontsize=11)
        fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight()))  # room for the title
        path = directory / f"{name}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written


# --- the document --------------------------------------------------------------------


def replace_section(text: str, body: str) -> str:
    """``text`` with everything between the peers markers replaced by ``body``."""
    lines = text.splitlines(keepends=True)
    begin = next((i for i, line in enumerate(lines) if line.startswith(BEGIN)), None)
    end = next((i for i, line in enumerate(lines) if line.strip() == END), None)
    if begin is None or end is None or end < begin:
        raise ValueError(f"no {BEGIN} ... {END} section")
    return "".join(lines[: begin + 1]) + body + "".join(lines[end:])


# --- metadata ----------------------------------------------------------------------------


def file_system(path: Path) -> str:
    target = os.path.realpath(path)
    best: tuple[str, str, str] | None = None
    with contextlib.suppress(OSError), open("/proc/mounts", encoding="utf-8") as f:
        for line in f:
            parts = line.split()
            if len(parts) < 3:
                continue
            device, mount, fstype = parts[0], parts[1], parts[2]
            inside = target == mount or target.startswith(mount.rstrip("/") + "/")
            if inside and (best is None or len(mount) >= len(best[1])):
                best = (device, mount, fstype)
    return "unknown" if best is None else f"{best[2]} ({best[0]}) at {best[1]}"


def python_build() -> str:
    args = str(sysconfig.get_config_var("CONFIG_ARGS") or "")
    parts = [
        "PGO" if "--enable-optimizations" in args else "no PGO",
        "LTO" if "--with-lto" in args else "no LTO",
    ]
    return ", ".join(parts)


def source_state() -> str:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True, timeout=10
        ).stdout.rstrip("\n")

    try:
        commit = git("rev-parse", "--short", "HEAD")
        changed = git("status", "--porcelain", "--", "equeue").splitlines()
    except (OSError, subprocess.SubprocessError):
        return "not a git checkout"
    if not changed:
        return f"{commit}, equeue/ unmodified"
    return f"{commit} + uncommitted changes in {', '.join(sorted(c[3:] for c in changed))}"


def versions() -> dict[str, str]:
    found = {"sqlite3": f"SQLite {sqlite3.sqlite_version}"}
    for peer in PEERS:  # keyed by peer: the modes list names each peer's version
        if peer.dist:
            try:
                found[peer.key] = importlib.metadata.version(peer.dist)
            except importlib.metadata.PackageNotFoundError:
                found[peer.key] = "not installed"
    return found


def load_average() -> tuple[float, float, float]:
    try:
        return os.getloadavg()
    except OSError:
        return (float("nan"),) * 3


# --- main --------------------------------------------------------------------------------


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1G, 64M, 4096)")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[match.group(2)]
    return int(float(match.group(1)) * scale)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat: seconds")
    parser.add_argument("--repeat", type=int, help="repeats per case (default 3; smoke 1)")
    parser.add_argument(
        "--dir",
        type=Path,
        default=ROOT / ".bench-scratch",
        help="where the case directories go (default: .bench-scratch in the repository, on "
        "the same disk as the repository); removed afterwards",
    )
    parser.add_argument(
        "--reopen-size",
        type=parse_size,
        default=1 << 30,
        help="bytes of messages in the store that is killed and reopened (default 1G; slow "
        "peers use less)",
    )
    parser.add_argument(
        "--scale", type=float, default=1.0, help="multiply the full run's message counts"
    )
    parser.add_argument("--peers", default=",".join(PEER), help="comma-separated peer keys")
    parser.add_argument(
        "--scenarios", default=",".join(SCENARIO), help="comma-separated scenario keys"
    )
    parser.add_argument(
        "--doc",
        type=Path,
        help="the markdown file whose peers section to "
        "rewrite (default docs/benchmarks.md; none with --smoke)",
    )
    parser.add_argument(
        "--charts",
        type=Path,
        help="where to write the PNG charts (default docs/; none with --smoke)",
    )
    parser.add_argument("--json", type=Path, help="also write every result here")
    parser.add_argument("--case-timeout", type=float, help="seconds per case process")
    parser.add_argument(
        "--jobs", type=int, help="cases run side by side (default 1; smoke 3, timings moot)"
    )
    parser.add_argument(
        "--from-json",
        type=Path,
        metavar="FILE",
        help="measure nothing: write the report and charts from a run saved with --json",
    )
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.case:
        return args
    if args.repeat is None:
        args.repeat = 1 if args.smoke else 3
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    if args.jobs is None:
        args.jobs = 3 if args.smoke else 1
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    if args.case_timeout is None:
        args.case_timeout = 120.0 if args.smoke else 900.0
    args.peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    args.scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [p for p in args.peers if p not in PEER] + [
        s for s in args.scenarios if s not in SCENARIO
    ]
    if unknown:
        parser.error(f"unknown peer or scenario: {', '.join(unknown)}")
    if args.smoke:
        args.reopen_size = min(args.reopen_size, SCENARIO["reopen"].smoke)
    else:
        args.doc = args.doc or DOCS / "benchmarks.md"
        args.charts = args.charts or DOCS
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.case:
        print(json.dumps(run_case(json.loads(args.case))), flush=True)
        return 0
    if args.from_json:
        outcomes, meta = load_results(args.from_json)
        return write_report(args, outcomes, meta)
    args.dir.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="bench-peers-", dir=args.dir))
    load_before = load_average()
    started = time.perf_counter()
    runner = Runner(args, base)
    try:
        progress(f"benchmark directory: {base} ({file_system(base)})")
        runner.run()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    meta = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "repeat": args.repeat,
        "smoke": args.smoke,
        "python": platform.python_version(),
        "python_build": python_build(),
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "directory": str(args.dir.resolve()),
        "directory_shown": _shown(args.dir),
        "file_system": file_system(args.dir),
        "source": source_state(),
        "versions": versions(),
        "load_before": load_before,
        "load_after": load_average(),
        "wall_seconds": time.perf_counter() - started,
    }
    return write_report(args, runner.outcomes, meta)


def load_results(path: Path) -> tuple[dict[tuple[str, str, str], Outcome], dict[str, Any]]:
    """The outcomes and metadata a run saved with ``--json``."""
    data = json.loads(path.read_text())
    outcomes = {}
    for o in data["outcomes"]:
        outcome = Outcome(o["scenario"], o["peer"], o["variant"], o["count"])
        outcome.results, outcome.errors = o["results"], o["errors"]
        outcomes[(outcome.scenario, outcome.peer, outcome.variant)] = outcome
    meta: dict[str, Any] = data["meta"]
    return outcomes, meta


def write_report(
    args: argparse.Namespace,
    outcomes: dict[tuple[str, str, str], Outcome],
    meta: dict[str, Any],
) -> int:
    report = Report(outcomes, meta, bool(meta["smoke"]))
    charts = write_charts(report, args.charts) if args.charts else []
    section = report.markdown(charts, args.doc)
    print(section)
    if args.doc:
        args.doc.write_text(replace_section(args.doc.read_text(), section))
        progress(f"wrote the peers section of {args.doc}")
    for path in charts:
        progress(f"wrote {path}")
    if args.json:
        data = {
            "meta": meta,
            "outcomes": [
                {
                    "scenario": o.scenario,
                    "peer": o.peer,
                    "name": PEER[o.peer].name,
                    "variant": o.variant,
                    "count": o.count,
                    "reduced": report.reduced(o),
                    "results": o.results,
                    "errors": o.errors,
                }
                for o in outcomes.values()
            ],
            "targets": [dataclasses.asdict(t) for t in report.targets()],
            "charts": [str(p) for p in charts],
        }
        args.json.write_text(json.dumps(data, indent=2))
    failed = [o for o in outcomes.values() if o.errors]
    return 1 if failed else 0


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT)) + "/"
    except ValueError:
        return str(path)


if __name__ == "__main__":
    sys.exit(main())
