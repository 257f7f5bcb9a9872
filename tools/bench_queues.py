"""Benchmark of a store with many queues (issue 25): open files, memory per queue,
create_topic per queue, close and reopen time.

Each queue count runs in a fresh child process and a fresh store directory: TOPICS
topics of ``--per-topic`` queues, created with ``create_topic``, then one send to each
queue, then a close and a reopen. Printed per count: open file descriptors (the
process's, /proc/self/fd) after the sends and after the reopen, RSS after the sends,
µs per queue for create_topic and for the first send, close and reopen seconds. The
memory per idle queue is (RSS with N queues - RSS with the smallest count) / the queue
difference.

``--code DIR ...``: each count run once per source tree DIR (PYTHONPATH of the child),
alternated, ``--repeat`` times: before/after comparisons in one run. Each child also
times an fdatasync loop in its store directory (a 60-byte append and its fdatasync,
``FSYNC_LOOP`` times): what one durable append costs on this disk at that moment; a
create_topic that commits by one such append cannot be cheaper. And a read-only handle
opened beside the reopened writer: its open time, descriptors, queues it opened, a
refresh(), and whether it sees a topic the writer created after it opened.

``--kill``: a reopen after a SIGKILL of a writer of ``--cold`` queues that sent to 40
of them after its last checkpoint (how many queues re-dispatch opened, and the time),
a clean reopen, then ``equeue inspect`` and ``equeue verify`` of that store, timed.

``--inspect STORE``: ``equeue inspect`` and ``equeue verify`` of a store, timed (wall and
CPU), ``--repeat`` times; ``--kill --keep DIR`` builds the SIGKILLed store there and keeps it.
``--retention``, ``--compaction``: retention and the compaction job over ``--cold``
queues, timed (see their functions).

``--hot``: send/pull throughput to one hot queue with ``--cold`` cold queues beside it
vs without (alternated A, B, A, B), and a round-robin send over all the cold queues
(what the open-queue cache's churn costs).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from equeue import MessageStore, StoreConfig


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _config(args: argparse.Namespace) -> StoreConfig:
    extra: dict[str, Any] = {}
    if args.max_open_files:
        extra["max_open_files"] = args.max_open_files
    return StoreConfig(flush=args.flush, **extra)


FSYNC_LOOP = 2000


def fdatasync_loop(directory: Path) -> float:
    """µs per 60-byte append + fdatasync of a file in ``directory``."""
    path = directory / "bench.fdatasync"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.fsync(fd)
        started = time.perf_counter()
        for _ in range(FSYNC_LOOP):
            os.write(fd, b"x" * 60)
            os.fdatasync(fd)
        return (time.perf_counter() - started) / FSYNC_LOOP * 1e6
    finally:
        os.close(fd)
        path.unlink()


def reader_beside(store: MessageStore, directory: Path, out: dict[str, Any]) -> None:
    """A read-only handle opened beside the writer ``store``: open time, descriptors,
    queues opened; a refresh; a topic created after it opened."""
    fds = _fds()
    started = time.perf_counter()
    reader = MessageStore.open(directory, read_only=True)
    out["reader_open_s"] = time.perf_counter() - started
    out["reader_fds"] = _fds() - fds
    out["reader_queues_opened"] = reader._files.opened
    store.create_topic("late", 4)
    store.send("late", b"z", queue_id=3)
    started = time.perf_counter()
    reader.refresh()
    out["reader_refresh_s"] = time.perf_counter() - started
    out["reader_sees_late"] = "late" in reader.topics() and reader.queue_range("late", 3) == (
        0,
        1,
    )
    reader.close()


def child(queues: int, per_topic: int, directory: Path, args: argparse.Namespace) -> None:
    topics = [f"t{i:05d}" for i in range(max(1, queues // per_topic))]
    out: dict[str, Any] = {"queues": len(topics) * per_topic, "per_topic": per_topic}
    out["code"] = str(Path(str(__import__("equeue").__file__)).parent.parent)
    out["fdatasync_us"] = fdatasync_loop(directory)
    gc.collect()
    base_rss = _rss_kib()
    started = time.perf_counter()
    store = MessageStore.open(directory, _config(args))
    out["open_empty_s"] = time.perf_counter() - started
    started = time.perf_counter()
    for topic in topics:
        store.create_topic(topic, per_topic)
    out["create_us_per_queue"] = (time.perf_counter() - started) / out["queues"] * 1e6
    body = b"x" * 100
    started = time.perf_counter()
    for topic in topics:
        for q in range(per_topic):
            store.send(topic, body, queue_id=q)
    out["first_send_us_per_queue"] = (time.perf_counter() - started) / out["queues"] * 1e6
    gc.collect()
    out["fds_after_sends"] = _fds()
    out["rss_kib"] = _rss_kib() - base_rss
    started = time.perf_counter()
    store.close()
    out["close_s"] = time.perf_counter() - started
    gc.collect()
    started = time.perf_counter()
    store = MessageStore.open(directory, _config(args))
    out["reopen_s"] = time.perf_counter() - started
    out["fds_after_reopen"] = _fds()
    started = time.perf_counter()
    ranges = [store.queue_range(t, q) for t in store.topics() for q in store.queue_ids(t)]
    out["queue_range_all_s"] = time.perf_counter() - started
    assert all(r == (0, 1) for r in ranges), "every queue holds its one message"
    reader_beside(store, directory, out)
    store.close()
    out["fdatasync_us_after"] = fdatasync_loop(directory)
    print(json.dumps(out))


def run_counts(args: argparse.Namespace) -> list[dict[str, Any]]:
    results = []
    codes: list[Path | None] = list(args.code) if args.code else [None]
    runs = [(c, code) for c in args.queues for _ in range(args.repeat) for code in codes]
    for count, code in runs if args.code else [(c, None) for c in args.queues]:
        directory = Path(tempfile.mkdtemp(prefix="eqbq", dir=args.dir))
        env = dict(os.environ)
        if code is not None:
            env["PYTHONPATH"] = str(code)
        try:
            cmd = [sys.executable, __file__, "--child", str(count), "--per-topic",
                   str(args.per_topic), "--flush", args.flush, "--store", str(directory),
                   "--max-open-files", str(args.max_open_files)]  # fmt: skip
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env)
            if done.returncode != 0:
                print(f"{count} queues: failed\n{done.stderr[-2000:]}", file=sys.stderr)
                results.append({"queues": count, "error": done.stderr.strip().splitlines()[-1]})
                continue
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    return results


def print_counts(results: list[dict[str, Any]]) -> None:
    ok = [r for r in results if "error" not in r]
    small = min(ok, key=lambda r: r["queues"]) if ok else None
    print(
        f"{'queues':>7} {'fds':>6} {'fds reopen':>10} {'RSS MiB':>8} {'B/queue':>8} "
        f"{'create µs/q':>11} {'send1 µs/q':>10} {'close s':>8} {'reopen s':>8} {'ranges s':>8} "
        f"{'fdatasync µs':>12} {'reader s':>8} {'reader fds':>10} {'reader opened':>13} "
        f"{'refresh s':>9} {'late':>5}  code"
    )
    for r in results:
        if "error" in r:
            print(f"{r['queues']:>7} error: {r['error']}")
            continue
        per = ""
        if small is not None and r["queues"] > small["queues"]:
            per_queue = (r["rss_kib"] - small["rss_kib"]) * 1024 / (r["queues"] - small["queues"])
            per = f"{per_queue:.0f}"
        print(
            f"{r['queues']:>7} {r['fds_after_sends']:>6} {r['fds_after_reopen']:>10} "
            f"{r['rss_kib'] / 1024:>8.1f} {per:>8} {r['create_us_per_queue']:>11.0f} "
            f"{r['first_send_us_per_queue']:>10.0f} {r['close_s']:>8.2f} {r['reopen_s']:>8.2f} "
            f"{r['queue_range_all_s']:>8.3f} "
            f"{r['fdatasync_us']:>5.0f}/{r['fdatasync_us_after']:<6.0f} "
            f"{r['reader_open_s']:>8.3f} {r['reader_fds']:>10} {r['reader_queues_opened']:>13} "
            f"{r['reader_refresh_s']:>9.3f} {r['reader_sees_late']!s:>5}  {r['code']}"
        )


def hot(args: argparse.Namespace) -> None:
    """Hot-queue send and pull rates with and without cold queues, alternated."""
    body = b"x" * 100
    count = args.messages
    rates: dict[str, list[tuple[float, float]]] = {"alone": [], "beside": []}
    rr: list[float] = []
    for turn in range(args.repeat * 2):
        case = "alone" if turn % 2 == 0 else "beside"
        directory = Path(tempfile.mkdtemp(prefix="eqbh", dir=args.dir))
        try:
            with MessageStore.open(directory, _config(args)) as store:
                store.create_topic("hot", 1)
                cold = []
                if case == "beside":
                    for i in range(args.cold // 4):
                        store.create_topic(f"c{i:05d}", 4)
                        cold.append(f"c{i:05d}")
                    for topic in cold:  # every cold queue written once: its files opened
                        for q in range(4):
                            store.send(topic, body, queue_id=q)
                store.flush()  # the closed queues' entries synced: a steady state
                # and the kernel's writeback of the cold queues' 20,000 new files done
                # (both cases), so it does not run beside the timed part
                os.sync()
                started = time.perf_counter()
                for _ in range(count):
                    store.send("hot", body)
                send_rate = count / (time.perf_counter() - started)
                started = time.perf_counter()
                offset, pulled = 0, 0
                while pulled < count:
                    result = store.pull("hot", 0, offset, 256)
                    pulled += len(result.messages)
                    offset = result.next_offset
                pull_rate = count / (time.perf_counter() - started)
                rates[case].append((send_rate, pull_rate))
                if case == "beside":
                    rounds = max(1, args.rr_messages // len(cold) // 4)
                    started = time.perf_counter()
                    for _ in range(rounds):
                        for topic in cold:
                            for q in range(4):
                                store.send(topic, body, queue_id=q)
                    rr.append(rounds * len(cold) * 4 / (time.perf_counter() - started))
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    for case, values in rates.items():
        sends = [v[0] for v in values]
        pulls = [v[1] for v in values]
        print(
            f"hot queue {case:>6}: send {statistics.median(sends):>9,.0f}/s "
            f"(min {min(sends):,.0f} max {max(sends):,.0f}), pull "
            f"{statistics.median(pulls):>9,.0f}/s (min {min(pulls):,.0f} max {max(pulls):,.0f})"
        )
        print(f"  each turn (send, pull): {[(round(a), round(b)) for a, b in values]}")
    print(
        f"round-robin send over {args.cold} queues: {statistics.median(rr):,.0f}/s "
        f"(min {min(rr):,.0f} max {max(rr):,.0f})"
    )


def hot_reopened(args: argparse.Namespace) -> None:
    """The hot queue's pull and send CPU time in fresh processes over reopened stores: one
    with the hot queue alone, one with ``--cold`` written queues beside it (alternated,
    ``--repeat`` times). Apart from what building the cold queues leaves in the process
    and the page cache, which the in-run ``--hot`` figures carry."""
    base = Path(tempfile.mkdtemp(prefix="eqbr", dir=args.dir))
    stores = {"alone": base / "alone", "beside": base / "beside"}
    try:
        for case, directory in stores.items():
            cold = 0 if case == "alone" else args.cold
            _hot_child(args, "build", directory, cold)
        os.sync()
        for _ in range(args.repeat):
            for case, directory in stores.items():
                print(f"hot queue {case:>6}, reopened: {_hot_child(args, 'time', directory, 0)}")
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _hot_child(args: argparse.Namespace, mode: str, directory: Path, cold: int) -> str:
    command = [sys.executable, __file__, "--hot-child", mode, "--store", str(directory)]
    command += ["--cold", str(cold), "--messages", str(args.messages)]
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip()


def hot_child(mode: str, directory: Path, args: argparse.Namespace) -> None:
    body = b"x" * 100
    with MessageStore.open(directory, _config(args)) as store:
        if mode == "build":
            store.create_topic("hot", 1)
            for i in range(args.cold // 4):
                store.create_topic(f"c{i:05d}", 4)
                for q in range(4):
                    store.send(f"c{i:05d}", body, queue_id=q)
            for _ in range(args.messages):
                store.send("hot", body)
            return
        pulls = []
        for _ in range(5):
            started, offset, pulled = time.process_time(), 0, 0
            while pulled < args.messages:
                result = store.pull("hot", 0, offset, 256)
                pulled += len(result.messages)
                offset = result.next_offset
            pulls.append(time.process_time() - started)
        started = time.process_time()
        for _ in range(args.messages):
            store.send("hot", body)
        send = time.process_time() - started
    per = 1e9 / args.messages
    print(
        f"pull CPU ns/msg {statistics.median(pulls) * per:.0f} (5 passes: "
        f"{', '.join(f'{p * per:.0f}' for p in pulls)}), send CPU ns/msg {send * per:.0f}"
    )


def kill_child(directory: Path, queues: int, args: argparse.Namespace) -> None:
    """Build ``queues`` queues, one send each, a flush (checkpoint), then sends to 40 of
    them, then SIGKILL this process."""
    topics = [f"t{i:05d}" for i in range(queues // 4)]
    store = MessageStore.open(directory, _config(args))
    for topic in topics:
        store.create_topic(topic, 4)
        for q in range(4):
            store.send(topic, b"x" * 100, queue_id=q)
    store.flush()
    for i in range(args.messages // 10):
        store.send(topics[i % 10], b"y" * 100)
    os.kill(os.getpid(), 9)


def reopen_child(directory: Path, args: argparse.Namespace) -> None:
    started = time.perf_counter()
    store = MessageStore.open(directory, _config(args))
    took = time.perf_counter() - started
    opened = sum(q.checked for qs in store._queues.values() for q in qs)
    report = store.recovery
    print(
        json.dumps(
            {
                "reopen_s": took,
                "queues_opened": opened,
                "redispatched": report.redispatched,
                "problems": len(report.problems),
            }
        )
    )
    store.close()


def kill(args: argparse.Namespace) -> None:
    """Reopen after a SIGKILL with --cold queues; then inspect and verify timed."""
    directory = args.keep or Path(tempfile.mkdtemp(prefix="eqbk", dir=args.dir))
    directory.mkdir(parents=True, exist_ok=True)
    try:
        base = [
            sys.executable,
            __file__,
            "--flush",
            args.flush,
            "--store",
            str(directory),
            "--max-open-files",
            str(args.max_open_files),
            "--messages",
            str(args.messages),
        ]
        subprocess.run([*base, "--kill-child", str(args.cold)], timeout=1800)
        done = subprocess.run([*base, "--reopen-child"], capture_output=True, text=True,
                              timeout=600)  # fmt: skip
        print("reopen after SIGKILL:", done.stdout.strip() or done.stderr[-2000:])
        done = subprocess.run([*base, "--reopen-child"], capture_output=True, text=True,
                              timeout=600)  # fmt: skip
        print("clean reopen:", done.stdout.strip() or done.stderr[-2000:])
        time_commands(directory, 1)
    finally:
        if args.keep is None:
            shutil.rmtree(directory, ignore_errors=True)


def time_commands(directory: Path, repeat: int) -> None:
    """``equeue inspect`` and ``equeue verify`` of the store, each ``repeat`` times
    (alternated), timed: wall seconds, and the CPU seconds (user + system) the child
    used, which the machine's other work disturbs less; the load average beside."""
    for turn in range(repeat):
        for command in ("inspect", "verify"):
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            started = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "equeue", command, str(directory)],
                                  capture_output=True, text=True, timeout=1800)  # fmt: skip
            wall = time.perf_counter() - started
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            user, system = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
            lines = done.stdout.count("\n")
            print(
                f"equeue {command} (turn {turn + 1}): {wall:.2f} s wall, CPU {user:.2f} s user "
                f"+ {system:.2f} s system, exit {done.returncode}, {lines} lines of output, "
                f"load average {os.getloadavg()[0]:.1f}",
                flush=True,
            )


