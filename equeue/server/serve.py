"""The broker: listeners, connections, the loop's periodic work, and draining on SIGTERM.

Everything touching the store runs on the event loop thread (the broker is the store's
only writer; an append is microseconds in C), except the fdatasyncs of ``--flush sync``
(groupcommit.py's thread). Blocking ``serve()`` is ``equeue serve``;
``BrokerThread`` runs one in a thread (tests, embedding).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import heapq
import logging
import os
import signal
import socket
import ssl
import stat
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgpack

from equeue.errors import (
    BrokerError,
    ConfigError,
    FencedMemberError,
    GroupError,
    StoreReplacedError,
)
from equeue.protocol import shmrings
from equeue.protocol.frames import DEFAULT_MAX_CONNECTIONS, MESSAGE_OVERHEAD, SUPPORTED_VERSIONS
from equeue.server import stopping
from equeue.server.busypoll import BusyPoll
from equeue.server.config import (
    DEFAULT_MAX_TOPICS,
    MAX_UNIX_PATH,
    SOCKET_NAME,
    STATUS_SOCKET_NAME,
    Listener,
    ServerConfig,
    read_token,
)
from equeue.server.connection import Connection
from equeue.server.fdlimit import SHM_DESCRIPTORS, fit_open_files
from equeue.server.groupcommit import CrossClientCommit, Entry
from equeue.server.groups import GroupCoordinator
from equeue.server.handlers import Handlers
from equeue.server.holds import HeldPull, Holds
from equeue.server.loops import run as run_on
from equeue.server.offsetcommit import OffsetCommitter
from equeue.server.periodic import PeriodicJobs
from equeue.server.release import release_durable
from equeue.server.shm import BrokerShm
from equeue.server.stats import Counters, retention_stats, retry_and_retention
from equeue.server.statussock import StatusConnection
from equeue.store.config import FlushPolicy, StoreConfig
from equeue.store.store import MessageStore
from equeue.store.types import PullResult
from equeue.store.validate import check_open

log = logging.getLogger("equeue.server")

TICK_S = 0.1  # the group coordinator's tick, held pulls' poll
SAMPLE_EVERY = 10  # ticks between rate samples
StoreOrPath = MessageStore | str | os.PathLike[str]


def _check_frame_carries_a_message(max_frame_bytes: int, store: StoreConfig) -> None:
    """A pull's answer must be able to carry the largest message the store takes."""
    needed = store.max_message_size + store.max_properties_size + MESSAGE_OVERHEAD
    if max_frame_bytes < needed:
        raise ConfigError(
            f"max_frame_bytes={max_frame_bytes} cannot carry one message of the store's "
            f"max_message_size={store.max_message_size} with max_properties_size="
            f"{store.max_properties_size} of properties ({needed} bytes with the answer's "
            "overhead): raise --max-frame-bytes, or open the store with a smaller "
            "StoreConfig.max_message_size"
        )


def open_store(store: StoreOrPath, config: ServerConfig) -> tuple[MessageStore, bool]:
    """The store to serve, and whether the broker opened it (and so closes it). A store
    it opens takes messages up to what one frame can carry (at most the store's default)
    and the config's retention; a caller's handle must already fit (ConfigError), and
    keeps its own retention (a retention setting beside it is a ConfigError)."""
    max_frame_bytes = config.max_frame_bytes
    if isinstance(store, MessageStore):
        if config.sets_retention:  # it would be silently ignored
            raise ConfigError(
                f"cannot serve {store.path} with retention settings (--retention, "
                "--max-store-bytes, --retention-respects-consumers): they apply to a store "
                "the broker opens; open the handle with StoreConfig(retention=..., "
                "max_store_bytes=..., retention_respects_consumers=...) instead"
            )
        if store.read_only:
            raise ConfigError(f"cannot serve {store.path}: the handle is read-only")
        if config.max_topics != DEFAULT_MAX_TOPICS:  # it would be silently ignored
            raise ConfigError(
                f"cannot serve {store.path} with max_topics={config.max_topics} "
                "(--max-topics): it applies to a store the broker opens; open the handle "
                "with StoreConfig(max_topics=...) instead"
            )
        if store.config.flush == "sync":
            raise ConfigError(
                f"cannot serve {store.path} opened with flush='sync': its group commit would "
                "block the broker's event loop on every fdatasync; open it with flush='async' "
                "and give the broker flush='sync' (it commits across clients itself)"
            )
        _check_frame_carries_a_message(max_frame_bytes, store.config)
        return store, False
    # Under --flush sync the broker flushes itself; the store's service flushes the rest.
    policy: FlushPolicy = "os" if config.flush == "os" else "async"
    default = StoreConfig()
    largest = max_frame_bytes - default.max_properties_size - MESSAGE_OVERHEAD
    store_config = StoreConfig(
        flush=policy, max_message_size=min(default.max_message_size, largest),
        retention=config.retention, max_store_bytes=config.max_store_bytes,
        retention_respects_consumers=config.retention_respects_consumers,
        max_topics=config.max_topics,
    )  # fmt: skip
    return MessageStore.open(store, store_config), True


