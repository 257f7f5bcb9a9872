"""What a read's request or answer, and a frame begun, may hold of the broker (reviewg F10,
F12, F16): a tag filter's length, a query_by_key answer within max_frame_bytes, and the
partial-frame budget given back by the frames stalled longest, not by the newest."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import pytest
from server_helpers import raw, short_home

import equeue
import equeue.aio
from equeue import MessageStore
from equeue.errors import InvalidMessageError, InvalidTypeError, LimitExceededError
from equeue.protocol.frames import FRAME_HEADER, encode
from equeue.server import BrokerThread
from equeue.store.reads import MAX_FILTER_TAGS

MiB = 1 << 20

home = pytest.fixture(short_home, name="home")


def _stats_until(connection: object, key: str, at_least: int) -> int:
    """stats[key] once it reaches ``at_least`` (the broker reads at its own pace), or its
    last value after 5 s."""
    deadline = time.monotonic() + 5.0
    while True:
        value: int = connection.call("stats")[key]  # type: ignore[attr-defined]
        if value >= at_least or time.monotonic() > deadline:
            return value
        time.sleep(0.01)


# --- F10: tags per filter ------------------------------------------------------------


def test_a_filter_of_more_than_max_filter_tags_is_refused_and_not_held(home: Path) -> None:
    too_many = [f"tag{i}" for i in range(MAX_FILTER_TAGS + 1)]
    most = too_many[:MAX_FILTER_TAGS]
    with BrokerThread(home / "s") as running, raw(running.urls[0]) as c:
        c.call("create_topic", topic="t", queue_count=1)
        for op in ("pull", "pull_columns"):
            error = c.error(op, topic="t", queue_id=0, offset=0, tags=too_many, wait_ms=60_000)
            assert error["code"] == "InvalidMessageError", error
            assert f"more than {MAX_FILTER_TAGS} tags" in error["message"]
            assert "MAX_FILTER_TAGS" in error["message"]
        assert c.call("stats")["held_pulls"] == 0
        # the limit itself is held, and answered by a message with its last tag
        rid = c.request("pull", topic="t", queue_id=0, offset=0, tags=most, wait_ms=60_000)
        assert _stats_until(c, "held_pulls", 1) == 1
        with raw(running.urls[0]) as producer:
            producer.call("send", topic="t", body=b"m", tag=most[-1])
        answered = c.answers(1)
        assert list(answered) == [rid]
        status, result = answered[rid]
        assert status == 0 and [m[5] for m in result[0]] == [most[-1]], result
        assert running.store.queue_range("t", 0) == (0, 1)


def test_the_store_refuses_a_longer_filter_counted_as_it_comes(tmp_path: Path) -> None:
    with MessageStore.open(tmp_path / "s") as store:
        store.send("t", b"x", tag="a")
        generated = (f"tag{i}" for i in range(100 * MAX_FILTER_TAGS))  # never listed
        with pytest.raises(InvalidMessageError, match="MAX_FILTER_TAGS"):
            store.pull("t", 0, 0, tags=generated)
        with pytest.raises(InvalidMessageError, match=f"more than {MAX_FILTER_TAGS}"):
            store.pull("t", 0, 0, tags=["a"] * (MAX_FILTER_TAGS + 1))
        assert [m.body for m in store.pull("t", 0, 0, tags=["a"] * MAX_FILTER_TAGS)] == [b"x"]


# --- F16: the partial-frame budget --------------------------------------------------


def test_past_the_partial_cap_the_frame_stalled_longest_is_closed(home: Path) -> None:
    cap = 2 * MiB
    running = BrokerThread(home / "s", max_partial_frame_bytes=cap, max_frame_bytes=cap)
    with running, raw(running.urls[0]) as good:
        url = running.urls[0]
        good.call("create_topic", topic="t", queue_count=1)
        with raw(url) as stalled, raw(url) as newer, raw(url) as sender:
            header = FRAME_HEADER.pack(2 * MiB - 100)
            stalled.send_raw(header + b"\x00" * (MiB // 2 + MiB // 4))  # 0.75 MiB, then nothing
            assert _stats_until(good, "buffered_bytes", MiB // 2 + MiB // 4) >= 3 * MiB // 4
            time.sleep(0.05)  # the second frame's last byte comes later than the first's
            newer.send_raw(header + b"\x00" * (MiB // 2 + MiB // 4))
            assert _stats_until(good, "buffered_bytes", 3 * MiB // 2) >= 3 * MiB // 2
            # a good client's send of 1 MiB passes the cap (1.5 + 1 MiB): the frame that has
            # waited longest gives way, and the send is stored
            frame = encode([1, "send", {"topic": "t", "body": b"b" * MiB}])
            with contextlib.suppress(OSError):
                sender.send_raw(frame)
            ((status, result),) = sender.answers(1).values()
            assert status == 0 and result[2:4] == [0, 0], result  # queue 0, offset 0
            error = stalled.closed_with()
            assert error["code"] == "LimitExceededError"
            assert f"max_partial_frame_bytes={cap}" in error["message"]
            assert "closed to make room" in error["message"], error
            # the newer stalled frame stays (the total is under the cap again) and completes
            newer.send_raw(b"\x00" * (2 * MiB - 100 - (MiB // 2 + MiB // 4)))
            assert newer.closed_with()["code"] == "ProtocolError"  # zeros are no request
        assert running.store.queue_range("t", 0) == (0, 1)
        assert good.call("stats")["buffered_bytes"] < MiB


# --- F12: query_by_key within the frame -------------------------------------------------

FRAME = MiB  # a small max_frame_bytes: messages of up to 1 MiB - 34 KiB
BODY = 300_000


def _keyed_broker(home: Path, max_pull_count: int = 65536) -> BrokerThread:
    return BrokerThread(home / "s", max_frame_bytes=FRAME, max_pull_count=max_pull_count)


def test_query_by_key_answers_fit_the_frame_and_pages_give_the_rest(home: Path) -> None:
    with _keyed_broker(home) as running:
        store = running.store
        for n in range(10):  # 3 MB with key k: ten times what a frame of 1 MiB carries
            store.send("t", bytes([n]) * BODY, key="k", queue_id=0)
        store.send("t", b"other", key="j", queue_id=0)
        expected = [m.position for m in store.query_by_key("t", "k", limit=100)]
        assert len(expected) == 10
        url = running.urls[0]
        with raw(url, versions=(1, 2, 3)) as old:  # query_by_key: whole, or refused
            error = old.error("query_by_key", topic="t", key="k", limit=100)
            assert error["code"] == "LimitExceededError", error  # review4 R5: never a part
            assert "query_by_key_page" in error["message"] and "max_frame_bytes" in error["message"]
            answer = old.call("query_by_key", topic="t", key="k", limit=2)  # fits: whole
            assert [m[4] for m in answer] == expected[:2]
            old.request("query_by_key_page", topic="t", key="k")  # of version 4
            assert "protocol version 4" in old.closed_with()["message"]
        with raw(url) as new:  # query_by_key_page: cut, and where the rest begins
            pages: list[list[int]] = []
            before = None
            while True:
                args = {"topic": "t", "key": "k", "limit": 100 - sum(map(len, pages))}
                if before is not None:
                    args["before"] = before
                messages, before = new.call("query_by_key_page", **args)
                assert len(encode([1, 0, [messages, before]])) <= FRAME
                pages.append([m[4] for m in messages])
                if before is None:
                    break
                assert before == pages[-1][-1]  # below the last one answered
                assert len(pages) < 20
            assert len(pages) >= 3 and [p for page in pages for p in page] == expected
            # a page that is not cut says there is no more; limit is kept
            messages, before = new.call("query_by_key_page", topic="t", key="k", limit=1)
            assert before is None and [m[4] for m in messages] == expected[:1]
        # the clients follow the pages: the store's answer, whatever its size
        with equeue.connect(url, timeout=20) as client:
            assert [m.position for m in client.query_by_key("t", "k", 100)] == expected
            assert [m.position for m in client.query_by_key("t", "k", 3)] == expected[:3]
            assert client.query_by_key("t", "k", 100) == store.query_by_key("t", "k", 100)

        async def aio() -> list[int]:
            client = await equeue.aio.connect(url)
            try:
                return [m.position for m in await client.query_by_key("t", "k", 100)]
            finally:
                await client.close()

        assert asyncio.run(aio()) == expected
        # a client welcomed with version 3 sends query_by_key: the whole list, or an error
        running.broker.welcome_versions = (1, 2, 3)
        with equeue.connect(url, timeout=20) as client:
            assert client.welcome is not None and client.welcome.version == 3
            with pytest.raises(LimitExceededError, match="query_by_key_page"):
                client.query_by_key("t", "k", 100)
            assert [m.position for m in client.query_by_key("t", "k", 2)] == expected[:2]


def test_query_by_key_pages_by_max_pull_count(home: Path) -> None:
    with _keyed_broker(home, max_pull_count=4) as running:
        for n in range(10):
            running.store.send("t", b"m%d" % n, key="k", queue_id=0)
        expected = [m.position for m in running.store.query_by_key("t", "k", limit=100)]
        with raw(running.urls[0]) as new:
            messages, before = new.call("query_by_key_page", topic="t", key="k", limit=100)
            assert [m[4] for m in messages] == expected[:4] and before == expected[3]
            messages, before = new.call(
                "query_by_key_page", topic="t", key="k", limit=96, before=before
            )
            assert [m[4] for m in messages] == expected[4:8] and before == expected[7]
            # a limit the broker's count covers: no next, even with more below
            messages, before = new.call("query_by_key_page", topic="t", key="k", limit=4)
            assert before is None and len(messages) == 4
        with equeue.connect(running.urls[0], timeout=20) as client:
            assert [m.position for m in client.query_by_key("t", "k", 100)] == expected
        # the old op: exactly max_pull_count messages of a key, a larger limit: whole
        # (review5 F4: refused, though nothing lay below); more than that: refused
        for n in range(4):
            running.store.send("t", b"j%d" % n, key="j", queue_id=0)
        with raw(running.urls[0], versions=(1, 2, 3)) as old:
            assert len(old.call("query_by_key", topic="t", key="j", limit=5)) == 4
            assert old.error("query_by_key", topic="t", key="k", limit=5)["code"] == (
                "LimitExceededError"
            )


def test_the_store_continues_a_key_query_below_a_position(tmp_path: Path) -> None:
    with MessageStore.open(tmp_path / "s") as store:
        sent = [store.send("t", b"%d" % n, key="k").position for n in range(6)]
        newest = sent[::-1]
        assert [m.position for m in store.query_by_key("t", "k", 2, before=sent[3])] == [
            sent[2],
            sent[1],
        ]
        assert store.key_positions("t", "k", 100, before=0) == []
        assert store.key_positions("t", "k", 100, before=1 << 70) == newest
        with pytest.raises(InvalidTypeError, match="before"):
            store.query_by_key("t", "k", before=-1)
