"""``delete_topic``: files, offsets and keys of the topic go, a topic created again under
the name starts empty, recovery neither re-queues nor reports the deleted topic's log
records, and a SIGKILL after any file-system call of a deletion leaves the old topic or
none of it (tests/delete_topic_child.py)."""

from __future__ import annotations

import contextlib
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from code_paths import code_path  # noqa: F401 - the fixture
from fork_child import ForkServer
from store_helpers import snapshot

from equeue import MessageStore, ReadOnlyError, StoreConfig, TopicNotFoundError
from equeue.cli import main
from equeue.store import validate

CONFIG = StoreConfig(chunk_data_size=64 * 1024, queue_chunk_records=400, flush="os")


def _fill(path: Path) -> None:
    with MessageStore.open(path, CONFIG) as store:
        store.create_topic("gone", 2)
        store.create_topic("kept", 1)
        for i in range(20):
            store.send("gone", b"old %d" % i, key=f"k{i % 3}", queue_id=i % 2)
            store.send("kept", b"kept %d" % i, key="k0")
        store.commit_offset("g", "gone", 0, 4)
        store.commit_offset("g", "kept", 0, 7)
        store.commit_offset("h", "gone", 1, 2)
    # A group file, consumers/c.json, written by a consumer loop of a read-only handle.
    with (
        MessageStore.open(path, read_only=True) as reader,
        reader.consumer("c", "gone", timeout=0) as consumer,
    ):
        assert len(list(consumer)) == 20


def _bodies(store: MessageStore, topic: str) -> list[bytes]:
    return [m.body for q in store.queue_ids(topic) for m in store.pull(topic, q, 0, 1000)]


def _check_kept(store: MessageStore) -> None:
    assert _bodies(store, "kept") == [b"kept %d" % i for i in range(20)]
    assert store.committed_offset("g", "kept", 0) == 7
    assert len(store.query_by_key("kept", "k0", 100)) == 20


def _check_gone_or_whole(store: MessageStore) -> bool:
    """True if the topic is gone, False if whole; anything in between fails."""
    assert not store.recovery.problems, store.recovery.problems
    _check_kept(store)
    if "gone" in store.topics():
        assert sorted(_bodies(store, "gone")) == sorted(b"old %d" % i for i in range(20))
        assert store.committed_offset("g", "gone", 0) == 4
        assert store.committed_offset("h", "gone", 1) == 2
        assert store.consumer_groups()["c"] == {"gone": {0: 10, 1: 10}}
        return False
    assert not (store.path / "queues" / "gone").exists()
    assert "gone" not in str(store.consumer_groups())
    with pytest.raises(TopicNotFoundError):
        store.pull("gone", 0, 0)
    return True


def _check_created_again(store: MessageStore) -> None:
    store.create_topic("gone", 1)
    store.send("gone", b"new", key="k0")
    assert _bodies(store, "gone") == [b"new"]
    assert [m.body for m in store.query_by_key("gone", "k0", 100)] == [b"new"]
    assert store.committed_offset("g", "gone", 0) is None
    assert store.committed_offset("c", "gone", 0) is None  # the group file forgot it too
    with store.consumer("c", "gone", timeout=0) as consumer:  # so it reads the new one
        assert [m.body for m in consumer] == [b"new"]


@pytest.mark.usefixtures("code_path")
def test_delete_topic_and_create_it_again(tmp_path: Path) -> None:
    path = tmp_path / "s"
    _fill(path)
    with MessageStore.open(path) as store:
        store.delete_topic("gone")
        assert _check_gone_or_whole(store)
        with pytest.raises(TopicNotFoundError):
            store.delete_topic("gone")
        _check_created_again(store)
    with MessageStore.open(path) as store:  # the old records are neither queued nor reported
        assert store.recovery.clean, store.recovery
        assert _bodies(store, "gone") == [b"new"]
        assert [m.body for m in store.query_by_key("gone", "k0", 100)] == [b"new"]
        _check_kept(store)


