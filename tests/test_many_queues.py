"""Many queues in one store (issue 25): the open-file bound of the cache of open queues
(equeue/store/queuecache.py), queues closed and reopened under sends and pulls, a
SIGKILL with many queues, retention over many queues, a read-only handle in another
process."""

from __future__ import annotations

import datetime as dt
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from code_paths import code_path  # noqa: F401 - the fixture
from many_queues_child import body, low_config

from equeue import MessageStore, StoreConfig
from equeue.atomicfile import read_json, write_json
from equeue.cli import main
from equeue.errors import ConfigError
from equeue.format.topicsjson import pack_head
from equeue.store.config import open_queue_limit
from equeue.store.topics import TopicPolicy, topics_body
from equeue.store.topicsfile import TopicsFile

CHILD = Path(__file__).with_name("many_queues_child.py")
HERE = Path(__file__).parent


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(HERE.parent), str(HERE), env.get("PYTHONPATH", "")]
    ).rstrip(os.pathsep)
    return env


def _child(*args: str, timeout: float = 120) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, str(CHILD), *args],
        capture_output=True, text=True, timeout=timeout, env=_env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_open_files_stay_bounded_under_a_low_rlimit(tmp_path: Path) -> None:
    """200 queues, each written three times and read back, then reopened, under
    RLIMIT_NOFILE=64 (the code before the cache stopped at 26 topics with Errno 24)."""
    report = _child("write", str(tmp_path / "s"), "50", "64")
    assert "error" not in report, report["error"]
    assert report["wrong"] == []
    assert report["read"] == report["reread"] == 50 * 4 * 3
    assert report["problems"] == []  # the control: a clean reopen reports nothing
    assert report["most_fds"] <= 64


def test_max_open_files_is_checked() -> None:
    with pytest.raises(ConfigError, match="max_open_files"):
        StoreConfig(max_open_files=20)
    assert open_queue_limit(StoreConfig()) >= 64  # the default keeps a useful number open
    assert open_queue_limit(low_config()) == 9


@pytest.mark.usefixtures("code_path")
def test_a_closed_queue_reopens_with_its_ongoing_chunk(tmp_path: Path) -> None:
    """A queue past one chunk (a completed chunk and an ongoing one), closed by the cache
    while others are used, reads and writes on where it was, also after a reopen."""
    config = low_config(queue_chunk_records=400)
    with MessageStore.open(tmp_path, config) as store:
        store.create_topic("hot", 1)
        for i in range(500):
            store.send("hot", body("hot", 0, i))
        hot = store._queues["hot"][0]
        assert hot.is_open
        for i in range(20):  # more queues than stay open: "hot" is closed
            store.send(f"other{i}", b"x", queue_id=0)
        assert not hot.is_open
        assert store.queue_range("hot", 0) == (0, 500)  # without opening it
        assert not hot.is_open
        got = [m.body for m in store.pull("hot", 0, 390, 100).messages]
        assert got == [body("hot", 0, i) for i in range(390, 490)]
        for i in range(20):
            store.send(f"other{i}", b"y", queue_id=0)
        assert not hot.is_open
        results = [store.send("hot", body("hot", 0, i)) for i in range(500, 900)]
        assert [r.queue_offset for r in results] == list(range(500, 900))
        batch = store.send_batch("hot", [body("hot", 0, i) for i in range(900, 950)])
        assert [r.queue_offset for r in batch] == list(range(900, 950))
        assert store._files.closed > 0
    with MessageStore.open(tmp_path, config) as store:
        assert store.recovery.problems == []
        assert store.queue_range("hot", 0) == (0, 950)
        got = [m.body for m in store.pull("hot", 0, 0, 1000).messages]
        assert got == [body("hot", 0, i) for i in range(950)]
        for i in range(20):
            assert [m.body for m in store.pull(f"other{i}", 0, 0, 5).messages] == [b"x", b"y"]


