"""Faulting in the pages ahead of the writer, off the writer's thread.

The first write to each page of a fresh shared mapping costs a page fault in
which the file system prepares the block; for 100-byte records that is about
a third of the append cost. RocketMQ warms its mapped files for the same
reason. Here a thread asks the kernel (``MADV_POPULATE_WRITE``, Linux 5.14+) to
fault in the next window while the writer works on the current one. The call
changes no bytes, so it is safe beside concurrent appends. Where the kernel
lacks it, nothing is done.

With the C accelerator the thread is a C thread that never takes the GIL
(``equeue/cext/prefault.c``); without it, a Python thread calling madvise
through ctypes, which costs the writer two GIL hand-offs a request.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import threading

from equeue import speedups

log = logging.getLogger("equeue.prefault")

MADV_POPULATE_WRITE = 23
WINDOW = 512 << 10


def _load_madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


class Prefaulter:
    def __init__(self, *, in_c: bool = True) -> None:
        fast = speedups.SPEEDUPS if in_c else None
        self._in_c = fast
        self._madvise = _load_madvise() if fast is None else None
        # The newest window asked for, by mapping. A writer that outruns this thread (it
        # waits for the GIL) asks again before the last window was faulted in; faulting
        # in the old windows then would fault back what the writer already released
        # behind it (measured: 71 MiB at once), so a new request replaces the older one.
        self._requests: dict[int, tuple[int, int]] = {}
        self._wakeup = threading.Condition()
        self._thread: threading.Thread | None = None
        self._serving: int | None = None  # the mapping whose window is being faulted in
        # By mapping, the end of the range faulted in last: windows overlap by half, and
        # MADV_POPULATE_WRITE dirties a page again once a flush cleaned it (prefault.c)
        self._populated: dict[int, int] = {}
        # Probed once: a request failing later (its mapping closed) is no verdict.
        if fast is not None:
            self.enabled = fast.prefault_supported()
        else:
            self.enabled = self._madvise is not None and self._probe()
        if not self.enabled:
            log.info("MADV_POPULATE_WRITE unsupported; writing without prefault")

    def _probe(self) -> bool:
        assert self._madvise is not None
        with mmap.mmap(-1, mmap.PAGESIZE) as page:
            address = self.address_of(page)
            return bool(self._madvise(address, mmap.PAGESIZE, MADV_POPULATE_WRITE) == 0)

    @staticmethod
    def address_of(mm: mmap.mmap) -> int:
        view = ctypes.c_char.from_buffer(mm)
        try:
            return ctypes.addressof(view)
        finally:
            del view  # drop the buffer export so the map can still be closed

    def request(self, mapping: int, address: int, length: int) -> None:
        """Fault in ``length`` bytes at ``address``, inside the mapping that starts at
        ``mapping``, instead of whatever that mapping asked for before."""
        if not self.enabled or length <= 0:
            return
        if self._in_c is not None:
            if not self._in_c.prefault_request(mapping, address, length):
                log.warning("the prefault thread could not start; writing without prefault")
                self.enabled = False
            return
        with self._wakeup:
            self._requests.pop(mapping, None)  # re-inserted last: the queue stays fair
            self._requests[mapping] = (address, length)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="equeue-prefault", daemon=True
                )
                self._thread.start()
            self._wakeup.notify()

    def forget(self, mapping: int) -> None:
        """The mapping that starts at ``mapping`` is about to be unmapped: drop its request,
        and wait for the one being served if it is that mapping's (served after the unmap,
        the range could be another mapping's by then)."""
        if self._in_c is not None:
            self._in_c.prefault_forget(mapping)
            return
        with self._wakeup:
            self._requests.pop(mapping, None)
            while self._serving == mapping:
                self._wakeup.wait()
            self._populated.pop(mapping, None)

    def _run(self) -> None:
        assert self._madvise is not None
        while True:
            with self._wakeup:
                while not self._requests:
                    self._wakeup.wait()
                self._serving = mapping = next(iter(self._requests))
                address, length = self._requests.pop(mapping)
                stop = address + length
                done = self._populated.get(mapping, address)
                start = done if address < done <= stop else address
            ok = start >= stop
            try:
                if not ok:
                    # The range into the page cache in one readahead first (prefault.c: why)
                    self._madvise(start, stop - start, mmap.MADV_WILLNEED)
                    ok = self._madvise(start, stop - start, MADV_POPULATE_WRITE) == 0
            finally:
                with self._wakeup:
                    if ok:
                        self._populated.pop(mapping, None)
                        self._populated[mapping] = stop
                        if len(self._populated) > 64:  # the oldest goes, as in prefault.c
                            del self._populated[next(iter(self._populated))]
                    self._serving = None
                    self._wakeup.notify_all()


PREFAULTER = Prefaulter()
