"""Names the broker's retries put on the wire (docs/groups.md): the topics a consumer
group's retries and dead letters go to, and the properties a retry copy carries. Shared
by the broker (equeue/server/retry.py) and the clients (equeue/client/consumer.py)."""

from __future__ import annotations

from typing import Final

from equeue.store.types import Message

DELAY_TOPIC: Final = "equeue.delay"  # internal: one queue per delay level
MOVER_GROUP: Final = "equeue.mover"  # internal: the mover's cursor in each delay queue
RETRY_PREFIX: Final = "equeue.retry."  # + group: what the group consumes again
DLQ_PREFIX: Final = "equeue.dlq."  # + group: the dead letters, an ordinary topic

GROUP: Final = "equeue.group"
ATTEMPT: Final = "equeue.attempt"  # how many times the message was nacked
ORIGIN_TOPIC: Final = "equeue.origin.topic"
ORIGIN_QUEUE: Final = "equeue.origin.queue_id"
ORIGIN_OFFSET: Final = "equeue.origin.offset"
ORIGIN_ID: Final = "equeue.origin.id"
DUE_MS: Final = "equeue.due_ms"  # copies in DELAY_TOPIC: when due, ms since the epoch


def retry_topic(group: str) -> str:
    return RETRY_PREFIX + group


def dead_letter_topic(group: str) -> str:
    return DLQ_PREFIX + group


def restore(message: Message) -> Message:
    """A retry copy as its consumer sees it: the original topic, queue id and offset (its
    message_id stays the copy's, which is what nack takes)."""
    props = message.properties
    if not message.topic.startswith(RETRY_PREFIX) or ORIGIN_TOPIC not in props:
        return message
    try:
        queue_id, offset = int(props[ORIGIN_QUEUE]), int(props[ORIGIN_OFFSET])
    except (KeyError, ValueError):
        return message
    return message._replace(topic=props[ORIGIN_TOPIC], queue_id=queue_id, queue_offset=offset)
