"""The sync client's ``send_many`` in chunks (equeue/client/many.py) against real brokers:
whatever the messages and the window, the store holds exactly what ``sent`` says, and
``sent``, ``unsent`` and ``unanswered`` hold every message once, in order; a chunk is
never refused for its size; after a SIGKILL of the broker under ``--flush sync`` the
reopened store holds every acknowledged message and none of the unsent."""

from __future__ import annotations

import contextlib
import itertools
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from client_helpers import BrokerProcess, FakeBroker, Peer, send_many_killed
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import short_dir, short_home

import equeue
from equeue import MessageStore, OutgoingMessage, StoreConfig, errors
from equeue.client.many import PARTS
from equeue.client.sync import Client
from equeue.protocol.frames import STATUS_OK
from equeue.server import BrokerThread

home = pytest.fixture(short_home, name="home")

MAX_MESSAGE = 20_000  # the stores' max_message_size: a larger body is refused by the store
FRAME = 65536  # the smallest max_frame_bytes a broker takes
QUEUES = 2


@contextlib.contextmanager
def _served(
    max_message_size: int = MAX_MESSAGE, max_properties_size: int = 512, **settings: Any
) -> Iterator[BrokerThread]:
    """A broker (thread) on a store of small messages, so a frame of 64 KiB carries one."""
    path = short_dir()
    config = StoreConfig(
        flush="async", max_message_size=max_message_size, max_properties_size=max_properties_size
    )
    try:
        with (
            MessageStore.open(path / "store", config) as store,
            BrokerThread(store, **settings) as broker,
        ):
            yield broker
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def small() -> Iterator[BrokerThread]:
    """Frames of 64 KiB and at most 6 messages a batch: chunks are cut by both."""
    with _served(max_frame_bytes=FRAME, max_batch_messages=6) as broker:
        yield broker


@pytest.fixture(scope="module")
def roomy() -> Iterator[BrokerThread]:
    with _served() as broker:
        yield broker


@pytest.fixture(scope="module")
def version_1() -> Iterator[BrokerThread]:
    """A broker of protocol version 1: no send_bodies (the request would close the
    connection), so chunks of bodies go as send_batch."""
    with _served() as broker:
        broker.broker.welcome_versions = (1,)
        del broker.broker.handlers.ops["send_bodies"]
        yield broker


# What each drawn message is: good, or refused by the store or by the client's encoder.
GOOD = ("body", "tagged", "keyed", "queue")
BAD = ("too large", "past the frame", "long tag", "unencodable tag", "no such queue")


def _message(kind: str, n: int, size: int) -> Any:
    body = f"{n}:".encode() + b"x" * size
    if kind == "body":
        return body
    if kind == "tagged":
        return OutgoingMessage(body, tag=f"t{n % 3}")
    if kind == "keyed":
        return {"body": body, "key": f"k{n}", "properties": {"n": str(n), "p": "q" * (n % 9)}}
    if kind == "queue":
        return OutgoingMessage(body, queue_id=n % QUEUES)
    if kind == "too large":
        return body + b"y" * MAX_MESSAGE
    if kind == "past the frame":
        return body + b"z" * FRAME  # past the small broker's frame; the others' store limit
    if kind == "long tag":
        return OutgoingMessage(body, tag="l" * 300)  # the store's limit is 255 bytes
    if kind == "unencodable tag":
        return OutgoingMessage(body, tag="\ud800")  # no UTF-8: the client cannot encode it
    return OutgoingMessage(body, queue_id=QUEUES + 5)


def _body(item: Any) -> bytes:
    if isinstance(item, bytes):
        return item
    return item.body if isinstance(item, OutgoingMessage) else item["body"]


def _stored(client: Client, topic: str) -> dict[tuple[int, int], bytes]:
    found: dict[tuple[int, int], bytes] = {}
    for queue_id in client.queue_ids(topic):
        offset = 0
        for _ in range(1000):  # (bounded)
            batch = client.pull(topic, queue_id, offset, max_count=500)
            if not batch:
                break
            found.update(((queue_id, m.queue_offset), m.body) for m in batch)
            offset = batch.next_offset
    return found


