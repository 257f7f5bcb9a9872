"""The broker's ``delete_group`` (protocol version 5, equeue/server/groupdelete.py)
through both clients and a raw connection, and ``equeue delete-group``: refused while
the group has a live member; an expired member's held pull answered at once; joins
refused while the deletion runs; the made-up group's retention pin (reviewg F17) ended
with retention running underneath; a client welcomed with version 4 refuses the call
itself; the CLI refuses a served store."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import time
from pathlib import Path

import pytest
from server_helpers import raw, short_home

import equeue
import equeue.aio
from equeue import MessageStore, StoreConfig
from equeue.cli import main
from equeue.client.consumer import GroupConsumer
from equeue.errors import BrokerTooOldError, GroupError, GroupNotFoundError
from equeue.format.chunk import MIN_CHUNK_DATA_SIZE
from equeue.server import BrokerThread, retry
from equeue.server.groups import GroupCoordinator

RETRY = retry.retry_topic("g")
DEADLINE_S = 30.0


home = pytest.fixture(short_home, name="home")


def _store(home: Path) -> Path:
    with MessageStore.open(home / "s") as store:
        store.create_topic("t", 2)
        for i in range(6):
            store.send("t", b"m%d" % i, queue_id=i % 2)
    return home / "s"


def test_a_group_with_a_live_member_is_refused_then_deleted_once_it_left(home: Path) -> None:
    with BrokerThread(_store(home)) as running, equeue.connect(running.urls[0]) as client:
        consumer = GroupConsumer(client, "g", ["t"], session_timeout=10.0)
        got = [consumer.poll(5.0) for _ in range(6)]
        assert all(m is not None for m in got)
        consumer.commit()
        with pytest.raises(GroupError, match="1 live member") as refused:
            client.delete_group("g")
        assert "stop its consumers" in str(refused.value)
        assert client.committed_offset("g", "t", 0) == 3  # the refusal changed nothing
        assert RETRY in client.topics()
        consumer.close()  # leaves at once
        deleted = client.delete_group("g")
        assert (deleted.group, deleted.topics) == ("g", (RETRY,))
        assert deleted.offsets in (2, 3)  # t/0, t/1 and (if committed there) its retry queue
        assert client.committed_offset("g", "t", 0) is None
        assert RETRY not in client.topics()
        with pytest.raises(GroupNotFoundError):
            client.delete_group("g")
        # made again: from the start, with a retry topic of its own
        again = GroupConsumer(client, "g", ["t"], session_timeout=10.0)
        assert len([again.poll(5.0) for _ in range(6)]) == 6
        again.close()
        assert RETRY in client.topics()
        assert client.committed_offset("g", "t", 0) == 3


def test_an_expired_members_held_pull_is_answered_by_the_deletion(home: Path) -> None:
    """A member that stopped heartbeating is expired (no live member: the deletion goes
    ahead) but its long poll stays held until its wait ends: the deletion answers it,
    with the GroupError of its ownership check."""
    with BrokerThread(_store(home)) as running, raw(running.urls[0]) as member:
        joined = member.call("join", group="g", consumer="c", topics=["t"], session_timeout_ms=200)
        # a queue of t (its retry topic's pulls are answered by that topic's deletion)
        queue = next(q for q in joined["assignment"] if q[0] == "t")
        rid = member.request(
            "pull", topic=queue[0], queue_id=queue[1], offset=3, wait_ms=60_000,
            group="g", consumer="c", join_id=joined["join_id"],
        )  # fmt: skip
        with raw(running.urls[0]) as operator:
            deadline = time.monotonic() + DEADLINE_S
            while operator.call("stats")["coordinator"].get("g"):
                assert time.monotonic() < deadline, "the member never expired"
                time.sleep(0.05)
            assert operator.call("stats")["held_pulls"] == 1
            started = time.monotonic()
            result = operator.call("delete_group", group="g")
            assert result == {"group": "g", "offsets": 0, "topics": [RETRY]}
            answered = member.answers(1)
            assert time.monotonic() - started < DEADLINE_S
            status, error = answered[rid]
            assert status == 1 and error["code"] == "GroupError", error
            assert operator.call("stats")["held_pulls"] == 0


def test_joins_are_refused_while_the_group_is_being_deleted(tmp_path: Path) -> None:
    with MessageStore.open(tmp_path / "s") as store:
        store.create_topic("t", 1)
        coord = GroupCoordinator(store)
        coord.deleting.add("g")
        with pytest.raises(GroupError, match="being deleted"):
            coord.join("g", "a", ["t"])
        assert RETRY not in store.topics()  # nothing made
        coord.deleting.discard("g")
        coord.join("g", "a", ["t"])
        assert coord.live_members("g") == ["a"]


def test_a_client_welcomed_with_version_4_refuses_delete_group(home: Path) -> None:
    with BrokerThread(_store(home)) as running:
        running.broker.welcome_versions = (1, 2, 3, 4)
        with equeue.connect(running.urls[0]) as client:
            client.commit_offset("g", "t", 0, 1)
            with pytest.raises(BrokerTooOldError, match=r"protocol version 4; delete_group is of"):
                client.delete_group("g")
            assert client.committed_offset("g", "t", 0) == 1
        with raw(running.urls[0], versions=(1, 2, 3, 4)) as old:
            old.request("delete_group", group="g")
            assert "version 5" in old.closed_with()["message"]


def test_the_asyncio_client_deletes_a_group(home: Path) -> None:
    with BrokerThread(_store(home)) as running:
        running.store.create_topic(retry.dead_letter_topic("g"), 1)  # (the broker's own)

        async def scenario() -> None:
            client = await equeue.aio.connect(running.urls[0])
            try:
                await client.commit_offset("g", "t", 1, 2)
                deleted = await client.delete_group("g", delete_dead_letters=True)
                assert deleted.offsets == 1
                assert deleted.topics == (retry.dead_letter_topic("g"),)
                assert await client.committed_offset("g", "t", 1) is None
                with pytest.raises(GroupNotFoundError):
                    await client.delete_group("g")
            finally:
                await client.close()

        asyncio.run(scenario())


def test_the_made_up_groups_pin_ends_with_its_deletion_while_retention_runs(home: Path) -> None:
    """reviewg F17's probe, with the store's service running retention every 200 ms."""
    config = StoreConfig(
        chunk_data_size=MIN_CHUNK_DATA_SIZE,
        retention=dt.timedelta(seconds=1),
        retention_respects_consumers=True,
        flush_interval_ms=100,
        flush_thorough_interval_ms=200,
    )
    store = MessageStore.open(home / "s", config)
    store.create_topic("t", 1)
    with BrokerThread(store) as running, equeue.connect(running.urls[0]) as client:
        client.commit_offset("nobody-consumes", "t", 0, 0)
        for _ in range(300):
            client.send("t", b"r" * 200)
        deadline = time.monotonic() + DEADLINE_S
        while client.stats().get("retention_held", {}).get("group") != "nobody-consumes":
            assert time.monotonic() < deadline, client.stats().get("retention_held")
            time.sleep(0.1)
        assert client.queue_range("t", 0)[0] == 0
        assert client.delete_group("nobody-consumes").offsets == 1
        while client.queue_range("t", 0)[0] == 0:
            assert time.monotonic() < deadline, client.stats().get("retention_held")
            time.sleep(0.1)
    store.close()


def test_the_cli_deletes_a_group_and_refuses_a_served_store(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _store(home)
    with MessageStore.open(path) as store:
        store.commit_offset("g", "t", 0, 2)
        store.commit_offset("h", "t", 0, 1)
    with BrokerThread(path):
        assert main(["delete-group", str(path), "g"]) == 1
        err = capsys.readouterr().err
        assert "open for writing by pid" in err and "through the broker" in err, err
    assert main(["delete-group", str(path), "g", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"group": "g", "offsets": 1, "topics": []}
    assert main(["delete-group", str(path), "g"]) == 1
    assert "no consumer group 'g'" in capsys.readouterr().err
    assert main(["delete-group", str(home / "none"), "g"]) == 2
    assert not (home / "none").exists()
    with MessageStore.open(path, read_only=True) as store:
        assert store.consumer_groups() == {"h": {"t": {0: 1}}}


def _failing_retry_deletion(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every deletion of the retry topic fails (EIO): a delete_group commits, then its
    finish fails, and the store reports it ``unfinished`` (fixdelete's M1)."""
    import errno

    from equeue.errors import StoreWriteError

    real = MessageStore.delete_topic

    def delete_topic(store: MessageStore, topic: str) -> None:
        if topic == RETRY:
            raise StoreWriteError(errno.EIO, f"deleting {topic}: Input/output error (test)")
        real(store, topic)

    monkeypatch.setattr(MessageStore, "delete_topic", delete_topic)


