"""Where a broker listens by default: a Unix socket of this name inside the store
directory (mode 0600), so a client given the store's path finds its broker."""

from __future__ import annotations

from typing import Final

DEFAULT_SOCKET_NAME: Final = "broker.sock"
