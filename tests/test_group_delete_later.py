"""A group deletion finished later (review7): an intent left by a failed finish deletes
nothing written after it, even when the group is made again before the next open (F1);
an intent that deletes nothing makes ``delete_group`` of no group GroupNotFoundError
with what to do (F3), keeps an earlier ``.damaged`` file (F4) and is no group file copy
(F5)."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest

from equeue import MessageStore, StoreConfig
from equeue.errors import GroupNotFoundError, StoreWriteError
from equeue.server import retry
from equeue.store import groupdeletion
from equeue.store import offsets as group_offsets

RETRY = retry.retry_topic("g")
CONFIG = StoreConfig(flush="os")
REAL_DELETE_TOPIC = MessageStore.delete_topic


def _store(path: Path) -> Path:
    with MessageStore.open(path, CONFIG) as store:
        store.create_topic("t", 1)
        for i in range(4):
            store.send("t", b"m%d" % i)
        store.commit_offset("g", "t", 0, 2)
        store.create_topic(RETRY, 1)
        store.send(RETRY, b"old-copy")
    return path


def _delete_failing(store: MessageStore, monkeypatch: pytest.MonkeyPatch, times: int) -> Any:
    """delete_group("g") with the retry topic's deletion failing ``times`` times."""
    left = [times]

    def delete_topic(store: MessageStore, topic: str) -> None:
        if topic == RETRY and left[0]:
            left[0] -= 1
            raise StoreWriteError(errno.EIO, f"deleting {topic}: Input/output error (test)")
        REAL_DELETE_TOPIC(store, topic)

    monkeypatch.setattr(MessageStore, "delete_topic", delete_topic)
    try:
        return store.delete_group("g")
    finally:
        monkeypatch.setattr(MessageStore, "delete_topic", REAL_DELETE_TOPIC)


def _intents(path: Path) -> list[str]:
    return [e for e in os.listdir(path / "consumers" / "recovered") if e.endswith(".deleting")]


def test_a_finish_failing_once_is_tried_again_and_the_deletion_is_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _store(tmp_path / "s")
    with MessageStore.open(path, CONFIG) as store:
        deleted = _delete_failing(store, monkeypatch, 1)
        assert (deleted.offsets, deleted.topics, deleted.unfinished) == (1, (RETRY,), "")
        assert RETRY not in store.topics()
        assert _intents(path) == []


def test_an_intent_left_deletes_nothing_of_the_group_made_again_before_the_next_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _store(tmp_path / "s")
    with MessageStore.open(path, CONFIG) as store:
        deleted = _delete_failing(store, monkeypatch, 2)
        # the topic whose deletion failed is not reported deleted
        assert (deleted.offsets, deleted.topics) == (1, ())
        assert "Input/output error (test)" in deleted.unfinished
        assert RETRY in store.topics() and "g" not in store.consumer_groups()
        # g made again: a commit, a retry copy of the new g, a commit on it
        store.commit_offset("g", "t", 0, 3)
        store.send(RETRY, b"new-copy")
        store.commit_offset("g", RETRY, 0, 1)
    assert len(_intents(path)) == 1
    with MessageStore.open(path, CONFIG) as store:
        assert store.recovery.problems == []
        assert store.consumer_groups()["g"] == {"t": {0: 3}, RETRY: {0: 1}}
        assert [m.body for m in store.pull(RETRY, 0, 0, 10)] == [b"old-copy", b"new-copy"]
    assert _intents(path) == []


