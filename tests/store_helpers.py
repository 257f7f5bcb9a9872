"""Shared helpers for the store-level corruption and fault tests (not a test module).

Every message a test sends is kept as a ``Sent`` (its SendResult and what was
sent), so reads can be compared field by field with what the producer gave.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from equeue import Message, MessageStore, OutgoingMessage, SendResult
from equeue.errors import CorruptionError, MessageNotFoundError
from equeue.format.chunk import FRAME_OVERHEAD, HEADER_SIZE
from equeue.format.message import QUEUE_RECORD_SIZE, encode_properties, message_length


def settle_chunk_maker(store: MessageStore) -> None:
    """Wait until the chunk maker is done with the store's log (equeue/chunks/ahead.py):
    its thread makes and removes ``messages/ahead-*.tmp`` beside the writer, so a test
    that copies or compares a live store's files waits for it first (its own thread
    sending nothing meanwhile). Done means no job queued or running and no file made for
    a chunk that exists (the manager removes it and asks for the next); nothing changes
    then until the next roll-over. Without the manager's lock: a job on the maker thread
    may need it while another job of this manager waits behind it."""
    manager = store._messages
    deadline = time.monotonic() + 10
    while True:
        with manager._ahead_cond:
            busy, ahead = manager._ahead_busy, manager._ahead
        last = manager.last_chunk
        stale = (
            ahead is not None
            and last is not None
            and ahead.header.chunk_start_number <= last.end_number
        )
        if not busy and not stale:
            return
        assert time.monotonic() < deadline, (
            f"the chunk maker is not done on {manager.directory}: busy {busy}, "
            f"made {ahead}, the last chunk {last}"
        )
        time.sleep(0.002)


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
    """Every file (bytes) and directory (None) under ``directory``, by relative path."""
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
