"""Damaged files at the store level: what opening reports, and what reads return after.

The store is built once (two topics, four queues, 4 KiB message chunks and
342-entry queue chunks, so there are completed and ongoing chunks of both
kinds), closed cleanly, and each test damages one file of a copy: a bit flip
or a truncation in a message chunk, a queue chunk, checkpoint.json or
offsets.json. Then, for every case:

* opening does not fail with an unexpected exception. Refusing to open with a
  CorruptionError that names the file and offset is accepted only where the
  case says opening cannot be safe, and then nothing on disk may change.
* the damage is reported with its file and offset: in ``store.recovery`` (a
  cut or a problem), or in the error a read of the damaged message raises;
* every message sent reads back (by pull, tag-filtered pull, id and position)
  byte-identical to what was sent, or the read raises a CorruptionError or
  MessageNotFoundError naming a file and offset, or the message is gone from
  its queue at a place the recovery report names. Wrong bytes are never
  returned;
* reopening reports nothing new (recovery is done once) and the store takes
  new messages.

Each case has a control: the same copy, located the same way, not damaged,
opens clean and returns everything. Chunk-level recovery (exact cuts, side
files) is covered by test_chunks_recovery.py; crash-shaped damage (lost queue
entries, torn tails) by test_store_recovery.py.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from store_helpers import (
    READ_ERRORS,
    Sent,
    assert_all_readable,
    error_locations,
    locations,
    message_file,
    mismatch,
    queue_file,
    send,
    snapshot,
)

from equeue import Message, MessageStore, StoreConfig
from equeue.errors import CorruptionError
from equeue.format.chunk import FOOTER_SIZE, HEADER_SIZE, chunk_file_size
from equeue.format.message import QUEUE_RECORD, QUEUE_RECORD_SIZE

CHUNK = 4096
RECORDS = 342  # the fewest entries a queue chunk may hold (342 * 12 >= 4096)
CONFIG = StoreConfig(
    chunk_data_size=CHUNK, queue_chunk_records=RECORDS, default_queue_count=3, flush="os"
)
U_MESSAGES = 420  # queue u/0: a completed queue chunk (0..341) and an ongoing one (342..419)
COMMITTED = {("g1", "t", 0): 17, ("g1", "u", 0): 350, ("g2", "t", 2): 5}
KEYS = [f"key{i}" for i in range(7)]


def build(path: Path) -> list[Sent]:
    sent: list[Sent] = []
    with MessageStore.open(path, CONFIG) as store:
        store.create_topic("t", 3)
        store.create_topic("u", 1)
        for i in range(U_MESSAGES):
            sent.append(
                send(
                    store,
                    "u",
                    b"u%04d" % i + bytes([i % 251]) * (i % 23),
                    tag="" if i % 4 else "ut",
                )
            )
            if i % 3 == 0:
                j = i // 3
                sent.append(
                    send(
                        store,
                        "t",
                        f"t{j}:".encode() * (1 + j % 13),
                        tag=f"tag{j % 3}",
                        key=KEYS[j % 7] if j % 2 else None,
                        properties={"n": str(j), "p": "x" * (j % 5)} if j % 5 else None,
                        code=j - 70,
                        queue_id=j % 3,
                    )
                )
        for (group, topic, queue_id), offset in COMMITTED.items():
            store.commit_offset(group, topic, queue_id, offset)
    return sent


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Sent]]:
    path = tmp_path_factory.mktemp("pristine") / "store"
    sent = build(path)
    numbers = sorted({s.position // CHUNK for s in sent})
    assert len(numbers) >= 6, "the store must have several completed message chunks"
    assert sum(1 for s in sent if s.position // CHUNK == numbers[-1]) >= 3
    return path, sent


@pytest.fixture
def store_copy(pristine: tuple[Path, list[Sent]], tmp_path: Path) -> tuple[Path, list[Sent]]:
    path = tmp_path / "store"
    shutil.copytree(pristine[0], path)
    return path, pristine[1]


# --- the damage cases --------------------------------------------------------------------


@dataclass(frozen=True)
class Damage:
    """One damaged file: its bytes before and after, and where the damage lies.

    A report of it must name ``file`` and an offset in [start, at]: ``at`` is the first
    damaged byte (for a truncation, the new length) and ``start`` the start of the
    structure holding it (a record frame, a queue entry, a header or footer).
    """

    file: Path
    original: bytes
    damaged: bytes
    start: int
    at: int
    refusal_ok: bool = False

    def apply(self) -> None:
        self.file.write_bytes(self.damaged)

    def restore(self) -> None:
        self.file.write_bytes(self.original)


def flip(path: Path, at: int, start: int, mask: int = 0x10, *, refusal_ok: bool = False) -> Damage:
    original = path.read_bytes()
    damaged = bytearray(original)
    damaged[at] ^= mask
    return Damage(path, original, bytes(damaged), start, at, refusal_ok)


def truncate(path: Path, size: int, start: int, *, refusal_ok: bool = False) -> Damage:
    original = path.read_bytes()
    assert size < len(original)
    return Damage(path, original, original[:size], start, size, refusal_ok)


def zero(path: Path, start: int, length: int) -> Damage:
    original = path.read_bytes()
    damaged = original[:start] + bytes(length) + original[start + length :]
    assert damaged != original
    return Damage(path, original, damaged, start, start)


def log_chunks(sent: list[Sent]) -> list[int]:
    return sorted({s.position // CHUNK for s in sent})


def in_log_chunk(sent: list[Sent], number: int) -> list[Sent]:
    return sorted((s for s in sent if s.position // CHUNK == number), key=lambda s: s.position)


def frame_of(path: Path, s: Sent) -> tuple[Path, int]:
    return message_file(path, CHUNK, s.position)


def assert_completed(file: Path) -> None:
    raw = file.read_bytes()
    assert len(raw) == chunk_file_size(len(raw) - HEADER_SIZE - FOOTER_SIZE)
    assert any(raw[-FOOTER_SIZE:]), f"{file} was expected to be a completed chunk"


def assert_ongoing(file: Path) -> None:
    assert not any(file.read_bytes()[-FOOTER_SIZE:]), f"{file} was expected to be ongoing"


# Message chunks -------------------------------------------------------------------------


def record_in_completed_chunk(path: Path, sent: list[Sent]) -> Damage:
    victim = in_log_chunk(sent, log_chunks(sent)[1])[2]
    file, frame = frame_of(path, victim)
    assert_completed(file)
    return flip(file, frame + 4 + (victim.frame_size - 12) // 2, frame)


def record_in_ongoing_chunk(path: Path, sent: list[Sent]) -> Damage:
    victim = in_log_chunk(sent, log_chunks(sent)[-1])[1]
    file, frame = frame_of(path, victim)
    assert_ongoing(file)
    return flip(file, frame + 4 + (victim.frame_size - 12) // 2, frame)


def length_of_record_in_ongoing_chunk(path: Path, sent: list[Sent]) -> Damage:
    victim = in_log_chunk(sent, log_chunks(sent)[-1])[1]
    file, frame = frame_of(path, victim)
    return flip(file, frame + 1, frame, 0x01)  # the length prefix: 256 bytes longer


# Header and footer damage of a message chunk: the header says which positions the chunk
# holds and the footer vouches for a completed chunk's data. The log is the source of truth,
# and every later position depends on these chunks, so a store that refuses to open (with the
# file and offset, changing nothing) is safe; so is one that opens and reports it.


def header_of_completed_chunk(path: Path, sent: list[Sent]) -> Damage:
    file, _ = frame_of(path, in_log_chunk(sent, log_chunks(sent)[1])[0])
    assert_completed(file)
    return flip(file, 20, 0, refusal_ok=True)


def header_of_ongoing_chunk(path: Path, sent: list[Sent]) -> Damage:
    file, _ = frame_of(path, in_log_chunk(sent, log_chunks(sent)[-1])[0])
    assert_ongoing(file)
    return flip(file, 20, 0, refusal_ok=True)


def footer_of_completed_chunk(path: Path, sent: list[Sent]) -> Damage:
    file, _ = frame_of(path, in_log_chunk(sent, log_chunks(sent)[1])[0])
    assert_completed(file)
    footer = chunk_file_size(CHUNK) - FOOTER_SIZE
    return flip(file, footer + 10, footer, refusal_ok=True)


def ongoing_chunk_cut_mid_record(path: Path, sent: list[Sent]) -> Damage:
    victim = in_log_chunk(sent, log_chunks(sent)[-1])[1]
    file, frame = frame_of(path, victim)
    return truncate(file, frame + 10, frame)


def ongoing_chunk_cut_at_record(path: Path, sent: list[Sent]) -> Damage:
    victim = in_log_chunk(sent, log_chunks(sent)[-1])[1]
    file, frame = frame_of(path, victim)
    return truncate(file, frame, frame)


def completed_chunk_cut(path: Path, sent: list[Sent]) -> Damage:
    # A completed message chunk that lost its end lost acknowledged messages in the middle
    # of the log; refusing to open (changing nothing, so it can be restored) is safe.
    victim = in_log_chunk(sent, log_chunks(sent)[1])[3]
    file, frame = frame_of(path, victim)
    assert_completed(file)
    return truncate(file, frame + 7, frame, refusal_ok=True)


# Queue chunks ---------------------------------------------------------------------------
# Queue chunks are a derived index: every entry's content is also in its message record.
# Opening can therefore always be safe, so no queue case may refuse to open.


def u_entry(path: Path, offset: int) -> tuple[Path, int]:
    return queue_file(path, RECORDS, "u", 0, offset)


def entry_value(file: Path, at: int) -> int:
    stored, _ = QUEUE_RECORD.unpack_from(file.read_bytes(), at)
    return int(stored)


def redirecting_flip(path: Path, sent: list[Sent], offsets: range) -> Damage:
    """A one-bit flip in an entry's position that makes it name another message's record."""
    positions = {s.position for s in sent}
    for offset in offsets:
        file, at = u_entry(path, offset)
        stored = entry_value(file, at)
        for bit in range(20):
            if (stored ^ (1 << bit)) - 1 in positions:
                return flip(file, at + bit // 8, at, 1 << (bit % 8))
    raise AssertionError("no one-bit flip turns an entry into another message's position")


def entry_to_other_message(path: Path, sent: list[Sent]) -> Damage:
    damage = redirecting_flip(path, sent, range(RECORDS + 5, U_MESSAGES))
    assert_ongoing(damage.file)
    return damage


def entry_to_other_message_in_completed_chunk(path: Path, sent: list[Sent]) -> Damage:
    damage = redirecting_flip(path, sent, range(40, RECORDS))
    assert_completed(damage.file)
    return damage


def entry_off_record_boundary(path: Path, sent: list[Sent]) -> Damage:
    file, at = u_entry(path, RECORDS + 10)
    return flip(file, at, at, 0x01)


def entry_past_the_log(path: Path, sent: list[Sent]) -> Damage:
    file, at = u_entry(path, RECORDS + 10)
    return flip(file, at + 5, at, 0x01)  # bit 40 of the position


def entry_tag_hash(path: Path, sent: list[Sent]) -> Damage:
    tagged = next(s for s in sent if s.topic == "u" and s.offset > RECORDS and s.tag)
    file, at = u_entry(path, tagged.offset)
    return flip(file, at + 8, at, 0x01)


def entry_zeroed(path: Path, sent: list[Sent]) -> Damage:
    file, at = u_entry(path, RECORDS + 10)
    return zero(file, at, QUEUE_RECORD_SIZE)


def queue_chunk_cut_mid_entry(path: Path, sent: list[Sent]) -> Damage:
    file, at = u_entry(path, RECORDS + 20)
    assert_ongoing(file)
    return truncate(file, at + 5, at)


def queue_chunk_cut_at_entry(path: Path, sent: list[Sent]) -> Damage:
    file, at = u_entry(path, RECORDS + 20)
    return truncate(file, at, at)


# A completed queue chunk could in principle be rebuilt from the message log, but
# only by scanning the log from that chunk's first message; the store refuses to open
# instead (naming the file and offset, changing nothing) rather than guess.
def completed_queue_chunk_cut(path: Path, sent: list[Sent]) -> Damage:
    file, at = u_entry(path, 100)
    assert_completed(file)
    return truncate(file, at + 3, at, refusal_ok=True)


def header_of_completed_queue_chunk(path: Path, sent: list[Sent]) -> Damage:
    file, _ = u_entry(path, 0)
    assert_completed(file)
    return flip(file, 20, 0, refusal_ok=True)


# Metadata files -------------------------------------------------------------------------


def metadata(name: str, size: Callable[[int], int]) -> Callable[[Path, list[Sent]], Damage]:
    def locate(path: Path, sent: list[Sent]) -> Damage:
        file = path / name
        return truncate(file, size(file.stat().st_size), 0)

    return locate


CASES: dict[str, Callable[[Path, list[Sent]], Damage]] = {
    "log-record-in-completed-chunk": record_in_completed_chunk,
    "log-record-in-ongoing-chunk": record_in_ongoing_chunk,
    "log-record-length-in-ongoing-chunk": length_of_record_in_ongoing_chunk,
    "log-header-of-completed-chunk": header_of_completed_chunk,
    "log-header-of-ongoing-chunk": header_of_ongoing_chunk,
    "log-footer-of-completed-chunk": footer_of_completed_chunk,
    "log-ongoing-chunk-truncated-mid-record": ongoing_chunk_cut_mid_record,
    "log-ongoing-chunk-truncated-at-record": ongoing_chunk_cut_at_record,
    "log-completed-chunk-truncated": completed_chunk_cut,
    "queue-entry-to-other-message": entry_to_other_message,
    "queue-entry-to-other-message-in-completed-chunk": entry_to_other_message_in_completed_chunk,
    "queue-entry-off-record-boundary": entry_off_record_boundary,
    "queue-entry-past-the-log": entry_past_the_log,
    "queue-entry-tag-hash": entry_tag_hash,
    "queue-entry-zeroed": entry_zeroed,
    "queue-ongoing-chunk-truncated-mid-entry": queue_chunk_cut_mid_entry,
    "queue-ongoing-chunk-truncated-at-entry": queue_chunk_cut_at_entry,
    "queue-completed-chunk-truncated": completed_queue_chunk_cut,
    "queue-header-of-completed-chunk": header_of_completed_queue_chunk,
    "checkpoint-truncated": metadata("checkpoint.json", lambda n: n // 2),
    "checkpoint-emptied": metadata("checkpoint.json", lambda n: 0),
    "offsets-truncated": metadata("offsets.json", lambda n: n // 2),
    "offsets-emptied": metadata("offsets.json", lambda n: 0),
}


# --- reading everything back -------------------------------------------------------------


@dataclass
class Readback:
    intact: set[int]  # positions of messages every read returned exactly as sent
    evidence: list[tuple[Path, int]]  # (file, offset) named by read errors
    unexplained: list[str]  # reads that neither returned the message nor said why


def report_locations(store: MessageStore) -> list[tuple[Path, int]]:
    found = [(Path(cut.file), cut.offset) for cut in store.recovery.cuts]
    for problem in store.recovery.problems:
        found += locations(problem)
    return found


def covered(s: Sent, path: Path, report: list[tuple[Path, int]]) -> bool:
    """The recovery report names a place at or before the message's record or queue entry,
    in the chunk that holds it: what was cut from there on includes this message."""
    places = [frame_of(path, s), queue_file(path, RECORDS, s.topic, s.queue_id, s.offset)]
    return any(f == file and o <= offset for file, offset in places for f, o in report)


READS = ("get", "read", "pull", "tag-filtered pull")


def read_one(store: MessageStore, s: Sent, how: str) -> Message | None:
    """The message as one way of reading returns it; None if a pull finds nothing there."""
    if how == "get":
        return store.get(s.result.message_id)
    if how == "read":
        return store.read(s.position)
    tags = s.tag if how == "tag-filtered pull" else None
    messages = store.pull(s.topic, s.queue_id, s.offset, max_count=1, tags=tags).messages
    # A pull goes on past an offset it skips (filtered out, or removed): then the
    # message at s.offset was not found, whatever came after it.
    return messages[0] if messages and messages[0].queue_offset == s.offset else None


def read_back(
    store: MessageStore,
    path: Path,
    sent: list[Sent],
    report: list[tuple[Path, int]] | None = None,
) -> Readback:
    """Read every message every way; collect what failed and whether it was explained
    (by a read error naming a file and offset, or by ``report``, by default the store's
    recovery report)."""
    if report is None:
        report = report_locations(store)
    by_place = {(s.topic, s.queue_id, s.offset): s for s in sent}
    intact: set[int] = set()
    evidence: list[tuple[Path, int]] = []
    unexplained: list[str] = []

    def failed(s: Sent, how: str, exc: BaseException | None) -> None:
        where = error_locations(exc) if exc is not None else []
        evidence.extend(where)
        if not where and not covered(s, path, report):
            unexplained.append(f"{how} of {s.result}: {exc!r}")

    for s in sent:
        ok = True
        named = False  # an earlier read of this message raised an error naming the damage
        for how in READS if s.tag else READS[:3]:
            try:
                got = read_one(store, s, how)
            except READ_ERRORS as exc:
                ok = False
                named = named or bool(error_locations(exc))
                failed(s, how, exc)
                continue
            if got is None:
                ok = False
                # A tag filter trusts the entry's tag hash (reading every record to check
                # it would undo the filter), so a damaged hash can hide the message from
                # a filtered pull; the unfiltered pull before it must have named the entry.
                if not (how == "tag-filtered pull" and named):
                    failed(s, f"{how} (nothing at the offset)", None)
                continue
            wrong = mismatch(got, s)
            assert wrong is None, f"{how} of {s.result} returned wrong data: {wrong}"
        if ok:
            intact.add(s.position)

    # Batched pulls take another path through the queue; whatever they return is exact.
    for topic in store.topics():
        for queue_id in store.queue_ids(topic):
            offset, end = store.queue_range(topic, queue_id)
            while offset < end:
                try:
                    pulled = store.pull(topic, queue_id, offset, max_count=50)
                except READ_ERRORS as exc:
                    evidence.extend(error_locations(exc))
                    offset += 1
                    continue
                for message in pulled.messages:
                    expected = by_place.get((topic, queue_id, message.queue_offset))
                    assert expected is not None, f"a pull returned a message never sent: {message}"
                    wrong = mismatch(message, expected)
                    assert wrong is None, f"a batched pull returned wrong data: {wrong}"
                if pulled.next_offset <= offset:
                    break
                offset = pulled.next_offset

    # Key lookups return only exact messages too.
    for key in KEYS:
        try:
            found = store.query_by_key("t", key, limit=1000)
        except READ_ERRORS as exc:
            evidence.extend(error_locations(exc))
            continue
        for message in found:
            match = next((s for s in sent if s.position == message.position), None)
            assert match is not None and match.key == key, f"query_by_key({key!r}): {message}"
            assert mismatch(message, match) is None, mismatch(message, match)
    return Readback(intact, evidence, unexplained)


def check_offsets(store: MessageStore, *, may_lose: bool) -> None:
    for (group, topic, queue_id), offset in COMMITTED.items():
        found = store.committed_offset(group, topic, queue_id)
        assert found == offset or (may_lose and found is None), (group, topic, queue_id, found)


def open_store(path: Path) -> MessageStore:
    return MessageStore.open(path, CONFIG)


# --- tests -------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_control_without_damage(store_copy: tuple[Path, list[Sent]], case: str) -> None:
    """The same steps as the damage test, with the damage located but not applied."""
    path, sent = store_copy
    damage = CASES[case](path, sent)
    assert damage.damaged != damage.original
    with open_store(path) as store:
        assert store.recovery.cuts == []
        assert store.recovery.problems == []
        assert store.recovery.clean
        assert_all_readable(store, sent)
        readback = read_back(store, path, sent)
        assert readback.intact == {s.position for s in sent}
        assert readback.evidence == [] and readback.unexplained == []
        check_offsets(store, may_lose=False)
    with open_store(path) as store:
        assert store.recovery.clean


@pytest.mark.parametrize("case", CASES)
def test_damage_is_reported_and_never_read(store_copy: tuple[Path, list[Sent]], case: str) -> None:
    path, sent = store_copy
    damage = CASES[case](path, sent)
    damage.apply()
    before = snapshot(path)
    try:
        store = open_store(path)
    except CorruptionError as exc:
        assert damage.refusal_ok, f"opening can be safe here, but was refused: {exc!r}"
        where = error_locations(exc)
        assert any(f == damage.file and damage.start <= o <= damage.at for f, o in where), (
            f"the refusal does not name {damage.file} at [{damage.start}, {damage.at}]: {exc}"
        )
        assert snapshot(path) == before, "a refused open changed files"
        damage.restore()  # once the file is restored, the store opens as it was
        with open_store(path) as store:
            assert store.recovery.clean
            assert_all_readable(store, sent)
        return

    with store:
        report = store.recovery
        reported = report_locations(store)
        readback = read_back(store, path, sent)
        where = reported + readback.evidence
        assert any(f == damage.file and damage.start <= o <= damage.at for f, o in where), (
            f"nothing names {damage.file} at an offset in [{damage.start}, {damage.at}]; "
            f"report: cuts={report.cuts}, problems={report.problems}; "
            f"read errors named {readback.evidence}"
        )
        assert readback.unexplained == [], readback.unexplained[:5]
        check_offsets(store, may_lose=damage.file.name == "offsets.json")
        if damage.file.name == "checkpoint.json":
            assert readback.intact == {s.position for s in sent}  # the log has everything
    with open_store(path) as store:
        assert store.recovery.cuts == [], "recovery must be done once"
        assert store.recovery.problems == [], "recovery must be done once"
        again = read_back(store, path, sent, reported)
        assert again.intact == readback.intact
        assert again.unexplained == []
        for topic in store.topics():
            for queue_id in store.queue_ids(topic):
                after = send(store, topic, b"after recovery %d" % queue_id, queue_id=queue_id)
                pulled = store.pull(topic, queue_id, after.offset).messages
                assert [mismatch(m, after) for m in pulled] == [None]