@pytest.mark.usefixtures("code_path")
def test_sends_and_pulls_while_queues_are_closed_under_them(tmp_path: Path) -> None:
    """Threads send to and pull from 48 queues, 9 open at most: every message is read
    back once, in order, at the offset its send returned."""
    config = low_config(queue_chunk_records=400)
    topics = [f"t{i}" for i in range(12)]
    sent: dict[tuple[str, int], list[tuple[int, bytes]]] = {}
    errors: list[BaseException] = []
    lock = threading.Lock()
    stop = threading.Event()
    with MessageStore.open(tmp_path, config) as store:

        def sender(seed: int) -> None:
            rng = random.Random(seed)
            try:
                for i in range(1500):
                    topic, q = rng.choice(topics), rng.randrange(4)
                    data = f"{seed}/{i}".encode()
                    if i % 50 == 0:
                        results = store.send_batch(topic, [data + b"b", data + b"c"])
                    else:
                        results = [store.send(topic, data, queue_id=q)]
                    with lock:
                        for r, b in zip(results, [data + b"b", data + b"c"] if i % 50 == 0
                                        else [data], strict=True):  # fmt: skip
                            sent.setdefault((topic, r.queue_id), []).append((r.queue_offset, b))
            except BaseException as exc:
                errors.append(exc)

        def puller(seed: int) -> None:
            rng = random.Random(seed)
            try:
                while not stop.is_set():
                    topic, q = rng.choice(topics), rng.randrange(4)
                    start = rng.randrange(0, 200)
                    for m in store.pull(topic, q, start, 32).messages:
                        assert m.topic == topic and m.queue_id == q
            except BaseException as exc:
                errors.append(exc)

        for topic in topics:
            store.create_topic(topic, 4)
        threads = [threading.Thread(target=sender, args=(s,)) for s in (1, 2)]
        readers = [threading.Thread(target=puller, args=(s,)) for s in (3, 4)]
        for t in threads + readers:
            t.start()
        for t in threads:
            t.join(timeout=120)
        stop.set()
        for t in readers:
            t.join(timeout=60)
        assert not errors, errors
        assert store._files.closed > 100  # the cache churned
        for (topic, q), items in sent.items():
            items.sort()
            assert [o for o, _ in items] == list(range(len(items)))
            got = store.pull(topic, q, 0, 10_000).messages
            assert [m.body for m in got] == [b for _, b in items]


def test_a_sigkill_with_many_queues_loses_no_acknowledged_message(tmp_path: Path) -> None:
    """A writer over 400 queues (16 open at most) is killed mid-send to 40 of them after a
    checkpoint; the reopen opens only those 40 and finds every acknowledged message at
    its offset. Control: a clean close and reopen of the same store reports nothing."""
    path = tmp_path / "s"
    proc = subprocess.Popen(
        [sys.executable, str(CHILD), "ack", str(path), "100"],
        stdout=subprocess.PIPE, text=True, env=_env(),
    )  # fmt: skip
    acked: list[tuple[str, int, int]] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 60
        while len(acked) < 1900 and time.monotonic() < deadline:
            fields = proc.stdout.readline().split()
            if fields != ["ready"]:
                acked.append((fields[0], int(fields[1]), int(fields[2])))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert len(acked) == 1900
    with MessageStore.open(path, low_config(max_open_files=60)) as store:
        # Re-dispatch opened the 40 queues it met records of past the checkpoint, not 400.
        assert sum(q.checked for qs in store._queues.values() for q in qs) == 40
        assert store.recovery.problems == []
        for name, q, offset in acked:
            (message,) = store.pull(name, q, offset, 1).messages
            assert (message.queue_offset, message.body) == (offset, body(name, q, offset))
    with MessageStore.open(path, low_config(max_open_files=60)) as store:
        assert store.recovery.problems == [] and store.recovery.cuts == []


