"""``equeue verify``'s look at ``consumers/recovered/``: a group deletion's intent file
that the next writable open cannot act on (unreadable, not a file, naming another group
or the retry mover's ``equeue.mover``) is a problem, as the open reports it (reviewl
L2). One that reads as an intent is not: its deletion committed, and the next writable
open (or ``delete_group`` of the group) finishes it; one gone between the listing and
its read was finished meanwhile (a writer's ``delete_group`` unlinks it last)."""

from __future__ import annotations

from pathlib import Path

from equeue.errors import EQueueError
from equeue.format.chunk import RECOVERED_DIR
from equeue.inspect.layout import Problem
from equeue.store.groupdeletion import INTENT_SUFFIX, intent_problem, read_intent
from equeue.store.meta import CONSUMERS_DIR

KIND = "group deletion intent"


def intent_problems(store: Path) -> list[Problem]:
    side = store / CONSUMERS_DIR / RECOVERED_DIR
    try:
        entries = sorted(e.name for e in side.iterdir() if e.name.endswith(INTENT_SUFFIX))
    except OSError:  # none, or not a directory (the open refuses that: said there)
        return []
    problems = []
    for entry in entries:
        try:
            read_intent(side / entry, entry)
        except FileNotFoundError:
            continue  # finished since the listing (a writer's delete_group beside verify)
        except (EQueueError, OSError) as exc:
            problems.append(Problem(str(side / entry), None, KIND, intent_problem(entry, exc)))
    return problems
