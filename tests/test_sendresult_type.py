"""The C SendResult (equeue/cext/sendresult.c) against the NamedTuple of the pure-Python
path (``equeue.store.types.TupleSendResult``): the same behaviour wherever users, the
broker and the clients rely on it; fields made on first read and kept; no garbage
collector involvement; freed by reference counting."""

from __future__ import annotations

import copy
import gc
import os
import pickle
import subprocess
import sys
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from equeue import MessageStore, SendResult, StoreConfig, speedups
from equeue.errors import InvalidTypeError
from equeue.protocol.records import pack_send_columns, pack_send_result, unpack_send_columns
from equeue.store.types import TupleSendResult

needs_c = pytest.mark.skipif(speedups.SPEEDUPS is None, reason="the C accelerator is not built")
CONFIG = StoreConfig(chunk_data_size=8192, queue_chunk_records=342, max_message_size=2000)
FIELDS: tuple[Any, ...] = ("c5f6cce2000000000000004a", "t", 1, 7, 74, 1_795_648_194.344364)


def sent(directory: Path) -> tuple[Any, list[Any], float, float]:
    """A send's result, a send_batch's results, and the stored_at of the messages as
    pulled (stored_ns / 1e9) for the single send and the batch's first."""
    with MessageStore.open(directory, CONFIG) as store:
        store.create_topic("t", 2)
        one = store.send("t", b"body", key="k")
        batch = store.send_batch("t", [b"a", b"b", b"c"])
        single = store.get(one.message_id).stored_at
        first = store.get(batch[0].message_id).stored_at
    return one, batch, single, first


@needs_c
def test_c_send_result_is_the_named_tuples_equal() -> None:
    c, t = SendResult(*FIELDS), TupleSendResult(*FIELDS)
    assert type(c) is not TupleSendResult and SendResult is speedups.SPEEDUPS.SendResult  # type: ignore[union-attr]
    assert c == t and t == c and (c != t) is False and c == FIELDS and list(c) == list(t)
    assert c != t._replace(queue_offset=8) and t._replace(queue_offset=8) != c
    assert (c < t._replace(queue_offset=8)) == (t < t._replace(queue_offset=8)) is True
    assert (t._replace(queue_offset=8) > c) is True
    assert repr(c) == repr(t) and str(c) == str(t)
    assert SendResult._fields == TupleSendResult._fields == SendResult.__match_args__
    assert SendResult._field_defaults == {} and len(c) == 6
    assert SendResult.__doc__ == TupleSendResult.__doc__
    assert [getattr(c, name) for name in SendResult._fields] == list(FIELDS)
    assert hash(c) == hash(t) == hash(FIELDS) and {c: 1}[t] == 1 and len({c, t}) == 1
    assert c[-1] == t[-1] and c[1:4] == t[1:4] and type(c[1:4]) is tuple and c[::-2] == t[::-2]
    assert ("t" in c, "nope" in c) == (True, False)
    assert c.index("t") == t.index("t") == 1 and c.count(1) == t.count(1) == 1
    assert c._asdict() == t._asdict() and c._replace(topic="u") == t._replace(topic="u")
    assert SendResult._make(FIELDS) == c and SendResult(**t._asdict()) == c
    assert SendResult(*FIELDS[:2], queue_id=1, queue_offset=7, position=74, stored_at=FIELDS[5])
    message_id, topic, *_, stored_at = c  # unpacking
    assert (message_id, topic, stored_at) == (FIELDS[0], FIELDS[1], FIELDS[5])
    match c:
        case SendResult(topic="t", queue_offset=offset):
            assert offset == 7
        case _:
            pytest.fail("no match")
    assert copy.copy(c) == c and copy.deepcopy(c) == c
    assert pack_send_result(c) == pack_send_result(t) == list(FIELDS)
    assert pack_send_columns("t", [c, c]) == pack_send_columns("t", [t, t])


@needs_c
@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda r: r[6], IndexError),
        (lambda r: r[-7], IndexError),
        (lambda r: r["topic"], TypeError),
        (lambda r: r._replace(nope=1), ValueError),
        (lambda r: SendResult._make(FIELDS[:5]), TypeError),
        (lambda r: SendResult(*FIELDS[:5]), TypeError),
        (lambda r: SendResult(*FIELDS, 1), TypeError),  # type: ignore[call-arg]
        (lambda r: setattr(r, "topic", "u"), AttributeError),
        (lambda r: setattr(r, "queue_id", 2), AttributeError),
        (lambda r: setattr(r, "other", "u"), AttributeError),
        (lambda r: r.index("nope"), ValueError),
        (lambda r: hash(r._replace(topic=["unhashable"])), TypeError),
    ],
)
def test_c_send_result_raises_as_the_named_tuple(
    call: Callable[[Any], object], error: type[Exception]
) -> None:
    for result in (SendResult(*FIELDS), TupleSendResult(*FIELDS)):
        with pytest.raises(error):
            call(result)