def test_retention_over_many_queues(tmp_path: Path) -> None:
    """Retention moves every queue's first offset past the removed messages, also the
    queues that are closed when it runs; their removed queue chunks go too."""
    config = low_config(chunk_data_size=64 * 1024, queue_chunk_records=400)
    topics = [f"t{i}" for i in range(8)]
    with MessageStore.open(tmp_path, config) as store:
        for topic in topics:
            store.create_topic(topic, 4)
        for round_ in range(420):  # 32 queues past a queue chunk; ~1.4 MB of log
            for topic in topics:
                for q in range(4):
                    store.send(topic, body(topic, q, round_) + b"." * 80, queue_id=q)
        removed = store.apply_retention(now=time.time() + 10**6)
        assert removed == 0  # no retention configured: nothing removed
    config = low_config(
        chunk_data_size=64 * 1024, queue_chunk_records=400, retention=dt.timedelta(seconds=1)
    )
    with MessageStore.open(tmp_path, config) as store:
        assert store.apply_retention(now=time.time() + 10) > 0
        for topic in topics:
            for q in range(4):
                first, end = store.queue_range(topic, q)
                assert end == 420 and first > 0
                got = store.pull(topic, q, 0, 1000).messages
                assert got and got[0].queue_offset == first
        queue_files = list((tmp_path / "queues" / "t0" / "0").glob("chunk-*"))
        assert len(queue_files) == 1  # the completed queue chunk went with its messages
    with MessageStore.open(tmp_path, config) as store:
        assert store.recovery.problems == []
        assert store.queue_range("t0", 0)[1] == 420


def test_a_read_only_handle_in_another_process_reads_many_queues(tmp_path: Path) -> None:
    """A writer holds 240 queues open and keeps writing; a read-only process under
    RLIMIT_NOFILE=64 reads every queue."""
    topics = [f"r{i:03d}" for i in range(60)]
    with MessageStore.open(tmp_path, low_config()) as store:
        for topic in topics:
            store.create_topic(topic, 4)
        for round_ in range(3):
            for topic in topics:
                for q in range(4):
                    store.send(topic, body(topic, q, round_), queue_id=q)
        store.flush()
        found = _child("read", str(tmp_path), "64")
        for topic in topics:
            store.send(topic, b"later", queue_id=0)  # the writer goes on meanwhile
    assert found.pop("_most_fds") <= 64
    assert found == {
        f"{t}/{q}": [body(t, q, r).decode() for r in range(3)] for t in topics for q in range(4)
    }


def _many(path: Path, config: StoreConfig, topics: int = 12, hot: int = 0) -> None:
    """``topics`` topics of 4 queues (more than ``low_config`` keeps open), each queue
    one message; ``hot`` more to t0/0 (past its first queue chunk of 400 entries)."""
    with MessageStore.open(path, config) as store:
        for i in range(topics):
            store.create_topic(f"t{i}", 4)
            for q in range(4):
                store.send(f"t{i}", body(f"t{i}", q, 0), queue_id=q)
        for i in range(1, hot + 1):
            store.send("t0", body("t0", 0, i), queue_id=0)


def test_a_clean_reopen_opens_no_queue_until_used(tmp_path: Path) -> None:
    config = low_config(queue_chunk_records=400)
    _many(tmp_path, config)
    with MessageStore.open(tmp_path, config) as store:
        assert store.recovery.problems == []
        ranges = {
            (t, q): store.queue_range(t, q) for t in store.topics() for q in store.queue_ids(t)
        }
        assert len(ranges) == 48 and set(ranges.values()) == {(0, 1)}
        assert store._files.opened == 0  # topics(), queue_ids(), queue_range() open nothing
        assert [m.body for m in store.pull("t5", 2, 0).messages] == [body("t5", 2, 0)]
        assert store._files.opened == 1
    small = low_config(queue_chunk_records=400, max_open_files=200)  # 60 stay open
    with MessageStore.open(tmp_path, small) as store:  # fewer than stay open: opened now
        assert store._files.opened == 48


