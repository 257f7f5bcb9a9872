"""Broker urls and the clients' argument checks, without a broker."""

from __future__ import annotations

import datetime as dt
import re
import ssl
from pathlib import Path
from typing import Any

import msgpack
import pytest

import equeue
from equeue.client import calls
from equeue.client.core import RequestEncoder, given
from equeue.client.url import parse_url
from equeue.errors import (
    ConfigError,
    FrameTooLargeError,
    InvalidMessageError,
    InvalidTypeError,
    MessageNotFoundError,
    MessageTooLargeError,
    QueueNotFoundError,
)
from equeue.protocol.frames import PROTOCOL_VERSION
from equeue.protocol.ops import check_args
from equeue.server.config import parse_listener
from equeue.store.types import OutgoingMessage

loose: Any = calls  # for calls with arguments of the wrong types


def test_urls() -> None:
    assert str(parse_url("unix:/run/eq.sock")) == "unix:/run/eq.sock"
    assert parse_url("unix:///run/eq.sock").path == "/run/eq.sock"
    assert parse_url("unix:rel/eq.sock").path == "rel/eq.sock"
    tcp = parse_url("tcp://127.0.0.1:7070")
    assert (tcp.kind, tcp.host, tcp.port) == ("tcp", "127.0.0.1", 7070)
    v6 = parse_url("tcp://[::1]:7070")
    assert (v6.host, str(v6)) == ("::1", "tcp://[::1]:7070")
    tls = parse_url("tls://localhost:7443")
    assert tls.kind == "tls" and isinstance(tls.ssl_context, ssl.SSLContext)
    context = ssl.create_default_context()
    assert parse_url("tls://h:1", ssl_context=context).ssl_context is context


def test_a_store_directory_means_its_broker_socket(tmp_path: Path) -> None:
    assert parse_url(tmp_path).path == str(tmp_path / "broker.sock")
    assert parse_url(str(tmp_path / "x.sock")).path == str(tmp_path / "x.sock")


@pytest.mark.parametrize(
    "url",
    [
        "", "unix:", "tcp://host", "tcp://:80", "tcp://h:0", "tcp://h:99999", "tcp://h:x",
        "tcp://h:1/path", "tcp://u@h:1", "http://h:1", "unix:/" + "a" * 120,
    ],
)  # fmt: skip
def test_bad_urls_are_config_errors(url: str) -> None:
    with pytest.raises(ConfigError):
        parse_url(url)


@pytest.mark.parametrize(
    ("port", "number"),
    [("08080", 8080), ("000080", 80), ("0" * 5000 + "7070", 7070), ("065535", 65535)],
)
def test_a_port_with_leading_zeros_is_its_number_to_serve_and_connect(
    port: str, number: int
) -> None:
    # round 20: `equeue serve --listen tcp://127.0.0.1:000080` was refused ("expected
    # tcp://HOST:PORT", the port's 6 characters past its 5-digit bound) while
    # equeue.connect took the same url as port 80 (urllib's int()), and 4,301 characters
    # of it as a ConfigError about sys.set_int_max_str_digits. Both read leading zeros as
    # getaddrinfo and urllib do: the port is the number the digits say.
    url = f"tcp://127.0.0.1:{port}"
    assert parse_url(url).port == number
    assert parse_listener(url).port == number
    assert parse_listener(f"tls://[::1]:{port}") == parse_listener(f"tls://[::1]:{number}")


@pytest.mark.parametrize(
    "port", ["65536", "9" * 20, "x", "+80", "-1", "8 0", " 80", "\u0663", "\u00b2", "1" * 5000]
)
def test_a_bad_port_is_refused_alike_by_serve_and_connect_naming_the_port(port: str) -> None:
    url = f"tcp://127.0.0.1:{port}"
    for parse, what in ((parse_url, "broker url"), (parse_listener, "listener")):
        with pytest.raises(ConfigError) as refused:
            parse(url)
        message = str(refused.value)
        said = f"{what} {url[:80]!r}: port {port[:20]!r} is not a number from 0 to 65535"
        assert message.startswith(said), message[:300]
        assert message.count("127.0.0.1") == 1 and len(message) < 300  # (the url once)


