"""The report: markdown tables of a run (the median over repeats, min-max beside it), the
targets of issue 23 and whether each was met, and the progress lines on stderr."""

from __future__ import annotations

import math
import statistics
import sys
from typing import Any

PRODUCE_COLUMNS = [
    ("broker-batch", "broker, send_batch({batch})"),
    ("broker-single", "broker, unbatched: asyncio client, {window} sends in flight"),
    ("broker-many", "broker, unbatched: sync send_many, window {window}"),
    ("store-batch", "in-process store, send_batch({batch})"),
    ("store-single", "in-process store, send"),
    ("redis", "Redis, XADD pipelines of {batch}"),
]
DASH, TIMES = "\u2013", "\u00d7"  # escaped: ruff's RUF001 flags them in source
DURABLE_FACTOR = 10
DURABLE_FLOOR = 60_000
BATCHED_TARGET = 1_000_000
PIPELINED_TARGET = 100_000
P99_TARGET_US = 1000.0
# The two readings of "64 concurrent asyncio producers" (brokerbench/cases.py durable),
# each also over shared-memory rings (the broker's --shm, the clients' shm=True):
# (equeue's system, Redis's, how the row names it).
ON_RINGS = "on shared-memory rings (`--shm`, `shm=True`)"
DURABLE_READINGS = [
    ("broker", "redis", "a connection per task"),
    ("broker-shm", "redis", f"a connection per task, {ON_RINGS}"),
    ("broker-shared", "redis-shared", "one client per process, shared by its tasks"),
    ("broker-shm-shared", "redis-shared", f"one client per process, shared, {ON_RINGS}"),
]
# The ceiling of a durable row (brokerbench/cases.py durable): its system's name after
# this prefix, the same producers against a --flush async broker (no fdatasync waited for)
CEILING = "async-"


def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def percentiles(samples: list[int]) -> dict[str, float]:
    ordered = sorted(samples)

    def at(fraction: float) -> float:
        return ordered[min(len(ordered) - 1, math.ceil(fraction * len(ordered)) - 1)] / 1000

    return {
        "p50_us": at(0.50),
        "p90_us": at(0.90),
        "p99_us": at(0.99),
        "p999_us": at(0.999),
        "max_us": ordered[-1] / 1000,
        "mean_us": statistics.fmean(ordered) / 1000,
    }


def describe(run: dict[str, Any]) -> str:
    text = f"{run['count']:,} in {run['seconds']:.2f} s = {run['rate']:,.0f}/s"
    if run.get("capped"):
        text += " (time cap)"
    if "p99_us" in run:
        text += f", p50 {run['p50_us']:.0f} us, p99 {run['p99_us']:.0f} us"
    if "server_cpu" in run and run["count"]:
        text += f", server CPU {run['server_cpu'] / run['count'] * 1e6:.1f} us/msg"
    if "error" in run:
        text += f" ERROR {run['error'][:300]}"
    return text


class Table:
    """The runs of one section, by case and system."""

    def __init__(self, runs: list[dict[str, Any]], section: str) -> None:
        self.by: dict[tuple[str, str], list[dict[str, Any]]] = {}
        self.cases: list[str] = []
        for run in runs:
            if run["section"] != section:
                continue
            if run["case"] not in self.cases:
                self.cases.append(run["case"])
            self.by.setdefault((run["case"], run["system"]), []).append(run)

    def runs(self, case: str, system: str) -> list[dict[str, Any]]:
        return self.by.get((case, system), [])

    def first(self, case: str) -> dict[str, Any]:
        return next(r for (c, _), rs in self.by.items() if c == case for r in rs)

    def median(self, case: str, system: str, field: str = "rate") -> float | None:
        values = [r[field] for r in self.runs(case, system) if "error" not in r and field in r]
        return statistics.median(values) if values else None

    def cell(self, case: str, system: str, field: str = "rate") -> str:
        runs = self.runs(case, system)
        if not runs:
            return DASH
        values = [r[field] for r in runs if "error" not in r and field in r]
        if not values:
            return "failed"
        text = _number(statistics.median(values))
        if len(values) > 1:
            text += f" ({_number(min(values))}{DASH}{_number(max(values))})"
        if any(r.get("capped") for r in runs):
            text += " ⏱"
        return text

    def cpu(self, case: str, system: str, field: str) -> str:
        per = [r[field] / r["count"] * 1e6 for r in self.runs(case, system) if r.get("count")]
        per = [p for p in per if p > 0]
        return f"{statistics.median(per):.1f}" if per else DASH


