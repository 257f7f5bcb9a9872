"""A broker address: ``unix:PATH``, ``tcp://HOST:PORT``, ``tls://HOST:PORT``, or the path
of a store directory (its broker's default socket, ``broker.sock``, inside it)."""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from equeue.digits import PORT_FORM, port_number
from equeue.errors import ConfigError, InvalidTypeError
from equeue.protocol.address import DEFAULT_SOCKET_NAME

_FORMS = "unix:PATH, tcp://HOST:PORT, tls://HOST:PORT or a store directory"


@dataclass(frozen=True, slots=True)
class Endpoint:
    kind: str  # "unix", "tcp" or "tls"
    path: str = ""  # unix
    host: str = ""  # tcp, tls
    port: int = 0
    ssl_context: ssl.SSLContext | None = None  # tls

    def __str__(self) -> str:
        if self.kind == "unix":
            return f"unix:{self.path}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.kind}://{host}:{self.port}"


def parse_url(
    url: str | os.PathLike[str],
    *,
    ssl_context: ssl.SSLContext | None = None,
    cafile: str | os.PathLike[str] | None = None,
) -> Endpoint:
    """The endpoint ``url`` names; ConfigError saying which form it breaks."""
    if isinstance(url, os.PathLike):
        url = os.fspath(url)
    if not isinstance(url, str):
        raise InvalidTypeError(f"a broker url must be a str or a path, got {type(url).__name__}")
    if ssl_context is not None and not isinstance(ssl_context, ssl.SSLContext):
        raise InvalidTypeError(
            f"ssl_context must be an ssl.SSLContext, got {type(ssl_context).__name__}"
        )
    if "\0" in url or not url.strip():
        raise ConfigError(f"broker url {url[:80]!r} is empty or holds a NUL; give {_FORMS}")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme in ("tcp", "tls"):
        endpoint = _network(url, scheme)
    elif scheme == "unix":
        path = url[len("unix:") :]
        if path.startswith("//"):  # unix:///run/eq.sock
            path = path[2:]
        if not path:
            raise ConfigError(f"broker url {url!r} names no socket path; give unix:PATH")
        endpoint = Endpoint("unix", path=path)
    elif "://" in url:
        raise ConfigError(f"broker url {url[:80]!r}: unknown scheme {scheme[:20]!r}; give {_FORMS}")
    else:  # a path: a store directory means its broker's socket
        given = Path(url)
        try:
            is_dir = given.is_dir()
        except OSError:  # a name over 255 bytes (ENAMETOOLONG): the length check below
            is_dir = False
        endpoint = Endpoint("unix", path=str(given / DEFAULT_SOCKET_NAME if is_dir else given))
    if endpoint.kind == "unix" and len(os.fsencode(endpoint.path)) > 107:
        raise ConfigError(
            f"unix socket path {endpoint.path[:80]!r} is {len(os.fsencode(endpoint.path))} "
            "bytes, longer than the 107 a socket address holds; use a shorter path (or a "
            "symbolic link to the directory)"
        )
    if endpoint.kind != "tls":
        if ssl_context is not None or cafile is not None:
            raise ConfigError(
                f"ssl_context/cafile given for {url[:80]!r}, which is not a tls:// url"
            )
        return endpoint
    if ssl_context is None:
        try:
            ssl_context = ssl.create_default_context(
                cafile=os.fspath(cafile) if cafile is not None else None
            )
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"cannot load cafile {cafile!r} for {url[:80]}: {exc}") from None
    elif cafile is not None:
        raise ConfigError("give ssl_context or cafile, not both")
    return Endpoint("tls", host=endpoint.host, port=endpoint.port, ssl_context=ssl_context)


def _network(url: str, scheme: str) -> Endpoint:
    """HOST and PORT of ``scheme://HOST:PORT``; a ConfigError naming the part that is
    wrong (the url shown once, its first 80 characters). The port is read as the
    broker's listener reads it (equeue.digits.port_number: leading zeros are the
    number's), not by urllib's ``port`` (int(): its own messages, and more than 4,300
    digits a message about sys.set_int_max_str_digits)."""
    where = f"broker url {url[:80]!r}"
    form = f"give {scheme}://HOST:PORT"
    try:
        parts = urlsplit(url)
        host = parts.hostname
    except ValueError as exc:  # a bad [v6]
        raise ConfigError(f"{where}: {exc}; {form}") from None
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        raise ConfigError(f"{where} has more than {scheme}://HOST:PORT (a path, query or user)")
    netloc = parts.netloc
    tail = netloc[netloc.rfind("]") + 1 :]  # (past an IPv6 address's brackets)
    if tail.count(":") > 1:  # tcp://::1:80, tcp://127.0.0.1:8080:9090 (review16 R16-3)
        raise ConfigError(f"{where}: an IPv6 address is written [ADDRESS]:PORT; {form}")
    port = tail.rpartition(":")[2] if ":" in tail else ""
    if not port:
        raise ConfigError(f"{where}: no port after the host; {form}")
    if not host:
        raise ConfigError(f"{where}: no host before the port; {form}")
    number = port_number(port)
    if number is None:
        raise ConfigError(f"{where}: port {port[:20]!r} is not {PORT_FORM}; {form}")
    if number == 0:  # (a listener's port 0 is any free port: none to connect to)
        raise ConfigError(f"{where}: port 0 names no listener; give the port the broker listens on")
    return Endpoint(scheme, host=host, port=number)