@pytest.mark.parametrize(
    ("url", "part"),
    [
        ("tcp://127.0.0.1", "no port after the host"),
        ("tcp://127.0.0.1:", "no port after the host"),
        ("tcp://[::1]", "no port after the host"),
        ("tcp://:80", "no host before the port"),
        ("tcp://127.0.0.1:80/x", "has more than tcp://HOST:PORT (a path, query or user)"),
    ],
)
def test_a_bad_listener_or_url_names_the_part_that_is_wrong(url: str, part: str) -> None:
    for parse in (parse_url, parse_listener):
        with pytest.raises(ConfigError, match=re.escape(part)) as refused:
            parse(url)
        assert str(refused.value).count(url) == 1


@pytest.mark.parametrize("url", ["tcp://[::1:80", "tcp://::1]:80", "tcp://[::1]x80"])
def test_a_listener_with_unbalanced_brackets_is_refused(url: str) -> None:
    # (main took tcp://[::1:80 as [::1]:80: strip("[]") dropped the lone bracket)
    with pytest.raises(ConfigError, match=re.escape("an IPv6 address is written [ADDRESS]:PORT")):
        parse_listener(url)
    with pytest.raises(ConfigError):
        parse_url(url)


def test_port_0_listens_on_any_free_port_and_names_no_broker_to_connect_to() -> None:
    assert parse_listener("tcp://127.0.0.1:00").port == 0
    with pytest.raises(ConfigError, match="port 0 names no listener"):
        parse_url("tcp://127.0.0.1:00")


def test_tls_options_only_with_tls(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a tls"):
        parse_url("tcp://h:1", cafile="x.pem")
    with pytest.raises(ConfigError, match="cafile"):
        parse_url("tls://h:1", cafile=tmp_path / "missing.pem")
    with pytest.raises(InvalidTypeError):
        parse_url(5)  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError):
        equeue.connect("unix:/x", timeout="1")
    with pytest.raises(ConfigError):
        equeue.connect("unix:/x", connect_timeout=0)


def test_calls_are_what_the_op_table_accepts() -> None:
    """Every call the clients make passes the broker's own argument check."""
    made = [
        loose.send("t", bytearray(b"b"), "tag", "k", {"a": "b"}, -5, 3),
        calls.send("t", b"", "", None, None, 0, None),
        calls.send_batch("t", [b"a", OutgoingMessage(b"b", tag="x"), {"body": b"c", "key": "k"}]),
        calls.pull("t", 0, 5, 10, ["a", "b"], 1.5, 100),
        calls.pull("t", 0, 0, 32, "a", 0.0001, None),
        calls.get("0" * 24),
        calls.query_by_key("t", "k", 3),
        calls.offset_for_time("t", 0, 1.5),
        calls.offset_for_time("t", 0, dt.datetime(2024, 5, 1, tzinfo=dt.UTC)),
        calls.commit_offset("g", "t", 1, 2),
        calls.create_topic("t", 4),
        calls.create_topic("t", None),
        calls.topics(),
        calls.queue_ids("t"),
        calls.queue_range("t", 2),
        calls.stats(),
        calls.ping(),
    ]
    committed = calls.committed_offset("g", "t", 0)
    assert committed is not None
    for call in [*made, committed]:
        check_args(call.op, call.args, "test")
        msgpack.packb(call.args, use_bin_type=True)
    assert made[4].args["wait_ms"] == 1  # a wait > 0 stays > 0
    assert made[4].wait == 0.001
    assert made[8].args["timestamp"] == 1714521600.0
    assert made[2].unanswered == [b"a", OutgoingMessage(b"b", tag="x"), {"body": b"c", "key": "k"}]
    body: Any = bytearray(b"b")
    assert given(made[0].unanswered) == [OutgoingMessage(body, "tag", "k", {"a": "b"}, -5, 3)]


