"""Clients of an equeue broker (``equeue serve``): ``equeue.connect`` (blocking,
thread-safe) and ``equeue.aio.connect`` (asyncio). docs/broker.md describes them."""

from equeue.client.sync import Client, connect
from equeue.client.url import Endpoint, parse_url

__all__ = ["Client", "Endpoint", "connect", "parse_url"]
