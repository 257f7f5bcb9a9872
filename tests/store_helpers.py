"""Shared helpers for the store-level corruption and fault tests (not a test module).

Every message a test sends is kept as a ``Sent`` (its SendResult and what was
sent), so reads can be compared field by field with what the producer gave.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from equeue import Message, MessageStore, OutgoingMessage, SendResult
from equeue.chunks.ahead import MAKER, AheadFile
from equeue.chunks.chunk import Chunk
from equeue.chunks.stream import ChunkFile
from equeue.compaction.rewrite import rewrite_group
from equeue.errors import CorruptionError, MessageNotFoundError
from equeue.format.chunk import FRAME_OVERHEAD, HEADER_SIZE
from equeue.format.message import QUEUE_RECORD_SIZE, encode_properties, message_length

# How long a settle waits for the chunk maker: its job is one file's creation and an
# fsync, which a disk shared with other test runs can hold for seconds.
SETTLE_TIMEOUT = 60.0


def settle_chunk_maker(store: MessageStore | None = None) -> None:
    """Wait until the chunk maker (equeue/chunks/ahead.py) has no job queued or running:
    its one thread per process makes and removes ``messages/ahead-*.tmp`` (and fsyncs the
    log directory after a roll-over installed one) beside the writer, so whatever reads a
    live store's files, copies them or counts file calls or descriptors waits for it first.

    Done is when a marker job, queued behind every job submitted so far, runs and finds
    nothing queued after it: the jobs before it are finished and any job they queued (a
    file made for a chunk a roll-over made first is removed and the next one asked for,
    within the job) would be behind it. This holds until a writer of this process rolls
    a log over again, so the thread that settles sends nothing meanwhile, and a snapshot
    taken after an operation that may have rolled over settles again (``snapshot`` does).
    ``store``: also checks that its log's manager has no job and no file made for a chunk
    that exists (a writer thread of this process, a BrokerThread's, may roll over while
    this waits: then the wait goes on). A broker in another process has its own maker,
    which this cannot see."""
    deadline = time.monotonic() + SETTLE_TIMEOUT
    while True:
        if _maker_idle(deadline) and (store is None or _manager_settled(store)):
            return
        assert time.monotonic() < deadline, (
            f"the chunk maker did not settle in {SETTLE_TIMEOUT} s: jobs queued "
            f"{len(MAKER._jobs)}, {_manager_state(store) if store is not None else ''}"
        )
        time.sleep(0.002)


def _maker_idle(deadline: float) -> bool:
    """Whether a marker job found nothing queued behind it (see settle_chunk_maker)."""
    ran = threading.Event()
    queued_after: list[int] = []

    def marker() -> None:
        with MAKER._wakeup:
            queued_after.append(len(MAKER._jobs))
        ran.set()

    MAKER.submit(marker)
    assert ran.wait(max(deadline - time.monotonic(), 0.0)), (
        f"the chunk maker's thread did not run a job in {SETTLE_TIMEOUT} s "
        f"({len(MAKER._jobs)} queued)"
    )
    return queued_after == [0]


def _manager_settled(store: MessageStore) -> bool:
    busy, ahead, last = _manager_state(store)
    stale = (
        ahead is not None
        and last is not None
        and ahead.header.chunk_start_number <= last.end_number
    )
    return not busy and not stale


def _manager_state(store: MessageStore) -> tuple[bool, AheadFile | None, Chunk | None]:
    """Without the manager's lock: a maker job may need it (a file made for a chunk that
    exists is removed under it)."""
    manager = store._messages
    with manager._ahead_cond:
        busy, ahead = manager._ahead_busy, manager._ahead
    return busy, ahead, manager.last_chunk


@dataclass(frozen=True)
class Sent:
    """One acknowledged message: what send() returned and what it was given."""

    result: SendResult
    body: bytes
    tag: str = ""
    key: str | None = None
    properties: dict[str, str] = field(default_factory=dict)
    code: int = 0

    @property
    def topic(self) -> str:
        return self.result.topic

    @property
    def queue_id(self) -> int:
        return self.result.queue_id

    @property
    def offset(self) -> int:
        return self.result.queue_offset

    @property
    def position(self) -> int:
        return self.result.position

    @property
    def frame_size(self) -> int:
        """Bytes the message's record takes in the log, framing included."""
        return frame_size(self.topic, self.body, self.tag, self.key, self.properties)


