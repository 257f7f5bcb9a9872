"""What a store must look like after a crash, checked without trusting the store.

Shared by tests/test_crash.py (SIGKILL), tests/test_power_loss.py (the power-loss
model) and tools/crash_test.py (the kill test, many iterations).

``verify_recovered_store`` opens a crashed store and checks:

* every queue is a gap-free prefix: offsets first..next-1 all pull, each message
  names its topic, queue and offset, positions increase with offsets, no message
  id or position appears twice;
* every body is exactly the workload's message ``(producer, seq)`` with the
  right tag, key, properties and code, and each producer's messages are seqs
  0, 1, 2, ... in order (a producer is pinned to one queue);
* an independent walk of the message chunk files (the documented format, every
  frame's checksum verified) finds exactly the records the queues point at, and
  nothing but zeros after the last record: the tail was cut cleanly;
* the queue chunk files hold exactly the pulled entries, and only zeros after;
* ``query_by_key`` returns exactly the surviving messages with that key;
* ``read(position)`` and ``get(message_id)`` agree with ``pull``;
* what the ``Expectation`` requires survived (byte-identical, at the acknowledged
  position and offset), nothing never sent appeared, and, where the send order
  is known, the survivors are a prefix of it;
* every byte recovery removed or changed is in ``store.recovery.cuts``, with an
  exact copy in the cut's side file (nothing dropped silently);
* the store accepts a new send per producer; reopening after a clean close
  needs no recovery (a clean report) and shows exactly the same messages.
"""

from __future__ import annotations

import math
import os
import random
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from crash_writer import (
    PRODUCERS,
    TOPICS,
    Ack,
    code_of,
    key_of,
    keys_of,
    parse_body,
    properties_of,
    send,
    store_config,
    tag_of,
)

from equeue import Message, MessageStore, RecoveryReport, StoreConfig
from equeue.chunks.recovery import TailCut
from equeue.errors import CorruptionError, EQueueError
from equeue.format.chunk import (
    FOOTER_SIZE,
    FRAME_OVERHEAD,
    HEADER_SIZE,
    ChunkFooter,
    ChunkHeader,
    parse_chunk_file_name,
    record_checksum,
)
from equeue.format.message import QUEUE_RECORD, QUEUE_RECORD_SIZE, MessageLogRecord, tag_hash
from equeue.format.topicsjournal import TOPICS_JOURNAL_FILE

WRITER = Path(__file__).resolve().with_name("crash_writer.py")
_U32 = struct.Struct("<I")
_SUFFIX = struct.Struct("<II")
_SHOWN = 25  # problems shown in a description; the rest are counted

QueueKey = tuple[str, int]


# --- what must (and may) survive ---------------------------------------------------------


@dataclass
class Expectation:
    """Per producer: seqs below ``required`` must survive; seqs at or past ``attempted``
    were never sent, so they cannot. ``acks`` holds what sends returned (the last
    acknowledgement of a seq wins: a lost unacknowledged seq is sent again).
    ``order``, when one thread sent everything, is the send order: survivors must be
    a prefix of it."""

    required: dict[int, int] = field(default_factory=dict)
    attempted: dict[int, int] = field(default_factory=dict)
    acks: dict[tuple[int, int], Ack] = field(default_factory=dict)
    order: list[tuple[int, int]] | None = None

    def attempt(self, producer: int, seq: int, count: int) -> None:
        self.attempted[producer] = max(self.attempted.get(producer, 0), seq + count)
        if self.order is not None:
            self.order.extend((producer, s) for s in range(seq, seq + count))

    def acknowledge(self, ack: Ack, *, durable: bool) -> None:
        self.acks[(ack.producer, ack.seq)] = ack
        self.attempted[ack.producer] = max(self.attempted.get(ack.producer, 0), ack.seq + 1)
        if durable:
            self.required[ack.producer] = max(self.required.get(ack.producer, 0), ack.seq + 1)

    def require_acknowledged(self) -> None:
        """Everything acknowledged so far must survive (after flush() or close())."""
        for producer, seq in self.acks:
            self.required[producer] = max(self.required.get(producer, 0), seq + 1)

    def copy(self) -> Expectation:
        return Expectation(
            dict(self.required),
            dict(self.attempted),
            dict(self.acks),
            None if self.order is None else list(self.order),
        )