@pytest.mark.parametrize("again", [0, 1, 3], ids=["deleted", "again-fewer", "again-as-many"])
def test_verify_leaves_a_deleted_topics_records_alone(
    tmp_path: Path, again: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """A deleted topic's records stay in the log until retention: `equeue verify` skips
    them as recovery does (before the fix: "belongs to queue gone/1, which the store
    lacks", and with the topic created again, queue directories "deleted" under it)."""
    path = tmp_path / "s"
    _fill(path)
    with MessageStore.open(path) as store:
        store.delete_topic("gone")
        if again:
            store.create_topic("gone", again)
            store.send("gone", b"new", queue_id=again - 1)
    capsys.readouterr()
    assert main(["verify", str(path)]) == 0, capsys.readouterr().out
    # The control: a queue of the live topic whose entries are gone is still found.
    if again:
        for chunk in (path / "queues" / "gone" / str(again - 1)).glob("chunk-*"):
            chunk.unlink()
        assert main(["verify", str(path)]) == 1


@pytest.mark.usefixtures("code_path")
def test_recovery_skips_a_deleted_topics_records_after_a_crash(
    tmp_path: Path, forks: ForkServer
) -> None:
    """The deleted topic's records lie past the last checkpoint (the child writes none),
    and the process is killed when the deletion is done: re-dispatch reads them, and
    must neither queue them (into the topic created again) nor report them."""
    path = tmp_path / "s"
    _fill(path)
    run = _run(forks, path, "after", 10_000, 5)
    assert run.returncode == -9 and "DONE" in run.stdout  # killed once it was done
    with MessageStore.open(path) as store:
        assert store.recovery.start_position < store._deleted["gone"]  # they are re-read
        assert _check_gone_or_whole(store)
        _check_created_again(store)
        store.send_batch("gone", [b"later"] * 3)
    with MessageStore.open(path) as store:
        assert not store.recovery.problems
        assert _bodies(store, "gone") == [b"new"] + [b"later"] * 3
        assert [m.body for m in store.query_by_key("gone", "k0", 100)] == [b"new"]


def test_a_read_only_handle_follows_a_deletion(tmp_path: Path) -> None:
    path = tmp_path / "s"
    _fill(path)
    with MessageStore.open(path) as writer, MessageStore.open(path, read_only=True) as reader:
        assert len(reader.pull("gone", 0, 0, 100)) == 10  # control
        writer.delete_topic("gone")
        reader.refresh()
        assert reader.topics() == ["kept"]
        with pytest.raises(TopicNotFoundError):
            reader.pull("gone", 0, 0)
        writer.create_topic("gone", 1)
        writer.send("gone", b"new", key="k0")
        writer.flush()
        reader.refresh()
        assert [m.body for m in reader.pull("gone", 0, 0, 100)] == [b"new"]
        assert [m.body for m in reader.query_by_key("gone", "k0")] == [b"new"]
        _check_kept(reader)


def test_delete_topic_refusals(tmp_path: Path) -> None:
    path = tmp_path / "s"
    _fill(path)
    before = snapshot(path)
    with MessageStore.open(path, read_only=True) as reader, pytest.raises(ReadOnlyError):
        reader.delete_topic("gone")
    assert snapshot(path) == before
    with MessageStore.open(path) as store:
        opened = snapshot(path)  # (the writable open's own writes, its file made ahead)
        with pytest.raises(TopicNotFoundError):
            store.delete_topic("never")
        assert snapshot(path) == opened
        assert store.topics() == ["gone", "kept"]  # control: nothing changed


def _run(
    forks: ForkServer, path: Path, mode: str, k: int, sends: int = 0
) -> subprocess.CompletedProcess[str]:
    argv = [str(path), mode, str(k)] + ([str(sends)] if sends else [])
    proc = forks.run("delete_topic_child", argv, timeout=60)
    assert proc.returncode in (0, -9), proc.stderr
    return proc


def _calls(forks: ForkServer, tmp_path: Path, path: Path) -> list[str]:
    """The deletion's file-system calls, as a copy of the store shows them."""
    import shutil

    copy = tmp_path / "count"
    shutil.copytree(path, copy)
    run = _run(forks, copy, "never", 0)
    shutil.rmtree(copy)
    assert "DONE" in run.stdout
    return [
        line.split(" ", 3)[3].replace(str(copy), str(path))
        for line in run.stdout.splitlines()
        if line[:5] == "CALL "
    ]


def test_sigkill_at_each_step_of_a_deletion(tmp_path: Path, forks: ForkServer) -> None:
    template = tmp_path / "template"
    _fill(template)
    calls = _calls(forks, tmp_path, template)
    assert any(c.endswith("topics.journal") for c in calls)  # the commit point: its fdatasync
    assert any("offsets.json" in c for c in calls)
    outcomes: dict[bool, int] = {True: 0, False: 0}
    import shutil

    for k in range(len(calls) + 1):
        path = tmp_path / f"k{k}"
        shutil.copytree(template, path)
        mode, at = ("before", 1) if k == 0 else ("after", k)
        run = _run(forks, path, mode, at)
        assert run.returncode == -9, (k, run.stdout[-500:])
        with MessageStore.open(path) as store:
            gone = _check_gone_or_whole(store)
            outcomes[gone] += 1
            if gone:
                _check_created_again(store)
        with MessageStore.open(path) as store:  # and again, clean
            assert not store.recovery.problems, (k, store.recovery.problems)
            if gone:
                assert _bodies(store, "gone") == [b"new"]
        shutil.rmtree(path)
    assert outcomes[True] and outcomes[False]  # both sides of the commit point were hit
    args: Any = (len(calls), outcomes)
    print("calls, outcomes:", *args)


def test_a_send_that_waited_for_the_lock_through_a_deletion(tmp_path: Path) -> None:
    """A send holds the topic's queues while it waits for the write lock; if the topic
    was deleted meanwhile, it writes nothing into the closed queues."""
    path = tmp_path / "s"
    _fill(path)
    with MessageStore.open(path) as store:
        stale = store._queues["gone"]
        store.delete_topic("gone")
        end = store._messages.committed_position
        fields = validate.check_message(store.config, "gone", 2, b"late", "", None, None, 0, None)
        with pytest.raises(TopicNotFoundError, match="deleted while this send waited"):
            store._store("gone", stale, [fields])
        assert store._messages.committed_position == end  # nothing written
        assert store.topics() == ["kept"]


@pytest.mark.usefixtures("code_path")
def test_sends_racing_a_deletion(tmp_path: Path) -> None:
    path = tmp_path / "s"
    _fill(path)
    outcomes: list[str] = []
    with MessageStore.open(path) as store:
        stop = threading.Event()

        def send() -> None:
            while not stop.is_set():
                try:
                    store.send("gone", b"racing", queue_id=0)
                    outcomes.append("sent")
                except TopicNotFoundError:
                    outcomes.append("refused")

        thread = threading.Thread(target=send)
        thread.start()
        time.sleep(0.05)
        store.delete_topic("gone")
        time.sleep(0.05)
        stop.set()
        thread.join()
        # the sends after the deletion created the topic again, with only their messages
        assert outcomes.count("sent") >= 1
        racing = [m.body for q in store.queue_ids("gone") for m in store.pull("gone", q, 0, 10**5)]
        assert set(racing) <= {b"racing"}
        _check_kept(store)
    with MessageStore.open(path) as store:
        assert not store.recovery.problems


def test_a_pull_waiting_through_a_deletion_fails(tmp_path: Path) -> None:
    """A pull waiting on a queue that delete_topic closed returned that queue's offsets
    once a send to the topic created again woke it: a caller going on from there skipped
    the new topic's first messages. It raises TopicNotFoundError now."""
    path = tmp_path / "s"
    _fill(path)
    with MessageStore.open(path) as store:
        end = store.queue_range("gone", 0)[1]
        outcome: list[object] = []

        def wait() -> None:
            try:
                outcome.append(store.pull("gone", 0, end, wait=30))
            except TopicNotFoundError as exc:
                outcome.append(exc)

        waiter = threading.Thread(target=wait)
        waiter.start()
        while not store._waiting:  # the pull is waiting
            time.sleep(0.001)
        store.delete_topic("gone")
        store.create_topic("gone", 1)
        store.send("gone", b"new", queue_id=0)
        waiter.join(timeout=30)
        assert len(outcome) == 1 and isinstance(outcome[0], TopicNotFoundError), outcome
        assert [m.body for m in store.pull("gone", 0, 0)] == [b"new"]  # the control


@pytest.mark.parametrize("read_only", [False, True], ids=["writer's handle", "read-only"])
def test_a_consumer_open_through_a_deletion_starts_the_new_topic_over(
    tmp_path: Path, read_only: bool
) -> None:
    """A consumer that read the old topic committed its offsets again after the deletion
    (the group file forgot them, the consumer did not), so it and every later consumer of
    the group skipped the re-created topic's first messages."""
    path = tmp_path / "s"
    with MessageStore.open(path, CONFIG) as store:
        store.create_topic("t", 1)
        for i in range(10):
            store.send("t", b"old %d" % i)
        with contextlib.ExitStack() as stack:
            handle = (
                stack.enter_context(MessageStore.open(path, read_only=True)) if read_only else store
            )
            consumer = stack.enter_context(handle.consumer("g", "t", timeout=0))
            assert len(consumer.poll(10)) == 10
            store.delete_topic("t")
            store.create_topic("t", 1)
            for i in range(3):
                store.send("t", b"new %d" % i)
            if read_only:
                handle.refresh()  # a reader learns of the deletion here, or at its next open
            assert [m.body for m in consumer.poll(10)] == [b"new 0", b"new 1", b"new 2"]
        assert store.consumer_groups()["g"] == {"t": {0: 3}}  # the old topic's 10 is gone
        with store.consumer("g", "t", timeout=0) as later:
            store.send("t", b"new 3")
            assert [m.body for m in later] == [b"new 3"]
