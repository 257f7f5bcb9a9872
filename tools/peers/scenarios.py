"""What is measured: the scenarios, the peers (each with its modes and reduced counts) and
the message bodies."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from itertools import cycle, islice

from peers.stores import (
    DiskcacheDeque,
    EqueueStore,
    LiteQueueStore,
    LmdbStore,
    MiB,
    PersistQueueFile,
    PersistQueueSQLite,
    QueuelibStore,
    ReferenceLog,
    SqliteStore,
    Store,
)

DISTINCT_BODIES = 1024  # bodies are cycled: equal work for every store, little memory


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
