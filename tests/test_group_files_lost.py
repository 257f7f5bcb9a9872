"""review17 R17-9: a consumer group file deleted from outside (``consumers/GROUP.json``,
where the consumer loop, the broker and ``commit_offset`` of a group commit) is reported
by ``equeue verify`` (exit 1), ``equeue inspect`` and every open, as a lost
``offsets.json`` is: the checkpoint records which group files exist (``group_files``,
equeue/store/grouprecord.py). Controls: the sound store, a store after ``delete_group``,
and a store whose checkpoint an older equeue wrote (no record) report nothing; a
read-only process beside a writer that makes and deletes groups never reports one."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from fork_child import ForkServer
from server_helpers import short_home

import equeue
from equeue import MessageStore, StoreConfig
from equeue.atomicfile import read_json, write_json
from equeue.cli import main
from equeue.client.consumer import GroupConsumer
from equeue.inspect import intents
from equeue.server import BrokerThread
from equeue.store import groupdeletion, grouprecord
from equeue.store.meta import CHECKPOINT_FILE, CONSUMERS_DIR
from equeue.store.offsets import file_name

CONFIG = StoreConfig(flush="os", default_queue_count=2)
LONG = "g" * 200 + "\u00e9"  # a file name ending in a hash: its group is read from the file


def build(path: Path) -> None:
    """Group grp commits through a read-only handle's consumer loop (its file), billing
    through commit_offset (offsets.json), LONG through a consumer too."""
    with MessageStore.open(path, CONFIG) as store:
        store.create_topic("orders", 2)
        for i in range(20):
            store.send("orders", b"m%d" % i, queue_id=i % 2)
        store.commit_offset("billing", "orders", 0, 10)
    with MessageStore.open(path, read_only=True) as reader:
        for group in ("grp", LONG):
            with reader.consumer(group, "orders", timeout=0) as consumer:
                assert len([m for m, _ in zip(consumer, range(7), strict=False)]) == 7
    with MessageStore.open(path, CONFIG):  # its checkpoint records the group files
        pass


def run(*argv: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue() + err.getvalue()


def assert_clean(path: Path) -> None:
    code, output = run("verify", str(path))
    assert code == 0 and output.endswith("No problems found.\n"), output


def missing_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "is missing" in line and CONSUMERS_DIR in line]


@pytest.fixture
def store_path(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> Path:
    """A copy, for the test to damage, of the store build() makes once a session."""
    template = tmp_path_factory.getbasetemp() / "groupfiles-template"
    if not template.exists():  # (built aside, then renamed: never half a template)
        building = tmp_path_factory.mktemp("groupfiles-building") / "store"
        build(building)
        building.rename(template)
    return Path(shutil.copytree(template, tmp_path / "store", symlinks=True))


def test_the_checkpoint_records_the_group_files(store_path: Path) -> None:
    body = read_json(store_path / CHECKPOINT_FILE)
    assert body[grouprecord.GROUP_FILES_KEY] == sorted(["grp", LONG])


def test_the_sound_store_reports_nothing(store_path: Path) -> None:
    assert_clean(store_path)
    code, output = run("inspect", str(store_path))
    assert code == 0 and "Problems" not in output, output
    for read_only in (True, False):
        with MessageStore.open(store_path, read_only=read_only) as store:
            assert store.recovery.problems == [], store.recovery.problems


@pytest.mark.parametrize("group", ["grp", LONG])
def test_a_deleted_group_file_is_reported_by_verify_inspect_and_the_opens(
    store_path: Path, group: str
) -> None:
    lost = store_path / CONSUMERS_DIR / file_name(group)
    lost.unlink()
    code, output = run("verify", str(store_path))
    assert code == 1, output
    assert [str(lost) in line for line in missing_lines(output)] == [True], output
    code, output = run("inspect", str(store_path))
    assert code == 0 and "Problems noticed" in output, output
    assert len(missing_lines(output)) == 1, output
    code, output = run("inspect", "--json", str(store_path))
    problems = json.loads(output)["problems"]
    assert [p["file"] for p in problems] == [str(lost)], problems
    with MessageStore.open(store_path, read_only=True) as reader:
        said = [p for p in reader.recovery.problems if str(lost) in p]
        assert len(said) == 1 and "were lost" in said[0] and "commit_offset" in said[0], said
    with MessageStore.open(store_path, CONFIG) as writer:
        said = [p for p in writer.recovery.problems if str(lost) in p]
        assert len(said) == 1 and repr(group) in said[0], writer.recovery.problems
        # nothing made up: the group's offsets are gone, offsets.json's billing stays
        assert writer.committed_offset(group, "orders", 0) is None
        assert writer.committed_offset("billing", "orders", 0) == 10
        assert not lost.exists()
    # reported once: the writer's checkpoint records the store as it now is
    assert_clean(store_path)
    with MessageStore.open(store_path, CONFIG) as writer:
        assert writer.recovery.problems == []


def test_a_deleted_consumers_directory_is_reported_for_each_group(store_path: Path) -> None:
    for entry in (store_path / CONSUMERS_DIR).iterdir():
        entry.unlink()
    (store_path / CONSUMERS_DIR).rmdir()
    code, output = run("verify", str(store_path))
    assert code == 1 and len(missing_lines(output)) == 2, output
    with MessageStore.open(store_path, CONFIG) as writer:
        assert len([p for p in writer.recovery.problems if "is missing" in p]) == 2


def test_delete_group_is_no_loss(store_path: Path) -> None:
    with MessageStore.open(store_path, CONFIG) as store:
        store.delete_group("grp")
        # read beside the writer (the record dropped grp before the file went)
        assert_clean(store_path)
        with MessageStore.open(store_path, read_only=True) as reader:
            assert reader.recovery.problems == []
    assert_clean(store_path)
    with MessageStore.open(store_path, CONFIG) as store:
        assert store.recovery.problems == []
    assert read_json(store_path / CHECKPOINT_FILE)[grouprecord.GROUP_FILES_KEY] == [LONG]


def test_a_deletion_between_the_record_and_the_listing_is_no_loss(
    store_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """verify reads the checkpoint (grp recorded), then delete_group drops grp from the
    record and removes its file, then verify looks for the file: the record read again
    after the look no longer names it."""
    with MessageStore.open(store_path, CONFIG) as store:
        here = grouprecord._here
        deleted: list[object] = []

        def delete_first(directory: Path, group: str, copies: set[str]) -> bool:
            if not deleted:
                deleted.append(store.delete_group("grp"))
            return here(directory, group, copies)

        monkeypatch.setattr(grouprecord, "_here", delete_first)
        assert_clean(store_path)
        assert deleted and not (store_path / CONSUMERS_DIR / file_name("grp")).exists()


def test_a_damaged_group_file_set_aside_is_not_reported_as_missing(store_path: Path) -> None:
    path = store_path / CONSUMERS_DIR / file_name("grp")
    path.write_bytes(b"{not json")
    with MessageStore.open(store_path, CONFIG) as writer:  # moves it to consumers/recovered/
        assert [p for p in writer.recovery.problems if "moved to" in p]
        assert not [p for p in writer.recovery.problems if "is missing" in p]
    assert not path.exists()
    _, output = run("verify", str(store_path))
    assert not missing_lines(output), output


def test_a_checkpoint_without_the_record_opens_and_verifies_clean(store_path: Path) -> None:
    """A checkpoint an equeue before the record wrote: nothing to compare with."""
    path = store_path / CHECKPOINT_FILE
    body = read_json(path)
    del body[grouprecord.GROUP_FILES_KEY]
    write_json(path, body)
    assert_clean(store_path)
    for read_only in (True, False):
        with MessageStore.open(store_path, read_only=read_only) as store:
            assert store.recovery.problems == []
    assert grouprecord.GROUP_FILES_KEY in read_json(path)  # the writer's checkpoint has it


@pytest.mark.parametrize(
    "record", [[""], "grp", [7], [None], ["x" * 300], ["grp", "grp"]], ids=repr
)
def test_a_record_no_equeue_writes_is_reported_and_ignored(
    store_path: Path, record: object
) -> None:
    path = store_path / CHECKPOINT_FILE
    write_json(path, read_json(path) | {grouprecord.GROUP_FILES_KEY: record})
    code, output = run("verify", str(store_path))
    assert code == 1 and grouprecord.GROUP_FILES_KEY in output, output
    assert not missing_lines(output), output
    with MessageStore.open(store_path, read_only=True) as reader:
        assert [p for p in reader.recovery.problems if grouprecord.GROUP_FILES_KEY in p]
    with MessageStore.open(store_path, CONFIG) as writer:
        assert [p for p in writer.recovery.problems if grouprecord.GROUP_FILES_KEY in p]
    assert_clean(store_path)


def test_a_recorded_name_that_is_a_path_is_looked_for_as_its_escaped_file(
    store_path: Path,
) -> None:
    """A group name is any str (commit_offset takes "../../evil"): its file's name is
    escaped, and that is what the record's name is looked for as, nothing outside."""
    path = store_path / CHECKPOINT_FILE
    write_json(path, read_json(path) | {grouprecord.GROUP_FILES_KEY: ["../../evil", "grp"]})
    (store_path.parent / "evil.json").write_bytes(b"outside")
    code, output = run("verify", str(store_path))
    escaped = store_path / CONSUMERS_DIR / "..%2F..%2Fevil.json"
    assert code == 1 and [str(escaped) in line for line in missing_lines(output)] == [True]


