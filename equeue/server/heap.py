"""``keep_heap()``: the broker process keeps its freed heap instead of handing it back.

glibc returns the free top of its heap to the kernel (brk) once it passes the trim
threshold, 128 KiB until a large mmapped block has been freed; the next allocation takes
the pages back, each with a zero-filling page fault. The broker allocates a frame per
request: a send_bodies of ~48 sends of 1 KiB (the asyncio client's loop turn) is ~50 KB,
and two or three of them freed together passed the threshold, so it shrank and regrew its
heap for nearly every read: 0.4 anonymous faults and a brk a message, ~35 % of the event
loop's samples (perf), 1.3-1.8 us of the broker's 4.3-5.6 a message (docs/benchmarks.md,
"1 KiB sends": round 7). keep_heap sets, once per process:
  - the trim threshold to TRIM_KEEP: at most that much free heap stays mapped;
  - the mmap threshold to MMAP_FROM (setting the first freezes glibc's own moving of this
    one): blocks up to it come from the heap and are reused, larger ones are mapped.
Both within what glibc's own dynamic thresholds reach (32 MiB and 64 MiB).

Malloc settings are process-wide, so the library never makes them: ``equeue serve`` (a
process equeue owns) calls this at its start; an application that embeds a broker
(BrokerThread, Broker) or a store may call it itself. Nothing is changed where the
environment already tunes malloc (an operator's choice wins) or the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import threading

log = logging.getLogger(__name__)

# glibc's mallopt parameters (malloc.h) and the values set.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
TRIM_KEEP, MMAP_FROM = 64 << 20, 4 << 20
# glibc's own environment settings of the same things: any one means the operator decided.
MALLOC_VARIABLES = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")

_lock = threading.Lock()
_decided: bool | None = None


def keep_heap() -> bool:
    """Set glibc's trim and mmap thresholds for this process (once; later calls return the
    first call's answer). True if set; False where the environment sets malloc options
    (MALLOC_TRIM_THRESHOLD_, MALLOC_MMAP_THRESHOLD_, MALLOC_TOP_PAD_, glibc.malloc in
    GLIBC_TUNABLES) or the C library is not glibc."""
    global _decided
    with _lock:
        if _decided is None:
            _decided = _apply()
        return _decided


def _apply() -> bool:
    told = [name for name in MALLOC_VARIABLES if name in os.environ]
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        told.append("GLIBC_TUNABLES")
    if told:
        log.info("malloc left as the environment sets it (%s)", ", ".join(told))
        return False
    if platform.libc_ver()[0] != "glibc":
        log.info("malloc left as it is (not glibc)")
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_FROM)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_KEEP))
    log.info(
        "malloc keeps freed heap: trim threshold %d MiB, mmap threshold %d MiB%s",
        TRIM_KEEP >> 20, MMAP_FROM >> 20, "" if done else " (refused by mallopt)",
    )  # fmt: skip
    return done