# --- independent walks of the chunk files ------------------------------------------------


def _chunk_paths(directory: Path) -> list[Path]:
    if not directory.is_dir():
        return []
    found = []
    for name in os.listdir(directory):
        parsed = parse_chunk_file_name(name)
        if parsed is not None:
            found.append((parsed, directory / name))
    return [path for _, path in sorted(found)]


def _open_chunk(path: Path, data_size: int, problems: list[str]) -> tuple[bytes, int, int] | None:
    """(file bytes, first global position, used data bytes per the footer or -1)."""
    data = path.read_bytes()
    if len(data) != HEADER_SIZE + data_size + FOOTER_SIZE:
        problems.append(f"{path}: {len(data)} bytes, expected {HEADER_SIZE + data_size + 128}")
        return None
    try:
        header = ChunkHeader.unpack(data[:HEADER_SIZE], file=str(path))
    except CorruptionError as exc:
        problems.append(f"{path}: bad header: {exc}")
        return None
    raw_footer = data[-FOOTER_SIZE:]
    used = -1
    if any(raw_footer):
        try:
            used = ChunkFooter.unpack(raw_footer, file=str(path)).physical_data_size
        except CorruptionError as exc:
            problems.append(f"{path}: bad footer: {exc}")
            return None
    return data, header.start_position, used


def walk_log(directory: Path, data_size: int) -> tuple[list[tuple[int, bytes]], list[str]]:
    """Every record of the message chunks, each frame checked, as (position, payload)."""
    records: list[tuple[int, bytes]] = []
    problems: list[str] = []
    paths = _chunk_paths(directory)
    expected_base: int | None = None
    for index, path in enumerate(paths):
        opened = _open_chunk(path, data_size, problems)
        if opened is None:
            continue
        data, base, used = opened
        if expected_base is not None and base != expected_base:
            problems.append(f"{path}: starts at position {base}, expected {expected_base}")
        expected_base = base + data_size
        if used < 0 and index != len(paths) - 1:
            problems.append(f"{path}: an ongoing chunk (no footer) before the last chunk")
        limit = HEADER_SIZE + (used if used >= 0 else data_size)
        p = HEADER_SIZE
        while p + _U32.size <= limit:
            (n,) = _U32.unpack_from(data, p)
            if n == 0:
                break
            q = p + _U32.size + n
            if q + _SUFFIX.size > limit:
                problems.append(f"{path}: record at position {base + p - HEADER_SIZE} overruns")
                break
            payload = data[p + _U32.size : q]
            checksum, suffix = _SUFFIX.unpack_from(data, q)
            if suffix != n or record_checksum(payload) != checksum:
                problems.append(
                    f"{path}: record at position {base + p - HEADER_SIZE} fails its checksum"
                )
                break
            records.append((base + p - HEADER_SIZE, payload))
            p = q + _SUFFIX.size
        if used >= 0 and p != HEADER_SIZE + used:
            problems.append(f"{path}: records end at {p - HEADER_SIZE}, the footer says {used}")
        tail = data[p : HEADER_SIZE + data_size]
        if any(tail):
            first = p + len(tail) - len(tail.lstrip(b"\0"))
            problems.append(
                f"{path}: non-zero bytes at file offset {first} after the last record "
                f"(data offset {p - HEADER_SIZE}): not cut cleanly"
            )
    return records, problems


def walk_queue(directory: Path, records_per_chunk: int) -> tuple[list[tuple[int, int]], list[str]]:
    """Every entry of a queue's chunks as (message position, tag hash)."""
    entries: list[tuple[int, int]] = []
    problems: list[str] = []
    data_size = records_per_chunk * QUEUE_RECORD_SIZE
    paths = _chunk_paths(directory)
    for index, path in enumerate(paths):
        opened = _open_chunk(path, data_size, problems)
        if opened is None:
            continue
        data, base, used = opened
        if base != len(entries) * QUEUE_RECORD_SIZE and entries:
            problems.append(f"{path}: starts at offset {base // 12}, expected {len(entries)}")
        if used < 0 and index != len(paths) - 1:
            problems.append(f"{path}: an ongoing chunk (no footer) before the last chunk")
        limit = HEADER_SIZE + (used if used >= 0 else data_size)
        p = HEADER_SIZE
        while p + QUEUE_RECORD_SIZE <= limit:
            stored, hashed = QUEUE_RECORD.unpack_from(data, p)
            if stored == 0 and hashed == 0:
                break
            entries.append((stored - 1, hashed))
            p += QUEUE_RECORD_SIZE
        if used >= 0 and p != HEADER_SIZE + used:
            problems.append(f"{path}: entries end at {p - HEADER_SIZE}, the footer says {used}")
        if any(data[p : HEADER_SIZE + data_size]):
            problems.append(f"{path}: non-zero bytes after the last entry: not cut cleanly")
    return entries, problems


