"""What the set-up needs, said where it is needed: without Java on the PATH (a PATH of
this machine's directories with java left out, JAVA_HOME unset, in a subprocess)
``equeue compact`` says so in one line, ``make demo`` says so before it starts, and
the Spark tests are skipped with that reason. With Java, ``equeue compact`` keeps
Spark's log out of sight unless ``--verbose``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from equeue import MessageStore, StoreConfig
from equeue.errors import SparkUnavailableError
from equeue.spark.java import JAVA_MIN, require_spark

ROOT = Path(__file__).resolve().parent.parent
# Spark's noise on a default start (pyspark 4): none of it may reach a user by default.
SPARK_NOISE = (
    "log4j",
    "NativeCodeLoader",
    "setLogLevel",
    "replaced a previously registered data source",
    "Using incubator modules",
)


def without_java(tmp_path: Path) -> dict[str, str]:
    """This environment with every PATH directory holding a java replaced by a copy (of
    symbolic links) without it, JAVA_HOME unset."""
    # Not the settings of a make that runs these tests (make test): a nested make would
    # print its "Entering directory" lines, as a user's make does not.
    unset = ("JAVA_HOME", "MAKEFLAGS", "MFLAGS", "MAKELEVEL")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    directories = []
    for n, directory in enumerate(env.get("PATH", "").split(os.pathsep)):
        if os.path.lexists(os.path.join(directory, "java")):
            shadow = tmp_path / f"path-{n}"
            shadow.mkdir()
            for name in os.listdir(directory):
                if name != "java":
                    (shadow / name).symlink_to(os.path.join(directory, name))
            directory = str(shadow)
        directories.append(directory)
    env["PATH"] = os.pathsep.join(directories)
    assert shutil.which("java", path=env["PATH"]) is None
    return env


def with_fake_java(tmp_path: Path, version: str) -> dict[str, str]:
    """PATH with one ``java`` that only says it is ``version``, JAVA_HOME unset."""
    tmp_path.mkdir(exist_ok=True)
    env = without_java(tmp_path)
    fake = tmp_path / "fake-java"
    fake.mkdir()
    (fake / "java").write_text(f"#!/bin/sh\necho 'openjdk version \"{version}\" 2025-04-15' >&2\n")
    (fake / "java").chmod(0o755)
    env["PATH"] = f"{fake}{os.pathsep}{env['PATH']}"
    return env


def compactable_store(path: Path) -> Path:
    """A compacted topic whose completed chunks hold superseded messages."""
    config = StoreConfig(chunk_data_size=4096, queue_chunk_records=400, default_queue_count=2)
    with MessageStore.open(path, config) as store:
        store.create_topic("orders", cleanup="compact")
        for i in range(30):
            store.send("orders", b"kept" * 10, key=f"unique-{i}")
        for _ in range(100):
            store.send("orders", b"filler" * 10, key="filler")
    return path


def equeue_command(*args: str | Path, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    return finish(equeue_process(*args, env=env))


def equeue_process(*args: str | Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "equeue", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def finish(process: subprocess.Popen[str]) -> tuple[int, str, str]:
    try:
        out, err = process.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        pytest.fail(f"{process.args!r} ran for 600 s: {err[-3000:]}")
    return process.returncode, out, err


def test_compact_without_java_says_so_in_one_line(tmp_path: Path) -> None:
    store = compactable_store(tmp_path / "store")
    env = without_java(tmp_path)
    code, out, err = equeue_command("compact", store, env=env)
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("equeue: error: Spark needs Java 17 or newer")
    assert "no java on PATH and JAVA_HOME is not set" in err
    code, out, err = equeue_command("compact", store, "--dry-run", "--json", env=env)
    assert code == 1 and out == ""
    doc = json.loads(err)
    assert doc["path"] == str(store) and doc["error"].startswith("Spark needs Java 17")
    assert not (store / "compaction").exists()  # nothing was started


def test_java_requirement(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An old Java and a JAVA_HOME without one are refused by name; Java 17 or newer is
    not (so the Spark tests run wherever Spark can)."""
    for version, refused in [("11.0.2", "Java 11"), ("1.8.0_292", "Java 8"), ("21.0.1", None)]:
        monkeypatch.setenv("PATH", with_fake_java(tmp_path / version, version)["PATH"])
        monkeypatch.delenv("JAVA_HOME", raising=False)
        if refused is None:
            require_spark()
        else:
            with pytest.raises(SparkUnavailableError, match=f"and .*/java is {refused};"):
                require_spark()
    monkeypatch.setenv("JAVA_HOME", str(tmp_path))
    with pytest.raises(SparkUnavailableError, match=f"JAVA_HOME is {tmp_path}, which has no"):
        require_spark()
    assert JAVA_MIN == 17


