"""The report: the peers section of docs/benchmarks.md, its tables and targets."""

from __future__ import annotations

import os
import re
import sqlite3
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from peers.runner import Outcome
from peers.scenarios import (
    ENGINES,
    PEER,
    PEER_NAMES,
    PEERS,
    QUEUES,
    SCENARIO,
    SCENARIOS,
    Scenario,
)
from peers.stores import MiB

BEGIN = "<!-- peers:begin"
END = "<!-- peers:end -->"
DASH = "\u2013"  # en dash, for ranges


def fmt_rate(value: float) -> str:
    return f"{value:,.0f}" if value == value else "-"


def fmt_mib(value: float) -> str:
    if value != value:
        return "-"
    return f"{value:,.1f}" if value < 100 else f"{value:,.0f}"


def fmt_secs(value: float) -> str:
    return f"{value:.3f}" if value == value else "-"


def fmt_ratio(value: float) -> str:
    if value != value:
        return "-"
    return f"{value:.2f}" if value < 10 else f"{value:.1f}" if value < 100 else f"{value:,.0f}"


def spread(outcome: Outcome, name: str, fmt: Callable[[float], str]) -> str:
    values = outcome.values(name)
    if not values:
        return "failed: " + "; ".join(outcome.errors) if outcome.errors else "-"
    text = fmt(statistics.median(values))
    if len(values) > 1:
        text += f" ({fmt(min(values))}{DASH}{fmt(max(values))})"
    if outcome.errors:
        text += f" [{len(outcome.errors)} failed]"
    return text


def fmt_size(n: float) -> str:
    if n >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    return f"{n / MiB:,.0f} MiB" if n >= MiB else f"{n / 1024:,.0f} KiB"


def row_name(outcome: Outcome) -> str:
    if outcome.peer == "equeue":
        return f"**equeue `{outcome.variant}`**" if outcome.variant else "**equeue**"
    return PEER[outcome.peer].name