def check_outcome(client: Client, topic: str, items: list[Any], window: int) -> None:
    """send_many ``items``; the store holds exactly ``sent``, and ``sent`` + ``unsent``
    (no connection is lost here) are every message once, in order."""
    bad = [i for i, item in enumerate(items) if getattr(item, "bad", False)]
    try:
        results = client.send_many(topic, [item.value for item in items], window=window)
    except errors.EQueueError as exc:
        error: errors.EQueueError | None = exc
        sent, unsent, unanswered = list(exc.sent), list(exc.unsent), list(exc.unanswered)
    else:
        error, sent, unsent, unanswered = None, results, [], []
    values = [item.value for item in items]
    index = {id(value): i for i, value in enumerate(values)}
    assert not unanswered
    unsent_at = [index[id(value)] for value in unsent]
    assert unsent_at == sorted(set(unsent_at))  # each once, in order
    sent_at = [i for i in range(len(values)) if i not in set(unsent_at)]
    assert len(sent) == len(sent_at)  # together: every message once
    stored = _stored(client, topic)
    expected = {
        (r.queue_id, r.queue_offset): _body(values[i]) for r, i in zip(sent, sent_at, strict=True)
    }
    assert stored == expected  # the store holds exactly sent: nothing more, nothing twice
    if not bad:
        assert error is None
        return
    assert isinstance(
        error, errors.InvalidMessageError | errors.QueueNotFoundError | errors.FrameTooLargeError
    )
    assert set(bad) <= set(unsent_at)  # no bad message is stored
    first = bad[0]
    assert set(range(max(0, first - window))) <= set(sent_at)  # before its chunk: sent
    assert set(range(first + window, len(values))) <= set(unsent_at)  # the writing stopped


class Drawn:
    def __init__(self, value: Any, bad: bool) -> None:
        self.value, self.bad = value, bad


@st.composite
def messages(draw: st.DrawFn) -> list[Drawn]:
    count = draw(st.integers(0, 60))
    bad_odds = draw(st.sampled_from([0, 0, 40, 150]))  # per mille: most runs have none
    drawn = []
    for n in range(count):
        is_bad = draw(st.integers(0, 999)) < bad_odds
        kind = draw(st.sampled_from(BAD if is_bad else GOOD))
        if draw(st.integers(0, 3)):  # bodies alone in runs, as send_many mostly gets them
            kind = "body" if not is_bad else kind
        size = draw(st.integers(0, 15_000) if draw(st.integers(0, 9)) == 0 else st.integers(0, 900))
        drawn.append(Drawn(_message(kind, n, size), is_bad))
    return drawn


_topics = itertools.count()


@pytest.mark.parametrize("which", ["small", "roomy", "version_1"])
def test_the_store_holds_exactly_what_sent_says(which: str, request: pytest.FixtureRequest) -> None:
    broker: BrokerThread = request.getfixturevalue(which)
    with equeue.connect(broker.urls[0], timeout=30) as client:

        @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
        @given(items=messages(), window=st.integers(1, 40))
        def run(items: list[Drawn], window: int) -> None:
            topic = f"p{next(_topics)}"
            client.create_topic(topic, QUEUES)
            check_outcome(client, topic, items, window)

        run()
        client.ping()  # the connection outlived every refusal


def test_a_chunk_is_never_refused_for_its_size() -> None:
    """max_batch_messages=3 and frames of 64 KiB: a window of 100 bodies of up to the
    store's limit goes in chunks the broker takes, each at most 3 messages and a frame."""
    settings = {"max_batch_messages": 3, "max_frame_bytes": FRAME}
    with (
        _served(60_000, 512, **settings) as broker,
        equeue.connect(broker.urls[0]) as client,
    ):
        bodies = [bytes([n % 256]) * (n * 397 % 60_001) for n in range(300)]
        results = client.send_many("c", bodies, window=100)
        stats = client.stats()
        assert [broker.store.get(r.message_id).body for r in results] == bodies
    assert stats["send_requests"] >= 100  # chunks of 3 at most
    assert stats["sends"] == 300


def test_a_chunk_of_many_properties_stays_within_the_objects_a_request_may_hold() -> None:
    """max_batch_messages=100 bounds a request body past 64 KiB to 3,200 msgpack objects
    (equeue/protocol/bounded.py; past it the broker closes the connection): 200
    messages of 13 properties each (34 objects a message as the broker counts them) go
    in chunks under it."""
    with (
        _served(max_batch_messages=100) as broker,
        equeue.connect(broker.urls[0]) as client,
    ):
        properties = {f"p{n}": "v" for n in range(13)}
        items = [{"body": b"%04d" % n + b"x" * 1000, "properties": properties} for n in range(200)]
        results = client.send_many("o", items, window=200)
        assert [broker.store.get(r.message_id).body for r in results] == [
            item["body"] for item in items
        ]


