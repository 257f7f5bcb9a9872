"""``delete_group`` when the file system fails (reviewl M1) and a deletion's intent file
that cannot be acted on (reviewl L1, L2): an I/O error at the commit point is an equeue
error naming the file, with the store's files put back; one after it leaves the group
deleted, says what is unfinished, and the next open or ``delete_group`` finishes it; an
intent naming another group, an ``equeue.*`` group, or no group is moved aside, acts on
nothing, and is reported with its remedy, once, and by ``verify`` before that."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

import pytest

import equeue
from equeue import MessageStore, StoreConfig
from equeue.atomicfile import write_json
from equeue.errors import DiskFullError, GroupNotFoundError
from equeue.inspect.verify import verify_store
from equeue.server import BrokerThread, retry

RETRY = retry.retry_topic("g")
CONFIG = StoreConfig(flush="os")
REAL_RENAME, REAL_UNLINK = os.rename, os.unlink


def _store(path: Path) -> Path:
    """Group g in both files (offsets.json above its group file on t/0), its retry topic;
    group h beside it with a retry topic of its own."""
    with MessageStore.open(path, CONFIG) as store:
        store.create_topic("t", 2)
        for i in range(6):
            store.send("t", b"m%d" % i, queue_id=i % 2)
        store.commit_offset("h", "t", 0, 1)
        for group in ("g", "h"):
            store.create_topic(retry.retry_topic(group), 1)
            store.send(retry.retry_topic(group), b"copy")
    with (
        MessageStore.open(path, read_only=True) as reader,
        reader.consumer("g", "t", timeout=0) as consumer,
    ):
        assert len([m for m, _ in zip(consumer, range(2), strict=False)]) == 2
    with MessageStore.open(path, CONFIG) as store:
        store.commit_offset("g", "t", 0, 3)
    return path


def _files(path: Path) -> dict[str, Any]:
    consumers = path / "consumers"
    return {
        "offsets.json": json.loads((path / "offsets.json").read_text()),
        "consumers": {
            name: json.loads((consumers / name).read_text())
            for name in sorted(os.listdir(consumers))
            if name.endswith(".json")
        },
        "recovered": sorted(os.listdir(consumers / "recovered"))
        if (consumers / "recovered").exists()
        else [],
    }


def _rename_full(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
    if str(dst).endswith(".deleting"):
        raise OSError(errno.ENOSPC, "No space left on device")
    REAL_RENAME(src, dst, *args, **kwargs)


def _unlink_eio(path: Any, *args: Any, **kwargs: Any) -> None:
    if str(path).endswith(".deleting"):
        raise OSError(errno.EIO, "Input/output error", str(path))
    REAL_UNLINK(path, *args, **kwargs)


def test_a_failed_commit_point_is_an_equeue_error_naming_the_file_and_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _store(tmp_path / "s")
    with MessageStore.open(path, CONFIG) as store:
        groups, before = store.consumer_groups(), _files(path)
        monkeypatch.setattr(os, "rename", _rename_full)
        with pytest.raises(DiskFullError) as failed:
            store.delete_group("g")
        monkeypatch.setattr(os, "rename", REAL_RENAME)
        message = str(failed.value)
        assert str(path / "consumers" / "g.json") in message
        assert "commit point" in message and "the group was not deleted" in message
        assert "its files are as they were" in message
        assert store.consumer_groups() == groups
        assert _files(path) == before
        assert RETRY in store.topics()
    with MessageStore.open(path, CONFIG) as store:
        assert store.recovery.problems == []
        assert store.consumer_groups() == groups
        assert store.delete_group("g").offsets == 2


def test_a_failed_write_of_offsets_json_puts_the_group_file_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Step 2 failing: step 1's group file (with the intent) is written back as it was."""
    path = _store(tmp_path / "s")
    real_replace = os.replace

    def replace_full(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        if str(dst).endswith("offsets.json"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_replace(src, dst, *args, **kwargs)

    with MessageStore.open(path, CONFIG) as store:
        groups, before = store.consumer_groups(), _files(path)
        monkeypatch.setattr(os, "replace", replace_full)
        with pytest.raises(DiskFullError) as failed:
            store.delete_group("g")
        monkeypatch.setattr(os, "replace", real_replace)
        assert str(path / "offsets.json") in str(failed.value)
        assert "the group was not deleted, its files are as they were" in str(failed.value)
        assert _files(path) == before
        assert store.consumer_groups() == groups


def test_a_failure_after_the_commit_point_reports_the_deletion_done_and_is_finished_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _store(tmp_path / "s")
    side = path / "consumers" / "recovered"
    with MessageStore.open(path, CONFIG) as store:
        monkeypatch.setattr(os, "unlink", _unlink_eio)
        deleted = store.delete_group("g")
        monkeypatch.setattr(os, "unlink", REAL_UNLINK)
        (intent,) = [e for e in os.listdir(side) if e.endswith(".deleting")]
        assert (deleted.group, deleted.offsets, deleted.topics) == ("g", 2, (RETRY,))
        assert str(side / intent) in deleted.unfinished
        assert "Input/output error" in deleted.unfinished
        assert "delete_group" in deleted.unfinished
        assert "g" not in store.consumer_groups() and RETRY not in store.topics()
        # delete_group again finishes it (the remedy the note names)
        again = store.delete_group("g")
        assert (again.offsets, again.topics, again.unfinished) == (0, (), "")
        assert not [e for e in os.listdir(side) if e.endswith(".deleting")]
        with pytest.raises(GroupNotFoundError):
            store.delete_group("g")
        assert "h" in store.consumer_groups()


def test_the_next_open_finishes_a_deletion_whose_intent_could_not_be_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _store(tmp_path / "s")
    with MessageStore.open(path, CONFIG) as store:
        monkeypatch.setattr(os, "unlink", _unlink_eio)
        assert store.delete_group("g").unfinished
        monkeypatch.setattr(os, "unlink", REAL_UNLINK)
    with MessageStore.open(path, CONFIG) as store:
        assert store.recovery.problems == []
        assert "g" not in store.consumer_groups()
    assert not [e for e in os.listdir(path / "consumers" / "recovered") if "deleting" in e]


def test_the_broker_answers_a_deletion_whose_finish_failed_as_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _store(tmp_path / "s")
    with BrokerThread(path) as running, equeue.connect(running.urls[0]) as client:
        monkeypatch.setattr(os, "unlink", _unlink_eio)
        deleted = client.delete_group("g")
        monkeypatch.setattr(os, "unlink", REAL_UNLINK)
        assert (deleted.group, deleted.offsets, deleted.topics) == ("g", 2, (RETRY,))
        assert client.committed_offset("g", "t", 0) is None
        assert RETRY not in client.topics()


def _hostile(path: Path, case: str) -> Path:
    side = path / "consumers" / "recovered"
    side.mkdir(parents=True, exist_ok=True)
    entry = side / "g.json.1700000000000000000.deleting"
    if case == "garbage":
        entry.write_bytes(b"\x00garbage")
    elif case == "directory":
        entry.mkdir()
    elif case == "fifo":
        os.mkfifo(entry)
    elif case == "link":
        os.symlink(path / "offsets.json", entry)
    else:
        write_json(entry, {"group": case, "offsets": {}, "deleting": {"dead_letters": True}})
    return entry


@pytest.mark.parametrize("case", ["h", "equeue.mover", "garbage", "directory", "fifo", "link"])
def test_an_intent_that_cannot_be_acted_on_deletes_nothing_and_is_reported_once(
    tmp_path: Path, case: str
) -> None:
    path = _store(tmp_path / "s")
    with MessageStore.open(path, CONFIG) as store:
        groups, topics = store.consumer_groups(), sorted(store.topics())
        if case == "equeue.mover":
            store.create_topic("equeue.retry.equeue.mover", 1)
            topics = sorted(store.topics())
    entry = _hostile(path, case)
    (found,) = verify_store(path)  # reported before any open acts on it
    assert (found.file, found.kind) == (str(entry), "group deletion intent")
    assert "delete_group('g') again" in found.reason
    with MessageStore.open(path, CONFIG) as store:
        (problem,) = store.recovery.problems
        assert str(entry) in problem and f"moved to {entry}.damaged" in problem
        assert "delete_group('g') again" in problem
        assert store.consumer_groups() == groups
        assert sorted(store.topics()) == topics
    assert os.path.lexists(f"{entry}.damaged") and not os.path.lexists(entry)
    assert (path / "offsets.json").is_file()  # a link's target is left alone
    with MessageStore.open(path, CONFIG) as store:
        assert store.recovery.problems == []
    assert verify_store(path) == []