def test_an_unfinished_deletion_is_reported_through_both_clients(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DeletedGroup.unfinished comes over the wire (version 6), as the store reports it;
    a connection welcomed with version 5 gets the answer of before (no key) and its
    client reads the deletion as done. Before, every client read unfinished as ""."""
    with BrokerThread(_store(home)) as running:
        running.store.create_topic(RETRY, 1)
        _failing_retry_deletion(monkeypatch)
        url = running.urls[0]
        with equeue.connect(url) as client:
            client.commit_offset("g", "t", 0, 1)
            deleted = client.delete_group("g")
        assert (deleted.offsets, deleted.topics) == (1, ())
        assert "Input/output error (test)" in deleted.unfinished, deleted

        async def scenario() -> str:
            client = await equeue.aio.connect(url)
            try:
                await client.commit_offset("g", "t", 0, 2)
                return (await client.delete_group("g")).unfinished
            finally:
                await client.close()

        assert "Input/output error (test)" in asyncio.run(scenario())
        with raw(url, versions=(5,)) as old:
            old.call("commit_offset", group="g", topic="t", queue_id=0, offset=3)
            assert old.call("delete_group", group="g") == {
                "group": "g",
                "offsets": 1,
                "topics": [],
            }
        running.broker.welcome_versions = (1, 2, 3, 4, 5)
        with equeue.connect(url) as client:
            client.commit_offset("g", "t", 0, 2)
            assert client.delete_group("g").unfinished == ""


def test_a_hostile_unfinished_is_a_protocol_error() -> None:
    from equeue.client.core import DECODERS
    from equeue.errors import ProtocolError

    answer = {"group": "g", "offsets": 1, "topics": []}
    assert DECODERS["delete_group"](answer | {"unfinished": "x"}, "here").unfinished == "x"
    for hostile in (5, None, b"x", ["x"]):
        with pytest.raises(ProtocolError, match="unfinished"):
            DECODERS["delete_group"](answer | {"unfinished": hostile}, "here")