def retention_bench(args: argparse.Namespace) -> None:
    """``--retention``: ``--cold`` queues (topics of 4), one message each, then filler
    to one queue past several 1 MiB log chunks; a store reopened with a size bound so that
    ``apply_retention`` removes the log chunks holding every queue's message (each
    queue's first offset moves), timed with the queues it opened; then more filler and a
    second removal that leaves the many queues as they are (the common case), timed."""
    directory = Path(tempfile.mkdtemp(prefix="eqbr", dir=args.dir))
    body = b"r" * 100
    try:
        base = {"chunk_data_size": 1 << 20, "flush": args.flush}
        if args.max_open_files:
            base["max_open_files"] = args.max_open_files
        topics = [f"t{i:05d}" for i in range(args.cold // 4)]
        with MessageStore.open(directory, StoreConfig(**base)) as store:
            for topic in topics:
                store.create_topic(topic, 4)
                for q in range(4):
                    store.send(topic, body, queue_id=q)
            store.create_topic("filler", 1)
            for _ in range(3 * (1 << 20) // 150):
                store.send("filler", body)
        bounded = StoreConfig(**base, max_store_bytes=2 << 20)
        with MessageStore.open(directory, bounded) as store:
            for step in ("moves every queue", "moves no cold queue"):
                opened = store._files.opened
                started = time.perf_counter()
                removed = store.apply_retention()
                took = time.perf_counter() - started
                moved = sum(store.queue_range(t, q)[0] > 0 for t in topics for q in range(4))
                print(
                    f"retention over {len(topics) * 4} queues, removal that {step}: "
                    f"{took:.3f} s, {removed} log chunks removed, {store._files.opened - opened} "
                    f"queues opened, {moved} queues start past offset 0, load average "
                    f"{os.getloadavg()[0]:.1f}",
                    flush=True,
                )
                for _ in range(2 * (1 << 20) // 150):
                    store.send("filler", body)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def compaction_bench(args: argparse.Namespace) -> None:
    """``--compaction``: ``--cold`` queues, half of the topics compacted (3 keys a queue),
    half with a 30 s retention, two messages a queue; the compaction job (a local Spark
    session, ``local[2]``) timed, then a pull through every queue, then ``verify``."""
    from equeue.compaction.job import compact
    from equeue.inspect.verify import verify_store

    directory = Path(tempfile.mkdtemp(prefix="eqbc", dir=args.dir))
    try:
        config = StoreConfig(chunk_data_size=1 << 20, flush=args.flush)
        with MessageStore.open(directory, config) as store:
            topics = [f"k{i:05d}" if i % 2 else f"d{i:05d}" for i in range(args.cold // 4)]
            for topic in topics:
                if topic.startswith("k"):
                    store.create_topic(topic, 4, cleanup="compact")
                else:
                    store.create_topic(topic, 4, retention=dt.timedelta(seconds=30))
            for round_ in range(2):
                for topic in topics:
                    for q in range(4):
                        key = f"key{(round_ + q) % 3}" if topic.startswith("k") else None
                        store.send(topic, b"c" * 100, key=key, queue_id=q)
            store.create_topic("filler", 1)
            for _ in range(2 * (1 << 20) // 150):  # the chunks above completed
                store.send("filler", b"f" * 100)
        started = time.perf_counter()
        report = compact(directory, master="local[2]", now=time.time() + 60, quiet=True)
        took = time.perf_counter() - started
        print(
            f"compaction over {len(topics) * 4} queues: {took:.1f} s (Spark start included), "
            f"{report.records_removed} records removed, {report.bytes_before:,} -> "
            f"{report.bytes_after:,} bytes, load average {os.getloadavg()[0]:.1f}",
            flush=True,
        )
        started = time.perf_counter()
        pulled = 0
        with MessageStore.open(directory, config) as store:
            for topic in topics:
                for q in range(4):
                    pulled += len(store.pull(topic, q, 0, 100).messages)
        print(f"pull through every queue after: {time.perf_counter() - started:.2f} s, "
              f"{pulled} messages")  # fmt: skip
        started = time.perf_counter()
        problems = verify_store(directory)
        print(f"verify after: {time.perf_counter() - started:.2f} s, {len(problems)} problems")
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--queues", type=int, nargs="+", default=[10, 1000, 10000])
    parser.add_argument("--per-topic", type=int, default=4)
    parser.add_argument("--flush", default="async", choices=["sync", "async", "os"])
    parser.add_argument("--max-open-files", type=int, default=0, help="0: the default")
    parser.add_argument("--dir", type=Path, default=Path("/tmp"))
    parser.add_argument("--hot", action="store_true")
    parser.add_argument("--hot-reopened", action="store_true", help="hot queue CPU, reopened")
    parser.add_argument("--hot-child", help=argparse.SUPPRESS)
    parser.add_argument("--cold", type=int, default=10000)
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--rr-messages", type=int, default=40_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--kill", action="store_true", help="reopen after SIGKILL, inspect")
    parser.add_argument("--keep", type=Path, help="--kill: build the store here and keep it")
    parser.add_argument("--inspect", type=Path, help="time inspect and verify of this store")
    parser.add_argument("--retention", action="store_true", help="retention over --cold queues")
    parser.add_argument("--compaction", action="store_true", help="compaction, --cold queues")
    parser.add_argument("--code", type=Path, nargs="+", help="source trees to alternate")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--kill-child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--reopen-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--store", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args.child, args.per_topic, args.store, args)
        return
    if args.hot_child is not None:
        hot_child(args.hot_child, args.store, args)
        return
    if args.hot_reopened:
        hot_reopened(args)
        return
    if args.kill_child is not None:
        kill_child(args.store, args.kill_child, args)
        return
    if args.reopen_child:
        reopen_child(args.store, args)
        return
    if args.kill:
        kill(args)
        return
    if args.inspect is not None:
        time_commands(args.inspect, args.repeat)
        return
    if args.retention:
        retention_bench(args)
        return
    if args.compaction:
        compaction_bench(args)
        return
    if args.hot:
        hot(args)
        return
    print_counts(run_counts(args))


if __name__ == "__main__":
    main()
