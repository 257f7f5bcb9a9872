"""The optional C accelerator of the write and read paths (equeue/cext/, built as equeue._speedups).

``SPEEDUPS`` is the module when it was built and the layouts it was written for
match ``equeue.format``; otherwise None, and the store runs its pure-Python paths,
which produce the same bytes and the same results (tests/test_speedups.py runs
both). Set ``EQUEUE_PURE_PYTHON=1`` to use the Python paths on purpose.
"""

from __future__ import annotations

import logging
import os
from types import ModuleType

from equeue.format.chunk import FRAME_OVERHEAD
from equeue.format.message import MAX_NAME_BYTES, MESSAGE_HEAD_SIZE, QUEUE_RECORD_SIZE

log = logging.getLogger(__name__)


def load() -> ModuleType | None:
    if os.environ.get("EQUEUE_PURE_PYTHON"):
        return None
    try:
        from equeue import _speedups
    except ImportError as exc:
        log.info("equeue runs without its C accelerator: %s", exc)
        return None
    try:
        _speedups.configure(MESSAGE_HEAD_SIZE, FRAME_OVERHEAD, QUEUE_RECORD_SIZE, MAX_NAME_BYTES)
    except ValueError as exc:  # built from another version of the layouts
        log.warning("equeue's C accelerator is not used: %s", exc)
        return None
    return _speedups


SPEEDUPS: ModuleType | None = load()
