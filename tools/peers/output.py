"""What a run leaves: the printed section, the rewritten document, the charts and the JSON of
every result (which --from-json reads back)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from peers.charts import write_charts
from peers.report import Report, replace_section
from peers.runner import Outcome, progress
from peers.scenarios import PEER


def load_results(path: Path) -> tuple[dict[tuple[str, str, str], Outcome], dict[str, Any]]:
    """The outcomes and metadata a run saved with ``--json``."""
    data = json.loads(path.read_text())
    outcomes = {}
    for o in data["outcomes"]:
        outcome = Outcome(o["scenario"], o["peer"], o["variant"], o["count"])
        outcome.results, outcome.errors = o["results"], o["errors"]
        outcomes[(outcome.scenario, outcome.peer, outcome.variant)] = outcome
    meta: dict[str, Any] = data["meta"]
    return outcomes, meta


def write_report(
    args: argparse.Namespace,
    outcomes: dict[tuple[str, str, str], Outcome],
    meta: dict[str, Any],
) -> int:
    report = Report(outcomes, meta, bool(meta["smoke"]))
    charts = write_charts(report, args.charts) if args.charts else []
    section = report.markdown(charts, args.doc)
    print(section)
    if args.doc:
        args.doc.write_text(replace_section(args.doc.read_text(), section))
        progress(f"wrote the peers section of {args.doc}")
    for path in charts:
        progress(f"wrote {path}")
    if args.json:
        data = {
            "meta": meta,
            "outcomes": [
                {
                    "scenario": o.scenario,
                    "peer": o.peer,
                    "name": PEER[o.peer].name,
                    "variant": o.variant,
                    "count": o.count,
                    "reduced": report.reduced(o),
                    "results": o.results,
                    "errors": o.errors,
                }
                for o in outcomes.values()
            ],
            "targets": [dataclasses.asdict(t) for t in report.targets()],
            "charts": [str(p) for p in charts],
        }
        args.json.write_text(json.dumps(data, indent=2))
    failed = [o for o in outcomes.values() if o.errors]
    return 1 if failed else 0
