"""Opening a blocking connection to a broker: the socket, TLS, the hello and welcome."""

from __future__ import annotations

import socket
import ssl
import time

from equeue.client.core import AnswerReader, hello_frame, lost, welcome
from equeue.client.url import Endpoint
from equeue.errors import ConnectionLostError, EQueueError, ProtocolError
from equeue.protocol.frames import HELLO_MAX_FRAME_BYTES
from equeue.protocol.handshake import Welcome

# Reads go into one buffer of this size per connection (recv_into): a recv() of this
# much would allocate it (an mmap and a munmap per read, 20 us a round trip).
RECV_BYTES = 1 << 18


def open_socket(endpoint: Endpoint, timeout: float) -> socket.socket:
    """A connected socket (OSError if the broker is not there)."""
    if endpoint.kind == "unix":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(endpoint.path)
        except BaseException:
            sock.close()
            raise
        return sock
    sock = _tcp(endpoint.host, endpoint.port, timeout)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if endpoint.kind == "tls":
            assert endpoint.ssl_context is not None
            return endpoint.ssl_context.wrap_socket(sock, server_hostname=endpoint.host)
    except BaseException:
        sock.close()
        raise
    return sock


def _tcp(host: str, port: int, timeout: float) -> socket.socket:
    """socket.create_connection, but its socket closed on any exception: it closes one
    on an OSError only, so an interrupt in a connect that waits (a SYN dropped by a full
    accept queue, a far host) left it to the garbage collector, and a kept traceback
    kept it open (reviewk F10)."""
    errors: list[OSError] = []
    for family, kind, proto, _, address in socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(timeout)
            sock.connect(address)
        except OSError as exc:
            sock.close()
            errors.append(exc)
            continue
        except BaseException:
            sock.close()
            raise
        return sock
    if errors:
        raise errors[0]
    raise OSError(f"getaddrinfo gave no address for {host}:{port}")


def handshake(
    sock: socket.socket, token: str | None, client_name: str, where: str
) -> tuple[Welcome, AnswerReader]:
    """Hello out, welcome in; the reader then holds the welcome's frame limit. Raises the
    broker's refusal (AuthenticationError, LimitExceededError, ProtocolError)."""
    sock.sendall(hello_frame(token, client_name))
    reader = AnswerReader(HELLO_MAX_FRAME_BYTES, where)
    while True:
        data = sock.recv(1 << 16)  # (once per connection)
        if not data:
            raise lost(f"{where}: the broker closed the connection during the handshake", [])
        bodies = reader.feed(data)
        if bodies:
            break
    found = welcome(bodies[0], where)
    if len(bodies) > 1 or reader.pending:
        raise ProtocolError(f"{where}: the broker sent more than its welcome before a request")
    reader.max_frame_bytes = found.limits["max_frame_bytes"]
    return found, reader


def telling(last: BaseException | None, exc: BaseException) -> BaseException:
    """What a failed connect reports: the newest error, but a timeout does not hide an
    earlier one that said why (a refusal, no such socket): the deadline cuts the last
    attempt short, to whatever was left of connect_timeout, and under load that was not
    enough for the refusal to come back (fixflaky: the cause was TimeoutError 3 times in 3
    at load 25, with no broker there at all)."""
    if last is not None and isinstance(exc, TimeoutError) and not isinstance(last, TimeoutError):
        return last
    return exc


def then(told: BaseException | None, newest: BaseException | None) -> str:
    """The rest of the message where ``told`` is not the newest error (a timeout after it)."""
    return "" if newest is told else f"; the last attempt timed out: {newest!r}"


def connect_with_retries(
    endpoint: Endpoint, token: str | None, client_name: str, connect_timeout: float
) -> tuple[socket.socket, Welcome, AnswerReader]:
    """Connect and shake hands, retrying a broker that is not (yet) there with a growing
    pause until ``connect_timeout``; a refusal (token, version, limit) is not retried."""
    where = str(endpoint)
    deadline = time.monotonic() + connect_timeout
    delay = 0.02
    attempts = 0
    last: BaseException | None = None
    newest: BaseException | None = None
    while True:
        attempts += 1
        remaining = max(deadline - time.monotonic(), 0.001)
        sock: socket.socket | None = None
        try:
            sock = open_socket(endpoint, remaining)
            sock.settimeout(remaining)
            found, reader = handshake(sock, token, client_name, where)
            return sock, found, reader
        except ssl.SSLCertVerificationError as exc:  # retrying would not change it
            if sock is not None:
                sock.close()
            raise lost(
                f"{where}: the broker's TLS certificate is refused: {exc}", [], exc
            ) from None
        except ssl.SSLError as exc:
            if sock is not None:
                sock.close()
            if not tls_refused(exc):  # (a broker going down mid-handshake: try again)
                last, newest = telling(last, exc), exc
            else:
                raise lost(f"{where}: {tls_refusal(exc)}", [], exc) from None
        except (OSError, ConnectionLostError) as exc:
            last, newest = telling(last, exc), exc
        except BaseException:  # a refusal, or an interrupt: a kept traceback keeps sock
            if sock is not None:
                sock.close()
            raise
        if sock is not None:
            sock.close()
        if time.monotonic() + delay > deadline:
            raise lost(
                f"cannot connect to the broker at {where} within connect_timeout="
                f"{connect_timeout:g}s ({attempts} attempts): {last}{then(last, newest)}",
                [],
                last,
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.5)


def tls_refused(error: ssl.SSLError) -> bool:
    """Whether a TLS handshake failed for good: anything but the connection ending under
    it (SSLEOFError, SSLZeroReturnError: a broker going down). A ``tls://`` URL against a
    plain-TCP listener (WRONG_VERSION_NUMBER) was retried for the whole connect_timeout
    (reviewk F11), though no retry changes the listener."""
    return not isinstance(error, ssl.SSLEOFError | ssl.SSLZeroReturnError)


def tls_refusal(error: ssl.SSLError) -> str:
    return (
        f"the TLS handshake failed: {error} (is the broker listening with TLS? a tls:// URL "
        "needs `equeue serve --listen tls://...`, a plain listener tcp://)"
    )


def again(failure: EQueueError, unsent: list[object]) -> EQueueError:
    """A caller's own copy of a failed connect's error (each raise adds its own
    traceback), its ``unsent`` the caller's messages: nothing of them was written."""
    if isinstance(failure, ConnectionLostError):
        fresh: EQueueError = lost(str(failure), [], failure.__cause__)
    else:  # a refusal (a token, a version, a limit): the same class, message and fields
        # Built as faults.unpack_error builds one, not by copy.copy: that calls cls(*args),
        # and some classes' __init__ take required keyword arguments (StorePathError: file).
        cls = type(failure)
        fresh = cls.__new__(cls)
        Exception.__init__(fresh, *failure.args)
        fields = vars(failure).items()
        fresh.__dict__.update({k: list(v) if type(v) is list else v for k, v in fields})
        fresh.__cause__ = failure.__cause__
    if isinstance(fresh, ConnectionLostError):
        fresh.unsent = list(unsent)
    return fresh
