"""The shared-memory rings of a unix: connection (docs/protocol.md "Shared-memory
rings"), opt-in on both sides (``equeue serve --shm``,
``equeue.aio.connect(url, shm=True)``).

The hello carries ``"shm": GROUP`` (a client's ring group: one per client event loop and
broker). A broker with ``--shm`` sends its welcome with SCM_RIGHTS: a memfd holding the
connection's two rings (equeue/cext/shmring.c: requests and answers, the socket
protocol's bytes as they are), and, for the first connection of a (peer pid, group),
the client's end of that group's wake-up socketpair. The socket then carries
nothing but its end: each side closes the connection on the other's EOF.
"""

from __future__ import annotations

import array
import fcntl
import socket
from typing import Any, Final

from equeue import speedups
from equeue.errors import ShmRingError

HEADER_BYTES: Final = 4096
DEFAULT_RING_BYTES: Final = 1 << 18  # each direction
MIN_RING_BYTES: Final = 4096
REQUESTS_HEAD: Final = 0  # ring 0's head index (tests write it as a hostile peer would)
CLIENT, BROKER = 0, 1
# The broker seals each region before sending it, the client maps only a sealed one: a
# size fixed for its life (a region shrunk under a mapping faults its next read: SIGBUS,
# the process gone), and no seal added afterwards (F_SEAL_WRITE, FUTURE_WRITE)
SEALS: Final = (
    fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
    if hasattr(fcntl, "F_ADD_SEALS")
    else 0
)

_types: tuple[type, type, type] | None = (
    speedups.SPEEDUPS.shm_types(ShmRingError) if speedups.SPEEDUPS is not None else None
)
ShmRing: Any = _types[0] if _types is not None else None
ShmWaker: Any = _types[1] if _types is not None else None
ShmMux: Any = _types[2] if _types is not None else None
AVAILABLE: Final = _types is not None and hasattr(socket, "send_fds") and SEALS != 0


def region_bytes(ring_bytes: int) -> int:
    return HEADER_BYTES + 2 * ring_bytes


def check_ring_bytes(ring_bytes: int) -> int:
    if ring_bytes < MIN_RING_BYTES or ring_bytes & (ring_bytes - 1):
        raise ShmRingError(
            f"shm_ring_bytes={ring_bytes}: a ring is a power of two of at least "
            f"{MIN_RING_BYTES} bytes (equeue serve --shm-ring-bytes)"
        )
    return ring_bytes


def recv_with_fds(sock: socket.socket, size: int) -> tuple[bytes, list[int]]:
    """One recvmsg: its bytes and the descriptors that came with them (at most 3: more
    than the 2 of a welcome, so that a broker of another version is told, not cut),
    close-on-exec from their arrival: a program the client execs must not hold the
    group's wake-up end, nor a thread's spawn meanwhile the region (reviewshm2 N3)."""
    fds = array.array("i")
    data, ancdata, flags, _ = sock.recvmsg(
        size, socket.CMSG_SPACE(3 * fds.itemsize), socket.MSG_CMSG_CLOEXEC
    )
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            whole = len(payload) - len(payload) % fds.itemsize
            fds.frombytes(payload[:whole])
    if flags & socket.MSG_CTRUNC:
        for fd in fds:
            socket.close(fd)
        raise ShmRingError(f"{len(data)} bytes came with more descriptors than the 3 expected")
    return data, list(fds)
