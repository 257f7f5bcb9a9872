"""``equeue verify``'s look at ``compaction/`` (review f F3, F5): what every writable open
would refuse there (a staging directory that is a link, a committed manifest that cannot
be read or would lose a chunk) is a problem, as it is for the open. A staging directory
without a manifest (a job's, or one a crash left) and a committed one that holds up are
not: the next writable open or job finishes or removes them."""

from __future__ import annotations

from pathlib import Path

from equeue.compaction.commit import (
    COMMIT_LOCK,
    INSTALLED_FILE,
    JOB_LOCK,
    MANIFEST_FILE,
    check_manifest,
    compaction_dir,
)
from equeue.errors import CorruptionError, StorePathError
from equeue.inspect.layout import Problem, describe
from equeue.safepath import check_dir

KIND = "compaction staging"


def staging_problems(store: Path) -> list[Problem]:
    directory = compaction_dir(store)
    try:
        if not check_dir(directory):
            return []
    except StorePathError as exc:
        return [Problem(str(directory), None, KIND, str(exc))]
    problems: list[Problem] = []
    for entry in sorted(directory.iterdir()):
        if entry.name in (JOB_LOCK, COMMIT_LOCK, INSTALLED_FILE):
            continue
        try:
            if not check_dir(entry):
                continue
        except StorePathError as exc:
            if entry.is_symlink():  # a plain file there is left alone, as recovery does
                problems.append(Problem(str(entry), None, KIND, str(exc)))
            continue
        if not (entry / MANIFEST_FILE).exists():
            continue
        try:
            check_manifest(store, entry)
        except CorruptionError as exc:
            problems.append(Problem(exc.file or str(entry), exc.offset, KIND, describe(exc)))
    return problems
