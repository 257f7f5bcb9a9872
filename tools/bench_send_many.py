"""CPU per message of the sync client's ``send_many`` against a real ``equeue serve``:
the client's process time and the broker's (/proc/PID/stat), for source trees given as
arguments, alternated (``--rounds``): a noisy machine moves rates, much less CPU time.

    python tools/bench_send_many.py /work/main /work/wt-many --count 100000 --rounds 2

Each run: a fresh store in /tmp, ``equeue serve --flush async`` and the client both run
from that tree (PYTHONPATH), one warm-up ``send_many`` of a tenth, then the measured one.
Both start in the run's temporary directory: ``python -m`` and ``python -c`` put their
working directory first on sys.path, ahead of PYTHONPATH, so started in a checkout they
would both run that checkout's equeue; the client's ``equeue.__file__`` is checked to lie
under the tree asked for (the broker resolves its import the same way, from the same
directory and PYTHONPATH).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CLIENT = r"""
import json, os, sys, time
import equeue
url = sys.argv[1]
count, size, window, pid = map(int, sys.argv[2:6])
def broker_cpu():
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
client = equeue.connect(url)
bodies = [os.urandom(size) for _ in range(1000)]
client.send_many("b", bodies * (count // 10000 or 1), window=window)  # warm-up
messages = bodies * (count // 1000)
server0, cpu0, wall0 = broker_cpu(), time.process_time(), time.perf_counter()
client.send_many("b", messages, window=window)
wall, cpu, server = time.perf_counter() - wall0, time.process_time() - cpu0, broker_cpu() - server0
print(json.dumps({"rate": len(messages) / wall, "client_us": cpu / len(messages) * 1e6,
                  "server_us": server / len(messages) * 1e6, "file": equeue.__file__}))
"""


def run_one(tree: Path, count: int, size: int, window: int) -> dict[str, Any]:
    tree = tree.resolve()  # the children start elsewhere: a relative tree would miss
    home = Path(tempfile.mkdtemp(prefix="eqbench", dir="/tmp"))
    env = {**os.environ, "PYTHONPATH": str(tree)}
    serve = [sys.executable, "-m", "equeue", "serve", str(home / "s"), "--quiet"]
    broker = subprocess.Popen(
        [*serve, "--flush", "async"], stdout=subprocess.PIPE, text=True, env=env, cwd=home
    )
    try:
        assert broker.stdout is not None
        line = broker.stdout.readline()
        if not line.startswith("listening on "):
            raise RuntimeError(f"the broker of {tree} did not start: {line!r}")
        url = line.split()[-1]
        args = [url, str(count), str(size), str(window), str(broker.pid)]
        out = subprocess.run(
            [sys.executable, "-c", CLIENT, *args],
            env=env, cwd=home, capture_output=True, text=True, timeout=600, check=True,
        )  # fmt: skip
        found: dict[str, Any] = json.loads(out.stdout)
        if not Path(found["file"]).resolve().is_relative_to(tree):
            raise RuntimeError(f"asked to measure {tree}, but the client ran {found['file']}")
        return found
    finally:
        broker.terminate()
        try:
            broker.wait(20)
        except subprocess.TimeoutExpired:
            broker.kill()
            broker.wait(10)
        shutil.rmtree(home, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("trees", nargs="+", type=Path, help="source trees to compare")
    parser.add_argument("--count", type=int, default=100_000)
    parser.add_argument("--sizes", default="100,1024", help="body sizes, bytes")
    parser.add_argument("--window", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=2)
    options = parser.parse_args(argv)
    print(f"load average {os.getloadavg()[0]:.2f} at the start")
    for size in map(int, options.sizes.split(",")):
        for round_ in range(options.rounds):
            for tree in options.trees:
                found = run_one(tree, options.count, size, options.window)
                print(
                    f"{size:5d} B  round {round_}  {tree!s:20s} {found['rate']:10,.0f} msg/s"
                    f"  client {found['client_us']:5.2f} us  broker {found['server_us']:5.2f} us"
                    f"  load {os.getloadavg()[0]:.1f}",
                    flush=True,
                )
                time.sleep(0.5)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