# --- observing a recovered store ---------------------------------------------------------


@dataclass
class Observation:
    problems: list[str] = field(default_factory=list)
    queues: dict[QueueKey, list[Message]] = field(default_factory=dict)
    by_producer: dict[int, list[Message]] = field(default_factory=dict)

    def layout(self) -> dict[QueueKey, list[tuple[str, int]]]:
        return {k: [(m.message_id, m.position) for m in ms] for k, ms in self.queues.items()}


def _pull_all(store: MessageStore, topic: str, queue_id: int, problems: list[str]) -> list[Message]:
    """Every message of the queue. A pull that raises is retried one message at a time,
    so that only the unreadable offsets are reported (and skipped)."""
    first, end = store.queue_range(topic, queue_id)
    if first != 0:
        problems.append(f"{topic}/{queue_id}: starts at offset {first}, not 0 (no retention)")
    messages: list[Message] = []
    offset, count = first, 256
    while offset < end:
        try:
            pulled = store.pull(topic, queue_id, offset, max_count=count)
        except EQueueError as exc:
            if count > 1:
                count = 1
                continue
            problems.append(f"{topic}/{queue_id} offset {offset}: pull raised {exc!r}")
            offset += 1
            continue
        if not pulled.messages or pulled.next_offset <= offset:
            problems.append(f"{topic}/{queue_id}: pull at offset {offset} < next {end} is empty")
            break
        messages += pulled.messages
        offset, count = pulled.next_offset, 256
    return messages


