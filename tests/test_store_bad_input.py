"""Every input rule of the store: the right error, a message naming the limit, nothing changed.

A rejected call must leave the store exactly as it was (queue ranges, the bytes
of every chunk file, topics and offsets) and the store must go on working.
"""

from __future__ import annotations

import datetime as dt
import math
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from code_paths import code_path  # noqa: F401 - the fixture
from store_helpers import settle_chunk_maker

from equeue import MessageStore, OutgoingMessage, StoreConfig
from equeue.atomicfile import decode_json, read_json, write_json
from equeue.errors import (
    ClosedError,
    ConfigError,
    CorruptionError,
    EQueueError,
    InvalidMessageError,
    InvalidTypeError,
    MessageTooLargeError,
    NotAStoreError,
    QueueNotFoundError,
    StoreWriteError,
    TopicNotFoundError,
)
from equeue.inspect.verify import verify_store
from equeue.store.topics import TopicPolicy

MAX_MESSAGE = 2000
MAX_SPAN = dt.timedelta(days=36_500)  # the longest retention (docs/compaction.md)
CONFIG = StoreConfig(
    chunk_data_size=4096,
    queue_chunk_records=400,
    default_queue_count=4,
    max_message_size=MAX_MESSAGE,
)
BUILTIN: dict[type[Exception], type[Exception]] = {
    ConfigError: ValueError,
    NotAStoreError: FileNotFoundError,
    InvalidMessageError: ValueError,
    MessageTooLargeError: ValueError,
    InvalidTypeError: TypeError,
    QueueNotFoundError: LookupError,
    TopicNotFoundError: LookupError,
}

Snapshot = tuple[Any, ...]
FALSY: list[object] = [0, [], ""]
pytestmark = pytest.mark.usefixtures("code_path")  # each test on the C and the Python paths


@pytest.fixture
def store(tmp_path: Path) -> Iterator[MessageStore]:
    with MessageStore.open(tmp_path / "store", CONFIG) as s:
        s.create_topic("t")
        for i in range(30):
            body, key = b"m%d" % i * 20, f"k{i % 4}"
            s.send("t", body, tag="g", key=key, properties={"i": str(i)}, queue_id=i % 4)
        s.commit_offset("g", "t", 0, 2)
        yield s


def snapshot(store: MessageStore) -> Snapshot:
    settle_chunk_maker(store)  # its file made ahead, not the rejected call, would differ
    files = {}
    for sub in ("messages", "queues"):
        for path in sorted((store.path / sub).rglob("*")):
            if path.is_file():
                files[str(path.relative_to(store.path))] = path.read_bytes()
    for name in ("topics.json", "topics.journal", "offsets.json"):  # (topics.json: at a fold)
        files[name] = (store.path / name).read_bytes() if (store.path / name).exists() else b""
    ranges = {(t, q): store.queue_range(t, q) for t in store.topics() for q in store.queue_ids(t)}
    return (store.topics(), ranges, store.consumer_groups(), files)


def still_works(store: MessageStore, before: Snapshot) -> None:
    assert snapshot(store) == before
    result = store.send("t", b"good", tag="ok", key="good-key", queue_id=1)
    assert result.queue_offset == before[1][("t", 1)][1]
    [message] = store.pull("t", 1, result.queue_offset).messages
    assert (message.body, message.tag, message.key) == (b"good", "ok", "good-key")


