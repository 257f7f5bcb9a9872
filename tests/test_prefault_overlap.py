"""The prefault thread faults in only the part of a window it did not fault in last time for
that mapping (equeue/cext/prefault.c, and prefault.py's Python thread): Chunk asks for a
window every half window, so they overlap by half, and MADV_POPULATE_WRITE on a page a
flush cleaned since dirties it again, so under --flush sync every zero page ahead of the
writer was written back twice. Real file, real fdatasync; a page's dirtiness read from
/proc/self/smaps; the control forgets the mapping in between (all of the window again)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from test_resident import SMAPS, c_prefault, fresh_mapping, resident

from equeue.chunks.prefault import Prefaulter

pytestmark = pytest.mark.skipif(not SMAPS.exists(), reason="needs /proc/self/smaps (Linux)")
KiB = 1024
LIMIT_S = 10.0


def dirty(path: Path) -> int:
    """Bytes of ``path`` dirty in this process's mappings of it (smaps: the pages written
    and not yet written back)."""
    total, inside = 0, False
    for line in SMAPS.read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:
            inside = len(fields) >= 6 and fields[5] == str(path)
        elif inside and fields[0] in ("Shared_Dirty:", "Private_Dirty:"):
            total += int(fields[1]) * KiB
    return total


def until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + LIMIT_S
    while not condition():
        assert time.monotonic() < deadline, "the prefault thread did not get to it"
        time.sleep(0.005)


def _overlapping_windows(
    tmp_path: Path,
    request: Callable[[int, int, int], object],
    forget: Callable[[int], object],
    forget_between: bool,
) -> int:
    """A 1 MiB window populated and flushed, then the next one overlapping it by half: the
    bytes dirty afterwards. A request for a sentinel mapping queued after it is served
    after it (one thread, in request order)."""
    path, sentinel_path = tmp_path / "f", tmp_path / "s"
    mm, sentinel = fresh_mapping(path, 4 << 20), fresh_mapping(sentinel_path, 64 * KiB)
    address, sentinel_address = Prefaulter.address_of(mm), Prefaulter.address_of(sentinel)
    try:
        request(address, address, 1 << 20)
        until(lambda: dirty(path) >= 1 << 20)
        with open(path, "rb+") as f:
            os.fdatasync(f.fileno())  # the flush: the window's pages clean again
        assert dirty(path) == 0
        if forget_between:
            forget(address)
        request(address, address + (512 * KiB), 1 << 20)
        request(sentinel_address, sentinel_address, 64 * KiB)
        until(lambda: resident(sentinel_path) >= 64 * KiB)
        assert resident(path) >= 1536 * KiB
        assert mm[: 2 << 20] == bytes(2 << 20)  # and nothing was written
        return dirty(path)
    finally:
        forget(address)  # before the unmap, as Chunk does
        forget(sentinel_address)
        mm.close()
        sentinel.close()


@pytest.mark.parametrize("forget_between", [False, True])
def test_the_c_thread_populates_only_the_new_part_of_an_overlapping_window(
    tmp_path: Path, forget_between: bool
) -> None:
    fast = c_prefault()
    held = _overlapping_windows(
        tmp_path, fast.prefault_request, fast.prefault_forget, forget_between
    )
    if forget_between:
        assert held >= 1 << 20, held  # the control: the whole window dirtied again
    else:
        assert 512 * KiB <= held < 600 * KiB, held  # the new half only (fault-around: a little)


@pytest.mark.parametrize("forget_between", [False, True])
def test_the_python_thread_populates_only_the_new_part_too(
    tmp_path: Path, forget_between: bool
) -> None:
    c_prefault()  # the kernel's MADV_POPULATE_WRITE
    prefaulter = Prefaulter(in_c=False)
    assert prefaulter.enabled
    held = _overlapping_windows(tmp_path, prefaulter.request, prefaulter.forget, forget_between)
    if forget_between:
        assert held >= 1 << 20, held
    else:
        assert 512 * KiB <= held < 600 * KiB, held
