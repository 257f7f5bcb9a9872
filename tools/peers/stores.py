"""The stores measured: one adapter per peer behind the operations the scenarios need."""

from __future__ import annotations

import abc
import operator
import os
import sqlite3
import struct
from collections.abc import Iterator
from itertools import chain, islice, repeat, starmap
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, cast

if TYPE_CHECKING:
    from equeue import MessageStore

TOPIC = "bench"
BATCH = 1000  # messages per commit for sqlite3 and lmdb, per send_batch call for equeue
LMDB_MAP_SIZE = 8 << 30  # address space only: the file grows with the data
MiB = 1 << 20


class Store(abc.ABC):
    """One peer behind the operations the scenarios need, each written as a user of that
    library would write it (the timed loops are the store's own calls, nothing more)."""

    # False: the harness serialises durable puts from several threads with a lock.
    threadsafe: ClassVar[bool] = True
    # True: reading a message removes it (so a count taken after first() misses it).
    destructive: ClassVar[bool] = True
    # What the constructor imports: imported before any timing starts, so reopen times
    # open + first read, not the library's import.
    modules: ClassVar[tuple[str, ...]] = ()

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
    modules = ("equeue",)
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
                batch = pull(TOPIC, 0, offset, min(256, count - offset))
                if not batch:
                    break
                offset = batch.next_offset
                yield [m.body for m in batch]
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


class _PersistQueue(Store):
    """What persist-queue's file queue and SQLite queue share: put, get, task_done."""

    modules = ("persistqueue",)

    queue: Any

    def _take(self) -> bytes:
        raise NotImplementedError

    def append(self, bodies: Iterator[bytes]) -> None:
        put = self.queue.put
        for body in bodies:
            put(body)

    def put_durable(self, body: bytes) -> None:
        self.queue.put(body)

    def consume(self, count: int) -> Iterator[bytes]:
        take, done = self._take, self.queue.task_done
        left = count
        while left:
            n = min(left, BATCH)
            yield from starmap(take, repeat((), n))
            done()  # the consumed position (or the deletes) persists once per 1,000
            left -= n

    def first(self) -> bytes | None:
        import persistqueue

        try:
            return self._take()
        except persistqueue.Empty:
            return None

    def count(self) -> int:
        return int(self.queue.qsize())


class PersistQueueFile(_PersistQueue):
    def __init__(self, directory: Path, durable: bool) -> None:
        super().__init__(directory, durable)
        import persistqueue

        # chunksize=1: every put rolls the chunk over, which is the only fsync it does.
        # tempdir: its info file is written there and renamed; keep it on the same disk.
        self.queue = persistqueue.Queue(
            str(directory / "pq"), chunksize=1 if durable else 100, tempdir=str(directory)
        )

    def _take(self) -> bytes:
        body: bytes = self.queue.get_nowait()
        return body

    def close(self) -> None:
        for f in (self.queue.headf, self.queue.tailf):
            f.close()


class PersistQueueSQLite(_PersistQueue):
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

    def _take(self) -> bytes:
        body: bytes = self.queue.get(block=False)
        return body

    def close(self) -> None:
        self.queue.close()


class LiteQueueStore(Store):
    modules = ("litequeue",)

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
    modules = ("diskcache",)

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
    modules = ("queuelib",)
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
    modules = ("lmdb",)
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
