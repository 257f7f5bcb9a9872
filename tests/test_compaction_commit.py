"""Crash injected at each stage of the compaction commit: the store opens consistent,
with either the old or the new chunks.

One real compaction job (Spark) runs per module, stopped just before it installs:
the store with its staged, uncommitted replacements is copied as a template. Each
test works on a fresh copy of it. The crash tests run ``commit.install`` in a child
process (forked: tests/compaction_crash_child.py) that SIGKILLs itself just before, or just
after, its k-th file-system call, for k = 1, 2, ... until it gets through; the store
is then opened for writing (recovery rolls the install forward or back) and must
hold exactly the messages it held before the job if the crash came before the
manifest was in place, else exactly those the policy keeps (tests/compaction_model.py),
byte-identical, with no staging directory or superseded chunk file left, a clean
``equeue verify``, and a clean report at the next open.
"""

from __future__ import annotations

import json
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from compaction_crash_child import forked
from compaction_model import all_messages, expected_removed

from equeue import Message, MessageStore, StoreConfig
from equeue.atomicfile import read_json, write_json
from equeue.compaction import commit
from equeue.compaction.job import compact
from equeue.compaction.rewrite import RewriteResult
from equeue.errors import CompactionError, CorruptionError
from equeue.format.chunk import parse_chunk_file_name
from equeue.inspect.verify import Verifier
from equeue.store.meta import MESSAGES_DIR

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

CHUNK_DATA_SIZE = 16 * 1024
COMPACTED = "state"  # cleanup="compact"
PLAIN = "events"  # cleanup="delete" without retention: compaction keeps everything
KEYS = 40
COUNT = 1200


class _StopBeforeInstall(Exception):
    pass


@dataclass(frozen=True)
class Template:
    """A store whose compaction job was stopped right before ``commit.install``."""

    original: Path  # the store the job ran on (it discarded its staging when stopped)
    store: Path  # a copy taken inside install(): the staged replacements are there
    staging_name: str
    results: list[RewriteResult]
    read: list[str]
    needs: list[frozenset[str]]  # per result: the other chunk files its tombstones need
    before: dict[int, Message]  # every pullable message before the job, by position
    removed: set[int]  # what the policy removes (the reference model)
    old_files: set[str]  # messages/ before the job
    new_files: set[str]  # messages/ once installed

    @property
    def after(self) -> dict[int, Message]:
        return {p: m for p, m in self.before.items() if p not in self.removed}

    def copy(self, destination: Path) -> tuple[Path, Path]:
        """A fresh copy of the template store; (store, its staging directory)."""
        shutil.copytree(self.store, destination)
        return destination, commit.compaction_dir(destination) / self.staging_name


def _body(i: int) -> bytes:
    return b"message %d " % i + bytes([65 + i % 26]) * (20 + i % 60)


def _fill(path: Path) -> None:
    config = StoreConfig(chunk_data_size=CHUNK_DATA_SIZE, queue_chunk_records=1024)
    with MessageStore.open(path, config) as store:
        store.create_topic(COMPACTED, 2, cleanup="compact")
        store.create_topic(PLAIN, 1)
        for i in range(COUNT):
            if i % 9 == 0:
                store.send(PLAIN, _body(i), key=f"k{i % KEYS}", tag="plain")
            elif i % 7 == 0:
                store.send(COMPACTED, _body(i), tag="keyless", properties={"i": str(i)})
            elif i % 101 == 0:
                store.send(COMPACTED, b"", key=f"k{i % KEYS}", tag="tombstone")
            else:
                store.send(COMPACTED, _body(i), key=f"k{i % KEYS}", tag=f"t{i % 3}", code=i)
        store.flush()


def _pullable(path: Path) -> dict[int, Message]:
    with MessageStore.open(path, read_only=True) as store:
        return all_messages(store)


