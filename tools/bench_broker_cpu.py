"""The broker's instructions per message under valgrind's callgrind, without sockets:
repeatable where CPU seconds on a shared machine are not (issue 23's tuning).

A Broker is started on an event loop and a recorded byte stream is fed to
``Connection.buffer_updated`` through fake transports (writes counted, not sent), as
asyncio would after a read. Each case runs twice under ``valgrind --tool=callgrind``,
with N and 2N measured reads after the same set-up; (Ir(2N) - Ir(N)) / messages is
one message's cost without the interpreter's start. Cases:
``send``: reads of 100 plain 100 B ``send`` requests (the pipelined asyncio client);
``send1``: one send per read; ``batch``: one ``send_batch`` of 100 per read; ``bodies``:
one ``send_bodies`` of 100 per read (protocol version 2, the clients' batch of bytes);
``durable``: ``--flush sync``, 64 connections with one send each per round, each round
awaiting its fdatasync and answers (the flusher thread's instructions count too);
``group``: a consumer group's member reading a 1-queue topic of 100 B messages, one
``pull_columns`` of 100 (tools/bench_broker.py's consume batch) per read at the next
offset, with the member's group, consumer and join id (the owner check), as
GroupConsumer sends it; the topic is filled and the reads encoded for the 2N run in both
runs, so the difference is the pulls' alone (per message: a pull's cost / 100).
``--src DIR`` measures the equeue package under DIR (for before/after); ``--direct``
runs a case once, timed by ``time.process_time``, without valgrind.

``--process`` (durable only) measures a real ``equeue serve --flush sync`` instead: for each
``--src`` in turn, alternated ``--rounds`` times, a broker process of that tree on its Unix
socket and ``DURABLE_PEERS`` asyncio tasks in this process, each on its own connection,
each one send at a time (this tree's client, the same for every broker), ``--count`` sends
each; the broker's user and system CPU from ``/proc/PID/stat`` per send, its fdatasyncs
(stats) and the rate. ``--process --callgrind``: the same real broker under callgrind,
with ``--count`` N and 2N sends per connection, (Ir(2N) - Ir(N)) / sends: its user-space
instructions per durable send, uvloop and the sockets' Python included, the kernel not
(repeatable where CPU seconds on a loaded machine are not).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CASES = ("send", "send1", "batch", "bodies", "durable", "group")
BODY = b"x" * 100
DURABLE_PEERS = 64
GROUP_BATCH = 100  # a member's pull (tools/bench_broker.py's consume: batch_size 100)
PER_READ = {"send": 100, "send1": 1, "batch": 100, "bodies": 100, "durable": 1}
PER_READ["group"] = GROUP_BATCH


class FakeTransport:
    def __init__(self) -> None:
        self.writes = 0

    def get_extra_info(self, name: str, default: object = None) -> object:
        return default

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0

    def is_closing(self) -> bool:
        return False

    def write(self, data: bytes) -> None:
        self.writes += 1
        self.last = data  # (the group case reads its join's and last pull's answers)

    def close(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def _read(case: str) -> bytes:
    from equeue.protocol.frames import encode

    if case == "batch":
        args: dict[str, Any] = {"topic": "t", "messages": [{"body": BODY}] * 100}
        return encode([1, "send_batch", args])
    if case == "bodies":  # protocol version 2: what the clients send for a batch of bytes
        return encode([1, "send_bodies", {"topic": "t", "bodies": [BODY] * 100}])
    per_read = 100 if case == "send" else 1
    return b"".join(encode([1 + i, "send", {"topic": "t", "body": BODY}]) for i in range(per_read))


def _feed(connection: Any, data: bytes) -> None:
    if not hasattr(connection, "get_buffer"):  # a tree before BufferedProtocol
        connection.data_received(data)
        return
    view = connection.get_buffer(len(data))
    view[: len(data)] = data
    connection.buffer_updated(len(data))


def _answer(transport: FakeTransport, where: str) -> Any:
    """The result of the last frame written (one answer a write here), or SystemExit."""
    import msgpack

    from equeue.protocol.frames import FRAME_HEADER_SIZE, STATUS_OK

    _, status, result = msgpack.unpackb(transport.last[FRAME_HEADER_SIZE:], raw=False)
    if status != STATUS_OK:
        raise SystemExit(f"the {where} was refused: {result!r}")
    return result


def _group_reads(broker: Any, connection: Any, transport: FakeTransport, most: int) -> list[bytes]:
    """The group case's set-up: topic ``t`` of one queue filled with ``most`` pulls' worth
    of messages, member ``c0`` of group ``g`` joined, and ``most`` pull_columns requests
    of the member at successive offsets, encoded."""
    from equeue.protocol.frames import encode

    broker.store.create_topic("t", 1)
    for _ in range(most):
        broker.store.send_batch("t", [BODY] * GROUP_BATCH)
    member = {"group": "g", "consumer": "c0"}
    join = member | {"topics": ["t"], "session_timeout_ms": 600_000}
    _feed(connection, encode([1, "join", join]))
    answer = _answer(transport, "join")
    if answer.get("join_id") is not None:
        member["join_id"] = answer["join_id"]
    reads = []
    for i in range(most):
        pull = {"topic": "t", "queue_id": 0, "offset": i * GROUP_BATCH, "max_count": GROUP_BATCH}
        reads.append(encode([2 + i, "pull_columns", pull | member]))
    return reads


async def _run(case: str, count: int, directory: Path, most: int) -> tuple[float, int]:
    """CPU seconds of the measured part, and messages sent (or pulled) in it."""
    from equeue.protocol.frames import encode
    from equeue.protocol.handshake import Hello
    from equeue.server.config import ServerConfig
    from equeue.server.connection import Connection
    from equeue.server.serve import Broker

    config = ServerConfig(flush="sync") if case == "durable" else ServerConfig(flush="async")
    broker = Broker(directory / "store", config)
    await broker.start()
    try:
        peers = DURABLE_PEERS if case == "durable" else 1
        connections = []
        transport = FakeTransport()  # the first connection's
        for number in range(peers):
            connection = Connection(broker, "bench", number + 1)
            mine = transport if number == 0 else FakeTransport()
            connection.connection_made(mine)  # type: ignore[arg-type]
            _feed(connection, encode(Hello(client="bench").pack()))
            connections.append(connection)
        # The same read each time (request ids repeat, which the broker allows): no set-up
        # grows with the count, so the difference of two counts is the broker's alone.
        # (group: a read per offset, all made in the set-up of both runs alike)
        if case == "group":
            pulls = _group_reads(broker, connections[0], transport, most + 1)
        read = pulls[0] if case == "group" else _read(case)
        for connection in connections:  # untimed warm-up
            _feed(connection, read)
        if broker.commit is not None:
            await broker.commit.drain()
        await asyncio.sleep(0)
        started = time.process_time()
        started_thread = time.thread_time()
        for i in range(count):
            if case == "group":
                read = pulls[1 + i]
            for connection in connections:
                _feed(connection, read)
            if broker.commit is not None:
                await broker.commit.drain()
                await asyncio.sleep(0)  # the answers' write callback
        spent = time.process_time() - started
        print(f"the loop thread's share: {(time.thread_time() - started_thread) / spent:.0%}")
        # group: answered with a batch, not refused (the owner check passed)
        if case == "group" and len(transport.last) < GROUP_BATCH * len(BODY):
            raise SystemExit(f"the last pull's answer is {_answer(transport, 'pull')!r}")
        return spent, count * PER_READ[case] * peers
    finally:
        broker._ticker.cancel()
        broker.store.close()


def child(case: str, count: int, most: int) -> None:
    directory = Path(tempfile.mkdtemp(prefix="eqcpu", dir="/tmp"))
    try:
        spent, messages = asyncio.run(_run(case, count, directory, max(most, count)))
        print(f"{case}: {spent / messages * 1e6:.3f} us CPU per message ({messages} messages)")
    finally:
        shutil.rmtree(directory, ignore_errors=True)


async def _drive(url: str, sends: int) -> tuple[int, float]:
    import equeue.aio

    clients = await asyncio.gather(*(equeue.aio.connect(url) for _ in range(DURABLE_PEERS)))

    async def lane(client: Any, count: int) -> None:
        for _ in range(count):
            await client.send("t", BODY)

    try:
        await asyncio.gather(*(lane(c, 20) for c in clients))  # warm-up, untimed
        flushes = int((await clients[0].stats())["flushes"])
        started = time.perf_counter()
        await asyncio.gather(*(lane(c, sends) for c in clients))
        wall = time.perf_counter() - started
        return int((await clients[0].stats())["flushes"]) - flushes, wall
    finally:
        for client in clients:
            await client.close()


def _cpu(pid: int) -> tuple[float, float]:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def _broker(
    src: Path, directory: Path, prefix: list[str], flush: str = "sync", extra: tuple[str, ...] = ()
) -> tuple[subprocess.Popen[bytes], str]:
    """A broker of tree ``src`` (``prefix``: valgrind's argv, or none; ``extra``: more
    options of ``equeue serve``) and its URL (tools/bench_batch_cpu.py's too, with
    ``flush`` async; tools/bench_shm.py's with --shm)."""
    env = dict(os.environ, PYTHONPATH=str(src))
    argv = [sys.executable, "-m", "equeue", "serve", str(directory / "s"), "--flush", flush]
    argv += extra
    # cwd: `python -m` puts the working directory first on sys.path, ahead of PYTHONPATH;
    # run from a worktree, every "src" would be that worktree's equeue
    broker = subprocess.Popen(
        [*prefix, *argv, "--quiet"], cwd=directory,
        env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL if prefix else None,
    )  # fmt: skip
    assert broker.stdout is not None
    line = broker.stdout.readline().decode()
    if not line.startswith("listening on "):
        broker.kill()
        broker.wait(60)
        raise SystemExit(f"the broker of {src} did not start: {line!r}")
    return broker, line.split()[-1]


def process_instructions(
    src: Path, sends: int, keep: Path | None = None, flush: str = "sync"
) -> tuple[list[int], int]:
    """A real broker of tree ``src`` under callgrind, ``sends`` durable sends from each of
    DURABLE_PEERS connections: its user-space instructions (start and drain included) a
    thread, in the order they started (the loop's first), and its fdatasyncs. ``keep``: a
    directory the output files (one a thread, for callgrind_annotate) are copied to."""
    directory = Path(tempfile.mkdtemp(prefix="eqpg", dir="/tmp"))
    target = directory / "callgrind.out"
    prefix = [
        "valgrind", "--tool=callgrind", "--separate-threads=yes",
        f"--callgrind-out-file={target}",
    ]  # fmt: skip
    broker, url = _broker(src, directory, prefix, flush)
    try:
        flushes, _wall = asyncio.run(_drive(url, sends))
    finally:
        broker.terminate()  # a drain: callgrind writes its counts at the exit
        broker.wait(600)
    try:
        threads = []
        outputs = sorted(directory.glob("callgrind.out-*"))
        for output in outputs:
            found = re.search(r"^summary:\s+(\d+)", output.read_text(), re.MULTILINE)
            if found is None:
                raise SystemExit(f"no summary line in {output}")
            threads.append(int(found.group(1)))
            if keep is not None:
                keep.mkdir(parents=True, exist_ok=True)
                shutil.copy(output, keep / f"{output.name}.{sends}")
        if not outputs:
            raise SystemExit(f"no callgrind output in {directory}")
        return threads, flushes
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def process(src: Path, sends: int) -> str:
    """One real broker of tree ``src``, loaded by DURABLE_PEERS connections."""
    directory = Path(tempfile.mkdtemp(prefix="eqpc", dir="/tmp"))
    broker, url = _broker(src, directory, [])
    try:
        user0, system0 = _cpu(broker.pid)
        flushes, wall = asyncio.run(_drive(url, sends))
        user, system = _cpu(broker.pid)
    finally:
        broker.terminate()
        broker.wait(60)
        shutil.rmtree(directory, ignore_errors=True)
    # the warm-up's CPU is in the figures too: its 20 sends a peer are counted with them
    total = DURABLE_PEERS * (sends + 20)
    per = 1e6 / total
    return (
        f"{src}: {DURABLE_PEERS * sends / wall:,.0f} sends/s, broker CPU per send "
        f"{(user - user0 + system - system0) * per:.1f} us (user {(user - user0) * per:.1f}, "
        f"system {(system - system0) * per:.1f}), {DURABLE_PEERS * sends / max(flushes, 1):.1f} "
        f"sends per fdatasync, load {os.getloadavg()[0]:.1f}"
    )


def instructions(case: str, count: int, src: Path, most: int) -> int:
    with tempfile.TemporaryDirectory(prefix="eqcg", dir="/tmp") as out:
        target = Path(out) / "callgrind.out"
        env = dict(os.environ, PYTHONPATH=str(src))
        subprocess.run(
            [
                "valgrind", "--tool=callgrind", f"--callgrind-out-file={target}",
                sys.executable, __file__, "--child", case, "--count", str(count),
                "--most", str(most),
            ],
            check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            timeout=3600,
        )  # fmt: skip
        found = re.search(r"^summary:\s+(\d+)", target.read_text(), re.MULTILINE)
        if found is None:
            raise SystemExit(f"no summary line in {target}")
        return int(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cases", nargs="*", help=f"of {', '.join(CASES)} (default: all)")
    parser.add_argument("--count", type=int, default=200, help="N: measured reads (rounds)")
    parser.add_argument("--src", type=Path, action="append", help="a tree holding equeue/")
    parser.add_argument("--direct", action="store_true", help="no valgrind: CPU seconds")
    parser.add_argument("--process", action="store_true", help="durable: a real broker")
    parser.add_argument(
        "--callgrind", action="store_true", help="--process: instructions under callgrind"
    )
    parser.add_argument("--rounds", type=int, default=3, help="--process: A/B rounds")
    parser.add_argument(
        "--flush", choices=("sync", "async"), default="sync", help="--process --callgrind"
    )
    parser.add_argument(
        "--keep", type=Path, help="--process --callgrind: copy the outputs (a file a thread) here"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--most", type=int, default=0, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.child:
        child(options.child, options.count, options.most)
        return
    for case in options.cases:
        if case not in CASES:
            parser.error(f"no case {case!r}: the cases are {', '.join(CASES)}")
    sources = options.src or [Path(__file__).resolve().parent.parent]
    if options.process and options.callgrind:
        n = options.count
        for src in sources:
            (small, flushes1), (large, flushes2) = (
                process_instructions(
                    src, c, options.keep and options.keep / src.name, options.flush
                )
                for c in (n, 2 * n)
            )
            per = (sum(large) - sum(small)) / (DURABLE_PEERS * n)
            threads = ", ".join(
                f"{(b - a) / (DURABLE_PEERS * n):,.0f}" for a, b in zip(small, large, strict=False)
            )
            print(
                f"durable process {src}: {per:,.0f} instructions per send (broker, user space; "
                f"a thread: {threads}; "
                f"{DURABLE_PEERS * n / max(flushes2 - flushes1, 1):.1f} sends per fdatasync "
                f"in the difference; raw: N={n} {small} Ir {flushes1} flushes, "
                f"2N {large} Ir {flushes2} flushes)",
                flush=True,
            )
        return
    if options.process:
        for round_ in range(options.rounds):  # A/B, B/A, ...
            for src in sources if round_ % 2 == 0 else sources[::-1]:
                print(process(src, options.count), flush=True)
        return
    for case in options.cases or CASES:
        for src in sources:
            if options.direct:
                env = dict(os.environ, PYTHONPATH=str(src))
                argv = [sys.executable, __file__, "--child", case, "--count", str(options.count)]
                subprocess.run(argv, check=True, env=env, timeout=3600)
                continue
            n = options.count
            per_read = PER_READ[case] * (DURABLE_PEERS if case == "durable" else 1)
            at_n, at_2n = (instructions(case, c, src, 2 * n) for c in (n, 2 * n))
            cost = (at_2n - at_n) / (n * per_read)
            print(f"{case:8s} {src}: {cost:,.0f} instructions per message", flush=True)


if __name__ == "__main__":
    main()