@pytest.mark.parametrize(
    ("make", "error"),
    [
        (lambda: loose.send(1, b"", "", None, None, 0, None), InvalidTypeError),
        (lambda: loose.send("t", "text", "", None, None, 0, None), InvalidTypeError),
        (lambda: loose.send("t", b"", 1, None, None, 0, None), InvalidTypeError),
        (lambda: loose.send("t", b"", "", 1, None, 0, None), InvalidTypeError),
        (lambda: loose.send("t", b"", "", None, {"a": 1}, 0, None), InvalidTypeError),
        (lambda: loose.send("t", b"", "", None, [], 0, None), InvalidTypeError),
        (lambda: loose.send("t", b"", "", None, None, True, None), InvalidTypeError),
        (lambda: loose.send("t", b"", "", None, None, False, None), InvalidTypeError),
        (lambda: loose.send("t", b"", b"", None, None, 0, None), InvalidTypeError),
        (lambda: loose.send("t", b"", "", None, None, 1 << 40, None), InvalidMessageError),
        (lambda: loose.send("t", b"", "", None, None, 0, -1), QueueNotFoundError),
        (lambda: loose.send("t", b"", "", None, None, 0, 1.0), InvalidTypeError),
        (lambda: loose.send_batch("t", b"abc"), InvalidTypeError),
        (lambda: loose.send_batch("t", [b"a", 5]), InvalidTypeError),
        (lambda: loose.send_batch("t", [{"bod": b"a"}]), InvalidTypeError),
        (lambda: loose.send_batch("t", 5), InvalidTypeError),
        (lambda: loose.pull("t", -1, 0, 32, None, 0, None), QueueNotFoundError),
        (lambda: loose.pull("t", 0, -1, 32, None, 0, None), InvalidMessageError),
        (lambda: loose.pull("t", 0, 1.5, 32, None, 0, None), InvalidMessageError),
        (lambda: loose.pull("t", 0, 0, 0, None, 0, None), InvalidMessageError),
        (lambda: loose.pull("t", 0, 0, 32, None, -1, None), InvalidMessageError),
        (lambda: loose.pull("t", 0, 0, 32, None, float("nan"), None), InvalidMessageError),
        (lambda: loose.pull("t", 0, 0, 32, None, "1", None), InvalidTypeError),
        (lambda: loose.pull("t", 0, 0, 32, b"a", 0, None), InvalidTypeError),
        (lambda: loose.pull("t", 0, 0, 32, [1], 0, None), InvalidTypeError),
        (lambda: loose.pull("t", 0, 0, 32, None, 0, 0), InvalidMessageError),
        (lambda: loose.get(5), MessageNotFoundError),
        (lambda: loose.query_by_key("t", 5, 1), InvalidTypeError),
        (lambda: loose.query_by_key("t", "k", 0), InvalidMessageError),
        (lambda: loose.query_by_key("t", "k", "1"), InvalidTypeError),
        (lambda: loose.offset_for_time("t", 0, dt.datetime(2024, 5, 1)), InvalidMessageError),
        (lambda: loose.offset_for_time("t", 0, "now"), InvalidTypeError),
        (lambda: loose.offset_for_time("t", 0, float("inf")), InvalidMessageError),
        (lambda: loose.commit_offset(5, "t", 0, 0), InvalidMessageError),
        (lambda: loose.commit_offset("g", "t", 0, -2), InvalidMessageError),
        (lambda: loose.committed_offset("g", "t", "0"), InvalidTypeError),
        (lambda: loose.committed_offset(None, "t", 0), InvalidTypeError),
        (lambda: loose.create_topic("t", 0), InvalidMessageError),
        (lambda: loose.create_topic("t", "2"), InvalidTypeError),
        (lambda: loose.queue_range("t", True), InvalidTypeError),
    ],
)
def test_arguments_the_wire_cannot_carry_are_refused_before_sending(
    make: Any, error: type[Exception]
) -> None:
    with pytest.raises((error, calls.Probe)) as raised:  # a Probe: after the broker's lookup
        make()
    found = raised.value.error if isinstance(raised.value, calls.Probe) else raised.value
    assert isinstance(found, error)