def test_an_intent_left_finishes_at_the_next_open_when_nothing_was_written_since(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _store(tmp_path / "s")
    with MessageStore.open(path, CONFIG) as store:
        assert _delete_failing(store, monkeypatch, 2).unfinished
    with MessageStore.open(path, CONFIG) as store:
        assert RETRY not in store.topics() and "g" not in store.consumer_groups()
    assert _intents(path) == []


# review7 F3, F4, F5: intent files that delete nothing.

STAMP = 1700000000000000000


def _garbage_intent(path: Path, group: str) -> Path:
    side = path / "consumers" / "recovered"
    side.mkdir(parents=True, exist_ok=True)
    intent = side / f"{group}.json.{STAMP}.deleting"
    intent.write_bytes(b"\x00garbage")
    return intent


def test_delete_group_of_no_group_beside_an_unmovable_intent_is_group_not_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _store(tmp_path / "s")
    real_rename = os.rename

    def rename_refused(src: object, dst: object, *args: object, **kwargs: object) -> None:
        if str(dst).endswith(".damaged"):
            raise PermissionError(errno.EACCES, "Permission denied")
        real_rename(src, dst, *args, **kwargs)  # type: ignore[arg-type]

    with MessageStore.open(path, CONFIG) as store:
        intent = _garbage_intent(path, "k")  # (after the open: delete_group finds it)
        monkeypatch.setattr(os, "rename", rename_refused)
        for _ in range(2):  # the same answer each time, and the file still there
            with pytest.raises(GroupNotFoundError, match="no consumer group 'k'") as failed:
                store.delete_group("k")
            assert f"remove {intent} yourself" in str(failed.value)
            assert intent.exists()
        monkeypatch.setattr(os, "rename", real_rename)
        assert store.consumer_groups() == {"g": {"t": {0: 2}}}
        intent.unlink()  # the remedy: then nothing of k is left
        with pytest.raises(GroupNotFoundError) as failed:
            store.delete_group("k")
        assert "intent" not in str(failed.value)


def test_delete_group_of_no_group_whose_intent_is_moved_aside_is_group_not_found(
    tmp_path: Path,
) -> None:
    path = _store(tmp_path / "s")
    with MessageStore.open(path, CONFIG) as store:
        intent = _garbage_intent(path, "k")  # (after the open: delete_group finds it)
        with pytest.raises(GroupNotFoundError, match=f"moved to {intent}.damaged"):
            store.delete_group("k")
        assert store.consumer_groups() == {"g": {"t": {0: 2}}}


def test_an_intent_moved_aside_keeps_an_earlier_damaged_file_of_the_same_name(
    tmp_path: Path,
) -> None:
    path = _store(tmp_path / "s")
    intent = _garbage_intent(path, "x")
    earlier = intent.with_name(intent.name + ".damaged")
    earlier.write_bytes(b"EVIDENCE of the first damaged intent")
    with MessageStore.open(path, CONFIG) as store:
        (problem,) = store.recovery.problems
        assert f"moved to {intent}.1.damaged" in str(problem)
    assert earlier.read_bytes() == b"EVIDENCE of the first damaged intent"
    assert intent.with_name(intent.name + ".1.damaged").read_bytes() == b"\x00garbage"
    assert not intent.exists()


def test_delete_group_leaves_an_intent_moved_aside_where_the_problem_named_it(
    tmp_path: Path,
) -> None:
    path = _store(tmp_path / "s")
    intent = _garbage_intent(path, "g")
    side = intent.parent
    copy = side / f"g.json.{STAMP}.damaged"  # a damaged group file set aside: g's
    copy.write_bytes(b"{damaged")
    with MessageStore.open(path, CONFIG) as store:
        (problem,) = store.recovery.problems
        moved = f"{intent}.damaged"
        assert f"moved to {moved}" in str(problem)
        store.delete_group("g")
    assert sorted(os.listdir(side)) == sorted(
        [Path(moved).name, f"{copy.name}{groupdeletion.SET_ASIDE_DELETED}"]
    )


@pytest.mark.parametrize(
    ("entry", "copy"),
    [
        ("g.json.17.damaged", ("g.json", 17)),
        ("g.json.17.2.damaged", ("g.json", 17)),
        ("g.json.17.deleting.damaged", None),
        ("g.json.17.deleting.1.damaged", None),
        ("g.json.17.damaged.group-deleted", None),
        ("g.json.x.damaged", None),
        ("g.json.17.deleting", None),
    ],
)
def test_one_definition_of_a_set_aside_group_file(entry: str, copy: tuple[str, int] | None) -> None:
    assert group_offsets.set_aside_copy(entry) == copy
