"""Instructions (callgrind) or CPU seconds per message of the batched produce case
(issue 23): a real ``equeue serve --flush async`` on its Unix socket and one producer
process sending ``send_batch`` of 100 random 100 B bodies (cycled from 64), one request at
a time, as tools/bench_broker.py's "broker, send_batch(100)" column does.

    python tools/bench_batch_cpu.py [--src DIR ...] [--count 400] [--body 100]
        [--callgrind | --rounds 3]

With ``--callgrind`` the broker and the producer both run under ``valgrind
--tool=callgrind``, twice per tree: ``--count`` N and 2N batches after the same set-up
(200 warm-up batches): (Ir(2N) - Ir(N)) / (100 N) instructions per message, each side's
and together, and the top functions (inclusive of nothing: self cost) of the 2N run's
difference where ``--top K`` asks. Without it (``--rounds``): the trees alternated
(A/B, B/A, ...), the broker's user + system CPU (``/proc/PID/stat``) and the producer's
``time.process_time()`` per message over ``--count`` batches, and the rate.
Each tree's broker and producer import that tree's ``equeue`` (PYTHONPATH, cwd).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_broker_cpu

BATCH = 100
WARMUP = 200

_PRODUCER = r"""
import os, sys, time
import equeue
url, count, warm, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
stat = f"/proc/{sys.argv[5]}/stat"
def server_cpu():
    fields = open(stat).read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
bodies = [os.urandom(size) for _ in range(64)]
chunk = [bodies[i % 64] for i in range(BATCH)]
client = equeue.connect(url)
send_batch = client.send_batch
for _ in range(warm):
    send_batch("t", chunk)
t0, w0, s0 = time.process_time(), time.perf_counter(), server_cpu()
for _ in range(count):
    send_batch("t", chunk)
t1, w1, s1 = time.process_time(), time.perf_counter(), server_cpu()
print(t1 - t0, w1 - w0, s1 - s0, flush=True)
client.close()
""".replace("BATCH", str(BATCH))


def _broker(src: Path, directory: Path, prefix: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    return bench_broker_cpu._broker(src, directory, prefix, flush="async")


def _produce(
    src: Path, url: str, count: int, size: int, prefix: list[str], cwd: Path, pid: int
) -> str:
    env = dict(os.environ, PYTHONPATH=str(src))
    argv = [sys.executable, "-c", _PRODUCER, url, str(count), str(WARMUP), str(size), str(pid)]
    done = subprocess.run(
        [*prefix, *argv], cwd=cwd, env=env, stdout=subprocess.PIPE, check=True, timeout=3600
    )
    return done.stdout.decode()


def _summary(path: Path) -> int:
    found = re.search(r"^summary:\s+(\d+)", path.read_text(), re.MULTILINE)
    if found is None:
        raise SystemExit(f"no summary line in {path}")
    return int(found.group(1))


def _top(path: Path, inclusive: bool) -> dict[str, int]:
    """Self (or inclusive) instructions per function (callgrind_annotate's view)."""
    out = subprocess.run(
        ["callgrind_annotate", "--threshold=100", f"--inclusive={'yes' if inclusive else 'no'}",
         str(path)],
        stdout=subprocess.PIPE, check=True, text=True,
    ).stdout  # fmt: skip
    costs: dict[str, int] = {}
    for line in out.splitlines():
        found = re.match(r"\s*([\d,]+)\s+(?:\([^)]*\)\s+)?(\S.*)$", line)
        if found and ":" in found.group(2):
            costs[found.group(2).strip()] = int(found.group(1).replace(",", ""))
    return costs


def callgrind(src: Path, count: int, size: int) -> tuple[Path, Path, int, int]:
    """One run, both sides under callgrind: the two output files and their totals."""
    directory = Path(tempfile.mkdtemp(prefix="eqbc", dir="/tmp"))
    server_out, client_out = directory / "broker.cg", directory / "producer.cg"
    grind = ["valgrind", "--tool=callgrind"]
    broker, url = _broker(src, directory, [*grind, f"--callgrind-out-file={server_out}"])
    try:
        grind_out = [*grind, f"--callgrind-out-file={client_out}"]
        _produce(src, url, count, size, grind_out, directory, broker.pid)
    finally:
        broker.terminate()
        broker.wait(600)
    return server_out, client_out, _summary(server_out), _summary(client_out)


def measure_callgrind(src: Path, count: int, size: int, top: int, inclusive: bool) -> None:
    small = callgrind(src, count, size)
    large = callgrind(src, 2 * count, size)
    messages = count * BATCH
    server = (large[2] - small[2]) / messages
    client = (large[3] - small[3]) / messages
    print(
        f"{src}: instructions per message: broker {server:,.0f}, producer {client:,.0f}, "
        f"together {server + client:,.0f} (N={count} batches of {BATCH} x {size} B)",
        flush=True,
    )
    if top:
        for side, a_path, b_path in (
            ("broker", small[0], large[0]),
            ("producer", small[1], large[1]),
        ):
            a, b = _top(a_path, inclusive), _top(b_path, inclusive)
            diff = {name: b.get(name, 0) - a.get(name, 0) for name in b}
            kind = "inclusive" if inclusive else "self"
            print(f"  {side}: {kind} instructions per message, top {top}")
            for name, cost in sorted(diff.items(), key=lambda kv: -kv[1])[:top]:
                print(f"    {cost / messages:9,.1f}  {name[:150]}")
    for run in (small, large):
        shutil.rmtree(run[0].parent, ignore_errors=True)


def measure_cpu(src: Path, count: int, size: int) -> str:
    directory = Path(tempfile.mkdtemp(prefix="eqbp", dir="/tmp"))
    broker, url = _broker(src, directory, [])
    try:
        out = _produce(src, url, count, size, [], directory, broker.pid)
        client_cpu, wall, server_cpu = (float(x) for x in out.split())
    finally:
        broker.terminate()
        broker.wait(60)
        shutil.rmtree(directory, ignore_errors=True)
    messages = count * BATCH
    return (
        f"{src}: {messages / wall:,.0f} msg/s, CPU us per message: producer "
        f"{client_cpu / messages * 1e6:.2f}, broker {server_cpu / messages * 1e6:.2f}, "
        f"load {os.getloadavg()[0]:.1f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", type=Path, action="append", help="a tree holding equeue/")
    parser.add_argument("--count", type=int, default=400, help="N: measured batches")
    parser.add_argument("--body", type=int, default=100, help="bytes a message")
    parser.add_argument("--callgrind", action="store_true")
    parser.add_argument("--top", type=int, default=0, help="--callgrind: top K functions")
    parser.add_argument("--inclusive", action="store_true", help="--top: inclusive costs")
    parser.add_argument("--rounds", type=int, default=3, help="without --callgrind: A/B rounds")
    options = parser.parse_args()
    sources = options.src or [Path(__file__).resolve().parent.parent]
    if options.callgrind:
        for src in sources:
            measure_callgrind(src, options.count, options.body, options.top, options.inclusive)
        return
    for round_ in range(options.rounds):
        for src in sources if round_ % 2 == 0 else sources[::-1]:
            print(measure_cpu(src, options.count, options.body), flush=True)
        time.sleep(0.1)


if __name__ == "__main__":
    main()
