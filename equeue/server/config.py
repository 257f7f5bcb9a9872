"""The broker's settings (ServerConfig) and its listeners (``unix:PATH``, ``tcp://HOST:PORT``,
``tls://HOST:PORT``), checked before anything is opened: a bad one is a ConfigError naming it."""

from __future__ import annotations

import datetime as dt
import errno
import ipaddress
import math
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from equeue.chunks.config import MiB, check_int
from equeue.digits import PORT_FORM, port_number
from equeue.errors import ConfigError
from equeue.protocol.address import DEFAULT_SOCKET_NAME
from equeue.protocol.frames import (
    DEFAULT_MAX_BATCH_MESSAGES,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_FRAME_BYTES,
    DEFAULT_MAX_IN_FLIGHT,
    DEFAULT_MAX_PULL_COUNT,
    HELLO_MAX_FRAME_BYTES,
    MIN_MAX_FRAME_BYTES,
)
from equeue.protocol.handshake import MAX_TOKEN_BYTES, token_of, token_problem
from equeue.store.validate import MAX_SPAN, check_span

# Under --flush sync; 0 otherwise (docs/benchmarks.md, "Group commit wait": measured on)
DEFAULT_GROUP_COMMIT_WAIT_US = 500
MAX_GROUP_COMMIT_WAIT_US = 100_000
MAX_BUSY_POLL_US = 10_000
# Groups ever joined (each keeps a retry topic: there is no op that deletes a group) and
# topics clients create: measured ~3.8 kB of broker memory and ~1.2 kB of disk a group
# (review g F6), so the defaults hold ~40 MB; real deployments have tens to hundreds.
DEFAULT_MAX_GROUPS = 10_000
DEFAULT_MAX_TOPICS = 10_000
# Held pulls of every connection (max_held_pulls): 1,024 connections each a group member
# holding its 64 long polls (the client's MAX_POLLERS) is 65,536; twice that, ~1 KB each
# (measured: docs/broker.md, "Limits and backpressure").
DEFAULT_MAX_HELD_PULLS = 131_072
# The weight of one connection's held tag filters (heldfilters.py): three filters of
# 1,024 tags of 255 bytes, or 12 of 1,024 tags of 20 bytes.
DEFAULT_MAX_HELD_FILTER_BYTES = 1 << 20
DEFAULT_STATS_MAX_LISTED = 100
BrokerFlush = Literal["sync", "async", "os"]
EventLoop = Literal["auto", "uvloop", "asyncio"]
EVENT_LOOPS: tuple[EventLoop, ...] = ("auto", "uvloop", "asyncio")
SOCKET_NAME = DEFAULT_SOCKET_NAME  # the default listener, inside the store directory
STATUS_SOCKET_NAME = "status.sock"  # stats past max_connections, beside it (statussock.py)
MAX_UNIX_PATH = 107  # sun_path holds 108 bytes with the NUL
# --retention: a number with an optional unit (no unit: seconds)
DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([smhd]?)\s*")


@dataclass(frozen=True, slots=True)
class Listener:
    kind: Literal["unix", "tcp", "tls"]
    path: str = ""  # unix
    host: str = ""  # tcp, tls
    port: int = 0

    @property
    def url(self) -> str:
        return (
            f"unix:{self.path}" if self.kind == "unix" else f"{self.kind}://{self.host}:{self.port}"
        )

    @property
    def loopback(self) -> bool:
        return self.kind == "unix" or is_loopback(self.host)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # any other name may resolve anywhere
        return False


