"""The asyncio client of an equeue broker: ``client = await equeue.aio.connect(url)``."""

from equeue.client.aio import AsyncClient, connect

__all__ = ["AsyncClient", "connect"]
