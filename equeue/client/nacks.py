"""A group member's nack, both loops: its arguments checked before anything is sent,
and what a failed nack does to the membership (docs/groups.md "A nack that fails")."""

from __future__ import annotations

import logging
from typing import Any

from equeue.client.groupstate import GroupState
from equeue.errors import (
    BrokerError,
    ConnectionLostError,
    EQueueError,
    GroupError,
    InvalidMessageError,
    InvalidTypeError,
    StoreWriteError,
)
from equeue.protocol.retries import GROUP, ORIGIN_TOPIC, retry_topic
from equeue.store.types import Message
from equeue.store.validate import MAX_DELAY_MS

log = logging.getLogger("equeue.client.consumer")


def nack_args(state: GroupState, message: object, delay: object) -> dict[str, Any]:
    """The nack request's arguments; a wrong argument raises here, nothing sent."""
    if not isinstance(message, Message):  # (a str once raised a builtin AttributeError)
        raise InvalidTypeError(
            f"nack takes a Message the consumer handed out, got {type(message).__name__}"
        )
    check_ours(state, message)
    args: dict[str, Any] = {**state.member_args(), "message_id": message.message_id}
    if delay is not None:
        args["delay_ms"] = delay_ms(delay)
    return args


def check_ours(state: GroupState, message: Message) -> None:
    """Refuse a message of a topic the group does not consume (a plain pull's, another
    group's retry copy) before anything is sent: the broker would refuse it as a queue
    the member does not hold, a GroupError taken as a nack in doubt, which drops the
    membership and hands out again what was processed since the last commit (review19
    R19-7). Only the topic can be told here: a message of a queue revoked since it was
    handed out, or one of the group's topics that another member handed out, is sent
    and stays the in-doubt case ("A nack that fails in doubt")."""
    topic = message.topic
    if topic in state.topics or topic == retry_topic(state.group):
        return
    props = message.properties
    if props.get(ORIGIN_TOPIC) == topic and props.get(GROUP) == state.group:
        return  # a retry copy of the group's, shown at its origin: a topic it dropped since
    raise InvalidMessageError(
        f"nack takes a message this consumer handed out: message {message.message_id} "
        f"({topic}/{message.queue_id} at offset {message.queue_offset}) is of a topic "
        f"group {state.group!r} does not consume (its topics: "
        f"{', '.join(map(repr, state.topics))}; its retries: {retry_topic(state.group)!r}); "
        "nothing was sent, the member goes on as it was"
    )


def delay_ms(delay: object) -> int:
    # the broker's bound (MAX_DELAY_MS), checked here so that a wrong delay costs no nack
    if not isinstance(delay, int | float) or isinstance(delay, bool):
        raise InvalidTypeError(
            f"delay must be seconds (an int or a float) or None, got {type(delay).__name__}"
        )
    if not 0 <= delay <= MAX_DELAY_MS / 1000:
        raise InvalidMessageError(
            f"delay must be seconds in [0, {MAX_DELAY_MS // 1000}] (one day; a delay past "
            f"the broker's longest delay level waits that level), got {delay!r}"
        )
    return int(delay * 1000)


# The failures after which the retry copy may be stored, or the membership is gone: the
# member joins again without committing, so the message comes again (at least once).
# Any other error is a refusal answered before anything was copied (an unknown message
# id, a bad argument, a closed client): the member goes on as it was, and the message
# stays in hand, unprocessed, until the loop is asked for the next one.
IN_DOUBT = (ConnectionLostError, BrokerError, StoreWriteError, GroupError)


def nack_failed(state: GroupState, error: EQueueError, message_id: str) -> None:
    """A nack of ``message_id`` failed with ``error``: raise it (a GroupError only
    logged: the member joins again at its next poll, and the message comes again)."""
    if not isinstance(error, IN_DOUBT):
        raise error
    state.lose(error)  # (fenced: raised, and by every later call)
    if not isinstance(error, GroupError):
        raise error
    log.warning("nack of %s refused (%s); it will be redelivered", message_id, error)