def parse_listener(url: str) -> Listener:
    """``unix:PATH``, ``tcp://HOST:PORT`` or ``tls://HOST:PORT`` (port 0: any free port)."""
    if url.startswith("unix:"):
        path = url[len("unix:") :]
        if not path:
            raise ConfigError(f"listener {url!r}: unix: needs a path")
        if len(os.fsencode(path)) > MAX_UNIX_PATH:
            raise ConfigError(
                f"listener {url[:80]!r}: the path is {len(os.fsencode(path))} bytes; a Unix "
                f"socket path is limited to {MAX_UNIX_PATH} bytes; "
                "listen on a shorter one (--listen unix:PATH, e.g. under /tmp or $XDG_RUNTIME_DIR)"
            )
        return Listener("unix", path=path)
    for kind in ("tcp", "tls"):
        prefix = f"{kind}://"
        if url.startswith(prefix):
            host, port = _host_port(url, kind, url[len(prefix) :])
            return Listener(kind, host=host, port=port)
    raise ConfigError(
        f"listener {url[:80]!r}: expected unix:PATH, tcp://HOST:PORT or tls://HOST:PORT"
    )


def _host_port(url: str, kind: Literal["tcp", "tls"], rest: str) -> tuple[str, int]:
    """HOST and PORT of ``kind://HOST:PORT`` (port 0: any free port); a ConfigError that
    names the part that is wrong, the url shown once (its first 80 characters)."""
    where = f"listener {url[:80]!r}"
    form = f"give {kind}://HOST:PORT (port 0: any free port)"
    if any(c in rest for c in "/?#@"):
        raise ConfigError(f"{where} has more than {kind}://HOST:PORT (a path, query or user)")
    if rest.startswith("["):  # [ADDRESS]:PORT, an IPv6 address's colons inside
        close = rest.find("]")
        host, port = rest[: close + 1], rest[close + 1 :]
        if close < 0 or (port and not port.startswith(":")):
            raise ConfigError(f"{where}: an IPv6 address is written [ADDRESS]:PORT; {form}")
        port = port[1:]
    else:
        host, sep, port = rest.rpartition(":")
        if not sep:
            host, port = rest, ""
        if "[" in host or "]" in host or ":" in host:  # (tcp://::1:80, tcp://a:b:80)
            raise ConfigError(f"{where}: an IPv6 address is written [ADDRESS]:PORT; {form}")
    if not port:
        raise ConfigError(f"{where}: no port after the host; {form}")
    if host in ("", "[]"):
        raise ConfigError(f"{where}: no host before the port; {form}")
    # (port_number: "\u00b2".isdigit() is true and int() refuses it, 4,301 digits too:
    # builtin ValueErrors, review10, R11-7; leading zeros are the number's, as urllib's)
    number = port_number(port)
    if number is None:
        raise ConfigError(f"{where}: port {port[:20]!r} is not {PORT_FORM}; {form}")
    return host.strip("[]"), number


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """Settings of ``equeue serve`` / ``equeue.serve``; docs/broker.md describes each.

    ``flush`` says when a send is answered: ``"sync"`` after an fdatasync of the message
    log that covers it (one fdatasync for the sends of every connection that arrived
    meanwhile: nothing acknowledged is lost, even on power loss); ``"async"`` at once, the
    store's background thread flushing every ``flush_interval_ms`` (a broker crash loses
    nothing, a power loss the last interval's sends); ``"os"`` at once, the OS writing
    back when it likes (a power loss can lose everything since the last checkpoint).
    """

    listen: tuple[str, ...] = ()  # empty: unix:STORE/broker.sock
    flush: BrokerFlush = "async"
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    # Reading a connection pauses while this many answer bytes wait in its send buffer.
    write_buffer_high: int = 4 * MiB
    token_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    drain_timeout_ms: int = 10_000  # SIGTERM: how long answers may take to leave
    # --flush sync: the most an fdatasync waits for the sends the previous one's answers
    # are expected to bring back from several connections (groupcommit.py); 0: never
    # waits; None: DEFAULT_GROUP_COMMIT_WAIT_US under flush="sync", else 0. Risks latency
    # (at most this, and twice the last fdatasync, per flush), never durability.
    group_commit_wait_us: int | None = None
    # --flush sync: overlapping cohorts (groupcommit.py, _overlap): where a round of sends
    # takes more than this many fdatasyncs, the next fdatasync starts with the last few
    # sends of a round still out (they join the one after); 0: never, one fdatasync a
    # round. Off by default: measured on a loaded disk it halved the sends per fdatasync
    # without raising the rate (docs/benchmarks.md, "The C flusher and overlapping
    # cohorts"). Risks latency for a round's last sends (at most the wait's bound).
    group_commit_overlap: int = 0
    # --flush sync: after a flush's answers are written the event loop keeps polling its
    # sockets (no sleep in epoll) until this many µs pass with no request arriving, and
    # while a flush is in progress (busypoll.py); 0: never. Costs CPU while it polls,
    # risks nothing for durability.
    busy_poll_us: int = 0
    # unix: connections whose hello asks for them get shared-memory rings of this many
    # bytes each way instead of socket reads and writes (equeue/server/shm.py,
    # docs/protocol.md "Shared-memory rings"); off: every connection on its socket.
    shm: bool = False
    shm_ring_bytes: int = 1 << 18
    # One request's work: messages of a send_batch (and items of any array or map a
    # request may hold, checked while decoding), messages of a pull's answer.
    max_batch_messages: int = DEFAULT_MAX_BATCH_MESSAGES
    max_pull_count: int = DEFAULT_MAX_PULL_COUNT
    hello_timeout_ms: int = 10_000  # a connection that has not sent its hello is closed
    # Consumer groups with a retry topic in the store (a join of another is refused), and
    # the topics a store the broker opens may get from clients (StoreConfig.max_topics;
    # a caller's handle keeps its own: another value with a handle is a ConfigError).
    max_groups: int = DEFAULT_MAX_GROUPS
    max_topics: int = DEFAULT_MAX_TOPICS
    # Bytes of frames begun and not yet whole, over every connection: past it, the
    # connection whose bytes passed it is closed (LimitExceededError).
    max_partial_frame_bytes: int = 512 * MiB
    # Long-poll pulls held at once over every connection, and the weight of the tag
    # filters one connection's held pulls keep (holds.py, heldfilters.py): past either, a
    # pull with a wait is answered as one without (empty, nothing skipped) at the next tick.
    max_held_pulls: int = DEFAULT_MAX_HELD_PULLS
    max_held_filter_bytes: int = DEFAULT_MAX_HELD_FILTER_BYTES
    # The groups, the coordinator's live groups and the connections one ``stats`` answer
    # lists (the most lag first; the rest counted): its size does not grow with them.
    stats_max_listed: int = DEFAULT_STATS_MAX_LISTED
    # A token over plain tcp:// off loopback crosses the network in clear: refused unless this.
    insecure_token: bool = False
    # "auto": uvloop where it is installed (a dependency on Linux and macOS), else asyncio's.
    event_loop: EventLoop = "auto"
    # The retention of a store the broker opens (StoreConfig's fields of the same names;
    # a caller's handle keeps its own: these with a handle are a ConfigError). Whole log
    # chunks are removed after each of the store's checkpoints while older than
    # ``retention`` or while the store is over ``max_store_bytes``; with
    # ``retention_respects_consumers`` only once every group committed past them.
    retention: dt.timedelta | None = None
    max_store_bytes: int | None = None
    retention_respects_consumers: bool = False
    listeners: tuple[Listener, ...] = field(init=False, default=())

    @property
    def commit_wait_us(self) -> int:
        """The group-commit wait in effect: the setting, or by default 500 µs under
        flush="sync" and 0 otherwise (resolved here, not stored, so that
        ``dataclasses.replace(config, flush=...)`` gets the new flush's default)."""
        if self.group_commit_wait_us is not None:
            return self.group_commit_wait_us
        return DEFAULT_GROUP_COMMIT_WAIT_US if self.flush == "sync" else 0

    def __post_init__(self) -> None:
        if isinstance(self.listen, str):
            raise ConfigError(f"listen must be a sequence of URLs, got the string {self.listen!r}")
        object.__setattr__(self, "listen", tuple(self.listen))
        if self.flush not in ("sync", "async", "os"):
            raise ConfigError(f"flush={self.flush!r}; it must be 'sync', 'async' or 'os'")
        if self.event_loop not in EVENT_LOOPS:
            raise ConfigError(
                f"event_loop={self.event_loop!r}; it must be 'auto', 'uvloop' or 'asyncio'"
            )
        check_int(
            "max_frame_bytes",
            self.max_frame_bytes,
            max(MIN_MAX_FRAME_BYTES, HELLO_MAX_FRAME_BYTES),
            1 << 31,
        )
        check_int("max_in_flight", self.max_in_flight, 1, 1 << 20)
        check_int("max_connections", self.max_connections, 1, 1 << 20)
        check_int("write_buffer_high", self.write_buffer_high, 1024, 1 << 34)
        check_int("drain_timeout_ms", self.drain_timeout_ms, 0, 3_600_000)
        if self.group_commit_wait_us is not None:  # None stays None: see commit_wait_us
            wait = self.group_commit_wait_us
            check_int("group_commit_wait_us", wait, 0, MAX_GROUP_COMMIT_WAIT_US)
        if self.group_commit_wait_us and self.flush != "sync":  # it would be silently ignored
            raise ConfigError(
                f"group_commit_wait_us={self.group_commit_wait_us} (--group-commit-wait-us) "
                f"only applies to flush='sync' (--flush sync, the broker's group commit); "
                f"got flush={self.flush!r}"
            )
        check_int("group_commit_overlap", self.group_commit_overlap, 0, 1000)
        check_int("busy_poll_us", self.busy_poll_us, 0, MAX_BUSY_POLL_US)
        if self.busy_poll_us and self.flush != "sync":  # nothing would start it
            raise ConfigError(
                f"busy_poll_us={self.busy_poll_us} (--busy-poll-us) only applies to "
                f"flush='sync' (--flush sync: it polls after each group commit's answers); "
                f"got flush={self.flush!r}"
            )
        if self.busy_poll_us and self.group_commit_wait_us == 0:  # nothing would start it
            raise ConfigError(
                f"busy_poll_us={self.busy_poll_us} (--busy-poll-us) polls while the group "
                f"commit expects sends back, which it does not count with "
                f"group_commit_wait_us=0 (--group-commit-wait-us 0): set one of them to 0"
            )
        check_int("shm_ring_bytes", self.shm_ring_bytes, 4096, 1 << 30)
        if self.shm_ring_bytes & (self.shm_ring_bytes - 1):
            raise ConfigError(
                f"shm_ring_bytes={self.shm_ring_bytes} (--shm-ring-bytes) must be a power of two"
            )
        check_int("max_batch_messages", self.max_batch_messages, 1, 1 << 24)
        check_int("max_pull_count", self.max_pull_count, 1, 1 << 24)
        check_int("hello_timeout_ms", self.hello_timeout_ms, 1, 3_600_000)
        check_int("max_groups (--max-groups)", self.max_groups, 1, 1 << 24)
        check_int("max_topics (--max-topics)", self.max_topics, 1, 1 << 24)
        check_int("stats_max_listed (--stats-max-listed)", self.stats_max_listed, 1, 100_000)
        check_int(
            "max_partial_frame_bytes", self.max_partial_frame_bytes, HELLO_MAX_FRAME_BYTES, 1 << 40
        )
        if self.max_partial_frame_bytes < self.max_frame_bytes:
            raise ConfigError(
                f"max_partial_frame_bytes={self.max_partial_frame_bytes} is below "
                f"max_frame_bytes={self.max_frame_bytes}: no frame of that size could arrive"
            )
        check_int("max_held_pulls (--max-held-pulls)", self.max_held_pulls, 0, 1 << 24)
        check_int(
            "max_held_filter_bytes (--max-held-filter-bytes)", self.max_held_filter_bytes,
            0, 1 << 34,
        )  # fmt: skip
        self._check_retention()
        listeners = tuple(parse_listener(url) for url in self.listen)
        object.__setattr__(self, "listeners", listeners)
        tls = [x for x in listeners if x.kind == "tls"]
        if tls and not (self.tls_cert and self.tls_key):
            raise ConfigError(
                f"listener {tls[0].url} needs a certificate and key (--tls-cert, --tls-key)"
            )
        if (self.tls_cert or self.tls_key) and not tls:
            raise ConfigError(
                "--tls-cert/--tls-key given but no tls://HOST:PORT listener would use them"
            )
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("TLS needs both --tls-cert and --tls-key")
        exposed = [x for x in listeners if not x.loopback]
        if exposed and self.token_file is None:
            raise ConfigError(
                f"listener {exposed[0].url} is not on a loopback address: refusing to start "
                "without authentication (give --token-file / token_file)"
            )
        plain = [x for x in exposed if x.kind == "tcp"]
        if plain and not self.insecure_token:
            raise ConfigError(
                f"listener {plain[0].url} is plain TCP off loopback: the token would cross the "
                "network in clear in every hello (anyone on the path can read and replay it); "
                "use tls://HOST:PORT with --tls-cert/--tls-key, or accept that risk with "
                "--insecure-token / insecure_token=True"
            )

    def _check_retention(self) -> None:
        """As StoreConfig checks them, the message naming the option too."""
        if self.retention is not None:
            check_span("retention (--retention)", self.retention)
        if self.max_store_bytes is not None:
            check_int("max_store_bytes (--max-store-bytes)", self.max_store_bytes, 1, 1 << 62)
        respects = self.retention_respects_consumers
        if not isinstance(respects, bool):
            raise ConfigError(
                f"retention_respects_consumers (--retention-respects-consumers) must be a "
                f"bool, got {respects!r}"
            )
        if respects and self.retention is None and self.max_store_bytes is None:  # ignored
            raise ConfigError(
                "retention_respects_consumers (--retention-respects-consumers) only applies "
                "with retention (--retention) or max_store_bytes (--max-store-bytes)"
            )

    @property
    def sets_retention(self) -> bool:
        """Whether any retention setting differs from its default (no retention)."""
        return (
            self.retention is not None
            or self.max_store_bytes is not None
            or self.retention_respects_consumers
        )

    def listeners_for(self, store_path: Path) -> tuple[Listener, ...]:
        if self.listeners:
            return self.listeners
        return (parse_listener(f"unix:{store_path / SOCKET_NAME}"),)


