"""Review 36's L1 and L4 (L2, ``--status`` of a missing path, is in
tests/test_server.py): a body refused under a max_message_size the broker lowered to
fit its frames names ``equeue serve --max-frame-bytes`` (a store's own limit still
names StoreConfig), and ``pull(wait=)`` past the broker's one day is refused by the
client before sending, as the store refuses it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from server_helpers import short_home

import equeue
import equeue.aio
from equeue import MessageStore, StoreConfig
from equeue.errors import InvalidMessageError, MessageTooLargeError
from equeue.server import BrokerThread
from equeue.store.validate import MAX_WAIT

FRAME = 65536  # the smallest max_frame_bytes: the broker lowers max_message_size to 30720


directory = pytest.fixture(short_home, name="directory")


def _refusal(url: str) -> tuple[str, tuple[int, int]]:
    with equeue.connect(url) as client:
        client.create_topic("t", 1)
        client.send("t", b"small")
        with pytest.raises(MessageTooLargeError) as refused:
            client.send("t", b"x" * 60000)
        return str(refused.value), client.queue_range("t", 0)


def test_a_body_past_a_limit_the_broker_lowered_names_max_frame_bytes(directory: Path) -> None:
    thread = BrokerThread(directory / "s", max_frame_bytes=FRAME).start()
    try:
        text, queue_range = _refusal(thread.urls[0])
    finally:
        thread.stop()
    # before: "...; the limit is 30720 (StoreConfig.max_message_size)", out of a CLI
    # user's reach
    assert "body is 60000 bytes; the limit is 30720" in text
    assert "equeue serve --max-frame-bytes" in text and f"max_frame_bytes={FRAME}" in text
    assert "StoreConfig" not in text
    assert queue_range == (0, 1)  # refused: nothing stored


def test_a_body_past_the_stores_own_limit_names_storeconfig(directory: Path) -> None:
    store = MessageStore.open(directory / "s", StoreConfig(max_message_size=20000))
    try:
        thread = BrokerThread(store, max_frame_bytes=FRAME).start()
        try:
            text, queue_range = _refusal(thread.urls[0])
        finally:
            thread.stop()
    finally:
        store.close()
    assert text.endswith("the limit is 20000 (StoreConfig.max_message_size)")
    assert queue_range == (0, 1)


def test_pull_wait_past_a_day_is_refused_before_sending(directory: Path) -> None:
    thread = BrokerThread(directory / "s").start()
    try:
        url = thread.urls[0]
        errors = thread.broker.counters
        with equeue.connect(url) as client:
            client.send("t", b"one", queue_id=0)
            before = errors.errors
            with pytest.raises(InvalidMessageError, match=r"wait=1000000000.0 seconds .* 86400"):
                client.pull("t", 0, 0, 1, wait=1e9)
            assert errors.errors == before  # never sent: the broker answered no error
            assert client.pull("t", 0, 0, 1, wait=MAX_WAIT).messages[0].body == b"one"

        async def main() -> None:
            aclient = await equeue.aio.connect(url)
            try:
                with pytest.raises(InvalidMessageError, match=r"wait=.* seconds .* 86400"):
                    await aclient.pull("t", 0, 0, 1, wait=MAX_WAIT + 1)
                got = await aclient.pull("t", 0, 0, 1, wait=MAX_WAIT)
                assert got.messages[0].body == b"one"
            finally:
                await aclient.close()

        asyncio.run(main())
        assert errors.errors == before
    finally:
        thread.stop()
