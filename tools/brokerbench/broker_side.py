"""The equeue broker's side of the benchmark: the runners of the ``broker_*`` jobs (in the
worker processes, through equeue's clients only) and the parent's checks of what the
broker stored or delivered."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import equeue
import equeue.aio
from brokerbench.jobs import Runner, bodies, new_loop, result, timed
from equeue.client.consumer import GroupConsumer

IDLE_SECONDS = 1.0  # a group consumer stops once nothing came for this long
SESSION_SECONDS = 3.0  # heartbeats every second: a quicker settling of the members
SETTLE_SECONDS = 30.0


def make(job: dict[str, Any]) -> Runner:
    kind = job["kind"]
    if kind == "broker_produce":
        if job["batch"] > 1 or job["style"] == "send_many":
            return SyncProduce(job)
        return AioProduce(job)
    if kind == "broker_latency":
        return SyncLatency(job)
    if kind == "broker_durable":
        return AioDurableShared(job) if job.get("shared") else AioDurable(job)
    if kind == "broker_consume":
        return GroupConsume(job)
    raise ValueError(f"no runner for {kind!r}")


class SyncProduce:
    """The sync client: ``send_batch`` of ``batch`` messages a request, one request at a
    time; or (batch 1) ``send_many`` with ``window`` requests in flight."""

    def __init__(self, job: dict[str, Any]) -> None:
        self.job = job
        self.client = equeue.connect(job["url"])
        self.bodies = bodies(job["body"])

    def run(self) -> dict[str, Any]:
        topic, count, batch, cap = (self.job[k] for k in ("topic", "count", "batch", "cap"))
        body_list, n = self.bodies, len(self.bodies)
        done = 0
        t0 = time.perf_counter()
        stop = t0 + cap
        if batch > 1:
            chunk = [body_list[i % n] for i in range(batch)]
            send_batch = self.client.send_batch
            while done < count and time.perf_counter() < stop:
                size = min(batch, count - done)
                send_batch(topic, chunk[:size] if size < batch else chunk)
                done += size
        else:
            step = self.job["window"] * 10
            send_many = self.client.send_many
            while done < count and time.perf_counter() < stop:
                size = min(step, count - done)
                chunk = [body_list[i % n] for i in range(size)]
                send_many(topic, chunk, window=self.job["window"])
                done += size
        return result(done, t0, time.perf_counter())

    def close(self) -> None:
        self.client.close()


class AioProduce:
    """The asyncio client, one message per request, ``window`` requests in flight on the
    one connection (a new send starts as each answer comes)."""

    def __init__(self, job: dict[str, Any]) -> None:
        self.job = job
        self.loop = new_loop(job)
        connecting = equeue.aio.connect(job["url"], shm=job.get("shm", False))
        self.client = self.loop.run_until_complete(connecting)
        self.bodies = bodies(job["body"])

    def run(self) -> dict[str, Any]:
        return self.loop.run_until_complete(self._run())

    async def _run(self) -> dict[str, Any]:
        topic, count, window, cap = (self.job[k] for k in ("topic", "count", "window", "cap"))
        body_list, n = self.bodies, len(self.bodies)
        send = self.client.send
        t0 = time.perf_counter()
        stop = t0 + cap

        async def lane(start: int) -> int:
            done = 0
            for i in range(start, count, window):
                await send(topic, body_list[i % n])
                done += 1
                if not done % 64 and time.perf_counter() > stop:
                    break
            return done

        counts = await asyncio.gather(*(lane(i) for i in range(min(window, count))))
        return result(sum(counts), t0, time.perf_counter())

    def close(self) -> None:
        self.loop.run_until_complete(self.client.close())
        self.loop.close()


class SyncLatency:
    def __init__(self, job: dict[str, Any]) -> None:
        self.job = job
        self.client = equeue.connect(job["url"])
        self.bodies = bodies(job["body"])

    def run(self) -> dict[str, Any]:
        topic, count, warmup, cap = (self.job[k] for k in ("topic", "count", "warmup", "cap"))
        send, body_list, n = self.client.send, self.bodies, len(self.bodies)
        for i in range(warmup):
            send(topic, body_list[i % n])
        return timed(lambda i: send(topic, body_list[i % n]), count, cap)

    def close(self) -> None:
        self.client.close()


async def produce_durable(
    send: Callable[[str, bytes], Any],
    topic: str,
    per_task: int,
    body_list: list[bytes],
    stop: float,
) -> int:
    """One producer task: one send at a time, each awaited, until ``per_task`` or ``stop``."""
    done, n = 0, len(body_list)
    while done < per_task and time.perf_counter() < stop:
        await send(topic, body_list[done % n])
        done += 1
    return done


class AioDurable:
    """``producers`` asyncio tasks, each on its own connection, each one send at a time
    (the per-connection reading of "64 concurrent producers": the broker's group commit
    across connections)."""

    def __init__(self, job: dict[str, Any]) -> None:
        self.job = job
        self.loop = new_loop(job)

        async def connect() -> list[equeue.aio.AsyncClient]:
            return await asyncio.gather(
                *(
                    equeue.aio.connect(job["url"], shm=job.get("shm", False))
                    for _ in range(job["producers"])
                )
            )

        self.clients = self.loop.run_until_complete(connect())
        self.bodies = bodies(job["body"])

    def run(self) -> dict[str, Any]:
        return self.loop.run_until_complete(self._run())

    async def _run(self) -> dict[str, Any]:
        topic, count, cap = self.job["topic"], self.job["count"], self.job["cap"]
        per_task = -(-count // len(self.clients))
        t0 = time.perf_counter()
        stop = t0 + cap
        counts = await asyncio.gather(
            *(produce_durable(c.send, topic, per_task, self.bodies, stop) for c in self.clients)
        )
        return result(sum(counts), t0, time.perf_counter())

    def close(self) -> None:
        async def close_all() -> None:
            for client in self.clients:
                await client.close()

        self.loop.run_until_complete(close_all())
        self.loop.close()


class AioDurableShared(AioProduce):
    """``producers`` asyncio tasks sharing one ``equeue.aio.connect`` client (the shared
    reading: the natural way to write it; the client pipelines, and the sends of one loop
    turn go as one ``send_bodies`` request), each task one send at a time."""

    async def _run(self) -> dict[str, Any]:
        topic, count, cap, tasks = (self.job[k] for k in ("topic", "count", "cap", "producers"))
        per_task = -(-count // tasks)
        t0 = time.perf_counter()
        stop = t0 + cap
        send = self.client.send
        counts = await asyncio.gather(
            *(produce_durable(send, topic, per_task, self.bodies, stop) for _ in range(tasks))
        )
        return result(sum(counts), t0, time.perf_counter())


class GroupConsume:
    """One member of a consumer group (equeue.client.consumer.GroupConsumer, the blocking
    loop: long-polls of its assigned queues, commits as it goes and on close), joined
    before the start; it stops once nothing came for ``idle`` seconds, and its time ends
    at its last message (the idle wait is not counted)."""

    def __init__(self, job: dict[str, Any]) -> None:
        self.job = job
        self.client = equeue.connect(job["url"])
        self.consumer = GroupConsumer(
            self.client, job["group"], job["topic"], batch_size=job["batch"],
            timeout=job["idle"], consumer_id=job["consumer"], session_timeout=SESSION_SECONDS,
        )  # fmt: skip
        # Until the group is settled (every member joined, every queue with the holder
        # it is meant to have): polls of the still empty topic apply the assignments
        # and release what others are to get, without taking a message.
        deadline = time.monotonic() + SETTLE_SECONDS
        while not settled(
            self.client.stats(job["group"]), job["group"], job["members"], self.consumer
        ):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"group {job['group']} not settled {SETTLE_SECONDS:.0f} s after "
                    f"{job['consumer']} joined: {self.client.stats().get('coordinator')}"
                )
            if self.consumer.poll(0.05) is not None:
                raise ValueError("a message before the topic was filled")

    def run(self) -> dict[str, Any]:
        done = checked = 0
        t0 = t1 = time.perf_counter()
        stop = t0 + self.job["cap"]
        first = None
        for message in self.consumer:
            if first is None:
                first = time.perf_counter() - t0  # the wait for the first message
            done += 1
            checked += len(message.body)
            if not done % 256:
                t1 = time.perf_counter()
                if t1 > stop:
                    break
            else:
                t1 = time.perf_counter()
        self.consumer.close()  # commits what it handed out
        return result(done, t0, t1, body_bytes=checked, first=first)

    def close(self) -> None:
        self.consumer.close()
        self.client.close()


# --- the parent's side ------------------------------------------------------------


def check_stored(url: str, topic: str, results: list[dict[str, Any]]) -> dict[str, Any]:
    sent = sum(r["count"] for r in results)
    with equeue.connect(url) as client:
        stored = 0
        for queue_id in client.queue_ids(topic):
            first, end = client.queue_range(topic, queue_id)
            stored += end - first
    if stored != sent:
        raise ValueError(f"{sent} sends answered, {stored} in the broker's {topic} queues")
    return {"stored": stored}


def settled(stats: dict[str, Any], group: str, members: int, member: GroupConsumer) -> bool:
    """Every member joined, every queue held by its target, and ``member`` pulls just the
    queues the broker has it hold (the broker's view runs ahead of the member's)."""
    state = stats.get("coordinator", {}).get(group)
    if not state or len(state["members"]) != members:
        return False
    if any(holder is None or holder != target for *_, holder, target in state["assignment"]):
        return False
    held = state["members"].get(member.consumer_id, {}).get("queues", [])
    return {tuple(queue) for queue in held} == set(member.assignment())


def flushes(url: str) -> int:
    """The fdatasyncs of the broker's group commit so far (``--flush sync``)."""
    with equeue.connect(url) as client:
        return int(client.stats()["flushes"])


