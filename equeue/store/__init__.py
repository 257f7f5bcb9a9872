"""The message store: topics, queues, consumer offsets, lookups and retention."""

from equeue.store.config import StoreConfig
from equeue.store.recovery import RecoveryReport
from equeue.store.store import MessageStore
from equeue.store.topics import TopicPolicy
from equeue.store.types import Message, OutgoingMessage, PullResult, SendResult

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