def frame_size(
    topic: str,
    body: bytes,
    tag: str = "",
    key: str | None = None,
    properties: dict[str, str] | None = None,
) -> int:
    props = encode_properties(properties) if properties else b""
    key_bytes = key.encode() if key is not None else b""
    return message_length(topic.encode(), tag.encode(), key_bytes, props, body) + FRAME_OVERHEAD


def send(
    store: MessageStore,
    topic: str,
    body: bytes,
    *,
    tag: str = "",
    key: str | None = None,
    properties: dict[str, str] | None = None,
    code: int = 0,
    queue_id: int | None = None,
) -> Sent:
    result = store.send(
        topic, body, tag=tag, key=key, properties=properties, code=code, queue_id=queue_id
    )
    return Sent(result, body, tag, key, dict(properties or {}), code)


def send_batch(store: MessageStore, topic: str, messages: list[OutgoingMessage]) -> list[Sent]:
    results = store.send_batch(topic, messages)
    return [
        Sent(r, m.body, m.tag, m.key, dict(m.properties or {}), m.code)
        for r, m in zip(results, messages, strict=True)
    ]


def mismatch(message: Message, sent: Sent) -> str | None:
    """Why ``message`` is not exactly the message ``sent`` describes; None if it is."""
    result = sent.result
    expected = (
        result.message_id,
        result.topic,
        result.queue_id,
        result.queue_offset,
        result.position,
        sent.tag,
        sent.key,
        sent.properties,
        sent.code,
        sent.body,
        result.stored_at,
    )
    found = (
        message.message_id,
        message.topic,
        message.queue_id,
        message.queue_offset,
        message.position,
        message.tag,
        message.key,
        message.properties,
        message.code,
        message.body,
        message.stored_at,
    )
    if expected == found:
        return None
    return f"expected {expected!r}, read {found!r}"


def pull_all(store: MessageStore) -> dict[tuple[str, int], list[Message]]:
    """Every message of every queue, by batched pulls from each queue's start."""
    result: dict[tuple[str, int], list[Message]] = {}
    for topic in store.topics():
        for queue_id in store.queue_ids(topic):
            messages: list[Message] = []
            offset = store.queue_range(topic, queue_id)[0]
            while True:
                pulled = store.pull(topic, queue_id, offset, max_count=64)
                messages += pulled.messages
                if pulled.next_offset <= offset:
                    break
                offset = pulled.next_offset
            result[(topic, queue_id)] = messages
    return result


def assert_all_readable(store: MessageStore, sent: list[Sent]) -> None:
    """Every message reads back exactly as sent, by pull, by id and by position, and the
    queues hold nothing else."""
    by_queue: dict[tuple[str, int], list[Sent]] = {}
    for s in sent:
        by_queue.setdefault((s.topic, s.queue_id), []).append(s)
    pulled = pull_all(store)
    for key, expected in by_queue.items():
        expected = sorted(expected, key=lambda s: s.offset)
        got = pulled.get(key, [])
        offsets = [m.queue_offset for m in got]
        assert offsets == [s.offset for s in expected], (
            f"queue {key} holds offsets {offsets}, but {[s.offset for s in expected]} were "
            "acknowledged"
        )
        for message, s in zip(got, expected, strict=True):
            assert mismatch(message, s) is None, mismatch(message, s)
    for key, messages in pulled.items():
        assert key in by_queue or not messages, f"unexpected messages in {key}: {messages[:3]}"
    for s in sent:
        assert mismatch(store.get(s.result.message_id), s) is None
        assert mismatch(store.read(s.position), s) is None


# --- where damage is reported ---------------------------------------------------------

_WHERE = re.compile(r"in (/\S+?) at offset (\d+)")


def locations(text: str) -> list[tuple[Path, int]]:
    """(file, offset) pairs named in an error message or a recovery problem."""
    return [(Path(f), int(o)) for f, o in _WHERE.findall(text)]


def error_locations(exc: BaseException) -> list[tuple[Path, int]]:
    """Where an exception (or one it was raised from) says the damage is."""
    found: list[tuple[Path, int]] = []
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, CorruptionError) and seen.file is not None and seen.offset is not None:
            found.append((Path(seen.file), seen.offset))
        found += locations(str(seen))
        seen = seen.__cause__ or seen.__context__
    return found


