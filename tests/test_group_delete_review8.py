"""Group deletion intents (review8): a group with no retry topic gets the mark that drops
its delayed copies without its retry topic ever being made, so a SIGKILL anywhere leaves
no empty ``equeue.retry.G`` behind (R8-1); a malformed ``"topics"`` record is damage, set
aside with nothing deleted (R8-2)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from test_group_delete_later import _delete_failing

from equeue import MessageStore, StoreConfig
from equeue.atomicfile import write_json
from equeue.server import retry

RETRY = retry.retry_topic("g")
CONFIG = StoreConfig(flush="os")

# The child deletes g, SIGKILLing itself at POINT: "retry deleted" (the retry topic's
# delete_topic, which the old finish called after creating it to record a mark) or
# "committed" (groupdeletion's commit point, before any finish).
CHILD = textwrap.dedent(
    """
    import os, signal, sys
    from equeue import MessageStore, StoreConfig
    from equeue.store import groupdeletion
    path, point = sys.argv[1], sys.argv[2]
    real = MessageStore.delete_topic
    def delete_topic(store, topic):
        if point == "retry deleted" and topic == "equeue.retry.g":
            os.kill(os.getpid(), signal.SIGKILL)
        real(store, topic)
    def step(name):
        if point == name:
            os.kill(os.getpid(), signal.SIGKILL)
    MessageStore.delete_topic = delete_topic
    groupdeletion._step = step
    with MessageStore.open(path, StoreConfig(flush="os")) as store:
        store.delete_group("g")
    """
)


def _no_retry_topic(path: Path) -> Path:
    with MessageStore.open(path, CONFIG) as store:
        store.create_topic("t", 1)
        store.send("t", b"x")
        store.commit_offset("g", "t", 0, 1)
        store.create_topic(retry.DELAY_TOPIC, 1)
        store.send(retry.DELAY_TOPIC, b"a delayed copy of g")
    return path


@pytest.mark.parametrize("point", ["retry deleted", "committed"])
def test_a_sigkill_in_a_deletion_of_a_group_with_no_retry_topic_leaves_none_and_its_mark(
    tmp_path: Path, point: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = _no_retry_topic(tmp_path / "s")
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), point], capture_output=True, timeout=60
    )
    assert child.returncode in (0, -signal.SIGKILL), child.stderr.decode()
    with MessageStore.open(path, CONFIG) as store:
        assert not store.recovery.problems, store.recovery.problems
        assert sorted(store.topics()) == [retry.DELAY_TOPIC, "t"]
        assert RETRY in store.deleted_topics()  # the mover drops g's delayed copies
        assert "g" not in store.consumer_groups()
    assert "kept" not in caplog.text
    assert not [e for e in os.listdir(path / "consumers" / "recovered") if "deleting" in e]


DLQ = retry.dead_letter_topic("g")
GOOD = {RETRY: {"mark": -1, "ends": [1, 0]}, DLQ: {"mark": -1, "ends": [1]}}
MALFORMED: dict[str, object] = {
    "a list": [],
    "null": None,
    "a string": "x",
    "an end past 2**63": {RETRY: {"mark": -1, "ends": [2**63, 0]}},
    "a negative end": {RETRY: {"mark": -1, "ends": [-5, 0]}},
    "a string end": {RETRY: {"mark": -1, "ends": ["1", 0]}},
    "a float end": {RETRY: {"mark": -1, "ends": [1.0, 0]}},
    "a bool end": {RETRY: {"mark": -1, "ends": [True, 0]}},
    "ends past the queue count limit": {RETRY: {"mark": -1, "ends": [0] * 1025}},
    "ends not a list": {RETRY: {"mark": -1, "ends": {"0": 1}}},
    "no ends": {RETRY: {"mark": -1}},
    "a string mark": {RETRY: {"mark": "x", "ends": [1, 0]}},
    "a bool mark": {RETRY: {"mark": True, "ends": [1, 0]}},
    "a float mark": {RETRY: {"mark": -1.0, "ends": [1, 0]}},
    "a mark below -1": {RETRY: {"mark": -2, "ends": [1, 0]}},
    "no mark": {RETRY: {"ends": [1, 0]}},
    "an entry not a dict": {RETRY: [-1, [1, 0]]},
    "another group's topic": {"equeue.retry.h": {"mark": -1, "ends": [0]}},
    "a topic of no group": {"t": {"mark": -1, "ends": [0]}},
}


def _living_group(path: Path) -> Path:
    with MessageStore.open(path, CONFIG) as store:
        store.create_topic("t", 1)
        store.send("t", b"x")
        store.commit_offset("g", "t", 0, 1)
        store.create_topic(RETRY, 2)
        store.send(RETRY, b"old", queue_id=0)
        store.create_topic(DLQ, 1)
        store.send(DLQ, b"dead")
        store.create_topic(retry.DELAY_TOPIC, 1)
    return path


def _intent(path: Path, topics: object) -> Path:
    side = path / "consumers" / "recovered"
    side.mkdir(parents=True, exist_ok=True)
    intent = side / "g.json.1700000000000000000.deleting"
    body = {"group": "g", "offsets": {}, "deleting": {"dead_letters": True, "topics": topics}}
    write_json(intent, body)
    return intent


@pytest.mark.parametrize("label", list(MALFORMED))
def test_a_malformed_topics_record_is_damage_set_aside_with_nothing_deleted(
    tmp_path: Path, label: str
) -> None:
    path = _living_group(tmp_path / "s")
    intent = _intent(path, MALFORMED[label])
    open_refusing(path, intent, "topics")
    assert os.listdir(intent.parent) == [f"{intent.name}.damaged"]


def open_refusing(path: Path, intent: Path, field: str) -> None:
    """A writable open of a store whose intent is malformed at ``field``: one problem
    naming it, g and every one of its topics kept (nothing deleted)."""
    with MessageStore.open(path, CONFIG) as store:
        assert sorted(store.topics()) == sorted([DLQ, RETRY, retry.DELAY_TOPIC, "t"])
        assert store.consumer_groups()["g"] == {"t": {0: 1}}
        assert len(store.recovery.problems) == 1, store.recovery.problems
        assert str(intent) in store.recovery.problems[0]
        assert f'"{field}"' in store.recovery.problems[0]


def test_a_well_formed_topics_record_is_acted_on(tmp_path: Path) -> None:
    path = _living_group(tmp_path / "s")
    intent = _intent(path, GOOD)
    with MessageStore.open(path, CONFIG) as store:
        assert not store.recovery.problems, store.recovery.problems
        assert sorted(store.topics()) == [retry.DELAY_TOPIC, "t"]
    assert not intent.exists()


def test_a_later_finish_renames_only_the_copies_set_aside_before_its_intent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _living_group(tmp_path / "s")
    side = path / "consumers" / "recovered"
    side.mkdir(parents=True, exist_ok=True)
    older = side / f"g.json.{time.time_ns()}.damaged"  # the deleted g's, before its intent
    older.write_bytes(b"the old g's damaged group file")
    with MessageStore.open(path, CONFIG) as store:
        assert _delete_failing(store, monkeypatch, 2).unfinished  # an intent is left
        store.commit_offset("g", "t", 0, 1)  # g made again
        newer = side / f"g.json.{time.time_ns()}.damaged"  # the new g's, after the intent
        newer.write_bytes(b"the new g's damaged group file")
    with MessageStore.open(path, CONFIG) as store:
        assert "g" in store.consumer_groups()
        assert store._group_files.set_aside() == [newer.name]  # it holds retention still
    assert sorted(os.listdir(side)) == sorted([newer.name, f"{older.name}.group-deleted"])


def test_delete_group_again_reports_the_topic_its_earlier_pass_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _living_group(tmp_path / "s")
    with MessageStore.open(path, CONFIG) as store:
        assert _delete_failing(store, monkeypatch, 2).topics == ()  # an intent is left
        again = store.delete_group("g")  # the remedy the problem names
        assert (again.offsets, again.topics, again.unfinished) == (0, (RETRY,), "")
        assert RETRY not in store.topics()
