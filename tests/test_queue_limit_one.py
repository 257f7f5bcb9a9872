"""The most queues a topic has is one constant, validate.MAX_QUEUES: every check of a
queue count or id reads it (review9 R9-6: check_queue_count, the queue directories'
scan, group files and group deletion intents each held a 1024 of their own, so a change
of the bound in one place would refuse the others' files as damage). Each reader is
asked here at the bound and with it raised: it follows."""

from __future__ import annotations

from pathlib import Path

import pytest

from equeue.errors import CorruptionError, InvalidMessageError
from equeue.server import retry
from equeue.store import groupdeletion, losses, offsets, validate

QUEUE_ID = 1500  # above today's bound


def _readers(tmp_path: Path) -> dict[str, object]:
    """What each reader makes of queue id QUEUE_ID (or a topic of QUEUE_ID + 1 queues)."""
    results: dict[str, object] = {}
    try:
        results["check_queue_count"] = validate.check_queue_count(QUEUE_ID + 1)
    except InvalidMessageError:
        results["check_queue_count"] = None
    topic = tmp_path / "t"
    (topic / str(QUEUE_ID)).mkdir(parents=True, exist_ok=True)
    (topic / str(QUEUE_ID) / "00000000000000000000.chunk").touch()
    results["scan_topic_dir"] = losses.scan_topic_dir(topic, [])[0]
    body = {"group": "g", "offsets": {"t": {str(QUEUE_ID): 1}}}
    try:
        results["group file"] = offsets._check_body(body, "g.json", tmp_path / "g.json")[1]
    except CorruptionError:
        results["group file"] = None
    scope = {retry.retry_topic("g"): {"mark": -1, "ends": [0] * (QUEUE_ID + 1)}}
    try:
        results["intent"] = len(
            groupdeletion._checked_scope(scope, "g", tmp_path / "i")[retry.retry_topic("g")]["ends"]
        )
    except CorruptionError:
        results["intent"] = None
    return results


def test_every_reader_of_queue_ids_follows_the_one_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert validate.MAX_QUEUES == 1024
    assert _readers(tmp_path / "today") == {
        "check_queue_count": None,
        "scan_topic_dir": [],
        "group file": None,
        "intent": None,
    }
    monkeypatch.setattr(validate, "MAX_QUEUES", 2048)
    assert _readers(tmp_path / "raised") == {
        "check_queue_count": QUEUE_ID + 1,
        "scan_topic_dir": [QUEUE_ID],
        "group file": {"t": {str(QUEUE_ID): 1}},
        "intent": QUEUE_ID + 1,
    }
