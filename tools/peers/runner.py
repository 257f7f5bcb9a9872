"""The parent: plan the cases, run each in a child process, collect and check the results."""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import json
import os
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peers.scenarios import PEER, PEERS, SCENARIOS, Peer, Scenario

# The command line, which a child process runs with --case.
SCRIPT = str(Path(__file__).resolve().parent.parent / "bench_peers.py")


@dataclass
class Outcome:
    scenario: str
    peer: str
    variant: str
    count: int
    results: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def values(self, name: str) -> list[float]:
        return [float(r[name]) for r in self.results if name in r]

    def median(self, name: str) -> float:
        values = self.values(name)
        return statistics.median(values) if values else float("nan")


class Runner:
    def __init__(self, args: argparse.Namespace, base: Path) -> None:
        self.args = args
        self.base = base
        self.outcomes: dict[tuple[str, str, str], Outcome] = {}
        self.done = 0
        self.lock = threading.Lock()

    def count(self, scenario: Scenario, peer: Peer) -> int:
        if self.args.smoke:
            return peer.smoke_reduced.get(scenario.key, scenario.smoke)
        if scenario.kind == "reopen":
            size: int = self.args.reopen_size
            return min(peer.reduced.get("reopen", size), size)
        full = peer.reduced.get(scenario.key, scenario.full)
        return max(1, int(full * float(self.args.scale)))

    def outcome(self, scenario: Scenario, peer: Peer, variant: str, count: int) -> Outcome:
        key = (scenario.key, peer.key, variant)
        with self.lock:
            if key not in self.outcomes:
                self.outcomes[key] = Outcome(scenario.key, peer.key, variant, count)
            return self.outcomes[key]

    def fresh(self) -> Path:
        return Path(tempfile.mkdtemp(prefix="case-", dir=self.base))

    def child(self, spec: dict[str, Any]) -> dict[str, Any]:
        proc = subprocess.run(
            [sys.executable, SCRIPT, "--case", json.dumps(spec)],
            capture_output=True,
            text=True,
            timeout=self.args.case_timeout,
        )
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode != 0 or not lines:
            tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise RuntimeError(f"exit {proc.returncode}: {tail}")
        result: dict[str, Any] = json.loads(lines[-1])
        return result

    def report(self, outcome: Outcome, message: str) -> None:
        label = f"{outcome.scenario} {PEER[outcome.peer].name} {outcome.variant}".rstrip()
        with self.lock:
            self.done += 1
            progress(f"[{self.done}] {label}: {message}")

    def record(
        self, outcome: Outcome, spec: dict[str, Any], check: Callable[[dict[str, Any]], str]
    ) -> bool:
        try:
            result = self.child(spec)
            problem = check(result)
        except (RuntimeError, subprocess.TimeoutExpired, ValueError, KeyError) as exc:
            result, problem = {}, f"{type(exc).__name__}: {exc}"
        if problem:
            outcome.errors.append(problem)
            self.report(outcome, f"FAILED: {problem}")
            return False
        outcome.results.append(result)
        if outcome.scenario == "reopen":
            self.report(outcome, f"{result['seconds']:.3f} s")
        else:
            self.report(outcome, f"{outcome.count:,} msgs, {result['rate']:,.0f} msg/s")
        return True

    def run_size(self, size: int, peer: Peer) -> None:
        """The append cases of one body size, then the consume case on what was appended."""
        append = next((s for s in SCENARIOS if s.kind == "append" and s.size == size), None)
        consume = next((s for s in SCENARIOS if s.kind == "consume" and s.size == size), None)
        keep: Path | None = None
        kept_count = 0
        if append is not None and append.key in self.args.scenarios:
            count = self.count(append, peer)
            for variant in ("send", "send_batch") if peer.key == "equeue" else ("",):
                directory = self.fresh()
                spec: dict[str, Any] = {"op": "append", "peer": peer.key, "dir": str(directory)}
                spec |= {"size": size, "count": count, "variant": variant}

                def check(r: dict[str, Any], count: int = count) -> str:
                    return "" if r["stored"] == count else f"stored {r['stored']:,} of {count:,}"

                ok = self.record(self.outcome(append, peer, variant, count), spec, check)
                if ok and variant in ("", "send_batch"):
                    keep, kept_count = directory, count
                else:
                    shutil.rmtree(directory, ignore_errors=True)
        if consume is not None and consume.key in self.args.scenarios:
            count = self.count(consume, peer)
            outcome = self.outcome(consume, peer, "pull" if peer.key == "equeue" else "", count)
            if keep is None or kept_count != count:
                if keep is not None:
                    shutil.rmtree(keep, ignore_errors=True)
                keep = self.fresh()
                fill = {"op": "fill", "peer": peer.key, "dir": str(keep)}
                try:
                    self.child(fill | {"size": size, "count": count})
                except (RuntimeError, subprocess.TimeoutExpired) as exc:
                    outcome.errors.append(f"fill: {exc}")
                    self.report(outcome, f"fill FAILED: {exc}")
                    shutil.rmtree(keep, ignore_errors=True)
                    return
            spec = {"op": "consume", "peer": peer.key, "dir": str(keep)}

            def check_read(r: dict[str, Any], count: int = count) -> str:
                if r["read"] != count or r["mismatches"] or r["stored"] != count:
                    return (
                        f"read {r['read']:,} of {count:,} (the store held {r['stored']:,}), "
                        f"{r['mismatches']:,} differ from what was appended"
                    )
                return ""

            self.record(outcome, spec | {"size": size, "count": count}, check_read)
        if keep is not None:
            shutil.rmtree(keep, ignore_errors=True)

    def run_durable(self, scenario: Scenario, peer: Peer) -> None:
        count = self.count(scenario, peer)
        count -= count % scenario.threads
        variant = "send" if peer.key == "equeue" else ""
        directory = self.fresh()
        spec: dict[str, Any] = {"op": "durable", "peer": peer.key, "dir": str(directory)}
        spec |= {"size": scenario.size, "count": count, "threads": scenario.threads}

        def check(r: dict[str, Any], count: int = count) -> str:
            return "" if r["stored"] == count else f"stored {r['stored']:,} of {count:,}"

        self.record(self.outcome(scenario, peer, variant, count), spec, check)
        shutil.rmtree(directory, ignore_errors=True)

    def run_reopen(self, scenario: Scenario, peer: Peer) -> None:
        size = self.count(scenario, peer)
        outcome = self.outcome(scenario, peer, "", size)
        directory = self.fresh()
        try:
            written = self.fill_and_kill(peer, directory, scenario.size, size)
        except (RuntimeError, OSError) as exc:
            outcome.errors.append(f"fill: {exc}")
            self.report(outcome, f"fill FAILED: {exc}")
            shutil.rmtree(directory, ignore_errors=True)
            return
        spec = {"op": "reopen", "peer": peer.key, "dir": str(directory), "size": scenario.size}

        def check(r: dict[str, Any], written: tuple[int, int] = written) -> str:
            r["written"], r["disk_bytes"] = written
            return ""

        self.record(outcome, spec, check)
        shutil.rmtree(directory, ignore_errors=True)

    def fill_and_kill(self, peer: Peer, directory: Path, size: int, target: int) -> tuple[int, int]:
        """Fill a store with ``target`` bytes of bodies and SIGKILL the writer in the middle of
        the appends that follow: (messages written before those, bytes on disk)."""
        count = max(1, target // size)
        spec: dict[str, Any] = {"op": "fill", "peer": peer.key, "dir": str(directory)}
        spec["size"] = size
        spec |= {"count": count, "then_wait_for_kill": True}
        with subprocess.Popen(
            [sys.executable, SCRIPT, "--case", json.dumps(spec)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        ) as proc:
            assert proc.stdout is not None and proc.stderr is not None
            try:
                ready, _, _ = select.select([proc.stdout], [], [], self.args.case_timeout)
                line = proc.stdout.readline() if ready else ""
                if '"ready"' in line:
                    time.sleep(0.05)  # into the appends that follow
            finally:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
            if '"ready"' not in line:
                tail = (proc.stderr.read().strip().splitlines() or ["(no output)"])[-1]
                raise RuntimeError(f"the filling process did not get ready: {tail}")
        disk = sum(
            (Path(root) / name).stat().st_blocks * 512
            for root, _, names in os.walk(directory)
            for name in names
        )
        return count, disk

    def units(self) -> list[Callable[[], None]]:
        """One repeat's work, in independent pieces (a piece may hold several cases)."""
        peers = [p for p in PEERS if p.key in self.args.peers]
        wanted = [s for s in SCENARIOS if s.key in self.args.scenarios]
        units: list[Callable[[], None]] = []
        for size in sorted({s.size for s in wanted if s.kind in ("append", "consume")}):
            units += [functools.partial(self.run_size, size, peer) for peer in peers]
        for scenario in wanted:
            if scenario.kind == "durable":
                units += [functools.partial(self.run_durable, scenario, p) for p in peers]
            elif scenario.kind == "reopen":
                units += [functools.partial(self.run_reopen, scenario, p) for p in peers]
        return units

    def run(self) -> None:
        for rep in range(self.args.repeat):
            progress(f"--- repeat {rep + 1} of {self.args.repeat}")
            units = self.units()
            if self.args.jobs == 1:
                for unit in units:
                    unit()
                continue
            # Side by side (the smoke run): the figures then mean nothing, the checks do.
            with concurrent.futures.ThreadPoolExecutor(self.args.jobs) as pool:
                for future in [pool.submit(unit) for unit in units]:
                    future.result()


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
