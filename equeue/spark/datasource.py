"""The one ``equeue`` format Spark knows: ``spark.read``, ``spark.readStream``,
``df.write`` and ``df.writeStream`` all come here, and each hands over to its room:
the batch source (source.py), the streaming source (stream.py) and the sink (sink.py).

The store path is resolved here, on the driver, once: executors run in other working
directories (other JVMs, other machines), so a relative path must never reach them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    DataSourceWriter,
)
from pyspark.sql.types import StructType

from equeue.errors import SparkOptionError


def store_path(options: Mapping[str, str]) -> str:
    """The store directory of ``load(STORE)``/``save(STORE)``, absolute."""
    path = options.get("path")
    if not path:
        raise SparkOptionError(
            'format("equeue") needs the store directory: .load("/path/to/store") or '
            '.save("/path/to/store")'
        )
    return os.path.abspath(path)


def resolved(options: Mapping[str, str]) -> dict[str, str]:
    """``options`` with ``path`` made absolute (where it is given)."""
    out = dict(options)
    if out.get("path"):
        out["path"] = store_path(out)
    return out


def through_broker(options: Mapping[str, str]) -> bool:
    """The ``broker`` option is given: nothing opens the store (viabroker.py)."""
    return any(key.lower() == "broker" for key in options)


class EqueueDataSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return "equeue"

    def schema(self) -> str:
        from equeue.spark.source import schema_for

        return schema_for(resolved(self.options))

    def reader(self, schema: StructType) -> DataSourceReader:
        if through_broker(self.options):
            from equeue.spark.brokerread import EqueueBrokerReader

            return EqueueBrokerReader(dict(self.options))
        from equeue.spark.source import EqueueReader

        return EqueueReader(resolved(self.options))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        from equeue.spark.stream import EqueueStreamReader

        return EqueueStreamReader(resolved(self.options), schema)

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        if through_broker(self.options):
            from equeue.spark.brokersink import EqueueBrokerWriter

            return EqueueBrokerWriter(dict(self.options), schema, overwrite)
        from equeue.spark.sink import EqueueWriter

        return EqueueWriter(resolved(self.options), schema, overwrite)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        if through_broker(self.options):
            from equeue.spark.brokersink import EqueueBrokerStreamWriter

            return EqueueBrokerStreamWriter(dict(self.options), schema, overwrite)
        from equeue.spark.sink import EqueueStreamWriter

        return EqueueStreamWriter(resolved(self.options), schema, overwrite)
