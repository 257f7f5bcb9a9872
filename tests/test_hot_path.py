"""The hot path's C shortcuts against the pure-Python paths (issue 24): ``store.send``
bound to the C Sender's ``call``, and the untagged pull's ``pull_chunk``. Each gives
the same results and raises the same errors as the Python path, for a closed store, a
read-only handle, a deleted topic and arguments of the wrong type or name."""

from __future__ import annotations

import dataclasses
import gc
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from code_paths import code_path  # noqa: F401 - the fixture
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from equeue import MessageStore, StoreConfig, speedups
from equeue.errors import CorruptRecordError
from equeue.format.chunk import HEADER_SIZE

needs_c = pytest.mark.skipif(speedups.SPEEDUPS is None, reason="the C accelerator is not built")
# Small chunks: a few sends of up to 1.5 KiB fill a log chunk, so runs cross chunk boundaries.
CONFIG = StoreConfig(chunk_data_size=8192, queue_chunk_records=342, max_message_size=2000)


def outcome(path: Path, call: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[str, Any]:
    """What a call returned (store-neutral: no store id, no clock) or raised."""
    try:
        result = call(*args, **kwargs)
    except Exception as exc:  # a TypeError for a bad signature included
        return type(exc).__name__, str(exc).replace(str(path), "STORE")
    if hasattr(result, "messages"):
        return "pull", (
            [m._replace(message_id=m.message_id[8:]) for m in result.messages],
            result.next_offset,
        )
    return "sent", (result.topic, result.queue_id, result.queue_offset, result.position)


SEND_CALLS: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
    (("t", b"plain"), {}),
    (("t", b"all"), {"tag": "g", "key": "k", "properties": None, "code": -3, "queue_id": 1}),
    (("t", b"props"), {"properties": {"a": "b"}}),  # handed to Python by the C path
    ((), {"topic": "t", "body": b"by keyword"}),
    (("t",), {"body": b"body by keyword"}),
    (("t", b"x"), {"colour": "red"}),
    (("t", b"x"), {"topic": "u"}),
    (("t", b"x", "tag"), {}),  # tag is keyword-only
    (("t",), {}),
    (("t", b"x"), {"tag": 5}),
    (("t", 5), {}),
    ((5, b"x"), {}),
    ((None, b"x"), {}),
    (("t", b"x"), {"queue_id": "0"}),
    (("t", b"x"), {"queue_id": 9}),
    (("t", b"x"), {"code": True}),
    (("t", b"x" * 2001), {}),
    (("", b"x"), {}),
    (("new-topic", b"first"), {}),
    (("gone", b"after its deletion"), {}),
]


def send_outcomes(path: Path, *, read_only: bool = False) -> list[tuple[str, Any]]:
    seen = []
    with MessageStore.open(path, CONFIG) as store:
        store.create_topic("t", 3)
        store.create_topic("gone", 2)
        store.send("gone", b"before")
        store.delete_topic("gone")
        for q in range(3):  # the queues' first chunks exist: later sends can take the C path
            store.send("t", b"first", queue_id=q)
        target = store
        if read_only:
            target = MessageStore.open(path, read_only=True)
        try:
            for args, kwargs in SEND_CALLS:
                seen.append(outcome(path, target.send, *args, **kwargs))
        finally:
            if read_only:
                target.close()
    with MessageStore.open(path, CONFIG) as store:
        store.close()
        seen.append(outcome(path, store.send, "t", b"closed"))
    return seen


@needs_c
@pytest.mark.parametrize("read_only", [False, True])
def test_bound_send_same_results_and_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, read_only: bool
) -> None:
    """Every send of SEND_CALLS (good ones, keywords it does not know, wrong types, a
    new topic, a deleted one), and a send to a closed store, on a store whose send is
    the C call and on the pure-Python store: the same results, the same errors."""
    fast = send_outcomes(tmp_path / "c", read_only=read_only)
    with monkeypatch.context() as m:
        m.setattr(speedups, "SPEEDUPS", None)
        slow = send_outcomes(tmp_path / "python", read_only=read_only)
    assert fast == slow
    kinds = [kind for kind, _ in fast]
    if read_only:
        # (a call that does not fit the signature is a TypeError before anything else)
        assert kinds[:-1].count("ReadOnlyError") == len(SEND_CALLS) - 4
    else:  # the control: the list does hold sends that succeed and each kind of refusal
        assert kinds.count("sent") == 7 and "TypeError" in kinds and "InvalidTypeError" in kinds
    assert fast[-1][0] == "ClosedError"


