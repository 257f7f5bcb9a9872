"""A damaged queue index entry, read without its message: ``queue_positions`` and
``offset_for_time`` report it as a CorruptRecordError naming the queue chunk and the
entry's file offset (review8: ``queue_positions`` dropped a negative position silently
and returned a position past the log; ``offset_for_time`` said "position ... is
negative" or "no chunk N", naming no file). ``pull`` and ``verify`` report the same
damage at the same place, one problem; the undamaged copy reports nothing. A writable
open's recovery keeps every entry (its search for a crash's tail past the log's end took
an entry far past it for the tail and cut the 30 good entries after it), and still cuts a
power loss's tail whose last entry was torn to a small position (review10 F1: that entry
made the check keep every unbacked entry before it).

The store: one queue of 60 messages over several 4 KiB log chunks, closed cleanly; each
case rewrites the entry of queue offset 30 (equeue/store/entrycheck.py says what an
entry alone can show). The compacted variant has log chunk 0 rewritten without every
third record (no Spark: the rewrite itself, installed by hand), so the index names
removed records below the damage.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from equeue import MessageStore, StoreConfig
from equeue.chunks.stream import ChunkFile
from equeue.compaction.rewrite import rewrite_group
from equeue.errors import CorruptionError, CorruptRecordError
from equeue.format.chunk import HEADER_SIZE
from equeue.format.message import QUEUE_RECORD, QUEUE_RECORD_SIZE
from equeue.inspect.verify import verify_store

CONFIG = StoreConfig(chunk_data_size=4096, default_queue_count=1, flush="os")
COUNT = 60
DAMAGED = 30
ENTRY_FILE = Path("queues/t/0/chunk-000000000000.0000")
ENTRY_AT = HEADER_SIZE + DAMAGED * QUEUE_RECORD_SIZE


def _stored(path: Path, offset: int) -> int:
    raw = (path / ENTRY_FILE).read_bytes()
    return int(QUEUE_RECORD.unpack_from(raw, HEADER_SIZE + offset * QUEUE_RECORD_SIZE)[0])


Built = tuple[Path, list[int], list[float], set[int]]

# Each case: the damaged entry's stored value (position + 1) from the store's entries.
CASES: dict[str, Callable[[Path], int]] = {
    # A flipped sign bit: the position turns negative (queue_positions dropped it).
    "negative": lambda path: _stored(path, DAMAGED) ^ (1 << 63),
    # A flipped bit 40: a position far past the log's end (queue_positions returned it).
    "past-the-log": lambda path: _stored(path, DAMAGED) ^ (1 << 40),
    # In the log, but not after the previous entry's position.
    "below-previous": lambda path: _stored(path, DAMAGED - 1) - 1,
    # In the log, but not before the next entry's: the damaged one is this entry, whose
    # position holds no record of offset 30, not the next one.
    "above-next": lambda path: _stored(path, DAMAGED + 1) + 1,
}


def _build(path: Path, compacted: bool) -> tuple[list[int], list[float], set[int]]:
    """(every message's position, every message's stored_at), by queue offset, and the
    positions compaction removed."""
    with MessageStore.open(path, CONFIG) as store:
        store.create_topic("t", 1)
        results = [store.send("t", b"body %03d " % i + b"x" * 150) for i in range(COUNT)]
        times = [m.stored_at for m in store.pull("t", 0, 0, COUNT)]
    removed: set[int] = set()
    if compacted:
        file = sorted((path / "messages").glob("chunk-*"))[0]
        chunk = ChunkFile.open(file)
        positions = [chunk.header.start_position + local for local, _ in chunk.records()]
        staging = path / "staging"
        staging.mkdir()
        removed = set(positions[::3])
        result = rewrite_group([chunk], sorted(removed), staging, version=1)
        file.unlink()
        shutil.move(staging / result.file_name, path / "messages" / result.file_name)
        staging.rmdir()
        assert verify_store(path) == []
    return [r.position for r in results], times, removed


@pytest.fixture(scope="module", params=["plain", "compacted"])
def built(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Built:
    path = tmp_path_factory.mktemp(f"entries-{request.param}") / "store"
    return (path, *_build(path, request.param == "compacted"))


def _copy(built: Built, tmp_path: Path) -> Path:
    copy = tmp_path / "store"
    shutil.copytree(built[0], copy)
    return copy


def _damage(path: Path, case: str) -> int:
    stored = CASES[case](path) & ((1 << 64) - 1)
    file = path / ENTRY_FILE
    raw = bytearray(file.read_bytes())
    raw[ENTRY_AT : ENTRY_AT + 8] = stored.to_bytes(8, "little")
    file.write_bytes(bytes(raw))
    return stored


def _names_the_entry(exc: CorruptionError, path: Path) -> None:
    assert exc.file == str(path / ENTRY_FILE), exc
    assert exc.offset == ENTRY_AT, exc
    assert f"offset {DAMAGED}" in str(exc) and f"(0x{ENTRY_AT:x})" in str(exc), exc


@pytest.mark.parametrize("read_only", [True, False], ids=["read-only", "writer"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_damaged_entry_is_reported_by_every_read(
    built: Built, tmp_path: Path, case: str, read_only: bool
) -> None:
    path = _copy(built, tmp_path)
    positions, times = built[1], built[2]
    stored = _damage(path, case)
    with MessageStore.open(path, CONFIG, read_only=read_only) as store:
        # A writer's recovery cuts no entry: one far past the log is not a crash's tail
        # (its binary search for the tail cut offsets 30..59 on a flipped bit 20 or 40).
        assert store.recovery.cuts == [] and store.queue_range("t", 0) == (0, COUNT)
        with pytest.raises(CorruptRecordError) as caught:
            store.queue_positions("t", 0, 0, COUNT)
        _names_the_entry(caught.value, path)
        assert caught.value.found == stored, caught.value
        assert f"found 0x{stored:x}" in str(caught.value)
        # The entries after it are read as ever.
        assert store.queue_positions("t", 0, DAMAGED + 1, COUNT) == positions[DAMAGED + 1 :]
        with pytest.raises(CorruptionError) as later:
            store.offset_for_time("t", 0, times[DAMAGED])  # its search reads offset 30 first
        _names_the_entry(later.value, path)
        with pytest.raises(CorruptionError) as pulled:
            store.pull("t", 0, 0, COUNT)
        _names_the_entry(pulled.value, path)
    problems = verify_store(path)
    assert [(p.file, p.offset, p.kind) for p in problems] == [
        (str(path / ENTRY_FILE), ENTRY_AT, "queue entry")
    ], problems


@pytest.mark.parametrize("read_only", [True, False], ids=["read-only", "writer"])
def test_the_undamaged_copy_reports_nothing(built: Built, tmp_path: Path, read_only: bool) -> None:
    path = _copy(built, tmp_path)
    positions, times = built[1], built[2]
    with MessageStore.open(path, CONFIG, read_only=read_only) as store:
        assert store.queue_positions("t", 0, 0, COUNT) == positions
        assert store.offset_for_time("t", 0, times[DAMAGED]) == DAMAGED
        pulled = store.pull("t", 0, 0, COUNT)
        assert [m.position for m in pulled] == [p for p in positions if p not in built[3]]
        assert pulled.next_offset == COUNT
    assert verify_store(path) == []


_READER = """
import json, sys
from equeue import MessageStore
from equeue.errors import EQueueError
out = {}
with MessageStore.open(sys.argv[1], read_only=True) as store:
    for name, read in [
        ("queue_positions", lambda: store.queue_positions("t", 0, 0, 100)),
        ("offset_for_time", lambda: store.offset_for_time("t", 0, float(sys.argv[2]))),
    ]:
        try:
            out[name] = read()
        except EQueueError as exc:
            out[name] = [type(exc).__name__, exc.file, exc.offset]
