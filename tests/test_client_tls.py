"""The clients over TCP and TLS with a token, against the real broker (on a thread):
the round trip, a refused token or certificate (raised at once, not retried), and
threads sharing one TLS connection (reads and writes never in two threads at once)."""

from __future__ import annotations

import asyncio
import ssl
import threading
from pathlib import Path

import pytest
from server_helpers import short_home
from test_server_auth import TOKEN, _self_signed, token_file

import equeue
import equeue.aio
from equeue.errors import AuthenticationError, ConnectionLostError
from equeue.server import BrokerThread

home = pytest.fixture(short_home, name="home")


def test_tls_with_a_token(home: Path) -> None:
    cert, key = _self_signed(home)
    with BrokerThread(
        home / "s", listen=["tls://127.0.0.1:0"], tls_cert=str(cert), tls_key=str(key),
        token_file=str(token_file(home)),
    ) as running:  # fmt: skip
        (url,) = running.urls
        with equeue.connect(url, token=TOKEN, cafile=cert) as client:
            sent = client.send("t", b"over tls", key="k")
            assert client.get(sent.message_id).body == b"over tls"
            assert client.send_many("t", [b"a", b"b"], window=2)[1].topic == "t"

            errors: list[BaseException] = []
            held = []
            waiter = threading.Thread(
                target=lambda: held.append(client.pull("held", 0, 0, wait=30))
            )
            client.create_topic("held", 1)
            waiter.start()

            def producer(n: int) -> None:
                try:
                    for i in range(50):
                        body = f"{n}:{i}".encode()
                        assert client.get(client.send("t", body).message_id).body == body
                except BaseException as exc:
                    errors.append(exc)

            threads = [threading.Thread(target=producer, args=(n,)) for n in range(4)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
            assert not errors, errors
            client.send("held", b"now")
            waiter.join(30)
            assert [m.body for m in held[0]] == [b"now"]

        async def with_aio() -> bytes:
            context = ssl.create_default_context(cafile=str(cert))
            async with await equeue.aio.connect(url, token=TOKEN, ssl_context=context) as aio:
                result = await aio.send("t", b"aio over tls")
                return (await aio.get(result.message_id)).body

        assert asyncio.run(with_aio()) == b"aio over tls"

        for token in ("wrong", None):
            with pytest.raises(AuthenticationError):
                equeue.connect(url, token=token, cafile=cert, connect_timeout=30)
            with pytest.raises(AuthenticationError):
                asyncio.run(equeue.aio.connect(url, token=token, cafile=cert, connect_timeout=30))
        # a certificate the client does not trust: refused at once, not retried for 30 s
        with pytest.raises(ConnectionLostError, match="certificate") as raised:
            equeue.connect(url, token=TOKEN, connect_timeout=30)
        assert "attempts" not in str(raised.value)
        with pytest.raises(ConnectionLostError, match="certificate"):
            asyncio.run(equeue.aio.connect(url, token=TOKEN, connect_timeout=30))


def test_tcp_on_loopback(home: Path) -> None:
    with BrokerThread(home / "s", listen=["tcp://127.0.0.1:0"]) as running:
        (url,) = running.urls
        with equeue.connect(url) as client:
            assert client.send("t", b"tcp").topic == "t"

        async def with_aio() -> int:
            async with await equeue.aio.connect(url) as aio:
                results = await asyncio.gather(*(aio.send("t", b"x") for _ in range(100)))
                return len({r.message_id for r in results})

        assert asyncio.run(with_aio()) == 100


def test_tls_to_a_plain_listener_is_refused_at_once(home: Path) -> None:
    """A tls:// URL against a plain-TCP listener: no retry changes the listener, so it is
    refused at the first attempt, naming TLS (reviewk F11: retried for connect_timeout)."""
    with BrokerThread(home / "s", listen=["tcp://127.0.0.1:0"]) as running:
        (url,) = running.urls
        wrong = url.replace("tcp://", "tls://")
        with pytest.raises(ConnectionLostError, match="listening with TLS") as raised:
            equeue.connect(wrong, connect_timeout=30)
        assert "attempts" not in str(raised.value)
        with pytest.raises(ConnectionLostError, match="listening with TLS") as raised:
            asyncio.run(equeue.aio.connect(wrong, connect_timeout=30))
        assert "attempts" not in str(raised.value)
        with equeue.connect(url) as client:  # (the listener is there, plain)
            assert client.send("t", b"tcp").topic == "t"
