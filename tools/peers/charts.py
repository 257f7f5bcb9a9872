"""The charts: docs/peers*.png, bar panels of medians with their min-max."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from peers.report import Report, fmt_size
from peers.runner import Outcome
from peers.scenarios import PEER, PEERS, SCENARIOS

if TYPE_CHECKING:
    from matplotlib.axes import Axes

COLORS = {"equeue": "#d62728", "queue": "#1f77b4", "engine": "#2ca02c", "reference": "#7f7f7f"}


def bar_panel(
    ax: Axes,
    outcomes: Sequence[Outcome],
    metric: str,
    title: str,
    xlabel: str,
    marked: Callable[[Outcome], bool] = lambda outcome: False,
) -> None:
    rows = [o for o in outcomes if o.values(metric)]
    labels, medians, low, high, colors = [], [], [], [], []
    for outcome in reversed(rows):  # barh draws bottom-up: equeue on top
        values = outcome.values(metric)
        median = statistics.median(values)
        name = PEER[outcome.peer].name
        if outcome.peer == "equeue" and outcome.variant:
            name = f"equeue {outcome.variant}"
        if any(r.get("empty") for r in outcome.results):
            name += " (reopened empty)"
        labels.append(f"{name} *" if marked(outcome) else name)
        medians.append(median)
        low.append(median - min(values))
        high.append(max(values) - median)
        colors.append(COLORS[PEER[outcome.peer].kind])
    positions = list(range(len(rows)))
    ax.barh(positions, medians, xerr=[low, high], color=colors, capsize=2)
    ax.set_yticks(positions, labels, fontsize=8)
    log = metric != "rss_mib"  # memory spans a small range: linear reads better
    if log:
        ax.set_xscale("log")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(axis="x", which="major", alpha=0.3)
    for y, value, above in zip(positions, medians, high, strict=True):
        text = (
            f"{value:.3g} s"
            if metric == "seconds"
            else (f"{value:,.0f}" if metric == "rate" else f"{value:,.0f} MiB")
        )
        ax.annotate(  # past the error bar, which it would hide
            text,
            (value + above, y),
            xytext=(4, 0),
            textcoords="offset points",
            va="center",
            fontsize=7,
        )
    if medians:
        top = max(m + h for m, h in zip(medians, high, strict=True))
        ax.set_xlim(min(medians) / 2 if log else 0, top * 6 if log else top * 1.25)


def memory_outcomes(report: Report) -> list[Outcome]:
    """One pseudo-outcome per store: its peak RSS over every case."""
    rows = []
    for peer in PEERS:
        values: list[float] = []
        for outcome in report.outcomes.values():
            if outcome.peer == peer.key:
                values.append(outcome.median("rss_mib"))
        values = [v for v in values if v == v]
        if values:
            rows.append(Outcome("memory", peer.key, "", 0, [{"rss_mib": max(values)}]))
    return rows


def write_charts(report: Report, directory: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    panels: dict[str, tuple[list[Outcome], str, str, str]] = {}
    for scenario in SCENARIOS:
        rows = report.rows(scenario.key)
        if not rows:
            continue
        if scenario.kind == "reopen":
            size = fmt_size(max(o.count for o in rows))
            title = f"Reopen + first read after SIGKILL, {size} store"
            if any(report.reduced(o) for o in rows):
                title += " (* smaller)"
            panels[scenario.key] = (rows, "seconds", title, "seconds (log), lower is better")
        else:
            n = max(o.count for o in rows)
            title = f"{scenario.label[0].upper()}{scenario.label[1:]}, {n:,} msgs"
            if any(report.reduced(o) for o in rows):
                title += " (* fewer)"
            panels[scenario.key] = (rows, "rate", title, "messages/s (log), higher is better")
    memory = memory_outcomes(report)
    if memory:
        panels["memory"] = (
            memory,
            "rss_mib",
            "Peak RSS (ru_maxrss) over all cases",
            "MiB, lower is better",
        )
    groups = {
        "peers-append": ["append-100", "append-1k"],
        "peers-consume": ["consume-100", "consume-1k"],
        "peers-durable": ["durable-1", "durable-16"],
        "peers-reopen": ["reopen", "memory"],
        "peers": [s.key for s in SCENARIOS] + ["memory"],
    }
    written = []
    for name, keys in groups.items():
        keys = [k for k in keys if k in panels]
        if not keys:
            continue
        cols = 2
        nrows = -(-len(keys) // cols)
        fig, axes = plt.subplots(nrows, cols, figsize=(12, 3.6 * nrows), squeeze=False)
        for ax, key in zip(axes.flat, keys, strict=False):
            bar_panel(ax, *panels[key], marked=report.reduced)
        for ax in list(axes.flat)[len(keys) :]:
            ax.set_visible(False)
        title = "equeue beside the Python stores users pick today"
        if report.smoke:
            title += " (smoke run: not figures)"
        fig.suptitle(f"{title}, {report.meta['date'][:10]}", fontsize=11)
        fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight()))  # room for the title
        path = directory / f"{name}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written