def test_sent_results_equal_the_pure_python_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """send and send_batch give the same fields on both paths (but the store id), and
    each path's stored_at is the float of the stored nanoseconds a pull gives back. (In
    one process both paths build the C type: the NamedTuple is a pure process's, as the
    pickling test below shows.)"""
    fast, fast_batch, fast_single, fast_first = sent(tmp_path / "c")
    monkeypatch.setattr(speedups, "SPEEDUPS", None)
    slow, slow_batch, slow_single, slow_first = sent(tmp_path / "py")
    assert type(fast) is SendResult and {type(r) for r in fast_batch} == {SendResult}
    for c, t in zip([fast, *fast_batch], [slow, *slow_batch], strict=True):
        assert c[1:5] == t[1:5] and c.message_id[8:] == t.message_id[8:]
        assert c.message_id[:8] == fast.message_id[:8] and len(c.message_id) == 24
    assert fast.stored_at == fast_single and slow.stored_at == slow_single
    assert fast_batch[0].stored_at == fast_first and slow_batch[0].stored_at == slow_first


@needs_c
def test_fields_made_on_first_read_are_kept_and_nothing_is_tracked(tmp_path: Path) -> None:
    one, batch, _, _ = sent(tmp_path / "s")
    assert not gc.is_tracked(one) and not gc.is_tracked(SendResult(*FIELDS))
    assert gc.get_referents(one) == []  # (nothing the collector could walk through)
    for result in (one, batch[1]):
        for name in ("message_id", "queue_offset", "position", "stored_at"):
            assert getattr(result, name) is getattr(result, name)
        assert result[0] is result.message_id and list(result)[5] is result.stored_at
        assert result.message_id.endswith(f"{result.position:016x}")


@needs_c
def test_results_are_freed_by_reference_counting(tmp_path: Path) -> None:
    """Results never read, and results read field by field: freed when dropped, with the
    garbage collector off, and their topic's reference count back where it was."""
    with MessageStore.open(tmp_path / "s", CONFIG) as store:
        store.create_topic("t", 2)
        topic = store.send("t", b"x").topic
        store.send_batch("t", [b"y"] * 2)  # (whatever the first batch keeps)
        gc.disable()
        try:
            before = sys.getrefcount(topic)
            results = [store.send("t", b"x") for _ in range(200)]
            results += store.send_batch("t", [b"y"] * 200)
            assert sys.getrefcount(topic) == before + 400
            read = [tuple(r) for r in results[::2]]
            assert len(read) == 200 and sys.getrefcount(topic) == before + 600
            del results, read
            assert sys.getrefcount(topic) == before
        finally:
            gc.enable()


def test_client_columns_unpack_to_the_paths_type() -> None:
    """The client's send_bodies answer becomes SendResults (the C type with the
    accelerator) equal to what was packed."""
    packed = pack_send_columns("t", [TupleSendResult(*FIELDS)] * 2)
    got = unpack_send_columns([packed[0], *map(list, packed[1:])], "test")
    assert got == [TupleSendResult(*FIELDS)] * 2 and type(got[0]) is SendResult


@needs_c
def test_pickled_between_the_c_and_the_pure_python_process(tmp_path: Path) -> None:
    """A C SendResult unpickles as the NamedTuple in a process without the accelerator
    (multiprocessing, Spark), and back; equal both ways."""
    one, _, _, _ = sent(tmp_path / "s")
    program = (
        "import pickle, sys; from equeue.store.types import SendResult, TupleSendResult;"
        "r = pickle.load(sys.stdin.buffer); assert type(r) is TupleSendResult, type(r);"
        "sys.stdout.buffer.write(pickle.dumps(r._replace(queue_offset=5)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], input=pickle.dumps(one), capture_output=True,
        env={**os.environ, "EQUEUE_PURE_PYTHON": "1"}, timeout=60, check=True,
    )  # fmt: skip
    back = pickle.loads(done.stdout)
    assert type(back) is SendResult and back == one._replace(queue_offset=5)
    assert back != one and pickle.loads(pickle.dumps(one)) == one


class _Reduced:
    """Pickles as SendResult(*fields): what a pickle from elsewhere may hold."""

    def __init__(self, fields: tuple[Any, ...]) -> None:
        self.fields = fields

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return SendResult, self.fields


class _Sentinel:
    pass


class _Text(str):  # a str subclass's instance has a __dict__: a cycle can run through it
    pass


@needs_c
@pytest.mark.parametrize(
    "build",
    [
        lambda v: SendResult(FIELDS[0], "t", 1, 7, 74, v),
        lambda v: SendResult(FIELDS[0], "t", 1, 7, 74, stored_at=v),
        lambda v: SendResult._make((*FIELDS[:5], v)),
        lambda v: SendResult(*FIELDS)._replace(stored_at=v),
        lambda v: pickle.loads(pickle.dumps(_Reduced((*FIELDS[:5], v)))),
    ],
)
def test_a_container_that_could_refer_back_is_refused(build: Callable[[Any], Any]) -> None:
    """The C type is not known to the garbage collector: a hand-built result holding a
    container that refers back to it was never freed (a leak). Every way to build one
    refuses a value that is not a str, int, float, bool or None, naming the field (the
    sentinel in the container is freed with it), and keeps a str subclass's instance as
    its plain str."""
    for value in (1.5, 7, "s", True, None):  # the control: atomic values are taken
        assert build(value)[5] == value
    box: list[Any] = [_Sentinel()]
    alive = weakref.ref(box[0])
    with pytest.raises(InvalidTypeError, match="SendResult field stored_at is a list"):
        box.append(build(box))  # (the cycle, before: box -> result -> box)
    del box
    gc.collect()
    assert alive() is None
    text = _Text("x")  # kept as the plain str: nothing to refer back through
    assert type(build(text)[5]) is str and build(text)[5] == "x"
