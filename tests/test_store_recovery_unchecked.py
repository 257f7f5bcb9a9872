"""Recovery and the queue entries the log cannot check (their records removed by
compaction or retention), review11.

R11-1: a re-dispatch that starts at or below a compacted chunk (checkpoint.json missing
or unreadable, the key index missing, or another queue that lost entries the checkpoint
called durable) saw queue q only up to its last surviving record and cut the entries
after it, whose records compaction had removed: durable entries, and the next sends got
their offsets again. R11-2: with no usable checkpoint, a power loss's torn tail whose
last entry fell between an older entry and the log's first position (retention) was
kept whole, silently, pointing at positions the next sends reuse. R11-3: the check of a
queue's tail kept a list of every entry after a damaged one. R11-8: no test needed the
rule that an unchecked entry below the last entry before the tail is not kept.

The compacted store (as review11's s13): topics r (3 messages), q (10), busy (300), 8 KiB
log chunks, closed cleanly; log chunks 0-2 rewritten by ``rewrite_group`` without q's
records from offset ``part`` on and every third other record, installed by hand as a job
would. The retention store (as review11's s2): q's 10 records in log chunk 0, chunks 0-3
removed by retention, then a writer SIGKILLed after sends to q and a power loss: the log
zeroed from q's first new record, q's entries written back, the last torn low.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
from store_helpers import compact_by_hand

from equeue import MessageStore, StoreConfig
from equeue.atomicfile import read_json
from equeue.chunks.stream import ChunkFile
from equeue.format.chunk import HEADER_SIZE
from equeue.format.message import QUEUE_RECORD, QUEUE_RECORD_SIZE
from equeue.inspect.verify import verify_store
from equeue.store import recovery

CONFIG = StoreConfig(chunk_data_size=8192, flush="os", default_queue_count=1)
Q_FILE = Path("queues/q/0/chunk-000000000000.0000")

_WRITER = """
import os, signal, sys
from equeue import MessageStore, StoreConfig
store = MessageStore.open(sys.argv[1], StoreConfig(flush="os", default_queue_count=1))
topic = sys.argv[3]
if topic not in store.topics():
    store.create_topic(topic, 1)