def observe(store: MessageStore) -> Observation:
    obs = Observation()
    problems = obs.problems
    ids: dict[str, str] = {}
    positions: dict[int, Message] = {}
    broken: set[QueueKey] = set()  # queues whose pull failed: their records are not compared
    config = store.config
    for topic in store.topics():
        if topic not in TOPICS:
            problems.append(f"unexpected topic {topic!r}")
            continue
        for queue_id in store.queue_ids(topic):
            before = len(problems)
            messages = _pull_all(store, topic, queue_id, problems)
            if len(problems) > before:
                broken.add((topic, queue_id))
            obs.queues[(topic, queue_id)] = messages
            previous, expected = -1, 0
            for m in messages:
                where = f"{topic}/{queue_id} offset {m.queue_offset} (position {m.position})"
                if (m.topic, m.queue_id) != (topic, queue_id) or m.queue_offset < expected:
                    problems.append(
                        f"{where}: pulled from {topic}/{queue_id} at or after offset {expected}, "
                        f"names {m.topic}/{m.queue_id} offset {m.queue_offset}"
                    )
                elif m.queue_offset > expected:
                    problems.append(f"{where}: offsets {expected}..{m.queue_offset - 1} missing")
                expected = m.queue_offset + 1
                if m.position <= previous:
                    problems.append(f"{where}: position not above the previous offset's")
                previous = m.position
                if m.message_id in ids:
                    problems.append(f"{where}: message id also at {ids[m.message_id]}")
                ids[m.message_id] = where
                positions[m.position] = m
                parsed = parse_body(m.body)
                if parsed is None:
                    problems.append(f"{where}: not a message that was sent: {m.body[:32]!r}")
                    continue
                p, seq = parsed
                if PRODUCERS[p] != (topic, queue_id):
                    problems.append(f"{where}: producer {p}'s seq {seq} in the wrong queue")
                fields = (m.tag, m.key, m.properties, m.code)
                if fields != (
                    tag_of(p, seq),
                    key_of(p, seq),
                    properties_of(p, seq),
                    code_of(p, seq),
                ):
                    problems.append(f"{where}: tag/key/properties/code differ from what was sent")
                obs.by_producer.setdefault(p, []).append(m)
                try:
                    if store.read(m.position) != m:
                        problems.append(f"{where}: read(position) differs from pull")
                    if store.get(m.message_id).position != m.position:
                        problems.append(f"{where}: get(message_id) finds another position")
                except EQueueError as exc:
                    problems.append(f"{where}: read/get raised {exc!r}")
            entries, queue_problems = walk_queue(
                store.path / "queues" / topic / str(queue_id), config.layout.queue_chunk_records
            )
            problems += queue_problems
            pulled = [(m.position, tag_hash(m.tag)) for m in messages]
            if entries != pulled:
                at = next(
                    (i for i, (a, b) in enumerate(zip(entries, pulled, strict=False)) if a != b),
                    None,
                )
                problems.append(
                    f"{topic}/{queue_id}: the queue files hold {len(entries)} entries, pull "
                    f"returned {len(pulled)}; first difference at offset "
                    f"{min(len(entries), len(pulled)) if at is None else at}"
                )
    for p, messages in obs.by_producer.items():
        for i, m in enumerate(messages):
            parsed = parse_body(m.body)
            if parsed is not None and parsed[1] != i:
                problems.append(
                    f"producer {p}: seq {parsed[1]} at {m.topic}/{m.queue_id} offset "
                    f"{m.queue_offset} where seq {i} was due (a gap, duplicate or reordering)"
                )
                break
    records, log_problems = walk_log(store.path / "messages", config.layout.chunk_data_size)
    problems += log_problems
    unchecked: Counter[QueueKey] = Counter()
    for position, payload in records:
        try:
            record = MessageLogRecord.unpack(payload)
        except CorruptionError as exc:
            problems.append(f"log record at position {position} does not decode: {exc}")
            continue
        found = positions.pop(position, None)
        what = f"{record.topic}/{record.queue_id} offset {record.queue_offset}"
        if record.log_position != position:
            problems.append(f"log record at position {position} names {record.log_position}")
        if found is None and (record.topic, record.queue_id) in broken:
            unchecked[(record.topic, record.queue_id)] += 1
        elif found is None:
            problems.append(f"log record at position {position} ({what}) is in no queue")
        elif (record.topic, record.queue_id, record.queue_offset, record.body) != (
            found.topic,
            found.queue_id,
            found.queue_offset,
            found.body,
        ):
            problems.append(f"log record at position {position} ({what}) differs from pull")
    for (topic, queue_id), count in sorted(unchecked.items()):
        problems.append(f"{count} log records of {topic}/{queue_id} unchecked: its pull failed")
    for position in positions:
        problems.append(f"a queue points at position {position}; the log walk has no record there")
    for p, queue in enumerate(PRODUCERS):
        topic = queue[0]
        if topic not in store.topics() or queue in broken:
            continue
        mine = obs.by_producer.get(p, [])
        for key in keys_of(p):
            want = [m.position for m in reversed(mine) if m.key == key]
            try:
                got = [m.position for m in store.query_by_key(topic, key, limit=1 << 30)]
            except EQueueError as exc:
                problems.append(f"query_by_key({topic!r}, {key!r}) raised {exc!r}")
                continue
            if got != want:
                problems.append(
                    f"query_by_key({topic!r}, {key!r}) returned {len(got)} positions, expected "
                    f"{len(want)}: {sorted(set(got) ^ set(want))[:5]} differ"
                )
    return obs


def _by_seq(messages: list[Message]) -> dict[int, Message]:
    found: dict[int, Message] = {}
    for m in messages:
        parsed = parse_body(m.body)
        if parsed is not None:
            found[parsed[1]] = m
    return found


