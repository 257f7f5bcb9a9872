"""Retention interrupted by a crash: a queue's next offset never moves back, and the
next ``apply_retention`` finishes what the killed one started.

Each case copies one template store (queue t/0 with 400 entries, so a completed and an
ongoing queue chunk, then enough on f/0 for several more log chunks) and runs
``apply_retention`` in a child process (tests/store_kill_child.py) that SIGKILLs
itself inside it: before each of its file-system calls in turn (checkpoint, message
chunk unlinks, queue chunk unlinks, directory fsyncs), or after sends made between its
checkpoint and its deletions. The store is then reopened for writing and compared with
the same retention run to its end without a kill (the control).
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from store_kill_child import Outcome, config
from store_kill_child import run_child as run_kill_child

from equeue import MessageStore

T_MESSAGES = 400  # t/0: entries 0..341 fill queue chunk 0, 342..399 are in chunk 1
NOW = time.time() + 7200  # every chunk written now is past the one-hour retention then


def listing(store: Path) -> dict[str, set[str]]:
    dirs = [store / "messages", *sorted((store / "queues").glob("*/*"))]
    return {str(d.relative_to(store)): {p.name for p in d.glob("chunk-*")} for d in dirs}


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("retention-crash") / "store"
    with MessageStore.open(path, config()) as store:
        store.create_topic("t", 1)
        store.create_topic("f", 1)
        for i in range(T_MESSAGES):
            store.send("t", b"t%d" % i, queue_id=0)
        for i in range(30):
            store.send("f", b"%d" % i + b"f" * 400, queue_id=0)
    return path


@dataclass(frozen=True)
class Control:
    files: dict[str, set[str]]  # what a retention run to its end leaves
    calls: list[str]  # its file-system calls, as the child printed them


@pytest.fixture(scope="module")
def control(template: Path, tmp_path_factory: pytest.TempPathFactory) -> Control:
    path = tmp_path_factory.mktemp("control") / "store"
    shutil.copytree(template, path)
    outcome = run_child(path, "never", 0)
    assert "DONE" in outcome.stdout and int(outcome.stdout.split("REMOVED ")[1].split()[0]) >= 3
    with MessageStore.open(path, config()) as store:
        assert store.recovery.clean
        assert store.queue_range("t", 0) == (T_MESSAGES, T_MESSAGES)
        assert store.apply_retention(now=NOW) == 0
    calls = [line for line in outcome.stdout.splitlines() if line.startswith("CALL ")]
    return Control(listing(path), calls)


def kill_points(calls: list[str]) -> list[int]:
    """Every call, but of a run of message chunk unlinks only the first two and the last
    (the ones between are alike)."""
    unlinks = [i for i, c in enumerate(calls) if c.split()[2] == "unlink" and "/messages/" in c]
    alike = set(unlinks[2:-1])
    return [i + 1 for i in range(len(calls)) if i not in alike]


def check_resumed(path: Path, control: Control) -> None:
    """Reopened after the kill: offsets kept, and retention finishes where it stopped and
    keeps working after more chunks expire."""
    with MessageStore.open(path, config()) as store:
        assert store.queue_range("t", 0)[1] == T_MESSAGES
        store.apply_retention(now=NOW)
        assert listing(path) == control.files
        assert store.queue_range("t", 0) == (T_MESSAGES, T_MESSAGES)
        # Later retention runs work too: more log chunks, removed with their queue chunk.
        for i in range(400):
            store.send("f", b"%d" % i + b"g" * 300, queue_id=0)
        first_f = store.queue_range("f", 0)[0]
        assert store.apply_retention(now=NOW) > 0
        assert store.queue_range("f", 0)[0] > first_f
        assert len(listing(path)["queues/f/0"]) == 1  # its completed queue chunks all went
        sent = store.send("t", b"after", queue_id=0)
        assert sent.queue_offset == T_MESSAGES
        assert [m.body for m in store.pull("t", 0, T_MESSAGES).messages] == [b"after"]


def test_retention_resumes_after_a_kill_at_every_step(
    template: Path, control: Control, tmp_path: Path
) -> None:
    points = kill_points(control.calls)
    assert len(points) > 6, control.calls
    seen_between = False  # a kill after the message chunks went, before the queue chunk
    for k in points:
        path = tmp_path / f"before-{k}"
        shutil.copytree(template, path)
        outcome = run_child(path, "before", k)
        assert outcome.killed, f"no call {k} (the control made {control.calls})"
        files = listing(path)
        if files["messages"] == control.files["messages"]:
            seen_between = seen_between or files["queues/t/0"] != control.files["queues/t/0"]
        check_resumed(path, control)
    assert seen_between


def test_control_retention_without_a_kill(template: Path, control: Control, tmp_path: Path) -> None:
    path = tmp_path / "store"
    shutil.copytree(template, path)
    assert "DONE" in run_child(path, "never", 0).stdout
    check_resumed(path, control)


@pytest.mark.parametrize("sends", [1, 3, 300])
def test_sends_between_the_checkpoint_and_the_deletion_keep_their_offsets(
    template: Path, tmp_path: Path, sends: int
) -> None:
    """Acknowledged sends made after retention's checkpoint, in chunks it then removes:
    after the kill the queue's next offset is past them (it was moved back to the
    checkpoint's, and the next send reused an acknowledged offset). With 300, they
    fill t/0's queue chunk, so retention removes every queue chunk the checkpoint's
    offset lies in."""
    path = tmp_path / "store"
    shutil.copytree(template, path)
    outcome = run_child(path, "sends", sends)
    assert outcome.killed and "REMOVED" in outcome.stdout, outcome.stdout
    acknowledged = [offset for _, offset, _ in outcome.acknowledged()]
    assert acknowledged == list(range(T_MESSAGES, T_MESSAGES + sends))
    with MessageStore.open(path, config()) as store:
        first, end = store.queue_range("t", 0)
        assert end == T_MESSAGES + sends, (first, end, store.recovery)
        assert first == end  # every one of them was removed by retention
        if sends == 300:
            assert len(listing(path)["queues/t/0"]) == 1
            assert store.queue_range("t", 0)[0] > 2 * 342
        assert not any("t/0" in str(cut) for cut in store.recovery.cuts), store.recovery.cuts
        assert store.send("t", b"next", queue_id=0).queue_offset == end
    with MessageStore.open(path, config()) as store:
        assert store.recovery.clean
        assert store.queue_range("t", 0)[1] == end + 1


def run_child(store: Path, mode: str, k: int) -> Outcome:
    return run_kill_child(store, mode, k, NOW)
