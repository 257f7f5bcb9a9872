"""A client on shared rings made before a fork is refused in the child as a socket one is
(equeue/client/forks.py), and the child's copy of the rings, eventfds and mapping touches
nothing of the parent's: a child that runs the inherited loop neither reads the parent's
answers out of the shared answer ring nor swallows the group's wake-ups."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest
from client_helpers import BrokerProcess, temporary_broker
from test_client_aio_fork import SENDS, TASKS, _new_loop, _refused, _sends

import equeue
import equeue.aio
from equeue.client.shmconn import ShmClientTransport
from equeue.protocol import shmrings

pytestmark = pytest.mark.skipif(not shmrings.AVAILABLE, reason="needs the C accelerator, Linux")


@pytest.fixture
def broker() -> Iterator[BrokerProcess]:
    with temporary_broker("--shm") as running:
        yield running


@pytest.mark.parametrize("kind", ["selector", "uvloop"])
def test_a_client_on_rings_is_closed_in_a_forked_child_and_the_parent_keeps_its_rings(
    broker: BrokerProcess, kind: str
) -> None:
    checker = equeue.connect(broker.url)
    checker.create_topic("t", queue_count=4)
    loop = _new_loop(kind)
    try:
        client = loop.run_until_complete(equeue.aio.connect(broker.url, timeout=20.0, shm=True))
        assert type(client._protocol.transport) is ShmClientTransport  # type: ignore[union-attr]
        loop.run_until_complete(client.send("t", b"warm"))
        pid = os.fork()
        if pid == 0:  # the child: the inherited loop, client and rings
            code = 3
            try:
                signal.alarm(60)
                refused = loop.run_until_complete(_refused(client))
                code = 0 if refused == TASKS * SENDS else 1
            finally:
                os._exit(code)
        sent = loop.run_until_complete(_sends(client, b"parent"))
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the child's sends were not all refused"
        assert len(sent) == TASKS * SENDS
        wrong = [(mid, body) for mid, body in sent if checker.get(mid).body != body]
        assert wrong == []
        assert loop.run_until_complete(client.send("t", b"after")).topic == "t"
        loop.run_until_complete(client.close())
    finally:
        loop.close()
        checker.close()
