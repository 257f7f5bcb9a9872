"""Fault injection for the broker's C flusher tests (test_groupcommit_cflush.py,
test_groupcommit_errors.py)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest

from equeue.server import flushers
from equeue.store.flush import log_sync_target


def pipe_fdatasync(monkeypatch: pytest.MonkeyPatch, opened: list[int]) -> Callable[[], None]:
    """arm() makes the C flusher's next fdatasync go to a pipe (EINVAL: a real failed
    fdatasync) in place of the chunk's descriptor (the chunk stays); the pipe's read end
    is put in ``opened`` for the caller to close."""
    read_end, write_end = os.pipe()
    os.close(write_end)  # fdatasync of the read end fails all the same
    opened.append(read_end)
    armed: list[int] = []

    def target(host: Any, own: Any) -> Any:
        got = log_sync_target(host, own)
        if got is not None and armed:
            armed.clear()
            return got[0], read_end, got[2]
        return got

    monkeypatch.setattr(flushers, "log_sync_target", target)
    return lambda: armed.append(1)
