"""Helpers of the client tests (not a test module): a fake broker speaking a script over
a real Unix socket, to hand the clients what a real broker never sends."""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import equeue
from equeue.errors import ConnectionLostError
from equeue.protocol.frames import DEFAULT_MAX_FRAME_BYTES, FrameReader, decode_body, encode

WELCOME: dict[str, Any] = {
    "version": 1,
    "server": "fake",
    "limits": {"max_frame_bytes": DEFAULT_MAX_FRAME_BYTES, "max_in_flight": 64,
               "max_connections": 8},
}  # fmt: skip


class Peer:
    """The fake broker's side of one connection."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = FrameReader(1 << 26, "fake")
        self.bodies: list[Any] = []

    def recv(self) -> Any:
        """The next frame body from the client; EOFError when it closed."""
        while not self.bodies:
            data = self.sock.recv(1 << 16)
            if not data:
                raise EOFError
            self.bodies += [decode_body(b, "fake") for b in self.reader.feed(data)]
        return self.bodies.pop(0)

    def send(self, body: object) -> None:
        self.sock.sendall(encode(body))

    def raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def welcome(self) -> Any:
        """Take the hello, send the welcome; the hello."""
        hello = self.recv()
        self.send(WELCOME)
        return hello


Script = Callable[[Peer], None]


class FakeBroker:
    """Accepts connections on a Unix socket and runs ``script`` on each, in turn, in a
    thread; ``connections`` counts them."""

    def __init__(self, script: Script) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="eq", dir="/tmp"))
        self.path = self.dir / "fake.sock"
        self.url = f"unix:{self.path}"
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(self.path))
        self.listener.listen(8)
        self.listener.settimeout(0.1)
        self.script = script
        self.connections = 0
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                sock, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            sock.settimeout(10)
            try:
                self.script(Peer(sock))
            except (EOFError, OSError):
                pass
            except BaseException as exc:  # a defect of the script: the test reports it
                self.errors.append(exc)
            finally:
                sock.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.listener.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> FakeBroker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        assert not self.errors, self.errors


START_SECONDS = 180  # at most, for a broker process to say it listens
EXIT_SECONDS = 60  # at most, for one to exit after a signal


class BrokerProcess:
    """``equeue serve STORE`` as a child process (the real broker, killable): ``url`` is
    its Unix socket. ``kill()`` SIGKILLs it, ``start()`` runs it again on the same store;
    ``stop()`` (SIGTERM, then SIGKILL after EXIT_SECONDS) is for every test's teardown."""

    def __init__(self, store: Path, *options: str) -> None:
        self.store = store
        self.options = options
        self.process: subprocess.Popen[str] | None = None
        self.url = ""
        self.start()

    def start(self) -> None:
        command = [sys.executable, "-m", "equeue", "serve", str(self.store), "--quiet"]
        self._close_streams()
        with open(self.store.parent / "broker.log", "a") as log:  # (a pipe could fill up)
            self.process = subprocess.Popen(
                [*command, *self.options], stdout=subprocess.PIPE, stderr=log, text=True
            )
        assert self.process.stdout is not None
        # A bound for a broker that hangs, not a speed: at load 26 on 2 cores its start
        # (the imports) took 8.8 s, and 30 s was seen passed at load 10-30 (the test then
        # failed with an empty log); one that exits is seen at once (poll() below).
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.process.stdout], [], [], 0.5)
            if ready:
                line = self.process.stdout.readline()
                if line.startswith("listening on "):
                    self.url = line.split()[-1]
                    return
                if not line:
                    break
            if self.process.poll() is not None:
                break
        self.stop()
        text = (self.store.parent / "broker.log").read_text()
        raise AssertionError(f"the broker did not start: {text[-2000:]}")

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(EXIT_SECONDS)
        self._close_streams()

    def _close_streams(self) -> None:
        if self.process is not None and self.process.stdout is not None:
            self.process.stdout.close()

    def stop(self) -> None:
        process = self.process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(EXIT_SECONDS)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(EXIT_SECONDS)
        self._close_streams()

    def __enter__(self) -> BrokerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def temporary_broker(*options: str) -> Iterator[BrokerProcess]:
    """A BrokerProcess on a new store in a new directory under /tmp (short enough for
    its socket's path), stopped and removed afterwards."""
    base = Path(tempfile.mkdtemp(prefix="eq", dir="/tmp"))
    try:
        with BrokerProcess(base / "store", *options) as running:
            yield running
    finally:
        shutil.rmtree(base, ignore_errors=True)


def wait_for_progress(url: str, topic: str, least: int) -> None:
    """Until the broker holds ``least`` messages of ``topic`` (bounded: 60 s)."""
    with equeue.connect(url) as watcher:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ids = watcher.queue_ids(topic)
            if sum(watcher.queue_range(topic, q)[1] for q in ids) >= least:
                return
            time.sleep(0.01)
    raise AssertionError(f"no progress on {topic}")


def send_many_killed(
    broker: BrokerProcess, client: Any, topic: str, bodies: list[bytes], window: int, least: int
) -> ConnectionLostError:
    """``client.send_many(topic, bodies)`` in a thread, the broker SIGKILLed once it holds
    ``least`` of them: the ConnectionLostError send_many raised."""
    outcome: dict[str, Any] = {}

    def produce() -> None:
        try:
            outcome["results"] = client.send_many(topic, bodies, window=window)
        except ConnectionLostError as exc:
            outcome["error"] = exc

    producer = threading.Thread(target=produce)
    producer.start()
    try:
        wait_for_progress(broker.url, topic, least)
        broker.kill()
    finally:
        producer.join(120)
    error: ConnectionLostError = outcome["error"]  # (the sends take far longer than the kill)
    return error


class _Counting(asyncio.SelectorEventLoop):
    soon = 0

    def call_soon(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        self.soon += 1
        return super().call_soon(*args, **kwargs)


def counting_loop(mode: str) -> Any:
    """A new event loop counting its call_soon calls (``soon``): asyncio's selector loop
    (``mode`` "asyncio", or "debug": in debug mode) or uvloop's ("uvloop"; the test is
    skipped without it)."""
    loop: Any = _Counting()
    if mode == "uvloop":
        import pytest

        uvloop = pytest.importorskip("uvloop")

        class _UVCounting(uvloop.Loop):  # type: ignore[misc,name-defined]
            soon = 0

            def call_soon(self, *args: Any, **kwargs: Any) -> Any:
                self.soon += 1
                return super().call_soon(*args, **kwargs)

        loop.close()
        loop = _UVCounting()
    loop.set_debug(mode == "debug")
    return loop


def run_pure_python(code: str) -> None:
    """``code`` run in a child process without the accelerator (EQUEUE_PURE_PYTHON=1),
    the tests' directory on its path (so it imports a test module); fails with its output."""
    here = str(Path(__file__).resolve().parent)
    env = {**os.environ, "EQUEUE_PURE_PYTHON": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [here, env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
