"""What the broker refuses on the wire and how (review 37b): an op above the version a
connection was welcomed with, a nack's delay_ms past one day, committed_offset of names
commit_offset refuses, a pull offset past a uint64, a send_batch message naming a topic,
and a join_id that was never the consumer's. Each over a real Unix socket, against the
store's and both clients' answers where they have one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from code_paths import code_path  # noqa: F401 - the fixture
from server_helpers import raw, short_home

from equeue.protocol.frames import encode
from equeue.server import BrokerThread

home = pytest.fixture(short_home, name="home")


@pytest.fixture
def broker(home: Path) -> Iterator[BrokerThread]:
    with BrokerThread(home / "store") as running:
        yield running


def _stored(url: str, topic: str) -> int:
    with raw(url) as c:
        if topic not in c.call("topics"):
            return 0
        queue_ids = c.call("queue_ids", topic=topic)
        return sum(c.call("queue_range", topic=topic, queue_id=q)[1] for q in queue_ids)


@pytest.mark.usefixtures("code_path")
@pytest.mark.parametrize(
    ("versions", "op", "args"),
    [
        ((1,), "send_bodies", {"topic": "t", "bodies": [b"a", b"b"]}),
        ((1,), "pull_columns", {"topic": "t", "queue_id": 0, "offset": 0}),
        ((1, 2), "pull_columns", {"topic": "t", "queue_id": 0, "offset": 0}),
    ],
)
def test_an_op_above_the_welcomed_version_closes_the_connection(
    broker: BrokerThread, versions: tuple[int, ...], op: str, args: dict[str, Any]
) -> None:
    url = broker.urls[0]
    with raw(url) as setup:
        setup.call("create_topic", topic="t", queue_count=1)
    with raw(url, versions=versions) as c, raw(url) as other:
        assert c.welcome["version"] == max(versions)
        c.send_raw(encode([1, op, args]))  # one frame a read: the C readers' path too
        error = c.closed_with()
        assert error["code"] == "ProtocolError", error
        assert f"op {op!r} is of protocol version" in error["message"], error
        assert f"welcomed with version {max(versions)}" in error["message"], error
        assert other.call("ping") is None  # that connection only
    assert _stored(url, "t") == 0


@pytest.mark.usefixtures("code_path")
def test_the_ops_of_the_welcomed_version_are_served(broker: BrokerThread) -> None:
    url = broker.urls[0]
    with raw(url) as setup:
        setup.call("create_topic", topic="t", queue_count=1)
    with raw(url, versions=(1, 2)) as c:
        assert c.welcome["version"] == 2
        columns = c.call("send_bodies", topic="t", bodies=[b"a", b"b"])
        assert columns[0] == "t" and columns[3] == [0, 1]
    with raw(url, versions=(3,)) as c:
        answer = c.call("pull_columns", topic="t", queue_id=0, offset=0)
        assert answer[0] == 2 and answer[9] == [b"a", b"b"]
