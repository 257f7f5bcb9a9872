"""The peer benchmark's tally of its first target, on made-up reopen outcomes: a peer that
reopens without what was written before the kill fails the scenario instead of beating
equeue. Needs none of the peers installed: only the report's code is run."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

from peers.report import Report, Target
from peers.runner import Outcome


def reopen(peer: str, seconds: float, written: int, *stored: int) -> Outcome:
    # equeue's peak memory below the peer's: the memory comparison is never lost here.
    rss = 10.0 if peer == "equeue" else 20.0
    results: list[dict[str, Any]] = [
        {"seconds": seconds, "written": written, "stored": n, "first_ok": n > 0}
        | {"empty": n == 0, "rss_mib": rss}
        for n in stored
    ]
    return Outcome("reopen", peer, "", written, results)


def first_target(*outcomes: Outcome) -> Target:
    found = {(o.scenario, o.peer, o.variant): o for o in outcomes}
    return Report(found, {}, smoke=True).targets()[0]


EQUEUE = reopen("equeue", 0.040, 1000, 1010, 1005)


def test_a_faster_complete_peer_is_ahead_of_equeue() -> None:
    target = first_target(EQUEUE, reopen("diskcache", 0.008, 1000, 1000, 1000))
    assert not target.met and target.summary.startswith("behind in 1 of 2")
    assert target.details == ["reopen after SIGKILL: diskcache.Deque 0.008 s vs equeue 0.040 s"]


def test_a_peer_that_reopens_empty_or_short_fails_the_scenario() -> None:
    target = first_target(EQUEUE, reopen("queuelib", 0.000, 1000, 0, 999))
    assert target.met and target.summary.startswith("behind in 0 of 2"), target
    (detail,) = target.details
    assert "reopened empty in 1 and short in 1 of 2 runs (found 0 of 1,000" in detail
    assert detail.endswith("it failed the scenario, counted as equeue ahead, not as a loss")


def test_the_peers_time_counts_when_equeue_has_no_complete_reopen() -> None:
    short = reopen("equeue", 0.040, 1000, 1010, 999)  # lost data in one run
    none = Outcome("reopen", "equeue", "", 1000)  # no run finished
    for equeue in (short, none):
        target = first_target(equeue, reopen("queuelib", 0.000, 1000, 0, 0))
        (detail,) = [d for d in target.details if d.startswith("reopen")]
        assert not target.met and "reopened empty in 2 of 2 runs (found 0 of 1,000" in detail
        assert "failed the scenario" not in detail  # a loss, listed as one