WRITER = textwrap.dedent(
    """
    import sys, time
    from equeue import MessageStore, StoreConfig
    path, rounds = sys.argv[1], int(sys.argv[2])
    with MessageStore.open(path, StoreConfig(flush="os")) as store:
        print("READY", flush=True)
        for n in range(rounds):
            group = f"churn{n % 3}"
            with store.consumer(group, "orders", timeout=0) as consumer:
                next(iter(consumer))
            store.flush()  # a checkpoint naming the group's file
            store.delete_group(group)
            store.flush()
    print("DONE", flush=True)
    """
)


def test_a_reader_beside_a_writer_making_and_deleting_groups_reports_none(
    store_path: Path,
) -> None:
    """Another process makes a group (its file, then a checkpoint naming it) and deletes
    it, 150 times; verify and read-only opens beside it, bounded in count and time, never
    report a group file missing."""
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(store_path), "150"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        assert writer.stdout is not None and writer.stdout.readline() == "READY\n"
        deadline, runs = time.monotonic() + 60, 0
        while writer.poll() is None and runs < 200 and time.monotonic() < deadline:
            code, output = run("verify", str(store_path))
            assert code == 0 and not missing_lines(output), output
            with MessageStore.open(store_path, read_only=True) as reader:
                said = [p for p in reader.recovery.problems if CONSUMERS_DIR in p]
                assert not said, said
            runs += 1
        out, err = writer.communicate(timeout=120)
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    assert writer.returncode == 0 and "DONE" in out, err
    assert runs >= 5, runs
    assert_clean(store_path)


