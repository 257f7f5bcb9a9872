"""What a worker process runs: one runner per job kind. ``__init__`` sets up (connects,
opens), ``run()`` is the timed part, ``close()`` tears down; none of it is shared between
processes. Every loop stops at its count or at its time cap (``cap`` seconds), whichever
comes first, and reports what it did."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import redis
import redis.asyncio

FIELD = b"b"  # the one field of a Redis stream entry: the body


class Runner(Protocol):
    def run(self) -> dict[str, Any]: ...
    def close(self) -> None: ...


def make_runner(job: dict[str, Any]) -> Runner:
    kind = job["kind"]
    if kind in BROKER_KINDS:
        from brokerbench import broker_side  # the client, only where a job uses it

        return broker_side.make(job)
    runner: Runner = RUNNERS[kind](job)
    return runner


BROKER_KINDS = {"broker_produce", "broker_consume", "broker_latency", "broker_durable"}


def bodies(size: int, count: int = 64) -> list[bytes]:
    """Distinct random bodies, cycled: nothing compresses and nothing is one shared object."""
    return [os.urandom(size) for _ in range(count)]


def result(count: int, t0: float, t1: float, **extra: Any) -> dict[str, Any]:
    return {"count": count, "t0": t0, "t1": t1, **extra}


def timed(call: Callable[[int], object], count: int, cap: float) -> dict[str, Any]:
    """``call(i)`` for i in range(count), one at a time, each timed (ns)."""
    samples: list[int] = []
    clock = time.perf_counter_ns
    t0 = time.perf_counter()
    stop = t0 + cap
    for i in range(count):
        start = clock()
        call(i)
        samples.append(clock() - start)
        if not i % 64 and time.perf_counter() > stop:
            break
    return result(len(samples), t0, time.perf_counter(), samples=samples)


class StoreProduce:
    """The in-process store: ``MessageStore.send`` / ``send_batch`` in this process."""

    def __init__(self, job: dict[str, Any]) -> None:
        from equeue import MessageStore, StoreConfig

        self.job = job
        self.store = MessageStore.open(Path(job["dir"]), StoreConfig(flush=job["flush"]))
        self.bodies = bodies(job["body"])

    def run(self) -> dict[str, Any]:
        store, topic, count, batch, cap = (
            self.store,
            self.job["topic"],
            self.job["count"],
            self.job["batch"],
            self.job["cap"],
        )
        body_list, n = self.bodies, len(self.bodies)
        done = 0
        t0 = time.perf_counter()
        stop = t0 + cap
        if batch == 1:
            send = store.send
            while done < count:
                for i in range(min(1000, count - done)):
                    send(topic, body_list[i % n])
                done += min(1000, count - done)
                if time.perf_counter() > stop:
                    break
        else:
            chunk = [body_list[i % n] for i in range(batch)]
            send_batch = store.send_batch
            while done < count:
                size = min(batch, count - done)
                send_batch(topic, chunk[:size] if size < batch else chunk)
                done += size
                if time.perf_counter() > stop:
                    break
        t1 = time.perf_counter()
        stored = 0
        for queue_id in store.queue_ids(topic):
            first, end = store.queue_range(topic, queue_id)
            stored += end - first
        return result(done, t0, t1, stored=stored)

    def close(self) -> None:
        self.store.close()


class StoreLatency:
    """The in-process reference of a round trip: ``MessageStore.send``, each timed."""

    def __init__(self, job: dict[str, Any]) -> None:
        from equeue import MessageStore, StoreConfig

        self.job = job
        self.store = MessageStore.open(Path(job["dir"]), StoreConfig(flush="async"))
        self.bodies = bodies(job["body"])

    def run(self) -> dict[str, Any]:
        topic, count, warmup, cap = (
            self.job["topic"],
            self.job["count"],
            self.job["warmup"],
            self.job["cap"],
        )
        send, body_list, n = self.store.send, self.bodies, len(self.bodies)
        for i in range(warmup):
            send(topic, body_list[i % n])
        return timed(lambda i: send(topic, body_list[i % n]), count, cap)

    def close(self) -> None:
        self.store.close()


class _RedisJob:
    """One redis-py connection over the server's Unix socket, checked with a PING."""

    def __init__(self, job: dict[str, Any]) -> None:
        self.job = job
        self.client = redis.Redis(unix_socket_path=job["socket"])
        self.client.ping()

    def close(self) -> None:
        self.client.close()


class RedisProduce(_RedisJob):
    """XADD through redis-py pipelines (transaction=False) of ``batch`` commands: Redis has
    no many-entries XADD, so this is its batch; each XADD is its own command and reply."""

    def __init__(self, job: dict[str, Any]) -> None:
        super().__init__(job)
        self.bodies = bodies(job["body"])

    def run(self) -> dict[str, Any]:
        key, count, batch, cap = (
            self.job["key"],
            self.job["count"],
            self.job["batch"],
            self.job["cap"],
        )
        body_list, n = self.bodies, len(self.bodies)
        done = 0
        t0 = time.perf_counter()
        stop = t0 + cap
        while done < count:
            size = min(batch, count - done)
            pipe = self.client.pipeline(transaction=False)
            for i in range(size):
                pipe.xadd(key, {FIELD: body_list[i % n]})
            pipe.execute()
            done += size
            if time.perf_counter() > stop:
                break
        return result(done, t0, time.perf_counter())


