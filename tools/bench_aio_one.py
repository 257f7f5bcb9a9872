"""The asyncio client's CPU per send against a real ``equeue serve`` (issue 23): ``--conns``
connections in one process, each ``--depth`` tasks sending one at a time (64 x 1: the
durable case's "a connection per task"; 1 x 100: the pipelined case), ``--body`` bytes
a message (100; 1024: the produce section's 1 KiB rows). ``--procs P`` (not with
``--callgrind``) starts P such client processes together (the produce section's 4- and
16-process rows) and prints each one's figures and their mean.

    python tools/bench_aio_one.py [--src DIR ...] [--flush async|sync] [--loop asyncio|uvloop]
        [--conns 64] [--depth 1] [--body 100] [--procs 1] [--count 20000]
        [--rounds 2] [--callgrind]

For each ``--src`` tree in turn (alternated ``--rounds`` times) a client process of that
tree's ``equeue`` (PYTHONPATH) runs against one broker (this tree's), and prints its
``time.process_time()`` per send over the timed sends (after 2,000 warm-up sends), and
its user and system parts and context switches per send (getrusage). With
``--callgrind`` the client runs under ``valgrind --tool=callgrind`` twice, ``--count`` N
and 2N sends after the same set-up: (Ir(2N) - Ir(N)) / N instructions per send.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from brokerbench.servers import start_broker

WARMUP = 2000


async def _client(url: str, conns: int, depth: int, count: int, body: bytes) -> float:
    import equeue.aio

    clients = [await equeue.aio.connect(url) for _ in range(conns)]

    async def one(client: equeue.aio.AsyncClient, n: int) -> None:
        send = client.send
        for _ in range(n):
            await send("t", body)

    async def round_(total: int) -> None:
        per = -(-total // (conns * depth))
        await asyncio.gather(*(one(c, per) for c in clients for _ in range(depth)))

    await round_(WARMUP)
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.process_time()
    await round_(count)
    spent = time.process_time() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    for client in clients:
        await client.close()
    sends = -(-count // (conns * depth)) * conns * depth
    print(
        f"user_us {(r1.ru_utime - r0.ru_utime) / sends * 1e6:.2f} "
        f"sys_us {(r1.ru_stime - r0.ru_stime) / sends * 1e6:.2f} "
        f"switches {(r1.ru_nvcsw + r1.ru_nivcsw - r0.ru_nvcsw - r0.ru_nivcsw) / sends:.3f}"
    )
    return spent / sends * 1e6


def _slowed() -> None:
    """Under valgrind a loop turn of 64 answers outlasts HEARD_RECENTLY (20 ms), and the
    tasks woken last would find their connection silent too long and take the general
    path (asking the socket first): not the path measured. Widened in both modules."""
    import equeue.client.aio
    import equeue.client.coalesce

    for module in (equeue.client.aio, equeue.client.coalesce):
        setattr(module, "HEARD_RECENTLY", 5.0)  # noqa: B010  # (a Final, on purpose)


def child(url: str, conns: int, depth: int, count: int, loop_name: str, body: int) -> None:
    if os.environ.get("EQUEUE_BENCH_VALGRIND"):
        _slowed()
    if loop_name == "uvloop":
        import uvloop

        loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    else:
        loop = asyncio.new_event_loop()
    print(f"cpu_us {loop.run_until_complete(_client(url, conns, depth, count, b'x' * body)):.2f}")
    loop.close()


def _run(src: str, argv: list[str], callgrind: Path | None) -> str:
    env = dict(os.environ, PYTHONPATH=src)
    if callgrind is not None:
        env["EQUEUE_BENCH_VALGRIND"] = "1"
    cmd = [sys.executable, __file__, "--child", *argv]
    if callgrind is not None:
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={callgrind}", *cmd]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=True)
    return out.stdout + out.stderr


def _run_together(src: str, argv: list[str], procs: int) -> str:
    """``procs`` clients started at once; each one's figures, then the means."""
    env = dict(os.environ, PYTHONPATH=src)
    cmd = [sys.executable, __file__, "--child", *argv]
    running = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(procs)
    ]
    outs = []
    try:
        for process in running:
            outs.append(process.communicate(timeout=900)[0])
    finally:
        for process in running:
            if process.poll() is None:
                process.kill()
                process.wait()
    figures: dict[str, list[float]] = {}
    for out in outs:
        for name, value in re.findall(r"(\w+) ([\d.]+)", out):
            figures.setdefault(name, []).append(float(value))
    means = " ".join(f"{k} {sum(v) / len(v):.2f}" for k, v in figures.items())
    return f"mean of {procs}: {means}"


def _ir(path: Path) -> int:
    match = re.search(r"^summary: (\d+)", path.read_text(), re.M)
    assert match, path
    return int(match.group(1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--src", action="append")
    parser.add_argument("--flush", default="async")
    parser.add_argument("--loop", default="asyncio")
    parser.add_argument("--conns", type=int, default=64)
    parser.add_argument("--depth", type=int, default=1)
    parser.add_argument("--body", type=int, default=100, help="bytes a message")
    parser.add_argument("--procs", type=int, default=1, help="client processes at once")
    parser.add_argument("--count", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--callgrind", action="store_true")
    parser.add_argument("--keep", help="with --callgrind: copy each 2N run's output here")
    parser.add_argument("--child")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.conns, args.depth, args.count, args.loop, args.body)
        return
    srcs = args.src or [str(Path(__file__).resolve().parent.parent)]
    with tempfile.TemporaryDirectory(prefix="eqa", dir="/tmp") as tmp:
        store = Path(tmp) / "s"
        store.mkdir()
        server = start_broker(store, args.flush, Path(tmp) / "log")
        try:
            import equeue

            with equeue.connect(server.url) as admin:
                admin.create_topic("t", 4)
            shape = ["--conns", str(args.conns), "--depth", str(args.depth), "--loop", args.loop]
            shape += ["--body", str(args.body)]
            for _ in range(args.rounds):
                for src in srcs:
                    if args.callgrind:
                        irs = []
                        for n in (args.count, 2 * args.count):
                            out = Path(tmp) / "cg.out"
                            _run(src, [server.url, *shape, "--count", str(n)], out)
                            irs.append(_ir(out))
                            if args.keep:  # (cg.TREE.N and .2N: a function-level difference)
                                name = f"cg.{Path(src).name}.{len(os.listdir(args.keep)):02d}"
                                shutil.copy(out, Path(args.keep) / name)
                        per = (irs[1] - irs[0]) / args.count
                        print(f"{src}: {per:,.0f} instructions per send", flush=True)
                    else:
                        argv = [server.url, *shape, "--count", str(args.count)]
                        if args.procs > 1:
                            out_text = _run_together(src, argv, args.procs)
                        else:
                            out_text = _run(src, argv, None)
                        shown = " ".join(out_text.split())
                        print(f"{src}: {shown} µs/send  load {os.getloadavg()[0]:.2f}", flush=True)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
