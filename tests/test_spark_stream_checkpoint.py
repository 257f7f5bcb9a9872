"""The streaming driver given a start offset from the query's checkpoint that this
source did not write (reviewl L7: a hand-edited or foreign checkpoint), and one an older
version wrote, without ``"@deleted"``, for a topic the store has deleted (reviewl L4: a
warning, once)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from test_spark_stream import reader

from equeue import MessageStore
from equeue.errors import CorruptionError


def _store(path: Path) -> Path:
    with MessageStore.open(path) as store:
        store.create_topic("t", 1)
        store.send("t", b"old")
        store.delete_topic("t")
        store.create_topic("t", 1)
        for i in range(3):
            store.send("t", b"new%d" % i)
    return path


@pytest.mark.parametrize(
    ("start", "said"),
    [
        ({"t": 5}, "topic 't' maps to 5"),
        ({"t": {"0": "x"}}, "offset 'x' of t/0"),
        ({"t": {"0": -1}}, "offset -1 of t/0"),
        ({"t": {"zero": 0}}, "queue id 'zero'"),
        ({"t": {"1" * 5000: 0}}, "queue id '1111"),  # (int(): a builtin ValueError, R11-7)
        ({"t": {"0": 0}, "@deleted": 3}, "@deleted must map topics to log positions"),
        ({"t": {"0": 0}, "@deleted": []}, "@deleted must map"),
        ({"t": {"0": 0}, "@deleted": {"t": "x"}}, "@deleted must map"),
        ({"t": {"0": 0}, "@from": 7}, "@from must map"),
        ({"t": {"0": 0}, "@from": {"t": {"0": None}}}, "offset None of t/0"),
        ([1], "not a JSON object"),
    ],
)
def test_a_checkpoint_offset_of_another_shape_is_a_corruption_error(
    tmp_path: Path, start: Any, said: str
) -> None:
    stream = reader(_store(tmp_path / "s"), topics="t")
    try:
        with pytest.raises(CorruptionError, match="checkpoint holds an offset") as refused:
            stream.latestOffset(start, _all())
        assert said in str(refused.value) and "checkpointLocation" in str(refused.value)
        with pytest.raises(CorruptionError):
            stream.partitions(start, {"t": {"0": 1}})
    finally:
        stream.stop()


def _all() -> Any:
    from pyspark.sql.streaming.datasource import ReadAllAvailable

    return ReadAllAvailable()


def test_an_offset_without_deletion_marks_of_a_deleted_topic_is_warned_of_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    stream = reader(_store(tmp_path / "s"), topics="t")
    try:
        with caplog.at_level(logging.WARNING, logger="equeue.spark.stream"):
            end = stream.latestOffset({"t": {"0": 1}}, _all())
            stream.latestOffset({"t": {"0": 1}}, _all())
        assert end["t"] == {"0": 3}
        warned = [r.getMessage() for r in caplog.records if "cannot rule out" in r.getMessage()]
        assert len(warned) == 1 and "topic 't'" in warned[0], warned
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="equeue.spark.stream"):
            stream.latestOffset(end, _all())  # with "@deleted": nothing to say
        assert not [r for r in caplog.records if "cannot rule out" in r.getMessage()]
    finally:
        stream.stop()
