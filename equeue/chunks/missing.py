"""A read-only view's judgement of a chunk file gone from under it: the writer removes
files only oldest first (retention) or once a higher version covering them is in the
directory (a compaction's replacement). A file missing with an older chunk still listed
and no such replacement was removed by neither: damage (MissingChunkError), not a removal."""

from __future__ import annotations

import os
from pathlib import Path

from equeue.format.chunk import parse_chunk_file_name


def removal_explains(path: Path, start_number: int, version: int) -> bool:
    try:
        names = os.listdir(path.parent)
    except OSError:
        return True  # the whole directory went (a topic's deletion): the store's doing
    older = False
    for name in names:
        parsed = parse_chunk_file_name(name)
        if parsed is None:
            continue
        if parsed[0] <= start_number and parsed[1] > version:
            # A replacement may cover it (unsure without its header: said to be a removal).
            return True
        older = older or parsed[0] < start_number
    return not older
