"""The servers a run starts: `equeue serve` on a store, and `redis-server`, each on a Unix
socket in the run's directory, each stopped by ``stop()`` (SIGTERM, then SIGKILL)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

START_SECONDS = 30.0
STOP_SECONDS = 30.0


class ServerError(Exception):
    """A server did not start (its log's tail is in the message)."""


class Server:
    def __init__(
        self, name: str, argv: list[str], socket_path: Path, log: Path, cwd: Path | None = None
    ) -> None:
        self.name = name
        self.socket_path = socket_path
        self.log = log
        self.argv = argv
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=cwd
            )

    @property
    def url(self) -> str:
        return f"unix:{self.socket_path}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self) -> None:
        """Until a connection to the socket is accepted: the server listens."""
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(
                    f"{self.name} exited with {self.proc.returncode} before listening on "
                    f"{self.socket_path}: {self.log_tail()}"
                )
            if self.socket_path.exists():
                with socket.socket(socket.AF_UNIX) as sock, contextlib.suppress(OSError):
                    sock.connect(str(self.socket_path))
                    return
            time.sleep(0.05)
        self.stop()
        raise ServerError(
            f"{self.name} did not listen on {self.socket_path} within {START_SECONDS:.0f} s: "
            f"{self.log_tail()}"
        )

    def log_tail(self, size: int = 2000) -> str:
        try:
            return self.log.read_bytes()[-size:].decode(errors="replace").strip()
        except OSError as error:
            return f"(no log: {error})"

    def stop(self) -> int | None:
        """SIGTERM (the broker drains, Redis exits), SIGKILL after STOP_SECONDS."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_SECONDS)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_broker(store: Path, flush: str, log: Path, extra: list[str] | None = None) -> Server:
    """``equeue serve STORE --flush FLUSH`` on its default listener, ``STORE/broker.sock``.

    Started in the store's parent directory: ``python -m`` puts its working directory
    first on sys.path, ahead of PYTHONPATH, so a run started in another checkout would
    serve that checkout's equeue instead of the one PYTHONPATH (or the install) names."""
    store = store.resolve()
    argv = [sys.executable, "-m", "equeue", "serve", str(store), "--flush", flush]
    server = Server(
        f"equeue serve --flush {flush}",
        argv + (extra or []),
        store / "broker.sock",
        log,
        cwd=store.parent,
    )
    server.wait_ready()
    return server


def redis_binary() -> str | None:
    return shutil.which("redis-server")


def redis_version() -> str:
    binary = redis_binary()
    if binary is None:
        return "not installed"
    out = subprocess.run(
        [binary, "--version"], capture_output=True, text=True, timeout=10, check=False
    ).stdout
    for word in out.split():
        if word.startswith("v="):
            return word[2:]
    return out.strip() or "unknown"


def redis_py_version() -> str:
    """redis-py's version, and whether it parses replies with hiredis (C) or in Python."""
    try:
        import redis
        from redis.utils import HIREDIS_AVAILABLE
    except ImportError:
        return "redis-py not installed"
    parser = "hiredis" if HIREDIS_AVAILABLE else "no hiredis: replies parsed in Python"
    return f"redis-py {redis.__version__} ({parser})"


def start_redis(directory: Path, *, durable: bool) -> Server:
    """redis-server on a Unix socket in ``directory``, no TCP port. Not durable: no RDB
    snapshots and no AOF; durable: AOF with ``appendfsync always`` (one fsync per event
    loop turn, before the replies of the commands that turn ran)."""
    binary = redis_binary()
    if binary is None:
        raise ServerError("redis-server is not installed (apt-get install redis-server)")
    directory.mkdir(parents=True, exist_ok=True)
    sock = directory / "redis.sock"
    argv = [binary, "--port", "0", "--unixsocket", str(sock), "--unixsocketperm", "700"]
    argv += ["--dir", str(directory), "--save", "", "--daemonize", "no"]
    argv += ["--protected-mode", "no", "--maxmemory", "0"]
    if durable:
        argv += ["--appendonly", "yes", "--appendfsync", "always"]
    else:
        argv += ["--appendonly", "no"]
    server = Server(
        "redis-server" + (" (appendfsync always)" if durable else ""),
        argv,
        sock,
        directory / "redis.log",
    )
    server.wait_ready()
    check_redis_config(server, durable)
    return server


def check_redis_config(server: Server, durable: bool) -> None:
    """The durability the rows claim is the server's: asked of it, not assumed."""
    import redis

    want = {"appendonly": "yes" if durable else "no", "save": ""}
    if durable:
        want["appendfsync"] = "always"
    with redis.Redis(unix_socket_path=str(server.socket_path), decode_responses=True) as client:
        found = {name: client.config_get(name).get(name) for name in want}
    if found != want:
        server.stop()
        raise ServerError(f"redis-server runs with {found}, not {want}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used (from /proc), 0.0 where unknown."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks
