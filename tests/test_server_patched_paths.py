"""The broker's one-frame fast reads (a plain send: connection.py buffer_updated and the
SendLane, cext/sendlane.c, through sendframe.c's plain_send; a send_bodies: bodyspans.c's
bodies_read) are taken only while the connection's class finds Connection's own
`_request` and `_send` and the handlers' class finds Handlers' own `send_plain` and
`send_bodies` (reviewd F4: a spy or hook put there was bypassed for the commonest
requests, unless two frames came in one read). Replaced on the class after the
connection was made, or overridden by a subclass, they are called for every such read;
put back, the fast reads come back. Under --flush async and sync, with the accelerator."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from typing import Any

import pytest
from server_helpers import short_dir
from test_server_fastsend import Recorder, _feed

from equeue import speedups
from equeue.protocol.frames import encode
from equeue.protocol.handshake import Hello
from equeue.server import Broker, ServerConfig
from equeue.server.connection import Connection
from equeue.server.handlers import Handlers

pytestmark = pytest.mark.skipif(speedups.SPEEDUPS is None, reason="needs the C accelerator")

PLAIN = encode([5, "send", {"topic": "t", "body": b"x"}])
BODIES = encode([6, "send_bodies", {"topic": "t", "bodies": [b"a", b"b"]}])


async def _reads(
    flush: str, patch: Any, patch_first: bool, connection_class: type[Connection] = Connection
) -> tuple[list[str], int]:
    """The calls the spies saw for one plain send and one send_bodies read whole, the
    patch made before the broker starts or after the connection is made; and the
    messages stored."""
    directory = short_dir()
    seen: list[str] = []
    early = patch(seen) if patch_first else contextlib.nullcontext()
    with early:
        broker = Broker(directory / "s", ServerConfig(flush=flush))  # type: ignore[arg-type]
        await broker.start()
        try:
            return await _served(broker, seen, patch, patch_first, connection_class)
        finally:
            await broker._drain()
            shutil.rmtree(directory, ignore_errors=True)


async def _served(
    broker: Broker, seen: list[str], patch: Any, patch_first: bool,
    connection_class: type[Connection],
) -> tuple[list[str], int]:  # fmt: skip
    broker.store.create_topic("t", 1)
    connection = connection_class(broker, "test", 1)
    transport = Recorder()
    transport.protocol = connection
    connection.connection_made(transport)  # type: ignore[arg-type]
    _feed(connection, encode(Hello(client="t").pack()))
    with contextlib.nullcontext() if patch_first else patch(seen):
        for read in (PLAIN, BODIES):
            _feed(connection, read)
            if broker.commit is not None:
                await broker.commit.drain()
            await asyncio.sleep(0)
    stored = len(broker.store.pull("t", 0, 0, 100).messages)
    return seen, stored


def _spying(monkeypatch: pytest.MonkeyPatch, owner: type, name: str) -> Any:
    real = getattr(owner, name)

    class Patch:
        def __init__(self, seen: list[str]) -> None:
            self.seen = seen

        def __enter__(self) -> None:
            seen = self.seen

            def spy(self: Any, *args: Any) -> Any:
                seen.append(name)
                return real(self, *args)

            monkeypatch.setattr(owner, name, spy)

        def __exit__(self, *exc: object) -> None:
            monkeypatch.undo()

    return Patch


@pytest.mark.parametrize("flush", ["async", "sync"])
@pytest.mark.parametrize(
    ("owner", "name", "expected", "patch_first"),
    [  # Handlers' two: bound by the general path when the connection and the handlers
        # are made, so replaced before the broker starts
        (Handlers, "send_plain", ["send_plain"], True),
        (Handlers, "send_bodies", ["send_bodies"], True),
        (Connection, "_request", ["_request", "_request"], True),
        (Connection, "_send", ["_send"], True),
        (Connection, "_request", ["_request", "_request"], False),
        (Connection, "_send", ["_send"], False),
    ],
)
def test_a_method_replaced_on_the_class_is_called(
    monkeypatch: pytest.MonkeyPatch,
    flush: str,
    owner: type,
    name: str,
    expected: list[str],
    patch_first: bool,
) -> None:
    seen, stored = asyncio.run(_reads(flush, _spying(monkeypatch, owner, name), patch_first))
    assert seen == expected and stored == 3


@pytest.mark.parametrize("flush", ["async", "sync"])
def test_a_subclass_overriding_send_gets_it_called(flush: str) -> None:
    calls: list[str] = []

    class Spying(Connection):
        __slots__ = ()

        def _send(self, request_id: int, topic: str, data: bytes) -> None:
            calls.append(topic)
            super()._send(request_id, topic, data)

    class Nothing:
        def __init__(self, seen: list[str]) -> None:
            pass

        def __enter__(self) -> None:
            pass

        def __exit__(self, *exc: object) -> None:
            pass

    _, stored = asyncio.run(_reads(flush, Nothing, False, Spying))
    assert calls == ["t"] and stored == 3