@dataclass
class Report:
    outcomes: dict[tuple[str, str, str], Outcome]
    meta: dict[str, Any]
    smoke: bool

    def get(self, scenario: str, peer: str, variant: str = "") -> Outcome | None:
        return self.outcomes.get((scenario, peer, variant))

    def rows(self, scenario: str) -> list[Outcome]:
        order = {p.key: i for i, p in enumerate(PEERS)}
        found = [o for o in self.outcomes.values() if o.scenario == scenario]
        return sorted(found, key=lambda o: (order[o.peer], o.variant))

    def reduced(self, outcome: Outcome) -> bool:
        equeue = [o.count for o in self.rows(outcome.scenario) if o.peer == "equeue"]
        return bool(equeue) and outcome.count < max(equeue)

    def equeue_best(self, scenario: str) -> float:
        values = [o.median("rate") for o in self.rows(scenario) if o.peer == "equeue"]
        values = [v for v in values if v == v]
        return max(values) if values else float("nan")

    # -- tables

    def throughput_table(self, scenario: Scenario) -> list[str]:
        equeue_rows = [o for o in self.rows(scenario.key) if o.peer == "equeue"]
        heads = [f"equeue `{o.variant}` ÷ this" for o in equeue_rows]
        lines = [
            f"| store | messages | msg/s median (min{DASH}max) | MiB/s | peak RSS, MiB | "
            + " | ".join(heads)
            + " |",
            "|---|--:|--:|--:|--:|" + "--:|" * len(heads),
        ]
        for outcome in self.rows(scenario.key):
            rate = outcome.median("rate")
            cells = [
                row_name(outcome),
                f"{outcome.count:,}" + (" (reduced)" if self.reduced(outcome) else ""),
                spread(outcome, "rate", fmt_rate),
                fmt_mib(rate * scenario.size / MiB),
                fmt_mib(outcome.median("rss_mib")),
            ]
            for mine in equeue_rows:
                ratio = mine.median("rate") / rate if rate else float("nan")
                cells.append("" if outcome.peer == "equeue" else fmt_ratio(ratio))
            lines.append("| " + " | ".join(cells) + " |")
        return lines

    def durable_table(self) -> list[str]:
        lines = [
            f"| store | messages, 1 / 16 threads | 1 thread: msg/s median (min{DASH}max) | "
            f"16 threads: msg/s median (min{DASH}max) | peak RSS (16 threads), MiB | "
            "equeue 16 threads ÷ this store's best |",
            "|---|--:|--:|--:|--:|--:|",
        ]
        best = self.equeue_best("durable-16")
        for peer in PEERS:
            one, many = self.get("durable-1", peer.key), self.get("durable-16", peer.key)
            if peer.key == "equeue":
                one = self.get("durable-1", "equeue", "send")
                many = self.get("durable-16", "equeue", "send")
            if one is None and many is None:
                continue
            rates = [o.median("rate") for o in (one, many) if o is not None]
            rates = [r for r in rates if r == r]
            ratio = best / max(rates) if rates else float("nan")
            counts = " / ".join(f"{o.count:,}" if o else "-" for o in (one, many))
            name = '**equeue `send`, flush="sync"**' if peer.key == "equeue" else peer.name
            if peer.key == "equeue" and many is not None:
                flushes = [_flushes(r) for r in many.results]
                per_flush = [many.count / f for f in flushes if f]
                if per_flush:
                    name += f" ({statistics.median(per_flush):.1f} sends per fdatasync at 16)"
            lines.append(
                f"| {name} | {counts} | "
                f"{spread(one, 'rate', fmt_rate) if one else '-'} | "
                f"{spread(many, 'rate', fmt_rate) if many else '-'} | "
                f"{fmt_mib(many.median('rss_mib')) if many else '-'} | "
                f"{'' if peer.key == 'equeue' else fmt_ratio(ratio)} |"
            )
        return lines

    def reopen_table(self) -> list[str]:
        lines = [
            "| store | written before the kill | on disk | reopen + first read, s "
            f"median (min{DASH}max) | first message | messages found | peak RSS, MiB | "
            "this ÷ equeue |",
            "|---|--:|--:|--:|---|--:|--:|--:|",
        ]
        equeue = self.get("reopen", "equeue")
        mine = equeue.median("seconds") if equeue else float("nan")
        for outcome in self.rows("reopen"):
            results = outcome.results
            seconds = outcome.median("seconds")
            if results:
                written = int(statistics.median(r["written"] for r in results))
                found = statistics.median(r["stored"] for r in results)
                disk = statistics.median(r["disk_bytes"] for r in results)
                firsts = {
                    "ok" if r["first_ok"] else "empty" if r["empty"] else "wrong" for r in results
                }
                lost = lost_runs(results)
                first = "/".join(sorted(firsts))
                if lost:
                    first += f" (lost data in {len(lost)} of {len(results)} runs)"
                notes = {r["note"] for r in results if r.get("note")}
                if notes:
                    first += "; " + "; ".join(sorted(notes))
            else:
                written, found, disk, first = outcome.count, float("nan"), float("nan"), "-"
            size = f"{fmt_size(written * SCENARIO['reopen'].size)}, {written:,} msgs"
            if self.reduced(outcome):
                size += " (reduced)"
            lines.append(
                f"| {row_name(outcome)} | {size} | "
                f"{fmt_size(disk) if disk == disk else '-'} | "
                f"{spread(outcome, 'seconds', fmt_secs)} | {first} | "
                f"{fmt_rate(found)} | {fmt_mib(outcome.median('rss_mib'))} | "
                f"{'' if outcome.peer == 'equeue' else fmt_ratio(seconds / mine)} |"
            )
        return lines

    def memory(self, name: str = "rss_mib") -> dict[str, dict[str, float]]:
        """Medians of ``name`` (MiB) per store label and scenario: the larger of equeue's."""
        table: dict[str, dict[str, float]] = {}
        for outcome in self.outcomes.values():
            label = PEER[outcome.peer].name if outcome.peer != "equeue" else "equeue"
            value = outcome.median(name)
            if value == value:
                cell = table.setdefault(label, {})
                cell[outcome.scenario] = max(cell.get(outcome.scenario, 0.0), value)
        return table

    def memory_table(self) -> list[str]:
        memory, anon, nan = self.memory(), self.memory("anon_mib"), float("nan")
        scenarios = [s for s in SCENARIOS if any(s.key in m for m in memory.values())]
        lines = [
            "| store | " + " | ".join(s.label for s in scenarios) + " | peak |",
            "|---|" + "--:|" * (len(scenarios) + 1),
        ]
        for peer in PEERS:
            label = peer.name if peer.key != "equeue" else "equeue"
            if label not in memory:
                continue
            values, private = memory[label], anon.get(label, {})
            cells = [
                f"{fmt_mib(values.get(s.key, nan))} ({fmt_mib(private.get(s.key, nan))})"
                for s in scenarios
            ]
            name = "**equeue**" if peer.key == "equeue" else label
            lines.append(
                f"| {name} | " + " | ".join(cells) + f" | {fmt_mib(max(values.values()))} |"
            )
        return lines

    # -- targets

    def targets(self) -> list[Target]:
        found: list[Target] = []
        losses, checked = [], 0
        failed: list[str] = []
        memory = self.memory()
        equeue_peak = max(memory.get("equeue", {}).values(), default=float("nan"))
        for peer in QUEUES:
            for scenario in SCENARIOS:
                outcome = self.get(scenario.key, peer.key)
                if outcome is None or not outcome.results:
                    continue
                if scenario.kind == "reopen":
                    theirs = outcome.median("seconds")
                    equeue = self.get("reopen", "equeue")
                    mine = equeue.median("seconds") if equeue else float("nan")
                    detail = f"{theirs:.3f} s vs equeue {mine:.3f} s"
                    # A store that reopens without what was written before the kill has
                    # not reopened the store the scenario times: its time is that of an
                    # empty or shorter queue. It fails the scenario, which equeue passed
                    # if it reopened, every run, with all it had written.
                    lost = lost_runs(outcome.results)
                    if lost:
                        empty = sum(1 for r in lost if r["stored"] == 0)
                        how = [f"empty in {empty}"] if empty else []
                        how += [f"short in {len(lost) - empty}"] if len(lost) > empty else []
                        detail += (
                            f", but it reopened {' and '.join(how)} of "
                            f"{len(outcome.results)} runs (found "
                            f"{min(r['stored'] for r in lost):,} of "
                            f"{max(r['written'] for r in lost):,} messages written before "
                            "the kill)"
                        )
                    if (
                        lost
                        and equeue is not None
                        and equeue.results
                        and not lost_runs(equeue.results)
                    ):
                        failed.append(
                            f"{scenario.label}: {peer.name} {detail}: it failed the scenario, "
                            "counted as equeue ahead, not as a loss"
                        )
                        checked += 1
                        continue
                    ahead = mine < theirs
                else:
                    theirs = outcome.median("rate")
                    mine = self.equeue_best(scenario.key)
                    ahead = mine > theirs
                    detail = (
                        f"{fmt_rate(theirs)} vs equeue {fmt_rate(mine)} msg/s "
                        f"({fmt_ratio(mine / theirs)}x)"
                    )
                checked += 1
                if not ahead:
                    losses.append(f"{scenario.label}: {peer.name} {detail}")
            theirs_peak = max(memory.get(peer.name, {}).values(), default=float("nan"))
            if theirs_peak == theirs_peak:
                checked += 1
                if not equeue_peak < theirs_peak:
                    losses.append(
                        f"peak RSS: {peer.name} {fmt_mib(theirs_peak)} MiB vs equeue "
                        f"{fmt_mib(equeue_peak)} MiB"
                    )
        found.append(
            Target(
                "equeue ahead of every queue library in every scenario",
                checked > 0 and not losses,
                f"behind in {len(losses)} of {checked} comparisons (scenarios x queue "
                "libraries; throughput against the better of `send`/`send_batch`)",
                losses + failed,
            )
        )
        losses, checked = [], 0
        for scenario in (s for s in SCENARIOS if s.kind == "append"):
            batch = self.get(scenario.key, "equeue", "send_batch")
            for peer in ENGINES:
                engine = self.get(scenario.key, peer.key)
                if batch is None or engine is None or not engine.results:
                    continue
                mine, other = batch.median("rate"), engine.median("rate")
                checked += 1
                line = (
                    f"{scenario.label}: {peer.name} {fmt_rate(other)} vs `send_batch` "
                    f"{fmt_rate(mine)} msg/s ({fmt_ratio(mine / other)}x)"
                )
                if not mine > other:
                    losses.append(line)
        found.append(
            Target(
                "with `send_batch`, ahead of sqlite3 and lmdb on append throughput",
                checked > 0 and not losses,
                f"behind in {len(losses)} of {checked} comparisons",
                losses,
            )
        )
        best = self.equeue_best("durable-16")
        ratios = []
        for peer in PEERS:
            if peer.kind not in ("queue", "engine"):
                continue
            rates = [self.get(k, peer.key) for k in ("durable-1", "durable-16")]
            values = [o.median("rate") for o in rates if o is not None and o.results]
            if values:
                ratios.append((best / max(values), peer.name, max(values)))
        ratios.sort()
        found.append(
            Target(
                "durable appends with 16 threads at least 10x every peer's per-message durable "
                "rate",
                bool(ratios) and ratios[0][0] >= 10,
                f"equeue {fmt_rate(best)} msg/s with 16 threads, against each peer's better "
                "rate of 1 and 16 threads",
                [f"{fmt_ratio(r)}x {name} ({fmt_rate(rate)} msg/s)" for r, name, rate in ratios],
            )
        )
        return found

    # -- the whole section

    def markdown(self, charts: Sequence[Path], doc: Path | None) -> str:
        meta = self.meta
        lines = [
            "`tools/bench_peers.py` (part of `make bench`; `--smoke` is a tiny run in `make "
            "test`). Each case runs in its own process and a fresh directory under "
            f"`{meta['directory_shown']}`; the tables give the median and min{DASH}max over "
            f"{meta['repeat']} repeat(s). Bodies are random bytes (1,024 distinct ones, "
            "cycled); MiB/s counts body bytes. Every store holds one FIFO (equeue: one topic "
            "of one queue). Timed: the append or read loop only (open and close are not), "
            "except reopen, which is open + first read in a fresh process. Peak RSS is "
            "`ru_maxrss` of the case's process (it counts the mapped file pages a store "
            "touched; a bare interpreter with the bodies is about the reference row's). "
            "The consume cases read exactly what their append case wrote (checked message "
            "by message). Every store's modules are imported before the timer starts, from "
            "compiled bytecode (the tool compiles equeue's first, as pip does for the "
            "peers' wheels). **Compare ratios within one run, not absolute figures across "
            "runs.**",
            "",
        ]
        lines += [f"- {line}" for line in describe(meta)]
        if self.smoke:
            lines += ["- **Smoke run** (`--smoke`): tiny sizes, one repeat; not figures."]
        lines += ["", "Targets of the issue, in this run:", ""]
        for target in self.targets():
            verdict = "met" if target.met else "not met"
            lines.append(f"- {target.name}: **{verdict}**: {target.summary}")
            lines += [f"  - {detail}" for detail in target.details]
        if charts:
            base = doc.parent if doc is not None else Path.cwd()
            lines += [""] + [
                f"![{p.stem}]({os.path.relpath(p, base)})" for p in charts if p.stem != "peers"
            ]
        for scenario in SCENARIOS:
            if scenario.kind not in ("append", "consume") or not self.rows(scenario.key):
                continue
            equeue = next((o for o in self.rows(scenario.key) if o.peer == "equeue"), None)
            n = equeue.count if equeue else scenario.full
            lines += [
                "",
                f"### {scenario.label[0].upper()}{scenario.label[1:]}: {n:,} messages",
                "",
            ]
            if scenario.kind == "append":
                lines += [
                    'No fsync per message (each store\'s mode below). "equeue ÷ this" > 1: '
                    "equeue is faster.",
                    "",
                ]
            else:
                lines += [
                    "Reads what the append case above wrote (litequeue: a smaller queue it "
                    "appended for this, see modes), from the page cache.",
                    "",
                ]
            lines += self.throughput_table(scenario)
        if self.rows("durable-1") or self.rows("durable-16"):
            lines += [
                "",
                "### Durable appends, 1 KiB",
                "",
                "Each message synced before the call returns, where the store offers it "
                "(modes below); 16 threads share one store. Ratio: equeue with 16 threads ÷ "
                "the better of this store's two rates.",
                "",
            ]
            lines += self.durable_table()
        if self.rows("reopen"):
            lines += [
                "",
                "### Reopen after SIGKILL",
                "",
                "A process fills the store with 1 KiB messages, keeps appending and is "
                "SIGKILLed; a fresh process then opens the store and reads its first message "
                '(timed, imports excluded; the page cache is warm). "messages found" is what '
                "the store holds after reopening. Ratio > 1: equeue reopens faster.",
                "",
            ]
            lines += self.reopen_table()
        if self.outcomes:
            lines += [
                "",
                "### Peak memory",
                "",
                "`ru_maxrss` of each case's process, MiB, and in brackets its anonymous "
                "(private) RSS at the end of the case: `ru_maxrss` also counts the pages of "
                "memory-mapped files a store touched (equeue's chunks, lmdb), which are page "
                "cache the kernel can reclaim. Medians over repeats; for equeue the larger of "
                "`send` and `send_batch`. Reduced cases hold less data.",
                "",
            ]
            lines += self.memory_table()
        lines += ["", "### Modes: what each store does, and what it fsyncs", ""]
        for peer in PEERS:
            if not any(o.peer == peer.key for o in self.outcomes.values()):
                continue
            version = meta["versions"].get(peer.key, "")
            lines.append(f"- **{peer.name}**{f' {version}' if version else ''}:")
            for kind in ("append", "consume", "durable", "reopen"):
                lines.append(f"  - {kind}: {peer.modes[kind]}")
        reduced = {
            PEER[o.peer].name
            for o in self.outcomes.values()
            if self.reduced(o) and SCENARIO[o.scenario].kind != "durable"
        }
        if reduced:
            lines += [
                "",
                'Slow peers run fewer messages (marked "reduced") to keep the run within '
                f"about 15 minutes: {', '.join(n for n in PEER_NAMES if n in reduced)}. "
                "In the 16-thread durable case every peer writes fewer messages than equeue "
                "(a per-message fsync each).",
            ]
        return "\n".join(lines) + "\n"