print(json.dumps(out))
"""


@pytest.mark.parametrize("case", ["past-the-log", None], ids=["damaged", "control"])
def test_a_reader_in_another_process_beside_the_writer(
    built: Built, tmp_path: Path, case: str | None
) -> None:
    path = _copy(built, tmp_path)
    positions, times = built[1], built[2]
    if case is not None:
        _damage(path, case)
    with MessageStore.open(path, CONFIG) as writer:
        writer.send("t", b"after the damage")  # the reader's view must catch up to it
        run = subprocess.run(
            [sys.executable, "-c", _READER, str(path), repr(times[DAMAGED])],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        end = writer.queue_range("t", 0)[1]
    found = json.loads(run.stdout)
    if case is None:
        assert found["queue_positions"][:COUNT] == positions and end == COUNT + 1
        assert found["offset_for_time"] == DAMAGED
    else:
        where = ["CorruptRecordError", str(path / ENTRY_FILE), ENTRY_AT]
        assert found == {"queue_positions": where, "offset_for_time": where}


_POWER_LOSS = """
import os, signal, sys
from equeue import MessageStore, StoreConfig
store = MessageStore.open(sys.argv[1], StoreConfig(default_queue_count=1, flush="os"))
store.create_topic("new", 1)
print([store.send("new", b"new %d" % i).position for i in range(10)], flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_torn_tail_is_cut_and_a_damaged_entry_kept_in_one_recovery(tmp_path: Path) -> None:
    """Both shapes in one writable open. Topic "old" (closed cleanly, so in the
    checkpoint) has one entry flipped far past the log, with good entries after it: all
    are kept. Topic "new" was made after the checkpoint by a writer SIGKILLed at once;
    then a power loss: the log lost its messages (zeroed from its first one) while its 10
    queue entries were written back, the last torn to position 3 (an entry's u64 whose
    high half was not written back). Nothing backs "new"'s entries: all are cut (round 16
    cut them; the check entry by entry kept all 10, pointing at positions the next sends
    reuse)."""
    path = tmp_path / "store"
    old_count, damaged = 20, 10
    with MessageStore.open(path, StoreConfig(default_queue_count=1, flush="os")) as store:
        store.create_topic("old", 1)
        old = [store.send("old", b"old %d" % i).position for i in range(old_count)]
    run = subprocess.run(
        [sys.executable, "-c", _POWER_LOSS, str(path)], capture_output=True, text=True, timeout=60
    )
    assert run.returncode < 0, run.stderr
    first_new = json.loads(run.stdout)[0]
    assert first_new > 3 and 3 not in old  # position 3 lies inside old's first record
    log_file = sorted((path / "messages").glob("chunk-*"))[-1]
    with log_file.open("r+b") as f:
        f.seek(HEADER_SIZE + first_new)  # (new's 10 records take well under 64 KiB)
        f.write(bytes(64 << 10))
    old_file = path / "queues/old/0/chunk-000000000000.0000"
    new_file = path / "queues/new/0/chunk-000000000000.0000"
    for file, offset, value in [
        (
            old_file,
            damaged,
            QUEUE_RECORD.unpack_from(
                old_file.read_bytes(), HEADER_SIZE + damaged * QUEUE_RECORD_SIZE
            )[0]
            ^ (1 << 40),
        ),
        (new_file, 9, 3 + 1),
    ]:
        raw = bytearray(file.read_bytes())
        at = HEADER_SIZE + offset * QUEUE_RECORD_SIZE
        QUEUE_RECORD.pack_into(raw, at, value, QUEUE_RECORD.unpack_from(raw, at)[1])
        file.write_bytes(bytes(raw))
    for reopen in range(2):  # the second open must not bring them back
        with MessageStore.open(path) as store:
            assert store.queue_range("new", 0) == (0, 0), reopen
            assert store.queue_range("old", 0) == (0, old_count + reopen), reopen
            assert (
                store.queue_positions("old", 0, damaged + 1, old_count - damaged - 1)
                == old[damaged + 1 :]
            )
            with pytest.raises(CorruptRecordError):
                store.queue_positions("old", 0, damaged, 1)
            store.send("old", b"after")  # at a position new's lost entries named
            assert list(store.pull("new", 0, 0, 10)) == []
