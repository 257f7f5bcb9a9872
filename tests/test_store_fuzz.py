"""Every public MessageStore method called with junk: only equeue errors escape, a
rejected call changes no file of the store, and the store still verifies clean.

Runs on the C accelerator and on the pure-Python paths (the ``code_path`` fixture).
Valid values are mixed in so that calls get past their first argument to the later ones.
"""

from __future__ import annotations

import datetime as dt
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from code_paths import code_path  # noqa: F401 - the fixture
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from store_helpers import settle_chunk_maker

from equeue import MessageStore, OutgoingMessage, StoreConfig
from equeue.errors import EQueueError
from equeue.inspect.verify import verify_store

CONFIG = StoreConfig(
    chunk_data_size=4096, queue_chunk_records=400, default_queue_count=2, flush="os"
)
# What the service or a checkpoint may rewrite between calls; every other file is compared.
DERIVED = {"checkpoint.json", "tail.live", "keys.sqlite", "keys.sqlite-wal", "keys.sqlite-shm"}
MAX_WAIT = 86_400
pytestmark = pytest.mark.usefixtures("code_path")  # each test on the C and the Python paths

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**64), 2**64),
    st.sampled_from([2**70, -(2**70), 2**63, 2**31, -1, 0, 1, 3]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, 1e300, 2.5, -0.0]),
    st.text(st.characters(blacklist_categories=()), max_size=8),  # surrogates too
    st.sampled_from(["\ud800", "", "*", ".", "..", "../x", "/abs", "a" * 300, "t\0"]),
    st.binary(max_size=8),
    st.timedeltas(),
    st.sampled_from([dt.timedelta.max, dt.timedelta.min, dt.timedelta(0)]),
    st.datetimes(),
)
junk = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.one_of(st.text(max_size=4), st.integers()), inner, max_size=3),
        st.tuples(inner),
    ),
    max_leaves=6,
)
topics = st.one_of(st.sampled_from(["t", "t", "nope"]), junk)
queue_ids = st.one_of(st.sampled_from([0, 1, 2]), junk)
offsets = st.one_of(st.sampled_from([0, 1, 5, 100]), junk)
bodies = st.one_of(st.sampled_from([b"x", b"", bytearray(b"y")]), junk)
message_fields = st.fixed_dictionaries(
    {},
    optional={
        name: st.one_of(valid, junk)
        for name, valid in [
            ("body", st.just(b"b")),
            ("tag", st.just("g")),
            ("key", st.just("k")),
            ("properties", st.just({"a": "b"})),
            ("code", st.just(1)),
            ("queue_id", st.just(0)),
        ]
    },
)
batch_items = st.one_of(
    st.sampled_from([b"x", OutgoingMessage(b"y", key="k")]),
    message_fields,
    message_fields.map(lambda f: OutgoingMessage(**{"body": b"", **f})),  # type: ignore[arg-type]
    junk,
)


def _no_wait(wait: Any) -> Any:
    """A valid positive wait would block the test: only the invalid ones are kept."""
    if isinstance(wait, int | float) and not isinstance(wait, bool) and 0 < wait <= MAX_WAIT:
        return 0
    return wait


def _small_count(count: Any) -> Any:
    """A valid large queue count would create up to 1024 queue directories per example."""
    if isinstance(count, int) and not isinstance(count, bool) and 3 < count <= 1024:
        return 3
    return count