# (send keyword arguments, expected error, fragments the message must contain)
CASES = [
    # topic
    pytest.param({"topic": ""}, InvalidMessageError, ["empty"], id="topic-empty"),
    pytest.param({"topic": "a" * 256}, InvalidMessageError, ["256", "255"], id="topic-256"),
    pytest.param({"topic": "\u00e9" * 128}, InvalidMessageError, ["256", "255"], id="topic-utf8"),
    pytest.param({"topic": "has space"}, InvalidMessageError, ["A-Za-z0-9._-"], id="topic-space"),
    pytest.param({"topic": "a/b"}, InvalidMessageError, ["A-Za-z0-9._-"], id="topic-slash"),
    pytest.param({"topic": "a.b-c_D9"}, None, [], id="topic-punctuation-ok"),
    *[
        pytest.param(
            {"topic": dots},
            InvalidMessageError,
            ["topic"],
            id=f"topic-{len(dots)}-dots",
        )
        for dots in (".", "..")
    ],
    pytest.param({"topic": "caf\u00e9"}, InvalidMessageError, ["A-Za-z0-9._-"], id="topic-accent"),
    pytest.param({"topic": "t\n"}, InvalidMessageError, ["A-Za-z0-9._-"], id="topic-newline"),
    pytest.param({"topic": 5}, InvalidTypeError, ["topic", "int"], id="topic-int"),
    pytest.param({"topic": None}, InvalidTypeError, ["topic"], id="topic-none"),
    pytest.param({"topic": b"t"}, InvalidTypeError, ["topic", "bytes"], id="topic-bytes"),
    pytest.param(
        {"topic": ["t"]},
        InvalidTypeError,
        ["topic"],
        id="topic-list",
    ),
    pytest.param(
        {"topic": "\ud800"},
        InvalidMessageError,
        ["topic"],
        id="topic-surrogate",
    ),
    # tag
    pytest.param({"tag": "\u00e9" * 128}, InvalidMessageError, ["256", "255"], id="tag-2byte"),
    pytest.param({"tag": "\u20ac" * 100}, InvalidMessageError, ["300", "255"], id="tag-3byte"),
    pytest.param({"tag": "a" * 256}, InvalidMessageError, ["256", "255"], id="tag-256"),
    pytest.param({"tag": "a" * 255}, None, [], id="tag-255-ok"),
    pytest.param({"tag": 5}, InvalidTypeError, ["tag", "int"], id="tag-int"),
    pytest.param({"tag": None}, InvalidTypeError, ["tag"], id="tag-none"),
    pytest.param({"tag": b"g"}, InvalidTypeError, ["tag", "bytes"], id="tag-bytes"),
    pytest.param({"tag": "\udc80"}, InvalidMessageError, ["tag"], id="tag-surrogate"),
    # key
    pytest.param({"key": "\u20ac" * 100}, InvalidMessageError, ["300", "255"], id="key-3byte"),
    pytest.param({"key": "\U0001f600" * 64}, InvalidMessageError, ["256", "255"], id="key-4byte"),
    pytest.param({"key": "k" * 256}, InvalidMessageError, ["256", "255"], id="key-256"),
    pytest.param({"key": "\u20ac" * 85}, None, [], id="key-255-ok"),
    pytest.param({"key": 5}, InvalidTypeError, ["key", "int"], id="key-int"),
    pytest.param({"key": b"k"}, InvalidTypeError, ["key", "bytes"], id="key-bytes"),
    pytest.param({"key": "\ud800"}, InvalidMessageError, ["key"], id="key-surrogate"),
    # properties
    pytest.param(
        {"properties": {"a": "x" * 33_000}},
        MessageTooLargeError,
        ["33005", "32768", "max_properties_size"],
        id="properties-big-value",
    ),
    pytest.param(
        {"properties": {f"key{i:04d}": "v" * 100 for i in range(400)}},
        MessageTooLargeError,
        ["32768", "max_properties_size"],
        id="properties-many",
    ),
    pytest.param(
        {"properties": {"a": "x" * 70_000}},
        MessageTooLargeError,
        ["65535"],
        id="properties-value-over-u16",
    ),
    pytest.param({"properties": {1: "a"}}, InvalidTypeError, ["properties", "int"], id="prop-key"),
    pytest.param({"properties": {"a": 1}}, InvalidTypeError, ["properties", "int"], id="prop-val"),
    pytest.param({"properties": {"a": None}}, InvalidTypeError, ["properties"], id="prop-none"),
    pytest.param({"properties": {"a": b"b"}}, InvalidTypeError, ["properties"], id="prop-bytes"),
    pytest.param({"properties": [("a", "b")]}, InvalidTypeError, ["properties"], id="prop-list"),
    pytest.param({"properties": "a=b"}, InvalidTypeError, ["properties", "str"], id="prop-str"),
    pytest.param({"properties": 5}, InvalidTypeError, ["properties", "int"], id="prop-int"),
    *[
        pytest.param(
            {"properties": falsy},
            InvalidTypeError,
            ["properties"],
            id=f"prop-falsy-{type(falsy).__name__}",
        )
        for falsy in FALSY
    ],
    pytest.param(
        {"properties": {"a": "\ud800"}},
        InvalidMessageError,
        ["properties"],
        id="prop-surrogate",
    ),
    # body
    pytest.param({"body": "text"}, InvalidTypeError, ["body", "str"], id="body-str"),
    pytest.param({"body": 5}, InvalidTypeError, ["body", "int"], id="body-int"),
    pytest.param({"body": None}, InvalidTypeError, ["body"], id="body-none"),
    pytest.param({"body": [1, 2]}, InvalidTypeError, ["body", "list"], id="body-list"),
    pytest.param(
        {"body": b"x" * (MAX_MESSAGE + 1)},
        MessageTooLargeError,
        ["2001", "2000", "max_message_size"],
        id="body-too-big",
    ),
    pytest.param(
        {"body": bytearray(MAX_MESSAGE + 1)},
        MessageTooLargeError,
        ["2001", "2000", "max_message_size"],
        id="body-bytearray-too-big",
    ),
    pytest.param(
        {"body": memoryview(b"y" * (MAX_MESSAGE + 5))},
        MessageTooLargeError,
        ["2005", "2000", "max_message_size"],
        id="body-memoryview-too-big",
    ),
    pytest.param({"body": b"x" * MAX_MESSAGE}, None, [], id="body-max-ok"),
    pytest.param(
        {"body": b"x" * MAX_MESSAGE, "properties": {"p": "v" * 2000}},
        InvalidMessageError,
        ["chunk_data_size", "4096"],
        id="message-larger-than-chunk",
    ),
    # code
    pytest.param({"code": "1"}, InvalidTypeError, ["code", "str"], id="code-str"),
    pytest.param({"code": 1.0}, InvalidTypeError, ["code", "float"], id="code-float"),
    pytest.param({"code": None}, InvalidTypeError, ["code"], id="code-none"),
    pytest.param({"code": True}, InvalidTypeError, ["code", "bool"], id="code-bool"),
    pytest.param({"code": 1 << 31}, InvalidMessageError, ["2147483648", "32-bit"], id="code-high"),
    pytest.param(
        {"code": -(1 << 31) - 1}, InvalidMessageError, ["-2147483649", "32-bit"], id="code-low"
    ),
    pytest.param({"code": 1 << 70}, InvalidMessageError, ["32-bit"], id="code-huge"),
    pytest.param({"code": -(1 << 31)}, None, [], id="code-min-ok"),
    # queue id
    pytest.param({"queue_id": 4}, QueueNotFoundError, ["4", "0..3"], id="queue-4"),
    pytest.param({"queue_id": -1}, QueueNotFoundError, ["-1", "0..3"], id="queue-negative"),
    pytest.param({"queue_id": 1 << 40}, QueueNotFoundError, ["0..3"], id="queue-huge"),
    pytest.param({"queue_id": "0"}, InvalidTypeError, ["queue_id", "str"], id="queue-str"),
    pytest.param({"queue_id": 1.0}, InvalidTypeError, ["queue_id", "float"], id="queue-float"),
    pytest.param({"queue_id": True}, InvalidTypeError, ["queue_id", "bool"], id="queue-bool"),
    pytest.param({"queue_id": 3}, None, [], id="queue-3-ok"),
]


