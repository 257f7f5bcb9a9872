"""The cases of tools/bench_broker.py: for each, the systems in turn (A/B), each run
through the worker pool and recorded with its checks (``Bench.runs``)."""

from __future__ import annotations

import argparse
import os
import shutil
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from brokerbench import report, servers
from brokerbench.pool import JobError, Pool
from brokerbench.profile import DURABLE, profile_broker
from brokerbench.servers import Server

PRODUCERS = (1, 4, 16)
BODIES = (100, 1024)
CONSUMERS = (1, 4)
QUEUES = 4  # of a consume case's topic
BATCH = 100  # messages per send_batch, and XADDs per Redis pipeline
WINDOW = 100  # unbatched: requests in flight per connection
FILL_SECONDS = 120.0  # the untimed sends a consume case reads

Case = dict[str, Any]
Go = Callable[[int], None]  # one system's run in a case, given the repeat's index


class Counts:
    """Messages per run, in total over a case's processes."""

    def __init__(self, quick: bool, scale: float) -> None:
        def n(full: int, smoke: int) -> int:
            return smoke if quick else max(1, int(full * scale))

        self.batched = {100: n(400_000, 2_000), 1024: n(100_000, 1_000)}
        self.unbatched = {100: n(100_000, 1_000), 1024: n(40_000, 500)}
        self.consume = n(200_000, 2_000)
        self.latency = n(5_000, 200)
        self.warmup = n(500, 20)
        # Runs of ~1-2 s (round 16's 40,000 took 0.24-0.55 s and varied 1.8x within a
        # cell; 4x as long, the same cells varied less: docs/benchmarks.md, round 17)
        self.durable = n(160_000, 640)
        self.fdatasync = n(20_000, 100)