def _number(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:,.1f}"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a and b else DASH


def markdown(meta: dict[str, Any], runs: list[dict[str, Any]]) -> str:
    names = {"batch": meta["batch"], "window": meta["window"]}
    out = [_meta_lines(meta), ""]
    produce = Table(runs, "produce")
    if produce.cases:
        out += _produce(produce, names)
    consume = Table(runs, "consume")
    if consume.cases:
        out += ["#### Consumer group, 100 B (msg/s)", ""]
        out += ["| consumer processes | broker: group consumer | Redis: XREADGROUP + XACK "
                "| broker / Redis | CPU µs/msg, server / clients: broker | Redis |",
                "|---|--:|--:|--:|--:|--:|"]  # fmt: skip
        for case in consume.cases:
            first = consume.first(case)
            broker, redis = consume.median(case, "broker"), consume.median(case, "redis")
            out.append(
                f"| {first['consumers']} | {consume.cell(case, 'broker')} | "
                f"{consume.cell(case, 'redis')} | {_ratio(broker, redis)} | "
                f"{_cpus(consume, case, 'broker')} | {_cpus(consume, case, 'redis')} |"
            )
        out.append("")
    latency = Table(runs, "latency")
    if latency.cases:
        out += ["#### Send round trip, 100 B, one request at a time (µs)", ""]
        out += [
            "| system | p50 | p90 | p99 | p99.9 | max | sends |",
            "|---|--:|--:|--:|--:|--:|--:|",
        ]
        labels = {
            "broker": "broker, sync client `send`",
            "redis": "Redis, `XADD`",
            "store": "in-process store, `send` (no round trip)",
        }
        for case in latency.cases:
            for system, label in labels.items():
                if not latency.runs(case, system):
                    continue
                cells = [latency.cell(case, system, f) for f in
                         ("p50_us", "p90_us", "p99_us", "p999_us", "max_us", "count")]  # fmt: skip
                out.append(f"| {label} | " + " | ".join(cells) + " |")
        out.append("")
    durable = Table(runs, "durable")
    if durable.cases:
        out += _durable(durable)
    out += ["#### Targets", ""] + [f"- {line}" for line in targets(runs)] + [""]
    if meta["notes"]:
        out += ["#### Notes from the run", ""] + [f"- {note}" for note in meta["notes"]] + [""]
    return "\n".join(out)


def _meta_lines(meta: dict[str, Any]) -> str:
    before = "/".join(f"{x:.2f}" for x in meta["load_before"])
    after = "/".join(f"{x:.2f}" for x in meta["load_after"])
    return "\n".join(
        [
            f"- Run: {meta['date']}, {meta['repeat']} repeat(s) per system and case"
            + (" (**--quick**: smoke counts, figures meaningless)" if meta["quick"] else "")
            + f", each run capped at {meta['cap']:g} s (⏱: a run hit the cap)",
            f"- Python {meta['python']}, {meta['cpus']} CPUs, Linux {meta['kernel']}, "
            f"{meta['file_system']}; Redis {meta['redis']}, {meta['redis_py']}",
            f"- Source: {meta['source']}",
            f"- Event loops: the broker's {meta.get('event_loop', '(its default)')}, "
            f"the asyncio producers' {meta.get('client_loop', 'asyncio')}",
            f"- The --flush sync broker's group-commit wait: "
            f"{_wait_text(meta.get('group_commit_wait_us'))}"
            + (
                f", --group-commit-overlap {meta['group_commit_overlap']}"
                if meta.get("group_commit_overlap") is not None
                else ""
            )
            + (
                f", --busy-poll-us {meta['busy_poll_us']}"
                if meta.get("busy_poll_us") is not None
                else ""
            ),
            f"- Load average (1/5/15 min): before {before}, after {after}",
            f"- Wall time: {meta['wall_seconds']:.0f} s",
        ]
    )


