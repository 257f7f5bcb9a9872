"""``MessageStore.delete_group`` (equeue/store/groupdeletion.py): a group's offsets in
both files, its retry topic and (asked) its dead letters removed; a SIGKILL after any
file-system call of a deletion leaves the whole group or none of it
(tests/group_delete_child.py); retention no longer counts a deleted group; a read-only
handle sees the group vanish; hostile names and a linked group file; a group made again
gets none of the old group's delayed retries."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from fork_child import ForkServer
from test_group_files_lost import run as cli
from test_retention_damaged_group import open_store

from equeue import MessageStore, StoreConfig
from equeue.errors import (
    GroupNotFoundError,
    InvalidMessageError,
    InvalidTypeError,
    ReadOnlyError,
    StorePathError,
)
from equeue.server import retry
from equeue.server.groups import GroupCoordinator
from equeue.store.offsets import file_name
from equeue.store.retentionhold import retention_hold

RETRY, DLQ = retry.retry_topic("g"), retry.dead_letter_topic("g")
CONFIG = StoreConfig(flush="os")


def _fill(path: Path) -> None:
    """Group g: offsets.json's entry (commit_offset), its group file (a read-only
    handle's consumer), its retry and dead-letter topics, a damaged copy of its file set
    aside; group h beside it."""
    with MessageStore.open(path, CONFIG) as store:
        store.create_topic("t", 2)
        for i in range(10):
            store.send("t", b"m%d" % i, queue_id=i % 2)
        store.commit_offset("g", "t", 0, 4)
        store.commit_offset("h", "t", 1, 2)
        store.create_topic(RETRY, 1)
        store.send(RETRY, b"retry copy")
        store.create_topic(DLQ, 1)
        store.send(DLQ, b"dead letter")
        store.create_topic(retry.DELAY_TOPIC, 3)
    with (
        MessageStore.open(path, read_only=True) as reader,
        reader.consumer("g", "t", timeout=0) as consumer,
    ):
        assert len([m for m, _ in zip(consumer, range(3), strict=False)]) == 3
    with MessageStore.open(path, CONFIG) as store:  # offsets.json above the file on t/1
        store.commit_offset("g", "t", 1, 4)
    side = path / "consumers" / "recovered"
    side.mkdir(exist_ok=True)
    (side / f"{file_name('g')}.1700000000000000000.damaged").write_bytes(b"{not json")


# commit_offset 4 on t/0, the consumer's file t/0 5 and t/1 3, commit_offset 4 on t/1:
# each file holds one of the offsets read
WHOLE = {"t": {0: 5, 1: 4}}


def _whole_or_gone(store: MessageStore) -> bool:
    """True if group g is gone (with its retry topic, its damaged copy set aside no
    longer holding retention), False if it is whole; anything between fails."""
    assert not store.recovery.problems, store.recovery.problems
    groups = store.consumer_groups()
    assert groups["h"] == {"t": {1: 2}}
    assert [m.body for m in store.pull(DLQ, 0, 0, 10).messages] == [b"dead letter"]
    side = sorted(os.listdir(store.path / "consumers" / "recovered"))
    assert not [e for e in side if e.endswith(".deleting")], side  # finished by the open
    if "g" in groups:
        assert groups["g"] == WHOLE
        assert [m.body for m in store.pull(RETRY, 0, 0, 10).messages] == [b"retry copy"]
        assert side == [f"{file_name('g')}.1700000000000000000.damaged"]
        return False
    assert RETRY not in store.topics() and RETRY in store.deleted_topics()
    assert store.committed_offset("g", "t", 0) is None
    assert side == [f"{file_name('g')}.1700000000000000000.damaged.group-deleted"]
    assert store._group_files.set_aside() == []
    return True


def test_delete_group_removes_its_offsets_and_retry_topic_and_keeps_dead_letters(
    tmp_path: Path,
) -> None:
    path = tmp_path / "s"
    _fill(path)
    with MessageStore.open(path, CONFIG) as store:
        assert store.consumer_groups()["g"] == WHOLE
        before = sorted(os.listdir(path / "consumers"))
        for bad, error in [
            ("nobody", GroupNotFoundError),
            ("equeue.mover", InvalidMessageError),
            ("", InvalidMessageError),
            (7, InvalidMessageError),
        ]:
            with pytest.raises(error):
                store.delete_group(bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidTypeError):
            store.delete_group("g", delete_dead_letters=1)  # type: ignore[arg-type]
        assert sorted(os.listdir(path / "consumers")) == before  # refusals changed nothing
        deleted = store.delete_group("g")
        assert (deleted.group, deleted.offsets, deleted.topics) == ("g", 2, (RETRY,))
        assert _whole_or_gone(store)
        with pytest.raises(GroupNotFoundError):
            store.delete_group("g")
        # made again: no commits, nothing of the old retry topic
        assert store.committed_offset("g", "t", 1) is None
        store.commit_offset("g", "t", 1, 1)
        assert store.consumer_groups()["g"] == {"t": {1: 1}}
    with MessageStore.open(path, CONFIG) as store:  # no loss reported, nothing left over
        assert store.recovery.clean, store.recovery
        assert store.consumer_groups()["g"] == {"t": {1: 1}}
        deleted = store.delete_group("g", delete_dead_letters=True)
        assert deleted.topics == (DLQ,)
        assert DLQ not in store.topics() and "g" not in store.consumer_groups()
    with MessageStore.open(path, read_only=True) as reader, pytest.raises(ReadOnlyError):
        reader.delete_group("h")


def _run(forks: ForkServer, path: Path, mode: str, k: int) -> subprocess.CompletedProcess[str]:
    return forks.run("group_delete_child", [str(path), mode, str(k)], timeout=60)


def test_a_sigkill_after_any_call_of_a_deletion_leaves_the_group_whole_or_gone(
    tmp_path: Path, forks: ForkServer
) -> None:
    """Each file-system call of the deletion, in turn, is the last the child makes; the
    next open finishes a deletion past its commit point (the rename of the group file
    into recovered/ as the intent), and the one after sees the same."""
    template = tmp_path / "template"
    _fill(template)
    counted = tmp_path / "counted"
    subprocess.run(["cp", "-a", str(template), str(counted)], check=True)
    full = _run(forks, counted, "never", 0)
    assert full.returncode == 0 and "DONE" in full.stdout, full.stderr
    calls = [line for line in full.stdout.splitlines() if line.startswith("CALL ")]
    assert len(calls) >= 10, calls
    outcomes = []
    for k in range(1, len(calls) + 1):
        path = tmp_path / f"k{k}"
        subprocess.run(["cp", "-a", str(template), str(path)], check=True)
        run = _run(forks, path, "after", k)
        assert run.returncode == -9, (k, run.returncode, run.stderr)
        # verify before any open: no group file is reported lost, whatever the kill
        # point (the checkpoint's record drops the group before its file goes: R17-9)
        _, said = cli("verify", str(path))
        assert "consumers" not in said or "is missing" not in said, (k, said)
        with MessageStore.open(path, CONFIG) as store:
            gone = _whole_or_gone(store)
        with MessageStore.open(path, CONFIG) as store:
            assert _whole_or_gone(store) is gone
        outcomes.append(gone)
    # Whole up to the commit point, gone from it on: one switch, at the rename.
    switch = outcomes.index(True)
    assert outcomes == [False] * switch + [True] * (len(outcomes) - switch), outcomes
    assert "rename" in calls[switch] and ".deleting" in calls[switch], calls[switch]


def test_a_made_up_groups_pin_on_retention_ends_with_its_deletion(tmp_path: Path) -> None:
    """reviewg F17: one commit_offset for a group nobody consumes holds every chunk under
    retention_respects_consumers; deleting the group releases them."""
    with open_store(tmp_path / "s") as store:  # 4 KiB chunks, 1 s, respecting consumers
        store.create_topic("t", 1)
        for _ in range(40):
            store.send("t", b"f" * 900)
        store.commit_offset("nobody-consumes", "t", 0, 0)
        later = time.time() + 60
        assert store.apply_retention(now=later) == 0
        hold = retention_hold(store)
        assert hold is not None and hold.reader.group == "nobody-consumes"
        store.delete_group("nobody-consumes")
        assert store.apply_retention(now=later) > 0
        assert retention_hold(store) is None
        assert store.queue_range("t", 0)[0] > 0


def test_a_read_only_handle_sees_the_group_vanish_and_its_consumer_makes_it_again(
    tmp_path: Path,
) -> None:
    path = tmp_path / "s"
    _fill(path)
    with (
        MessageStore.open(path, CONFIG) as writer,
        MessageStore.open(path, read_only=True) as reader,
    ):
        consumer = reader.consumer("g", "t", timeout=0, batch_size=1)
        first = consumer.poll(1)
        assert [m.queue_offset for m in first] in ([5], [4])
        assert reader.committed_offset("g", "t", 0) == 5
        writer.delete_group("g")
        # The reader's view follows the files: no offsets, no builtin exception.
        assert reader.committed_offset("g", "t", 0) is None
        assert "g" not in reader.consumer_groups()
        reader.refresh()
        assert RETRY not in reader.topics()
        # Its running consumer commits where it got to: the group exists again from there.
        writer.send("t", b"after", queue_id=0)
        more = consumer.poll(1)
        consumer.commit()
        consumer.close()
        assert more
        handed: dict[int, int] = {}
        for message in first + more:
            handed[message.queue_id] = message.queue_offset + 1
        # only the queues it handed messages from, at its own position (the deleted
        # group's other offsets do not come back)
        assert writer.consumer_groups()["g"] == {"t": handed}


@pytest.mark.parametrize("group", ["../x", "a/b", "..", ".", "%2F", "x" * 255, "é/../"])
def test_a_hostile_group_name_deletes_its_own_file_only(tmp_path: Path, group: str) -> None:
    with MessageStore.open(tmp_path / "s", CONFIG) as store:
        store.create_topic("t", 1)
        store.send("t", b"x")
        store.commit_offset(group, "t", 0, 1)
        with store.consumer(group, "t", timeout=0) as consumer:
            list(consumer)
        store.commit_offset("other", "t", 0, 1)
        outside = sorted(os.listdir(tmp_path))
        deleted = store.delete_group(group)
        assert deleted.offsets == 1 and deleted.topics == ()
        assert store.consumer_groups() == {"other": {"t": {0: 1}}}
        assert sorted(os.listdir(tmp_path)) == outside
        assert os.listdir(store.path / "consumers") == ["recovered"]


def test_a_linked_group_file_is_set_aside_never_followed(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.json"
    target.write_bytes(b"not the store's")
    with MessageStore.open(tmp_path / "s", CONFIG) as store:
        store.create_topic("t", 1)
        store.send("t", b"x")
        store.commit_offset("g", "t", 0, 1)
        (store.path / "consumers").mkdir(exist_ok=True)
        os.symlink(target, store.path / "consumers" / file_name("g"))
        deleted = store.delete_group("g")
        assert deleted.offsets == 1
        assert target.read_bytes() == b"not the store's"
        side = os.listdir(store.path / "consumers" / "recovered")
        assert len(side) == 1 and side[0].endswith(".damaged.group-deleted"), side
        assert os.path.islink(store.path / "consumers" / "recovered" / side[0])
        assert "g" not in store.consumer_groups()
        assert store._group_files.set_aside() == []  # retention is not held by it


def test_a_side_directory_that_is_a_file_refuses_the_deletion_and_changes_nothing(
    tmp_path: Path,
) -> None:
    """review6 R6-6: consumers/recovered made a file under an open handle: a builtin
    NotADirectoryError came after offsets.json had dropped the group."""
    with MessageStore.open(tmp_path / "s", CONFIG) as store:
        store.create_topic("t", 1)
        store.send("t", b"x")
        store.commit_offset("g", "t", 0, 1)
        store.commit_offset("k", "t", 0, 1)
        offsets = (store.path / "offsets.json").read_bytes()
        (store.path / "consumers").mkdir(exist_ok=True)
        (store.path / "consumers" / "recovered").write_bytes(b"a file")
        with pytest.raises(StorePathError, match="recovered is not a directory"):
            store.delete_group("g")
        assert (store.path / "offsets.json").read_bytes() == offsets
        assert not (store.path / "consumers" / file_name("g")).exists()
        assert store.committed_offset("g", "t", 0) == 1
        (store.path / "consumers" / "recovered").unlink()
        assert store.delete_group("g").offsets == 1  # control: with the directory back
        assert store.committed_offset("g", "t", 0) is None
        assert store.committed_offset("k", "t", 0) == 1


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def test_a_group_made_again_gets_none_of_the_deleted_groups_delayed_retries(
    tmp_path: Path,
) -> None:
    clock = Clock()
    with MessageStore.open(tmp_path / "s", CONFIG) as store:
        store.create_topic("t", 1)
        coord = GroupCoordinator(store, clock=clock, wall_clock=clock, retry_delays=(1.0, 5.0))
        coord.join("g", "a", ["t"], 600_000)
        old = store.send("t", b"old")
        coord.nack("g", "a", old.message_id, 5_000)  # waits 5 s in equeue.delay
        coord.leave("g", "a")
        store.delete_group("g")
        coord.forget_group("g")
        coord.join("g", "b", ["t"], 600_000)  # the group made again
        new = store.send("t", b"new")
        coord.nack("g", "b", new.message_id, 5_000)
        clock.now += 6
        coord.tick()
        moved = [m.body for m in store.pull(RETRY, 0, 0, 10).messages]
        assert moved == [b"new"]
        assert coord.retries.dropped_deleted == 1
        assert coord.retries.pending() == 0


def test_due_copies_of_a_group_being_deleted_wait_for_the_deletion(tmp_path: Path) -> None:
    """A copy due while the broker deletes its group (on the committer thread) is not
    moved then: the move would make the retry topic again under the deletion, holding
    retention and handing the old copy to the group made again. It waits, and is
    dropped once the deletion ended."""
    clock = Clock()
    with MessageStore.open(tmp_path / "s", CONFIG) as store:
        store.create_topic("t", 1)
        coord = GroupCoordinator(store, clock=clock, wall_clock=clock, retry_delays=(1.0,))
        coord.join("g", "a", ["t"], 600_000)
        coord.nack("g", "a", store.send("t", b"old").message_id, 1_000)
        coord.leave("g", "a")
        coord.deleting.add("g")  # as GroupDeleter.delete does, before the store's deletion
        clock.now += 2
        coord.tick()
        assert store.queue_range(RETRY, 0) == (0, 0)  # not moved
        assert coord.retries.pending() == 1
        store.delete_group("g")
        coord.deleting.discard("g")
        coord.tick()
        assert RETRY not in store.topics()
        assert (coord.retries.dropped_deleted, coord.retries.pending()) == (1, 0)


def test_a_group_left_only_as_a_damaged_copy_is_deleted_and_releases_retention(
    tmp_path: Path,
) -> None:
    with open_store(tmp_path / "s") as store:
        store.create_topic("t", 1)
        for _ in range(40):
            store.send("t", b"f" * 900)
        side = store.path / "consumers" / "recovered"
        side.mkdir(parents=True)
        (side / f"{file_name('g')}.1700000000000000000.damaged").write_bytes(b"{not json")
        later = time.time() + 60
        assert store.apply_retention(now=later) == 0  # held by the copy (review3 R5)
        assert store.delete_group("g").offsets == 0
        assert store.apply_retention(now=later) > 0
        assert os.listdir(side) == [f"{file_name('g')}.1700000000000000000.damaged.group-deleted"]
