"""The broker: ``equeue serve`` / ``equeue.serve`` (docs/broker.md)."""

from equeue.server.config import ServerConfig
from equeue.server.serve import Broker, BrokerThread, serve

__all__ = ["Broker", "BrokerThread", "ServerConfig", "serve"]
