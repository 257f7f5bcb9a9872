"""The child of tests/test_groupcommit_trace.py, run under tests/fdatasync_shim.c (LD_PRELOAD).

``order STORE``: 8 connections send 40 messages each (one in flight each, every answer
sends again) through the broker's group commit (CrossClientCommit, the C flusher) on a
store of 64 KiB chunks; prints, as JSON, per send: when its append ended, when it was
answered (time.monotonic_ns()), its chunk's path and whether it was answered OK.
``broker STORE``: a real broker and client; prints each of three sends' outcome.
``topics STORE``: a broker (``--flush sync``) and two clients: one sends to topic "t"
without pause (the C flusher busy when topics are made), the other makes topic "auto" by
its first send and "made" by the create_topic op and a send, then two consumer groups
join and nack a message each (their retry topics at the join, a dead-letter and the delay
topic at the nacks); prints each creation's topic and when its first request left and its
answer came (time.monotonic_ns()), and the topics at the end."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import equeue
from equeue import MessageStore, StoreConfig
from equeue.server import BrokerThread
from equeue.server.groupcommit import CrossClientCommit

CONNECTIONS, SENDS, LIMIT_S = 8, 40, 20.0
BACKGROUND_SENDS = 400  # topics: the most "t" gets


class Connection:
    def __init__(self, store: MessageStore, number: int, sends: list[list[Any]]) -> None:
        self.store, self.number, self.sends = store, number, sends
        self.commit: CrossClientCommit | None = None
        self.left = SENDS
        self.done = asyncio.Event()

    def send(self) -> None:
        assert self.commit is not None
        self.store.send("t", b"b" * 900, queue_id=self.number % 4)
        chunk = self.store._writer._chunk  # holds the record (a rollover came before it)
        assert chunk is not None
        self.sends.append([time.monotonic_ns(), None, str(chunk.path), False])
        self.commit.add(self, len(self.sends) - 1, None)

    def finish(self, request_id: int, outcome: object) -> None:
        record = self.sends[request_id]
        record[1], record[3] = time.monotonic_ns(), not isinstance(outcome, BaseException)
        self.left -= 1
        if self.left:
            self.send()
        else:
            self.done.set()


async def order(store: MessageStore) -> dict[str, Any]:
    sends: list[list[Any]] = []
    commit = CrossClientCommit(asyncio.get_running_loop(), store.flush_log, store=store)
    try:
        conns = [Connection(store, n, sends) for n in range(CONNECTIONS)]
        for conn in conns:
            conn.commit = commit
            conn.send()
        await asyncio.wait_for(asyncio.gather(*(c.done.wait() for c in conns)), LIMIT_S)
    finally:
        commit.close()
    return {"flusher": type(commit._sync).__name__, "sends": sends}


def topics(path: Path) -> dict[str, Any]:
    sock = path.parent / "b.sock"  # the test's short directory
    creations: list[tuple[str, int, int]] = []
    topics: list[str] = []
    answered = 0
    stop = threading.Event()
    with BrokerThread(path, flush="sync", listen=[f"unix:{sock}"]) as broker:
        name = type(broker.broker.commit._sync).__name__  # type: ignore[union-attr]
        url = broker.urls[0]
        with equeue.connect(url) as client:
            client.create_topic("t", 2)

        def background() -> None:
            nonlocal answered
            deadline = time.monotonic() + LIMIT_S
            with equeue.connect(url) as client:
                while answered < BACKGROUND_SENDS and time.monotonic() < deadline:
                    if stop.is_set() and answered >= 50:
                        break
                    client.send("t", b"t" * 200)
                    answered += 1

        thread = threading.Thread(target=background)
        thread.start()
        time.sleep(0.05)
        with equeue.connect(url) as client:
            begin = time.monotonic_ns()
            client.send("auto", b"first")  # created by its first send
            creations.append(("auto", begin, time.monotonic_ns()))
            time.sleep(0.02)
            begin = time.monotonic_ns()
            client.create_topic("made", 3)
            client.send("made", b"first", queue_id=2)
            creations.append(("made", begin, time.monotonic_ns()))
            # A consumer group's topics: its retry topic at the join, the dead-letter
            # topic at a nack past max_retries, the delay topic at a delayed nack.
            for group, retries, made in (("d", 0, "equeue.dlq.d"), ("w", 5, "equeue.delay")):
                begin = time.monotonic_ns()
                with client.consumer(group, "t", max_retries=retries) as consumer:
                    message = consumer.poll(LIMIT_S)
                    creations.append((f"equeue.retry.{group}", begin, time.monotonic_ns()))
                    assert message is not None
                    begin = time.monotonic_ns()
                    consumer.nack(message)  # answered once durable (--flush sync)
                    creations.append((made, begin, time.monotonic_ns()))
            topics = client.topics()
        stop.set()
        thread.join(LIMIT_S)
    return {"flusher": name, "creations": creations, "answered": answered, "topics": topics}


def main() -> None:
    mode, path = sys.argv[1], Path(sys.argv[2])
    if mode == "topics":
        print(json.dumps(topics(path)))
        return
    if mode == "order":
        store = MessageStore.open(
            path, StoreConfig(chunk_data_size=64 * 1024, queue_chunk_records=1024)
        )
        try:
            store.create_topic("t", 4)
            print(json.dumps(asyncio.run(order(store))))
        finally:
            store.close()
        return
    outcomes: list[str] = []
    sock = path.parent / "b.sock"  # the test's short directory
    with BrokerThread(path, flush="sync", listen=[f"unix:{sock}"]) as broker:
        name = type(broker.broker.commit._sync).__name__  # type: ignore[union-attr]
        with equeue.connect(broker.urls[0]) as client:
            client.create_topic("t", 1)
            for body in (b"one", b"two", b"three"):
                try:
                    outcomes.append(f"ok {client.send('t', body).queue_offset}")
                except equeue.errors.EQueueError as exc:
                    outcomes.append(f"error {exc}")
    print(json.dumps({"flusher": name, "outcomes": outcomes}))


if __name__ == "__main__":
    main()