@needs_c
def test_send_is_the_c_call_only_where_it_may_be(tmp_path: Path) -> None:
    """Bound on a writable store whose sends do not wait for a group commit; the class's
    send on a "sync" store, a read-only handle, a subclass that overrides send, and
    once the store is closed."""
    with MessageStore.open(tmp_path / "a", CONFIG) as store:
        assert store._sender is not None
        assert store.send == store._sender.call
        with MessageStore.open(tmp_path / "a", read_only=True) as reader:
            assert reader.send.__func__ is MessageStore.send  # type: ignore[attr-defined]
    assert store.send.__func__ is MessageStore.send  # type: ignore[attr-defined]

    class Logged(MessageStore):
        def send(self, topic: str, body: bytes, **fields: Any) -> Any:
            sends.append(body)
            return super().send(topic, body, **fields)

    sends: list[bytes] = []
    with Logged.open(tmp_path / "c", CONFIG) as logged:
        logged.send("t", b"through the override")
    assert sends == [b"through the override"]
    sync = dataclasses.replace(CONFIG, flush="sync")
    with MessageStore.open(tmp_path / "b", sync) as store:
        assert store.send.__func__ is MessageStore.send  # type: ignore[attr-defined]


def pull_outcomes(path: Path, sizes: list[int], pulls: list[tuple[int, int, int | None]]) -> Any:
    with MessageStore.open(path, CONFIG) as store:
        store.create_topic("t", 2)
        store.create_topic("u", 1)
        for i, size in enumerate(sizes):  # interleaved topics: runs that skip records
            topic, props = ("u", None) if i % 5 == 4 else ("t", {"i": str(i)} if i % 7 else None)
            store.send(topic, bytes([i % 256]) * size, key=str(i) if i % 3 else None,
                       properties=props, queue_id=0 if topic == "u" else i % 2)  # fmt: skip
        seen = [
            outcome(path, store.pull, "t", q, offset, count, max_bytes=max_bytes)
            for q in (0, 1)
            for offset, count, max_bytes in pulls
        ]
        with MessageStore.open(path, read_only=True) as reader:
            seen += [outcome(path, reader.pull, "t", 0, o, c, max_bytes=b) for o, c, b in pulls]
        bad = [("t", 0, "1", 3), ("t", 0, 0, 0), ("t", 5, 0, 3), ("nope", 0, 0, 3), (5, 0, 0, 3)]
        seen += [outcome(path, store.pull, *args) for args in bad]
        store.delete_topic("u")
        seen.append(outcome(path, store.pull, "u", 0, 0))
    seen.append(outcome(path, store.pull, "t", 0, 0))
    return seen


@needs_c
@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    sizes=st.lists(st.integers(0, 1500), min_size=1, max_size=40),
    pulls=st.lists(
        st.tuples(st.integers(0, 70), st.integers(1, 300), st.none() | st.integers(0, 5000)),
        min_size=1,
        max_size=6,
    ),
)
def test_pull_same_results_and_errors(
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
    sizes: list[int],
    pulls: list[tuple[int, int, int | None]],
) -> None:
    """Pulls across log chunk boundaries (4 KiB chunks, records up to 1.5 KiB), with
    max_bytes, from a writer and a read-only handle, then pulls with bad arguments, of a
    deleted topic and from a closed store: pull_chunk and the Python path agree."""
    base = tmp_path_factory.mktemp("pull")
    pulls = [(0, 300, None), *pulls]  # the control below: a pull that gets every message
    monkeypatch.setattr(time, "time_ns", lambda: 1_700_000_000_123_456_789)  # same stamps
    fast = pull_outcomes(base / "c", sizes, pulls)
    with monkeypatch.context() as m:
        m.setattr(speedups, "SPEEDUPS", None)
        slow = pull_outcomes(base / "python", sizes, pulls)
    assert fast == slow
    assert fast[-1][0] == "ClosedError" and fast[-2][0] == "TopicNotFoundError"
    assert any(kind == "pull" and got[0] for kind, got in fast)  # the control: messages came