def check_expectation(obs: Observation, exp: Expectation) -> list[str]:
    problems: list[str] = []
    survivors: set[tuple[int, int]] = set()
    for p, (topic, queue_id) in enumerate(PRODUCERS):
        present = _by_seq(obs.by_producer.get(p, []))
        survivors.update((p, seq) for seq in present)
        lost = [seq for seq in range(exp.required.get(p, 0)) if seq not in present]
        if lost:
            first = exp.acks.get((p, lost[0]))
            at = f" (seq {lost[0]} was acknowledged at position {first.position})" if first else ""
            problems.append(
                f"producer {p} ({topic}/{queue_id}): {len(lost)} acknowledged messages lost: "
                f"seqs {lost[0]}..{lost[-1]}{at}"
            )
        never_sent = [seq for seq in present if seq >= exp.attempted.get(p, 0)]
        if never_sent:
            problems.append(f"producer {p}: seqs {never_sent[:5]} survive but were never sent")
        for seq, m in sorted(present.items()):
            ack = exp.acks.get((p, seq))
            if ack is not None and (ack.position, ack.message_id, ack.queue_offset) != (
                m.position,
                m.message_id,
                m.queue_offset,
            ):
                problems.append(
                    f"producer {p} seq {seq}: acknowledged at position {ack.position} offset "
                    f"{ack.queue_offset}, found at position {m.position} offset {m.queue_offset}"
                )
    if exp.order is not None:
        prefix = set(exp.order[: len(survivors)])
        if prefix != survivors:
            missing = sorted(prefix - survivors)[:3]
            extra = sorted(survivors - prefix)[:3]
            problems.append(
                f"the survivors are not a prefix of the send order: (producer, seq) {missing} "
                f"are missing while later {extra} survived"
            )
    return problems


# --- recovery reports its cuts -----------------------------------------------------------


def read_chunk_files(root: Path) -> dict[str, bytes]:
    """Every chunk file of the store (message and queue chunks), by relative path."""
    found: dict[str, bytes] = {}
    for directory in [root / "messages", *sorted((root / "queues").glob("*/*"))]:
        for path in _chunk_paths(directory):
            found[str(path.relative_to(root))] = path.read_bytes()
    return found


def read_journals(root: Path) -> dict[str, bytes]:
    """The metadata journals recovery may cut a torn tail from (topics.journal), by
    relative path: appended in place, so a power cut before their fdatasync can leave a
    partly written last record."""
    path = root / TOPICS_JOURNAL_FILE
    return {TOPICS_JOURNAL_FILE: path.read_bytes()} if path.is_file() else {}


def check_cuts(
    root: Path,
    before: dict[str, bytes],
    after: dict[str, bytes],
    cuts: list[TailCut],
    journals: dict[str, bytes] | None = None,
) -> list[str]:
    """Every byte recovery zeroed, changed or moved away lies in a reported cut whose
    side file holds exactly those bytes; only zero bytes may change unreported
    (recovery re-adding queue entries). A cut of a journal (``journals``: its bytes
    before recovery) must be its tail, the side file a copy of it."""
    problems: list[str] = []
    working = {rel: bytearray(data) for rel, data in before.items()}
    moved: set[str] = set()
    for cut in cuts:
        file, offset, length, side = cut.file, cut.offset, cut.length, cut.side_file
        try:
            rel = str(Path(file).relative_to(root))
        except ValueError:
            problems.append(f"a cut names {file}, outside the store")
            continue
        data = working.get(rel)
        if data is None and journals is not None and rel in journals:
            journal = journals[rel]
            if offset + length != len(journal):
                problems.append(
                    f"a cut of {rel} at {offset} ({length} bytes) is not its tail "
                    f"({len(journal)} bytes before recovery)"
                )
            elif Path(side).read_bytes() != journal[offset:]:
                problems.append(f"side file {side} is not a copy of the tail cut from {rel}")
            continue
        if data is None:
            problems.append(f"a cut names {rel}, which was not a chunk file before recovery")
            continue
        try:
            kept = Path(side).read_bytes()
        except OSError as exc:
            problems.append(f"the side file of a cut from {rel} is unreadable: {exc}")
            kept = None
        if kept is not None and kept != bytes(data[offset : offset + length]):
            problems.append(f"side file {side} is not a copy of the {length} bytes cut from {rel}")
        if offset == 0 and length == len(data) and rel not in after:
            moved.add(rel)
        else:
            data[offset : offset + length] = bytes(len(data[offset : offset + length]))
    for rel, data in working.items():
        new = after.get(rel)
        if new is None:
            if rel not in moved:
                problems.append(f"recovery removed {rel} without reporting a cut")
            continue
        changed = [
            i
            for start in range(0, len(data), 4096)
            if data[start : start + 4096] != new[start : start + 4096]
            for i in range(start, min(start + 4096, len(data)))
            if data[i] != 0 and (i >= len(new) or new[i] != data[i])
        ]
        if changed:
            problems.append(
                f"recovery changed {len(changed)} non-zero bytes of {rel} (file offsets "
                f"{changed[0]}..{changed[-1]}) without reporting a cut"
            )
    return problems


