"""CPU time per operation of the read paths beside a plain pull, in one process: ``get``,
``query_by_key``, a ``Consumer.poll`` loop, pulls whose messages are read field by field
or as lists (the broker's packing), and a consumer that keeps every message it pulls
(where the garbage collector's generations see the survivors). Prints one JSON line:
µs per operation, and the collections the keep-all case caused.

Run it alternately on two checkouts (``PYTHONPATH=... python tools/bench_read_paths.py``)
to compare them; CPU time (not wall time) is what a shared machine disturbs least.
"""

from __future__ import annotations

import gc
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from equeue import Message, MessageStore, PullResult, StoreConfig

MESSAGES = 50_000
KEYED = 2_000
KEPT = 200_000


def per_op(run: Callable[[], object], count: int) -> float:
    started = time.process_time()
    run()
    return round((time.process_time() - started) / count * 1e6, 3)


def main() -> int:
    directory = tempfile.mkdtemp(prefix="eqrp", dir="/tmp")
    out: dict[str, Any] = {}
    try:
        with MessageStore.open(directory + "/s", StoreConfig(flush="async")) as store:
            store.create_topic("t", 1)
            sent = store.send_batch("t", [b"x" * 100] * MESSAGES)
            for i in range(KEYED):
                store.send("t", b"k", key=f"key{i % 20}", properties={"a": "b"})
            ids = [result.message_id for result in sent[:20_000]]
            out["get"] = per_op(lambda: [store.get(i) for i in ids], len(ids))
            queries = [f"key{i % 20}" for i in range(200)]
            out["query_by_key"] = per_op(
                lambda: [store.query_by_key("t", key) for key in queries], len(queries)
            )

            def pulled(use: Callable[[PullResult], object]) -> None:
                offset = 0
                while offset < MESSAGES:
                    batch = store.pull("t", 0, offset, 256)
                    offset = batch.next_offset
                    use(batch)

            def fields(m: Message) -> tuple[object, ...]:
                return (m.message_id, m.queue_offset, m.position, m.properties, m.body,
                        m.created_ns, m.stored_ns)  # fmt: skip

            out["pull, list(m)"] = per_op(lambda: pulled(lambda b: [list(m) for m in b]), MESSAGES)
            out["pull, fields"] = per_op(lambda: pulled(lambda b: [fields(m) for m in b]), MESSAGES)
            out["pull, properties"] = per_op(
                lambda: pulled(lambda b: [m.properties for m in b]), MESSAGES
            )

            def consume() -> None:
                consumer = store.consumer("g", "t", start="earliest", batch_size=256, timeout=0)
                taken = 0
                while taken < MESSAGES and (got := consumer.poll(256)):
                    taken += len(got)
                consumer.commit()

            out["consumer poll"] = per_op(consume, MESSAGES)
        with MessageStore.open(directory + "/k", StoreConfig(flush="async")) as store:
            store.create_topic("t", 1)
            for _ in range(KEPT // 1000):
                store.send_batch("t", [b"x" * 100] * 1000)
            kept: list[Message] = []
            before = [g["collections"] for g in gc.get_stats()]

            def keep() -> None:
                offset = 0
                while offset < KEPT:
                    batch = store.pull("t", 0, offset, 256)
                    offset = batch.next_offset
                    kept.extend(batch)

            out["pull, keep all"] = per_op(keep, KEPT)
            after = [g["collections"] for g in gc.get_stats()]
            out["keep all: collections by generation"] = [
                a - b for a, b in zip(after, before, strict=True)
            ]
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
