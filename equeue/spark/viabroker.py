"""``format("equeue")`` through a broker: the options ``broker`` and ``tokenFile``, and the
connections the driver and the executors make with them.

On this path nothing opens the store: the driver plans with the client
(``topics``, ``queue_ids``, ``queue_range``) and each task opens a connection of its own
(equeue/client), so executors need not see the store's filesystem, only the broker's
address. The token is read from ``tokenFile`` where the connection is made (on each
executor), never carried in an option: Spark logs a plan's options.
"""

from __future__ import annotations

import math
import os
import socket
import stat
from collections.abc import Mapping
from typing import TYPE_CHECKING, Final

from equeue.errors import (
    BrokerTooOldError,
    ConfigError,
    ConnectionLostError,
    EQueueError,
    FrameTooLargeError,
    SparkOptionError,
)
from equeue.protocol.handshake import MAX_TOKEN_BYTES, token_of, token_problem

if TYPE_CHECKING:
    from equeue.client.sync import Client
    from equeue.store.types import PullResult

BROKER: Final = "broker"
TOKEN_FILE: Final = "tokenFile"
CA_FILE: Final = "caFile"
# The client's waits, in seconds: for a broker to accept a connection (also each
# reconnection: a broker restarted within it is waited for), and for an answer.
CONNECT_TIMEOUT: Final = "connectTimeout"
TIMEOUT: Final = "timeout"
CLIENT_NAME: Final = "equeue-spark"
HEAD_GUESS: Final = 256  # bytes of a pulled message on the wire besides its body


def option(options: Mapping[str, str], name: str) -> str | None:
    """Spark hands options over case-insensitively (lower-cased keys)."""
    for key, value in options.items():
        if key.lower() == name.lower():
            return value
    return None


def broker_url(options: Mapping[str, str]) -> str | None:
    """The ``broker`` option checked (None when the store is read or written by path).
    SparkOptionError naming the option for a URL the client cannot use, or for ``path``
    given too (``load(STORE)``/``save(STORE)`` and ``broker`` are exclusive)."""
    from equeue.client.url import parse_url

    url = option(options, BROKER)
    token_file = option(options, TOKEN_FILE)
    if url is None:
        for name in (TOKEN_FILE, CA_FILE, CONNECT_TIMEOUT, TIMEOUT):
            if option(options, name) is not None:
                raise SparkOptionError(
                    f"option {name} is for a broker: give option({BROKER!r}, URL) with it"
                )
        return None
    if option(options, "path"):
        raise SparkOptionError(
            f"option {BROKER}={url!r} and the store path {option(options, 'path')!r} are "
            "exclusive: through a broker nothing opens the store; drop the path from "
            "load()/save() (or drop the broker option to use the store directly)"
        )
    if not url.startswith(("unix:", "tcp://", "tls://")):
        raise SparkOptionError(
            f"option {BROKER}={url!r}: give unix:PATH, tcp://HOST:PORT or tls://HOST:PORT"
        )
    ca_file = option(options, CA_FILE)
    if ca_file is not None and not url.startswith("tls://"):
        raise SparkOptionError(f"option {CA_FILE} is for a tls:// broker, not {url!r}")
    absolute = _absolute_unix(url)
    try:  # the URL every node connects to: a relative unix: path made absolute here
        parse_url(absolute)
    except EQueueError as exc:  # (its message names the url: not repeated here)
        made = f"={url[:80]!r} (made absolute)" if absolute != url else ""
        raise SparkOptionError(f"option {BROKER}{made}: {exc}") from None
    if token_file is not None and not token_file:
        raise SparkOptionError(f"option {TOKEN_FILE} is empty: give the token file's path")
    return absolute


def read_token(path: str | None) -> str | None:
    """The token in ``path`` (a file every executor can read at that path)."""
    if path is None:
        return None
    try:
        # O_NONBLOCK: a FIFO (a secret handed over as <(...)) does not hold the open until
        # a writer comes; it is refused below, as it would be read once, not on every node.
        fd = os.open(path, os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK)
        try:
            regular = stat.S_ISREG(os.fstat(fd).st_mode)
            data = os.read(fd, MAX_TOKEN_BYTES + 1) if regular else b""
        finally:
            os.close(fd)
    except OSError as exc:
        raise SparkOptionError(
            f"option {TOKEN_FILE}={path!r}: cannot read it on this node "
            f"({exc.strerror or exc}); it must be readable at that path on the driver and "
            "on every executor"
        ) from None
    if not regular:
        raise SparkOptionError(
            f"option {TOKEN_FILE}={path!r} is not a regular file (a pipe or a device is "
            "read once at most, and the driver and every executor read the token file): "
            "give a file"
        )
    problem = token_problem(data)
    if problem is not None:
        raise SparkOptionError(f"option {TOKEN_FILE}={path!r}: the file {problem}")
    return token_of(data)


def _absolute(path: str | None) -> str | None:
    return None if path is None else os.path.abspath(path)


def _absolute_unix(url: str) -> str:
    """A ``unix:`` URL of a relative socket path made absolute (reviewc F1: the driver
    connected from its working directory, every executor failed after connect_timeout)."""
    if not url.startswith("unix:"):
        return url
    path = url[len("unix:") :]
    if path.startswith("//"):  # unix:///run/eq.sock (parse_url's form)
        path = path[2:]
    return "unix:" + os.path.abspath(path)


