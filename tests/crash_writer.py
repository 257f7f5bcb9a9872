"""The crash tests' workload, and the writer subprocess the kill tests SIGKILL.

Every message says who sent it: producer ``p`` sends sequence numbers 0, 1,
2, ... to its own queue (``PRODUCERS[p]``), one send or batch at a time, and
every field of message ``(p, seq)`` (body, tag, key, properties, code) is a
function of ``(p, seq)``. A checker can therefore verify byte-identity and
per-producer order from the store alone, without trusting it.

Run as a script it is the writer::

    python tests/crash_writer.py STORE_DIR --policy sync --seed 7

It opens (and so recovers) the store, resumes every producer after the last
message the store holds, prints ``READY``, then runs one thread per producer
plus one that calls ``flush()`` at random moments, until it is killed. With
``--retention`` the store keeps at most ``RETENTION_CHUNKS`` log chunks
(``max_store_bytes``, applied by the service after its checkpoints) and a thread
calls ``apply_retention()`` every few milliseconds, while ``QUIET_PRODUCER`` pauses
now and then; as retention may have removed
every message of a producer, ``--start P:SEQ ...`` says where producers resume at
the least (past every seq a previous run attempted). On stdout, in one ``write``
each (so lines never interleave), it prints::

    T <producer> <first seq> <count>                          before a send or batch
    A <producer> <seq> <topic> <queue> <offset> <position> <id>   after it returned

A send that printed its ``A`` line was acknowledged. If a thread fails, the
traceback goes to stderr and the process exits with status 3.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import random
import re
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from equeue import MessageStore, OutgoingMessage, SendResult, StoreConfig
from equeue.format.chunk import MIN_CHUNK_DATA_SIZE, chunk_file_size
from equeue.format.message import QUEUE_RECORD_SIZE

TOPICS: dict[str, int] = {"a": 3, "b": 1}
# Producer -> (topic, queue id). Producers 0 and 4 share queue a/0.
PRODUCERS: tuple[tuple[str, int], ...] = (("a", 0), ("a", 1), ("a", 2), ("b", 0), ("a", 0))
POLICIES = ("sync", "async", "os")
MAX_BATCH = 6
RETENTION_CHUNKS = 3  # --retention: the log chunks max_store_bytes keeps
QUIET_PRODUCER = 3  # --retention: it pauses now and then (alone on its queue, b/0)
EXIT_THREAD_FAILED = 3
CONFIG_ENV = "EQUEUE_CRASH_CONFIG"  # JSON: StoreConfig settings over store_config's
# "1": QUIET_PRODUCER (alone on b/0, one queue) sends bodies alone, every send a
# send_batch of bytes (the C batch append, store/bodies.py); the checkers read it too.
PLAIN_ENV = "EQUEUE_CRASH_PLAIN"

_HEAD = re.compile(rb"p(\d+)s(\d+):")


def store_config(policy: str, **overrides: int) -> StoreConfig:
    """Small chunks, so that message and queue chunks roll over often."""
    settings: dict[str, int] = {
        "chunk_data_size": MIN_CHUNK_DATA_SIZE,
        # The smallest queue chunk that holds at least MIN_CHUNK_DATA_SIZE bytes (342 entries).
        "queue_chunk_records": -(-MIN_CHUNK_DATA_SIZE // QUEUE_RECORD_SIZE),
        "default_queue_count": 1,
        "flush_interval_ms": 20,
        "key_index_batch": 32,  # the service checkpoints often
    }
    # A test's variant of the layout (tests/test_store_diskuse.py), for writer and checker.
    settings.update(json.loads(os.environ.get(CONFIG_ENV, "{}")))
    settings.update(overrides)
    return StoreConfig(flush=policy, **settings)  # type: ignore[arg-type]


def retention_config(policy: str) -> StoreConfig:
    """store_config, and at most RETENTION_CHUNKS log chunks: retention removes chunks
    every few sends."""
    return store_config(
        policy, max_store_bytes=RETENTION_CHUNKS * chunk_file_size(MIN_CHUNK_DATA_SIZE)
    )


def _mix(producer: int, seq: int) -> int:
    digest = hashlib.blake2b(b"%d/%d" % (producer, seq), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def body_size(producer: int, seq: int) -> int:
    """Mostly 8..300 bytes; one message in 40 is 1..2.5 KiB (it often forces a rollover)."""
    h = _mix(producer, seq)
    if h % 40 == 0:
        return 1000 + (h >> 8) % 1500
    return 8 + (h >> 8) % 293


def make_body(producer: int, seq: int) -> bytes:
    head = b"p%ds%d:" % (producer, seq)
    size = body_size(producer, seq)
    block = hashlib.blake2b(head, digest_size=64).digest()
    return head + (block * (size // 64 + 1))[:size]


def parse_body(body: bytes) -> tuple[int, int] | None:
    """(producer, seq) of a workload body, or None if it is not exactly one."""
    match = _HEAD.match(body)
    if match is None:
        return None
    producer, seq = int(match.group(1)), int(match.group(2))
    if not 0 <= producer < len(PRODUCERS) or body != make_body(producer, seq):
        return None
    return producer, seq


def plain(producer: int) -> bool:
    return producer == QUIET_PRODUCER and os.environ.get(PLAIN_ENV) == "1"


def tag_of(producer: int, seq: int) -> str:
    return "" if plain(producer) else f"t{seq % 3}"


def key_of(producer: int, seq: int) -> str | None:
    return f"k{producer}.{seq % 4}" if seq % 2 == 0 and not plain(producer) else None


def keys_of(producer: int) -> list[str]:
    return [f"k{producer}.{i}" for i in range(4)]


def properties_of(producer: int, seq: int) -> dict[str, str]:
    return {"seq": str(seq), "p": str(producer)} if seq % 5 == 0 and not plain(producer) else {}


def code_of(producer: int, seq: int) -> int:
    return 0 if plain(producer) else seq % 1000 - 500


def outgoing(producer: int, seq: int) -> OutgoingMessage:
    _, queue_id = PRODUCERS[producer]
    return OutgoingMessage(
        make_body(producer, seq),
        tag=tag_of(producer, seq),
        key=key_of(producer, seq),
        properties=properties_of(producer, seq) or None,
        code=code_of(producer, seq),
        queue_id=queue_id,
    )


def send(store: MessageStore, producer: int, seq: int, count: int) -> list[SendResult]:
    """Messages seq..seq+count-1 of ``producer``: one send, or one send_batch."""
    topic, _ = PRODUCERS[producer]
    if plain(producer):
        return store.send_batch(topic, [make_body(producer, s) for s in range(seq, seq + count)])
    if count == 1:
        m = outgoing(producer, seq)
        return [
            store.send(
                topic,
                m.body,
                tag=m.tag,
                key=m.key,
                properties=m.properties,
                code=m.code,
                queue_id=m.queue_id,
            )
        ]
    return store.send_batch(topic, [outgoing(producer, s) for s in range(seq, seq + count)])


@dataclass(frozen=True)
class Ack:
    """What a send returned for message ``seq`` of ``producer``."""

    producer: int
    seq: int
    topic: str
    queue_id: int
    queue_offset: int
    position: int
    message_id: str

    @classmethod
    def of(cls, producer: int, seq: int, result: SendResult) -> Ack:
        return cls(
            producer,
            seq,
            result.topic,
            result.queue_id,
            result.queue_offset,
            result.position,
            result.message_id,
        )

    def line(self) -> bytes:
        return (
            f"A {self.producer} {self.seq} {self.topic} {self.queue_id} {self.queue_offset} "
            f"{self.position} {self.message_id}\n"
        ).encode()

    @classmethod
    def parse(cls, fields: list[str]) -> Ack:
        p, seq, topic, qid, qoff, pos, mid = fields
        return cls(int(p), int(seq), topic, int(qid), int(qoff), int(pos), mid)


def next_seqs(store: MessageStore) -> dict[int, int]:
    """Per producer, one past the last seq the store holds (0 if none)."""
    following = {p: 0 for p in range(len(PRODUCERS))}
    for topic in store.topics():
        for queue_id in store.queue_ids(topic):
            offset, end = store.queue_range(topic, queue_id)
            while offset < end:
                pulled = store.pull(topic, queue_id, offset, max_count=512)
                for message in pulled.messages:
                    parsed = parse_body(message.body)
                    if parsed is None:
                        raise AssertionError(
                            f"{topic}/{queue_id} offset {message.queue_offset}: not a workload "
                            "message"
                        )
                    following[parsed[0]] = max(following[parsed[0]], parsed[1] + 1)
                if pulled.next_offset <= offset:
                    break
                offset = pulled.next_offset
    return following


# --- the writer process ----------------------------------------------------------------


def _emit(data: bytes) -> None:
    os.write(1, data)  # one write of < PIPE_BUF bytes: never interleaved with another thread's


def _guarded(work: Callable[[], None]) -> None:
    try:
        work()
    except BaseException:
        traceback.print_exc(file=sys.stderr)
        sys.stderr.flush()
        os._exit(EXIT_THREAD_FAILED)


def _produce(
    store: MessageStore,
    producer: int,
    seq: int,
    rng: random.Random,
    deadline: float,
    pauses: bool = False,
) -> None:
    while time.monotonic() < deadline:
        count = 1 if rng.random() < 0.7 else rng.randint(2, MAX_BATCH)
        _emit(b"T %d %d %d\n" % (producer, seq, count))
        results = send(store, producer, seq, count)
        _emit(b"".join(Ack.of(producer, seq + i, r).line() for i, r in enumerate(results)))
        seq += count
        if pauses and rng.random() < 0.2:
            # A queue that goes quiet while retention removes the chunks of its last
            # sends: what recovery must not cut back to the checkpoint's offset.
            time.sleep(rng.uniform(0.005, 0.1))


def _flush_now_and_then(store: MessageStore, rng: random.Random, deadline: float) -> None:
    while time.monotonic() < deadline:
        time.sleep(rng.uniform(0.005, 0.15))
        store.flush()


def _retain_now_and_then(store: MessageStore, rng: random.Random, deadline: float) -> None:
    while time.monotonic() < deadline:
        time.sleep(rng.uniform(0.0, 0.02))
        store.apply_retention()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("store", type=Path)
    parser.add_argument("--policy", choices=POLICIES, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--seconds", type=float, default=60.0, help="stop on its own after this long"
    )
    parser.add_argument("--retention", action="store_true", help="see the module docstring")
    parser.add_argument("--start", nargs="*", default=[], metavar="P:SEQ")
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.seconds
    config = retention_config(args.policy) if args.retention else store_config(args.policy)
    store = MessageStore.open(args.store, config)
    for topic, count in TOPICS.items():
        if topic not in store.topics() or len(store.queue_ids(topic)) < count:
            store.create_topic(topic, count)
    seqs = next_seqs(store)
    for start in args.start:
        producer, seq = map(int, start.split(":"))
        seqs[producer] = max(seqs[producer], seq)
    _emit(b"READY\n")
    work: list[Callable[[], None]] = [
        functools.partial(
            _produce,
            store,
            p,
            seqs[p],
            random.Random(args.seed * 97 + p),
            deadline,
            args.retention and p == QUIET_PRODUCER,
        )
        for p in range(len(PRODUCERS))
    ]
    work.append(functools.partial(_flush_now_and_then, store, random.Random(args.seed), deadline))
    if args.retention:
        rng = random.Random(args.seed + 1)
        work.append(functools.partial(_retain_now_and_then, store, rng, deadline))
    threads = [threading.Thread(target=_guarded, args=(w,)) for w in work]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    store.close()
    _emit(b"DONE\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
