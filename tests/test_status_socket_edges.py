"""STORE/status.sock's edges (reviewl L3, L5, L6): a ``--listen unix:`` on the status
socket's own path refused for what it is; a broker listening on TCP only that still
starts, with a warning, where status.sock cannot be bound; ``--status-group G`` says
when G has nothing to show."""

from __future__ import annotations

import errno
import logging
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from server_helpers import short_home

import equeue
from equeue import MessageStore
from equeue.errors import ConfigError
from equeue.server import BrokerThread

home = pytest.fixture(short_home, name="home")
REAL_BIND = socket.socket.bind


def test_listening_on_the_status_sockets_path_is_refused_naming_it(home: Path) -> None:
    MessageStore.open(home / "s").close()
    with (
        pytest.raises(ConfigError, match="is the broker's status socket") as refused,
        BrokerThread(home / "s", listen=[f"unix:{home / 's' / 'status.sock'}"]),
    ):
        pass
    assert "another process" not in str(refused.value)
    assert f"unix:{home / 's' / 'broker.sock'}" in str(refused.value)
    assert not (home / "s" / "status.sock").exists()


def test_a_tcp_broker_starts_without_a_status_socket_it_cannot_bind(
    home: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def bind(sock: socket.socket, address: Any) -> None:
        if isinstance(address, str) and address.endswith("status.sock"):
            raise OSError(errno.EPERM, "Operation not permitted")
        REAL_BIND(sock, address)

    MessageStore.open(home / "s").close()
    monkeypatch.setattr(socket.socket, "bind", bind)
    with (
        caplog.at_level(logging.WARNING),
        BrokerThread(home / "s", listen=["tcp://127.0.0.1:0"]) as running,
        equeue.connect(running.urls[0]) as client,
    ):
        assert client.topics() == []
        assert not (home / "s" / "status.sock").exists()
    (warning,) = [r.getMessage() for r in caplog.records if "no status socket" in r.getMessage()]
    assert str(home / "s" / "status.sock") in warning and "Operation not permitted" in warning


def test_a_file_at_the_status_sockets_path_still_refuses_the_start(home: Path) -> None:
    MessageStore.open(home / "s").close()
    (home / "s" / "status.sock").write_text("kept")
    with (
        pytest.raises(ConfigError, match="remove it"),
        BrokerThread(home / "s", listen=["tcp://127.0.0.1:0"]),
    ):
        pass
    assert (home / "s" / "status.sock").read_text() == "kept"


@pytest.mark.parametrize("deleted", [True, False])
def test_status_group_names_a_group_with_nothing_to_show(home: Path, deleted: bool) -> None:
    with MessageStore.open(home / "s") as store:
        store.create_topic("t", 1)
        store.send("t", b"x")
        store.commit_offset("g", "t", 0, 1)
    with BrokerThread(home / "s") as running:
        asked = "g" if deleted else "nobody"
        if deleted:
            with equeue.connect(running.urls[0]) as client:
                client.delete_group("g")
        command = [sys.executable, "-m", "equeue", "serve", str(home / "s"), "--status"]
        shown = subprocess.run(
            [*command, "--status-group", asked], capture_output=True, text=True, timeout=60
        )
        assert shown.returncode == 0, shown.stderr
        assert f"group {asked}: no committed offset, no member" in shown.stdout
        with equeue.connect(running.urls[0]) as client:
            client.commit_offset("h", "t", 0, 1)
        shown = subprocess.run(
            [*command, "--status-group", "h"], capture_output=True, text=True, timeout=60
        )
        assert "group h: lag 0" in shown.stdout and "no committed offset" not in shown.stdout
