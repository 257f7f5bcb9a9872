"""What the store hands back: send results, messages, pull results."""

from __future__ import annotations

from typing import NamedTuple


class SendResult(NamedTuple):
    message_id: str
    topic: str
    queue_id: int
    queue_offset: int
    position: int
    stored_at: float  # seconds since the epoch, as time.time()


class Message(NamedTuple):
    message_id: str
    topic: str
    queue_id: int
    queue_offset: int
    position: int
    tag: str
    key: str | None
    properties: dict[str, str]
    code: int
    body: bytes
    created_at: float
    stored_at: float


class PullResult(NamedTuple):
    messages: list[Message]
    next_offset: int


class OutgoingMessage(NamedTuple):
    """One message of ``send_batch``."""

    body: bytes
    tag: str = ""
    key: str | None = None
    properties: dict[str, str] | None = None
    code: int = 0
    queue_id: int | None = None
