"""topics.journal (equeue/format/topicsjournal.py, equeue/store/topicsfile.py): its
records round-trip; a create_topic that returned survives a SIGKILL and a power cut at
every flush; a torn tail is cut (copied aside, reported), a hostile journal refused
with its file and offset; folds; a failed append changes nothing; a read-only handle in
another process follows topics through folds."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st
from many_queues_child import body, low_config
from power_loss_model import Damage, PowerCut, materialize, recording

from equeue import MessageStore, StoreConfig, atomicfile
from equeue.atomicfile import read_json
from equeue.chunks.chunk import write_error
from equeue.cli import main
from equeue.errors import (
    ChecksumMismatchError,
    CorruptionError,
    DiskFullError,
    StorePathError,
    TruncatedError,
)
from equeue.format.topicsjournal import (
    HEADER_SIZE,
    MAGIC,
    RECORD_HEAD_SIZE,
    TOPICS_JOURNAL_FILE,
    TopicRecord,
    check_header,
    pack_header,
)
from equeue.store import topicsfile
from equeue.store.config import open_queue_limit
from equeue.store.meta import TOPICS_FILE

HERE = Path(__file__).parent
CONFIG = StoreConfig(
    flush="os", max_open_chunks=2, chunk_data_size=1 << 20, queue_chunk_records=1024
)

NAMES = st.text(st.sampled_from("abcXYZ019._-é"), min_size=1, max_size=40)
SECONDS = st.floats(0, 3.15e9, allow_nan=False)


@given(
    topic=NAMES,
    count=st.none() | st.integers(1, 1024),
    deleted=st.none() | st.integers(0, (1 << 64) - 1),
    compact=st.booleans(),
    retention=st.none() | SECONDS,
    delete_retention=SECONDS,
)
def test_record_round_trip(
    topic: str,
    count: int | None,
    deleted: int | None,
    compact: bool,
    retention: float | None,
    delete_retention: float,
) -> None:
    record = TopicRecord(topic, count, deleted, compact, retention, delete_retention)
    raw = b"junk" + record.pack()
    assert len(raw) == 4 + RECORD_HEAD_SIZE + len(topic.encode())
    assert TopicRecord.unpack(raw, 4, "f") == (record, len(raw))
    if count is not None:
        assert TopicRecord.from_entry(topic, record.to_entry()) == record


def test_record_bytes_are_the_documented_table() -> None:
    raw = TopicRecord("ab", 4, 70, True, 30.0, 86400.0).pack()
    size = RECORD_HEAD_SIZE + 2
    assert struct.unpack_from("<I", raw, 0)[0] == xxhash.xxh32_intdigest(raw[4:])
    assert struct.unpack_from("<IBBHIQdd", raw, 4) == (
        size,
        1 | 2 | 4 | 8,
        0,
        2,
        4,
        70,
        30.0,
        86400.0,
    )
    assert raw[40:] == b"ab"
    header = pack_header(7)
    assert struct.unpack_from("<8sIQ", header) == (MAGIC, 2, 7)
    assert struct.unpack_from("<I", header, 20)[0] == xxhash.xxh32_intdigest(header[:20])
    assert check_header(header, "f") == (7, HEADER_SIZE)
    old = MAGIC + struct.pack("<I", 1)  # version 1: no generation, records from 16
    assert check_header(old + struct.pack("<I", xxhash.xxh32_intdigest(old)), "f") == (0, 16)


def test_unpack_refuses_damage_with_file_and_offset() -> None:
    raw = pack_header() + TopicRecord("t", 1).pack()
    with pytest.raises(TruncatedError) as truncated:
        TopicRecord.unpack(raw[:-1], HEADER_SIZE, "J")
    assert (truncated.value.file, truncated.value.offset) == ("J", HEADER_SIZE)
    flipped = bytearray(raw)
    flipped[-1] ^= 1
    with pytest.raises(ChecksumMismatchError):
        TopicRecord.unpack(bytes(flipped), HEADER_SIZE, "J")
    nan = bytearray(TopicRecord("t", 1, delete_retention_seconds=math.nan).pack())
    with pytest.raises(CorruptionError, match="delete_retention of nan"):
        TopicRecord.unpack(bytes(nan), 0, "J")
    with pytest.raises(CorruptionError, match="bad magic"):
        check_header(b"X" * HEADER_SIZE, "J")


# --- the store ------------------------------------------------------------------------


def _journal(path: Path) -> bytes:
    return (path / TOPICS_JOURNAL_FILE).read_bytes()


def _generation(path: Path) -> int:
    return topicsfile.file_generation(path / TOPICS_FILE)


def test_create_and_delete_append_records_and_a_clean_close_folds(tmp_path: Path) -> None:
    with MessageStore.open(tmp_path, CONFIG) as store:
        # Created at the open, at generation 1 though there is no topics.json yet: its
        # records are never at 0 (test_topics_downgrade.py).
        assert _generation(tmp_path) == 0 and _journal(tmp_path) == pack_header(1)
        store.create_topic("a", 4)
        store.create_topic("b", 1, cleanup="compact")
        store.send("b", b"x", key="k")
        store.delete_topic("b")
        store.create_topic("b", 2)  # created again
        raw = _journal(tmp_path)
        records = topicsfile.Journal(tmp_path / TOPICS_JOURNAL_FILE).read().records
        assert [(r.topic, r.queue_count, r.deleted_before) for _, r in records] == [
            ("a", 4, None),
            ("b", 1, None),
            ("b", None, store.deleted_topics()["b"]),
            ("b", 2, store.deleted_topics()["b"]),
        ]
        assert len(raw) == HEADER_SIZE + sum(RECORD_HEAD_SIZE + 1 for _ in records)
        assert not (tmp_path / TOPICS_FILE).exists()  # no fold yet: 4 appends only
        deleted = store.deleted_topics()
    assert _journal(tmp_path) == pack_header(_generation(tmp_path))  # the close folded it
    body = read_json(tmp_path / TOPICS_FILE)
    assert body["a"]["queue_count"] == 4 and body["b"]["queue_count"] == 2
    with MessageStore.open(tmp_path, CONFIG) as store:
        assert store.topics() == ["a", "b"] and store.queue_ids("b") == [0, 1]
        assert store.deleted_topics() == deleted
        assert store.topic_policy("b").cleanup == "delete"
        assert not store.recovery.problems and not store.recovery.cuts


def test_journal_folds_past_its_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(topicsfile, "JOURNAL_FOLD_BYTES", HEADER_SIZE + 5 * (RECORD_HEAD_SIZE + 3))
    with MessageStore.open(tmp_path, CONFIG) as store:
        sizes = []
        for i in range(13):
            store.create_topic(f"t{i:02d}", 2)
            sizes.append(len(_journal(tmp_path)))
        assert max(sizes) <= topicsfile.JOURNAL_FOLD_BYTES
        assert sizes.count(HEADER_SIZE) == 2  # folded instead of the 6th and 12th append
        assert sorted(read_json(tmp_path / TOPICS_FILE)) == [f"t{i:02d}" for i in range(12)]
        assert sizes[-1] == HEADER_SIZE + RECORD_HEAD_SIZE + 3  # t12: in the journal only
        store._topics_file.close_fd()  # no fold at the close: the next open replays it
    assert len(_journal(tmp_path)) == sizes[-1]
    with MessageStore.open(tmp_path, CONFIG) as again:
        assert again.topics() == [f"t{i:02d}" for i in range(13)]


def test_a_fold_cut_short_leaves_an_old_journal_that_is_not_replayed(tmp_path: Path) -> None:
    """A crash between a fold's topics.json and its fresh journal: the old journal's
    generation is below the file's, so its records are not replayed (deleted, created
    again), and the open replaces it."""
    with MessageStore.open(tmp_path, CONFIG) as store:
        store.create_topic("a", 1)
        store.send("a", b"x")
        store.delete_topic("a")
        store.create_topic("a", 3)
        store.create_topic("c", 1)
        old = _journal(tmp_path)
        expected = store.deleted_topics()
    (tmp_path / TOPICS_JOURNAL_FILE).write_bytes(old)  # as before the fold's second step
    with MessageStore.open(tmp_path, CONFIG) as store:
        assert store.topics() == ["a", "c"] and store.queue_ids("a") == [0, 1, 2]
        assert store.deleted_topics() == expected
        assert not store.recovery.problems and not store.recovery.cuts


def test_a_version_1_journal_is_replayed_and_replaced(tmp_path: Path) -> None:
    """A journal the first version wrote (no generation: generation 0) over a topics.json
    without one: replayed, then replaced by a version-2 journal at the writable open."""
    with MessageStore.open(tmp_path, CONFIG) as store:
        store.create_topic("a", 2)
        records = _journal(tmp_path)[HEADER_SIZE:]
        store._topics_file.close_fd()  # (no fold at the close)
    head = MAGIC + struct.pack("<I", 1)
    old = head + struct.pack("<I", xxhash.xxh32_intdigest(head)) + records
    (tmp_path / TOPICS_JOURNAL_FILE).write_bytes(old)
    with MessageStore.open(tmp_path, read_only=True) as reader:
        assert reader.topics() == ["a"]
    with MessageStore.open(tmp_path, CONFIG) as store:
        assert store.topics() == ["a"] and store.queue_ids("a") == [0, 1]
        assert _generation(tmp_path) == 2  # (a store with no topics.json journals at 1)
        assert _journal(tmp_path) == pack_header(2)


@pytest.mark.parametrize("tail", ["none", "half", "zeros", "flipped"])
def test_a_torn_tail_is_cut_copied_aside_and_reported(
    tmp_path: Path, tail: str, caplog: pytest.LogCaptureFixture
) -> None:
    """What an append a crash interrupted leaves; "none" is the control."""
    with MessageStore.open(tmp_path, CONFIG) as store:
        store.create_topic("kept", 2)
        store._topics_file.close_fd()  # (no fold at close: the journal stays as it is)
    journal = tmp_path / TOPICS_JOURNAL_FILE
    journal.write_bytes(
        pack_header() + TopicRecord("kept", 2, delete_retention_seconds=86400.0).pack()
    )
    torn = TopicRecord("lost", 1).pack()
    extra = {"none": b"", "half": torn[:30], "zeros": bytes(50), "flipped": torn[:-1] + b"?"}[tail]
    with open(journal, "ab") as f:
        f.write(extra)
    end = HEADER_SIZE + RECORD_HEAD_SIZE + 4
    reader = MessageStore.open(tmp_path, read_only=True)  # reads, never cuts
    assert reader.topics() == ["kept"]
    assert journal.stat().st_size == end + len(extra)
    with caplog.at_level(logging.WARNING, "equeue.recovery"), MessageStore.open(tmp_path) as store:
        assert store.topics() == ["kept"]
        cuts = [c for c in store.recovery.cuts if c.file == str(journal)]
        if tail == "none":
            assert cuts == [] and not caplog.records
        else:
            assert [(c.offset, c.length) for c in cuts] == [(end, len(extra))]
            assert Path(cuts[0].side_file).read_bytes() == extra
            assert any("topics.journal" in r.getMessage() for r in caplog.records)
        assert _journal(tmp_path) == pack_header(_generation(tmp_path))  # folded at the open
    reader.refresh()
    assert reader.topics() == ["kept"]
    reader.close()


def _hostile(path: Path, kind: str) -> int:
    """Plant a hostile journal; returns the offset the error must name."""
    journal = path / TOPICS_JOURNAL_FILE
    good = pack_header() + TopicRecord("ok", 1).pack()
    if kind == "symlink":
        (path / "elsewhere").write_bytes(good)
        journal.unlink()
        journal.symlink_to(path / "elsewhere")
        return -1
    if kind == "magic":
        journal.write_bytes(b"junk" * 10)
        return 0
    if kind == "junk in the middle":
        journal.write_bytes(good + b"\x07" * 60 + TopicRecord("after", 1).pack())
        return len(good)
    if kind in ("directory name", "path"):
        journal.write_bytes(
            good + TopicRecord(".." if kind == "directory name" else "../x", 1).pack()
        )
        return len(good)
    assert kind == "queue count"
    journal.write_bytes(good + TopicRecord("big", 5000).pack())
    return len(good)


@pytest.mark.parametrize(
    "kind", ["symlink", "magic", "junk in the middle", "directory name", "path", "queue count"]
)
def test_a_hostile_journal_is_refused_naming_file_and_offset(tmp_path: Path, kind: str) -> None:
    MessageStore.open(tmp_path, CONFIG).close()
    offset = _hostile(tmp_path, kind)
    journal = str(tmp_path / TOPICS_JOURNAL_FILE)
    for read_only in (True, False):
        before = sorted(p.name for p in tmp_path.iterdir())
        if kind == "symlink":
            with pytest.raises(StorePathError) as path_error:
                MessageStore.open(tmp_path, read_only=read_only)
            assert journal in str(path_error.value)
        else:
            with pytest.raises(CorruptionError) as exc:
                MessageStore.open(tmp_path, read_only=read_only)
            assert (exc.value.file, exc.value.offset) == (journal, offset), exc.value
        assert sorted(p.name for p in tmp_path.iterdir()) == before
    with pytest.raises((CorruptionError, StorePathError)):  # the consumers' read of it
        topicsfile.read_topics_body(tmp_path)


def test_a_failed_append_changes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Disk full at the append's fdatasync: create_topic raises, the record is cut off
    again (its bytes must not stand before the next one); the cut's own fdatasync failed
    too, so the next change folds (topics.json and a fresh journal) instead of appending."""
    store = MessageStore.open(tmp_path, CONFIG)
    try:
        store.create_topic("a", 1)
        before = _journal(tmp_path)
        real = os.fdatasync
        fd = store._topics_file._fd

        def full(target: int) -> None:
            if target == fd:
                raise OSError(errno.ENOSPC, "No space left on device")
            real(target)

        monkeypatch.setattr(os, "fdatasync", full)
        with pytest.raises(DiskFullError, match=r"topics\.journal"):
            store.create_topic("b", 2)
        assert store.topics() == ["a"] and _journal(tmp_path) == before
        assert not (tmp_path / TOPICS_FILE).exists()
        store.create_topic("c", 1)  # folded: no append to the journal that failed
        assert _journal(tmp_path) == pack_header(_generation(tmp_path))
        assert sorted(read_json(tmp_path / TOPICS_FILE)) == ["a", "c"]
        monkeypatch.setattr(os, "fdatasync", real)
        store.delete_topic("a")  # appended again
        assert len(_journal(tmp_path)) == HEADER_SIZE + RECORD_HEAD_SIZE + 1
        store._topics_file.close_fd()  # no fold at the close: replayed at the open
    finally:
        store.close()
    with MessageStore.open(tmp_path, CONFIG) as again:
        assert again.topics() == ["c"] and list(again.deleted_topics()) == ["a"]
        assert not again.recovery.problems