def _produce(table: Table, names: dict[str, Any]) -> list[str]:
    out = ["#### Producers over the Unix socket (msg/s, in total over the processes)", ""]
    header = [label.format(**names) for _, label in PRODUCE_COLUMNS]
    header += ["broker / Redis: batch", "asyncio", "send_many"]
    out += ["| body | producer processes | " + " | ".join(header) + " |"]
    out += ["|---|--:|" + "--:|" * len(header)]
    for case in table.cases:
        first = table.first(case)
        cells = [table.cell(case, system) for system, _ in PRODUCE_COLUMNS]
        redis = table.median(case, "redis")
        cells.append(_ratio(table.median(case, "broker-batch"), redis))
        cells.append(_ratio(table.median(case, "broker-single"), redis))
        cells.append(_ratio(table.median(case, "broker-many"), redis))
        out.append(f"| {_size(first['body'])} | {first['producers']} | " + " | ".join(cells) + " |")
    out += ["", "CPU per message (µs: the server process's, the producer processes' together):", ""]
    out += ["| body | producer processes | broker batch: server / clients | broker asyncio: "
            "server / clients | broker send_many: server / clients | Redis: server / clients |",
            "|---|--:|--:|--:|--:|--:|"]  # fmt: skip
    for case in table.cases:
        first = table.first(case)
        cells = [
            _cpus(table, case, s) for s in ("broker-batch", "broker-single", "broker-many", "redis")
        ]
        out.append(f"| {_size(first['body'])} | {first['producers']} | " + " | ".join(cells) + " |")
    return [*out, ""]


def _durable(table: Table) -> list[str]:
    out = ["#### Durable sends, 100 B (msg/s)", ""]
    out += [
        'Every row is its own reading of "64 concurrent asyncio producers": *a connection '
        "per task* (64 `equeue.aio.connect` clients; 64 redis-py `single_connection_client`s: "
        "the broker's group commit across connections) and *one client per process, shared "
        "by its tasks* (one `equeue.aio.connect`, whose sends of a loop turn coalesce into one "
        "request; one `redis.asyncio.Redis`, whose pool lends each concurrent XADD a "
        "connection of its own). The rows *on shared-memory rings* are the same two over "
        "the same broker (started with `--shm`), each client connecting with `shm=True` "
        '(docs/protocol.md "Shared-memory rings"); their Redis cells repeat the '
        "socket rows' Redis. *No fdatasync waited for* is each row's ceiling on this host: the "
        "same producers against a `--flush async` broker (each send answered after its "
        "append; its store still fdatasyncs in the background, every `flush_interval_ms` and "
        "at checkpoints), measured in the same alternation. It is the row with the wait for "
        "the disk taken away: an argument, not a measurement, says a durable row cannot pass "
        "it (with `--busy-poll-us` the two brokers do not even run the same loop code).",
        "",
    ]
    out += ["| producers | reading | broker `--flush sync` | Redis `appendfsync always` | "
            "append + fdatasync loop | broker / loop | broker / Redis | no fdatasync waited for: "
            "broker "
            "`--flush async` | its / loop | broker: sends per fdatasync | CPU µs/msg, "
            "server / clients: broker | Redis |",
            "|---|---|" + "--:|" * 10]  # fmt: skip
    for case in table.cases:
        first = table.first(case)
        who = f"{first['producers']} asyncio tasks in {first['processes']} process(es)"
        loop = table.median(case, "fdatasync")
        for ours, theirs, reading in DURABLE_READINGS:
            if not table.runs(case, ours) and not table.runs(case, theirs):
                continue
            broker = table.median(case, ours)
            out.append(
                f"| {who} | {reading} | {table.cell(case, ours)} | {table.cell(case, theirs)} | "
                f"{table.cell(case, 'fdatasync')} | {_ratio(broker, loop)} | "
                f"{_ratio(broker, table.median(case, theirs))} | "
                f"{table.cell(case, CEILING + ours)} | "
                f"{_ratio(table.median(case, CEILING + ours), loop)} | "
                f"{_per_flush(table, case, ours)} "
                f"| {_cpus(table, case, ours)} | {_cpus(table, case, theirs)} |"
            )
    return [*out, ""]


def _per_flush(table: Table, case: str, system: str) -> str:
    per = [r["count"] / r["flushes"] for r in table.runs(case, system) if r.get("flushes")]
    return f"{statistics.median(per):.1f}" if per else DASH


def _cpus(table: Table, case: str, system: str) -> str:
    return f"{table.cpu(case, system, 'server_cpu')} / {table.cpu(case, system, 'client_cpu')}"


def _size(body: int) -> str:
    return f"{body // 1024} KiB" if body >= 1024 else f"{body} B"


def _verdict(ok: bool | None) -> str:
    return "**not measured**" if ok is None else "**met**" if ok else "**not met**"


