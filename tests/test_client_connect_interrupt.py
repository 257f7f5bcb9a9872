"""An interrupt during the sync client's handshake closes the socket it connected
(reviewk F2): a traceback kept by a REPL, a log or a debugger holds the connecting frame,
and with it a socket the broker counts against max_connections."""

from __future__ import annotations

import signal
import socket
import tempfile
import threading
from pathlib import Path
from types import FrameType, TracebackType

import equeue


def _locals_named(tb: TracebackType | None, name: str) -> list[object]:
    found = []
    while tb is not None:
        frame: FrameType = tb.tb_frame
        if name in frame.f_locals:
            found.append(frame.f_locals[name])
        tb = tb.tb_next
    return found


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _connect_interrupted(url: str, after: float) -> KeyboardInterrupt | None:
    """equeue.connect(url) interrupted ``after`` seconds in: the interrupt (None if the
    connect ended first)."""
    previous = signal.signal(signal.SIGALRM, _interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, after)
        try:
            equeue.connect(url, connect_timeout=30)
        except KeyboardInterrupt as exc:
            return exc
        return None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_an_interrupted_handshake_leaves_no_socket_open() -> None:
    with tempfile.TemporaryDirectory(prefix="eq", dir="/tmp") as base:
        path = str(Path(base) / "mute.sock")
        mute = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # accepts, never welcomes
        mute.bind(path)
        mute.listen(4)
        accepted: list[socket.socket] = []
        acceptor = threading.Thread(target=lambda: accepted.append(mute.accept()[0]))
        acceptor.start()
        try:
            caught = _connect_interrupted(f"unix:{path}", 0.3)
        finally:
            acceptor.join(10)
        try:
            assert caught is not None, "the handshake was not interrupted"
            socks = _locals_named(caught.__traceback__, "sock")
            assert socks, "no connecting frame in the traceback"
            assert all(isinstance(s, socket.socket) and s.fileno() == -1 for s in socks)
            assert accepted[0].recv(1 << 16) != b""  # the hello came: it was past connect
        finally:
            for s in accepted:
                s.close()
            mute.close()


def test_an_interrupted_tcp_connect_leaves_no_socket_open() -> None:
    """The TCP connect itself interrupted (socket.create_connection closed its socket on
    an OSError only): a listener whose accept queue is full drops the SYN, so the connect
    waits, and the interrupt lands in it."""
    full = socket.socket()
    full.bind(("127.0.0.1", 0))
    full.listen(0)
    port = full.getsockname()[1]
    fillers = []
    for _ in range(3):  # (the queue holds backlog + 1; the rest are dropped)
        filler = socket.socket()
        filler.setblocking(False)
        filler.connect_ex(("127.0.0.1", port))
        fillers.append(filler)
    caught = _connect_interrupted(f"tcp://127.0.0.1:{port}", 0.5)
    try:
        assert caught is not None, "the connect was not interrupted"
        # (connect_with_retries' sock is still None: the socket is the connecting frame's)
        socks = [s for s in _locals_named(caught.__traceback__, "sock") if s is not None]
        assert socks, "no connecting frame in the traceback"
        assert all(isinstance(s, socket.socket) and s.fileno() == -1 for s in socks)
    finally:
        for filler in fillers:
            filler.close()
        full.close()