def _listing(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir()}


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory, spark: SparkSession) -> Template:
    root = tmp_path_factory.mktemp("compaction-commit")
    original, copy = root / "store", root / "template"
    _fill(original)
    now = time.time()
    before = _pullable(original)
    removed = expected_removed(original, now)
    old_files = _listing(original / MESSAGES_DIR)
    captured: list[tuple[Path, list[RewriteResult], list[str], list[frozenset[str]]]] = []

    def stop_before_install(
        store: Path,
        staging: Path,
        results: list[RewriteResult],
        read: list[str],
        needs: list[frozenset[str]],
        gone: list[str],
    ) -> None:
        assert gone == []
        shutil.copytree(store, copy)
        captured.append((staging, list(results), list(read), list(needs)))
        raise _StopBeforeInstall

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(commit, "install", stop_before_install)
        with pytest.raises(_StopBeforeInstall):
            compact(original, spark=spark, now=now)
    [(staging, results, read, needs)] = captured
    new_files = (old_files - set(read)) | {r.file_name for r in results}
    return Template(
        original, copy, staging.name, results, read, needs, before, removed, old_files, new_files
    )


def test_the_template_is_a_real_staged_job(template: Template) -> None:
    """The job planned merges of several chunks, staged them, and (stopped before the
    commit) discarded its staging in the store it ran on, changing nothing there."""
    assert len(template.read) >= 4
    assert len(template.results) >= 2
    assert any(r.end_number > r.start_number for r in template.results)  # a merge
    assert sum(r.records_removed for r in template.results) == len(template.removed)
    assert template.removed and template.removed < template.before.keys()
    removed = [template.before[p] for p in template.removed]
    assert all(m.topic == COMPACTED and m.key is not None for m in removed)
    staging = commit.compaction_dir(template.store) / template.staging_name
    assert _listing(staging) == {r.file_name for r in template.results}
    assert not (staging / commit.MANIFEST_FILE).exists()
    # The store the job ran on: staging discarded, chunks untouched.
    assert not [p for p in commit.compaction_dir(template.original).iterdir() if p.is_dir()]
    assert _listing(template.original / MESSAGES_DIR) == template.old_files
    assert _pullable(template.original) == template.before


# --- checks after a crash ---------------------------------------------------------------


def _check_recovered(template: Template, path: Path, committed: bool, what: str) -> None:
    staging = commit.compaction_dir(path) / template.staging_name
    staged = staging.is_dir()
    has_manifest = (staging / commit.MANIFEST_FILE).exists()
    expected = template.after if committed else template.before
    with MessageStore.open(path) as store:
        report = store.recovery
        assert (report.cuts, report.problems, report.redispatched) == ([], [], 0), what
        if has_manifest:
            done = [f"finished installing the committed compaction {template.staging_name}"]
        elif staged:
            done = [f"removed the uncommitted compaction staging {template.staging_name}"]
        else:
            done = []
        assert report.compactions == done, what
        found = all_messages(store)
        assert found.keys() == expected.keys(), (
            f"{what}: expected the {'new' if committed else 'old'} chunks; "
            f"{len(found.keys() - expected.keys())} messages too many, "
            f"{len(expected.keys() - found.keys())} missing"
        )
        assert found == expected, f"{what}: a message changed"
        compacted = [c.path.name for c in store._messages if c.header.compacted]
        assert sorted(compacted) == (
            sorted(r.file_name for r in template.results) if committed else []
        ), what
    assert _listing(path / MESSAGES_DIR) == (
        template.new_files if committed else template.old_files
    ), what
    # No staging directory and no temporary file left.
    entries = set(_listing(commit.compaction_dir(path)))
    marker = {commit.INSTALLED_FILE} if committed else set()
    assert entries == {commit.JOB_LOCK, commit.COMMIT_LOCK} | marker, what
    installed = commit.compaction_dir(path) / commit.INSTALLED_FILE
    if committed:
        assert read_json(installed)["staging"] == template.staging_name, what
    else:
        assert not installed.exists(), what
    assert Verifier(path).run() == [], what
    with MessageStore.open(path) as store:
        assert store.recovery.clean, f"{what}: {store.recovery}"
        assert all_messages(store).keys() == expected.keys(), what


@dataclass(frozen=True)
class ChildRun:
    killed: bool
    calls: list[str]  # "CALL <n> <name> <path>" lines, the last one possibly not run


def _run_child(template: Template, destination: Path, mode: str, k: int) -> ChildRun:
    store, staging = template.copy(destination)
    job = destination.with_name(destination.name + ".json")
    job.write_text(
        json.dumps({"results": [asdict(r) for r in template.results], "read": template.read})
    )
    returncode, lines = forked([str(store), str(staging), str(job), mode, str(k)])
    if returncode == -signal.SIGKILL:
        assert lines and lines[-1].startswith(f"CALL {k} "), lines
        return ChildRun(True, lines)
    assert returncode == 0 and lines and lines[-1] == "DONE", (returncode, lines[-20:])
    return ChildRun(False, lines[:-1])


