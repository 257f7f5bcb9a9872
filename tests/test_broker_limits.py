"""The broker's bounds on what a client may hold or make (review g F3-F6): TLS
connections counted from their accept, the process's file limit against
max_connections, no token in a log line or an answer, and limits on the groups and
topics clients create. Real brokers: a BrokerThread, or `equeue serve` in a subprocess
where a resource limit of its own is needed."""

from __future__ import annotations

import errno
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from server_helpers import Raw, raw, short_home
from test_server_auth import TOKEN, _self_signed, token_file

import equeue
from equeue import MessageStore, StoreConfig
from equeue.errors import ConfigError, LimitExceededError, StoreReadError
from equeue.protocol.frames import encode
from equeue.server import BrokerThread
from equeue.server.config import EventLoop
from equeue.server.tlsaccept import MAX_REFUSALS_IN_HANDSHAKE

home = pytest.fixture(short_home, name="home")
WAIT_S = 20.0  # the most a test waits for the broker to act (it acts within ~2 s)


def _closed_by_the_broker(sock: socket.socket) -> bool:
    """Whether the broker closed (or reset) sock within WAIT_S; False if it stayed open."""
    sock.settimeout(WAIT_S)
    try:
        return sock.recv(1 << 16) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


class _Tls(NamedTuple):
    running: BrokerThread
    url: str
    port: int
    cert: Path  # the certificate to trust


@contextmanager
def _tls_broker(home: Path, **settings: Any) -> Iterator[_Tls]:
    """A broker on one tls:// listener."""
    cert, key = _self_signed(home)
    with BrokerThread(
        home / "s", listen=["tls://127.0.0.1:0"], tls_cert=str(cert), tls_key=str(key),
        **settings,
    ) as running:  # fmt: skip
        (url,) = running.urls
        yield _Tls(running, url, int(url.rsplit(":", 1)[1]), cert)