print([store.send(topic, b"new %d" % i).position for i in range(int(sys.argv[2]))], flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _power_loss(path: Path, sends: int, torn: int, position: int, topic: str = "q") -> list[int]:
    """A writer's ``sends`` to ``topic`` (created first if new), SIGKILLed; then the log
    zeroed from the first of them (its messages not written back) and the topic's entry
    ``torn`` set to ``position`` (its u64's high half not written back). Returns the lost
    messages' positions."""
    run = subprocess.run(
        [sys.executable, "-c", _WRITER, str(path), str(sends), topic],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode < 0, run.stderr
    new: list[int] = json.loads(run.stdout)
    with MessageStore.open(path, CONFIG, read_only=True) as store:
        chunk = store._reader.manager.get_chunk_for(new[0])
        local, file, size = new[0] - chunk.base, chunk.path, chunk.data_size
    with file.open("r+b") as f:
        f.seek(HEADER_SIZE + local)
        f.write(bytes(size - local))
    _set_entry(path, torn, position, Path(str(Q_FILE).replace("/q/", f"/{topic}/")))
    return new


def _set_entry(path: Path, offset: int, position: int, file: Path = Q_FILE) -> None:
    raw = bytearray((path / file).read_bytes())
    at = HEADER_SIZE + offset * QUEUE_RECORD_SIZE
    QUEUE_RECORD.pack_into(raw, at, position + 1, QUEUE_RECORD.unpack_from(raw, at)[1])
    (path / file).write_bytes(bytes(raw))


def _stored_position(path: Path, offset: int) -> int:
    raw = (path / Q_FILE).read_bytes()
    return int(QUEUE_RECORD.unpack_from(raw, HEADER_SIZE + offset * QUEUE_RECORD_SIZE)[0]) - 1


def _damage_derived(path: Path, mode: str) -> None:
    if mode == "drop":
        (path / "checkpoint.json").unlink()
    elif mode == "garble":
        (path / "checkpoint.json").write_bytes(b"{garbage")
    elif mode == "nokeys":
        (path / "keys.sqlite").unlink()
    elif mode == "rdamaged":  # r's entries 1..2 zeroed; the checkpoint says 3
        file = path / "queues/r/0/chunk-000000000000.0000"
        raw = bytearray(file.read_bytes())
        raw[HEADER_SIZE + QUEUE_RECORD_SIZE : HEADER_SIZE + 3 * QUEUE_RECORD_SIZE] = bytes(
            2 * QUEUE_RECORD_SIZE
        )
        file.write_bytes(bytes(raw))


def _q_cuts(store: MessageStore) -> list[str]:
    return [c.file for c in store.recovery.cuts if "/queues/q/" in c.file]


# -- R11-1: entries whose records compaction removed ------------------------------------


Compacted = tuple[Path, list[int], set[int]]


@pytest.fixture(scope="module", params=[5, 0], ids=["part5", "part0"])
def compacted(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Compacted:
    """(the store, q's positions, the positions compaction removed): q's records from
    offset ``part`` on removed (part 0: every one)."""
    part: int = request.param
    path = tmp_path_factory.mktemp(f"compacted{part}") / "store"
    with MessageStore.open(path, CONFIG) as store:
        for topic in ("q", "busy", "r"):
            store.create_topic(topic, 1)
        for i in range(3):
            store.send("r", b"r%d" % i)
        qpos = [store.send("q", b"q%d" % i).position for i in range(10)]
        for i in range(300):
            store.send("busy", b"b%d" % i + b"x" * 40)
    file, _, removed = compact_by_hand(
        path, 3, lambda positions: set(qpos[part:]) | set(positions[10::3])
    )
    assert qpos[-1] < ChunkFile.open(file).header.end_position  # q's records all in it
    assert verify_store(path) == []
    return path, qpos, removed


def _copy(compacted: Compacted, tmp_path: Path) -> Path:
    shutil.copytree(compacted[0], tmp_path / "store")
    return tmp_path / "store"


@pytest.mark.parametrize("mode", ["keep", "rdamaged", "nokeys", "drop", "garble"])
def test_entries_whose_records_compaction_removed_are_kept(
    compacted: Compacted, tmp_path: Path, mode: str
) -> None:
    """Every mode but "keep" starts re-dispatch at the log's first position, below the
    compacted chunk (review11 R11-1: q was cut to (0, part) and its next send got offset
    ``part`` again)."""
    path, qpos, removed = _copy(compacted, tmp_path), compacted[1], compacted[2]
    survivors = [offset for offset, at in enumerate(qpos) if at not in removed]
    _damage_derived(path, mode)
    for reopen in range(2):
        with MessageStore.open(path, CONFIG) as store:
            if mode != "keep" and reopen == 0:
                assert store.recovery.start_position == 0
            assert store.queue_range("q", 0) == (0, 10 + reopen), (mode, reopen)
            assert _q_cuts(store) == []
            # Kept on faith with no checkpointed offset (review12 F3): reported, once.
            named = [p for p in store.recovery.problems if "queue q/0" in p]
            if mode in ("drop", "garble") and reopen == 0:
                assert len(named) == 1, store.recovery.problems
                assert f"offsets {len(survivors)}..9 are kept" in named[0]
            else:
                assert named == [], store.recovery.problems
            assert store.queue_range("r", 0) == (0, 3)
            assert [m.queue_offset for m in store.pull("q", 0, 0, 20)] == survivors + list(
                range(10, 10 + reopen)
            )
            assert store.send("q", b"after").queue_offset == 10 + reopen


@pytest.mark.parametrize(
    ("mode", "tail"),
    [
        ("keep", "five-last-in-a-hole-above"),
        ("drop", "five-last-in-a-hole-above"),
        ("keep", "one-in-a-hole-below"),
        ("drop", "one-in-a-hole-below"),
        ("keep", "one-in-a-hole-above"),
    ],
)
def test_a_torn_tail_after_compacted_entries_is_cut(
    compacted: Compacted, tmp_path: Path, mode: str, tail: str
) -> None:
    """A power loss's tail after q's compacted entries: 5 entries, the last torn to a
    position in a compaction hole above q's last entry (the first lies past the log's
    end); or one entry torn into a hole, below q's last entry's position (positions
    must rise) or above it (with a checkpoint: past the queue's checkpointed offset).
    The tail is cut whole, the compacted entries stay. (One entry torn into a hole above
    the last, with no checkpoint, is indistinguishable from a compacted entry: kept, and
    reported: test_one_entry_torn_into_a_hole_with_no_checkpoint_is_reported.)"""
    path, qpos, removed = _copy(compacted, tmp_path), compacted[1], compacted[2]
    above = min(p for p in removed if p > qpos[9])
    if tail == "five-last-in-a-hole-above":
        _power_loss(path, 5, 14, above)
    elif tail == "one-in-a-hole-below":
        _power_loss(path, 1, 10, max(p for p in removed if p < qpos[9]))
    else:
        _power_loss(path, 1, 10, above)
    _damage_derived(path, mode)
    with MessageStore.open(path, CONFIG) as store:
        assert store.queue_range("q", 0) == (0, 10)
        assert len(_q_cuts(store)) == 1
        assert store.send("q", b"after").queue_offset == 10


@pytest.mark.parametrize(
    ("sends", "onto"),
    [(2, "a-live-record"), (1, "a-live-record"), (1, "a-hole"), (3, "a-live-record")],
)
def test_a_torn_tail_of_a_topic_created_after_the_checkpoint_is_cut(
    compacted: Compacted, tmp_path: Path, sends: int, onto: str
) -> None:
    """review12 F2: topic z, which the checkpoint does not list, created and sent to,
    then a power loss, z's last entry torn low (below the checkpoint's position: onto a
    record of q that survived compaction, or into a compaction hole). The search for z's
    first entry at or past the recovery start ended at z's end (a last entry below it),
    so no entry was checked: z kept them, its pulls from 0 failed for ever and the next
    send reused offset ``sends``. None of z's records is in the log: every entry is cut,
    the bytes kept in recovered/. (3 sends, where the search landed on the tail: a
    control, cut before too.)"""
    path, qpos, removed = _copy(compacted, tmp_path), compacted[1], compacted[2]
    if onto == "a-live-record":
        with MessageStore.open(path, CONFIG, read_only=True) as store:
            position = store.pull("r", 0, 2, 1)[0].position
    else:
        position = min(p for p in removed if p > qpos[0])
    _power_loss(path, sends, sends - 1, position, topic="z")
    checkpoint = read_json(path / "checkpoint.json")
    assert "z" not in checkpoint["queues"] and position < checkpoint["log_position"]
    for reopen in range(2):
        with MessageStore.open(path, CONFIG) as store:
            assert store.queue_range("z", 0) == (0, reopen), reopen
            cuts = [c for c in store.recovery.cuts if "/queues/z/" in c.file]
            assert len(cuts) == 1 - reopen, store.recovery.cuts
            assert [m.body for m in store.pull("z", 0, 0, 10)] == [b"after"] * reopen
            assert store.queue_range("q", 0) == (0, 10)
            assert store.send("z", b"after").queue_offset == reopen
    assert any((path / "queues/z/0/recovered").iterdir())


def test_one_entry_torn_into_a_hole_with_no_checkpoint_is_reported(
    compacted: Compacted, tmp_path: Path
) -> None:
    """review12 F3: topic z created, one send, a power loss (its record lost, its entry
    torn into a compaction hole), checkpoint.json deleted. The entry cannot be told from
    one whose record compaction removed: it is kept (no good entry of a compacted store
    is cut), and the open says so, naming z, the offset and the entry's file (before:
    kept silently, an offset handed out with no message)."""
    path, qpos, removed = _copy(compacted, tmp_path), compacted[1], compacted[2]
    _power_loss(path, 1, 0, min(p for p in removed if p > qpos[0]), topic="z")
    (path / "checkpoint.json").unlink()
    for reopen in range(2):
        with MessageStore.open(path, CONFIG) as store:
            assert store.queue_range("z", 0) == (0, 1 + reopen)
            named = [p for p in store.recovery.problems if "queue z/0" in p]
            if reopen == 0:
                assert len(named) == 1, store.recovery.problems
                assert "offset 0 is kept" in named[0]
                assert f"{path / 'queues/z/0/chunk-000000000000.0000'} at offset 128" in named[0]
            else:  # the close's checkpoint records z's end
                assert named == [], store.recovery.problems
            assert [m.body for m in store.pull("z", 0, 0, 10)] == [b"after"] * reopen
            assert store.send("z", b"after").queue_offset == 1 + reopen


# -- R11-2 / R11-8: a torn tail behind entries whose records retention removed ----------


@pytest.fixture(scope="module")
def retained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int], int]:
    """(the store, q's positions, the log's first position after retention)."""
    # 8: the binary search for the first offset at or past a position lands on the
    # first entry past the log in both tails below, not past the torn one (with 10 it
    # did not: test_a_short_tail_torn_low_after_ten_retained_entries_is_cut).
    return _retained(tmp_path_factory, 8)


@pytest.fixture(scope="module")
def retained_ten(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int], int]:
    return _retained(tmp_path_factory, 10)