def _replace_call(calls: list[str], file_name: str) -> int | None:
    """The number of the call that renames a temporary file onto ``file_name``."""
    for line in calls:
        _, n, name, detail = line.split(" ", 3)
        if name == "replace" and detail.endswith(f"/{file_name}"):
            return int(n)
    return None


def _commit_call(calls: list[str]) -> int | None:
    """The number of the call that puts the manifest in place (the commit point)."""
    return _replace_call(calls, commit.MANIFEST_FILE)


def _crash_at_every_call(
    template: Template, root: Path, mode: str, committed: Callable[[int, int | None], bool]
) -> list[str]:
    """Kill the child at call k = 1, 2, ... until it gets through; check each crash."""
    finished: list[str] = []
    for k in range(1, 1000):
        path = root / f"{mode}-{k}"
        run = _run_child(template, path, mode, k)
        if not run.killed:
            finished = run.calls
            _check_recovered(template, path, True, f"{mode}: no crash")
            break
        commit_point = _commit_call(run.calls)
        _check_recovered(
            template, path, committed(k, commit_point), f"killed {mode} {run.calls[-1]!r}"
        )
        shutil.rmtree(path)
    else:
        pytest.fail("the child never got through install()")
    return finished


def test_crash_before_each_call_leaves_old_or_new_chunks(
    template: Template, tmp_path: Path
) -> None:
    calls = _crash_at_every_call(
        template, tmp_path, "before", lambda k, point: point is not None and point < k
    )
    names = [line.split(" ", 3)[2] for line in calls]
    assert len(calls) > 5
    # The calls the protocol makes: the manifest, a rename per replacement, a deletion
    # per replaced file, the installed marker, the staging directory removed.
    assert _commit_call(calls) is not None
    assert names.count("rename") == len(template.results)
    assert names.count("unlink") >= len(template.read)
    assert names.count("rmdir") == 1


def test_crash_after_each_call_leaves_old_or_new_chunks(template: Template, tmp_path: Path) -> None:
    calls = _crash_at_every_call(
        template, tmp_path, "after", lambda k, point: point is not None and point <= k
    )
    assert len(calls) > 5


def test_no_temporary_file_outlives_a_crash(template: Template, tmp_path: Path) -> None:
    probe = _run_child(template, tmp_path / "probe", "never", 0)
    k = _replace_call(probe.calls, commit.INSTALLED_FILE)
    assert k is not None
    path = tmp_path / "store"
    assert _run_child(template, path, "before", k).killed
    with MessageStore.open(path) as store:
        assert store.recovery.compactions != []
    with MessageStore.open(path):
        pass
    assert [e for e in _listing(commit.compaction_dir(path)) if e.endswith(".tmp")] == []


# --- without a child --------------------------------------------------------------------


def test_install_without_crash_installs_exactly_the_survivors(
    template: Template, tmp_path: Path
) -> None:
    path, staging = template.copy(tmp_path / "store")
    commit.install(path, staging, template.results, template.read)
    assert not staging.exists()
    assert _listing(path / MESSAGES_DIR) == template.new_files
    with MessageStore.open(path, read_only=True) as store:
        assert all_messages(store) == template.after
        chunks = {c.path.name: c for c in store._messages}
        for result in template.results:
            chunk = chunks[result.file_name]
            assert chunk.header.compacted
            assert (chunk.start_number, chunk.end_number) == (
                result.start_number,
                result.end_number,
            )
            assert chunk.record_count == result.records_kept
    _check_recovered(template, path, True, "installed in-process")