def test_a_sigkill_after_any_call_of_delete_group_reports_no_lost_group_file(
    tmp_path: Path, forks: ForkServer
) -> None:
    """Group g has a file only (no copy set aside, which would excuse its absence):
    a child deleting it is SIGKILLed after each file-system call in turn; verify, then a
    read-only and a writable open, report no lost group file, before the deletion's
    commit point (g whole) or after it (g gone)."""
    template = tmp_path / "template"
    with MessageStore.open(template, CONFIG) as store:
        store.create_topic("t", 1)
        for i in range(5):
            store.send("t", b"m%d" % i)
    with (
        MessageStore.open(template, read_only=True) as reader,
        reader.consumer("g", "t", timeout=0) as consumer,
    ):
        assert len([m for m, _ in zip(consumer, range(3), strict=False)]) == 3
    with MessageStore.open(template, CONFIG):
        pass
    assert read_json(template / CHECKPOINT_FILE)[grouprecord.GROUP_FILES_KEY] == ["g"]
    counted = tmp_path / "counted"
    shutil.copytree(template, counted)
    full = forks.run("group_delete_child", [str(counted), "never", "0"], timeout=60)
    assert full.returncode == 0 and "DONE" in full.stdout, full.stderr
    calls = [line for line in full.stdout.splitlines() if line.startswith("CALL ")]
    gone = []
    for k in range(1, len(calls) + 1):
        path = tmp_path / f"k{k}"
        shutil.copytree(template, path)
        run_k = forks.run("group_delete_child", [str(path), "after", str(k)], timeout=60)
        assert run_k.returncode == -9, (k, run_k.returncode, run_k.stderr)
        _, output = run("verify", str(path))
        assert not missing_lines(output), (k, calls[k - 1], output)
        for read_only in (True, False):
            with MessageStore.open(path, CONFIG, read_only=read_only) as store:
                said = [p for p in store.recovery.problems if "is missing" in p]
                assert not said, (k, calls[k - 1], said)
                if not read_only:
                    gone.append(store.committed_offset("g", "t", 0) is None)
    assert gone == sorted(gone) and gone[0] is False and gone[-1] is True, gone