# --- the whole verification --------------------------------------------------------------


@dataclass
class Verdict:
    problems: list[str] = field(default_factory=list)
    stats: Counter[str] = field(default_factory=Counter)
    recovery: RecoveryReport | None = None


def ensure_topics(store: MessageStore) -> None:
    for topic, count in TOPICS.items():
        if topic not in store.topics() or len(store.queue_ids(topic)) < count:
            store.create_topic(topic, count)


def verify_recovered_store(
    path: Path, config: StoreConfig, exp: Expectation, *, control: bool = False
) -> Verdict:
    """Open a crashed store and check it (see the module docstring). ``control``: the
    files are exactly as the page cache held them, so every acknowledged send must be
    there and recovery must cut nothing."""
    verdict = Verdict()
    problems, stats = verdict.problems, verdict.stats
    before = read_chunk_files(path) if path.exists() else {}
    journals = read_journals(path) if path.exists() else {}
    exp = exp.copy()
    if control:
        exp.require_acknowledged()  # the page cache held every acknowledged send
    try:
        store = MessageStore.open(path, config)
    except Exception as exc:
        problems.append(f"opening the crashed store failed: {exc!r}")
        return verdict
    first_layout: dict[QueueKey, list[tuple[str, int]]] = {}
    try:
        report = verdict.recovery = store.recovery
        stats["cuts"] += len(report.cuts)
        stats["recovery problems"] += len(report.problems)
        stats["redispatched"] += report.redispatched
        problems += check_cuts(path, before, read_chunk_files(path), list(report.cuts), journals)
        obs = observe(store)
        problems += obs.problems
        problems += check_expectation(obs, exp)
        exp.order = None  # the new sends below come after everything
        present = {p: _by_seq(ms) for p, ms in obs.by_producer.items()}
        survivors = sum(len(seqs) for seqs in present.values())
        acked = len(exp.acks)
        acked_present = sum(1 for (p, seq) in exp.acks if seq in present.get(p, {}))
        stats["acknowledged"] += acked
        stats["survivors"] += survivors
        stats["unacknowledged survivors"] += survivors - acked_present
        stats["acknowledged, not required, lost"] += acked - acked_present
        stats["unacknowledged lost"] += (
            sum(exp.attempted.values()) - survivors - (acked - acked_present)
        )
        if control and (report.cuts or report.problems):
            problems.append(
                f"nothing was damaged, yet recovery cut {len(report.cuts)} ranges and reported "
                f"{report.problems}: {[str(c) for c in report.cuts][:3]}"
            )
        if not problems:
            ensure_topics(store)
            for p in range(len(PRODUCERS)):
                seq = len(obs.by_producer.get(p, []))
                exp.attempt(p, seq, 1)
                (result,) = send(store, p, seq, 1)
                exp.acknowledge(Ack.of(p, seq, result), durable=True)
            first_layout = observe(store).layout()
    except Exception:
        problems.append(f"checking the recovered store raised:\n{traceback.format_exc()}")
    finally:
        try:
            store.close()
        except Exception as exc:
            problems.append(f"closing the recovered store raised {exc!r}")
    if problems:
        return verdict
    try:
        with MessageStore.open(path, config) as store:
            if not store.recovery.clean:
                problems.append(
                    "reopening after recovery and a clean close was not clean: "
                    f"{len(store.recovery.cuts)} cuts, problems {store.recovery.problems}, "
                    f"{store.recovery.redispatched} re-dispatched"
                )
            obs = observe(store)
            problems += [f"second open: {p}" for p in obs.problems]
            problems += [f"second open: {p}" for p in check_expectation(obs, exp)]
            if obs.layout() != first_layout:
                problems.append("the second open shows other messages than the first")
    except Exception:
        problems.append(f"the second open raised:\n{traceback.format_exc()}")
    return verdict


