"""JSON given to the Spark jobs (an option, the query's checkpoint metadata) nested past
the interpreter's recursion limit is refused like any other bad JSON, naming the option or
file (review 37a A1's family): before, a builtin RecursionError escaped."""

from __future__ import annotations

from pathlib import Path

import pytest

from equeue.errors import SinkCommitError, SparkOptionError
from equeue.spark.sink import query_id
from equeue.spark.source import _chunks_option
from equeue.spark.stream import offsets_json

DEEP = "[" * 200_000


def test_a_deep_starting_offsets_option_is_a_spark_option_error() -> None:
    with pytest.raises(SparkOptionError, match=r"option startingOffsets=.*not JSON"):
        offsets_json(DEEP)


def test_a_deep_chunks_option_is_a_spark_option_error() -> None:
    with pytest.raises(SparkOptionError, match="option chunks="):
        _chunks_option(DEEP)


def test_a_deep_checkpoint_metadata_is_a_sink_commit_error(tmp_path: Path) -> None:
    (tmp_path / "metadata").write_text(DEEP[:60_000])
    with pytest.raises(SinkCommitError, match="cannot read the streaming query's id"):
        query_id(str(tmp_path))


def test_control_well_formed_values_are_read(tmp_path: Path) -> None:
    assert offsets_json('{"t": {"0": 3}}') == {"t": {"0": 3}}
    assert _chunks_option('[["a", 4]]') == [("a", 4)]
    (tmp_path / "metadata").write_text('{"id": "q-1"}\n')
    assert query_id(str(tmp_path)) == "q-1"
