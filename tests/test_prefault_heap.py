"""A store writer keeps its heap (prefault.c, keep_heap): large blocks freed together
are reused, not handed back to the kernel and faulted in again zero-filled page by page,
as glibc's defaults did under the broker's 1 KiB send_bodies frames (~50 KB each)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import equeue

pytestmark = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc" or not os.path.exists("/proc/self/stat"),
    reason="glibc's heap trimming, counted by the kernel's minor faults (Linux)",
)

# 100 blocks of ~50 KB held at once, then all freed, 20 times: ~1,220 pages a round that
# a heap trimmed after each round faults in again.
SCRIPT = """
import resource, sys, tempfile
import equeue
assert equeue.__file__.startswith(sys.argv[3]), equeue.__file__
from equeue import MessageStore, speedups
from equeue.chunks.prefault import PREFAULTER
assert (PREFAULTER._in_c is None) == (sys.argv[1] == "python")
if sys.argv[1] != "none":
    store = MessageStore.open(tempfile.mkdtemp(prefix="eqh", dir=sys.argv[2]))
    store.create_topic("t", 1)
    store.send("t", b"x")  # the first append asks for its first window: keep_heap
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
before = faults()
for _ in range(20):
    held = [bytes(50_000 + i) for i in range(100)]
    del held
print((faults() - before) / 20)
"""


def faults_a_round(mode: str) -> float:
    """In a fresh process of this equeue (not the working directory's: ``-c`` puts it
    first on sys.path)."""
    tree = str(Path(equeue.__file__).parent.parent)
    env = dict(os.environ, PYTHONPATH=tree)
    env.pop("EQUEUE_PURE_PYTHON", None)
    if mode == "python":  # the Python prefault thread (ctypes): prefault.py's _keep_heap
        env["EQUEUE_PURE_PYTHON"] = "1"
    with tempfile.TemporaryDirectory(prefix="eqh", dir="/tmp") as scratch:
        out = subprocess.run(
            [sys.executable, "-c", SCRIPT, mode, scratch, tree],
            capture_output=True, text=True, timeout=60, check=True, cwd=scratch, env=env,
        )  # fmt: skip
    return float(out.stdout.strip())


@pytest.mark.parametrize("mode", ["c", "python"])
def test_a_store_writer_reuses_its_freed_heap(mode: str) -> None:
    from equeue import speedups

    if mode == "c" and speedups.SPEEDUPS is None:
        pytest.skip("the C accelerator is not built")
    from equeue.chunks.prefault import PREFAULTER

    if not PREFAULTER.enabled:
        pytest.skip("no MADV_POPULATE_WRITE: no prefault thread, nothing set")
    # Seen before keep_heap: ~1,030 faults a round; with it ~60 (Python's own objects).
    assert faults_a_round(mode) < 300


def test_control_a_process_that_wrote_no_store_trims_its_heap() -> None:
    """glibc's defaults, in the same pattern: the heap goes back and is faulted in again
    (so the test above measures something)."""
    assert faults_a_round("none") > 600
