"""The C Message (equeue/cext/message.c) against the NamedTuple of the pure-Python path
(``equeue.store.types.TupleMessage``): the same behaviour wherever users and the code
base rely on it, and the garbage collector's view of a pulled message that starts
untracked."""

from __future__ import annotations

import copy
import gc
import pickle
import subprocess
import sys
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from equeue import Message, MessageStore, StoreConfig, speedups
from equeue.store.types import TupleMessage

needs_c = pytest.mark.skipif(speedups.SPEEDUPS is None, reason="the C accelerator is not built")
CONFIG = StoreConfig(chunk_data_size=8192, queue_chunk_records=342, max_message_size=2000)
FIELDS: tuple[Any, ...] = (
    "c5f6cce2000000000000004a", "t", 1, 7, 74, "tag", "k", {"a": "b"}, -3, b"body",
    1_795_648_194_344_364_229, 1_795_648_194_344_364_230,
)  # fmt: skip


def pulled(tmp_path: Path, properties: dict[str, str] | None = None) -> Any:
    with MessageStore.open(tmp_path / "s", CONFIG) as store:
        store.create_topic("t", 1)
        store.send("t", b"body", tag="tag", key="k", properties=properties, code=-3)
        (message,) = store.pull("t", 0, 0).messages
    return message


@needs_c
def test_c_message_is_the_named_tuples_equal() -> None:
    c, t = Message(*FIELDS), TupleMessage(*FIELDS)
    assert type(c) is not TupleMessage and Message is speedups.SPEEDUPS.Message  # type: ignore[union-attr]
    assert c == t and t == c and (c != t) is False and c == FIELDS and list(c) == list(t)
    assert c != t._replace(code=0) and t._replace(code=0) != c
    assert (c < t._replace(code=0)) == (t < t._replace(code=0))
    assert repr(c) == repr(t) and str(c) == str(t)
    assert Message._fields == TupleMessage._fields and Message.__match_args__ == Message._fields
    assert Message._field_defaults == {} and len(c) == 12
    assert [getattr(c, name) for name in Message._fields] == list(FIELDS)
    assert (c.created_at, c.stored_at) == (t.created_at, t.stored_at)
    assert c[-1] == t[-1] and c[2:5] == t[2:5] and type(c[2:5]) is tuple and c[::-2] == t[::-2]
    assert ("tag" in c, "nope" in c) == (True, False)
    assert c.index("t") == t.index("t") == 1 and c.count(1) == t.count(1)
    assert c._asdict() == t._asdict() and c._replace(topic="u") == t._replace(topic="u")
    assert Message._make(FIELDS) == c and Message(**t._asdict()) == c
    message_id, topic, *_, stored_ns = c  # unpacking
    assert (message_id, topic, stored_ns) == (FIELDS[0], FIELDS[1], FIELDS[11])
    match c:
        case Message(topic="t", queue_offset=offset):
            assert offset == 7
        case _:
            pytest.fail("no match")
    assert copy.copy(c) == c and copy.copy(c).properties is c.properties
    assert copy.deepcopy(c) == c and copy.deepcopy(c).properties is not c.properties


@needs_c
@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda c: hash(c), TypeError),  # the dict, as a tuple's hash
        (lambda c: c[12], IndexError),
        (lambda c: c["topic"], TypeError),
        (lambda c: c._replace(nope=1), ValueError),
        (lambda c: Message._make(FIELDS[:11]), TypeError),
        (lambda c: Message(*FIELDS[:11]), TypeError),
        (lambda c: setattr(c, "topic", "u"), AttributeError),
        (lambda c: setattr(c, "other", "u"), AttributeError),
        (lambda c: c.index("nope"), ValueError),
    ],
)
def test_c_message_raises_as_the_named_tuple(
    call: Callable[[Any], object], error: type[Exception]
) -> None:
    for message in (Message(*FIELDS), TupleMessage(*FIELDS)):
        with pytest.raises(error):
            call(message)


def test_pulled_message_equals_the_pure_python_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fast = pulled(tmp_path / "c", {"p": "q"})
    monkeypatch.setattr(speedups, "SPEEDUPS", None)
    slow = pulled(tmp_path / "py", {"p": "q"})
    assert fast[1:10] == slow[1:10] and TupleMessage(*fast)[1:10] == slow[1:10]
    assert fast.message_id[8:] == slow.message_id[8:]  # (the store ids differ)


