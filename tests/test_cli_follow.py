"""``equeue records --follow`` (like ``tail -f``) and ``--tag``: the follower is a real
``python -m equeue`` process beside this test's writer, stopped with SIGINT."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest
from test_cli import snapshot

from equeue import MessageStore, SendResult, StoreConfig
from equeue.cli import main
from equeue.inspect.follow import POLL_SECONDS

# Small chunks: the messages sent while following roll the log over several times.
CONFIG = StoreConfig(chunk_data_size=4096, queue_chunk_records=400, default_queue_count=2)
TAGS = ("created", "paid", "")
READ_TIMEOUT = 60.0  # only against a hang: nothing here is timed
# The follower starts with SIGINT at its default, as a shell starts a foreground command.
# A process that ignores SIGINT passes that on to its children (a shell's background job
# `make test &` or nohup, and every pytest-xdist worker started from one), and Python then
# installs no KeyboardInterrupt handler: the follower outlived the test's Ctrl-C until the
# 60 s timeout (round 21's parallel run). This execs the same `python -m equeue ...`.
_SIGINT_AT_DEFAULT = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
)


class Follower:
    """``equeue records STORE --follow --json ARGS...``, its lines read by a thread."""

    def __init__(self, store: Path, *args: str) -> None:
        command = ["-m", "equeue", "records", str(store), "--follow", "--json", *args]
        self.process = subprocess.Popen(
            [sys.executable, "-c", _SIGINT_AT_DEFAULT, *command],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stopped: tuple[int, str] | None = None
        self._reader = threading.Thread(target=self._read, args=(self.process.stdout,))
        self._reader.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.put(line)
        self.lines.put(None)

    def take(self, count: int) -> list[dict[str, Any]]:
        records = []
        for _ in range(count):
            line = self.lines.get(timeout=READ_TIMEOUT)
            assert line is not None, self.stop()[1]
            records.append(json.loads(line))
        return records

    def stop(self) -> tuple[int, str]:
        """SIGINT, as Ctrl-C sends it; (exit status, stderr)."""
        if self.stopped is not None:
            return self.stopped
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
        try:
            code = self.process.wait(timeout=READ_TIMEOUT)
        finally:
            if self.process.poll() is None:
                self.process.kill()
        self._reader.join()
        assert self.process.stderr is not None
        err = self.process.stderr.read()
        self.process.stderr.close()
        assert self.process.stdout is not None
        self.process.stdout.close()
        self.stopped = code, err
        return self.stopped


@pytest.fixture
def followers() -> Iterator[list[Follower]]:
    started: list[Follower] = []
    yield started
    for follower in started:
        follower.stop()


def send(store: MessageStore, topic: str, count: int, start: int) -> list[SendResult]:
    return [
        store.send(topic, b"message %d " % i * 8, tag=TAGS[i % 3], key=f"k{i % 4}")
        for i in range(start, start + count)
    ]


def ids(records: list[dict[str, Any]]) -> list[str]:
    return [r["message_id"] for r in records]


def test_follow_prints_each_new_message_once_until_sigint(
    tmp_path: Path, followers: list[Follower]
) -> None:
    """What is there is printed, then every message a writer adds, across rollovers and
    a topic created while following, each once and in log order; a follower of one queue
    and one tag prints only those. SIGINT ends it with status 0 and nothing on stderr."""
    path = tmp_path / "store"
    with MessageStore.open(path, CONFIG) as writer:
        before = send(writer, "orders", 6, 0)
        chunks = len(list((path / "messages").glob("chunk-*")))
        everything = Follower(path)
        followers.append(everything)
        paid = Follower(path, "--topic", "orders", "--queue", "1", "--tag", "paid")
        followers.append(paid)
        assert ids(everything.take(6)) == [s.message_id for s in before]
        after = send(writer, "orders", 60, 6)
        after += send(writer, "audit", 3, 66)  # a topic the followers have not seen
        after += send(writer, "orders", 20, 69)
        assert len(list((path / "messages").glob("chunk-*"))) >= chunks + 3  # rollovers
        followed = everything.take(len(after))
        assert ids(followed) == [s.message_id for s in after]
        assert [r["position"] for r in followed] == sorted(r["position"] for r in followed)
        assert {r["topic"] for r in followed} == {"orders", "audit"}
        sent = before + after
        wanted = [
            s.message_id
            for i, s in enumerate(sent)
            if s.topic == "orders" and s.queue_id == 1 and TAGS[i % 3] == "paid"
        ]
        assert ids(paid.take(len(wanted))) == wanted
        last = send(writer, "orders", 1, 89)[0]
        assert ids(everything.take(1)) == [last.message_id]
        for follower in followers:
            assert follower.stop() == (0, "")
    for follower in followers:
        assert follower.lines.get_nowait() is None  # nothing more: nothing printed twice


def test_follow_from_a_queue_offset_past_its_end(tmp_path: Path, followers: list[Follower]) -> None:
    """--offset past the queue's end: the messages before that offset are never printed,
    even when they arrive while following."""
    path = tmp_path / "store"
    with MessageStore.open(path, CONFIG) as writer:
        writer.create_topic("one", 1)
        send(writer, "one", 2, 0)
        follower = Follower(path, "--topic", "one", "--queue", "0", "--offset", "5")
        followers.append(follower)
        later = send(writer, "one", 6, 2)  # offsets 2..7
        assert later[3].queue_offset == 5
        # Offsets 2..4 come first in the log: had they been printed, they would lead.
        assert [r["queue_offset"] for r in follower.take(3)] == [5, 6, 7]


def test_follow_with_limit_stops_by_itself(tmp_path: Path) -> None:
    """--limit ends a follower as soon as it has printed that many messages: among those
    already there, or at the last new one (not at the one after it)."""
    path = tmp_path / "store"
    with MessageStore.open(path, CONFIG) as writer:
        sent = send(writer, "orders", 3, 0)
        done = subprocess.run(
            [sys.executable, "-m", "equeue", "records", str(path), "-f", "--limit", "2", "--json"],
            capture_output=True,
            text=True,
            timeout=READ_TIMEOUT,
            check=False,
        )
        assert (done.returncode, done.stderr) == (0, "")
        assert [json.loads(line)["message_id"] for line in done.stdout.splitlines()] == [
            s.message_id for s in sent[:2]
        ]
        follower = Follower(path, "--limit", "5")
        assert ids(follower.take(3)) == [s.message_id for s in sent]
        sent += send(writer, "orders", 2, 3)
        assert ids(follower.take(2)) == [s.message_id for s in sent[3:]]
        assert follower.process.wait(timeout=READ_TIMEOUT) == 0  # no sixth message needed
        assert follower.stop() == (0, "")
        assert follower.lines.get_nowait() is None


def test_records_tag_filter(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "store"
    with MessageStore.open(path, CONFIG) as writer:
        sent = send(writer, "orders", 12, 0)

    def listed(*args: str) -> list[str]:
        code = main(["records", str(path), "--json", *args])
        out, err = capsys.readouterr()
        assert (code, err) == (0, "")
        return [json.loads(line)["message_id"] for line in out.splitlines()]

    assert listed() == [s.message_id for s in sent]  # the control: no filter
    assert listed("--tag", "paid") == [s.message_id for i, s in enumerate(sent) if i % 3 == 1]
    assert listed("--tag", "paid", "--tag", "") == [
        s.message_id for i, s in enumerate(sent) if i % 3 != 0
    ]
    assert listed("--tag", "nope") == []
    assert listed("--topic", "orders", "--queue", "0", "--tag", "created") == [
        s.message_id for i, s in enumerate(sent) if i % 3 == 0 and s.queue_id == 0
    ]


def test_follow_goes_on_after_retention_removes_chunks(
    tmp_path: Path, followers: list[Follower]
) -> None:
    """The writer's retention deletes the chunks the follower has read: it goes on with
    the messages sent after, none missed."""
    path = tmp_path / "store"
    config = dataclasses.replace(CONFIG, retention=dt.timedelta(hours=1))
    with MessageStore.open(path, config) as writer:
        first = send(writer, "orders", 60, 0)
        follower = Follower(path)
        followers.append(follower)
        assert ids(follower.take(60)) == [s.message_id for s in first]
        chunks = sorted((path / "messages").glob("chunk-*"))
        assert writer.apply_retention(now=time.time() + 7200) > 0
        assert chunks[0].exists() is False and len(chunks) > 1
        later = send(writer, "orders", 60, 60)
        assert ids(follower.take(60)) == [s.message_id for s in later]
        assert follower.stop() == (0, "")


def test_follow_changes_nothing_in_the_store(tmp_path: Path) -> None:
    """Like every inspector command, a follower reads only: no file is created or changed
    (the store's writer is gone; a key index exists)."""
    path = tmp_path / "store"
    with MessageStore.open(path, CONFIG) as writer:
        sent = send(writer, "orders", 5, 0)
        writer.flush()
    before = snapshot(path)
    follower = Follower(path)
    try:
        assert ids(follower.take(5)) == [s.message_id for s in sent]
        time.sleep(POLL_SECONDS * 3)  # a few rounds of refresh and pull
    finally:
        assert follower.stop() == (0, "")
    assert snapshot(path) == before


def test_follow_keeps_log_order_when_a_queue_holds_more_than_a_batch(
    tmp_path: Path, followers: list[Follower]
) -> None:
    """Two queues fill faster than the follower looks: one round finds more than a batch
    (256) in one of them. Printing a round's pulls sorted put the other queue's later
    messages before the first queue's rest; the follower holds back what lies past a
    cut batch."""
    path = tmp_path / "store"
    with MessageStore.open(path, CONFIG) as writer:
        writer.create_topic("two", 2)
        first = writer.send("two", b"first", queue_id=0)
        follower = Follower(path)
        followers.append(follower)
        assert ids(follower.take(1)) == [first.message_id]
        sent = [writer.send("two", b"m%d" % i, queue_id=int(i % 8 == 0)) for i in range(1200)]
        followed = follower.take(len(sent))
        assert [r["position"] for r in followed] == [s.position for s in sent]
        assert follower.stop() == (0, "")
    assert follower.lines.get_nowait() is None


def test_sigint_stops_a_follower_started_by_a_process_that_ignores_it(tmp_path: Path) -> None:
    """The test process ignoring SIGINT (started as `make test &` is) changes nothing:
    Follower's SIGINT still ends its child with status 0, as Ctrl-C would in a terminal."""
    path = tmp_path / "store"
    with MessageStore.open(path, CONFIG) as writer:
        sent = send(writer, "orders", 2, 0)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        follower = Follower(path)
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        assert ids(follower.take(2)) == [s.message_id for s in sent]
    finally:
        assert follower.stop() == (0, "")