def _journal_writes_fail(path: Path, data: bytes) -> None:
    """topicsfile's write_bytes with the disk full for topics.journal (a fold's second
    write) only."""
    if path.name == TOPICS_JOURNAL_FILE:
        raise write_error(OSError(errno.ENOSPC, "No space left on device"), "writing", path)
    _real_write_bytes(path, data)


_real_write_bytes = atomicfile.write_bytes


@pytest.mark.parametrize("change", ["delete keep", "delete tt", "create cc"])
def test_a_fold_whose_fresh_journal_fails_has_made_the_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    """A change that folds (the journal full) and whose fresh journal cannot be written:
    topics.json holds the change, so the call returns and memory has it too. The old
    journal stays beside the new file; its generation is older, so no reader and no open
    replays it ("tt": its create record there would bring the deleted topic back)."""
    with MessageStore.open(tmp_path, CONFIG) as store:
        store.send("keep", b"m1")
    bound = len(_journal(tmp_path)) + 2 * (RECORD_HEAD_SIZE + 2)
    monkeypatch.setattr(topicsfile, "JOURNAL_FOLD_BYTES", bound)
    store = MessageStore.open(tmp_path, CONFIG)
    try:
        store.create_topic("tt", 4)
        store.create_topic("aa", 1)  # the journal is full: the next change folds
        old = _journal(tmp_path)
        with monkeypatch.context() as m:
            m.setattr(topicsfile, "write_bytes", _journal_writes_fail)
            verb, topic = change.split()
            if verb == "delete":
                store.delete_topic(topic)
            else:
                store.create_topic(topic, 2)
        expected = sorted({"keep", "tt", "aa"} ^ {topic})  # (one removed, or "cc" added)
        assert store.topics() == expected
        assert _journal(tmp_path) == old  # left: the fold wrote topics.json only
        listed = topicsfile.read_topics_body(tmp_path)  # a reader, as consumer commits read
        assert sorted(t for t, e in listed.items() if "queue_count" in e) == expected
        with MessageStore.open(tmp_path, read_only=True) as reader:
            assert reader.topics() == expected
        assert topicsfile.Journal(tmp_path / TOPICS_JOURNAL_FILE).read().stale
    finally:
        store.close()  # (no fold: the journal is not open; as after a crash)
    assert _journal(tmp_path) == old
    with MessageStore.open(tmp_path, CONFIG) as again:
        assert again.topics() == expected and not again.recovery.problems
        if topic == "tt":
            assert "tt" in again.deleted_topics()
        if topic != "keep":
            assert [m.body for m in again.pull("keep", 0, 0, 10).messages] == [b"m1"]
        assert _journal(tmp_path) == pack_header(_generation(tmp_path))  # replaced


