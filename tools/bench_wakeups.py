"""Blocking-client wake-ups: ``--threads`` threads share one ``equeue.connect`` client,
each doing ``--calls`` round trips (ping), while ``--held`` more threads wait in long
polls the broker holds (as a group consumer's idle queues), against a real ``equeue
serve`` of the same tree (its own process, not traced). For each ``--src`` tree in turn,
alternated ``--rounds`` times: the client process's CPU per call (user + system, the
client only), the calls per second, and with ``--strace`` its futex system calls per
call (``strace -c -f -e trace=futex`` on the client process alone: a thread woken for an
answer that is not its own shows as a FUTEX_WAKE and a FUTEX_WAIT more; the GIL's
handovers are futex calls too), and always the client's voluntary context switches per
call (getrusage: every time one of its threads blocked).
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # brokerbench beside this file

from brokerbench.servers import start_broker


def child(url: str, threads: int, calls: int, held: int) -> None:
    import equeue

    client = equeue.connect(url)
    client.ping()
    start = threading.Barrier(threads + 1)
    polls = []
    if held:  # long polls held by the broker meanwhile (as a consumer's idle queues)
        client.create_topic("idle", held)
        polls = [
            threading.Thread(target=client.pull, args=("idle", q, 0, 1, None, 60.0))
            for q in range(held)
        ]
        for p in polls:
            p.start()
        for _ in range(1000):
            if client.stats()["held_pulls"] == held:
                break
            time.sleep(0.01)

    def lane() -> None:
        start.wait()
        for _ in range(calls):
            client.ping()

    workers = [threading.Thread(target=lane) for _ in range(threads)]
    for w in workers:
        w.start()
    cpu0, wall0 = time.process_time(), time.monotonic()
    switches0 = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
    start.wait()
    for w in workers:
        w.join(600)
    cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    switches = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - switches0
    for q in range(held):
        client.send("idle", b"end", queue_id=q)
    for p in polls:
        p.join(60)
    client.close()
    print(f"{threads * calls} {wall:.6f} {cpu:.6f} {switches}")


def measure(src: Path, threads: int, calls: int, held: int, trace: bool) -> str:
    directory = Path(tempfile.mkdtemp(prefix="eqwk", dir="/tmp"))
    env = dict(os.environ, PYTHONPATH=str(src))
    os.environ["PYTHONPATH"] = str(src)  # (the broker's tree: start_broker's child inherits)
    broker = start_broker(directory / "s", "async", directory / "broker.log")
    out = directory / "strace.txt"
    try:
        url = broker.url
        argv = [sys.executable, __file__, "--child", url, "--threads", str(threads),
                "--calls", str(calls), "--held", str(held)]  # fmt: skip
        if trace:
            argv = ["strace", "-c", "-f", "-e", "trace=futex", "-o", str(out), *argv]
        done = subprocess.run(argv, env=env, check=True, capture_output=True, timeout=900)
        total, wall, cpu, switches = done.stdout.decode().split()
        n = int(total)
        text = (
            f"{src}: {n / float(wall):,.0f} calls/s, client CPU {float(cpu) * 1e6 / n:.1f} us/call"
            f", voluntary context switches {int(switches) / n:.2f}/call"
        )
        if trace:
            row = r"^\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(\d+)?\s*futex"
            found = re.search(row, out.read_text(), re.M)
            futexes = int(found.group(1)) if found else 0
            text += f", futex calls {futexes / n:.2f}/call (traced: slower)"
        return text + f", load {os.getloadavg()[0]:.1f}"
    finally:
        broker.stop()
        shutil.rmtree(directory, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--child", metavar="URL")
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--calls", type=int, default=2000, help="round trips per thread")
    parser.add_argument("--held", type=int, default=0, help="long polls held meanwhile")
    parser.add_argument("--src", type=Path, action="append")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--strace", action="store_true")
    options = parser.parse_args()
    if options.child:
        child(options.child, options.threads, options.calls, options.held)
        return
    trees = options.src or [Path(__file__).resolve().parent.parent]
    for _ in range(options.rounds):
        for src in trees:
            print(measure(src.resolve(), options.threads, options.calls, options.held,
                          options.strace), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
