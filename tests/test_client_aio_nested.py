"""A send from a loop run nested inside the client's own loop (nest_asyncio's way: the
running loop unset, then the other loop's run_until_complete) is refused as from any other
loop, nothing written (review6 R6-5: the accelerator's running-loop check took the client's
loop for the running one, the send was stored and a builtin RuntimeError escaped)."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

import pytest

from equeue.client.aio import connect
from equeue.errors import WrongLoopError
from equeue.server import BrokerThread


def test_a_send_from_a_nested_loop_is_refused_and_not_sent() -> None:
    home = Path(tempfile.mkdtemp(prefix="eq", dir="/tmp"))  # a socket path must be short
    try:
        with BrokerThread(home / "s") as running:
            running.store.create_topic("t", 1)

            async def main() -> None:
                client = await connect(running.urls[0])
                assert (await client.send("t", b"own loop")).queue_offset == 0  # control
                nested = asyncio.new_event_loop()
                outer = asyncio.events._get_running_loop()
                asyncio.events._set_running_loop(None)
                try:
                    with pytest.raises(WrongLoopError):
                        nested.run_until_complete(asyncio.wait_for(client.send("t", b"x"), 5))
                finally:
                    asyncio.events._set_running_loop(outer)
                    nested.close()
                assert (await client.send("t", b"own loop again")).queue_offset == 1
                await client.close()

            asyncio.run(main())
            assert running.store.queue_range("t", 0) == (0, 2)
    finally:
        shutil.rmtree(home, ignore_errors=True)