class Bench:
    def __init__(self, args: argparse.Namespace, base: Path) -> None:
        self.args = args
        self.base = base
        self.counts = Counts(args.quick, args.scale)
        self.cap: float = args.cap
        self.pool = Pool(max(max(PRODUCERS), max(CONSUMERS), args.durable_procs))
        self.runs: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.serial = 0
        self.redis_ok = servers.redis_binary() is not None
        if not self.redis_ok:
            self.notes.append(
                "redis-server is not installed (Debian: apt-get install redis-server; "
                "`make bench` tries): the Redis rows are skipped."
            )

    def name(self, prefix: str) -> str:
        self.serial += 1
        return f"{prefix}{self.serial}"

    # --- running one system in one case ------------------------------------------

    def measure(
        self,
        section: str,
        case: Case,
        system: str,
        repeat: int,
        jobs: list[dict[str, Any]],
        server: Server | None = None,
        check: Callable[[list[dict[str, Any]]], dict[str, Any]] | None = None,
        between: Callable[[], None] | None = None,
    ) -> None:
        """Run ``jobs`` (one per process, started together) and record the run: messages,
        seconds, rate, the server's and the clients' CPU seconds, latency percentiles."""
        run: dict[str, Any] = {"section": section, **case, "system": system, "repeat": repeat}
        cpu_before = 0.0

        def before() -> None:
            nonlocal cpu_before
            if between is not None:
                between()
            cpu_before = servers.cpu_seconds(server.pid) if server else 0.0

        try:
            results = self.pool.run(jobs, self.cap, before)
        except JobError as error:
            self.failed(section, case, system, repeat, str(error))
            return
        count = sum(r["count"] for r in results)
        seconds = max(r["t1"] for r in results) - min(r["t0"] for r in results)
        run.update(count=count, seconds=seconds, rate=count / seconds if seconds > 0 else 0.0)
        run["capped"] = count < sum(j.get("count", 0) for j in jobs)
        run["client_cpu"] = sum(r["cpu"] for r in results)
        start = min(r["t0"] for r in results)
        run["workers"] = [  # per process: messages, start and end (s after the first start)
            [r["count"], r["t0"] - start, r["t1"] - start]
            + ([r["first"]] if r.get("first") is not None else [])  # to the first message
            for r in results
        ]
        if server is not None:
            run["server_cpu"] = servers.cpu_seconds(server.pid) - cpu_before
        samples = [s for r in results for s in r.get("samples", ())]
        if samples:
            run.update(report.percentiles(samples))
        if check is not None:
            try:
                run.update(check(results))
            except Exception as error:  # a wrong count is reported with the run
                run["error"] = f"check: {type(error).__name__}: {error}"
        self.runs.append(run)
        report.progress(f"  {system}: {report.describe(run)}")

    def failed(self, section: str, case: Case, system: str, repeat: int, error: str) -> None:
        run = {"section": section, **case, "system": system, "repeat": repeat}
        self.runs.append(run | {"error": error[-3000:]})
        report.progress(f"  {system}: FAILED {error[:300]}")
        if self.pool.broken:  # a worker still busy or gone: start afresh
            self.pool.close()
            self.pool = Pool(self.pool.size)

    # --- the cases ---------------------------------------------------------------
    # A case is a dict of what its rows show (``case``, ``body``, ``producers``...); each
    # system of a case is a bound method that takes the repeat's index.

    def alternate(self, section: str, case: Case, systems: list[tuple[str, Go]]) -> None:
        """A/B: the systems of a case in turn, the order reversed on odd repeats. A run
        that fails outside its processes (a server gone) is recorded as failed."""
        for repeat in range(self.args.repeat):
            for system, go in systems if repeat % 2 == 0 else systems[::-1]:
                if section == "durable":
                    # Each durable run starts on a disk with nothing of the last one left
                    # to write: the --flush async ceiling broker's store (~16-30 MB a run)
                    # is written back every flush_interval_ms, and without this would
                    # compete with the next run's fdatasyncs (review11 R11-6)
                    os.sync()
                try:
                    go(repeat)
                except Exception as error:
                    self.failed(section, case, system, repeat, f"{type(error).__name__}: {error}")

    def produce(self, broker: Server | None, redis: Server | None) -> None:
        for body in BODIES:
            for producers in PRODUCERS:
                case: Case = {"case": f"produce {producers}p {body}B", "body": body}
                case["producers"] = producers
                report.progress(case["case"])
                batched = max(1, self.counts.batched[body] // producers)
                single = max(1, self.counts.unbatched[body] // producers)
                systems: list[tuple[str, Go]] = []
                if broker is not None:
                    systems.append(
                        (
                            "broker-batch",
                            partial(self.broker_produce, broker, case, "batch", batched),
                        )
                    )
                if redis is not None:
                    systems.append(("redis", partial(self.redis_produce, redis, case, batched)))
                if broker is not None:
                    systems.append(
                        (
                            "broker-single",
                            partial(self.broker_produce, broker, case, "single", single),
                        )
                    )
                    systems.append(
                        ("broker-many", partial(self.broker_produce, broker, case, "many", single))
                    )
                if producers == 1:  # the store has one writer process
                    systems.append(
                        ("store-batch", partial(self.store_produce, case, "batch", batched))
                    )
                    systems.append(
                        ("store-single", partial(self.store_produce, case, "single", single))
                    )
                self.alternate("produce", case, systems)

    def broker_produce(self, broker: Server, case: Case, mode: str, per: int, r: int) -> None:
        from brokerbench import broker_side  # the client: imported where it is used

        topic = self.name("t")
        job: dict[str, Any] = {
            "kind": "broker_produce",
            "url": broker.url,
            "topic": topic,
            "body": case["body"],
        }
        job |= {"count": per, "batch": BATCH if mode == "batch" else 1, "window": WINDOW}
        job |= {"style": "send_many" if mode == "many" else "aio", "cap": self.cap}
        job["client_loop"] = self.args.client_loop
        jobs = [job] * case["producers"]
        self.measure(
            "produce", case, f"broker-{mode}", r, jobs, broker,
            lambda results: broker_side.check_stored(broker.url, topic, results),
        )  # fmt: skip

    def store_produce(self, case: Case, mode: str, per: int, r: int) -> None:
        directory = self.base / self.name("store")
        job: dict[str, Any] = {
            "kind": "store_produce",
            "dir": str(directory),
            "flush": "async",
            "topic": "t",
        }
        job |= {"body": case["body"], "count": per, "batch": BATCH if mode == "batch" else 1}
        job["cap"] = self.cap
        try:
            self.measure("produce", case, f"store-{mode}", r, [job], None, _stored)
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    def redis_produce(self, redis: Server, case: Case, per: int, r: int) -> None:
        key = self.name("s")
        job: dict[str, Any] = {
            "kind": "redis_produce",
            "socket": str(redis.socket_path),
            "key": key,
        }
        job |= {"body": case["body"], "count": per, "batch": BATCH, "cap": self.cap}
        jobs = [job] * case["producers"]
        self.measure("produce", case, "redis", r, jobs, redis, _redis_len(redis, key))

    def consume(self, broker: Server | None, redis: Server | None) -> None:
        for consumers in CONSUMERS:
            case: Case = {"case": f"consume {consumers}c 100B", "consumers": consumers}
            case["body"] = 100
            report.progress(case["case"])
            systems: list[tuple[str, Go]] = []
            if broker is not None:
                systems.append(("broker", partial(self.broker_consume, broker, case)))
            if redis is not None:
                systems.append(("redis", partial(self.redis_consume, redis, case)))
            self.alternate("consume", case, systems)

    def broker_consume(self, broker: Server, case: Case, r: int) -> None:
        """The members join an empty topic and wait until each holds its share of the
        queues (a handover takes heartbeats); then the topic is filled, untimed, and
        they start."""
        from brokerbench import broker_side

        total, n = self.counts.consume, case["consumers"]
        topic, group = self.name("c"), self.name("g")
        broker_side.create_topic(broker.url, topic, QUEUES)
        job = broker_side.consume_job(broker.url, topic, group, BATCH, self.cap)
        jobs = [job | {"consumer": f"c{i}", "members": n} for i in range(n)]
        check = broker_side.check_consumed(broker.url, topic, group, total)
        fill = partial(broker_side.fill, broker.url, topic, total, BATCH)
        self.measure("consume", case, "broker", r, jobs, broker, check, between=fill)

    def redis_consume(self, redis: Server, case: Case, r: int) -> None:
        total, n = self.counts.consume, case["consumers"]
        key, sock = self.name("s"), str(redis.socket_path)
        fill: dict[str, Any] = {"kind": "redis_produce", "socket": sock, "key": key, "body": 100}
        fill |= {"count": total, "batch": BATCH, "cap": FILL_SECONDS}
        if not self._fill(case, "redis", r, [fill]):
            return
        _redis_group(redis, key)
        job: dict[str, Any] = {"kind": "redis_consume", "socket": sock, "key": key, "group": "g"}
        job |= {"batch": BATCH, "cap": self.cap}
        jobs = [job | {"consumer": f"c{i}"} for i in range(n)]
        self.measure("consume", case, "redis", r, jobs, redis, _redis_consumed(redis, key, total))

    def _fill(self, case: Case, system: str, r: int, jobs: list[dict[str, Any]]) -> bool:
        """Send what a consume case reads (untimed); a failure is the run's error."""
        try:
            results = self.pool.run(jobs, FILL_SECONDS)
            filled = sum(result["count"] for result in results)
            wanted = sum(job["count"] for job in jobs)
            if filled != wanted:
                raise JobError(f"{filled} of {wanted} sent within {FILL_SECONDS} s")
        except JobError as error:
            self.failed("consume", case, system, r, f"filling: {error}")
            return False
        return True

    def latency(self, broker: Server | None, redis: Server | None) -> None:
        case: Case = {"case": "round trip 100B", "body": 100}
        report.progress(case["case"])
        job: dict[str, Any] = {
            "body": 100,
            "count": self.counts.latency,
            "warmup": self.counts.warmup,
        }
        job |= {"cap": self.cap, "topic": "lat", "key": "lat"}
        systems: list[tuple[str, Go]] = []
        if broker is not None:
            one = job | {"kind": "broker_latency", "url": broker.url}
            go = partial(self.measure, "latency", case, "broker", jobs=[one], server=broker)
            systems.append(("broker", go))
        if redis is not None:
            one = job | {"kind": "redis_latency", "socket": str(redis.socket_path)}
            go = partial(self.measure, "latency", case, "redis", jobs=[one], server=redis)
            systems.append(("redis", go))
        systems.append(("store", partial(self.store_latency, case, job)))
        self.alternate("latency", case, systems)

    def store_latency(self, case: Case, job: dict[str, Any], r: int) -> None:
        directory = self.base / self.name("store")
        try:
            one = job | {"kind": "store_latency", "dir": str(directory)}
            self.measure("latency", case, "store", r, [one], None)
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    def durable(self) -> None:
        """Own servers: the broker with --flush sync, Redis with appendfsync always."""
        tasks = self.args.durable_producers
        directory = self.base / "durable"
        directory.mkdir()
        broker = redis = ceiling = None
        try:
            # --shm: the same broker serves the rows on shared-memory rings beside the
            # socket rows (a client asks: shm=True; the others stay on their sockets)
            shm = shm_available()
            broker = self._start_broker("sync", ["--shm"] if shm else [])
            # The ceiling of each row: the same producers against a --flush async broker
            # (each send answered after its append, no fdatasync waited for), what the
            # row's clients and broker make on this host with the disk taken away
            ceiling = self._start_broker("async", ["--shm"] if shm else [], store="eq-ceiling")
            if not shm:
                self.notes.append("the durable rows on shared-memory rings were not run: "
                                  "they need Linux and the C accelerator")  # fmt: skip
            redis = self._start_redis(durable=True)
            for procs in sorted({1, self.args.durable_procs}):
                case: Case = {"case": f"durable {tasks} tasks in {procs} process(es) 100B"}
                case |= {"producers": tasks, "processes": procs, "body": 100}
                report.progress(case["case"])
                per = max(1, self.counts.durable // procs)
                job: dict[str, Any] = {
                    "body": 100,
                    "count": per,
                    "producers": tasks // procs,
                    "cap": self.cap,
                }
                systems: list[tuple[str, Go]] = []
                # Both readings of "64 concurrent producers": a connection per task
                # (``broker``, ``redis``), and the tasks of a process sharing one client
                # (``broker-shared``: one equeue.aio client; ``redis-shared``: one
                # redis.asyncio.Redis and its pool).
                # Each again on shared-memory rings (``broker-shm``, ``broker-shm-shared``:
                # shm=True, docs/protocol.md), measured in the same alternation.
                for shared in (False, True):
                    suffix = "-shared" if shared else ""
                    for rings in (False, True) if shm else (False,):
                        if broker is None:
                            continue
                        system = ("broker-shm" if rings else "broker") + suffix
                        job_b = job | {"kind": "broker_durable", "url": broker.url}
                        job_b |= {"client_loop": self.args.client_loop, "shared": shared}
                        job_b |= {"shm": rings}
                        go = partial(self.durable_run, case, system, broker, job_b)
                        systems.append((system, go))
                        if ceiling is not None:
                            job_c = job_b | {"url": ceiling.url}
                            name = report.CEILING + system
                            go = partial(self.durable_run, case, name, ceiling, job_c)
                            systems.append((name, go))
                    if redis is not None:
                        job_r = job | {"kind": "redis_durable", "socket": str(redis.socket_path)}
                        job_r |= {"client_loop": self.args.client_loop, "shared": shared}
                        go = partial(self.durable_run, case, "redis" + suffix, redis, job_r)
                        systems.append(("redis" + suffix, go))
                loop: dict[str, Any] = {"kind": "fdatasync", "dir": str(directory), "body": 100}
                loop |= {"count": self.counts.fdatasync, "cap": self.cap}
                go = partial(self.measure, "durable", case, "fdatasync", jobs=[loop])
                systems.append(("fdatasync", go))
                self.alternate("durable", case, systems)
            if self.args.profile and broker is not None:
                self.notes.extend(profile_broker(self, broker, DURABLE))
        finally:
            for server in (broker, redis, ceiling):
                if server is not None:
                    server.stop()

    def durable_run(
        self, case: Case, system: str, server: Server, job: dict[str, Any], r: int
    ) -> None:
        name = self.name("d")
        jobs = [job | {"topic": name, "key": name}] * case["processes"]
        if system.startswith("redis"):
            self.measure("durable", case, system, r, jobs, server, _redis_len(server, name))
            return
        from brokerbench import broker_side

        # What the clients saw acknowledged is stored; the group commit's fdatasyncs over
        # the run, from the broker's stats.
        before: list[int] = []

        def check(results: list[dict[str, Any]]) -> dict[str, Any]:
            found = broker_side.check_stored(server.url, name, results)
            return found | {"flushes": broker_side.flushes(server.url) - before[0]}

        self.measure(
            "durable", case, system, r, jobs, server, check,
            between=lambda: before.append(broker_side.flushes(server.url)),
        )  # fmt: skip

    # --- servers -----------------------------------------------------------------

    def _start_broker(
        self, flush: str, options: list[str] | None = None, store: str = ""
    ) -> Server | None:
        where = self.base / (store or f"eq-{flush}")
        try:
            loop = self.args.event_loop
            extra = (["--event-loop", loop] if loop else []) + (options or [])
            wait = self.args.group_commit_wait_us
            if flush == "sync" and wait is not None:
                extra += ["--group-commit-wait-us", str(wait)]
            overlap = self.args.group_commit_overlap
            if flush == "sync" and overlap is not None:
                extra += ["--group-commit-overlap", str(overlap)]
            busy = self.args.busy_poll_us
            if flush == "sync" and busy is not None:
                extra += ["--busy-poll-us", str(busy)]
            log = self.base / f"broker-{store or flush}.log"
            return servers.start_broker(where, flush, log, extra)
        except servers.ServerError as error:
            self.notes.append(f"the broker (--flush {flush}) did not start: {_flat(error)}")
            report.progress(f"broker --flush {flush}: {error}")
            return None

    def _start_redis(self, *, durable: bool) -> Server | None:
        if not self.redis_ok:
            return None
        try:
            return servers.start_redis(self.base / ("redis-aof" if durable else "redis"),
                                       durable=durable)  # fmt: skip
        except servers.ServerError as error:
            self.notes.append(f"redis-server did not start: {_flat(error)}")
            return None

    def run(self) -> None:
        broker = redis = None
        try:
            broker = self._start_broker("async")
            redis = self._start_redis(durable=False)
            sections = self.args.sections
            if "produce" in sections:
                self.produce(broker, redis)
            if "consume" in sections:
                self.consume(broker, redis)
            if "latency" in sections:
                self.latency(broker, redis)
            if self.args.profile and broker is not None:
                self.notes.extend(profile_broker(self, broker))
        finally:
            for server in (broker, redis):
                if server is not None:
                    server.stop()
        if "durable" in self.args.sections:
            self.durable()

    def close(self) -> None:
        self.pool.close()


def _flat(error: Exception) -> str:
    return " ".join(str(error).split())  # one markdown list item


def _stored(results: list[dict[str, Any]]) -> dict[str, Any]:
    stored = sum(r["stored"] for r in results)
    sent = sum(r["count"] for r in results)
    if stored != sent:
        raise ValueError(f"{sent} sent, {stored} in the store's queues")
    return {"stored": stored}


def _redis_client(server: Server) -> Any:
    import redis

    return redis.Redis(unix_socket_path=str(server.socket_path))


def _redis_len(server: Server, key: str) -> Callable[[list[dict[str, Any]]], dict[str, Any]]:
    def check(results: list[dict[str, Any]]) -> dict[str, Any]:
        with _redis_client(server) as client:
            stored = int(client.xlen(key))
            client.delete(key)  # Redis holds it in memory
        sent = sum(r["count"] for r in results)
        if stored != sent:
            raise ValueError(f"{sent} XADDs answered, XLEN {key} is {stored}")
        return {"stored": stored}

    return check


def _redis_group(server: Server, key: str) -> None:
    with _redis_client(server) as client:
        client.xgroup_create(key, "g", id="0")


def _redis_consumed(
    server: Server, key: str, total: int
) -> Callable[[list[dict[str, Any]]], dict[str, Any]]:
    def check(results: list[dict[str, Any]]) -> dict[str, Any]:
        read = sum(r["count"] for r in results)
        acked = sum(r["acked"] for r in results)
        with _redis_client(server) as client:
            pending = int(client.xpending(key, "g")["pending"])
            client.delete(key)
        if read != total or acked != total or pending:
            raise ValueError(f"{total} filled, {read} read, {acked} acked, {pending} pending")
        return {"consumed": read}

    return check


def shm_available() -> bool:
    """Whether the durable rows on shared-memory rings can run (Linux, the accelerator)."""
    from equeue.protocol import shmrings

    return bool(shmrings.AVAILABLE)
