"""Names the broker's retries put on the wire (docs/groups.md): the topics a consumer
group's retries and dead letters go to, and the properties a retry copy carries. Shared
by the broker (equeue/server/retry.py) and the clients (equeue/client/consumer.py)."""

from __future__ import annotations

from typing import Final

from equeue.digits import ascii_number
from equeue.errors import InvalidMessageError, InvalidTypeError
from equeue.store.types import Message
from equeue.store.validate import MAX_QUEUES

DELAY_TOPIC: Final = "equeue.delay"  # internal: one queue per delay level
MOVER_GROUP: Final = "equeue.mover"  # internal: the mover's cursor in each delay queue
RETRY_PREFIX: Final = "equeue.retry."  # + group: what the group consumes again
DLQ_PREFIX: Final = "equeue.dlq."  # + group: the dead letters, an ordinary topic
RESERVED_PREFIX: Final = "equeue."  # topics and groups only the broker writes
MAX_RETRIES_LIMIT: Final = 1000  # a group's max_retries at most

GROUP: Final = "equeue.group"
ATTEMPT: Final = "equeue.attempt"  # how many times the message was nacked
ORIGIN_TOPIC: Final = "equeue.origin.topic"
ORIGIN_QUEUE: Final = "equeue.origin.queue_id"
ORIGIN_OFFSET: Final = "equeue.origin.offset"
ORIGIN_ID: Final = "equeue.origin.id"
DUE_MS: Final = "equeue.due_ms"  # copies in DELAY_TOPIC: when due, ms since the epoch
# A dead letter sent there without the sender's properties: why (they left no room).
DLQ_REASON: Final = "equeue.dlq.reason"
# On a dead letter of a message read from a dead-letter topic: that topic. Such a one is
# not dead-lettered again, which ends a cycle of groups consuming each other's dead
# letters (review19 R19-9).
DLQ_FROM: Final = "equeue.dlq.from"
# A dead letter whose body was cut to the store's max_message_size (a message stored
# under a larger limit): the body's size as it was; absent, the body is whole.
DLQ_BODY_SIZE: Final = "equeue.dlq.body_size"


def is_internal_topic(topic: str) -> bool:
    """A topic the broker's retries live in, read from cursors (not the dead letters)."""
    return topic == DELAY_TOPIC or (topic.startswith(RETRY_PREFIX) and topic != RETRY_PREFIX)


def retry_topic(group: str) -> str:
    return RETRY_PREFIX + group


def dead_letter_topic(group: str) -> str:
    return DLQ_PREFIX + group


def check_store_group(group: str) -> None:
    """A group an application commits through the store (``commit_offset``, a
    ``consumer``): not one of the broker's names, which no request could then delete or
    release from retention (review19 R19-2). The broker's own commits (the retry mover's
    cursors) do not come this way."""
    if group.startswith(RESERVED_PREFIX):
        raise InvalidMessageError(
            f"group {group!r}: names starting {RESERVED_PREFIX!r} are the broker's own (its "
            "retry mover's cursors): choose another name"
        )


def check_client_write(op: str, args: dict[str, object], where: str) -> None:
    """Refuse a client's write into the broker's names: a send, send_batch or
    create_topic to an ``equeue.*`` topic; a commit_offset of an ``equeue.*`` group, in
    ``equeue.delay``, or in another group's retry topic. Reads stay open (the dead
    letters are consumed as an ordinary topic, and offsets committed there)."""
    topic, group = args.get("topic"), args.get("group")
    if not isinstance(topic, str):
        return  # check_args refuses it
    if op == "commit_offset":
        if isinstance(group, str) and group.startswith(RESERVED_PREFIX):
            bad = f"group {group!r}"
        elif topic == DELAY_TOPIC or (
            topic.startswith(RETRY_PREFIX) and topic != RETRY_PREFIX + str(group)
        ):
            bad = f"topic {topic!r} for group {group!r}"
        else:
            return
    elif topic.startswith(RESERVED_PREFIX):
        bad = f"topic {topic!r}"
    else:
        return
    raise InvalidMessageError(
        f"{where}: op {op!r} refused: {bad} is the broker's (names starting "
        f"{RESERVED_PREFIX!r} are reserved for its retries; a client may read them and "
        "commit its own group's offsets in its retry and dead-letter topics)"
    )


def restore(message: Message) -> Message:
    """A retry copy as its consumer sees it: the original topic, queue id and offset (its
    message_id stays the copy's, which is what nack takes)."""
    props = message.properties
    if not message.topic.startswith(RETRY_PREFIX) or ORIGIN_TOPIC not in props:
        return message
    numbers = origin_numbers(props)
    if numbers is None:
        return message
    return message._replace(topic=props[ORIGIN_TOPIC], queue_id=numbers[0], queue_offset=numbers[1])


def origin_numbers(props: dict[str, str]) -> tuple[int, int] | None:
    """The origin queue id and offset a retry copy's properties name, or None unless
    both are numbers the broker writes: ASCII digits, a queue id below MAX_QUEUES, an
    offset below 2**63. int() took "-1", 31 digits and "\u0663" (as 3) into the
    restored message; a property the broker did not write makes no retry copy, as one
    that does not parse did already (an error would fail every delivery of it)."""
    queue_id = ascii_number(props.get(ORIGIN_QUEUE, ""))
    offset = ascii_number(props.get(ORIGIN_OFFSET, ""))
    if queue_id is None or offset is None or queue_id >= MAX_QUEUES or offset >= 2**63:
        return None
    return queue_id, offset


def attempt_number(props: dict[str, str]) -> int | None:
    """A retry copy's attempt count, or None unless it is one the broker writes: ASCII
    digits, at most MAX_RETRIES_LIMIT (a count past a group's max_retries goes to the
    dead letters, not the retry topic)."""
    attempt = ascii_number(props.get(ATTEMPT, ""))
    return attempt if attempt is not None and attempt <= MAX_RETRIES_LIMIT else None


def check_max_retries(value: object) -> int:
    """A group's ``max_retries``, as the broker's join and the clients' consumers check
    it: a wrong type is InvalidTypeError, an int out of range InvalidMessageError."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidTypeError(f"max_retries must be an int, got {type(value).__name__}")
    if not 0 <= value <= MAX_RETRIES_LIMIT:
        raise InvalidMessageError(f"max_retries={value} must lie in [0, {MAX_RETRIES_LIMIT}]")
    return value