class RedisConsume(_RedisJob):
    """One consumer of a Redis consumer group: XREADGROUP of ``batch`` entries, and the
    XACK of a batch in the same pipeline as the next XREADGROUP (one round trip each);
    stops when the stream has nothing more for the group (it was filled beforehand)."""

    def run(self) -> dict[str, Any]:
        key, group, name, batch, cap = (
            self.job["key"],
            self.job["group"],
            self.job["consumer"],
            self.job["batch"],
            self.job["cap"],
        )
        done = checked = 0
        acked = 0
        t0 = time.perf_counter()
        stop = t0 + cap
        ids: list[bytes] = []
        while True:
            pipe = self.client.pipeline(transaction=False)
            if ids:
                pipe.xack(key, group, *ids)
            pipe.xreadgroup(group, name, {key: ">"}, count=batch)
            answers = pipe.execute()
            if ids:
                acked += int(answers[0])
            entries = answers[-1][0][1] if answers[-1] else []
            ids = [entry_id for entry_id, _ in entries]
            for _, fields in entries:
                checked += len(fields[FIELD])
            done += len(entries)
            if not entries or time.perf_counter() > stop:
                break
        if ids:
            acked += int(self.client.xack(key, group, *ids))
        return result(done, t0, time.perf_counter(), acked=acked, body_bytes=checked)


class RedisLatency(_RedisJob):
    """One XADD at a time, each timed; nothing else on the connection."""

    def __init__(self, job: dict[str, Any]) -> None:
        super().__init__(job)
        self.bodies = bodies(job["body"])

    def run(self) -> dict[str, Any]:
        key, count, warmup, cap = (
            self.job["key"],
            self.job["count"],
            self.job["warmup"],
            self.job["cap"],
        )
        xadd, body_list, n = self.client.xadd, self.bodies, len(self.bodies)
        for i in range(warmup):
            xadd(key, {FIELD: body_list[i % n]})
        return timed(lambda i: xadd(key, {FIELD: body_list[i % n]}), count, cap)


async def _xadd_durable(
    client: Any, key: str, per_task: int, body_list: list[bytes], stop: float
) -> int:
    """One producer task: one XADD at a time, each awaited, until ``per_task`` or ``stop``."""
    done, n = 0, len(body_list)
    while done < per_task and time.perf_counter() < stop:
        await client.xadd(key, {FIELD: body_list[done % n]})
        done += 1
    return done


def new_loop(job: dict[str, Any]) -> asyncio.AbstractEventLoop:
    """The job's event loop: asyncio's, or uvloop's (``--client-loop uvloop``: the asyncio
    producers of both systems, ours and redis-py's, run on the same loop)."""
    if job.get("client_loop") == "uvloop":
        import uvloop

        loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
        return loop
    return asyncio.new_event_loop()


class RedisDurable:
    """``producers`` asyncio tasks in this process, each one XADD at a time (awaiting its
    reply): Redis's concurrency under ``appendfsync always``. Per connection (``shared``
    false): a ``single_connection_client`` each. Shared: one ``redis.asyncio.Redis`` for
    all the tasks, whose pool lends each concurrent command a connection of its own (the
    pool is filled with ``producers`` connections before the timed part)."""

    def __init__(self, job: dict[str, Any]) -> None:
        self.job = job
        self.loop = new_loop(job)
        tasks, path = job["producers"], job["socket"]

        async def connect() -> list[redis.asyncio.Redis]:
            # made inside the loop that uses them: redis-py binds its futures to it
            if job.get("shared"):
                clients = [redis.asyncio.Redis(unix_socket_path=path)] * tasks
            else:
                clients = [
                    redis.asyncio.Redis(unix_socket_path=path, single_connection_client=True)
                    for _ in range(tasks)
                ]
            await asyncio.gather(*(c.ping() for c in clients))
            return clients

        self.clients = self.loop.run_until_complete(connect())
        self.bodies = bodies(job["body"])

    def run(self) -> dict[str, Any]:
        return self.loop.run_until_complete(self._run())

    async def _run(self) -> dict[str, Any]:
        key, count, cap = self.job["key"], self.job["count"], self.job["cap"]
        per_task = -(-count // len(self.clients))
        t0 = time.perf_counter()
        stop = t0 + cap
        counts = await asyncio.gather(
            *(_xadd_durable(c, key, per_task, self.bodies, stop) for c in self.clients)
        )
        return result(sum(counts), t0, time.perf_counter())

    def close(self) -> None:
        async def close_all() -> None:
            for client in {id(c): c for c in self.clients}.values():
                await client.aclose()

        self.loop.run_until_complete(close_all())
        self.loop.close()


class FdatasyncLoop:
    """The physical reference of a durable send: append 100 B, fdatasync, repeat."""

    def __init__(self, job: dict[str, Any]) -> None:
        self.job = job
        path = Path(job["dir"]) / "fdatasync.log"
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_TRUNC, 0o644)
        self.record = len(body := os.urandom(job["body"])).to_bytes(4, "little") + body

    def run(self) -> dict[str, Any]:
        fd, record, count, cap = self.fd, self.record, self.job["count"], self.job["cap"]
        done = 0
        t0 = time.perf_counter()
        stop = t0 + cap
        while done < count and time.perf_counter() < stop:
            os.write(fd, record)
            os.fdatasync(fd)
            done += 1
        return result(done, t0, time.perf_counter())

    def close(self) -> None:
        os.close(self.fd)


RUNNERS: dict[str, Any] = {
    "store_produce": StoreProduce,
    "store_latency": StoreLatency,
    "redis_produce": RedisProduce,
    "redis_consume": RedisConsume,
    "redis_latency": RedisLatency,
    "redis_durable": RedisDurable,
    "fdatasync": FdatasyncLoop,
}