def check_error(exc: BaseException, expected: type[Exception], fragments: list[str]) -> None:
    assert isinstance(exc, expected), repr(exc)
    assert isinstance(exc, EQueueError)
    assert isinstance(exc, BUILTIN[expected])
    for fragment in fragments:
        assert fragment in str(exc), (fragment, str(exc))


def call_send(store: MessageStore, arguments: dict[str, Any]) -> None:
    arguments = dict(arguments)
    topic = arguments.pop("topic", "t")
    body = arguments.pop("body", b"body")
    store.send(topic, body, **arguments)


def call_send_batch(store: MessageStore, arguments: dict[str, Any]) -> None:
    arguments = dict(arguments)
    topic = arguments.pop("topic", "t")
    bad = OutgoingMessage(**{"body": b"body", **arguments})
    store.send_batch(topic, [b"first good", OutgoingMessage(b"second good", key="k1"), bad])


def call_send_batch_dict(store: MessageStore, arguments: dict[str, Any]) -> None:
    arguments = dict(arguments)
    topic = arguments.pop("topic", "t")
    store.send_batch(topic, [OutgoingMessage(b"good", queue_id=0), {"body": b"body", **arguments}])


@pytest.mark.parametrize("call", [call_send, call_send_batch, call_send_batch_dict])
@pytest.mark.parametrize(("arguments", "expected", "fragments"), CASES)
def test_bad_input(
    store: MessageStore,
    call: Any,
    arguments: dict[str, Any],
    expected: type[Exception] | None,
    fragments: list[str],
) -> None:
    before = snapshot(store)
    if expected is None:  # the limit itself is allowed
        call(store, arguments)
        assert snapshot(store) != before
        return
    with pytest.raises(Exception) as info:
        call(store, arguments)
    check_error(info.value, expected, fragments)
    still_works(store, before)


