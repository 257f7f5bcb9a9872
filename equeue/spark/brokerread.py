"""``spark.read.format("equeue").option("broker", URL)``: a batch read of queue offsets
through a broker, for executors that do not see the store's filesystem.

The streaming source's way (stream.py) for a batch: the driver plans each queue's
[start, end) with the client (offsets.py, the ``startingOffsets``/``endingOffsets``
options as a path read takes them) and a task pulls its range through a connection of its
own. Only a read by topic is offered: the path reader's chunk scans, key index and
filter pushdown need the files (Spark applies the filters itself here).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Final

import pyarrow as pa
from pyspark.sql.datasource import DataSourceReader, InputPartition

from equeue.errors import SparkOptionError
from equeue.spark.offsets import OffsetBounds
from equeue.spark.stream import QueueRange, open_queues, read_range

OPTIONS: Final = (
    "broker", "tokenFile", "caFile", "connectTimeout", "timeout", "topics", "topicPattern",
    "startingOffsets", "endingOffsets", "failOnDataLoss",
)  # fmt: skip


class EqueueBrokerReader(DataSourceReader):
    def __init__(self, options: Mapping[str, str]) -> None:
        known = {name.lower() for name in OPTIONS}
        for key in options:
            if key.lower() not in known and key.lower() != "path":  # path: viabroker says
                raise SparkOptionError(
                    f"read.format('equeue') through a broker: option {key!r} is not taken "
                    "(a read through a broker is by topic and offsets; chunk scans, columns "
                    "and meta need the store's files); the options are " + ", ".join(OPTIONS)
                )
        bounds = OffsetBounds.of(options)
        if bounds is None:
            raise SparkOptionError(
                "read.format('equeue') through a broker needs option topics or topicPattern "
                "(a whole-store scan reads the chunk files: load(STORE) where they are seen)"
            )
        self.bounds = bounds

    def partitions(self) -> Sequence[InputPartition]:
        opened = open_queues(self.bounds.options)
        try:
            spans = self.bounds.spans(opened)
        finally:
            opened.close()
        return [QueueRange(topic, queue, start, stop) for topic, queue, start, stop in spans]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, QueueRange)
        return read_range(self.bounds.options, partition)
