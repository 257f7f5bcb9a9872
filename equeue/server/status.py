"""``equeue serve STORE --status``: ask a running broker for its stats and print them."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

from equeue.errors import BrokerError, ConnectionLostError
from equeue.protocol.faults import unpack_error
from equeue.protocol.frames import (
    DEFAULT_MAX_FRAME_BYTES,
    STATUS_OK,
    FrameReader,
    check_answer,
    decode_body,
    encode,
)
from equeue.protocol.handshake import Hello, Welcome
from equeue.server.config import SOCKET_NAME, parse_listener, read_token

TIMEOUT_S = 10.0


def fetch_stats(store: str, listen: list[str], token_file: str | None) -> dict[str, Any]:
    """The ``stats`` answer of the broker at ``listen[0]``, else at STORE/broker.sock."""
    url = listen[0] if listen else f"unix:{Path(store) / SOCKET_NAME}"
    listener = parse_listener(url)
    token = read_token(token_file) if token_file else None
    where = f"the broker at {url}"
    try:
        if listener.kind == "unix":
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(TIMEOUT_S)
            sock.connect(listener.path)
        else:
            sock = socket.create_connection((listener.host, listener.port), TIMEOUT_S)
            if listener.kind == "tls":
                import ssl

                sock = ssl.create_default_context().wrap_socket(sock, server_hostname=listener.host)
    except OSError as exc:
        raise ConnectionLostError(f"cannot connect to {where}: {exc.strerror or exc}") from None
    with sock:
        reader = FrameReader(DEFAULT_MAX_FRAME_BYTES, where)

        def answer() -> Any:
            while True:
                try:
                    data = sock.recv(1 << 16)
                except OSError as exc:
                    raise ConnectionLostError(f"{where}: {exc}") from None
                if not data:
                    raise ConnectionLostError(f"{where} closed the connection")
                bodies = reader.feed(data)
                if bodies:
                    return decode_body(bodies[0], where)

        sock.sendall(encode(Hello(token=token, client="equeue serve --status").pack()))
        first = answer()
        if type(first) is list:  # an error answer instead of the welcome
            raise unpack_error(check_answer(first, where)[2], where)
        Welcome.unpack(first, where)
        sock.sendall(encode([1, "stats", {}]))
        _, status, result = check_answer(answer(), where)
        if status != STATUS_OK:
            raise unpack_error(result, where)
        if type(result) is not dict:
            raise BrokerError(f"{where}: stats answered {type(result).__name__}, not a map")
        return result


def render_stats(stats: dict[str, Any]) -> str:
    lines = [f"{key}: {stats[key]}" for key in sorted(stats) if not isinstance(stats[key], dict)]
    for name, rate in sorted(stats.get("rates", {}).items()):
        lines.append(f"{name}: {rate}")
    for group, info in sorted(stats.get("groups", {}).items()):
        for topic, lag in sorted(info.get("topics", {}).items()):
            queues = " ".join(f"{q}:{v['lag']}" for q, v in sorted(lag["queues"].items()))
            lines.append(f"group {group} topic {topic}: lag {lag['lag']} ({queues})")
    if "coordinator" in stats:
        lines.append(f"coordinator: {stats['coordinator']}")
    return "\n".join(lines)
