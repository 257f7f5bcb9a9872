"""The sync client's shared connect failure: every waiting caller gets its own copy of
any equeue error (again()), and a failure is handed only to callers that queued behind
exactly that attempt, never after a later connect succeeded."""

from __future__ import annotations

import errno
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import equeue
import equeue.errors
from equeue.client.connect import again
from equeue.errors import ConnectionLostError, EQueueError, StorePathError
from equeue.protocol.faults import unpack_error
from equeue.server import BrokerThread

ERRORS = sorted(
    (c for c in vars(equeue.errors).values() if isinstance(c, type) and issubclass(c, EQueueError)),
    key=lambda c: c.__name__,
)


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="eq", dir="/tmp"))  # a socket path must be short
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("cls", ERRORS, ids=lambda c: c.__name__)
def test_again_copies_every_equeue_error_from_the_wire(cls: type[EQueueError]) -> None:
    failure = unpack_error({"code": cls.__name__, "message": "refused (the test's)"}, "here")
    assert type(failure) is cls
    cause = OSError(errno.ECONNREFUSED, "refused")
    failure.__cause__ = cause
    fresh = again(failure, [b"mine"])
    assert type(fresh) is cls and fresh is not failure
    assert str(fresh) == str(failure) and fresh.__cause__ is cause
    if isinstance(fresh, ConnectionLostError):
        assert fresh.unsent == [b"mine"]


def test_again_keeps_the_fields_of_a_locally_built_error() -> None:
    failure = StorePathError("is a symbolic link", file="/x/s")
    fresh = again(failure, [])
    assert type(fresh) is StorePathError and str(fresh) == str(failure)
    assert (fresh.file, fresh.reason) == ("/x/s", "is a symbolic link")


def test_a_failure_before_a_later_successful_connect_is_not_handed_on(base: Path) -> None:
    """T1 begins to wait for the write lock; T2's connect fails; T3's succeeds and its
    connection breaks later; T1 then gets the lock: it must try (the broker is up), not
    raise T2's stale failure. The lock order is played here in one thread: ``failed``
    read first, then what _submit does once it holds the lock."""
    store, sock = base / "s", f"unix:{base}/b.sock"
    broker = BrokerThread(store, listen=[sock]).start()
    client = equeue.connect(broker.urls[0], connect_timeout=0.2)
    try:
        client.send("t", b"one")
        t1_failed = client._failed[0]  # T1 reads it, then waits for the lock
        broker.stop()
        with pytest.raises(ConnectionLostError):  # T2: the connect fails
            client.send("t", b"lost")
        broker = BrokerThread(store, listen=[sock]).start()
        client.send("t", b"two")  # T3: connects
        broker.stop()  # ... and that connection breaks
        broker = BrokerThread(store, listen=[sock]).start()
        with client._write_lock:  # T1 has the lock at last: the broker is up
            conn = client._connection(t1_failed)
        assert conn is client._conn and not conn.broken
        assert client.send("t", b"three").queue_offset == 2
    finally:
        client.close()
        broker.stop()


def test_callers_queued_behind_a_failed_connect_get_its_failure(base: Path) -> None:
    """Control: a caller that queued behind exactly the attempt that failed gets that
    failure without a connect_timeout of its own."""
    store, sock = base / "s", f"unix:{base}/b.sock"
    broker = BrokerThread(store, listen=[sock]).start()
    client = equeue.connect(broker.urls[0], connect_timeout=0.2)
    try:
        client.send("t", b"one")
        queued = client._failed[0]
        broker.stop()
        with pytest.raises(ConnectionLostError) as first:
            client.send("t", b"lost")
        with client._write_lock, pytest.raises(ConnectionLostError) as second:
            client._connection(queued)
        assert str(second.value) == str(first.value) and second.value is not first.value
    finally:
        client.close()
        broker.stop()