@needs_c
def test_the_c_send_reads_the_clock_python_would(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The C send reads the real clock itself only while ``time.time_ns`` is the builtin;
    replaced after the store opened (as tests do), the replacement is what it calls."""
    with MessageStore.open(tmp_path / "s", CONFIG) as store:
        store.create_topic("t", 1)
        store.send("t", b"first")  # the queue's first chunk: later sends take the C path
        before = time.time_ns()
        real = store.send("t", b"real clock")
        after = time.time_ns()
        monkeypatch.setattr(time, "time_ns", lambda: 1_700_000_000_123_456_789)
        fixed = store.send("t", b"fixed clock")
        _, real_msg, fixed_msg = store.pull("t", 0, 0).messages
    assert store._sender is None  # closed; it was the C path while open (the control):
    assert before <= real_msg.stored_ns <= after and real.stored_at == real_msg.stored_ns / 1e9
    assert fixed_msg.stored_ns == fixed_msg.created_ns == 1_700_000_000_123_456_789
    assert fixed.stored_at == 1_700_000_000_123_456_789 / 1e9


class Probe:
    pass


@pytest.mark.usefixtures("code_path")
def test_pulled_messages_and_reference_cycles(tmp_path: Path) -> None:
    """A pulled message is tracked by the garbage collector once its properties dict was
    handed out, on both paths (the C Message starts untracked: see
    tests/test_message_type.py), so a cycle through that dict is found and collected."""
    with MessageStore.open(tmp_path / "s", CONFIG) as store:
        store.create_topic("t", 1)
        store.send("t", b"plain")
        store.send("t", b"props", properties={"a": "b"})
        plain, with_props = store.pull("t", 0, 0).messages
    assert plain.properties == {} and gc.is_tracked(plain)
    probe = Probe()
    gone = weakref.ref(probe)
    props: dict[str, Any] = with_props.properties
    assert gc.is_tracked(with_props)
    props["probe"], props["self"] = probe, with_props  # a cycle: message -> dict -> message
    del probe, props
    gc.collect()
    assert gone() is not None  # the control: alive while the message is referenced
    del with_props
    gc.collect()
    assert gone() is None  # the cycle was found and collected


@pytest.mark.usefixtures("code_path")
def test_entry_naming_another_intact_record(tmp_path: Path) -> None:
    """A damaged queue entry that names another message's intact record (pull_chunk
    decodes it, finds it does not match the entry, and stops): the messages before it
    are returned, and pulling it raises the general path's error naming the queue file."""
    with MessageStore.open(tmp_path / "s", CONFIG) as store:
        store.create_topic("t", 1)
        sent = store.send_batch("t", [b"m%d" % i for i in range(6)])
    queue_chunk = tmp_path / "s" / "queues" / "t" / "0" / "chunk-000000000000.0000"
    with queue_chunk.open("r+b") as f:
        f.seek(HEADER_SIZE + 3 * 12)  # offset 3's entry now names offset 1's record
        f.write((sent[1].position + 1).to_bytes(8, "little", signed=True))
    with MessageStore.open(tmp_path / "s", CONFIG) as store:
        before = store.pull("t", 0, 0, max_count=3)
        assert [m.body for m in before] == [b"m0", b"m1", b"m2"]  # the control
        with pytest.raises(CorruptRecordError) as caught:
            store.pull("t", 0, 0, max_count=6)
        assert "entry for offset 3" in str(caught.value) and queue_chunk.name in str(caught.value)
        assert [m.body for m in store.pull("t", 0, 4).messages] == [b"m4", b"m5"]