@settings(max_examples=200, deadline=None)
@given(
    body=st.binary(max_size=300),
    tag=st.text(max_size=40),
    key=st.none() | st.text(max_size=40),
    properties=st.none() | st.dictionaries(st.text(max_size=20), st.text(max_size=20)),
    code=st.integers(-(1 << 31), (1 << 31) - 1),
    queue_id=st.none() | st.integers(0, (1 << 64) - 1),
)
def test_a_chunk_cut_counts_at_least_the_bytes_and_exactly_the_objects_of_a_message(
    body: bytes, tag: str, key: str | None, properties: dict[str, str] | None, code: int,
    queue_id: int | None,
) -> None:  # fmt: skip
    """_cut's estimates against msgpack itself and the broker's object count."""
    import msgpack

    from equeue.client import args, many
    from equeue.protocol.bounded import decode_request, message_objects

    fields = args.message(body, tag, key, properties, code, queue_id, "t")
    try:
        packed = msgpack.packb([fields], use_bin_type=True)
    except UnicodeEncodeError:
        return  # (a surrogate: the encoder refuses the chunk, as tested above)
    assert many._packed_bound(fields) >= len(packed) - 1  # (- the array's header)
    # The message in an array beside a padding (past PLAIN_BELOW, so objects are
    # counted): the array's own object and the padding's place, 2 more.
    padded = msgpack.packb([fields, b"x" * 70_000], use_bin_type=True)
    objects = message_objects(fields) + 2
    decode_request(padded, "t", 1 << 16, "", objects, "")
    with pytest.raises(errors.ProtocolError, match="msgpack objects"):
        decode_request(padded, "t", 1 << 16, "", objects - 1, "")


def test_a_wrong_count_of_results_breaks_the_connection_and_is_unanswered() -> None:
    """A broker (fake, version 1) answering a chunk of 4 with 3 SendResults: which ones
    were stored cannot be known, so the chunk is unanswered, the connection closed."""

    def script(peer: Peer) -> None:
        peer.welcome()
        request_id, op, args = peer.recv()
        assert op == "send_batch" and len(args["messages"]) == 4
        result = ["m", "w", 0, 0, 0, 1.0]
        peer.send([request_id, STATUS_OK, [result] * 3])
        peer.recv()  # until the client closes

    with FakeBroker(script) as fake, equeue.connect(fake.url) as client:
        bodies = [b"a", b"b", b"c", b"d"]
        with pytest.raises(errors.ConnectionLostError) as raised:
            client.send_many("w", bodies, window=4 * PARTS)
        assert isinstance(raised.value.__cause__, errors.ProtocolError)
        assert "3 results to a send_bodies of 4" in str(raised.value)
        assert (raised.value.sent, raised.value.unsent) == ([], [])
        assert raised.value.unanswered == bodies


def test_arguments_refused_before_sending_leave_everything_unsent(roomy: BrokerThread) -> None:
    with equeue.connect(roomy.urls[0]) as client:
        items: list[Any] = [b"a", 5, b"c"]
        with pytest.raises(errors.InvalidTypeError) as raised:
            client.send_many("a", items)
        assert (raised.value.sent, raised.value.unsent) == ([], items)
        assert "a" not in client.topics()


def test_after_a_sigkill_sent_is_stored_and_unsent_is_not(home: Path) -> None:
    """send_many of 300,000 under --flush sync; the broker is SIGKILLed midway. The store
    reopened holds every message of ``sent`` (where sent said), none of ``unsent``, and
    beyond them only ``unanswered`` ones, each once. Control: a send_many of 3,000
    before the kill raised nothing and is all there."""
    path = home / "store"
    bodies = [f"k{i}".encode() for i in range(300_000)]
    control = [f"c{i}".encode() for i in range(3000)]
    with BrokerProcess(path, "--flush", "sync") as broker:
        client = equeue.connect(broker.url, connect_timeout=10)
        try:
            client.create_topic("k", QUEUES)
            control_results = client.send_many("c", control, window=100)
            error = send_many_killed(broker, client, "k", bodies, 100, 5000)
        finally:
            client.close()
    sent, unsent, unanswered = error.sent, list(error.unsent), list(error.unanswered)
    assert unanswered, "a chunk was in flight at the kill"
    assert sent and unsent
    assert bodies == bodies[: len(sent)] + unanswered + unsent  # one connection: in order
    with MessageStore.open(path, StoreConfig(flush="async")) as store:
        for result, body in zip(control_results, control, strict=True):
            assert store.get(result.message_id).body == body  # the control: all there
        for result, body in zip(sent, bodies[: len(sent)], strict=True):
            message = store.get(result.message_id)
            assert (message.body, message.queue_offset) == (body, result.queue_offset)
        found: list[bytes] = []
        for queue_id in store.queue_ids("k"):
            first, end = store.queue_range("k", queue_id)
            for offset in range(first, end, 1000):
                found += [m.body for m in store.pull("k", queue_id, offset, 1000)]
    assert len(found) == len(set(found))  # nothing stored twice
    assert set(found) - set(bodies[: len(sent)]) <= set(unanswered)
    assert not set(found) & set(unsent)