def test_a_negative_queue_id_is_refused_by_committed_offset_after_the_topics_lookup() -> None:
    """As commit_offset (and the store): QueueNotFoundError, unless the broker's answer
    to the probe (queue_ids) says the topic is missing, which is reported first."""
    with pytest.raises(calls.Probe) as raised:
        calls.committed_offset("g", "t", -1)
    assert isinstance(raised.value.error, QueueNotFoundError)
    assert raised.value.call.op == "queue_ids"


def test_a_request_over_the_brokers_frame_limit_is_refused_before_sending() -> None:
    encoder = RequestEncoder(1024, "unix:/x", PROTOCOL_VERSION)
    assert len(encoder.frame(1, "send", {"topic": "t", "body": b"x" * 900})) < 1024
    with pytest.raises(MessageTooLargeError, match="max_frame_bytes=1024"):  # as the store
        encoder.frame(2, "send", {"topic": "t", "body": b"x" * 1100})
    with pytest.raises(FrameTooLargeError, match="a query_by_key request of"):
        encoder.frame(3, "query_by_key", {"topic": "t", "key": "k" * 1100})
    with pytest.raises(InvalidMessageError, match="UTF-8"):
        encoder.frame(3, "send", {"topic": "t\ud800", "body": b""})
    with pytest.raises(InvalidTypeError):
        encoder.frame(4, "send", {"topic": object()})
    assert encoder.frame(5, "ping", {})  # the encoder still works after a refusal


@pytest.mark.parametrize(
    "name",
    ["a", "A-b_c.9", "", ".", "..", "...", "a b", "é", "a/b", "x" * 255, "x" * 256,
     "t\ud800", "tab\t", "ok."],
)  # fmt: skip
def test_topic_names_are_judged_as_the_store_judges_them(name: str) -> None:
    from equeue.client import args
    from equeue.format.message import MAX_NAME_BYTES
    from equeue.store import validate

    assert args.MAX_NAME_BYTES == MAX_NAME_BYTES

    def verdict(check: Any) -> str:
        try:
            check(name)
        except Exception as exc:
            return type(exc).__name__
        return "ok"

    assert verdict(args.topic) == verdict(validate.check_topic)


@pytest.mark.parametrize("count", [1, 1024, 0, -1, 1025, 2000, 1 << 32, 1 << 70, True, "2", 2.0])
def test_queue_counts_are_judged_as_the_store_judges_them(count: object, tmp_path: Path) -> None:
    """create_topic's queue_count: the client refuses what the store refuses, with the
    store's error and words (it let 1025 .. 2**32 go to the broker, and said [1, 1024]
    of them), and sends what the store takes."""

    def verdict(create: Any) -> tuple[str, str]:
        try:
            create()
        except Exception as exc:
            return type(exc).__name__, str(exc)
        return "ok", ""

    with equeue.MessageStore.open(tmp_path / "store") as store:
        expected = verdict(lambda: store.create_topic("t", count))  # type: ignore[arg-type]
    found = verdict(lambda: calls.create_topic("t", count))  # type: ignore[arg-type]
    assert found == expected
    if expected[0] == "InvalidMessageError":  # the value, the range, the bound's name
        assert all(part in found[1] for part in (repr(count), "[1, 1024]", "MAX_QUEUES")), found


@pytest.mark.parametrize(
    "url", ["tcp://127.0.0.1:8080:9090", "tcp://a:b:80", "tls://h:x:443", "tcp://::1:80"]
)
def test_a_host_with_a_colon_outside_brackets_is_refused_by_both(url: str) -> None:
    # review16 R16-3: connect took tcp://127.0.0.1:8080:9090 as 127.0.0.1:9090 (another
    # endpoint), the listener tcp://a:b:80 as host "a:b" and tcp://::1:80 as ::1
    for parse in (parse_url, parse_listener):
        with pytest.raises(
            ConfigError, match=re.escape("an IPv6 address is written [ADDRESS]:PORT")
        ):
            parse(url)


def test_a_path_url_with_a_name_too_long_is_a_config_error_not_an_os_error() -> None:
    # review16 R16-4: Path.is_dir() raised OSError(ENAMETOOLONG) out of connect
    with pytest.raises(ConfigError, match="longer than the 107"):
        parse_url("x" * 300)