@pytest.mark.parametrize("batch", [False, True])
def test_rejected_send_to_new_topic_creates_nothing(store: MessageStore, batch: bool) -> None:
    before = snapshot(store)
    with pytest.raises(MessageTooLargeError):
        if batch:
            store.send_batch("fresh", [b"ok", b"x" * (MAX_MESSAGE + 1)])
        else:
            store.send("fresh", b"x" * (MAX_MESSAGE + 1))
    assert store.topics() == ["t"]
    assert not (store.path / "queues" / "fresh").exists()
    still_works(store, before)


@pytest.mark.parametrize(
    "items",
    [
        pytest.param([b"ok", 5], id="int-item"),
        pytest.param([b"ok", "text"], id="str-item"),
        pytest.param([b"ok", None], id="none-item"),
        pytest.param([b"ok", (b"tuple",)], id="plain-tuple"),
    ],
)
def test_send_batch_bad_item_type(store: MessageStore, items: list[Any]) -> None:
    before = snapshot(store)
    with pytest.raises(InvalidTypeError, match="send_batch"):
        store.send_batch("t", items)
    still_works(store, before)


def test_send_batch_unknown_field(store: MessageStore) -> None:
    before = snapshot(store)
    with pytest.raises(TypeError):
        store.send_batch("t", [b"ok", {"body": b"x", "colour": "red"}])
    still_works(store, before)


def test_send_batch_bad_message_late_in_a_long_batch(store: MessageStore) -> None:
    """The bad message comes after enough good ones to fill several chunks."""
    before = snapshot(store)
    good = [OutgoingMessage(b"g" * 500, key=f"k{i}") for i in range(40)]
    with pytest.raises(MessageTooLargeError):
        store.send_batch("t", [*good, OutgoingMessage(b"x" * (MAX_MESSAGE + 1))])
    still_works(store, before)
    assert store.query_by_key("t", "k39") == []


# --- reading and offsets ------------------------------------------------------------


@pytest.mark.parametrize(
    ("arguments", "expected", "fragments"),
    [
        pytest.param({"topic": "nope"}, TopicNotFoundError, ["nope"], id="unknown-topic"),
        pytest.param({"topic": ""}, InvalidMessageError, ["empty"], id="empty-topic"),
        pytest.param({"topic": 5}, InvalidTypeError, ["topic"], id="topic-int"),
        pytest.param({"queue_id": 4}, QueueNotFoundError, ["0..3"], id="queue-4"),
        pytest.param({"queue_id": "1"}, InvalidTypeError, ["queue_id"], id="queue-str"),
        pytest.param({"offset": -1}, InvalidMessageError, ["offset", "-1"], id="offset-negative"),
        pytest.param({"offset": "0"}, InvalidMessageError, ["offset"], id="offset-str"),
        pytest.param({"offset": True}, InvalidMessageError, ["offset"], id="offset-bool"),
        pytest.param({"max_count": 0}, InvalidMessageError, ["max_count"], id="max-count-0"),
        pytest.param({"max_count": "5"}, InvalidMessageError, ["max_count"], id="max-count-str"),
        pytest.param({"tags": [1]}, InvalidTypeError, ["tags", "int"], id="tags-int"),
        pytest.param({"tags": ["a", None]}, InvalidTypeError, ["tags"], id="tags-none"),
        pytest.param({"tags": 5}, InvalidTypeError, ["tags", "iterable"], id="tags-int-alone"),
        pytest.param({"tags": b"g"}, InvalidTypeError, ["tags", "bytes"], id="tags-bytes"),
        pytest.param({"tags": ["\ud800"]}, InvalidMessageError, ["UTF-8"], id="tags-surrogate"),
        pytest.param({"wait": "1"}, InvalidTypeError, ["wait", "str"], id="wait-str"),
        pytest.param({"wait": None}, InvalidTypeError, ["wait"], id="wait-none"),
        pytest.param({"wait": 1e300}, InvalidMessageError, ["wait", "86400"], id="wait-huge"),
        pytest.param({"wait": 2**70}, InvalidMessageError, ["wait", "86400"], id="wait-huge-int"),
        pytest.param({"wait": -1}, InvalidMessageError, ["wait", "[0,"], id="wait-negative"),
        pytest.param({"wait": math.nan}, InvalidMessageError, ["wait", "finite"], id="wait-nan"),
        pytest.param({"wait": math.inf}, InvalidMessageError, ["wait", "finite"], id="wait-inf"),
        pytest.param({"topic": ["t"]}, InvalidTypeError, ["topic", "list"], id="topic-list"),
    ],
)
def test_bad_pull(
    store: MessageStore, arguments: dict[str, Any], expected: type[Exception], fragments: list[str]
) -> None:
    before = snapshot(store)
    call = {"topic": "t", "queue_id": 0, "offset": 0, **arguments}
    with pytest.raises(Exception) as info:
        store.pull(**call)
    check_error(info.value, expected, fragments)
    still_works(store, before)


