"""A group commit can be made durable before the messages it passes (a consumer reads
what is appended; the log's fdatasync comes later), so a power cut can leave a committed
offset past the end the log recovers to. The writable open lowers it to the end and
reports it; before, the group waited at the old offset and skipped the messages sent
after the restart up to it (review19 R19-1). The cut is the disk image it leaves: the
log as of before the last sends, the group files and offsets.json as of after the
commits (what ``fsync``'d files beside an unsynced log hold after a power loss)."""

from __future__ import annotations

import shutil
from pathlib import Path

from store_helpers import queue_file, snapshot

from equeue import MessageStore, StoreConfig
from equeue.format.message import QUEUE_RECORD_SIZE
from equeue.inspect.verify import verify_store
from equeue.store import offsets as group_offsets
from equeue.store.meta import CONSUMERS_DIR, OFFSETS_FILE

CONFIG = StoreConfig(flush="os", default_queue_count=2)


def _cut_after_commits(root: Path) -> Path:
    """Queue t/0 durable up to offset 3, t/1 up to 2; group g (a consumer: its group file)
    read t/0 to 5 and t/1 to 2, group h (commit_offset: offsets.json) t/0 to 4."""
    before, after = root / "before", root / "after"
    with MessageStore.open(before, CONFIG) as store:
        store.create_topic("t")
        for i in range(3):
            store.send("t", b"durable %d" % i, queue_id=0)
        for i in range(2):
            store.send("t", b"durable %d" % i, queue_id=1)
    shutil.copytree(before, after)
    with MessageStore.open(after, CONFIG) as store:
        for i in range(2):
            store.send("t", b"lost %d" % i, queue_id=0)
        consumer = store.consumer("g", "t", timeout=0.1)
        assert len(list(consumer)) == 7
        store.commit_offset("h", "t", 0, 4)
    for name in (CONSUMERS_DIR,):
        shutil.rmtree(before / name, ignore_errors=True)
        shutil.copytree(after / name, before / name)
    shutil.copy(after / OFFSETS_FILE, before / OFFSETS_FILE)
    return before


def test_an_offset_past_the_recovered_end_is_lowered_and_reported(tmp_path: Path) -> None:
    path = _cut_after_commits(tmp_path)
    with MessageStore.open(path, CONFIG) as store:
        problems = [p for p in store.recovery.problems if "past the queue's end" in p]
        assert len(problems) == 2, store.recovery.problems
        assert (
            "consumer group 'g' had committed offset 5 on t/0, past the queue's end 3"
            in (problems[0])
        )
        assert problems[1].startswith("consumer group 'h' had committed offset 4 on t/0")
        assert all("lowered to 3" in p for p in problems)
        assert store.committed_offset("g", "t", 0) == 3
        assert store.committed_offset("g", "t", 1) == 2  # at its end: left as it was
        assert store.committed_offset("h", "t", 0) == 3
        sent = [store.send("t", b"after the restart %d" % i, queue_id=0) for i in range(3)]
        assert [s.queue_offset for s in sent] == [3, 4, 5]
        consumer = store.consumer("g", "t", timeout=0.1)
        assert [m.body for m in consumer] == [b"after the restart %d" % i for i in range(3)]
    with MessageStore.open(path, CONFIG) as store:  # lowered once: nothing left to say
        assert store.recovery.clean, store.recovery
        assert store.committed_offset("g", "t", 0) == 6


def test_verify_reports_the_offsets_the_next_open_lowers(tmp_path: Path) -> None:
    path = _cut_after_commits(tmp_path)
    found = verify_store(path)
    assert [(p.kind, Path(p.file).name) for p in found] == [
        ("committed offset", "g.json"),
        ("committed offset", "offsets.json"),
    ]
    assert "consumer group 'g' committed offset 5 on t/0, past the queue's end 3" in (
        found[0].reason
    )
    with MessageStore.open(path, CONFIG):
        pass
    assert verify_store(path) == []


def test_verify_names_the_file_that_holds_the_offset_past_the_end(tmp_path: Path) -> None:
    """review20 R20-7: h's offset past the end is offsets.json's; its group file, made
    here with a lower one, is not the file to look at."""
    path = _cut_after_commits(tmp_path)
    group_offsets.commit_group_file(path, "h", {("t", 0): 1})
    found = [p for p in verify_store(path) if "'h'" in p.reason]
    assert [Path(p.file).name for p in found] == ["offsets.json"], found


def test_verify_takes_the_logs_messages_as_the_queues_end(tmp_path: Path) -> None:
    """review20 R20-3: a queue whose files lag the log (its last entry zeroed, as a crash
    before the queue's write leaves it) ends, for recovery, past the log's last message
    of it: a commit at that end is no problem."""
    path = tmp_path / "s"
    with MessageStore.open(path, CONFIG) as store:
        store.create_topic("t")
        for i in range(3):
            store.send("t", b"m %d" % i, queue_id=0)
        store.commit_offset("g", "t", 0, 3)
    chunk, at = queue_file(path, CONFIG.layout.queue_chunk_records, "t", 0, 2)
    with open(chunk, "r+b") as f:
        f.seek(at)
        f.write(bytes(QUEUE_RECORD_SIZE))
    assert [p for p in verify_store(path) if p.kind == "committed offset"] == []


def test_a_read_only_handle_leaves_the_offset_to_the_writer(tmp_path: Path) -> None:
    path = _cut_after_commits(tmp_path)
    before = snapshot(path)
    with MessageStore.open(path, read_only=True) as reader:
        assert reader.committed_offset("g", "t", 0) == 5
    assert snapshot(path) == before


def test_offsets_at_or_below_the_end_are_left_alone(tmp_path: Path) -> None:
    """The control: a store whose log holds everything its groups committed."""
    path = tmp_path / "s"
    with MessageStore.open(path, CONFIG) as store:
        store.create_topic("t")
        for i in range(4):
            store.send("t", b"m %d" % i, queue_id=i % 2)
        assert len(list(store.consumer("g", "t", timeout=0.1))) == 4
        store.commit_offset("h", "t", 0, 2)
    assert verify_store(path) == []
    before = snapshot(path)
    with MessageStore.open(path, CONFIG) as store:
        assert store.recovery.clean, store.recovery
        assert store.committed_offset("g", "t", 0) == 2
        assert store.committed_offset("h", "t", 0) == 2
    assert snapshot(path) == before