def _wait_until(done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not done() and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.mark.parametrize("event_loop", ["uvloop", "asyncio"])
def test_tls_connections_count_from_their_accept_and_a_stalled_one_makes_room(
    home: Path, event_loop: EventLoop
) -> None:
    with _tls_broker(
        home, max_connections=3, hello_timeout_ms=60_000, event_loop=event_loop
    ) as tls:
        # Three peers that connect and never start (or finish) their TLS handshake.
        stalled = [socket.create_connection(("127.0.0.1", tls.port), WAIT_S) for _ in range(3)]
        stalled[1].sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")  # half a ClientHello
        _wait_until(lambda: len(tls.running.broker.connections) >= 3)
        assert len(tls.running.broker.connections) == 3  # counted while in their handshake
        time.sleep(1.1)  # (admission.EVICT_AFTER_S: the silent become evictable)
        # The broker is full of them: a client with a handshake and a hello takes the
        # place of the one silent longest (before: they were not counted, nor bounded).
        with equeue.connect(tls.url, cafile=tls.cert, connect_timeout=WAIT_S) as client:
            client.ping()
            assert client.stats()["connections"] == 3
        assert _closed_by_the_broker(stalled[0])
        for sock in stalled:
            sock.close()


def test_a_tls_handshake_is_bounded_by_the_hello_timeout(home: Path) -> None:
    with (
        _tls_broker(home, hello_timeout_ms=500) as tls,
        socket.create_connection(("127.0.0.1", tls.port), WAIT_S) as stalled,
    ):
        assert _closed_by_the_broker(stalled)  # (before: asyncio's own 60 s handshake timeout)
        _wait_until(lambda: not tls.running.broker.connections)
        assert tls.running.broker.connections == set()


def test_a_full_broker_still_tells_a_tls_client_why(home: Path) -> None:
    with (
        _tls_broker(home, max_connections=1) as tls,
        equeue.connect(tls.url, cafile=tls.cert) as first,
    ):
        with pytest.raises(LimitExceededError, match="max_connections=1"):
            equeue.connect(tls.url, cafile=tls.cert, connect_timeout=WAIT_S)
        first.ping()  # (the refusal came through TLS: the client read it)


def test_refusals_in_their_tls_handshake_are_bounded(home: Path) -> None:
    with (
        _tls_broker(home, max_connections=1, hello_timeout_ms=60_000) as tls,
        equeue.connect(tls.url, cafile=tls.cert) as first,  # (welcomed: not evictable)
    ):
        count = MAX_REFUSALS_IN_HANDSHAKE + 4
        refused = [socket.create_connection(("127.0.0.1", tls.port), WAIT_S) for _ in range(count)]
        # the first 16 wait in their handshake for the refusal; the others are closed
        closed = [
            sock for sock in refused[MAX_REFUSALS_IN_HANDSHAKE:] if _closed_by_the_broker(sock)
        ]
        assert len(closed) == 4
        assert tls.running.broker.tls_refusals == MAX_REFUSALS_IN_HANDSHAKE
        first.ping()
        for sock in refused:
            sock.close()
        _wait_until(lambda: not tls.running.broker.tls_refusals)
        assert tls.running.broker.tls_refusals == 0


def test_a_hello_sent_twice_is_refused_without_quoting_its_token(
    home: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with BrokerThread(home / "s", token_file=str(token_file(home))) as running:
        hello = encode({"versions": [1], "token": TOKEN, "client": "replayed"})
        with raw(running.urls[0], token=TOKEN) as client:
            client.send_raw(hello)  # a client library bug, a proxy replaying
            error = client.closed_with()
        assert error["code"] == "ProtocolError"
        assert "'token': str" in error["message"]  # its keys and types are said
        assert TOKEN not in error["message"]
        refused = [r.getMessage() for r in caplog.records if "a request must be" in r.getMessage()]
        assert len(refused) == 1 and TOKEN not in refused[0], refused
        # a map anywhere in a request of the wrong shape
        with raw(running.urls[0], token=TOKEN) as client:
            client.send_raw(encode([0, "hello", {"token": TOKEN}]))
            assert TOKEN not in client.closed_with()["message"]
    assert not [r for r in caplog.records if TOKEN in r.getMessage()]


@pytest.mark.parametrize(
    "body",
    [
        [2, TOKEN, {}],
        [TOKEN, "ping", {}],
        [3, "ping", {"a": 1}, TOKEN],
        [[TOKEN], "ping", {}],
        TOKEN,
    ],
    ids=["as-op", "as-id", "an-extra-item", "in-a-list", "alone"],
)
def test_a_token_sent_where_a_request_goes_is_not_quoted(
    home: Path, caplog: pytest.LogCaptureFixture, body: Any
) -> None:
    """The token where an op or a request id goes, or anywhere in a list (review4 R7):
    the connection's error and the broker's log lines say types (and a map's keys), not
    the token."""
    with (
        BrokerThread(home / "s", token_file=str(token_file(home))) as running,
        raw(running.urls[0], token=TOKEN) as client,
    ):
        client.send_raw(encode(body))
        error = client.closed_with()
    assert error["code"] == "ProtocolError", error
    assert TOKEN not in error["message"], error
    assert not [r.getMessage() for r in caplog.records if TOKEN in r.getMessage()]
    if body[0] == 2:
        assert error["message"].endswith("unknown op (a string of 12 characters)"), error
    elif body[1] == "ping":
        assert " items [" in error["message"], error  # what the items are is said


def test_groups_are_limited_by_max_groups_and_a_refused_join_makes_nothing(home: Path) -> None:
    with BrokerThread(home / "s", max_groups=2) as running, raw(running.urls[0]) as client:
        client.call("create_topic", topic="t", queue_count=1)
        for group in ("g1", "g2"):
            client.call("join", group=group, consumer="c", topics=["t"])
        before = client.call("topics")
        error = client.error("join", group="g3", consumer="c", topics=["t"])
        assert error["code"] == "LimitExceededError"
        assert "max_groups=2" in error["message"] and "--max-groups" in error["message"]
        assert client.call("topics") == before  # no retry topic for g3
        client.call("join", group="g1", consumer="other", topics=["t"])  # a known group
        client.call("leave", group="g2", consumer="c")
    # a group's retry topic stays: the store's count survives a restart
    with BrokerThread(home / "s", max_groups=2) as running, raw(running.urls[0]) as client:
        assert client.error("join", group="g4", consumer="c", topics=["t"])["code"] == (
            "LimitExceededError"
        )
        client.call("join", group="g2", consumer="c", topics=["t"])
    with BrokerThread(home / "s", max_groups=3) as running, raw(running.urls[0]) as client:
        client.call("join", group="g4", consumer="c", topics=["t"])


def test_topics_are_limited_by_max_topics_and_a_refused_send_stores_nothing(home: Path) -> None:
    with BrokerThread(home / "s", max_topics=2) as running, raw(running.urls[0]) as client:
        client.call("create_topic", topic="a", queue_count=1)
        client.call("send", topic="b", body=b"made on first use")
        client.call("create_topic", topic="a", queue_count=2)  # grows a topic it has
        for op, args in (
            ("create_topic", {"topic": "c", "queue_count": 1}),
            ("send", {"topic": "c", "body": b"x"}),
            ("send_batch", {"topic": "c", "messages": [{"body": b"x"}]}),
        ):
            error = client.error(op, **args)
            assert error["code"] == "LimitExceededError", (op, error)
            assert "max_topics=2" in error["message"] and "--max-topics" in error["message"]
        # the broker's own topics are not counted: a group's retry topic is still made
        client.call("join", group="g", consumer="c", topics=["a"])
        assert client.call("topics") == ["a", "b", "equeue.retry.g"]
        assert client.call("send", topic="b", body=b"still")[1] == "b"


def test_max_topics_with_a_handle_is_refused(home: Path) -> None:
    with MessageStore.open(home / "s") as store, pytest.raises(ConfigError, match="max_topics"):
        BrokerThread(store, max_topics=5)
    with MessageStore.open(home / "s", StoreConfig(max_topics=1)) as store:
        store.create_topic("a", 1)
        with pytest.raises(LimitExceededError, match=r"StoreConfig\.max_topics"):
            store.send("b", b"x")
        assert store.topics() == ["a"]


def _nofile(soft: int, hard: int) -> Callable[[], None]:
    def limit() -> None:  # in the child, before exec
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    return limit


def _serve(store: Path, soft: int, hard: int, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "equeue", "serve", str(store), "--quiet",
         "--listen", "tcp://127.0.0.1:0", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=_nofile(soft, hard),
    )  # fmt: skip


def _url(broker: subprocess.Popen[str]) -> str:
    assert broker.stdout is not None
    line = broker.stdout.readline()
    assert line.startswith("listening on "), (line, broker.stderr.read() if broker.stderr else "")
    return line.split()[-1]


def _refused(broker: subprocess.Popen[str]) -> str:
    try:
        _, err = broker.communicate(timeout=60)
    finally:
        broker.kill()
    assert broker.returncode != 0
    return err


def test_max_connections_asked_for_past_the_open_file_limit_is_refused_at_start(
    home: Path,
) -> None:
    err = _refused(_serve(home / "s", 512, 512, "--max-connections", "1000"))
    assert "--max-connections" in err and "RLIMIT_NOFILE=512" in err, err
    assert "lower --max-connections to 191" in err, err  # 512 - 256 - 1 - 64
    assert not (home / "s").exists()  # refused before the store was made
    # a limit with no room for one connection beside the store's files: never "lower to 0"
    err = _refused(_serve(home / "s", 300, 300, "--max-connections", "20"))
    assert "leaves no room for a connection" in err and "at least 322" in err, err
    assert "lower --max-connections" not in err, err


def test_the_default_max_connections_is_lowered_to_what_fits(home: Path) -> None:
    # review4 R2: with a hard limit of 1024 (a container's --ulimit nofile=1024:1024) the
    # default 1024 connections cannot fit beside the store's files: equeue serve must still
    # start (it did before the check), with the connections the limit holds, and say so
    broker = subprocess.Popen(
        [sys.executable, "-m", "equeue", "serve", str(home / "s"),
         "--listen", "tcp://127.0.0.1:0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=_nofile(512, 512),
    )  # fmt: skip
    try:
        url = _url(broker)
        with raw(url) as client:
            assert client.welcome["limits"]["max_connections"] == 191
            client.call("ping")
    finally:
        broker.terminate()
        _, err = broker.communicate(timeout=60)
    assert "max_connections lowered from its default 1024 to 191" in err, err


def test_the_soft_open_file_limit_is_raised_to_the_hard_one(home: Path) -> None:
    broker = _serve(home / "s", 256, 4096)
    try:
        url = _url(broker)
        limits = Path(f"/proc/{broker.pid}/limits").read_text()
        (line,) = [x for x in limits.splitlines() if x.startswith("Max open files")]
        assert line.split()[3:5] == ["4096", "4096"], line
        with raw(url) as client:
            client.call("ping")
    finally:
        broker.terminate()
        broker.wait(60)


def test_connections_up_to_the_limit_leave_the_store_its_files(home: Path) -> None:
    broker = _serve(home / "s", 512, 512, "--max-connections", "150")
    clients: list[Raw] = []
    try:
        url = _url(broker)
        old = Raw(url)
        clients = [Raw(url) for _ in range(149)]
        refused = Raw(url, hello=False)
        clients.append(refused)
        error = refused.closed_with()  # answered, not reset: the broker had an fd for it
        assert error["code"] == "LimitExceededError" and "max_connections=150" in error["message"]
        # sends that open new queues (3 files each) still work
        for n in range(20):
            assert old.call("send", topic=f"t{n}", body=b"x")[1] == f"t{n}"
    finally:
        for client in clients:
            client.close()
        broker.terminate()
        broker.wait(60)


_EMFILE_CHILD = """
import os, resource, sys
from equeue import MessageStore
from equeue.errors import EQueueError
MessageStore.open(sys.argv[1]).close()
# What a create_topic that failed half-way (at EMFILE) leaves: the queue's directory.
os.makedirs(os.path.join(sys.argv[1], "queues", "new", "0"))
store = MessageStore.open(sys.argv[1])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (8, hard))  # every new open fails
for attempt in range(2):
    try:
        store.send("new", b"refused", queue_id=0)
        print("stored")
    except EQueueError as exc:
        print(type(exc).__name__, exc.errno, exc)
    except OSError as exc:
        print("builtin", type(exc).__name__, exc)
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
store.send("new", b"after", queue_id=0)
print("count", store.queue_range("new", 0)[1])
store.close()
"""


def test_a_queue_that_cannot_be_opened_is_a_store_error_naming_its_files(home: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _EMFILE_CHILD, str(home / "s")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1] == "count 1", lines  # the refused sends stored nothing
    refused = lines[:-1]
    assert len(refused) == 2, refused
    for line in refused:  # before: "builtin OSError [Errno 24] Too many open files"
        assert line.startswith("StoreWriteError 24 ") and "queues/new/0" in line, line
        assert "ulimit -n" in line, line  # the setting that changes the limit


def test_records_retries_a_chunk_open_that_retention_raced(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # review4 R6: a read-only chunk open that lost a race with a writer's retention is
    # StoreReadError(ENOENT) since F4 wrapped it; equeue records retries it as it retried
    # the FileNotFoundError it was before (and still fails on any other errno)
    from equeue.inspect import records
    from equeue.inspect.layout import open_store as open_files

    with MessageStore.open(home / "s") as store:
        store.create_topic("t", 1)
        store.send("t", b"kept")
    real = records.ChunkManager  # type: ignore[attr-defined]
    failures = [errno.ENOENT]

    def racing(*args: Any, **kwargs: Any) -> Any:
        if failures:
            raise StoreReadError(failures.pop(), "opening the chunk files failed (race)")
        return real(*args, **kwargs)

    monkeypatch.setattr(records, "ChunkManager", racing)
    source = records.RecordSource(open_files(home / "s"))
    try:
        bodies = [r.message.body for r in source.from_position(0, records.Filters())]
        assert bodies == [b"kept"]
        failures.append(errno.EACCES)  # anything else is not retried
        source.close()
        source = records.RecordSource(open_files(home / "s"))
        with pytest.raises(StoreReadError, match="race"):
            list(source.from_position(0, records.Filters()))
    finally:
        source.close()