calls = st.one_of(
    st.tuples(st.just("create_topic"), st.tuples(topics, junk.map(_small_count)), st.just({})),
    st.tuples(
        st.just("create_topic"),
        st.tuples(topics),
        st.fixed_dictionaries(
            {}, optional={k: junk for k in ("cleanup", "retention", "delete_retention")}
        ),
    ),
    st.tuples(
        st.just("send"),
        st.tuples(topics, bodies),
        message_fields.map(lambda f: {k: v for k, v in f.items() if k != "body"}),
    ),
    st.tuples(
        st.just("send_batch"),
        st.tuples(topics, st.one_of(st.lists(batch_items, max_size=4), junk)),
        st.just({}),
    ),
    st.tuples(
        st.just("pull"),
        st.tuples(topics, queue_ids, offsets),
        st.fixed_dictionaries(
            {},
            optional={
                "max_count": st.one_of(st.just(2), junk),
                "tags": st.one_of(st.sampled_from(["g", ["g", "h"], "*"]), junk),
                "wait": junk.map(_no_wait),
            },
        ),
    ),
    st.tuples(st.just("read"), st.tuples(offsets), st.just({})),
    st.tuples(st.just("get"), st.tuples(junk), st.just({})),
    st.tuples(
        st.just("query_by_key"),
        st.tuples(topics, st.one_of(st.just("k"), junk)),
        st.fixed_dictionaries({}, optional={"limit": st.one_of(st.just(2), junk)}),
    ),
    st.tuples(st.just("offset_for_time"), st.tuples(topics, queue_ids, junk), st.just({})),
    st.tuples(
        st.just("queue_positions"),
        st.tuples(topics, queue_ids, offsets, st.one_of(st.just(2), junk)),
        st.just({}),
    ),
    st.tuples(
        st.just("commit_offset"),
        st.tuples(st.one_of(st.just("g"), junk), topics, queue_ids, offsets),
        st.just({}),
    ),
    st.tuples(
        st.just("committed_offset"),
        st.tuples(st.one_of(st.just("g"), junk), topics, queue_ids),
        st.just({}),
    ),
    st.tuples(st.just("topic_policy"), st.tuples(topics), st.just({})),
    st.tuples(st.just("queue_ids"), st.tuples(topics), st.just({})),
    st.tuples(st.just("queue_range"), st.tuples(topics, queue_ids), st.just({})),
    st.tuples(st.just("apply_retention"), st.tuples(junk), st.just({})),
    st.tuples(
        st.sampled_from(["topics", "consumer_groups", "flush", "refresh"]),
        st.just(()),
        st.just({}),
    ),
    st.tuples(
        st.just("open"),
        st.tuples(junk, junk),
        st.fixed_dictionaries({}, optional={"read_only": junk}),
    ),
)


def files(path: Path) -> dict[str, bytes | None]:
    """Every file of the store but the derived ones, with its bytes (None: a directory),
    once the chunk maker has settled (an accepted send's roll-over has the next file made)."""
    settle_chunk_maker()
    found: dict[str, bytes | None] = {}
    for item in sorted(path.rglob("*")):
        name = str(item.relative_to(path))
        if item.name in DERIVED or item.name == "LOCK":
            continue
        found[name] = None if item.is_dir() else item.read_bytes()
    return found


@pytest.fixture
def stores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[MessageStore]]:
    """The writer, and a read-only handle beside it."""
    scratch = tmp_path / "scratch"  # where open() of a junk relative path lands
    scratch.mkdir()
    monkeypatch.chdir(scratch)
    with MessageStore.open(tmp_path / "store", CONFIG) as s:
        s.create_topic("t", 2)
        for i in range(40):
            s.send("t", b"m%d" % i * 10, tag="g", key=f"k{i % 3}", queue_id=i % 2)
        s.commit_offset("g", "t", 0, 3)
        with MessageStore.open(tmp_path / "store", read_only=True) as reader:
            yield [s, reader]


def call(store: MessageStore, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if name == "open":
        opened = MessageStore.open(*args, **kwargs)
        opened.close()
        return
    getattr(store, name)(*args, **kwargs)


@settings(
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", "250")),
    deadline=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,  # one store for all examples, on purpose
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)
@given(st.lists(st.tuples(calls, st.sampled_from([0, 0, 1])), min_size=1, max_size=4))
def test_junk_arguments(stores: list[MessageStore], sequence: list[Any]) -> None:
    store = stores[0]
    for (name, args, kwargs), handle in sequence:
        before = files(store.path)
        try:
            call(stores[handle], name, args, kwargs)
        except EQueueError:
            assert files(store.path) == before, f"a rejected {name}{args!r} {kwargs!r} wrote"
        except Exception as exc:
            which = "the read-only handle's " if handle else ""
            pytest.fail(f"{which}{name}{args!r} {kwargs!r} raised {exc!r}")
    store.flush()
    assert verify_store(store.path) == []


def test_junk_run_ends_clean(stores: list[MessageStore]) -> None:
    """The control: the store the fuzz test starts from verifies clean and reads back."""
    stores[0].flush()
    assert verify_store(stores[0].path) == []
    for store in stores:
        assert len(store.pull("t", 0, 0, max_count=100).messages) == 20
