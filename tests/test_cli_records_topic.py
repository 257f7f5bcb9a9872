"""`equeue records --topic T` for a topic the store never had (review17, noticed): it
printed nothing and exited 0, so a misspelt topic read as an empty one. Now it is a usage
error naming the topics there are; a deleted topic's records, which the log keeps until
retention, are still shown."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from equeue import MessageStore
from equeue.cli import main


def test_an_unknown_topic_is_a_usage_error_and_a_deleted_one_still_shows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = tmp_path / "store"
    with MessageStore.open(store) as writer:
        for topic in ("orders", "old"):
            writer.create_topic(topic, 1)
            writer.send(topic, b"body of " + topic.encode())
        writer.delete_topic("old")
    assert main(["records", str(store), "--topic", "ordrs"]) == 2
    err = capsys.readouterr().err
    assert "no topic 'ordrs'" in err and "(topics: orders)" in err, err
    for topic in ("orders", "old"):
        assert main(["records", str(store), "--topic", topic, "--json"]) == 0
        [line] = capsys.readouterr().out.splitlines()
        assert json.loads(line)["body"] == f"body of {topic}"