def describe_problems(problems: list[str]) -> str:
    shown = [f"  - {p}" for p in problems[:_SHOWN]]
    if len(problems) > _SHOWN:
        shown.append(f"  ... and {len(problems) - _SHOWN} more")
    return "\n".join(shown)


# --- the kill test -----------------------------------------------------------------------


@dataclass(frozen=True)
class KillPlan:
    """When to SIGKILL the writer: ``startup``: ``seconds`` after the spawn (maybe before
    or during its open, i.e. during recovery); ``ready``/``delay``: ``seconds`` after it
    printed READY; ``acks``: once it acknowledged ``acks`` messages."""

    mode: str
    seconds: float = 0.0
    acks: int = 0

    def __str__(self) -> str:
        if self.mode == "acks":
            return f"after {self.acks} acks"
        what = "spawn" if self.mode == "startup" else "READY"
        return f"{self.seconds * 1000:.0f} ms after {what}"


def plan_kill(rng: random.Random) -> KillPlan:
    r = rng.random()
    if r < 0.15:
        return KillPlan("startup", rng.uniform(0.0, 0.5))
    if r < 0.30:
        return KillPlan("ready", rng.uniform(0.0, 0.02))
    if r < 0.70:
        return KillPlan("acks", acks=int(math.exp(rng.uniform(0.0, math.log(2500)))))
    return KillPlan("delay", rng.uniform(0.02, 0.6))


@dataclass
class WriterRun:
    plan: KillPlan
    acks: list[Ack] = field(default_factory=list)
    intents: dict[int, int] = field(default_factory=dict)  # producer -> seqs below attempted
    ready: bool = False
    returncode: int | None = None
    stderr: str = ""
    command: str = ""


MAX_RUN_S = 3.0  # a round never runs longer than this after READY
READY_TIMEOUT_S = 60.0  # a writer that cannot open the store in this time has hung


def run_writer(
    store_dir: Path, policy: str, seed: int, plan: KillPlan, options: Sequence[str] = ()
) -> WriterRun:
    """Start the writer (``options`` added to its arguments), SIGKILL it as planned, and
    collect what it acknowledged."""
    run = WriterRun(plan)
    argv = [sys.executable, str(WRITER), str(store_dir), "--policy", policy, "--seed", str(seed)]
    argv += options
    run.command = shlex.join(argv)
    err_path = store_dir.parent / f"writer-{seed}.stderr"
    changed = threading.Condition()
    ready = threading.Event()
    with open(err_path, "wb") as err:
        start = time.monotonic()
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err)
        assert proc.stdout is not None
        stdout = proc.stdout

        def read() -> None:
            for line in stdout:
                if not line.endswith(b"\n"):
                    break  # cut short by the kill
                fields = line.decode().split()
                with changed:
                    if fields[:1] == ["A"]:
                        run.acks.append(Ack.parse(fields[1:]))
                    elif fields[:1] == ["T"]:
                        p, seq, count = map(int, fields[1:])
                        run.intents[p] = max(run.intents.get(p, 0), seq + count)
                    elif fields == ["READY"]:
                        run.ready = True
                        ready.set()
                    changed.notify_all()
            with changed:
                changed.notify_all()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            if plan.mode == "startup":
                _sleep_unless_exited(proc, start + plan.seconds)
            elif _wait_ready(proc, ready):
                if plan.mode == "acks":
                    deadline = time.monotonic() + MAX_RUN_S
                    with changed:
                        while len(run.acks) < plan.acks and proc.poll() is None:
                            if not changed.wait(max(0.0, deadline - time.monotonic())):
                                break
                            if time.monotonic() >= deadline:
                                break
                else:
                    _sleep_unless_exited(proc, time.monotonic() + plan.seconds)
        finally:
            proc.send_signal(signal.SIGKILL)
            run.returncode = proc.wait()
            reader.join(10)
            stdout.close()
    run.stderr = err_path.read_text(errors="replace")
    err_path.unlink()
    return run


def _wait_ready(proc: subprocess.Popen[bytes], ready: threading.Event) -> bool:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not ready.wait(0.05):
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
    return True


