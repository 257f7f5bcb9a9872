"""An asyncio client made in one ``asyncio.run()`` and closed in a later one (its loop
closed by then): close() closes its socket, not only shuts it (reviewk F10: closed was
True but the socket was left to the garbage collector, a ResourceWarning)."""

from __future__ import annotations

import asyncio
import gc
import warnings
from collections.abc import Iterator

import pytest
from group_helpers import broker_thread

import equeue.aio
from equeue.client.aio import AsyncClient
from equeue.errors import WrongLoopError


@pytest.fixture
def url() -> Iterator[str]:
    with broker_thread("t", 1) as url:
        yield url


@pytest.mark.parametrize("pure", [False, True])
def test_a_client_closed_after_its_loop_closed_closes_its_socket(
    url: str, pure: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if pure:  # asyncio's own transport, not rawconn's
        monkeypatch.setattr("equeue.client.rawconn.usable", lambda *args: False)
    holder: list[AsyncClient] = []

    async def first() -> None:
        holder.append(await equeue.aio.connect(url))
        await holder[0].send("t", b"x")

    async def later() -> None:
        with pytest.raises(WrongLoopError):
            await holder[0].send("t", b"y")
        await holder[0].close()

    asyncio.run(first())  # its loop closed, the client not
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asyncio.run(later())
        assert holder.pop().closed
        gc.collect()
    unclosed = [str(w.message) for w in caught if "unclosed <socket" in str(w.message)]
    assert unclosed == []