def test_spark_tests_skip_without_java(tmp_path: Path) -> None:
    test = "tests/test_compaction.py::test_dry_run_changes_nothing"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", test],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=ROOT,
        env=without_java(tmp_path),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 skipped" in done.stdout and "Spark needs Java 17 or newer" in done.stdout


def test_make_demo_without_java_says_so_before_it_starts(tmp_path: Path) -> None:
    make = shutil.which("make")
    if make is None:
        pytest.skip("no make on this machine")
    work = tmp_path / "checkout"
    work.mkdir()
    shutil.copy(ROOT / "Makefile", work)
    env = without_java(tmp_path)
    done = subprocess.run(
        [make, "demo"], cwd=work, env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode != 0
    assert done.stderr.startswith("make demo: the demo compacts its store with Spark, which")
    assert "needs Java 17" in done.stderr and "tools/demo.py ./demo-store" in done.stderr
    assert done.stdout == "" and sorted(os.listdir(work)) == ["Makefile"]  # nothing started
    # The control: with a java on the PATH, the check passes.
    env = with_fake_java(tmp_path / "java-17", "17.0.15")
    done = subprocess.run(
        [make, "check-java"], cwd=work, env=env, capture_output=True, text=True, check=False
    )
    assert (done.returncode, done.stderr) == (0, "")


def test_compact_is_quiet_unless_verbose(tmp_path: Path) -> None:
    """Spark's banner, log and JVM warnings stay out of sight; --verbose shows them. Two
    Spark starts, the only `equeue compact` subprocesses in the tests: run side by side,
    each on a store of its own (a JVM's start leaves a core idle much of the time)."""
    try:
        require_spark()
    except SparkUnavailableError as exc:
        pytest.skip(str(exc))
    quiet = equeue_process("compact", compactable_store(tmp_path / "store"), "--master", "local[2]")
    verbose = equeue_process(
        "compact",
        compactable_store(tmp_path / "verbose"),
        "--master",
        "local[1]",
        "--verbose",
        "--dry-run",
        "--now",
        "2100-01-01T00:00:00Z",
    )
    try:
        code, out, err = finish(quiet)
        assert code == 0, err
        assert "rewrote" in out and "[compact] pass 1 done" in err  # our own progress stays
        for noise in SPARK_NOISE:
            assert noise not in out + err
        assert "WARN" not in out + err
        code, out, err = finish(verbose)
        assert code == 0, err
        assert "Using Spark's default log4j profile" in err  # Spark's own log is back
    finally:
        for process in (quiet, verbose):
            if process.poll() is None:  # a failed assertion: no JVM outlives the test
                process.kill()
                process.communicate()


def test_readme_setup_says_what_it_needs() -> None:
    readme = (ROOT / "README.md").read_text()
    setup = " ".join(readme[readme.index("## Set-up") :].split("\n## ")[0].split())
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'requires-python = ">=3.11"' in pyproject and "Python 3.11" in setup
    assert f"for the Spark parts, Java {JAVA_MIN}**" in setup
    assert "Everything else works without Java" in setup
    assert "Spark tests are then skipped" in setup