@pytest.mark.parametrize(
    ("arguments", "expected", "fragments"),
    [
        pytest.param({"group": ""}, InvalidMessageError, ["group", "255"], id="group-empty"),
        pytest.param({"group": "g" * 256}, InvalidMessageError, ["255"], id="group-long"),
        pytest.param({"group": 5}, InvalidMessageError, ["group"], id="group-int"),
        pytest.param({"topic": "nope"}, TopicNotFoundError, ["nope"], id="unknown-topic"),
        pytest.param({"queue_id": 9}, QueueNotFoundError, ["0..3"], id="queue-9"),
        pytest.param({"offset": -5}, InvalidMessageError, ["offset", "-5"], id="offset-negative"),
        pytest.param({"offset": 1.5}, InvalidMessageError, ["offset"], id="offset-float"),
        pytest.param({"group": "\ud800"}, InvalidMessageError, ["UTF-8"], id="group-surrogate"),
        pytest.param({"group": ["g"]}, InvalidMessageError, ["group"], id="group-list"),
        pytest.param({"topic": ["t"]}, InvalidTypeError, ["topic"], id="topic-list"),
        pytest.param(
            {"offset": 10**6}, InvalidMessageError, ["past the queue's end", "[0, "], id="past-end"
        ),
    ],
)
def test_bad_commit_offset(
    store: MessageStore, arguments: dict[str, Any], expected: type[Exception], fragments: list[str]
) -> None:
    before = snapshot(store)
    call = {"group": "g", "topic": "t", "queue_id": 0, "offset": 3, **arguments}
    with pytest.raises(Exception) as info:
        store.commit_offset(**call)
    check_error(info.value, expected, fragments)
    still_works(store, before)
    assert store.committed_offset("g", "t", 0) == 2


@pytest.mark.parametrize(
    ("arguments", "expected", "fragments"),
    [
        pytest.param({"topic": "bad topic"}, InvalidMessageError, ["A-Za-z"], id="bad-topic"),
        pytest.param({"queue_count": 0}, InvalidMessageError, ["[1, 1024]"], id="count-0"),
        pytest.param({"queue_count": 1025}, InvalidMessageError, ["[1, 1024]"], id="count-1025"),
        pytest.param({"queue_count": "2"}, InvalidTypeError, ["queue_count"], id="count-str"),
        pytest.param(
            {"retention": dt.timedelta.max},
            ConfigError,
            ["retention", "(0, 36500 days]"],
            id="retention-max",
        ),
        pytest.param(
            {"retention": MAX_SPAN + dt.timedelta(microseconds=1)},
            ConfigError,
            ["retention", "36500 days"],
            id="retention-just-over",
        ),
        pytest.param(
            {"delete_retention": dt.timedelta.max},
            ConfigError,
            ["delete_retention", "[0, 36500 days]"],
            id="delete-retention-max",
        ),
        pytest.param(
            {"retention": dt.timedelta(0)}, ConfigError, ["retention", "(0, "], id="retention-0"
        ),
        pytest.param({"retention": 5}, ConfigError, ["retention", "timedelta"], id="retention-int"),
    ],
)
def test_bad_create_topic(
    store: MessageStore, arguments: dict[str, Any], expected: type[Exception], fragments: list[str]
) -> None:
    before = snapshot(store)
    for topic in ("new", "t"):  # a new topic, and a change to an existing one
        call = {"topic": topic, "queue_count": 4, **arguments}
        with pytest.raises(Exception) as info:
            store.create_topic(**call)
        check_error(info.value, expected, fragments)
        still_works(store, before)
        before = snapshot(store)
    path = store.path
    store.close()
    with MessageStore.open(path, CONFIG) as again:  # (a timedelta.max made this fail)
        assert again.topic_policy("t") == TopicPolicy()
        assert again.recovery.problems == []


