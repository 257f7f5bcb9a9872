"""A failed connect reports the error that said why, not the timeout of a last attempt
that the deadline cut short (fixflaky: under load the refusal never came back within what
was left of connect_timeout, and the cause was TimeoutError with no broker there)."""

from __future__ import annotations

import asyncio
import importlib
import socket
from collections.abc import Iterator
from typing import Any

import pytest

import equeue
import equeue.aio
from equeue.client import rawconn
from equeue.errors import ConnectionLostError

# (the module: equeue.client's `connect` is the function)
connect_module = importlib.import_module("equeue.client.connect")


def _failures(first: BaseException, then: BaseException) -> Iterator[BaseException]:
    yield first
    while True:
        yield then


@pytest.mark.parametrize(
    ("first", "then", "cause", "tail"),
    [
        (FileNotFoundError(2, "no socket"), TimeoutError("timed out"), FileNotFoundError,
         "; the last attempt timed out: TimeoutError('timed out')"),
        (ConnectionRefusedError(111, "refused"), TimeoutError("timed out"),
         ConnectionRefusedError, "; the last attempt timed out"),
        (TimeoutError("timed out"), TimeoutError("timed out"), TimeoutError, None),
        (TimeoutError("timed out"), ConnectionRefusedError(111, "refused"),
         ConnectionRefusedError, None),
    ],
)  # fmt: skip
def test_the_sync_client_reports_the_error_that_said_why(
    monkeypatch: pytest.MonkeyPatch,
    first: BaseException,
    then: BaseException,
    cause: type[BaseException],
    tail: str | None,
) -> None:
    failures = _failures(first, then)

    def failing(endpoint: object, timeout: float) -> socket.socket:
        raise next(failures)

    monkeypatch.setattr(connect_module, "open_socket", failing)
    with pytest.raises(ConnectionLostError) as raised:
        equeue.connect("unix:/nonexistent/broker.sock", connect_timeout=0.2)
    assert type(raised.value.__cause__) is cause
    if tail is None:
        assert "the last attempt timed out" not in str(raised.value)
    else:
        assert tail in str(raised.value)


def test_the_asyncio_client_reports_the_error_that_said_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    failures = _failures(ConnectionRefusedError(111, "refused"), TimeoutError())

    async def failing(*args: Any) -> None:
        raise next(failures)

    monkeypatch.setattr(rawconn, "usable", lambda *_: True)
    monkeypatch.setattr(rawconn, "open_connection", failing)

    async def main() -> ConnectionLostError:
        with pytest.raises(ConnectionLostError) as raised:
            await equeue.aio.connect("unix:/nonexistent/broker.sock", connect_timeout=0.2)
        return raised.value

    error = asyncio.run(main())
    assert type(error.__cause__) is ConnectionRefusedError
    assert "the last attempt timed out: TimeoutError()" in str(error)
