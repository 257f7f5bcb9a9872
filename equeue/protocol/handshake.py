"""The first frame each way: the client's hello and the broker's welcome.

hello (client to broker), a map::

    key        type          meaning
    versions   [uint]        protocol versions the client speaks (this package: 1 to 6)
    token      str | nil     the broker's token, where it asks for one (--token-file)
    client     str           a name for logs and stats (at most 200 characters)

welcome (broker to client), a map::

    version    uint          the version chosen: the highest both speak
    server     str           "equeue <package version>"
    limits     map           max_frame_bytes, max_in_flight, max_connections (uint);
                             max_batch_messages, max_pull_count, max_message_size,
                             max_properties_size (uint, kept if present)

A client takes a limit above LIMIT_CEILING (2**32 - 1, the longest frame the 4-byte
length field can carry) as LIMIT_CEILING: more means nothing on this wire (no frame, and
so no batch, pull or window of requests, can be longer), no broker of this package
announces more (its settings' maxima are 2**31 and below), and the client's C paths take
a limit as a C integer.

A broker that speaks none of the versions, or refuses the token, answers
``[0, 1, {"code": ..., "message": ...}]`` instead and closes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from equeue.errors import ProtocolError
from equeue.protocol.frames import FRAME_HEADER_SIZE, SUPPORTED_VERSIONS

MAX_CLIENT_NAME = 200
# A token file's size at most (equeue serve --token-file; the Spark option tokenFile).
MAX_TOKEN_BYTES = 4096
MAX_SHM_GROUP = 64
LIMIT_NAMES = ("max_frame_bytes", "max_in_flight", "max_connections")
# Announced by every broker of this package, but not required of one: a client that needs
# one (send_many's chunks: max_batch_messages) assumes the protocol's default without it.
# max_message_size, max_properties_size: the served store's, so that a client can refuse a
# message before it sends the ones around it (the Spark sink's check, reviewc F3).
OPTIONAL_LIMIT_NAMES = (
    "max_batch_messages", "max_pull_count", "max_message_size", "max_properties_size",
)  # fmt: skip
LIMIT_CEILING = (1 << 8 * FRAME_HEADER_SIZE) - 1
# Of those, the ones 0 is a value of (a store whose max_properties_size is 0 takes no
# properties at all): kept at 0, where a count of 0 is dropped (review3 R7).
ZERO_ALLOWED = frozenset({"max_properties_size"})


@dataclass(frozen=True, slots=True)
class Hello:
    versions: tuple[int, ...] = SUPPORTED_VERSIONS
    token: str | None = None
    client: str = ""
    # The shared-memory rings asked for (docs/protocol.md, equeue/protocol/shmrings.py):
    # the client's ring group, or None (not sent: a broker without --shm ignores it)
    shm: str | None = None

    def pack(self) -> dict[str, Any]:
        packed: dict[str, Any] = {
            "versions": list(self.versions), "token": self.token, "client": self.client,
        }  # fmt: skip
        if self.shm is not None:
            packed["shm"] = self.shm
        return packed

    @classmethod
    def unpack(cls, body: object, where: str) -> Hello:
        if type(body) is not dict:
            raise ProtocolError(f"{where}: the hello must be a map, got {type(body).__name__}")
        versions = body.get("versions")
        token = body.get("token")
        client = body.get("client", "")
        if (
            type(versions) is not list
            or not versions
            or not all(type(v) is int and v > 0 for v in versions)
        ):
            raise ProtocolError(f"{where}: hello 'versions' must be a non-empty list of uints")
        if token is not None and type(token) is not str:
            raise ProtocolError(f"{where}: hello 'token' must be a string or nil")
        if type(client) is not str or len(client) > MAX_CLIENT_NAME:
            raise ProtocolError(
                f"{where}: hello 'client' must be a string of at most {MAX_CLIENT_NAME} chars"
            )
        shm = body.get("shm")
        if shm is not None and (type(shm) is not str or len(shm) > MAX_SHM_GROUP):
            raise ProtocolError(
                f"{where}: hello 'shm' must be a string of at most {MAX_SHM_GROUP} chars"
            )
        return cls(tuple(versions), token, client, shm)


@dataclass(frozen=True, slots=True)
class Welcome:
    version: int
    server: str
    limits: dict[str, int] = field(default_factory=dict)

    def pack(self) -> dict[str, Any]:
        return {"version": self.version, "server": self.server, "limits": dict(self.limits)}

    @classmethod
    def unpack(cls, body: object, where: str) -> Welcome:
        if type(body) is not dict:
            raise ProtocolError(f"{where}: the welcome must be a map, got {type(body).__name__}")
        version = body.get("version")
        server = body.get("server")
        limits = body.get("limits")
        if type(version) is not int or version not in SUPPORTED_VERSIONS:
            raise ProtocolError(
                f"{where}: the broker chose protocol version {version!r}; this client "
                f"speaks {list(SUPPORTED_VERSIONS)}"
            )
        if type(server) is not str or type(limits) is not dict:
            raise ProtocolError(f"{where}: the welcome needs 'server' (str) and 'limits' (map)")
        checked: dict[str, int] = {}
        for name in LIMIT_NAMES:
            value = limits.get(name)
            if type(value) is not int or value <= 0:
                raise ProtocolError(
                    f"{where}: welcome limit {name!r} must be a uint > 0, got {value!r}"
                )
            checked[name] = min(value, LIMIT_CEILING)
        for name in OPTIONAL_LIMIT_NAMES:
            value = limits.get(name)
            if type(value) is int and (value > 0 or (value == 0 and name in ZERO_ALLOWED)):
                checked[name] = min(value, LIMIT_CEILING)
        return cls(version, server, checked)


def choose_version(
    offered: tuple[int, ...], spoken: tuple[int, ...] = SUPPORTED_VERSIONS
) -> int | None:
    """The highest version both sides speak, or None."""
    common = set(offered) & set(spoken)
    return max(common) if common else None


def token_problem(data: bytes) -> str | None:
    """What keeps a token file's bytes from being one token, or None. The file holds the
    token alone, on one line; whitespace around it (a final newline) is not part of it. A
    second line is refused rather than made part of the token or dropped: either would
    make a file such as "TOKEN\n# rotated in May" mean something its writer did not
    (review 38e E3)."""
    if len(data) > MAX_TOKEN_BYTES:
        return f"is longer than {MAX_TOKEN_BYTES} bytes; a token is 1 to {MAX_TOKEN_BYTES} bytes"
    try:
        token = data.decode().strip()
    except UnicodeDecodeError:
        return "is not UTF-8 text"
    if not token:
        return "holds no token (it is empty or only whitespace)"
    if "\n" in token or "\r" in token:
        return "holds more than one line; it must hold the token alone, on one line"
    return None


def token_of(data: bytes) -> str:
    """The token of a token file's bytes that ``token_problem`` passed."""
    return data.decode().strip()