def lost_runs(results: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The reopen runs that found fewer messages than were written before the kill."""
    return [r for r in results if r["stored"] < r["written"]]


@dataclass(frozen=True)
class Target:
    name: str
    met: bool
    summary: str
    details: list[str]


def _flushes(result: Mapping[str, Any]) -> int:
    match = re.search(r"flushes=(\d+)", str(result.get("note", "")))
    return int(match.group(1)) if match else 0


def describe(meta: Mapping[str, Any]) -> list[str]:
    before, after = meta["load_before"], meta["load_after"]
    found = meta["versions"]
    dists = {p.dist: found[p.key] for p in PEERS if p.dist and p.key in found}
    versions = ", ".join(f"{d} {v}" for d, v in dists.items())
    versions += f", sqlite3 (SQLite {sqlite3.sqlite_version})"
    return [
        f"Run: {meta['date']}, Python {meta['python']} ({meta['python_build']}), "
        f"{meta['cpus']} CPUs, Linux {meta['kernel']}",
        f"Directory: {meta['directory']} on {meta['file_system']}",
        f"Source: {meta['source']}",
        f"Peers: {versions}",
        "Load average (1/5/15 min): before "
        + "/".join(f"{x:.2f}" for x in before)
        + ", after "
        + "/".join(f"{x:.2f}" for x in after)
        + " (the machine is shared)",
        f"Wall time: {meta['wall_seconds']:.0f} s",
    ]


def replace_section(text: str, body: str) -> str:
    """``text`` with everything between the peers markers replaced by ``body``."""
    lines = text.splitlines(keepends=True)
    begin = next((i for i, line in enumerate(lines) if line.startswith(BEGIN)), None)
    end = next((i for i, line in enumerate(lines) if line.strip() == END), None)
    if begin is None or end is None or end < begin:
        raise ValueError(f"no {BEGIN} ... {END} section")
    return "".join(lines[: begin + 1]) + body + "".join(lines[end:])