def test_a_journal_larger_than_a_writer_leaves_is_refused_unread(tmp_path: Path) -> None:
    """A writer folds before the journal passes JOURNAL_FOLD_BYTES: a larger one (here
    sparse zeros) is refused, naming the file and its size, before it is read whole by
    the open or by a reader; one of the largest size a writer can leave is read."""
    with MessageStore.open(tmp_path, CONFIG) as store:
        store.create_topic("a", 1)
    journal = tmp_path / TOPICS_JOURNAL_FILE
    limit = topicsfile.JOURNAL_FOLD_BYTES + RECORD_HEAD_SIZE + 0xFFFF
    os.truncate(journal, limit + 1)
    with pytest.raises(CorruptionError, match=f"{limit + 1} bytes") as caught:
        topicsfile.read_topics_body(tmp_path)
    assert caught.value.file == str(journal)
    with pytest.raises(CorruptionError, match=f"{limit + 1} bytes"):
        MessageStore.open(tmp_path, CONFIG)
    os.truncate(journal, limit)  # the control: zeros after the header, a torn append
    assert list(topicsfile.read_topics_body(tmp_path)) == ["a"]
    with MessageStore.open(tmp_path, CONFIG) as store:
        assert store.topics() == ["a"] and len(store.recovery.cuts) == 1