home = pytest.fixture(short_home, name="home")


def test_the_brokers_groups_are_recorded_and_their_loss_reported(home: Path) -> None:
    """Groups committing through ``equeue serve`` (a BrokerThread) write group files as
    consumer loops do: the broker's checkpoint names them; one deleted through the broker
    is no loss, one deleted from outside afterwards is reported."""
    path = home / "s"
    with MessageStore.open(path, CONFIG) as store:
        store.create_topic("t", 2)
        for i in range(6):
            store.send("t", b"m%d" % i, queue_id=i % 2)
    with BrokerThread(path) as running, equeue.connect(running.urls[0]) as client:
        for group in ("kept", "dropped"):
            consumer = GroupConsumer(client, group, ["t"], session_timeout=10.0)
            assert all(consumer.poll(5.0) is not None for _ in range(6))
            consumer.commit()
            consumer.close()
        running.store.flush()  # the broker's checkpoint, naming both
        assert {"kept", "dropped"} <= set(
            read_json(path / CHECKPOINT_FILE)[grouprecord.GROUP_FILES_KEY]
        )
        assert client.delete_group("dropped").group == "dropped"
        code, output = run("verify", str(path))  # beside the broker
        assert code == 0 and not missing_lines(output), output
    assert_clean(path)
    recorded = read_json(path / CHECKPOINT_FILE)[grouprecord.GROUP_FILES_KEY]
    assert "kept" in recorded and "dropped" not in recorded
    (path / CONSUMERS_DIR / file_name("kept")).unlink()
    code, output = run("verify", str(path))
    assert code == 1 and len(missing_lines(output)) == 1 and "'kept'" in output, output


def test_an_intent_finished_between_verifys_listing_and_its_read_is_no_problem(
    store_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by the test above (1 run in ~4): a writer's delete_group unlinks its intent
    file last, after verify listed consumers/recovered/ and before it read the file;
    verify reported "[Errno 2] No such file or directory" as an intent it cannot act on."""
    side = store_path / CONSUMERS_DIR / "recovered"
    side.mkdir()
    intent = side / f"{file_name('grp')}.1795834291535179671.deleting"
    write_json(intent, {"group": "grp", "offsets": {}, "deleting": {"dead_letters": False}})
    read = groupdeletion.read_intent

    def finished_first(path: Path, entry: str) -> object:
        path.unlink()  # the writer's _finish, between the listing and the read
        return read(path, entry)

    monkeypatch.setattr(intents, "read_intent", finished_first)
    assert_clean(store_path)
    assert not intent.exists()
