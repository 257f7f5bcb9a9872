"""Broker(...) refuses before it opens anything, and closes what it opened when a later
step fails: a default socket path too long for sun_path leaves no store created, opened
or locked (in this process: a corrected retry and MessageStore.open work at once; from
the CLI: no files); a failure after the open closes the store it opened, never a
caller's handle (docs/broker.md)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from server_helpers import short_home

from equeue import MessageStore
from equeue.errors import ConfigError
from equeue.server import Broker, BrokerThread

home = pytest.fixture(short_home, name="home")
serve_module = importlib.import_module("equeue.server.serve")  # (equeue.server.serve: a function)


def deep(home: Path) -> Path:
    """A store path whose default unix:STORE/broker.sock is longer than 107 bytes."""
    path = home / ("a" * 60) / ("b" * 40) / "store"
    assert len(str(path / "broker.sock")) > 107
    return path


def test_a_listener_too_long_creates_no_store_and_leaves_none_locked(home: Path) -> None:
    path = deep(home)
    with pytest.raises(ConfigError, match="limited to 107 bytes"):
        BrokerThread(path)
    assert not path.exists()  # nothing created
    with BrokerThread(path, listen=[f"unix:{home}/b.sock"]) as broker:  # the retry serves
        assert broker.urls == [f"unix:{home}/b.sock"]
    with pytest.raises(ConfigError, match="limited to 107 bytes"):  # an existing store now
        Broker(path)
    MessageStore.open(path).close()  # not left open for writing by this process


def test_a_failure_after_the_open_closes_the_store_the_broker_opened(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fails() -> None:
        raise ConfigError("set-up failed after the open")

    monkeypatch.setattr(serve_module, "Counters", fails)
    with pytest.raises(ConfigError, match="set-up failed"):
        Broker(home / "s")
    MessageStore.open(home / "s").close()
    # a caller's handle stays the caller's: open after the failure
    with MessageStore.open(home / "h") as handle:
        with pytest.raises(ConfigError, match="set-up failed"):
            Broker(handle)
        assert handle.send("t", b"still open").queue_offset == 0


def test_the_cli_refuses_a_long_socket_path_before_creating_the_store(home: Path) -> None:
    path = deep(home) / "new"
    done = subprocess.run(
        [sys.executable, "-m", "equeue", "serve", str(path), "--quiet"],
        capture_output=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1, done
    assert b"limited to 107 bytes" in done.stderr
    assert not (home / ("a" * 60)).exists()  # not even the parents


@pytest.mark.parametrize("refused", [["--max-frame-bytes", "5"], ["--listen", "tcp://0.0.0.0:0"]])
def test_a_refused_start_writes_its_one_error_line_only(home: Path, refused: list[str]) -> None:
    # review 38e E9: the malloc settings' log line came first, so stderr under --json was
    # not one JSON document; the control is the same command without --json (one line too)
    for extra in (["--json"], []):
        done = subprocess.run(
            [sys.executable, "-m", "equeue", "serve", str(home / "s"), *refused, *extra],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 1, done
        lines = done.stderr.splitlines()
        assert len(lines) == 1, done.stderr
        if extra:
            assert "error" in json.loads(lines[0])
        else:
            assert lines[0].startswith("equeue: error: ")
        assert not (home / "s").exists()


@pytest.mark.parametrize("port", ["\u00b2", "\u0663", "1" * 5000, "0" * 5000 + "65536"])
def test_a_listener_port_of_non_ascii_digits_is_a_config_error(home: Path, port: str) -> None:
    # review10's isdigit() audit: "\u00b2".isdigit() is true and int() refused it with a
    # builtin ValueError; "\u0663" (int() reads 3) listened on port 3. review11 R11-7:
    # int() refuses 4,301 digits with a builtin ValueError too; a port has at most 5
    # digits past its leading zeros (round 20: those are the number's, as connect reads
    # them; "000080" was refused here and taken by connect)
    path = home / "s"
    with pytest.raises(ConfigError, match=f"port {port[:20]!r} is not a number from 0 to 65535"):
        BrokerThread(path, listen=[f"tcp://127.0.0.1:{port}"])
    assert not path.exists()