def _seconds(options: Mapping[str, str], name: str, default: float) -> float:
    text = option(options, name)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < 1e9:  # (NaN fails it too) the client's bounds
        raise SparkOptionError(
            f"option {name}={text!r}: give seconds, a number > 0 (default {default:g})"
        )
    return value


class BrokerAddress:
    """What a task needs to connect: picklable, no token inside (each node reads it)."""

    def __init__(self, options: Mapping[str, str]) -> None:
        url = broker_url(options)
        if url is None:
            raise SparkOptionError(f"option {BROKER} is missing")
        self.url = url  # (absolute: broker_url)
        # Absolute on the driver, as the store path is: an executor's working directory
        # is not the driver's, and each reads the files again (reviewc F1).
        self.token_file = _absolute(option(options, TOKEN_FILE))
        self.ca_file = _absolute(option(options, CA_FILE))  # None: the system's CAs
        from equeue.client.sync import DEFAULT_CONNECT_TIMEOUT, DEFAULT_TIMEOUT

        self.connect_timeout = _seconds(options, CONNECT_TIMEOUT, DEFAULT_CONNECT_TIMEOUT)
        self.timeout = _seconds(options, TIMEOUT, DEFAULT_TIMEOUT)
        read_token(self.token_file)  # on the driver first: a bad path fails the plan

    def connect(self) -> Client:
        """A client of the broker; the broker's refusal (AuthenticationError,
        ConnectionLostError, ...) raised as it is, with the option named."""
        from equeue.client.sync import Client

        try:
            return Client(
                self.url,
                token=read_token(self.token_file),
                cafile=self.ca_file,
                connect_timeout=self.connect_timeout,
                timeout=self.timeout,
                client_name=f"{CLIENT_NAME} pid {os.getpid()}",
            )
        except ConfigError as exc:  # (the URL was parsed on the driver: a CA file it is)
            where = f"{CA_FILE}={self.ca_file!r}" if self.ca_file else f"{BROKER}={self.url!r}"
            raise SparkOptionError(f"option {where}: {exc}") from None
        except EQueueError as exc:
            exc.add_note(f"(format('equeue') option {BROKER}={self.url!r})")
            raise

    def __repr__(self) -> str:
        return f"BrokerAddress({self.url!r})"


class BrokerQueues:
    """A client with the read-only handle's methods that the sources plan and read with
    (stream.py, offsets.py): ``pull`` bounded to fit a frame, ``topics``, ``queue_ids``,
    ``queue_range``, ``path`` for messages, and a ``refresh`` that has nothing to do (the
    broker's store is the writer's, always current)."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.path = f"the store served at {client.url}"  # (for messages)
        welcome = client.welcome
        frame = welcome.limits["max_frame_bytes"] if welcome is not None else 1 << 20
        # A pull's answer must fit one frame, and the broker bounds only its bodies
        # (max_bytes): bodies get half the frame, the other fields of ``count`` messages
        # (HEAD_GUESS bytes each, as a guess) the rest.
        self.max_bytes = max(1, frame // 2)
        self.count = max(1, frame // 2 // HEAD_GUESS)

    def pull(self, topic: str, queue_id: int, offset: int, max_count: int) -> PullResult:
        """At most ``max_count`` messages; fewer where their keys and properties would make
        an answer larger than a frame (then the connection breaks, with
        FrameTooLargeError as the cause: the pull, which changes nothing, is made again
        for a quarter as many, and this handle keeps to that)."""
        while True:
            count = min(max_count, self.count)
            try:
                return self.client.pull(topic, queue_id, offset, count, max_bytes=self.max_bytes)
            except ConnectionLostError as exc:
                if not isinstance(exc.__cause__, FrameTooLargeError) or count == 1:
                    raise
                self.count = max(1, count // 4)

    def queue_range(self, topic: str, queue_id: int) -> tuple[int, int]:
        return self.client.queue_range(topic, queue_id)

    def topics(self) -> list[str]:
        return self.client.topics()

    def queue_ids(self, topic: str) -> list[int]:
        return self.client.queue_ids(topic)

    def deleted_topics(self) -> dict[str, int] | None:
        """The store's, or None: a broker before protocol version 5 does not say."""
        try:
            return self.client.deleted_topics()
        except BrokerTooOldError:
            return None

    def refresh(self) -> None:
        return

    def close(self) -> None:
        self.client.close()


def served_at(store: str) -> str | None:
    """``unix:STORE/broker.sock`` if a broker serving ``store`` listens there (its default
    listener), else None. Only connects and hangs up: no hello, no request."""
    from equeue.protocol.address import DEFAULT_SOCKET_NAME

    path = os.path.join(store, DEFAULT_SOCKET_NAME)
    if len(os.fsencode(path)) > 107:  # too long for a socket address: no broker made it
        return None
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(2.0)
        try:
            sock.connect(path)
        except OSError:  # none there, or a socket left by a killed broker
            return None
    return f"unix:{path}"


def served_error(store: str, url: str) -> SparkOptionError:
    return SparkOptionError(
        f"the store at {store} is served by a broker (equeue serve, listening on {url}): the "
        "broker is its writer, so the sink cannot append by path; write through it: "
        f'.option("{BROKER}", "{url}") and save() without the path (at-least-once; '
        'docs/spark.md, "Through a broker")'
    )