def _sleep_unless_exited(proc: subprocess.Popen[bytes], until: float) -> None:
    while proc.poll() is None and time.monotonic() < until:
        time.sleep(min(0.01, max(0.0, until - time.monotonic())))


def image_notes(store_dir: Path) -> Counter[str]:
    """What the kill interrupted, as far as the files tell."""
    notes: Counter[str] = Counter()
    if not (store_dir / "store.json").exists():
        notes["killed before the store was created"] += 1
        return notes
    if any(store_dir.rglob("*.tmp")):
        notes["killed with a temp file (chunk or metadata being created)"] += 1
    chunks = _chunk_paths(store_dir / "messages")
    if chunks:
        data = chunks[-1].read_bytes()
        if any(data[-FOOTER_SIZE:]):
            notes["killed after completing a chunk, before creating the next"] += 1
        elif not any(data[HEADER_SIZE : HEADER_SIZE + FRAME_OVERHEAD]):
            notes["killed with an empty last chunk (just rolled over)"] += 1
    return notes


@dataclass
class IterationResult:
    policy: str
    seed: int
    rounds: list[WriterRun] = field(default_factory=list)
    verdict: Verdict = field(default_factory=Verdict)
    notes: Counter[str] = field(default_factory=Counter)
    image: Path | None = None
    seconds: float = 0.0

    @property
    def problems(self) -> list[str]:
        return self.verdict.problems

    def describe(self) -> str:
        lines = [
            f"kill test, policy={self.policy} seed={self.seed}: "
            f"{len(self.problems)} problems, {sum(len(r.acks) for r in self.rounds)} acks",
            f"  reproduce: python tools/crash_test.py --policy {self.policy} --seed {self.seed} "
            "--iterations 1 --keep",
        ]
        for i, run in enumerate(self.rounds):
            lines.append(
                f"  round {i + 1}: killed {run.plan}, ready={run.ready}, {len(run.acks)} acks, "
                f"exit {run.returncode}: {run.command}"
            )
            if run.stderr.strip():
                lines.append("    writer stderr:\n" + _indent(run.stderr[-3000:], "      "))
        if self.image is not None:
            lines.append(f"  the store as the kill left it: {self.image}")
        if self.verdict.recovery is not None:
            for cut in self.verdict.recovery.cuts[:5]:
                lines.append(f"  recovery: {cut}")
            for problem in self.verdict.recovery.problems[:5]:
                lines.append(f"  recovery problem: {problem}")
        lines.append(describe_problems(self.problems))
        return "\n".join(lines)


def _indent(text: str, prefix: str) -> str:
    return "\n".join(prefix + line for line in text.rstrip().splitlines())


def run_kill_iteration(
    workdir: Path, policy: str, seed: int, *, rounds: int | None = None, keep_image: bool = True
) -> IterationResult:
    """One kill test: ``rounds`` writer runs on one store (each resuming after recovery,
    each SIGKILLed as planned by the seed), then the full verification. Under every
    policy a SIGKILL keeps the page cache, so every acknowledged send must survive."""
    started = time.monotonic()
    rng = random.Random(f"{policy}/{seed}")
    count = rounds or rng.choice((1, 1, 1, 2, 2, 3))
    result = IterationResult(policy, seed)
    store_dir = workdir / "store"
    exp = Expectation()
    for _ in range(count):
        run = run_writer(store_dir, policy, rng.randrange(1 << 30), plan_kill(rng))
        result.rounds.append(run)
        for ack in run.acks:
            exp.acknowledge(ack, durable=True)
        for producer, end in run.intents.items():
            exp.attempted[producer] = max(exp.attempted.get(producer, 0), end)
        if run.returncode != -signal.SIGKILL:
            result.verdict.problems.append(
                f"the writer exited with {run.returncode} before the kill (see its stderr)"
            )
        elif not run.ready and run.plan.mode != "startup":
            result.verdict.problems.append("the writer never got READY (hung opening the store?)")
        if result.problems:
            result.seconds = time.monotonic() - started
            return result
    result.notes = image_notes(store_dir)
    if keep_image and store_dir.exists():
        result.image = workdir / "crash-image"
        shutil.copytree(store_dir, result.image)
    result.verdict = verify_recovered_store(store_dir, store_config(policy), exp)
    result.seconds = time.monotonic() - started
    return result