def test_uncommitted_staging_is_removed_at_the_next_writable_open(
    template: Template, tmp_path: Path
) -> None:
    """A crash during pass 2: staged chunk files (one torn), no manifest."""
    path, staging = template.copy(tmp_path / "store")
    torn = staging / template.results[-1].file_name
    torn.write_bytes(torn.read_bytes()[: torn.stat().st_size // 2])
    # A read-only open changes nothing, and sees the old chunks.
    with MessageStore.open(path, read_only=True) as store:
        assert all_messages(store) == template.before
    assert staging.is_dir()
    # While a job is running (its lock held), the staging may be that job's: kept.
    with commit.job_lock(path), MessageStore.open(path) as store:
        assert store.recovery.compactions == []
        assert all_messages(store) == template.before
    assert staging.is_dir()
    _check_recovered(template, path, False, "uncommitted staging")
    assert not staging.exists()


def _number(name: str) -> int:
    parsed = parse_chunk_file_name(name)
    assert parsed is not None
    return parsed[0]


def test_install_leaves_out_what_retention_removed_and_installs_the_rest(
    template: Template, tmp_path: Path
) -> None:
    """Retention deleted the first chunk the job read (review17 R17-5: nothing was
    installed): the replacement covering it is not installed (it would bring back what
    retention removed), nor one needing it; the others are, and the manifest names only
    them."""
    path, staging = template.copy(tmp_path / "store")
    first = min(template.read)
    assert parse_chunk_file_name(first) == (0, 0)
    (path / MESSAGES_DIR / first).unlink()
    manifests: list[dict[str, Any]] = []
    real_apply = commit._apply

    def apply(store: Path, staged: Path) -> None:
        manifests.append(read_json(staged / commit.MANIFEST_FILE))
        real_apply(store, staged)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(commit, "_apply", apply)
        outcome = commit.install(path, staging, template.results, template.read, template.needs)
    assert outcome.gone == [first]
    assert outcome.dropped and outcome.dropped[0] == template.results[0]
    assert outcome.dropped[0].start_number == 0 < outcome.dropped[0].end_number  # a merge
    assert outcome.installed == [r for r in template.results if r not in outcome.dropped]
    assert outcome.installed  # the rest: installed
    [manifest] = manifests
    assert [r["file_name"] for r in manifest["install"]] == [r.file_name for r in outcome.installed]
    dropped_chunks = {n for r in outcome.dropped for n in range(r.start_number, r.end_number + 1)}
    left = [n for n in template.read if _number(n) not in dropped_chunks]
    assert manifest["replaces"] == sorted(left)
    assert not staging.exists()
    listing = _listing(path / MESSAGES_DIR)
    # The chunks of the dropped replacement stay as they were, but the removed one: no
    # version of chunk 0 came back.
    assert listing == (template.new_files - {r.file_name for r in outcome.dropped}) | {
        n for n in template.read if _number(n) in dropped_chunks
    } - {first}
    assert not [n for n in listing if _number(n) == 0]
    with MessageStore.open(path) as store:
        assert store.recovery.compactions == []
        assert all_messages(store) == {
            p: m
            for p, m in template.before.items()
            if p >= CHUNK_DATA_SIZE
            and (p not in template.removed or p // CHUNK_DATA_SIZE in dropped_chunks)
        }
    assert Verifier(path).run() == []


def test_install_refuses_when_a_chunk_it_read_is_gone_other_than_by_retention(
    template: Template, tmp_path: Path
) -> None:
    """A chunk file gone from the middle (a hand; chunks before it are still there):
    nothing is installed, and the message names the file."""
    path, staging = template.copy(tmp_path / "store")
    middle = sorted(template.read)[2]
    (path / MESSAGES_DIR / middle).unlink()
    staged = {p.name: p.read_bytes() for p in staging.iterdir()}
    with pytest.raises(CompactionError, match="not by retention") as caught:
        commit.install(path, staging, template.results, template.read, template.needs)
    assert f"1 chunk file ({middle})" in str(caught.value)
    assert {p.name: p.read_bytes() for p in staging.iterdir()} == staged  # no manifest
    assert _listing(path / MESSAGES_DIR) == template.old_files - {middle}
    assert not (commit.compaction_dir(path) / commit.INSTALLED_FILE).exists()


# --- a committed manifest that does not hold up (review f F3, F5) -----------------------


def _plain_store(path: Path) -> set[str]:
    """A store of a few plain chunks; its chunk file names."""
    config = StoreConfig(chunk_data_size=CHUNK_DATA_SIZE, queue_chunk_records=1024)
    with MessageStore.open(path, config) as store:
        store.create_topic(PLAIN, 1)
        for i in range(400):
            store.send(PLAIN, _body(i))
        store.flush()
    return _listing(path / MESSAGES_DIR)


def _store_state(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in (path / MESSAGES_DIR).iterdir()}


def _committed_staging(path: Path, install: list[dict[str, object]], replaces: list[str]) -> Path:
    staging = commit.new_staging(path)
    write_json(staging / commit.MANIFEST_FILE, {"install": install, "replaces": replaces})
    return staging


def test_a_committed_manifest_whose_replacement_is_missing_deletes_nothing(
    tmp_path: Path,
) -> None:
    """The manifest names a replacement that is neither staged nor installed: the chunk
    it 'replaces' must stay (it was deleted, and the store no longer opened)."""
    path = tmp_path / "store"
    files = _plain_store(path)
    assert "chunk-000000000002.0000" in files
    before = _store_state(path)
    messages = _pullable(path)
    staging = _committed_staging(
        path, [{"file_name": "chunk-000000000002.0001"}], ["chunk-000000000002.0000"]
    )
    for attempt in (
        lambda: commit.recover(path, holding_job_lock=True),  # as a job does first
        lambda: MessageStore.open(path).close(),
    ):
        with pytest.raises(CorruptionError) as caught:
            attempt()
        text = str(caught.value)
        assert "chunk-000000000002.0001" in text and str(staging / commit.MANIFEST_FILE) in text
        assert "move the staging directory out of compaction/" in text
        assert _store_state(path) == before
        assert (staging / commit.MANIFEST_FILE).exists()
    # The remedy works: with the staging directory moved out, every message is there.
    staging.rename(tmp_path / "moved-out")
    with MessageStore.open(path) as store:
        assert all_messages(store) == messages


def test_a_committed_manifest_whose_replacement_does_not_cover_what_it_replaces(
    tmp_path: Path,
) -> None:
    """An installed file of a lower version, or of another chunk range, is no
    replacement: nothing is renamed or deleted."""
    path = tmp_path / "store"
    _plain_store(path)
    before = _store_state(path)
    staged = (path / MESSAGES_DIR / "chunk-000000000001.0000").read_bytes()
    cases: list[tuple[dict[str, object], str]] = [
        ({"file_name": "chunk-000000000001.0001", "end_number": 1}, "chunk-000000000002.0000"),
        ({"file_name": "chunk-000000000002.0000"}, "chunk-000000000002.0000"),
    ]
    for install, replaces in cases:
        staging = _committed_staging(path, [install], [replaces])
        (staging / str(install["file_name"])).write_bytes(staged)
        with pytest.raises(CorruptionError, match="covers that chunk"):
            commit.recover(path, holding_job_lock=True)
        assert _store_state(path) == before
        shutil.rmtree(staging)


def test_an_unreadable_manifest_names_the_remedy(tmp_path: Path) -> None:
    path = tmp_path / "store"
    _plain_store(path)
    before = _store_state(path)
    staging = commit.new_staging(path)
    (staging / commit.MANIFEST_FILE).write_text('{"body": {"install": [}')
    with pytest.raises(CorruptionError) as caught:
        MessageStore.open(path).close()
    assert str(staging / commit.MANIFEST_FILE) in str(caught.value)
    assert "move the staging directory out of compaction/" in str(caught.value)
    assert _store_state(path) == before


def test_verify_reports_what_every_writable_open_would_refuse_in_compaction(
    tmp_path: Path,
) -> None:
    """verify said "No problems found" while every writable open refused (review f F5)."""
    path = tmp_path / "store"
    _plain_store(path)
    assert Verifier(path).run() == []
    uncommitted = commit.new_staging(path)  # a job's, or a crash's: the next open removes it
    (uncommitted / "chunk-000000000001.0001").write_bytes(b"partial")
    assert Verifier(path).run() == []
    missing = _committed_staging(
        path, [{"file_name": "chunk-000000000002.0001"}], ["chunk-000000000002.0000"]
    )
    unreadable = commit.new_staging(path)
    (unreadable / commit.MANIFEST_FILE).write_text('{"body": {"install": [}')
    link = commit.compaction_dir(path) / "20261127T000000-deadbeef"
    link.symlink_to(tmp_path)
    problems = Verifier(path).run()
    assert sorted((p.kind, p.file) for p in problems) == sorted(
        [
            ("compaction staging", str(missing / commit.MANIFEST_FILE)),
            ("compaction staging", str(unreadable / commit.MANIFEST_FILE)),
            ("compaction staging", str(link)),
        ]
    )
    reasons = " ".join(p.reason for p in problems)
    assert "chunk-000000000002.0001" in reasons and "symbolic link" in reasons
    assert reasons.count("move the staging directory out of compaction/") == 2
