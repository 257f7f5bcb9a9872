"""The consumer-group loops against a broker that answers nonsense (a scripted fake on a
real Unix socket, tests/client_helpers.py): a ProtocolError, never a builtin exception."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from client_helpers import FakeBroker, Peer

import equeue
import equeue.aio
from equeue.client.consumer import GroupConsumer
from equeue.client.consumer_aio import AsyncGroupConsumer
from equeue.errors import ProtocolError

GOOD_JOIN: dict[str, Any] = {"generation": 1, "assignment": [["t", 0]],
                             "heartbeat_interval_ms": 1000, "session_timeout_ms": 3000}  # fmt: skip


def broker_answering(answers: dict[str, Any]) -> FakeBroker:
    """A fake broker answering each op with ``answers[op]`` (nil for an op not listed;
    a heartbeat, unless listed, as the join)."""
    answers = {"heartbeat": answers.get("join"), **answers}

    def script(peer: Peer) -> None:
        peer.welcome()
        while True:
            request_id, op, _ = peer.recv()
            peer.send([request_id, 0, answers.get(op)])

    return FakeBroker(script)


CASES = [
    # a heartbeat answered nil: the heartbeat thread hands the error to the loop
    (
        {"join": GOOD_JOIN, "heartbeat": None, "queue_range": [0, 0], "pull": [[], 0]},
        "an assignment must be a map",
    ),
    ({"join": {"generation": "one", "assignment": []}}, "generation"),
    ({"join": {"generation": 1, "assignment": [["t", "zero"]]}}, r"\[topic, queue_id\]"),
    ({"join": {"generation": 1, "assignment": "all"}}, "generation"),
    ({"join": GOOD_JOIN, "committed_offset": "ten", "queue_range": [0, 5]}, "committed"),
    ({"join": GOOD_JOIN, "queue_range": [0]}, "queue range"),
    ({"join": GOOD_JOIN, "queue_range": [0, 9], "pull": [[["x"]], 3]}, "Message"),
]


@pytest.mark.parametrize(("answers", "match"), CASES)
def test_blocking_member_raises_protocol_error(answers: dict[str, Any], match: str) -> None:
    with broker_answering(answers) as fake, equeue.connect(fake.url, timeout=5) as client:
        with pytest.raises(ProtocolError, match=match), GroupConsumer(client, "g", "t") as c:
            c.poll(2.0)
        assert not fake.errors


@pytest.mark.parametrize(("answers", "match"), CASES)
def test_asyncio_member_raises_protocol_error(answers: dict[str, Any], match: str) -> None:
    async def main() -> None:
        client = await equeue.aio.connect(fake.url, timeout=5)
        try:
            with pytest.raises(ProtocolError, match=match):
                async with AsyncGroupConsumer(client, "g", "t") as consumer:
                    await consumer.poll(2.0)
        finally:
            await client.close()

    with broker_answering(answers) as fake:
        asyncio.run(main())
        assert not fake.errors