def test_bad_query_by_key(store: MessageStore) -> None:
    before = snapshot(store)
    with pytest.raises(InvalidMessageError, match="255"):
        store.query_by_key("t", "\u20ac" * 100)
    with pytest.raises(InvalidTypeError):
        store.query_by_key("t", 5)  # type: ignore[arg-type]
    with pytest.raises(TopicNotFoundError):
        store.query_by_key("nope", "k")
    for limit, expected, fragment in [
        (2.5, InvalidTypeError, "float"),
        (True, InvalidTypeError, "bool"),
        ("3", InvalidTypeError, "str"),
        (2**70, InvalidMessageError, "[1, 2147483647]"),
        (0, InvalidMessageError, "[1, 2147483647]"),
        (-1, InvalidMessageError, "[1, 2147483647]"),  # (SQLite's "no limit")
    ]:
        with pytest.raises(Exception) as info:
            store.query_by_key("t", "k1", limit=limit)  # type: ignore[arg-type]
        check_error(info.value, expected, ["limit", fragment])
    assert len(store.query_by_key("t", "k1", limit=3)) == 3  # the control
    still_works(store, before)


@pytest.mark.parametrize(
    ("timestamp", "expected", "fragments"),
    [
        pytest.param("now", InvalidTypeError, ["timestamp", "str"], id="str"),
        pytest.param(None, InvalidTypeError, ["timestamp", "NoneType"], id="none"),
        pytest.param(True, InvalidTypeError, ["timestamp", "bool"], id="bool"),
        pytest.param(math.nan, InvalidMessageError, ["timestamp", "finite"], id="nan"),
    ],
)
def test_bad_offset_for_time(
    store: MessageStore, timestamp: Any, expected: type[Exception], fragments: list[str]
) -> None:
    before = snapshot(store)
    with pytest.raises(Exception) as info:
        store.offset_for_time("t", 0, timestamp)
    check_error(info.value, expected, fragments)
    assert store.offset_for_time("t", 0, 0) == 0  # the controls
    assert store.offset_for_time("t", 0, 2**70) == store.queue_range("t", 0)[1]
    assert store.offset_for_time("t", 0, dt.datetime.now(dt.UTC)) == store.queue_range("t", 0)[1]
    still_works(store, before)


@pytest.mark.parametrize(
    ("now", "expected", "fragments"),
    [
        pytest.param(math.nan, InvalidMessageError, ["now", "finite"], id="nan"),
        pytest.param(math.inf, InvalidMessageError, ["now", "finite"], id="inf"),
        pytest.param(1e300, InvalidMessageError, ["now", "out of range"], id="huge"),
        pytest.param(-1.0, InvalidMessageError, ["now", "out of range"], id="negative"),
        pytest.param("now", InvalidTypeError, ["now", "str"], id="str"),
    ],
)
def test_bad_apply_retention(
    tmp_path: Path, now: Any, expected: type[Exception], fragments: list[str]
) -> None:
    config = StoreConfig(
        chunk_data_size=4096, queue_chunk_records=400, retention=dt.timedelta(seconds=1)
    )
    with MessageStore.open(tmp_path / "store", config) as store:
        for i in range(60):  # several chunks, all past retention for a later now
            store.send("t", b"m%d" % i * 30, queue_id=0)
        store.commit_offset("g", "t", 0, 1)
        before = snapshot(store)
        with pytest.raises(Exception) as info:
            store.apply_retention(now=now)
        check_error(info.value, expected, fragments)
        assert snapshot(store) == before
        assert store.apply_retention(now=4e9) > 0  # the control: a valid now removes chunks


@pytest.mark.parametrize(
    ("messages", "fragment"),
    [
        pytest.param(None, "NoneType", id="none"),
        pytest.param(5, "int", id="int"),
        pytest.param(b"abc", "bytes", id="bytes"),
        pytest.param({"body": b"x"}, "dict", id="one-dict"),
    ],
)
def test_send_batch_not_iterable(store: MessageStore, messages: Any, fragment: str) -> None:
    before = snapshot(store)
    with pytest.raises(Exception) as info:
        store.send_batch("t", messages)
    check_error(info.value, InvalidTypeError, ["send_batch", fragment])
    assert snapshot(store) == before
    assert len(store.send_batch("t", iter([b"a", b"b"]))) == 2  # the control: any iterable


