"""Authentication and TLS: a wrong or missing token is refused, a listener off loopback
does not start without one, a token file others can read is refused, TLS round-trips."""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import subprocess
import sys
from pathlib import Path

import pytest
from server_helpers import Raw, keepalive_of, raw, short_home

from equeue.errors import ConfigError, SparkOptionError
from equeue.protocol.frames import PROTOCOL_VERSION, FrameReader, check_answer, decode_body, encode
from equeue.server import BrokerThread, ServerConfig

TOKEN = "s3cret-token"


home = pytest.fixture(short_home, name="home")


def token_file(home: Path, mode: int = 0o600) -> Path:
    path = home / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(mode)
    return path


def test_a_wrong_or_missing_token_is_refused(home: Path) -> None:
    with BrokerThread(home / "s", token_file=str(token_file(home))) as running:
        url = running.urls[0]
        for given in (None, "wrong", TOKEN + "x", ""):
            c = Raw(url, hello=False)
            try:
                c.send_raw(encode({"versions": [1], "token": given, "client": "t"}))
                error = c.closed_with()
            finally:
                c.close()
            assert error["code"] == "AuthenticationError", error
        with raw(url, token=TOKEN) as c:
            assert c.welcome["version"] == PROTOCOL_VERSION
            assert c.call("ping") is None


def test_token_file_rules(home: Path) -> None:
    with pytest.raises(ConfigError, match="every user"):
        BrokerThread(home / "s", token_file=str(token_file(home, 0o644)))
    real = token_file(home)
    link = home / "link"
    link.symlink_to(real)
    with pytest.raises(ConfigError, match="symlink"):
        BrokerThread(home / "s", token_file=str(link))
    with pytest.raises(ConfigError, match="token file"):
        BrokerThread(home / "s", token_file=str(home / "missing"))
    (home / "empty").write_text("\n")
    (home / "empty").chmod(0o600)
    with pytest.raises(ConfigError, match="no token"):
        BrokerThread(home / "s", token_file=str(home / "empty"))


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        # review 38e E3: the docs said "its first line is the token", the broker took the
        # whole file: a comment line became part of the token
        (b"abc\n# rotated 2026-11-01\n", "more than one line"),
        (b"\n\nabc\n", None),  # whitespace around the one line is not part of it
        (b"  abc\t\r\n", None),
        (b"a b c\n", None),  # a space inside is the token's
        (b"x" * 4096 + b"\n", "longer than 4096"),
        (b"\xff\xfe\n", "not UTF-8"),
        (b"\n \n", "no token"),
    ],
)
def test_a_token_file_holds_one_line(home: Path, content: bytes, problem: str | None) -> None:
    from equeue.server.config import read_token
    from equeue.spark.viabroker import read_token as spark_read_token

    path = home / "token"
    path.write_bytes(content)
    path.chmod(0o600)
    if problem is None:
        assert read_token(str(path)) == spark_read_token(str(path)) == content.decode().strip()
        return
    with pytest.raises(ConfigError, match=problem) as refused:
        read_token(str(path))
    assert str(path) in str(refused.value)
    with pytest.raises(SparkOptionError, match=problem) as refused_spark:
        spark_read_token(str(path))
    assert "tokenFile" in str(refused_spark.value)


def test_a_listener_off_loopback_needs_a_token(home: Path) -> None:
    for url in ("tcp://0.0.0.0:0", "tcp://[::]:0", "tcp://example.com:7000"):
        with pytest.raises(ConfigError, match="without authentication"):
            ServerConfig(listen=(url,))
    ServerConfig(listen=("tcp://127.0.0.1:0", "tcp://localhost:0", "tcp://[::1]:0"))
    # The command refuses too, before listening anywhere.
    done = subprocess.run(
        [sys.executable, "-m", "equeue", "serve", str(home / "s"), "--listen", "tcp://0.0.0.0:0"],
        capture_output=True, text=True, timeout=60, env={**os.environ},
    )  # fmt: skip
    assert done.returncode != 0
    assert "without authentication" in done.stderr
    assert "listening" not in done.stdout


def test_loopback_tcp_round_trip(home: Path) -> None:
    with BrokerThread(home / "s", listen=["tcp://127.0.0.1:0"]) as running:
        (url,) = running.urls
        assert url.startswith("tcp://127.0.0.1:") and not url.endswith(":0")
        with raw(url) as c:
            assert c.call("send", topic="t", body=b"x")[1] == "t"


