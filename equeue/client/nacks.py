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
from equeue.store.types import Message
from equeue.store.validate import MAX_DELAY_MS

log = logging.getLogger("equeue.client.consumer")


def nack_args(state: GroupState, message: object, delay: object) -> dict[str, Any]:
    """The nack request's arguments; a wrong argument raises here, nothing sent."""
    if not isinstance(message, Message):  # (a str once raised a builtin AttributeError)
        raise InvalidTypeError(
            f"nack takes a Message the consumer handed out, got {type(message).__name__}"
        )
    args: dict[str, Any] = {**state.member_args(), "message_id": message.message_id}
    if delay is not None:
        args["delay_ms"] = delay_ms(delay)
    return args


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