def test_open_not_a_store_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    regular = tmp_path / "file"
    regular.write_bytes(b"not a store")
    monkeypatch.chdir(tmp_path)
    cases: list[tuple[Any, type[Exception], str]] = [
        (regular, NotAStoreError, "not a directory"),
        (str(regular), NotAStoreError, "not a directory"),
        (regular / "below", NotAStoreError, "not a directory"),
        ("", NotAStoreError, "empty"),
        ("a\0b", NotAStoreError, "NUL"),
        ("\ud800", NotAStoreError, "not encodable"),  # (found by tests/test_store_fuzz.py)
        ("a" * 300, NotAStoreError, "File name too long"),
        (5, InvalidTypeError, "int"),
        (None, InvalidTypeError, "NoneType"),
        (b"store", InvalidTypeError, "bytes"),
    ]
    for read_only in (False, True):
        for path, expected, fragment in cases:
            with pytest.raises(Exception) as info:
                MessageStore.open(path, CONFIG, read_only=read_only)
            check_error(info.value, expected, [fragment])
    with pytest.raises(InvalidTypeError, match="config"):
        MessageStore.open(tmp_path / "s", {"chunk_data_size": 4096})  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match="read_only"):
        MessageStore.open(tmp_path / "s", CONFIG, read_only="no")  # type: ignore[arg-type]
    with pytest.raises(StoreWriteError, match="cannot create the store directory /proc/"):
        MessageStore.open("/proc/no-such-process/store", CONFIG)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # nothing created
    assert regular.read_bytes() == b"not a store"
    MessageStore.open("s", CONFIG).close()  # the control: a relative path
    assert (tmp_path / "s" / "store.json").is_file()


def test_commit_offset_up_to_the_queue_end(store: MessageStore) -> None:
    end = store.queue_range("t", 1)[1]
    store.commit_offset("g", "t", 1, end)  # the end itself: everything consumed
    assert store.committed_offset("g", "t", 1) == end
    before = snapshot(store)
    with pytest.raises(InvalidMessageError, match=rf"\[0, {end}\]"):
        store.commit_offset("g", "t", 1, end + 1)
    still_works(store, before)
    assert store.committed_offset("g", "t", 1) == end


# --- retention settings out of range ---------------------------------------------------


def test_store_config_retention_range() -> None:
    from equeue.store import validate

    assert validate.MAX_SPAN == MAX_SPAN
    for bad in (dt.timedelta.max, MAX_SPAN + dt.timedelta(seconds=1), dt.timedelta(0)):
        with pytest.raises(ConfigError, match=r"StoreConfig\.retention=.*36500 days"):
            StoreConfig(retention=bad)
    assert StoreConfig(retention=MAX_SPAN).retention == MAX_SPAN


def test_longest_retention_survives_reopen(tmp_path: Path) -> None:
    path = tmp_path / "store"
    with MessageStore.open(path, CONFIG) as store:
        store.create_topic("t", 1, retention=MAX_SPAN, delete_retention=MAX_SPAN)
        store.create_topic("u", 1, retention=MAX_SPAN - dt.timedelta(microseconds=1))
    with MessageStore.open(path, CONFIG) as store:
        assert store.topic_policy("t") == TopicPolicy("delete", MAX_SPAN, MAX_SPAN)
        assert store.topic_policy("u").retention == MAX_SPAN - dt.timedelta(microseconds=1)
        assert store.recovery.problems == []


@pytest.mark.parametrize("read_only", [False, True])
def test_topics_json_with_too_long_retention(tmp_path: Path, read_only: bool) -> None:
    """A topics.json an older version wrote with retention=timedelta.max (or inf): the
    store opens, the span is read as the longest accepted, and the open reports it."""
    path = tmp_path / "store"
    with MessageStore.open(path, CONFIG) as store:
        store.create_topic("t", 2, retention=dt.timedelta(days=1))
        store.create_topic("u", 2)
        store.send("t", b"kept", queue_id=0)
    topics = read_json(path / "topics.json")
    topics["t"]["retention_seconds"] = dt.timedelta.max.total_seconds()  # 8.64e13
    topics["t"]["delete_retention_seconds"] = math.inf
    write_json(path / "topics.json", topics)  # a valid checksum: what the old version wrote
    with MessageStore.open(path, CONFIG, read_only=read_only) as store:
        assert store.topic_policy("t") == TopicPolicy("delete", MAX_SPAN, MAX_SPAN)
        assert store.topic_policy("u") == TopicPolicy()  # the control
        problems = store.recovery.problems
        assert len(problems) == 2, problems
        assert all("topics.json" in p and "36500 days" in p for p in problems), problems
        assert "retention of 8.64e+13 seconds" in problems[0], problems
        assert [m.body for m in store.pull("t", 0, 0).messages] == [b"kept"]
        store.refresh()  # reads topics.json again: reported once
        assert len(store.recovery.problems) == 2 and len(store._meta_problems) == 2
        if not read_only:
            store.create_topic("t", retention=dt.timedelta(days=2))  # rewrites it
    if not read_only:
        with MessageStore.open(path, CONFIG) as store:
            assert store.topic_policy("t") == TopicPolicy("delete", dt.timedelta(days=2), MAX_SPAN)
            assert store.recovery.problems == []  # written back as the clamped value