def targets(runs: list[dict[str, Any]]) -> list[str]:
    lines = []
    behind: list[str] = []
    compared = 0
    for section, pairs in (
        (
            "produce",
            [("broker-batch", "redis"), ("broker-single", "redis"), ("broker-many", "redis")],
        ),
        ("consume", [("broker", "redis")]),
        ("durable", [(ours, theirs) for ours, theirs, _ in DURABLE_READINGS]),
    ):
        table = Table(runs, section)
        for case in table.cases:
            for ours, theirs in pairs:
                a, b = table.median(case, ours), table.median(case, theirs)
                if a is None or b is None:
                    continue
                compared += 1
                if a <= b:
                    behind.append(f"{case} ({ours}: {a / b:.2f}{TIMES} Redis)")
    latency = Table(runs, "latency")
    for case in latency.cases:
        a, b = latency.median(case, "broker", "p99_us"), latency.median(case, "redis", "p99_us")
        if a is not None and b is not None:
            compared += 1
            if a >= b:
                behind.append(f"{case} (p99 {a:.0f} µs vs Redis {b:.0f} µs)")
    ok = None if not compared else not behind
    detail = f"{compared - len(behind)} of {compared} comparisons ahead"
    if behind:
        detail += "; behind in: " + "; ".join(behind)
    lines.append(f"ahead of Redis Streams in every case measured: {_verdict(ok)} — {detail}")

    durable = Table(runs, "durable")
    for case in durable.cases:  # every reading's row on its own: none stands for another
        loop = durable.median(case, "fdatasync")
        for ours, theirs, reading in DURABLE_READINGS:
            if not durable.runs(case, ours):
                continue
            lines += _durable_targets(
                f"{case}, {reading}", durable.median(case, ours), loop,
                durable.median(case, theirs), durable.median(case, CEILING + ours),
            )  # fmt: skip
    produce = Table(runs, "produce")
    batched = next((c for c in produce.cases if c == "produce 4p 100B"), None)
    rate = produce.median(batched, "broker-batch") if batched else None
    lines.append(
        f"4 producer processes batched ≥ {BATCHED_TARGET:,} msg/s at 100 B: "
        f"{_verdict(None if rate is None else rate >= BATCHED_TARGET)}"
        + (f" — {rate:,.0f} msg/s" if rate else "")
    )
    single = produce.median("produce 1p 100B", "broker-single")
    lines.append(
        f"unbatched pipelined asyncio sends ≥ {PIPELINED_TARGET:,} msg/s per connection (1 "
        f"producer, 100 B): {_verdict(None if single is None else single >= PIPELINED_TARGET)}"
        + (f" — {single:,.0f} msg/s" if single else "")
    )
    p99 = next((latency.median(c, "broker", "p99_us") for c in latency.cases), None)
    lines.append(
        f"p99 round trip < 1 ms: {_verdict(None if p99 is None else p99 < P99_TARGET_US)}"
        + (f" — p99 {p99:.0f} µs (the machine was not idle: see the load average)" if p99 else "")
    )
    return lines


def _durable_targets(
    row: str, broker: float | None, loop: float | None, redis: float | None,
    ceiling: float | None,
) -> list[str]:  # fmt: skip
    met = None if broker is None or loop is None else broker >= DURABLE_FACTOR * loop
    shown = f"{broker:,.0f} vs loop {loop:,.0f} msg/s" if broker and loop else DASH
    if broker and loop:
        shown += f" ({broker / loop:.1f}{TIMES})"
    if ceiling and loop:  # what the row could reach here with the disk taken away
        shown += (f"; with no fdatasync waited for (`--flush async`) the same sends make "
                  f"{ceiling:,.0f} ({ceiling / loop:.1f}{TIMES})")  # fmt: skip
    lines = [
        f"durable ≥ {DURABLE_FACTOR}{TIMES} the fdatasync loop ({row}): {_verdict(met)} — {shown}"
    ]
    lines.append(
        f"durable ≥ {DURABLE_FLOOR:,} msg/s ({row}): "
        f"{_verdict(None if broker is None else broker >= DURABLE_FLOOR)}"
        + (f" — {broker:,.0f} msg/s" if broker is not None else "")
    )
    ahead = None if broker is None or redis is None else broker > redis
    lines.append(
        f"durable ahead of Redis `appendfsync always` at the same concurrency ({row}): "
        f"{_verdict(ahead)}"
        + (f" — {broker:,.0f} vs {redis:,.0f} msg/s" if broker and redis else "")
    )
    return lines


def summary(runs: list[dict[str, Any]]) -> str:
    failed = [r for r in runs if "error" in r]
    lines = [f"{len(runs)} runs, {len(failed)} failed"]
    lines += [f"FAILED {r['case']} {r['system']}: {r['error'][:500]}" for r in failed]
    return "\n".join(lines)


def _wait_text(wait: object) -> str:
    if wait is None:
        return "its default (--group-commit-wait-us not given)"
    return f"--group-commit-wait-us {wait}"
