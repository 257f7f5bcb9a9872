"""The broker's retry topics take no retention and no compaction (review f F7): their
retries are read from cursors, so a removed one was pending for ever, uncounted."""

from __future__ import annotations

import datetime as dt
import time
from pathlib import Path

import pytest

from equeue import MessageStore
from equeue.compaction.job import chunk_scan
from equeue.compaction.plan import Snapshot
from equeue.errors import ConfigError
from equeue.store.topics import TopicPolicy

SECOND = dt.timedelta(seconds=1)


@pytest.mark.parametrize("topic", ["equeue.delay", "equeue.retry.g"])
def test_a_policy_on_an_internal_topic_is_refused_naming_it(tmp_path: Path, topic: str) -> None:
    with MessageStore.open(tmp_path) as store:
        store.create_topic(topic, 2)  # as the broker creates them: allowed
        for settings in ({"retention": SECOND}, {"cleanup": "compact"}):
            with pytest.raises(ConfigError, match=f"topic '{topic}' is the broker's own"):
                store.create_topic(topic, **settings)
            assert store.topic_policy(topic) == TopicPolicy()
        store.create_topic(topic, cleanup="delete", retention=None)  # the defaults: fine
        # The dead letters are an ordinary topic.
        store.create_topic("equeue.dlq.g", 1, retention=SECOND)


def test_the_job_applies_no_policy_an_older_store_gave_an_internal_topic() -> None:
    policy = TopicPolicy(cleanup="compact", retention=SECOND)
    snapshot = Snapshot(
        "/nonexistent",
        1,
        1 << 16,
        0,
        [],
        {"equeue.delay": policy, "equeue.retry.g": policy, "t": policy},
    )
    scan = chunk_scan(snapshot, time.time(), 2)
    assert set(scan.rules) == {"t"}
