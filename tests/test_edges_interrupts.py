"""Interrupts at the two entries review 31 left open in the blocking client: the entry of
the function that passes the reader's turn on (``_end_turn``, ``_hand_over``) and the
entry of the socket's ``close`` in a connection's closing. A real broker; the interrupt
is raised by a trace function at the named function's entry (test_client_interrupts'
``_EntryTrap``, where CPython raises a pending SIGINT)."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator

import pytest
import test_client_interrupts as ti
from client_helpers import BrokerProcess, temporary_broker

import equeue


@pytest.fixture(scope="module")
def broker() -> Iterator[BrokerProcess]:
    with temporary_broker() as running:
        yield running


@pytest.mark.parametrize("entry", ["", "_end_turn", "_hand_over"], ids=["control", "end", "hand"])
def test_a_sleeper_is_not_left_asleep_when_the_turn_is_dropped(
    broker: BrokerProcess, entry: str
) -> None:
    """The reader (a long poll) is interrupted at the entry of the function that passes
    its turn on, while another thread sleeps waiting for its own long poll's answer: that
    one still gets its answer soon after it arrives (before: only at its deadline, the
    client's timeout of 600 s plus the wait). Control: no interrupt. The reader's answer
    comes on the test's say (a send made once the sleeper is asleep), not on a clock."""
    topic = f"u{entry}"
    client = equeue.connect(broker.url, timeout=600)
    sender = equeue.connect(broker.url, timeout=60)
    try:
        client.create_topic(topic, 2)
        outcome: list[BaseException | None] = []
        trap = ti._EntryTrap(entry or "no such function")

        def victim() -> None:
            outcome.append(trap.run(lambda: client.pull(topic, 0, 0, 1, None, 30)))

        reader = threading.Thread(target=victim, name="victim", daemon=True)
        reader.start()
        assert ti._until(lambda: client._reading)  # the victim holds the turn
        sleeper, sleeper_out = ti._polling(client, topic, 1, 1.2, "sleeper")
        assert ti._until(lambda: client._sleepers)  # asleep behind it
        sender.send(topic, b"wake", queue_id=0)  # the victim's answer, now
        reader.join(20)
        assert len(outcome) == 1
        if entry:
            assert trap.fired and isinstance(outcome[0], KeyboardInterrupt), outcome
        else:
            assert outcome == [None]
        sleeper.join(20)
        assert not sleeper.is_alive(), "the sleeper was left asleep past its answer"
        assert sleeper_out == {"sleeper": None}
        assert not client._reading and not client._sleepers
        assert topic in client.topics()
    finally:
        sender.close()
        client.close()


def _same_file(fd: int, identity: tuple[int, int]) -> bool:
    """fd still names the file it named (a number freed may be handed to another thread's
    file at once: compared by device and inode, not by the number's being open)."""
    try:
        st = os.fstat(fd)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == identity


class _InterruptedAtClose(socket.socket):
    """A first interrupt at socket.close's entry, before it does anything."""

    __slots__ = ()

    def close(self) -> None:
        raise KeyboardInterrupt("at socket.close's entry")


@pytest.mark.parametrize("interrupt", ["", "close", "twice"], ids=["control", "at-close", "twice"])
def test_a_close_interrupted_at_the_sockets_close_leaks_no_descriptor(
    broker: BrokerProcess, interrupt: str
) -> None:
    """The descriptor of a connection being closed is closed even if an interrupt lands
    at the entry of the socket's close (socket.socket.close is Python code), or a second
    one at the next Python function entered after it: before, it stayed open until the
    socket object was collected."""
    client = equeue.connect(broker.url, timeout=600)
    try:
        conn = client._conn
        assert conn is not None
        fd = conn.sock.fileno()
        st = os.fstat(fd)
        identity = (st.st_dev, st.st_ino)
        if interrupt == "twice":
            conn.sock.__class__ = _InterruptedAtClose
            trap = ti._EntryTrap("", after="close")  # the next function entered
        else:
            trap = ti._EntryTrap(interrupt or "no such function")
        try:
            failure = trap.run(lambda: client._break(conn, "broke (test)", None))
        finally:
            conn.sock.__class__ = socket.socket
        if interrupt:
            assert isinstance(failure, KeyboardInterrupt), failure
        else:
            assert failure is None
        assert conn.broken
        assert conn.sock.fileno() == -1, "the descriptor is still open"
        assert not _same_file(fd, identity)
        client.ping()  # the next call reconnects
    finally:
        client.close()
