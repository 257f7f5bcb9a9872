"""A group deletion finished later (review7): an intent left by a failed finish deletes
nothing written after it, even when the group is made again before the next open (F1).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from equeue import MessageStore, StoreConfig
from equeue.errors import StoreWriteError
from equeue.server import retry

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


def _failing_retry_deletion(times: int) -> object:
    left = [times]

    def delete_topic(store: MessageStore, topic: str) -> None:
        if topic == RETRY and left[0]:
            left[0] -= 1
            raise StoreWriteError(errno.EIO, f"deleting {topic}: Input/output error (test)")
        REAL_DELETE_TOPIC(store, topic)

    return delete_topic


def _intents(path: Path) -> list[str]:
    return [e for e in os.listdir(path / "consumers" / "recovered") if e.endswith(".deleting")]


def test_a_finish_failing_once_is_tried_again_and_the_deletion_is_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _store(tmp_path / "s")
    with MessageStore.open(path, CONFIG) as store:
        monkeypatch.setattr(MessageStore, "delete_topic", _failing_retry_deletion(1))
        deleted = store.delete_group("g")
        assert (deleted.offsets, deleted.topics, deleted.unfinished) == (1, (RETRY,), "")
        assert RETRY not in store.topics()
        assert _intents(path) == []


def test_an_intent_left_deletes_nothing_of_the_group_made_again_before_the_next_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _store(tmp_path / "s")
    with MessageStore.open(path, CONFIG) as store:
        monkeypatch.setattr(MessageStore, "delete_topic", _failing_retry_deletion(2))
        deleted = store.delete_group("g")
        monkeypatch.setattr(MessageStore, "delete_topic", REAL_DELETE_TOPIC)
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
        monkeypatch.setattr(MessageStore, "delete_topic", _failing_retry_deletion(2))
        assert store.delete_group("g").unfinished
        monkeypatch.setattr(MessageStore, "delete_topic", REAL_DELETE_TOPIC)
    with MessageStore.open(path, CONFIG) as store:
        assert RETRY not in store.topics() and "g" not in store.consumer_groups()
    assert _intents(path) == []
