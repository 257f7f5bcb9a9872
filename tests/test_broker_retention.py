"""Retention of a broker's store from the command line: ``equeue serve STORE --retention
DURATION --max-store-bytes N --retention-respects-consumers`` (ServerConfig fields
passed into the StoreConfig the broker opens; docs/broker.md "Retention"). A CLI broker
in a subprocess removes old log chunks while a group reads on (the group's ``skipped``
stat); each setting is checked like the store's, the error naming the option."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
import time
from pathlib import Path

import pytest
from server_helpers import short_home

import equeue
from equeue import MessageStore, StoreConfig
from equeue.errors import ConfigError
from equeue.format.chunk import MIN_CHUNK_DATA_SIZE
from equeue.server import BrokerThread, ServerConfig
from equeue.server.config import parse_duration

TOPIC = "t"
home = pytest.fixture(short_home, name="home")


def log_chunks(store: Path) -> list[str]:
    return sorted(p.name for p in (store / "messages").glob("chunk-*"))


def test_a_cli_broker_with_retention_removes_old_chunks_while_a_group_reads_on(
    home: Path,
) -> None:
    store = home / "store"
    with MessageStore.open(store, StoreConfig(chunk_data_size=MIN_CHUNK_DATA_SIZE)) as created:
        created.create_topic(TOPIC, 1)  # (chunk_data_size is the store's from now on)
    broker = subprocess.Popen(
        [sys.executable, "-m", "equeue", "serve", str(store), "--quiet", "--retention", "1s"],
        stdout=subprocess.PIPE,
    )
    try:
        assert broker.stdout is not None
        assert broker.stdout.readline().startswith(b"listening on ")
        with equeue.connect(str(store)) as client:
            consumer = client.consumer("g", TOPIC, session_timeout=5.0, batch_size=8)
            try:
                assert consumer.poll(0.5) is None  # joined, nothing yet
                client.send_batch(TOPIC, [b"%05d" % i + b"." * 200 for i in range(3000)])
                first = consumer.poll(5.0)
                assert first is not None and first.queue_offset == 0
                written = len(log_chunks(store))
                assert written > 10  # ~215 chunks of 4 KiB
                # the member pauses; retention runs after the store's checkpoint (10 s)
                deadline = time.monotonic() + 60
                while client.queue_range(TOPIC, 0)[0] == 0:
                    assert time.monotonic() < deadline, "retention never ran"
                    time.sleep(0.2)
                retained = client.queue_range(TOPIC, 0)[0]
                assert len(log_chunks(store)) < written
                client.send(TOPIC, b"late")
                offsets = []
                for _ in range(5000):  # bounded: at most the 3001 messages
                    message = consumer.poll(2.0)
                    if message is None:
                        break
                    offsets.append(message.queue_offset)
                    if message.body == b"late":
                        break
                skipped = client.stats("g")["groups"]["g"]["skipped"]
            finally:
                consumer.close()
    finally:
        broker.terminate()
        broker.wait(30)
    # what it had prefetched, then on from the first retained offset to the end
    jump = next(i for i in range(1, len(offsets)) if offsets[i] != offsets[i - 1] + 1)
    assert offsets[jump] >= retained
    assert offsets[jump:] == list(range(offsets[jump], 3001))
    assert skipped[f"{TOPIC}/0"]["count"] == offsets[jump] - offsets[jump - 1] - 1


def test_the_retention_settings_reach_the_store_the_broker_opens(home: Path) -> None:
    config = ServerConfig(
        listen=(f"unix:{home}/b.sock",), retention=dt.timedelta(hours=2),
        max_store_bytes=1 << 30, retention_respects_consumers=True,
    )  # fmt: skip
    with BrokerThread(home / "s", config) as broker:
        opened = broker.store.config
        assert opened.retention == dt.timedelta(hours=2)
        assert opened.max_store_bytes == 1 << 30
        assert opened.retention_respects_consumers is True
    with BrokerThread(home / "s", listen=[f"unix:{home}/b.sock"]) as broker:  # not stored
        assert broker.store.config.retention is None
        assert broker.store.config.max_store_bytes is None


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        ({"retention": dt.timedelta(0)}, "--retention"),
        ({"retention": dt.timedelta(days=40_000)}, "--retention"),
        ({"retention": 3600}, "--retention"),
        ({"max_store_bytes": 0}, "--max-store-bytes"),
        ({"max_store_bytes": "1G"}, "--max-store-bytes"),
        ({"retention_respects_consumers": 1}, "--retention-respects-consumers"),
        ({"retention_respects_consumers": True}, "only applies with"),
    ],
)
def test_bad_retention_settings_are_refused_naming_the_option(
    settings: dict[str, object], says: str
) -> None:
    with pytest.raises(ConfigError, match=says):
        ServerConfig(**settings)  # type: ignore[arg-type]


def test_retention_beside_a_callers_handle_is_refused_not_ignored(home: Path) -> None:
    with MessageStore.open(home / "s") as handle:
        with pytest.raises(ConfigError, match="StoreConfig\\(retention="):
            BrokerThread(handle, listen=[f"unix:{home}/b.sock"], max_store_bytes=1 << 30)
        assert handle.config.max_store_bytes is None
        handle.send(TOPIC, b"still open")


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90", 90), ("90s", 90), ("1.5m", 90), ("2h", 7200), ("7d", 604800), (".5", 0.5)],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text, "--retention").total_seconds() == seconds


@pytest.mark.parametrize("text", ["", "x", "-1s", "1w", "1e3", "99999999d"])
def test_bad_durations_name_the_option(text: str) -> None:
    with pytest.raises(ConfigError, match="--retention"):
        parse_duration(text, "--retention")


def test_the_cli_refuses_a_bad_duration_before_creating_the_store(home: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "equeue", "serve", str(home / "new"), "--retention", "soon"],
        capture_output=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1, done
    assert b"--retention 'soon'" in done.stderr
    assert not (home / "new").exists()


def _status(store: Path, *json_flag: str) -> str:
    shown = subprocess.run(
        [sys.executable, "-m", "equeue", "serve", str(store), "--status", *json_flag],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    return shown.stdout


def test_status_and_stats_show_the_retention_the_running_broker_applies(home: Path) -> None:
    import json

    store = home / "store"
    options = ["--retention", "2h", "--max-store-bytes", "1073741824"]
    serve = [sys.executable, "-m", "equeue", "serve", str(store), "--quiet"]
    for given, expected, line in [
        (
            [*options, "--retention-respects-consumers"],
            {"retention_s": 7200.0, "max_store_bytes": 1 << 30, "respects_consumers": True},
            "retention: removes chunks older than 7200 s and the oldest chunks while the "
            "store is over 1073741824 bytes, once every group committed past them",
        ),
        (  # not persisted: the next start without them applies none, and says so
            [],
            {"retention_s": None, "max_store_bytes": None, "respects_consumers": False},
            "retention: none (every log chunk is kept)",
        ),
    ]:
        broker = subprocess.Popen([*serve, *given], stdout=subprocess.PIPE)
        try:
            assert broker.stdout is not None
            assert broker.stdout.readline().startswith(b"listening on ")
            with equeue.connect(str(store)) as client:
                assert client.stats()["retention"] == expected
            assert json.loads(_status(store, "--json"))["retention"] == expected
            assert line in _status(store).splitlines()
        finally:
            broker.terminate()
            broker.wait(30)


def test_stats_show_a_callers_handles_own_retention(home: Path) -> None:
    config = StoreConfig(flush="async", retention=dt.timedelta(minutes=15))
    with (
        MessageStore.open(home / "s", config) as handle,
        BrokerThread(handle, listen=[f"unix:{home}/b.sock"]) as broker,
        equeue.connect(broker.urls[0]) as client,
    ):
        assert client.stats()["retention"] == {
            "retention_s": 900.0, "max_store_bytes": None, "respects_consumers": False,
        }  # fmt: skip