READ_ERRORS = (CorruptionError, MessageNotFoundError)


def message_file(store_path: Path, chunk_data_size: int, position: int) -> tuple[Path, int]:
    """The message chunk holding ``position`` and the file offset of its frame."""
    number, local = divmod(position, chunk_data_size)
    return store_path / "messages" / f"chunk-{number:012d}.0000", HEADER_SIZE + local


def queue_file(
    store_path: Path, records: int, topic: str, queue_id: int, offset: int
) -> tuple[Path, int]:
    """The queue chunk holding queue ``offset`` and the file offset of its entry."""
    number, index = divmod(offset, records)
    directory = store_path / "queues" / topic / str(queue_id)
    return directory / f"chunk-{number:012d}.0000", HEADER_SIZE + index * QUEUE_RECORD_SIZE


def snapshot(directory: Path, *, skip: tuple[str, ...] = ("LOCK",)) -> dict[str, bytes | None]:
    """Every file (bytes) and directory (None) under ``directory``, by relative path, read
    once this process's chunk maker has settled (its ``ahead-*.tmp`` is a write like any:
    a rejected call's stray one must show, the maker's own must not come and go between
    two snapshots)."""
    settle_chunk_maker()
    result: dict[str, bytes | None] = {}
    for root, dirs, files in os.walk(directory):
        base = Path(root)
        for name in dirs:
            result[str((base / name).relative_to(directory)) + "/"] = None
        for name in files:
            if name not in skip:
                path = base / name
                result[str(path.relative_to(directory))] = path.read_bytes()
    return result


def killed_store(script: str, store: Path) -> Path:
    """``store`` as ``script`` (run with the store's path as argv[1]) left it: the script
    ends by SIGKILLing itself (a writer killed, nothing closed)."""
    here = Path(__file__).parent
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(here.parent), str(here)])}
    run = subprocess.run(
        [sys.executable, "-c", script, str(store)], env=env, timeout=60, capture_output=True
    )
    assert run.returncode == -signal.SIGKILL, run.stderr
    return store


def tree(directory: Path, *, skip: tuple[str, ...] = ()) -> dict[str, tuple[bytes | None, int]]:
    """Every entry under ``directory`` (links not followed): its bytes (None: a directory
    or a link) and mtime, read once the chunk maker has settled (as ``snapshot``)."""
    settle_chunk_maker()
    found: dict[str, tuple[bytes | None, int]] = {}
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            if name in skip:
                continue
            entry = Path(root) / name
            st = entry.lstat()
            data = entry.read_bytes() if entry.is_file() and not entry.is_symlink() else None
            found[str(entry.relative_to(directory))] = (data, st.st_mtime_ns)
    return found


def compact_by_hand(
    store: Path, count: int, removing: Callable[[list[int]], set[int]]
) -> tuple[Path, list[int], set[int]]:
    """The first ``count`` log chunks of the closed store rewritten without the records
    ``removing(every position they hold)`` names, installed by hand as a compaction job
    would (no Spark). Returns (the compacted file, the positions it keeps, the removed)."""
    files = sorted((store / "messages").glob("chunk-*"))[:count]
    chunks = [ChunkFile.open(p) for p in files]
    positions = [c.header.start_position + local for c in chunks for local, _ in c.records()]
    removed = removing(positions)
    staging = store / "staging"
    staging.mkdir()
    result = rewrite_group(chunks, sorted(removed), staging, version=1)
    for f in files:
        f.unlink()
    shutil.move(staging / result.file_name, store / "messages" / result.file_name)
    staging.rmdir()
    return (
        store / "messages" / result.file_name,
        [p for p in positions if p not in removed],
        removed,
    )


def messages_listings(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every listing of a log directory (``messages``) from now on, as os.listdir's
    argument: monkeypatched, undone with ``monkeypatch``."""
    listed: list[str] = []
    listdir = os.listdir

    def counting(path: Any = ".") -> list[str]:
        if str(path).endswith("messages"):
            listed.append(str(path))
        return listdir(path)

    monkeypatch.setattr(os, "listdir", counting)
    return listed