def parse_duration(text: str, option: str) -> dt.timedelta:
    """``90``, ``90s``, ``15m``, ``2h``, ``7d`` (a number, decimals allowed, and an
    optional unit; no unit: seconds) as a timedelta; ConfigError naming ``option``."""
    match = _DURATION.fullmatch(text)
    if match is None:
        raise ConfigError(
            f"{option} {text!r}: expected a duration such as 90, 90s, 15m, 2h or 7d "
            "(no unit: seconds)"
        )
    seconds = float(match.group(1)) * DURATION_UNITS[match.group(2)]
    if not math.isfinite(seconds) or seconds > MAX_SPAN.total_seconds():
        raise ConfigError(f"{option} {text!r} is longer than {MAX_SPAN.days} days")
    return dt.timedelta(seconds=seconds)


def read_token(path: str) -> str:
    """The token in ``path``; refused if the file is a symlink, readable or writable by
    others than its owner and group, or empty. The checks are of the file opened (fstat of
    its descriptor), so a file swapped in after a check is never read unchecked."""
    try:
        # O_NONBLOCK: opening a FIFO put there does not wait for a writer
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ConfigError(f"token file {path} is a symlink; give the file itself") from None
        raise ConfigError(f"token file {path}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"token file {path} is not a regular file")
        if info.st_mode & 0o007:
            raise ConfigError(
                f"token file {path} is accessible by every user "
                f"(mode {stat.S_IMODE(info.st_mode):o}); chmod o-rwx it"
            )
        try:
            data = file.read(MAX_TOKEN_BYTES + 1)
        except OSError as exc:
            raise ConfigError(f"token file {path}: {exc.strerror or exc}") from None
    problem = token_problem(data)
    if problem is not None:
        raise ConfigError(f"token file {path} {problem}")
    return token_of(data)