def create_topic(url: str, topic: str, queues: int) -> None:
    with equeue.connect(url) as client:
        client.create_topic(topic, queues)


def fill(url: str, topic: str, count: int, batch: int) -> None:
    """``count`` 100 B messages in send_batch of ``batch`` (untimed, for a consume case)."""
    chunk = bodies(100, batch)
    with equeue.connect(url) as client:
        for done in range(0, count, batch):
            client.send_batch(topic, chunk[: min(batch, count - done)])


def consume_job(url: str, topic: str, group: str, batch: int, cap: float) -> dict[str, Any]:
    job = {"kind": "broker_consume", "url": url, "topic": topic, "group": group}
    return job | {"batch": batch, "idle": IDLE_SECONDS, "cap": cap}


def check_consumed(
    url: str, topic: str, group: str, total: int
) -> Callable[[list[dict[str, Any]]], dict[str, Any]]:
    """Everything filled was consumed (more: redelivered after a queue moved between
    members) and the group's committed offsets reached every queue's end."""

    def check(results: list[dict[str, Any]]) -> dict[str, Any]:
        read = sum(r["count"] for r in results)
        if read < total:
            raise ValueError(f"{total} filled, {read} consumed")
        with equeue.connect(url) as client:
            for queue_id in client.queue_ids(topic):
                end = client.queue_range(topic, queue_id)[1]
                committed = client.committed_offset(group, topic, queue_id)
                if committed != end:
                    raise ValueError(f"{group} committed {committed} of {topic}:{queue_id}, "
                                     f"which ends at {end}")  # fmt: skip
        return {"consumed": read, "redelivered": read - total}

    return check
