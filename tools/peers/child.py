"""One case, in a child process: the timed loops and the memory they took."""

from __future__ import annotations

import contextlib
import importlib
import json
import operator
import resource
import threading
import time
from collections.abc import Callable, Mapping
from itertools import cycle, islice
from pathlib import Path
from typing import Any

from peers.scenarios import PEER, bodies_for, stream
from peers.stores import BATCH, Store


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def anon_rss_mib() -> float:
    """Private (anonymous) resident memory now: ru_maxrss also counts the mapped file pages
    a store touched, which the kernel can drop at will."""
    with contextlib.suppress(OSError), open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def case_append(store: Store, spec: Mapping[str, Any]) -> dict[str, Any]:
    count = spec["count"]
    bodies = stream(spec["size"], count)
    append = store.append_batch if spec["variant"] == "send_batch" else store.append
    started = time.perf_counter()
    append(bodies)
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "rate": count / seconds, "stored": store.count()}


def case_consume(store: Store, spec: Mapping[str, Any]) -> dict[str, Any]:
    count = spec["count"]
    stored = store.count()
    expected = stream(spec["size"], count)
    started = time.perf_counter()
    # map pulls the store's stream first, so it stops at the shorter without losing a message
    mismatches = sum(map(operator.ne, store.consume(count), expected))
    seconds = time.perf_counter() - started
    read = count - sum(1 for _ in expected)
    return {
        "seconds": seconds,
        "rate": read / seconds,
        "stored": stored,
        "read": read,
        "mismatches": mismatches,
    }


def case_durable(store: Store, spec: Mapping[str, Any]) -> dict[str, Any]:
    threads, per_thread = spec["threads"], spec["count"] // spec["threads"]
    bodies = bodies_for(spec["size"])
    put = store.put_durable
    if not store.threadsafe and threads > 1:
        lock = threading.Lock()

        def put(body: bytes, _put: Callable[[bytes], None] = store.put_durable) -> None:
            with lock:
                _put(body)

    start = threading.Barrier(threads + 1)
    failures: list[BaseException] = []

    def produce(i: int) -> None:
        start.wait()
        try:
            for body in islice(cycle(bodies), i, i + per_thread):
                put(body)
        except BaseException as exc:
            failures.append(exc)

    workers = [threading.Thread(target=produce, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    start.wait()
    started = time.perf_counter()
    for worker in workers:
        worker.join()
    seconds = time.perf_counter() - started
    if failures:
        raise failures[0]
    total = per_thread * threads
    return {"seconds": seconds, "rate": total / seconds, "stored": store.count()}


def run_case(spec: Mapping[str, Any]) -> dict[str, Any]:
    peer = PEER[spec["peer"]]
    op = spec["op"]
    for module in peer.store.modules:
        importlib.import_module(module)
    directory = Path(spec["dir"])
    if op == "reopen":
        started = time.perf_counter()
        store = peer.store(directory, False)
        body = store.first()
        seconds = time.perf_counter() - started
        found = store.count() + (1 if body is not None and store.destructive else 0)
        result: dict[str, Any] = {
            "seconds": seconds,
            "first_ok": body == bodies_for(spec["size"])[0],
            "empty": body is None,
            "stored": found,
        }
    else:
        store = peer.store(directory, op == "durable")
        if op == "append":
            result = case_append(store, spec)
        elif op == "consume":
            result = case_consume(store, spec)
        elif op == "durable":
            result = case_durable(store, spec)
        elif op == "fill":
            append = store.append_batch if peer.key == "equeue" else store.append
            append(stream(spec["size"], spec["count"]))
            if spec.get("then_wait_for_kill"):
                print(json.dumps({"ready": True}), flush=True)
                while True:  # keep writing, so the kill lands in the middle of an append
                    append(stream(spec["size"], BATCH))
            result = {}
        else:
            raise ValueError(f"unknown case op {op!r}")
    result["note"] = store.note()
    result["anon_mib"] = anon_rss_mib()
    store.close()
    result["rss_mib"] = peak_rss_mib()
    return result
