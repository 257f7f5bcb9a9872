"""Many producer and consumer threads on one store: nothing lost, duplicated or reordered."""

from __future__ import annotations

import threading
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from equeue import Message, MessageStore, OutgoingMessage, SendResult, StoreConfig

PRODUCERS = 8
CONSUMERS = 4
PER_PRODUCER = 400
QUEUES = 4
DEADLINE_S = 120.0  # only a guard against a hang; never reached when the store works


def body_of(producer: int, seq: int) -> bytes:
    return f"{producer}:{seq}:".encode() + bytes([producer]) * ((producer * 31 + seq * 7) % 200)


def queue_of(producer: int, seq: int) -> int:
    return (producer + seq) % QUEUES


def test_producers_and_consumers(tmp_path: Path) -> None:
    config = StoreConfig(
        chunk_data_size=16384,
        queue_chunk_records=400,
        default_queue_count=QUEUES,
        max_open_chunks=2,  # consumers keep mapping and unmapping completed chunks
    )
    with MessageStore.open(tmp_path / "store", config) as store:
        store.create_topic("t", QUEUES)
        sent: dict[int, list[SendResult]] = {}
        pulled: dict[int, list[Message]] = {}
        errors: list[BaseException] = []
        start = threading.Barrier(PRODUCERS + CONSUMERS)
        expected_per_queue: defaultdict[int, int] = defaultdict(int)
        for p in range(PRODUCERS):
            for i in range(PER_PRODUCER):
                expected_per_queue[queue_of(p, i)] += 1

        def produce(p: int) -> None:
            try:
                start.wait()
                results: list[SendResult] = []
                i = 0
                while i < PER_PRODUCER:
                    if p % 2:  # odd producers send batches of up to 7
                        n = min(1 + (i % 7), PER_PRODUCER - i)
                        batch = [
                            OutgoingMessage(
                                body_of(p, j), tag=f"p{p}", key=None, queue_id=queue_of(p, j)
                            )
                            for j in range(i, i + n)
                        ]
                        results += store.send_batch("t", batch)
                        i += n
                    else:
                        results.append(
                            store.send(
                                "t",
                                body_of(p, i),
                                tag=f"p{p}",
                                properties={"seq": str(i)},
                                queue_id=queue_of(p, i),
                            )
                        )
                        i += 1
                sent[p] = results
            except BaseException as exc:
                errors.append(exc)

        def consume(q: int) -> None:
            try:
                start.wait()
                messages: list[Message] = []
                offset = 0
                deadline = threading.Event()
                timer = threading.Timer(DEADLINE_S, deadline.set)
                timer.start()
                try:
                    while len(messages) < expected_per_queue[q] and not deadline.is_set():
                        result = store.pull("t", q, offset, max_count=1 + offset % 50, wait=0.05)
                        messages += result.messages
                        assert result.next_offset == offset + len(result.messages)
                        offset = result.next_offset
                        if result.messages:
                            store.commit_offset(f"c{q}", "t", q, offset)
                finally:
                    timer.cancel()
                pulled[q] = messages
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=produce, args=(p,)) for p in range(PRODUCERS)]
        threads += [threading.Thread(target=consume, args=(q,)) for q in range(CONSUMERS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        assert len(sent) == PRODUCERS
        assert len(pulled) == CONSUMERS

        # Every send result is unique and dense per queue.
        all_results = [r for results in sent.values() for r in results]
        assert len(all_results) == PRODUCERS * PER_PRODUCER
        assert len({r.message_id for r in all_results}) == len(all_results)
        assert len({r.position for r in all_results}) == len(all_results)
        for q in range(QUEUES):
            offsets = sorted(r.queue_offset for r in all_results if r.queue_id == q)
            assert offsets == list(range(expected_per_queue[q]))
            assert store.queue_range("t", q) == (0, expected_per_queue[q])
            assert store.committed_offset(f"c{q}", "t", q) == expected_per_queue[q]

        by_id = {
            r.message_id: (p, i, r) for p, results in sent.items() for i, r in enumerate(results)
        }
        for q, messages in pulled.items():
            # Nothing lost, nothing duplicated, offsets dense and in order.
            assert [m.queue_offset for m in messages] == list(range(expected_per_queue[q]))
            assert len({m.message_id for m in messages}) == len(messages)
            last_seq: dict[int, int] = {}
            last_position = -1
            for m in messages:
                p, i, result = by_id[m.message_id]
                assert m.queue_id == q == queue_of(p, i) == result.queue_id
                assert (m.queue_offset, m.position) == (result.queue_offset, result.position)
                assert m.body == body_of(p, i)
                assert m.tag == f"p{p}"
                assert m.properties == ({} if p % 2 else {"seq": str(i)})
                # Each producer's messages appear in its send order.
                assert i > last_seq.get(p, -1)
                last_seq[p] = i
                # A queue's offsets follow log order.
                assert m.position > last_position
                last_position = m.position
            assert sorted(last_seq) == list(range(PRODUCERS))

        # What the consumers saw while the producers ran is what is stored.
        for q in range(QUEUES):
            again = store.pull("t", q, 0, max_count=10_000)
            assert again.messages == pulled[q]
            assert again.next_offset == expected_per_queue[q]
        assert len(list((store.path / "messages").glob("chunk-*"))) > 10
        assert len(list((store.path / "queues" / "t" / "0").glob("chunk-*"))) >= 2


def test_pull_while_retention_removes_the_chunk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The interleaving a retention run (service thread) and a consumer can hit, made
    deterministic: retention runs between the pull's chunk lookup and its read."""
    config = StoreConfig(
        chunk_data_size=4096, queue_chunk_records=400, default_queue_count=1, max_store_bytes=1
    )
    with MessageStore.open(tmp_path / "store", config) as store:
        results = [store.send("t", b"x" * 300) for _ in range(60)]
        last_chunk = results[-1].position // 4096
        assert last_chunk >= 3
        store.pull("t", 0, 0, max_count=100)  # maps the completed chunks
        manager = store._messages
        lookup = manager.get_chunk_for
        armed = [True]

        def racing(position: int) -> Any:
            chunk = lookup(position)
            if armed[0]:
                armed[0] = False
                assert store.apply_retention() == last_chunk
            return chunk

        monkeypatch.setattr(manager, "get_chunk_for", racing)
        result = store.pull("t", 0, 0, max_count=100)
        kept = [r for r in results if r.position // 4096 == last_chunk]
        assert [m.message_id for m in result.messages] == [r.message_id for r in kept]