def _retained(tmp_path_factory: pytest.TempPathFactory, count: int) -> tuple[Path, list[int], int]:
    path = tmp_path_factory.mktemp("retained") / "store"
    with MessageStore.open(path, CONFIG) as store:
        store.create_topic("q", 1)
        store.create_topic("busy", 1)
        qpos = [store.send("q", b"q%d" % i).position for i in range(count)]
        for i in range(300):
            store.send("busy", b"b%d" % i + b"x" * 40)
    retention = StoreConfig(chunk_data_size=8192, flush="os", max_store_bytes=12000)
    with MessageStore.open(path, retention) as store:
        assert store.apply_retention() > 0
        first = store._reader.manager.first_position
    assert qpos[-1] < first
    return path, qpos, first


@pytest.mark.parametrize(
    ("mode", "tail"),
    [
        (mode, tail)
        for mode in ("drop", "garble")
        for tail in ("torn-above-floor", "short-torn-below-floor")
    ]
    + [("keep", "short-torn-above-floor")],
)
def test_a_torn_tail_behind_retained_entries_is_cut_whole(
    retained: tuple[Path, list[int], int], tmp_path: Path, mode: str, tail: str
) -> None:
    """No usable checkpoint. "torn-above-floor" (review11 s2): 5 lost sends, the last
    entry torn between q's entry 7 and the log's first position: kept whole before
    (R11-2), 4 entries past the log lie before it. "short-torn-below-floor": 2 lost
    sends, the last torn below q's entry 7's position: only the floor rule cuts it (one
    entry past the log before it, as for one flipped entry; R11-8's mutation).
    "short-torn-above-floor", with the checkpoint: the tail check keeps the torn entry,
    the checkpoint's offset cuts it, and no problem says it was kept."""
    path, qpos, first = retained
    copy = tmp_path / "store"
    shutil.copytree(path, copy)
    if tail == "torn-above-floor":
        _power_loss(copy, 5, 12, (qpos[7] + first) // 2)
    elif tail == "short-torn-below-floor":
        _power_loss(copy, 2, 9, qpos[5])
    else:
        _power_loss(copy, 2, 9, (qpos[7] + first) // 2)
    _damage_derived(copy, mode)
    _reopen_cut_at(copy, 8)


def _reopen_cut_at(copy: Path, end: int) -> None:
    """Two opens: the first cuts q's tail at ``end`` (one cut, no problem named), the
    second finds it so; each send gets the next offset."""
    for reopen in range(2):
        with MessageStore.open(copy, CONFIG) as store:
            assert store.queue_range("q", 0) == (end, end + reopen), reopen
            assert len(_q_cuts(store)) == (1 - reopen)
            assert [p for p in store.recovery.problems if "queue q/0" in p] == []
            assert store.send("q", b"after").queue_offset == end + reopen


@pytest.mark.parametrize(
    ("mode", "sends", "torn"),
    [
        (mode, sends, torn)
        for mode in ("drop", "garble", "keep")
        for sends, torn in ((2, "below-q9"), (2, "zero"), (1, "below-q9"), (1, "zero"))
    ]
    + [("keep", 1, "gap")],
)
def test_a_short_tail_torn_low_after_ten_retained_entries_is_cut(
    retained_ten: tuple[Path, list[int], int], tmp_path: Path, mode: str, sends: int, torn: str
) -> None:
    """q's 10 records removed by retention, then ``sends`` lost sends, the last entry
    torn low: below q's entry 9 (to entry 5's position, or 0). With 2 sends and no
    checkpoint, the binary search for the tail's first entry met the torn one last and
    ended at 12, so nothing was checked, and the open's search for the first offset after
    retention (reopen.py) ended at 12 too: range (12, 12), offsets 10-11 skipped
    silently. With 1 send the entry, below the one before it, was kept as one whose
    record retention removed: (11, 11). "gap", with the checkpoint: 1 send torn between
    entry 9 and the log's first position, as a message retention removed would lie, but
    at the checkpoint's offset 10 and below its log position, where no entry appended
    after it can point: kept before, (11, 11). Neither offset was acknowledged: q is
    (10, 10) and the next send gets 10."""
    path, qpos, first = retained_ten
    copy = tmp_path / "store"
    shutil.copytree(path, copy)
    position = {"below-q9": qpos[5], "zero": 0, "gap": (qpos[9] + first) // 2}[torn]
    _power_loss(copy, sends, 9 + sends, position)
    _damage_derived(copy, mode)
    _reopen_cut_at(copy, 10)


def test_a_short_tail_torn_into_the_retained_gap_is_reported(
    retained_ten: tuple[Path, list[int], int], tmp_path: Path
) -> None:
    """As above, 2 sends, no checkpoint, the last entry torn between q's entry 9 and the
    log's first position: one entry past the log, then one whose record retention may
    have removed, is also one flipped entry and a good one. Kept, and now reported
    (the search was misled past both, so nothing was said); no offset is handed out
    twice."""
    path, qpos, first = retained_ten
    copy = tmp_path / "store"
    shutil.copytree(path, copy)
    _power_loss(copy, 2, 11, (qpos[9] + first) // 2)
    (copy / "checkpoint.json").unlink()
    with MessageStore.open(copy, CONFIG) as store:
        named = [p for p in store.recovery.problems if "queue q/0" in p]
        assert len(named) == 1, store.recovery.problems
        assert "offsets 10..11 are kept" in named[0]
        assert store.queue_range("q", 0)[1] == 12
        assert store.send("q", b"after").queue_offset == 12


def test_an_unchecked_entry_kept_past_a_damaged_one_is_reported(
    retained: tuple[Path, list[int], int], tmp_path: Path
) -> None:
    """q's records all removed by retention, its entry 4 flipped far past the log, no
    checkpoint: the entries after it are kept (one damaged entry is no crash's tail), on
    faith, and that is reported naming q and the entry's file (before: kept silently)."""
    path, _, _ = retained
    copy = tmp_path / "store"
    shutil.copytree(path, copy)
    _set_entry(copy, 4, _stored_position(copy, 4) ^ (1 << 40))
    (copy / "checkpoint.json").unlink()
    with MessageStore.open(copy, CONFIG) as store:
        # The open's search for the first offset after retention lands on the damaged one.
        assert store.queue_range("q", 0) == (4, 8)
        assert _q_cuts(store) == []
        named = [p for p in store.recovery.problems if "queue q/0" in p]
        assert len(named) == 1, store.recovery.problems
        assert str(copy / Q_FILE) in named[0]
        assert store.send("q", b"after").queue_offset == 8


# -- R11-3: the tail check's memory ----------------------------------------------------


def test_the_tail_check_keeps_one_block_of_entries(tmp_path: Path) -> None:
    """100,000 entries, entry 50,000 (where the binary search looks first) flipped far
    past the log: the check reads the entries after it from the queue's end and needs the
    last one only. Before, it kept the 50,000 in a list (122 MiB for 1 M entries)."""
    path = tmp_path / "store"
    count, damaged = 100_000, 50_000
    with MessageStore.open(path, StoreConfig(flush="os", default_queue_count=1)) as store:
        store.create_topic("q", 1)
        store.send_batch("q", [b"m"] * count)
    _set_entry(path, damaged, _stored_position(path, damaged) ^ (1 << 40))
    with MessageStore.open(path, read_only=True) as store:
        queue = store._queues["q"][0]
        log_end = store._reader.manager.committed_position
        assert queue.first_offset_at_or_after(log_end) == damaged
        tracemalloc.start()
        try:
            tail = recovery._tail_from(store._reader, queue, log_end)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert tail == (count, None)
    assert peak < 2 << 20, peak


def test_a_clean_reopen_reads_no_record_for_the_tail_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The walk that checks the tail search (``_unmisled``) stops at the checkpoint's
    offset: entries below it were flushed before the checkpoint was written, no crash's
    tail. Without that bound a clean reopen read each open queue's last record (64 reads
    for 64 queues, and a page-in of its chunk after a reboot)."""
    path = tmp_path / "store"
    with MessageStore.open(path, CONFIG) as store:
        store.create_topic("t", 64)
        for i in range(64 * 3):
            store.send("t", b"x", queue_id=i % 64)
    calls: list[int] = []
    backs = recovery._backs

    def counted(*args: object) -> bool | None:
        calls.append(1)
        return backs(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(recovery, "_backs", counted)
    with MessageStore.open(path, CONFIG) as store:
        assert store.recovery.clean
        assert store.queue_range("t", 63) == (0, 3)
    assert calls == []
