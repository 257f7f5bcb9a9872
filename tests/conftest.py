"""Fixtures shared by several test modules: one local SparkSession for the whole run."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    """local[2], tuned to start fast: a cold JVM costs seconds, so every Spark test shares it."""
    from equeue.spark import session

    spark = session(
        "local[2]",
        app_name="equeue-tests",
        shuffle_partitions=2,
        config={
            "spark.ui.enabled": "false",
            "spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
        },
    )
    spark.sparkContext.setLogLevel("ERROR")
    yield spark
    spark.stop()