def test_a_damaged_queue_of_a_clean_store_is_rebuilt_on_first_use(tmp_path: Path) -> None:
    """Its open was deferred: the damage (a zeroed chunk header) is found, and the queue
    rebuilt from the log at its offsets, when it is first used; reported in
    ``recovery.problems``; the next reopen finds nothing."""
    config = low_config(queue_chunk_records=400)
    _many(tmp_path, config, hot=450)
    first = sorted((tmp_path / "queues" / "t0" / "0").glob("chunk-*"))[0]
    with open(first, "r+b") as f:
        f.write(bytes(64))
    with MessageStore.open(tmp_path, config) as store:
        assert store.recovery.problems == []
        assert store.queue_range("t0", 0) == (0, 451)
        got = store.pull("t0", 0, 0, 1000).messages
        assert [m.body for m in got] == [body("t0", 0, i) for i in range(451)]
        assert any("t0/0" in p and "was rebuilt" in p for p in store.recovery.problems)
        assert store.send("t0", b"next", queue_id=0).queue_offset == 451
    assert list((first.parent / "recovered").glob(f"{first.name}.*.damaged"))
    with MessageStore.open(tmp_path, config) as store:
        assert store.recovery.problems == []
        assert store.queue_range("t0", 0) == (0, 452)
        assert store.pull("t0", 0, 449, 5).messages[0].body == body("t0", 0, 449)


def test_a_deleted_queue_chunk_of_a_clean_store_is_reported_at_open(tmp_path: Path) -> None:
    """A listing per queue at open: a queue whose chunk files do not cover its recorded
    offsets is opened (and reported, and rebuilt) by the open itself."""
    config = low_config(queue_chunk_records=400)
    _many(tmp_path, config, hot=450)
    sorted((tmp_path / "queues" / "t0" / "0").glob("chunk-*"))[0].unlink()
    with MessageStore.open(tmp_path, config) as store:
        assert any("t0/0" in p and "starts at offset 400" in p for p in store.recovery.problems)
        assert store.queue_range("t0", 0) == (0, 451)
        got = store.pull("t0", 0, 0, 1000).messages
        assert [m.body for m in got] == [body("t0", 0, i) for i in range(451)]


def test_topics_file_writes_what_write_json_writes(tmp_path: Path) -> None:
    """topics.json from cached per-topic pieces (topicsfile.py) is byte for byte what
    write_json(topics_body(...)) writes after the fold's generation head (every write has
    one: topicsjson.py), as topics are added, changed and deleted."""
    file = TopicsFile(tmp_path, writer=True)
    counts = {"a": 4, "b.c": 1, "é-ü": 2}
    policies = {"b.c": TopicPolicy("compact", dt.timedelta(days=1), dt.timedelta(hours=2))}
    deleted = {"z": 123}
    for step in range(4):
        if step == 1:
            counts["a"] = 6
            counts["z"] = 1  # created again after its deletion
        if step == 2:
            policies["a"] = TopicPolicy(retention=dt.timedelta(seconds=30))
            del counts["b.c"]
            deleted["b.c"] = 999
        if step == 3:
            counts.clear()
        file.write(counts, policies, deleted)
        write_json(tmp_path / "whole.json", topics_body(counts, policies, deleted))
        whole = (tmp_path / "whole.json").read_bytes()
        head = pack_head(step + 1).encode()
        assert (tmp_path / "topics.json").read_bytes() == head + whole[1:]
        assert read_json(tmp_path / "topics.json") == topics_body(counts, policies, deleted)
    file.close_fd()


def test_inspect_summary_of_many_queues_shows_the_largest_and_totals(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = low_config(queue_chunk_records=400)
    _many(tmp_path, config, hot=7)  # 48 queues; t0/0 holds 8 messages
    with MessageStore.open(tmp_path, config) as store:
        for q in range(4):
            store.commit_offset("g", "t1", q, 0)
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("  t") and "/" in line]
    assert "the 20 largest by messages" in out and len(rows) == 20
    assert rows[0].split()[:4] == ["t0/0", "0", "8", "8"]
    assert "all 48 queues: 55 messages, 48 queue chunks, 0 empty" in out
    assert main(["inspect", "--json", str(tmp_path)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert sum(len(t["queues"]) for t in summary["topics"]) == 48