def _tls_context(config: ServerConfig) -> ssl.SSLContext | None:
    if not config.tls_cert:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(config.tls_cert, config.tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"cannot load the TLS certificate {config.tls_cert} / key {config.tls_key}: {exc}"
        ) from None
    return context


def _claim_socket_path(path: str) -> None:
    """Remove a stale socket of a broker that died; refuse anything else at ``path``."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        kind = "a symlink" if stat.S_ISLNK(info.st_mode) else "not a socket"
        raise ConfigError(f"cannot listen on unix:{path}: it exists and is {kind}; remove it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except ConnectionRefusedError:
        os.unlink(path)  # nobody listens: a socket a killed broker left
        return
    except OSError as exc:
        raise ConfigError(f"cannot listen on unix:{path}: probing it failed: {exc}") from None
    finally:
        probe.close()
    raise ConfigError(f"cannot listen on unix:{path}: another process is listening on it")


def _refuse_status_path(listeners: Sequence[Listener], status: Path) -> None:
    """A ``unix:`` listener on STORE/status.sock is refused for what it is (the status
    socket's probe would find the broker's own listener there, reviewl L3)."""
    reserved = os.path.join(os.path.realpath(status.parent), status.name)
    for listener in listeners:
        if listener.kind != "unix":
            continue
        path = os.path.abspath(listener.path)
        if os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path)) == (
            reserved
        ):
            raise ConfigError(
                f"cannot listen on {listener.url}: {STATUS_SOCKET_NAME} in the store is the "
                "broker's status socket (--status, past max_connections); listen on "
                f"another path, e.g. unix:{status.parent / SOCKET_NAME}"
            )


def _store_path(store: StoreOrPath) -> Path:
    """Where the store is (or will be), as MessageStore.open names it (and refuses it:
    a path that cannot be a store directory, NotAStoreError)."""
    if isinstance(store, MessageStore):
        return store.path
    return check_open(store, None, False)


class Broker:
    def __init__(self, store: StoreOrPath, config: ServerConfig | None = None) -> None:
        self.config = config = config or ServerConfig()
        self.token = read_token(config.token_file) if config.token_file else None
        self._tls = _tls_context(config)
        # The listeners before the store: a refused one (a socket path too long) leaves
        # nothing created, opened or locked (docs/broker.md: checked before anything opens).
        self.listeners = config.listeners_for(_store_path(store))
        store_files = (
            store.config if isinstance(store, MessageStore) else StoreConfig()
        ).max_open_files  # (the broker opens a store with the default)
        connections = fit_open_files(
            config.max_connections,
            store_files,
            len(self.listeners),
            default=config.max_connections == DEFAULT_MAX_CONNECTIONS,
            per_connection=SHM_DESCRIPTORS if config.shm and shmrings.AVAILABLE else 1,
        )
        if connections != config.max_connections:  # (the default, lowered to what fits)
            self.config = config = dataclasses.replace(config, max_connections=connections)
        self.store, self._owns_store = open_store(store, config)
        try:
            self._set_up(config)
        except BaseException:  # a store this broker opened must not stay open and locked
            self._close_store()
            raise

    def _set_up(self, config: ServerConfig) -> None:
        self.urls: list[str] = []
        self.connections: set[Connection] = set()
        self.status_connections: set[Connection] = set()  # of STORE/status.sock (statussock.py)
        self.counters = Counters()
        self.draining = False
        self.limits = {
            "max_frame_bytes": config.max_frame_bytes,
            "max_in_flight": config.max_in_flight,
            "max_connections": config.max_connections,
            "max_batch_messages": config.max_batch_messages,
            "max_pull_count": config.max_pull_count,
            "max_message_size": self.store.config.max_message_size,
            "max_properties_size": self.store.config.max_properties_size,
        }
        self.partial_bytes = 0  # of frames begun, over every connection
        self.tls_refusals = 0  # refused connections in their TLS handshake (tlsaccept.py)
        self.welcome_versions: tuple[int, ...] = SUPPORTED_VERSIONS
        from equeue import __version__

        self.server_name = f"equeue {__version__}"
        self._servers: list[asyncio.AbstractServer] = []
        self._sockets: list[tuple[str, int]] = []  # unix socket files we made: (path, inode)
        self._number = 0
        # One packer for every answer (the loop is single-threaded): half the cost of packb;
        # its options are frames.encode's.
        self.packer = msgpack.Packer(use_bin_type=True)
        self.coordinator: GroupCoordinator | None = None  # made by start(), on the loop
        self.shm: BrokerShm | None = None  # --shm: made by start(), on the loop

    # --- start ------------------------------------------------------------------

    async def start(self) -> None:
        self.loop = loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self.holds = Holds(
            loop, self.store, self._answer_held, max_held=self.config.max_held_pulls,
            max_filter_bytes=self.config.max_held_filter_bytes,
        )  # fmt: skip
        sync = self.config.flush == "sync"
        self.busy_poll = busy = (
            BusyPoll(loop, self.config.busy_poll_us, self.counters)
            if sync and self.config.busy_poll_us
            else None
        )
        self.commit = (
            CrossClientCommit(
                loop,
                self.store.flush_log,
                release_durable if busy is None else self._release_and_poll,
                self.config.commit_wait_us,
                overlap_per_fdatasync=self.config.group_commit_overlap,
                store=self.store,
            )
            if sync
            else None
        )
        if busy is not None:
            busy.commit = self.commit
        self.shm = (
            BrokerShm(loop, self.config.shm_ring_bytes)
            if self.config.shm and shmrings.AVAILABLE
            else None
        )
        try:  # from here on a failure must stop the flusher thread the commit started
            self.coordinator = coordinator = GroupCoordinator(
                self.store, max_groups=self.config.max_groups
            )
            self.offsets = OffsetCommitter(loop, self.store)
            self.offsets.on_reset = coordinator.retries.forget
            coordinator.retries.appended = self.holds.noted
            self.handlers = Handlers(
                self.store, self.holds, self.commit, coordinator, self.counters, self._stats,
                self.config, self.packer, self.offsets,
            )  # fmt: skip
            _refuse_status_path(self.listeners, self.store.path / STATUS_SOCKET_NAME)
            for listener in self.listeners:
                await self._listen(listener)
            await self._listen_for_status()
        except BaseException:
            await self._close_servers()
            if self.commit is not None:
                self.commit.close()  # its flusher thread
            raise
        self._ticks = 0
        self._periodic = PeriodicJobs(log)
        self._ticker = loop.call_later(TICK_S, self._tick)
        wait = self.config.commit_wait_us if self.commit is not None else 0
        log.info(
            "serving %s on %s (flush=%s%s)", self.store.path, " ".join(self.urls),
            self.config.flush, f", group commit wait {wait} µs" if wait else "",
        )  # fmt: skip

    def _factory(self, url: str, tls: ssl.SSLContext | None = None) -> Callable[[], Connection]:
        def make() -> Connection:
            self._number += 1
            return Connection(self, url, self._number, tls)

        return make

    async def _listen(self, listener: Listener) -> None:
        loop = self.loop
        if listener.kind == "unix":
            server = await self._listen_unix(listener.path, self._factory(listener.url))
            self.urls.append(listener.url)
        else:
            # A tls:// listener accepts plain TCP: the Connection does its handshake
            # (tlsaccept.py), counted and bounded from the accept on.
            tls = self._tls if listener.kind == "tls" else None
            try:
                server = await loop.create_server(
                    self._factory(listener.url, tls), listener.host, listener.port,
                    reuse_address=True,
                )  # fmt: skip
            except OSError as exc:
                raise ConfigError(
                    f"cannot listen on {listener.url}: {exc.strerror or exc}"
                ) from None
            port = server.sockets[0].getsockname()[1]
            host = f"[{listener.host}]" if ":" in listener.host else listener.host
            self.urls.append(f"{listener.kind}://{host}:{port}")
        self._servers.append(server)

    async def _listen_unix(
        self, path: str, factory: Callable[[], Connection]
    ) -> asyncio.AbstractServer:
        _claim_socket_path(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
            # Before listen(): until then a connect is refused, so nobody gets in
            # between bind() (the umask's mode) and here.
            os.chmod(path, 0o600)
            inode = os.stat(path).st_ino
        except OSError as exc:
            sock.close()
            raise ConfigError(f"cannot listen on unix:{path}: {exc.strerror or exc}") from None
        self._sockets.append((path, inode))
        return await self.loop.create_unix_server(factory, sock=sock)

    async def _listen_for_status(self) -> None:
        """STORE/status.sock: stats and ping past max_connections (statussock.py). Not
        in ``urls`` (no client's listener); skipped, with a warning, where the store's
        path leaves no room for it in sun_path, or where it cannot be bound (a file
        system without socket files: the broker's listeners may be TCP only, reviewl
        L6). Something other than a stale socket there still refuses the start."""
        path = str(self.store.path / STATUS_SOCKET_NAME)
        if len(os.fsencode(path)) > MAX_UNIX_PATH:
            log.warning(
                "no status socket: %s is longer than %d bytes; --status of a full broker "
                "is refused like any client", path, MAX_UNIX_PATH,
            )  # fmt: skip
            return
        url = f"unix:{path}"

        def make() -> Connection:
            self._number += 1
            return StatusConnection(self, url, self._number)

        _claim_socket_path(path)  # a file, a directory, a link, a live socket: refused
        try:
            server = await self._listen_unix(path, make)
        except ConfigError as exc:
            log.warning(
                "no status socket: %s; --status of a full broker is refused like any client",
                exc,
            )
            return
        self._servers.append(server)

    # --- the loop's work ----------------------------------------------------------

    def _release_and_poll(self, batch: list[Entry], error: BaseException | None) -> None:
        """release_durable, then poll (busypoll.py) while the clients answer back: only
        where the group commit expects sends back from several connections (a lone
        sender's or a shared client's next batch is no cohort to wait for)."""
        try:
            release_durable(batch, error)
        finally:
            commit = self.commit
            if commit is not None and commit.expecting:
                assert self.busy_poll is not None
                self.busy_poll.kick()

    def after_batch(self) -> None:
        """After a connection's data: wake held pulls on the queues appended to."""
        if self.holds.appended:
            self.holds.arrived()

    def _answer_held(self, held: HeldPull, outcome: PullResult | BaseException) -> None:
        answer: object = outcome
        if not isinstance(outcome, BaseException):
            try:
                answer = self.handlers.fit_pull(outcome, held.owner.where)
            except Exception as exc:  # a message no frame can carry
                answer = exc
        # The member's queue moved, its session ended or it left while the pull was held:
        # the answer that makes it join again, part of every rebalance and clean leave
        # (one a queue it held), so not an error for an operator watching errors_per_s.
        moved = isinstance(outcome, GroupError) and not isinstance(outcome, FencedMemberError)
        if moved:
            self.counters.held_pulls_moved += 1
        held.owner.finish(held.request_id, answer, error=not moved)

    def _tick(self) -> None:
        coordinator = self.coordinator
        assert coordinator is not None
        periodic = self._periodic
        try:  # each its own try: a failing mover must not starve held pulls and the rates
            periodic.run("group tick (expiry, retries)", coordinator.tick)
            if self.holds.appended:  # retries the tick moved: their queues' held pulls
                periodic.run("held pulls of retries moved", self.holds.arrived)
            if self.holds.count:
                periodic.run("poll of held pulls", self.holds.poll)
            periodic.run("pulls not held", self.holds.answer_later)
            self._ticks += 1
            if self._ticks % SAMPLE_EVERY == 0:
                periodic.run("stats sample", self.counters.sample)
                self._check_store_directory()
        finally:
            if not self.draining:
                self._ticker = self.loop.call_later(TICK_S, self._tick)

    def _check_store_directory(self) -> None:
        """Once a second: a store directory removed and made again (or moved) under the
        broker stops it, before its checkpoint or a commit lands in the other store."""
        try:
            self.store._check_directory()
        except StoreReplacedError as exc:
            if not self._stop.is_set():
                log.error("%s; the broker stops", exc)
                self._stop.set()

    def _stats(self) -> dict[str, Any]:
        assert self.coordinator is not None  # (made by start(), before any connection)
        rings = {"shm": self.shm.stats()} if self.shm is not None else {}
        return {
            **rings,
            **retry_and_retention(self.store, self.coordinator.retries),
            "connections": len(self.connections),
            "in_flight": sum(c.in_flight for c in self.connections),
            "buffered_bytes": sum(c.buffered for c in self.connections),
            "uptime_s": round(self.loop.time() - self._started, 3)
            if hasattr(self, "_started")
            else 0.0,
            "listen": list(self.urls),
            "flush": self.config.flush,
            "retention": retention_stats(self.store.config),
            # --busy-poll-us: times the poll started from idle, loop turns spent polling
            "busy_poll_starts": self.busy_poll.kicks if self.busy_poll else 0,
            "busy_polls": self.busy_poll.spins if self.busy_poll else 0,
            "clients": [
                {
                    "where": c.where,
                    "client": c.client,
                    "in_flight": c.in_flight,
                    "buffered_bytes": c.buffered,
                }
                for c in heapq.nsmallest(
                    self.config.stats_max_listed, self.connections, key=lambda c: c.number
                )
            ],
        }

    # --- run and stop ---------------------------------------------------------------

    def request_stop(self) -> None:
        """From any thread: drain and stop."""
        loop = getattr(self, "loop", None)
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._stop.set)

    async def run(
        self, ready: Callable[[list[str]], None] | None = None, *, signals: bool = False
    ) -> None:
        """Start, serve until ``request_stop`` (or SIGTERM/SIGINT with ``signals``), drain."""
        try:
            await self.start()
        except BaseException:
            self._close_store()
            raise
        self._started = self.loop.time()
        if signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.loop.add_signal_handler(sig, self._stop.set)
        try:
            if ready is not None:
                ready(list(self.urls))
            await self._stop.wait()
            log.info("stopping: draining %d connections", len(self.connections))
        finally:
            await self._drain()

    async def _drain(self) -> None:
        """Stop accepting, answer what is in flight, flush, close the store, remove sockets."""
        self.draining = True
        with contextlib.suppress(AttributeError):
            self._ticker.cancel()
        busy = getattr(self, "busy_poll", None)
        if busy is not None:
            busy.stop()
            log.info("busy-poll: started %d times, %d polls", busy.kicks, busy.spins)
        for server in self._servers:
            server.close()
        for connection in list(self.connections):
            if connection.transport is not None and not connection.closed:
                connection.transport.pause_reading()
        self.holds.answer_all()
        if self.commit is not None:
            await self.commit.drain()
        await self.offsets.drain()
        for connection in list(self.connections):
            try:
                stopping.stop(connection)  # its last frame: what is unanswered was not served
            except Exception:  # its transport failed the write: the others stop all the same
                log.exception("%s: writing its last answers failed", connection.where)
                if connection.transport is not None:
                    connection.transport.abort()
        deadline = self.loop.time() + self.config.drain_timeout_ms / 1000
        while self.connections and self.loop.time() < deadline:
            await asyncio.sleep(0.01)
        for connection in list(self.connections):  # answers a stalled client never read
            if connection.transport is not None:
                connection.transport.abort()
        await self._close_servers()
        if self.commit is not None:
            self.commit.close()
        self.offsets.close()
        self._close_store()

    async def _close_servers(self) -> None:
        if self.shm is not None:
            self.shm.close()
        for server in self._servers:
            server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 1.0)
        for path, inode in self._sockets:
            with contextlib.suppress(OSError):
                if os.lstat(path).st_ino == inode:  # still ours
                    os.unlink(path)
        self._sockets.clear()

    def _close_store(self) -> None:
        if self._owns_store:
            self.store.close()
        elif not self.store._closed:
            self.store.flush()


