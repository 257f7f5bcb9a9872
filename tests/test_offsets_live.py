"""Group offsets at run time (review 37a A5, A7, L3): a group file damaged under a running
writer, what one ``committed_offset`` reads, and a reset killed between its two writes."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from server_helpers import short_home

import equeue
from equeue import MessageStore
from equeue.errors import CorruptionError, StorePathError
from equeue.server import BrokerThread
from equeue.server.offsetcommit import OffsetCommitter
from equeue.store import offsets as group_offsets
from equeue.store.meta import CONSUMERS_DIR, OFFSETS_FILE

BOUNDED = 60.0  # seconds: every subprocess and loop here


def _damage(path: Path) -> bytes:
    """A group file replaced by one whose checksum does not match (valid JSON)."""
    damaged = b'{"body": {"group": "g", "offsets": {}}, "xxh64": "0000000000000000"}'
    path.write_bytes(damaged)
    return damaged


def _recovered(store_path: Path) -> list[str]:
    side = store_path / CONSUMERS_DIR / "recovered"
    return sorted(os.listdir(side)) if side.is_dir() else []


# --- A5: a damaged group file under a running writer ---------------------------------


def test_a_writers_commit_moves_a_damaged_group_file_aside_and_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "s"
    with MessageStore.open(path) as store:
        store.create_topic("t", 2)
        for i in range(10):
            store.send("t", b"m%d" % i, queue_id=i % 2)
        group_offsets.commit_group(store, "g", {("t", 0): 3, ("t", 1): 4})
        assert store.committed_offset("g", "t", 1) == 4  # the handle has read the file
        damaged = _damage(path / CONSUMERS_DIR / "g.json")
        # Meanwhile its offsets as this handle last read them stand for it (reviewf F9: it
        # was ignored, and retention took the group for one that had committed nothing);
        # a read-only handle's commit is refused, file kept.
        assert store.committed_offset("g", "t", 0) == 3
        with (
            MessageStore.open(path, read_only=True) as reader,
            pytest.raises(CorruptionError, match="writer's next commit"),
        ):
            group_offsets.commit_group(reader, "g", {("t", 0): 5})
        assert (path / CONSUMERS_DIR / "g.json").read_bytes() == damaged
        with caplog.at_level(logging.WARNING, "equeue.consumer"):
            group_offsets.commit_group(store, "g", {("t", 0): 5})
        (moved,) = _recovered(path)
        assert moved.startswith("g.json.") and moved.endswith(".damaged")
        assert (path / CONSUMERS_DIR / "recovered" / moved).read_bytes() == damaged
        said = [r.getMessage() for r in caplog.records if "moved to" in r.getMessage()]
        assert len(said) == 1 and "from the 2 offsets this handle last read or wrote" in said[0], (
            said
        )
        # The commit merged with the last good offsets: t/1 kept, t/0 raised.
        assert store.consumer_groups() == {"g": {"t": {0: 5, 1: 4}}}
    with MessageStore.open(path) as store:
        assert store.recovery.problems == []
        assert store.consumer_groups() == {"g": {"t": {0: 5, 1: 4}}}


def test_a_reset_onto_a_damaged_group_file_is_not_undone_by_its_last_good_offsets(
    tmp_path: Path,
) -> None:
    path = tmp_path / "s"
    with MessageStore.open(path) as store:
        store.create_topic("t", 1)
        for i in range(10):
            store.send("t", b"m%d" % i)
        group_offsets.commit_group(store, "g", {("t", 0): 8})
        assert store.committed_offset("g", "t", 0) == 8
        _damage(path / CONSUMERS_DIR / "g.json")
        store.commit_offset("g", "t", 0, 2)
        assert store.committed_offset("g", "t", 0) == 2
        group_offsets.commit_group(store, "g", {("t", 0): 1})  # below: changes nothing
        assert store.committed_offset("g", "t", 0) == 2
        assert len(_recovered(path)) == 1
    with MessageStore.open(path) as store:
        assert store.committed_offset("g", "t", 0) == 2


def test_consumers_recovered_not_a_directory_is_refused_by_every_open(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with MessageStore.open(path) as store:
        store.create_topic("t", 1)
        group_offsets.commit_group(store, "g", {("t", 0): 0})
    (path / CONSUMERS_DIR / "recovered").write_text("x")
    for read_only in (True, False):
        with pytest.raises(StorePathError, match="consumers/recovered"):
            MessageStore.open(path, read_only=read_only)


broker_home = pytest.fixture(short_home, name="broker_home")


def _poll_all(consumer: Any, want: int, seconds: float) -> tuple[list[bytes], list[str]]:
    got: list[bytes] = []
    errors: list[str] = []
    deadline = time.monotonic() + seconds
    while len(got) < want and time.monotonic() < deadline:
        try:
            message = consumer.poll(0.2)
        except equeue.EQueueError as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
            continue
        if message is not None:
            got.append(message.body)
    return got, errors


def test_a_broker_commits_on_over_a_damaged_group_file_and_a_restart_resumes(
    broker_home: Path,
) -> None:
    """The reviewer's reproduction (p_damage_live.py) against a broker: the member's
    commits after the damage succeed, and after a restart the group reads nothing again."""
    path = broker_home / "s"
    with MessageStore.open(path) as store:
        store.create_topic("t", 2)
    thread = BrokerThread(path).start()
    try:
        with equeue.connect(thread.urls[0]) as client:
            for i in range(20):
                client.send("t", b"a%d" % i)
            consumer = client.consumer("g", ["t"], session_timeout=3.0)
            got, errors = _poll_all(consumer, 20, BOUNDED)
            consumer.commit()
            assert (len(got), errors) == (20, [])
            _damage(path / CONSUMERS_DIR / "g.json")
            for i in range(20):
                client.send("t", b"b%d" % i)
            got, errors = _poll_all(consumer, 20, BOUNDED)
            consumer.commit()
            assert (len(got), errors) == (20, [])
            assert {client.committed_offset("g", "t", q) for q in (0, 1)} == {20}
            consumer.close()
    finally:
        thread.stop()
    assert len(_recovered(path)) == 1
    thread = BrokerThread(path).start()
    try:
        with equeue.connect(thread.urls[0]) as client:
            client.send("t", b"after")
            with client.consumer("g", ["t"], session_timeout=3.0) as consumer:
                got, errors = _poll_all(consumer, 2, 3.0)
            assert (got, errors) == ([b"after"], [])
    finally:
        thread.stop()


def test_the_movers_last_failed_write_is_said_once_at_stop_and_retrieved(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """OffsetCommitter.run's last job failing as the broker stops: logged once by
    drain(), and no "Future exception was never retrieved" from the loop."""
    unretrieved: list[dict[str, Any]] = []

    def fail() -> None:
        raise CorruptionError("cannot write the mover's cursors", file=tmp_path / "x.json")

    async def stop_after_a_failed_job(store: MessageStore) -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _, context: unretrieved.append(context))
        committer = OffsetCommitter(loop, store)
        earlier = committer.run(fail)  # one the mover's tick would have read: not said
        await asyncio.wait([earlier])
        del earlier
        committer.run(fail)  # the mover keeps a reference, read at a tick that never comes
        await committer.drain()
        committer.close()

    with (
        MessageStore.open(tmp_path / "s") as store,
        caplog.at_level(logging.ERROR, "equeue.server"),
    ):
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(stop_after_a_failed_job(store))
            gc.collect()
        finally:
            loop.close()
    said = [r.getMessage() for r in caplog.records if "last cursor write failed" in r.getMessage()]
    assert len(said) == 1 and "cannot write the mover's cursors" in said[0], said
    assert unretrieved == []


# --- A7: one committed_offset reads one group's file ----------------------------------


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every file opened, stat'ed or listed through os (scandir's entries counted) by the
    calling thread: the store's background threads (the chunk maker making the log's next
    file after the open) do their own I/O, not the read's."""
    seen: list[str] = []
    caller = threading.get_ident()

    def wrap(name: str) -> None:
        real: Callable[..., Any] = getattr(os, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != caller:
                return real(*args, **kwargs)
            seen.append(f"{name} {args[0] if args else ''}")  # also one that fails
            result = real(*args, **kwargs)
            if name == "scandir":
                entries = list(result)
                seen.extend(f"scandir entry {e.name}" for e in entries)
                return iter(entries)
            return result

        monkeypatch.setattr(os, name, counted)

    for name in ("open", "stat", "lstat", "scandir", "listdir"):
        wrap(name)
    return seen


@pytest.mark.parametrize("read_only", [False, True])
def test_committed_offset_reads_one_group_file_whatever_the_number_of_groups(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, read_only: bool
) -> None:
    path = tmp_path / "s"
    with MessageStore.open(path) as store:
        store.create_topic("t", 4)
        store.send("t", b"x", queue_id=0)
        store.commit_offset("g7", "t", 0, 1)  # offsets.json: 1, the group file: 0
        for g in range(200):
            group_offsets.commit_group_file(path, f"g{g}", {("t", q): 0 for q in range(4)})
    with MessageStore.open(path, read_only=read_only) as store:
        assert store.committed_offset("g7", "t", 0) == 1  # parsed once, then cached
        seen = _counting(monkeypatch)
        assert store.committed_offset("g7", "t", 0) == 1
        assert store.committed_offset("g7", "t", 3) == 0
        assert store.committed_offset("nobody", "t", 0) is None
        monkeypatch.undo()
        # Per call: consumers/ opened and the one group file stat'ed (a read-only handle
        # also stats offsets.json): not the 200 files a scan of consumers/ reads.
        assert len(seen) == 3 * (3 if read_only else 2), seen
        assert not [s for s in seen if "scandir" in s or "listdir" in s], seen
        # A commit by another handle is seen: the file's identity changed, it is read again.
        group_offsets.commit_group_file(path, "g7", {("t", 3): 1})
        assert store.committed_offset("g7", "t", 3) == 1


# --- L3: a reset killed between its two writes ----------------------------------------

_RESET_CHILD = r"""
import os, signal, sys
from pathlib import Path
import equeue
from equeue.store import offsets as group_offsets

path, victim, when = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
store = equeue.MessageStore.open(path)
real = group_offsets.write_json

def dying(target, body):
    if Path(target).name == victim and when == "before":
        os.kill(os.getpid(), signal.SIGKILL)
    real(target, body)
    if Path(target).name == victim and when == "after":
        os.kill(os.getpid(), signal.SIGKILL)

group_offsets.write_json = dying
store.commit_offset("g", "t", 0, 5)
print("not killed", flush=True)
"""


@pytest.mark.parametrize(
    ("victim", "when", "expected"),
    [
        (OFFSETS_FILE, "before", 40),
        (OFFSETS_FILE, "after", 40),  # between the two writes: the group file's 40 wins
        ("g.json", "before", 40),
        ("g.json", "after", 5),
    ],
)
def test_a_reset_killed_at_either_write_lands_on_the_old_or_the_new_offset(
    tmp_path: Path, victim: str, when: str, expected: int
) -> None:
    path = tmp_path / "s"
    with MessageStore.open(path) as store:
        store.create_topic("t", 1)
        for i in range(40):
            store.send("t", b"m%d" % i)
        store.commit_offset("g", "t", 0, 30)  # offsets.json: 30
        group_offsets.commit_group(store, "g", {("t", 0): 40})  # a member's: the file 40
        assert store.committed_offset("g", "t", 0) == 40
    child = subprocess.run(
        [sys.executable, "-c", _RESET_CHILD, str(path), victim, when],
        capture_output=True,
        text=True,
        timeout=BOUNDED,
    )
    assert child.returncode == -9, child.stderr
    with MessageStore.open(path) as store:
        assert store.committed_offset("g", "t", 0) == expected


def test_a_deleted_topics_offsets_do_not_come_back_with_a_damaged_group_files_recovery(
    tmp_path: Path,
) -> None:
    path = tmp_path / "s"
    with MessageStore.open(path) as store:
        store.create_topic("t", 1)
        store.create_topic("u", 1)
        for topic in ("t", "u"):
            store.send(topic, b"m")
        group_offsets.commit_group(store, "g", {("t", 0): 1, ("u", 0): 1})
        assert store.committed_offset("g", "u", 0) == 1  # parsed: the last good offsets
        store.delete_topic("u")
        store.create_topic("u", 1)
        _damage(path / CONSUMERS_DIR / "g.json")
        group_offsets.commit_group(store, "g", {("t", 0): 1})  # recovers the file
        assert store.consumer_groups() == {"g": {"t": {0: 1}}}