# --- crashes -----------------------------------------------------------------------------

_CREATOR = """
import sys
from equeue import MessageStore, StoreConfig
config = StoreConfig(flush="os", chunk_data_size=1 << 20, queue_chunk_records=1024)
store = MessageStore.open(sys.argv[1], config)
for i in range(100_000):
    store.create_topic(f"t{i}", 1 + i % 4)
    if i % 7 == 3:
        print(f"deleting t{i - 1}", flush=True)
        store.delete_topic(f"t{i - 1}")
        print(f"deleted t{i - 1}", flush=True)
    print(f"created t{i} {1 + i % 4}", flush=True)
"""


def _env() -> dict[str, str]:
    return os.environ | {"PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)])}


def test_create_topic_that_returned_survives_a_sigkill(tmp_path: Path) -> None:
    for round_, kill_after in enumerate((25, 60, 150)):
        path = tmp_path / f"s{round_}"
        proc = subprocess.Popen(
            [sys.executable, "-c", _CREATOR, str(path)],
            stdout=subprocess.PIPE, text=True, env=_env(),
        )  # fmt: skip
        try:
            assert proc.stdout is not None
            deadline = time.monotonic() + 60
            lines: list[str] = []
            while len(lines) < kill_after and time.monotonic() < deadline:
                lines.append(proc.stdout.readline())
            proc.send_signal(signal.SIGKILL)  # in the middle of the next create or delete
            lines = ("".join(lines) + proc.stdout.read()).split("\n")[:-1]  # whole lines
        finally:
            proc.kill()
            proc.wait(timeout=30)
        expected: dict[str, int] = {}
        deleting = set()  # deleted maybe: the kill came before "deleted"
        for line in lines:
            words = line.split()
            if words[0] == "created":
                expected[words[1]] = int(words[2])
            elif words[0] == "deleting":
                deleting.add(words[1])
            else:
                expected.pop(words[1])
                deleting.discard(words[1])
        assert len(expected) > kill_after // 2, "the child created little before the kill"
        with MessageStore.open(path, CONFIG) as store:
            found = {t: len(store.queue_ids(t)) for t in store.topics()}
            sure = {t: n for t, n in expected.items() if t not in deleting}
            assert {t: found.get(t) for t in sure} == sure
            # At most the one being created at the kill is more.
            assert len(set(found) - set(expected)) <= 1, found.keys() - expected.keys()
            assert not store.recovery.problems, store.recovery.problems


@pytest.mark.parametrize("damage", [Damage("zeros", "revert"), Damage("random", "mixed", 3)])
def test_create_topic_that_returned_survives_a_power_cut_at_every_flush(
    tmp_path: Path, damage: Damage, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Power cut at each flush of a run of creates and deletes with folds (a small bound):
    every create_topic/delete_topic that returned is on the disk the cut leaves."""
    monkeypatch.setattr(topicsfile, "JOURNAL_FOLD_BYTES", HEADER_SIZE + 4 * (RECORD_HEAD_SIZE + 2))
    cut_at = 1
    while cut_at < 200:
        root = tmp_path / f"r{cut_at}"
        root.mkdir()
        done: dict[str, int | None] = {}
        in_flight = ""
        with recording(root, cut_at=cut_at, cut_after=cut_at % 2 == 0) as recorder:
            store = None
            try:
                store = MessageStore.open(root, CONFIG)
                for i in range(10):
                    store.create_topic(f"t{i}", 1 + i % 3)
                    done[f"t{i}"] = 1 + i % 3
                    if i % 3 == 2:
                        in_flight = f"t{i - 1}"  # deleted or not, if the cut comes in it
                        store.delete_topic(in_flight)
                        done[in_flight], in_flight = None, ""
                image = recorder.cut()
                finished = True
            except PowerCut:
                assert recorder.image is not None
                image, finished = recorder.image, False
            finally:
                if store is not None:
                    store._topics_file.close_fd()  # no fold of a dead machine's store
                    with contextlib.suppress(BaseException):  # the disk image is taken
                        store.close()
        after = tmp_path / f"a{cut_at}"
        materialize(image, after, damage)
        with MessageStore.open(after, CONFIG) as reopened:
            found = {t: len(reopened.queue_ids(t)) for t in reopened.topics()}
        wanted = {t: c for t, c in done.items() if c is not None and t != in_flight}
        assert {t: found.get(t) for t in wanted} == wanted, (cut_at, found)
        gone = [t for t, c in done.items() if c is None]
        assert not set(gone) & set(found), (cut_at, found)
        if finished:
            break
        cut_at += 1
    assert finished and cut_at > 10


def test_verify_and_inspect_read_the_journal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Topics only in the journal (a writer killed before a fold) are the store's topics
    for `equeue verify` (control: no problem); a torn tail and a hostile record are
    problems naming the journal and the offset."""
    store = MessageStore.open(tmp_path, CONFIG)
    store.create_topic("a", 2)
    store.send("a", b"x", queue_id=1)
    store._topics_file.close_fd()  # no fold at the close, as after a SIGKILL
    store.close()
    assert not (tmp_path / TOPICS_FILE).exists()
    capsys.readouterr()
    assert main(["verify", str(tmp_path)]) == 0, capsys.readouterr().out
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Topics (1, 2 queues)" in out
    assert "1 changes in topics.journal, not yet folded" in out, out
    journal = tmp_path / TOPICS_JOURNAL_FILE
    end = journal.stat().st_size
    with open(journal, "ab") as f:
        f.write(TopicRecord("b", 1).pack()[:20])
    assert main(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f"{journal}" in out and str(end) in out and "torn append" in out, out
    with open(journal, "r+b") as f:
        f.truncate(end)
        f.seek(end)
        f.write(TopicRecord("..", 1).pack())
    assert main(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert str(journal) in out and "'..'" in out, out


def test_a_reader_opens_queues_on_use_and_follows_new_topics(tmp_path: Path) -> None:
    """A read-only handle in another process, under RLIMIT_NOFILE=64, beside a writer of
    240 queues whose topics are all in the journal: its open opens no more queues than
    its cache keeps (9: before, all 240); it follows a topic created after it opened,
    then reads every queue (each opened on first use), within the descriptor bound."""
    config = low_config()
    with MessageStore.open(tmp_path, config) as store:
        for i in range(60):
            store.create_topic(f"t{i:02d}", 4)
            for q in range(4):
                store.send(f"t{i:02d}", body(f"t{i:02d}", q, 0), queue_id=q)
        store.flush()
        proc = subprocess.Popen(
            [sys.executable, str(HERE / "many_queues_child.py"), "follow", str(tmp_path), "64"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
        )  # fmt: skip
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "ready", proc.stderr
            store.create_topic("late", 4)
            for q in range(4):
                store.send("late", body("late", q, 0), queue_id=q)
            out, err = proc.communicate(timeout=120)
        finally:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == 0, err[-3000:]
    report = json.loads(out.strip().splitlines()[-1])
    limit = open_queue_limit(config)
    assert report["topics_at_open"] == 60 and report["topics"] == 61
    assert report["opened_at_open"] <= limit < 240, report
    # refresh() opened none; the wait for late/3's message opened that queue.
    assert report["opened_before_reads"] <= limit + 1, report
    assert report["wrong"] == []
    assert report["most_fds"] <= 64 and report["fds_at_open"] <= 64


def test_a_reader_reads_again_when_a_fold_replaced_topics_json_meanwhile(
    tmp_path: Path,
) -> None:
    """A reader reads topics.json, then the journal; a fold between the two (topics.json
    replaced, the journal emptied) would hide the records it folded: the reader sees
    topics.json replaced and reads both again."""
    with MessageStore.open(tmp_path, CONFIG) as writer:
        writer.create_topic("a", 1)
        writer._topics_file.write(*topicsfile.topics_state(writer))  # a fold: {a}
        reader = topicsfile.TopicsFile(tmp_path, writer=False)
        reads = 0

        def read_file() -> object:
            nonlocal reads
            reads += 1
            body = read_json(tmp_path / TOPICS_FILE)
            if reads == 1:  # between this read and the journal's: a record, then a fold
                writer.create_topic("b", 2)
                writer._topics_file.write(*topicsfile.topics_state(writer))
            return body

        body = reader.read(read_file)
        assert reads == 2
        assert isinstance(body, dict) and sorted(body) == ["a", "b"]