def serve(
    store: StoreOrPath,
    config: ServerConfig | None = None,
    *,
    ready: Callable[[list[str]], None] | None = None,
    **settings: Any,
) -> None:
    """Serve ``store`` (a path or a writable MessageStore) until SIGTERM/SIGINT (in the
    main thread) and drain; ``settings`` are ServerConfig's (listen, flush, ...)."""
    if config is None:
        config = ServerConfig(**settings)
    elif settings:
        raise ConfigError("give either a ServerConfig or its settings, not both")
    broker = Broker(store, config)
    signals = threading.current_thread() is threading.main_thread()
    run_on(broker.run(ready, signals=signals), config.event_loop)


class BrokerThread:
    """A broker on its own thread and loop: ``with BrokerThread(path, ...) as broker:``.
    ``urls`` are where it listens (a tcp port 0 resolved)."""

    def __init__(
        self, store: StoreOrPath, config: ServerConfig | None = None, **settings: Any
    ) -> None:
        self.broker = Broker(store, config or ServerConfig(**settings))
        self.urls: list[str] = []
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="equeue-broker", daemon=True)

    @property
    def store(self) -> MessageStore:
        return self.broker.store

    def _run(self) -> None:
        def ready(urls: list[str]) -> None:
            self.urls = urls
            self._ready.set()

        try:
            run_on(self.broker.run(ready), self.broker.config.event_loop)
        except BaseException as exc:
            self._error = exc
            log.exception("the broker thread failed")
        finally:
            self._ready.set()

    def start(self, timeout: float = 30.0) -> BrokerThread:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise BrokerError(f"the broker did not start within {timeout} s")
        if self._error is not None:
            raise self._error
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.broker.request_stop()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise BrokerError(f"the broker did not stop within {timeout} s")

    def __enter__(self) -> BrokerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = ["Broker", "BrokerThread", "serve"]