# --- pulls past the end -----------------------------------------------------------------


def test_pull_past_the_end_returns_the_end(store: MessageStore) -> None:
    end = store.queue_range("t", 2)[1]
    for offset in (end, end + 1, end + 10**6, 2**70):
        result = store.pull("t", 2, offset)
        assert (result.messages, result.next_offset) == ([], end)
        result = store.pull("t", 2, offset, tags=["g"])
        assert (result.messages, result.next_offset) == ([], end)
    held = store.pull("t", 2, end + 5).next_offset  # a consumer goes on from here
    sent = store.send("t", b"next", queue_id=2)
    assert sent.queue_offset == end
    result = store.pull("t", 2, held)
    assert [m.body for m in result.messages] == [b"next"]
    assert result.next_offset == end + 1
    # The control: from inside the queue, as before.
    assert store.pull("t", 2, end - 1, max_count=1).next_offset == end


@pytest.mark.parametrize("wait", [0.0, 10.0])
def test_read_only_pull_past_the_end(store: MessageStore, wait: float) -> None:
    end = store.queue_range("t", 3)[1]
    with MessageStore.open(store.path, read_only=True) as reader:
        result = reader.pull("t", 3, end + 1000)
        assert (result.messages, result.next_offset) == ([], end)
        sender = threading.Timer(0.2, lambda: store.send("t", b"later", queue_id=3))
        sender.start()
        try:
            if wait:  # waits past the end see the writer's next message
                result = reader.pull("t", 3, end + 1000, wait=wait)
            else:
                sender.join()
                store.flush()
                result = reader.pull("t", 3, end + 1000)
                assert (result.messages, result.next_offset) == ([], end + 1)
                result = reader.pull("t", 3, end)
        finally:
            sender.join()
        assert [m.body for m in result.messages] == [b"later"]
        assert result.next_offset == end + 1


def test_closed_store_refuses_writes(tmp_path: Path) -> None:
    path = tmp_path / "store"
    s = MessageStore.open(path, CONFIG)
    s.send("t", b"x", queue_id=0)
    s.close()
    s.close()  # idempotent
    with pytest.raises(ClosedError):
        s.send("t", b"y", queue_id=0)
    with pytest.raises(ClosedError):
        s.send_batch("t", [b"y"])
    with pytest.raises(ClosedError):
        s.commit_offset("g", "t", 0, 1)
    with pytest.raises(ClosedError):
        s.flush()
    with MessageStore.open(path, CONFIG) as again:
        assert again.queue_range("t", 0) == (0, 1)
        assert again.committed_offset("g", "t", 0) is None


def test_a_store_opened_by_a_relative_path_stays_whole_after_a_chdir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A daemon that changes directory after opening must not split the store."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    with MessageStore.open("s") as store:
        store.send("t", b"before")
        store.commit_offset("g", "t", 0, 1)
        monkeypatch.chdir(tmp_path / "elsewhere")
        store.create_topic("u", 2)
        store.send("u", b"after", queue_id=1)
        assert store.committed_offset("g", "t", 0) == 1
        assert store.path == tmp_path / "s"
    assert list((tmp_path / "elsewhere").iterdir()) == []
    with MessageStore.open(tmp_path / "s") as reopened:
        assert reopened.topics() == ["t", "u"]
        assert [m.body for m in reopened.pull("u", 1, 0)] == [b"after"]
    assert verify_store(tmp_path / "s") == []


@pytest.mark.parametrize(
    "document,missing", [(b'{"body": {}}', "xxh64"), (b'{"xxh64": "00"}', "body")]
)
def test_a_metadata_document_without_a_field_says_which(
    tmp_path: Path, document: bytes, missing: str
) -> None:
    with pytest.raises(CorruptionError, match=f"unreadable metadata file \\(no '{missing}' field"):
        decode_json(document, tmp_path / "topics.json")