@needs_c
def test_pickled_between_the_c_and_the_pure_python_process(tmp_path: Path) -> None:
    """A C Message unpickles as the NamedTuple in a process without the accelerator
    (multiprocessing, Spark), and back; equal both ways."""
    message = pulled(tmp_path, {"p": "q"})
    program = (
        "import pickle, sys; from equeue.store.types import Message, TupleMessage;"
        "m = pickle.load(sys.stdin.buffer); assert type(m) is TupleMessage, type(m);"
        "sys.stdout.buffer.write(pickle.dumps(m._replace(code=5)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], input=pickle.dumps(message), capture_output=True,
        env={**__import__("os").environ, "EQUEUE_PURE_PYTHON": "1"}, timeout=60, check=True,
    )  # fmt: skip
    back = pickle.loads(done.stdout)
    assert type(back) is Message and back == message._replace(code=5)
    assert back.properties == {"p": "q"}


@needs_c
def test_pulled_message_is_untracked_until_its_properties_leave(tmp_path: Path) -> None:
    """The C path's pulled message is not tracked while nothing can point back at it;
    reading any field but the properties leaves it so, and the message stays whole."""
    message = pulled(tmp_path)
    assert not gc.is_tracked(message)
    assert (message.topic, message.tag, message.key, message.body) == ("t", "tag", "k", b"body")
    assert message.queue_offset == 0 and message.code == -3 and message.created_at > 0
    assert message.message_id.endswith(f"{message.position:016x}")
    assert not gc.is_tracked(message)
    assert message.properties == {} and gc.is_tracked(message)
    assert message.properties is message.properties  # one dict per message, kept


class Probe:
    pass


HAND_OUTS: dict[str, Callable[[Any], dict[str, Any]]] = {
    "attribute": lambda m: m.properties,
    "index": lambda m: m[7],
    "negative index": lambda m: m[-5],
    "slice": lambda m: m[7:8][0],
    "iteration": lambda m: list(m)[7],
    "unpacking": lambda m: (lambda *f: f[7])(*m),
    "_asdict": lambda m: m._asdict()["properties"],
    "__reduce__": lambda m: m.__reduce__()[1][7],
    "_replace": lambda m: m._replace(code=1).properties,
}


@needs_c
@pytest.mark.parametrize("properties", [None, {"a": "b"}], ids=["empty", "decoded"])
@pytest.mark.parametrize("way", HAND_OUTS)
def test_cycle_through_a_handed_out_dict_is_collected(
    tmp_path: Path, way: str, properties: dict[str, str] | None
) -> None:
    """Whichever way the properties dict leaves a pulled message (empty, made on demand,
    or decoded), the message is tracked by then, so a cycle message -> dict -> message is
    collected; the control: alive while referenced."""
    message = pulled(tmp_path, properties)
    assert not gc.is_tracked(message)
    props = HAND_OUTS[way](message)
    probe = Probe()
    gone = weakref.ref(probe)
    props["probe"], props["self"] = probe, message
    del probe, props
    gc.collect()
    assert gone() is not None
    del message
    gc.collect()
    assert gone() is None


@needs_c
def test_untracked_messages_are_freed_by_reference_counting(tmp_path: Path) -> None:
    """Many pulled messages never read: freed when the result goes, without a collection
    (the garbage collector is off throughout)."""
    with MessageStore.open(tmp_path / "s", CONFIG) as store:
        store.create_topic("t", 1)
        store.send_batch("t", [b"x" * 50] * 500)
        gc.disable()
        try:
            messages = store.pull("t", 0, 0, 500).messages
            assert len(messages) == 500 and not any(gc.is_tracked(m) for m in messages)
            bodies = [m.body for m in messages]  # each held by its message and this list
            held = {sys.getrefcount(b) for b in bodies}
            assert len(held) == 1
            probe = Probe()
            gone = weakref.ref(probe)
            props: dict[str, Any] = messages[0].properties  # that message is tracked now
            props["probe"] = probe
            del messages, probe, props
            assert gone() is None and {sys.getrefcount(b) for b in bodies} == {held.pop() - 1}
        finally:
            gc.enable()
