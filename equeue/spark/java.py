"""What Spark needs besides pyspark: a Java runtime, 17 or newer (Spark 4).

Checked before a JVM is started, so that its absence is one clear line rather than
Spark's launcher failing ("JAVA_GATEWAY_EXITED") after a traceback. Importable
without pyspark.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from typing import Final

from equeue.errors import SparkUnavailableError

JAVA_MIN: Final = 17
_INSTALL: Final = "install Java 17 (e.g. apt install openjdk-17-jre-headless) or set JAVA_HOME"
_VERSION: Final = re.compile(r'version "(\d+)(?:\.(\d+))?')


def java_command() -> str | None:
    """The java that Spark's launcher runs (bin/spark-class): JAVA_HOME's, else PATH's."""
    home = os.environ.get("JAVA_HOME")
    if home:
        return os.path.join(home, "bin", "java")
    return shutil.which("java")


def java_major(java: str) -> int | None:
    """The major version ``java -version`` reports (8 for "1.8.0"); None if it cannot say."""
    try:
        done = subprocess.run(
            [java, "-version"], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    found = _VERSION.search(done.stderr + done.stdout)
    if found is None:
        return None
    major = int(found.group(1))
    return int(found.group(2) or 0) if major == 1 else major


def require_spark() -> None:
    """SparkUnavailableError unless pyspark is installed and a JVM can be started."""
    if importlib.util.find_spec("pyspark") is None:
        raise SparkUnavailableError(
            "Spark is not installed: pip install 'equeue[spark]' (pyspark, pyarrow)"
        )
    if "PYSPARK_GATEWAY_PORT" in os.environ:
        return  # spark-submit started the JVM already
    java = java_command()
    if java is None:
        raise SparkUnavailableError(
            f"Spark needs Java {JAVA_MIN} or newer: no java on PATH and JAVA_HOME is not "
            f"set; {_INSTALL}"
        )
    if not os.access(java, os.X_OK):
        raise SparkUnavailableError(
            f"Spark needs Java {JAVA_MIN} or newer: JAVA_HOME is {os.environ['JAVA_HOME']}, "
            f"which has no {java}; {_INSTALL}"
        )
    major = java_major(java)
    if major is None:
        raise SparkUnavailableError(
            f"Spark needs Java {JAVA_MIN} or newer: '{java} -version' does not say which it "
            f"is; {_INSTALL}"
        )
    if major < JAVA_MIN:
        raise SparkUnavailableError(
            f"Spark needs Java {JAVA_MIN} or newer, and {java} is Java {major}; {_INSTALL}"
        )