def _self_signed(home: Path) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make a self-signed certificate")
    cert, key = home / "cert.pem", home / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


def test_tls_round_trip_with_a_token(home: Path) -> None:
    cert, key = _self_signed(home)
    with BrokerThread(
        home / "s", listen=["tls://127.0.0.1:0"], tls_cert=str(cert), tls_key=str(key),
        token_file=str(token_file(home)),
    ) as running:  # fmt: skip
        (url,) = running.urls
        port = int(url.rsplit(":", 1)[1])
        context = ssl.create_default_context(cafile=str(cert))
        with (
            socket.create_connection(("127.0.0.1", port), 20) as plain,
            context.wrap_socket(plain, server_hostname="localhost") as sock,
        ):
            assert sock.version() in ("TLSv1.2", "TLSv1.3")
            reader = FrameReader(1 << 20, "test")

            def recv() -> object:
                while True:
                    bodies = reader.feed(sock.recv(1 << 16))
                    if bodies:
                        return decode_body(bodies[0], "test")

            sock.sendall(encode({"versions": [1], "token": TOKEN, "client": "tls"}))
            assert recv()["version"] == 1  # type: ignore[index]
            sock.sendall(encode([1, "send", {"topic": "t", "body": b"over tls"}]))
            rid, status, result = check_answer(recv(), "test")
            assert (rid, status, result[1]) == (1, 0, "t")
            assert keepalive_of(running) == [(1, 60, 10, 6)]  # reviewg F8, as over tcp://
        # plain TCP to the TLS port is not served
        with socket.create_connection(("127.0.0.1", port), 20) as plain:
            plain.sendall(encode({"versions": [1], "token": TOKEN, "client": "plain"}))
            assert plain.recv(100)[:1] in (b"", b"\x15")  # closed, or a TLS alert


def test_tls_rules(home: Path) -> None:
    with pytest.raises(ConfigError, match="would use them"):
        ServerConfig(tls_cert="c", tls_key="k")
    bad = home / "bad.pem"
    bad.write_text("not a certificate")
    with pytest.raises(ConfigError, match="cannot load the TLS certificate"):
        BrokerThread(home / "s", listen=["tls://127.0.0.1:0"], tls_cert=str(bad), tls_key=str(bad))


def test_a_token_over_plain_tcp_off_loopback_needs_insecure_token(home: Path) -> None:
    token = str(token_file(home))
    for url in ("tcp://0.0.0.0:0", "tcp://example.com:7000"):
        with pytest.raises(ConfigError, match=r"in clear.*--insecure-token"):
            ServerConfig(listen=(url,), token_file=token)
        ServerConfig(listen=(url,), token_file=token, insecure_token=True)  # the risk accepted
    ServerConfig(listen=("tcp://127.0.0.1:0",), token_file=token)  # loopback: not the network
    ServerConfig(listen=("tls://0.0.0.0:0",), token_file=token, tls_cert="c", tls_key="k")


def test_the_token_file_is_checked_as_opened(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file swapped in between a path check and the open is never read unchecked: the
    checks are of the opened descriptor (here the path check is made to see a safe file)."""
    import equeue.server.config as server_config

    safe = os.stat(token_file(home))
    exposed = home / "exposed"
    exposed.write_text("stolen\n")
    exposed.chmod(0o644)
    outcome: object = None
    with monkeypatch.context() as patch:  # os is every module's: undone before asserting
        patch.setattr(os, "lstat", lambda path, **kw: safe)
        try:
            outcome = server_config.read_token(str(exposed))
        except ConfigError as exc:
            outcome = exc
    assert isinstance(outcome, ConfigError) and "every user" in str(outcome), outcome
    fifo = home / "fifo"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(ConfigError, match="not a regular file"):  # and the open did not block
        server_config.read_token(str(fifo))


def test_status_of_a_broker_with_a_token_names_the_option(home: Path) -> None:
    # review 38e E11: --status without --token-file got the broker's words for a client
    # library ("the client gave no token") and no word of the option that fixes it
    path = token_file(home)
    with BrokerThread(home / "s", token_file=str(path)):
        command = [sys.executable, "-m", "equeue", "serve", str(home / "s"), "--status"]
        refused = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert refused.returncode == 1
        assert "gave no token" in refused.stderr and "--token-file FILE" in refused.stderr
        given = subprocess.run(
            [*command, "--token-file", str(path)], capture_output=True, text=True, timeout=60
        )
        assert given.returncode == 0, given.stderr  # the control
        assert "connections: 1" in given.stdout
