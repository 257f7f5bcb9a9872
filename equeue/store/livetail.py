"""The writer's side of ``tail.live`` (layout and reasoning: ``equeue/format/livetail.py``).

Recovery in the boot that wrote it starts its scan of the ongoing log chunk
at the newest slot instead of at the last checkpoint, so a reopen after a
killed writer walks at most a window of records, not tens of MiB.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import uuid
from pathlib import Path

from equeue.chunks import Chunk
from equeue.format.livetail import (
    FILE_SIZE,
    HEADER_SIZE,
    LIVE_TAIL_FILE,
    SLOT_OFFSETS,
    SLOT_SIZE,
    LiveTail,
    LiveTailHeader,
    newest,
)
from equeue.safepath import open_fd, open_file
from equeue.store.keyindex import KeyIndex

log = logging.getLogger("equeue.livetail")

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


def current_boot_id() -> uuid.UUID | None:
    """This boot's id; None where the system has none (then no live tail is kept)."""
    try:
        with open(BOOT_ID_PATH, encoding="ascii") as f:
            return uuid.UUID(f.read().strip())
    except (OSError, ValueError):
        return None


def read_live_tail(store: Path, boot_id: uuid.UUID) -> LiveTail | None:
    """The newest whole slot of the store's ``tail.live``, if this boot wrote it."""
    try:
        with open_file(store / LIVE_TAIL_FILE, "rb") as f:
            raw = f.read(FILE_SIZE)
    except OSError:  # a link or a directory there is a StorePathError, raised
        return None
    return newest(raw, boot_id)


class LiveTailWriter:
    """Notes the log's tail in ``tail.live``, once per half prefault window.

    ``advance`` runs under the store's write lock from ``Chunk._prefault``,
    which a publish calls the moment the log passes the next half window: the
    send being published may still lack its queue entries, so the slot names
    the point the previous call saw, which every send since has completed.
    """

    def __init__(self, store: Path, boot_id: uuid.UUID, keys: KeyIndex) -> None:
        path = store / LIVE_TAIL_FILE
        # Rewritten, not fsynced: its slots of an earlier run describe a log this open's
        # recovery may have cut, and the file is never trusted after a reboot anyway.
        fd = open_fd(path, os.O_RDWR | os.O_CREAT)  # never through a link: it is truncated
        try:
            os.ftruncate(fd, FILE_SIZE)
            os.pwrite(fd, LiveTailHeader(boot_id).pack() + bytes(FILE_SIZE - HEADER_SIZE), 0)
            self._mm = mmap.mmap(fd, FILE_SIZE)
        finally:
            os.close(fd)
        self._keys = keys
        self._valid = True
        self._sequence = 0
        self._seen: tuple[uuid.UUID, int, int] | None = None  # chunk id, data end, records

    def advance(self, chunk: Chunk) -> None:
        if not self._valid:
            return
        seen, chunk_id = self._seen, chunk.header.chunk_id
        self._seen = (chunk_id, chunk.data_end, chunk.record_count)
        if seen is None or seen[0] != chunk_id:
            return  # the first call in a chunk: no completed point in it yet
        # With keys still buffered for that stretch of the log, the slot would let recovery
        # skip re-indexing them; the older slot (or the checkpoint) stays the newest instead.
        if not self._keys.all_committed_before(chunk.start_position + seen[1]):
            return
        self._sequence += 1
        at = SLOT_OFFSETS[self._sequence % 2]
        slot = LiveTail(self._sequence, chunk_id, seen[1], seen[2]).pack()
        with contextlib.suppress(ValueError):  # closed by close() on another thread
            self._mm[at : at + SLOT_SIZE] = slot

    def invalidate(self) -> None:
        """An fdatasync of the store failed: its pages may be clean in the page cache and
        never written (docs/durability.md), so the next open in this boot must verify
        everything since the checkpoint, as after a reboot. No slot is written again."""
        self._valid = False
        with contextlib.suppress(ValueError):
            self._mm[HEADER_SIZE:FILE_SIZE] = bytes(FILE_SIZE - HEADER_SIZE)

    def close(self) -> None:
        self._mm.close()
