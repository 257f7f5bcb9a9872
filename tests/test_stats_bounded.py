"""``stats`` bounded by ``stats_max_listed``, not by groups, queues or members (reviewg
F11), and one group's detail behind protocol version 5's ``group`` argument."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from server_helpers import Raw, raw, short_home

import equeue
import equeue.aio
from equeue.server import BrokerThread
from equeue.server.status import render_stats

home = pytest.fixture(short_home, name="home")

LISTED = 3
QUEUES = 8


@pytest.fixture(name="running")
def _running(home: Path) -> Iterator[BrokerThread]:
    with BrokerThread(home / "s", stats_max_listed=LISTED) as running:
        running.store.create_topic("t", QUEUES)
        for queue_id in range(QUEUES):
            for _ in range(10):
                running.store.send("t", b"m", queue_id=queue_id)
        yield running


def _commit_groups(c: Raw, first: int, count: int) -> None:
    """Groups g<n> committed on every queue; g<n> is n messages short on queue 0."""
    for n in range(first, first + count):
        for queue_id in range(QUEUES):
            offset = 10 - n if queue_id == 0 else 10
            c.call("commit_offset", group=f"g{n:03d}", topic="t", queue_id=queue_id, offset=offset)


def test_the_summary_lists_the_groups_with_most_lag_and_counts_the_rest(
    running: BrokerThread,
) -> None:
    with raw(running.urls[0]) as c:
        _commit_groups(c, 1, 6)
        small = c.call("stats")
        _commit_groups(c, 7, 3)  # more lag than any before (g007 to g009; g010 is whole)
        for n in range(4):  # live groups: a member each, no commit
            c.call("join", group=f"live{n}", consumer="m", topics=["t"], session_timeout_ms=60_000)
        stats = c.call("stats")
    assert small["groups"] == {
        f"g{n:03d}": {"lag": n, "queue_count": QUEUES, "skipped_count": 0} for n in (6, 5, 4)
    }
    assert small["groups_omitted"] == 3
    assert list(stats["groups"]) == ["g009", "g008", "g007"]  # the most lag first
    assert stats["groups_omitted"] == 6
    # the live groups, in a few numbers each: none has a commit (lag 0), by name
    assert sorted(stats["coordinator"]) == ["live0", "live1", "live2"]
    assert stats["coordinator"]["live0"] == {
        "generation": 1, "topics": ["t"], "member_count": 1,
        "queue_count": QUEUES + 1,  # (and its retry topic's)
    }  # fmt: skip
    assert stats["coordinator_omitted"] == 1
    # more groups, not a larger answer (before: every group's every queue, 8.2 MB at
    # 4,236 groups of 64 queues)
    assert len(msgpack.packb(stats["groups"])) == len(msgpack.packb(small["groups"]))
    text = render_stats(stats)
    assert "group g009: lag 9 over 8 queues" in text
    assert "6 more groups and 1 more groups with members not listed" in text
    assert "t/0: committed" not in text


def test_one_groups_detail_with_version_5s_argument(running: BrokerThread) -> None:
    with raw(running.urls[0]) as c:
        _commit_groups(c, 1, 5)
        c.call("join", group="g002", consumer="m", topics=["t"], session_timeout_ms=60_000)
        stats = c.call("stats", group="g002")
        none = c.call("stats", group="nobody")
        assert c.error("stats", group="")["code"] == "InvalidMessageError"
        assert c.call("ping") is None  # (an answered refusal: the connection stays)
    assert list(stats["groups"]) == ["g002"] and list(stats["coordinator"]) == ["g002"]
    group = stats["groups"]["g002"]
    assert group["lag"] == 2 and len(group["queues"]) == QUEUES
    assert group["queues"]["t/0"] == {"committed": 8, "end": 10, "lag": 2}
    live = stats["coordinator"]["g002"]
    held = [["equeue.retry.g002", 0]] + [["t", q] for q in range(QUEUES)]
    assert sorted(live["members"]["m"]["queues"]) == held
    assert live["lag"]["t/0"] == 2 and len(live["assignment"]) == QUEUES + 1
    assert "groups_omitted" not in stats and stats["connections"] == 1  # and the rest
    assert (none["groups"], none["coordinator"]) == ({}, {})
    assert "  t/0: committed 8 end 10 lag 2" in render_stats(stats)


def test_a_connection_welcomed_with_4_may_not_send_the_argument(running: BrokerThread) -> None:
    with raw(running.urls[0], versions=(1, 2, 3, 4)) as old:
        assert "groups" in old.call("stats")
        old.request("stats", group="g")
        error = old.closed_with()
    assert error["code"] == "ProtocolError"
    assert "'group' is of protocol version 5" in error["message"]
    assert "welcomed with version 4" in error["message"]


@pytest.mark.parametrize("welcomed", [(1, 2, 3, 4), (1, 2, 3, 4, 5)])
def test_the_clients_ask_one_group_of_either_broker(
    running: BrokerThread, welcomed: tuple[int, ...]
) -> None:
    """Welcomed with 4, the clients send a plain stats (the broker closes a connection
    that sends 'group') and keep the group asked for."""
    running.broker.welcome_versions = welcomed
    with raw(running.urls[0]) as c:
        _commit_groups(c, 1, 2)
    with equeue.connect(running.urls[0]) as client:
        assert client.welcome is not None and client.welcome.version == welcomed[-1]
        stats = client.stats("g001")
        client.ping()  # (the connection stayed)
    assert list(stats["groups"]) == ["g001"] and stats["groups"]["g001"]["lag"] == 1
    assert "groups_omitted" not in stats


def test_the_asyncio_client_asks_one_group(running: BrokerThread) -> None:
    with raw(running.urls[0]) as c:
        _commit_groups(c, 1, 2)

    async def ask() -> tuple[dict[str, Any], dict[str, Any]]:
        client = await equeue.aio.connect(running.urls[0])
        try:
            return await client.stats("g002"), await client.stats()
        finally:
            await client.close()

    stats, summary = asyncio.run(ask())
    assert stats["groups"]["g002"]["queues"]["t/0"]["lag"] == 2
    assert summary["groups"]["g002"] == {"lag": 2, "queue_count": QUEUES, "skipped_count": 0}
