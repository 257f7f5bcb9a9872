"""Child processes of tests/test_many_queues.py (not a test module).

many_queues_child.py write DIR TOPICS NOFILE   under RLIMIT_NOFILE=NOFILE: TOPICS topics
    of 4 queues, three rounds of a send to every queue, each queue pulled back, a
    close and a reopen that reads them all again; prints a JSON report.
many_queues_child.py read DIR NOFILE           read-only, beside a writer: every
    queue pulled to its end; prints {"topic/queue": [bodies]} as JSON.
many_queues_child.py follow DIR NOFILE         read-only, beside a writer: opens,
    prints "ready", waits for topic "late", pulls every queue; prints a JSON report.
many_queues_child.py ack DIR TOPICS            sends round-robin over TOPICS topics
    of 4 queues, forever, printing each acknowledged send as "topic queue offset"
    (the parent kills it).
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

from equeue import MessageStore, StoreConfig
from equeue.errors import EQueueError


def low_config(**overrides: Any) -> StoreConfig:
    """A small bound on open files, where this version has one (the test shows the code
    before it failing with Errno 24 under the same limit)."""
    names = {f.name for f in dataclasses.fields(StoreConfig)}
    fields: dict[str, Any] = {"max_open_chunks": 2, "queue_chunk_records": 1024} | overrides
    if "max_open_files" in names:
        fields.setdefault("max_open_files", 40)
    return StoreConfig(**fields)


def body(topic: str, queue_id: int, round_: int) -> bytes:
    return f"{topic}/{queue_id}/{round_}".encode()


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def limit(nofile: int) -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))


def write(directory: Path, topics: int, nofile: int) -> dict[str, Any]:
    limit(nofile)
    names = [f"t{i:04d}" for i in range(topics)]
    report: dict[str, Any] = {"most_fds": 0, "wrong": []}
    try:
        with MessageStore.open(directory, low_config()) as store:
            for name in names:
                store.create_topic(name, 4)
            for round_ in range(3):
                for name in names:
                    for q in range(4):
                        result = store.send(name, body(name, q, round_), queue_id=q)
                        if result.queue_offset != round_:
                            report["wrong"].append([name, q, result.queue_offset])
                    report["most_fds"] = max(report["most_fds"], fds())
            report["read"] = read_all(store, names, report)
        with MessageStore.open(directory, low_config()) as store:
            report["reread"] = read_all(store, names, report)
            report["problems"] = store.recovery.problems
    except EQueueError as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
    return report


def read_all(store: MessageStore, names: list[str], report: dict[str, Any]) -> int:
    count = 0
    for name in names:
        for q in range(4):
            got = [m.body for m in store.pull(name, q, 0, 16).messages]
            if got != [body(name, q, r) for r in range(3)]:
                report["wrong"].append([name, q, [b.decode() for b in got]])
            count += len(got)
            report["most_fds"] = max(report["most_fds"], fds())
    return count


def read(directory: Path, nofile: int) -> dict[str, Any]:
    limit(nofile)
    found: dict[str, Any] = {}
    with MessageStore.open(directory, low_config(), read_only=True) as store:
        for topic in store.topics():
            for q in store.queue_ids(topic):
                offset, bodies = 0, []
                for _ in range(10_000):  # bounded: a queue holds far fewer
                    pulled = store.pull(topic, q, offset, 64)
                    bodies += [m.body.decode() for m in pulled.messages]
                    if not pulled.messages:
                        break
                    offset = pulled.next_offset
                found[f"{topic}/{q}"] = bodies
        found["_most_fds"] = fds()
    return found


def follow(directory: Path, nofile: int) -> dict[str, Any]:
    """Read-only under RLIMIT_NOFILE=``nofile``: open (how many queues that opened), say
    "ready", wait for the writer's topic "late" and its messages (refresh(), bounded), then
    pull every queue."""
    limit(nofile)
    report: dict[str, Any] = {"wrong": []}
    with MessageStore.open(directory, low_config(), read_only=True) as store:
        report["opened_at_open"] = store._files.opened
        report["topics_at_open"] = len(store.topics())
        report["fds_at_open"] = fds()
        print("ready", flush=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # "late", and the writer's last send to it
            if "late" in store.topics() and store.queue_range("late", 3)[1] == 1:
                break
            time.sleep(0.02)
            store.refresh()
        report["opened_before_reads"] = store._files.opened
        for topic in store.topics():
            for q in store.queue_ids(topic):
                got = [m.body for m in store.pull(topic, q, 0, 16).messages]
                if got != [body(topic, q, 0)]:
                    report["wrong"].append([topic, q, [b.decode() for b in got]])
                if store.queue_range(topic, q) != (0, 1):
                    report["wrong"].append([topic, q, store.queue_range(topic, q)])
        report["topics"] = len(store.topics())
        report["most_fds"] = fds()
    return report


def ack(directory: Path, topics: int) -> None:
    names = [f"t{i:04d}" for i in range(topics)]
    with MessageStore.open(directory, low_config(max_open_files=60)) as store:
        for name in names:
            store.create_topic(name, 4)
            for q in range(4):
                result = store.send(name, body(name, q, 0), queue_id=q)
                print(name, q, result.queue_offset, flush=True)
        store.flush()  # a checkpoint: then only the first 10 topics get records past it
        print("ready", flush=True)
        for round_ in range(1, 1_000_000):  # until killed
            for name in names[:10]:
                for q in range(4):
                    result = store.send(name, body(name, q, round_), queue_id=q)
                    print(name, q, result.queue_offset, flush=True)


def main() -> None:
    mode, directory = sys.argv[1], Path(sys.argv[2])
    if mode == "write":
        print(json.dumps(write(directory, int(sys.argv[3]), int(sys.argv[4]))))
    elif mode == "read":
        print(json.dumps(read(directory, int(sys.argv[3]))))
    elif mode == "follow":
        print(json.dumps(follow(directory, int(sys.argv[3]))))
    elif mode == "ack":
        ack(directory, int(sys.argv[3]))


if __name__ == "__main__":
    main()
