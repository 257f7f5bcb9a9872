"""The kill test of tests/test_crash.py, for many iterations, with a summary.

    python tools/crash_test.py --iterations 300                 # all policies in turn
    python tools/crash_test.py --policy sync --seed 17 --iterations 1 --keep
    python tools/crash_test.py --retention --iterations 21      # 210 kills, 10 a store

``--retention``: the writer runs with ``max_store_bytes`` and ``apply_retention()``
every few milliseconds, and the store is checked after every kill
(tests/retention_checks.py): no queue's next offset goes back, and nothing
acknowledged that the log still holds is missing or different.

Iteration i runs seed SEED + i under the next policy; the seed fixes the plan
(how many writer runs, when each is killed), not the timing. A failing
iteration keeps its directory (the store as the kill left it is in
crash-image/) and prints how to rerun it; the exit status is 1 if any failed.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from crash_checks import IterationResult, run_kill_iteration
from crash_writer import POLICIES
from retention_checks import RetentionResult, run_retention_iteration

_STATS = (
    "acknowledged",
    "survivors",
    "unacknowledged survivors",
    "unacknowledged lost",
    "cuts",
    "redispatched",
    "recovery problems",
)


def summarize(results: list[IterationResult], elapsed: float) -> str:
    by_policy: defaultdict[str, list[IterationResult]] = defaultdict(list)
    for result in results:
        by_policy[result.policy].append(result)
    lines = [f"{len(results)} iterations in {elapsed:.0f} s"]
    for policy, group in by_policy.items():
        failed = [r for r in group if r.problems]
        kills: Counter[str] = Counter(run.plan.mode for r in group for run in r.rounds)
        stats: Counter[str] = Counter()
        notes: Counter[str] = Counter()
        for r in group:
            stats.update(r.verdict.stats)
            notes.update(r.notes)
        lines.append(
            f"\n{policy}: {len(group)} iterations, {len(failed)} failed, "
            f"{sum(len(r.rounds) for r in group)} kills "
            f"({', '.join(f'{n} {mode}' for mode, n in sorted(kills.items()))}), "
            f"{sum(1 for r in group for run in r.rounds if not run.ready)} before READY"
        )
        lines.append("  " + ", ".join(f"{stats[k]} {k}" for k in _STATS))
        lines += [f"  {n} x {note}" for note, n in sorted(notes.items())]
        if failed:
            lines.append("  failed seeds: " + " ".join(str(r.seed) for r in failed))
    return "\n".join(lines)


def summarize_retention(results: list[RetentionResult], elapsed: float) -> str:
    lines = [f"{len(results)} stores in {elapsed:.0f} s"]
    for policy in POLICIES:
        group = [r for r in results if r.policy == policy]
        if not group:
            continue
        stats: Counter[str] = Counter()
        for r in group:
            stats.update(r.history.stats)
        failed = [r for r in group if r.problems]
        lines.append(
            f"{policy}: {len(group)} stores, {len(failed)} failed, {stats['kills']} kills, "
            f"{stats['acknowledged']} acknowledged sends, {stats['retained acknowledged checked']}"
            f" acknowledged-and-retained checks, {stats['losses']} losses, "
            f"{stats['offsets back']} offsets back, {stats['cuts']} cuts, "
            f"{stats['recovery problems']} recovery problems"
        )
        if failed:
            lines.append("  failed seeds: " + " ".join(str(r.seed) for r in failed))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--policy", choices=[*POLICIES, "all"], default="all")
    parser.add_argument("--seed", type=int, help="first seed (default: from the clock)")
    parser.add_argument("--rounds", type=int, help="writer runs per store (default: by seed)")
    parser.add_argument("--workdir", type=Path, help="where stores go (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep passing iterations' dirs too")
    parser.add_argument("--stop-on-failure", action="store_true")
    parser.add_argument("-v", "--verbose", action="store_true", help="a line per iteration")
    parser.add_argument("--retention", action="store_true", help="the retention kill loop")
    parser.add_argument(
        "--kills", type=int, default=10, help="--retention: kills per store (default 10)"
    )
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else int(time.time()) % 1_000_000
    policies = POLICIES if args.policy == "all" else (args.policy,)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="equeue-crash-"))
    print(f"seed {seed}, policies {', '.join(policies)}, work in {workdir}", flush=True)
    if args.retention:
        return _retention_main(args, seed, policies, workdir)
    results: list[IterationResult] = []
    started = time.monotonic()
    for i in range(args.iterations):
        policy = policies[i % len(policies)]
        directory = workdir / f"{policy}-{seed + i}"
        if directory.exists():
            shutil.rmtree(directory)
        directory.mkdir(parents=True)
        result = run_kill_iteration(directory, policy, seed + i, rounds=args.rounds)
        results.append(result)
        if result.problems:
            print(f"\nFAILED {result.describe()}\n  kept in {directory}\n", flush=True)
        else:
            if not args.keep:
                shutil.rmtree(directory)
            if args.verbose:
                acks = sum(len(run.acks) for run in result.rounds)
                plans = "; ".join(str(run.plan) for run in result.rounds)
                print(f"ok {policy} seed {seed + i}: {acks} acks, killed {plans}", flush=True)
        if result.problems and args.stop_on_failure:
            break
    print(summarize(results, time.monotonic() - started))
    if not args.keep and not any(r.problems for r in results) and args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if any(r.problems for r in results) else 0


def _retention_main(
    args: argparse.Namespace, seed: int, policies: tuple[str, ...], workdir: Path
) -> int:
    results: list[RetentionResult] = []
    started = time.monotonic()
    for i in range(args.iterations):
        policy = policies[i % len(policies)]
        directory = workdir / f"retention-{policy}-{seed + i}"
        if directory.exists():
            shutil.rmtree(directory)
        result = run_retention_iteration(directory, policy, seed + i, args.kills)
        results.append(result)
        if result.problems:
            print(f"\nFAILED {result.describe()}\n  kept in {directory}\n", flush=True)
        else:
            if not args.keep:
                shutil.rmtree(directory)
            if args.verbose:
                print(
                    f"ok {policy} seed {seed + i}: {result.kills} kills, "
                    f"{len(result.history.acks)} acks",
                    flush=True,
                )
        if result.problems and args.stop_on_failure:
            break
    print(summarize_retention(results, time.monotonic() - started))
    failed = any(r.problems for r in results)
    if not args.keep and not failed and args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
