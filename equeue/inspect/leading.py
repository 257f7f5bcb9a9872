"""A chunk file read in one ``pread`` when all its data lies in its leading bytes.

A queue's ongoing chunk is a file of full size (12 MB by default) of which the writer
has filled a few pages; its blocks are allocated in steps and the rest is a hole. The
general reader (layout.load_chunk_file) reads the header, then the footer area, then
maps the file and scans it, then looks for bytes past the valid end: for a store of
10,000 queues that was 10,000 mappings and zero-page faults (verify 13 s). When
SEEK_HOLE/SEEK_DATA say that nothing but a hole follows the first data range, and that
range is small, that range is the whole content of the file: read it once and find
everything in it. Anything else (a footer written, data further on, a file system
without SEEK_HOLE, a damaged header) goes the general way.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path

LEADING_MAX = 1 << 20  # larger leading data is read the general way (mapped, in steps)


@dataclass(frozen=True, slots=True)
class Leading:
    stat: os.stat_result
    # The file's first bytes, past which it holds only zeros (a hole); None when that
    # could not be established cheaply.
    content: bytes | None


def read_leading(path: Path, limit: int = LEADING_MAX) -> Leading:
    """The file's stat and, if all its non-hole bytes lie in its first ``limit`` bytes,
    those bytes. FileNotFoundError if the file is gone (retention on a live store)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        st = os.fstat(fd)
        try:
            hole = os.lseek(fd, 0, os.SEEK_HOLE)
        except OSError:
            return Leading(st, None)  # no SEEK_HOLE here
        if hole >= st.st_size or hole > limit:
            return Leading(st, None)  # no hole (a footer written, or a whole file), or large
        content = os.pread(fd, hole, 0)
        # Checked after the read: a writer that added data past the hole meanwhile shows
        # here; one that wrote inside it after our read only makes this an earlier view.
        try:
            os.lseek(fd, hole, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # nothing but a hole to the end of the file
                return Leading(st, content if len(content) == hole else None)
        return Leading(st, None)
    finally:
        os.close(fd)
