"""The floor under the durable case's per-connection form: what 64 connections, each with
one 100-byte request in flight, cost when the server does nothing but answer (an echo:
no protocol, no store, no fdatasync). CPU µs per round trip on each side, the server's
from ``/proc/PID/stat`` (user + system), the client's ``time.process_time()``.

    python tools/brokerbench/echo_floor.py [--conns 64] [--count 60000]
        [--server-loop uvloop|asyncio] [--client-loop uvloop|asyncio]

The server is a separate process on a Unix socket (asyncio.BufferedProtocol, as the
broker and equeue's asyncio client; ``transport.write`` of each whole 100-byte request as it
came); the client is 64 asyncio tasks, each on its own connection, each awaiting a future
its protocol resolves when the 100 bytes of the answer are in (the least a client library
can do per request).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIZE = 100
READ_BYTES = 64 * 1024  # one buffer per connection (asyncio.BufferedProtocol): asyncio's
# plain Protocol allocates 256 KiB per read, an mmap, mremap and munmap each (strace)
TICK = os.sysconf("SC_CLK_TCK")


def new_loop(name: str) -> asyncio.AbstractEventLoop:
    if name == "uvloop":
        import uvloop

        loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
        return loop
    return asyncio.new_event_loop()


class _Buffered(asyncio.BufferedProtocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.view = memoryview(bytearray(READ_BYTES))

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.view


class Echo(_Buffered):
    pending = b""

    def buffer_updated(self, nbytes: int) -> None:
        data = self.pending + self.view[:nbytes]
        whole = len(data) - len(data) % SIZE
        self.pending = data[whole:]
        if whole:
            assert self.transport is not None
            self.transport.write(data[:whole] if whole < len(data) else data)


def serve(path: str, loop_name: str) -> None:
    loop = new_loop(loop_name)
    asyncio.set_event_loop(loop)
    server = loop.run_until_complete(loop.create_unix_server(Echo, path))
    print("ready", flush=True)
    try:
        loop.run_until_complete(loop.run_in_executor(None, sys.stdin.read))  # until EOF
    finally:
        server.close()
        loop.close()


class Caller(_Buffered):
    waiter: asyncio.Future[None] | None = None
    got = 0

    def buffer_updated(self, nbytes: int) -> None:
        self.got += nbytes
        if self.got >= SIZE and self.waiter is not None:
            self.got -= SIZE
            self.waiter.set_result(None)
            self.waiter = None


async def drive(path: str, conns: int, count: int) -> tuple[float, float]:
    loop = asyncio.get_running_loop()
    callers = []
    for _ in range(conns):
        _, caller = await loop.create_unix_connection(Caller, path)
        callers.append(caller)
    message = os.urandom(SIZE)
    per = count // conns

    async def lane(caller: Caller) -> None:
        transport = caller.transport
        assert transport is not None
        for _ in range(per):
            caller.waiter = waiter = loop.create_future()
            transport.write(message)
            await waiter

    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(lane(c) for c in callers))
    spent = time.process_time() - cpu, time.perf_counter() - wall
    for caller in callers:
        assert caller.transport is not None
        caller.transport.close()
    return spent


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--conns", type=int, default=64)
    parser.add_argument("--count", type=int, default=60_000)
    parser.add_argument("--server-loop", choices=("uvloop", "asyncio"), default="uvloop")
    parser.add_argument("--client-loop", choices=("uvloop", "asyncio"), default="asyncio")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.server_loop)
        return
    with tempfile.TemporaryDirectory(prefix="eqecho", dir="/tmp") as directory:
        path = str(Path(directory) / "echo.sock")
        argv = [sys.executable, __file__, "--serve", path, "--server-loop", args.server_loop]
        server = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            assert server.stdout is not None and server.stdin is not None
            if server.stdout.readline().strip() != b"ready":
                raise SystemExit("the echo server did not start")
            loop = new_loop(args.client_loop)
            loop.run_until_complete(drive(path, args.conns, args.count // 10))  # warm-up
            before = cpu_seconds(server.pid)
            client_cpu, wall = loop.run_until_complete(drive(path, args.conns, args.count))
            server_cpu = cpu_seconds(server.pid) - before
            loop.close()
        finally:
            if server.stdin is not None:
                server.stdin.close()
            try:
                server.wait(10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
    done = args.count // args.conns * args.conns
    print(
        f"server {args.server_loop}, client {args.client_loop}, {args.conns} connections: "
        f"{done / wall:,.0f} round trips/s; CPU per round trip: server "
        f"{server_cpu / done * 1e6:.1f} us, client {client_cpu / done * 1e6:.1f} us; "
        f"load {os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main()
