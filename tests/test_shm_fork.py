"""A client on shared rings made before a fork is refused in the child as a socket one is
(equeue/client/forks.py), and the child's copy of the rings, wake-up socket and mapping touches
nothing of the parent's: a child that runs the inherited (selector) loop neither reads the
parent's answers out of the shared answer ring nor swallows the group's wake-ups, and a child
on a loop of its own (the only one a uvloop child may run: test_client_aio_fork.py) connects on
rings of its own."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from client_helpers import BrokerProcess, temporary_broker
from test_client_aio_fork import CHILD_LOOPS, forked_sends

from equeue.client.shmconn import ShmClientTransport
from equeue.protocol import shmrings

pytestmark = pytest.mark.skipif(not shmrings.AVAILABLE, reason="needs the C accelerator, Linux")


@pytest.fixture
def broker() -> Iterator[BrokerProcess]:
    with temporary_broker("--shm") as running:
        yield running


@pytest.mark.parametrize(("kind", "child_loop"), CHILD_LOOPS)
def test_a_client_on_rings_is_closed_in_a_forked_child_and_the_parent_keeps_its_rings(
    broker: BrokerProcess, kind: str, child_loop: str
) -> None:
    forked_sends(broker.url, kind, child_loop, _on_rings, shm=True)


def _on_rings(client: Any) -> bool:
    return type(client._protocol.transport) is ShmClientTransport
