"""equeue: an embedded, durable message store built on chunk files."""

from equeue.store import (
    Message,
    MessageStore,
    OutgoingMessage,
    PullResult,
    RecoveryReport,
    SendResult,
    StoreConfig,
    TopicPolicy,
)

__all__ = [
    "Message",
    "MessageStore",
    "OutgoingMessage",
    "PullResult",
    "RecoveryReport",
    "SendResult",
    "StoreConfig",
    "TopicPolicy",
]
__version__ = "0.1.0"
