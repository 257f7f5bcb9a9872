"""Group names starting ``equeue.`` are the broker's. The store used to take them from
an application (``commit_offset``, ``consumer``) while every way to delete or release
such a group refused them, so under ``retention_respects_consumers`` one commit held the
log for good (review19 R19-2). Now the store refuses them there, and ``delete_group``
deletes any but the retry mover's own, which a store made before keeps."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from store_helpers import snapshot
from test_retention_damaged_group import open_store

from equeue import MessageStore
from equeue.errors import InvalidMessageError
from equeue.protocol.retries import MOVER_GROUP
from equeue.store import offsets as group_offsets
from equeue.store.retentionhold import retention_hold


def test_the_store_refuses_broker_group_names_and_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with MessageStore.open(path) as store:
        store.create_topic("t", 1)
        store.send("t", b"m")
    before = snapshot(path)
    with MessageStore.open(path) as store:
        for group in ("equeue.audit", MOVER_GROUP):
            with pytest.raises(InvalidMessageError, match="are the broker's own"):
                store.commit_offset(group, "t", 0, 1)
            with pytest.raises(InvalidMessageError, match="choose another name"):
                store.consumer(group, "t")
    with (
        MessageStore.open(path, read_only=True) as reader,
        pytest.raises(InvalidMessageError, match="are the broker's own"),
    ):
        reader.consumer("equeue.audit", "t")
    assert snapshot(path) == before
    with MessageStore.open(path) as store:  # the prefix is "equeue.", the dot included
        store.commit_offset("equeue-audit", "t", 0, 1)
        assert store.committed_offset("equeue-audit", "t", 0) == 1


def test_an_equeue_group_an_older_store_took_can_be_deleted_and_releases_retention(
    tmp_path: Path,
) -> None:
    with open_store(tmp_path / "s") as store:  # 4 KiB chunks, 1 s, respecting consumers
        store.create_topic("t", 1)
        for _ in range(40):
            store.send("t", b"f" * 900)
        # What commit_offset wrote before the refusal: the group file of equeue.audit.
        group_offsets.commit_group(store, "equeue.audit", {("t", 0): 1})
        later = time.time() + 60
        assert store.apply_retention(now=later) == 0
        hold = retention_hold(store)
        assert hold is not None and hold.reader.group == "equeue.audit"
        with pytest.raises(InvalidMessageError, match="the retry mover's cursors"):
            store.delete_group(MOVER_GROUP)
        deleted = store.delete_group("equeue.audit")
        assert (deleted.group, deleted.offsets) == ("equeue.audit", 1)
        assert "equeue.audit" not in store.consumer_groups()
        assert store.apply_retention(now=later) > 0
        assert store.queue_range("t", 0)[0] > 0
