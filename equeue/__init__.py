"""equeue: an embedded, durable message store built on chunk files."""

from __future__ import annotations

from typing import TYPE_CHECKING

from equeue.errors import (
    AuthenticationError,
    BrokerError,
    BrokerStoppingError,
    BrokerTooOldError,
    ChecksumMismatchError,
    ChunkRemovedError,
    ChunkReplacedError,
    ClosedError,
    CompactedAwayError,
    CompactionError,
    ConfigError,
    ConnectionLostError,
    CorruptionError,
    CorruptRecordError,
    DataLossError,
    DiskFullError,
    EQueueError,
    FencedMemberError,
    FrameTooLargeError,
    GroupError,
    GroupNotFoundError,
    InvalidMessageError,
    InvalidRecordError,
    InvalidTypeError,
    LimitExceededError,
    MessageNotFoundError,
    MessageTooLargeError,
    MissingChunkError,
    NewerFormatError,
    NotAStoreError,
    PositionError,
    PositionNotFoundError,
    ProtocolError,
    QueueNotFoundError,
    ReadOnlyError,
    RecordTooLargeError,
    ReentrantSendError,
    ShmRingError,
    SinkCommitError,
    SparkClusterError,
    SparkOptionError,
    SparkSchemaError,
    SparkUnavailableError,
    StoreLockedError,
    StorePathError,
    StoreReadError,
    StoreReplacedError,
    StoreWriteError,
    TopicNotFoundError,
    TruncatedError,
    UsageError,
    WriterExistsError,
    WrongLoopError,
)
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

if TYPE_CHECKING:
    from equeue.client.sync import Client

__all__ = [
    "AuthenticationError",
    "BrokerError",
    "BrokerStoppingError",
    "BrokerTooOldError",
    "ChecksumMismatchError",
    "ChunkRemovedError",
    "ChunkReplacedError",
    "ClosedError",
    "CompactedAwayError",
    "CompactionError",
    "ConfigError",
    "ConnectionLostError",
    "CorruptRecordError",
    "CorruptionError",
    "DataLossError",
    "DiskFullError",
    "EQueueError",
    "FencedMemberError",
    "FrameTooLargeError",
    "GroupError",
    "GroupNotFoundError",
    "InvalidMessageError",
    "InvalidRecordError",
    "InvalidTypeError",
    "LimitExceededError",
    "Message",
    "MessageNotFoundError",
    "MessageStore",
    "MessageTooLargeError",
    "MissingChunkError",
    "NewerFormatError",
    "NotAStoreError",
    "OutgoingMessage",
    "PositionError",
    "PositionNotFoundError",
    "ProtocolError",
    "PullResult",
    "QueueNotFoundError",
    "ReadOnlyError",
    "RecordTooLargeError",
    "RecoveryReport",
    "ReentrantSendError",
    "SendResult",
    "ShmRingError",
    "SinkCommitError",
    "SparkClusterError",
    "SparkOptionError",
    "SparkSchemaError",
    "SparkUnavailableError",
    "StoreConfig",
    "StoreLockedError",
    "StorePathError",
    "StoreReadError",
    "StoreReplacedError",
    "StoreWriteError",
    "TopicNotFoundError",
    "TopicPolicy",
    "TruncatedError",
    "UsageError",
    "WriterExistsError",
    "WrongLoopError",
]
__version__ = "0.1.0"


def connect(url: object, *, token: str | None = None, **options: object) -> Client:
    """A blocking, thread-safe client of the broker at ``url`` (``unix:PATH``,
    ``tcp://HOST:PORT``, ``tls://HOST:PORT`` or a store directory): equeue.client.sync,
    imported only when called (sockets, ssl, msgpack). ``equeue.aio.connect`` is the
    asyncio client."""
    from equeue.client.sync import connect as client

    return client(url, token=token, **options)  # type: ignore[arg-type]


__all__ += ["connect"]


def serve(store: object, config: object = None, **settings: object) -> None:
    """Run the broker on ``store`` (a path or a writable MessageStore) until SIGTERM or
    SIGINT: equeue.server.serve, imported only when called (asyncio, ssl)."""
    from equeue.server.serve import serve as run

    run(store, config, **settings)  # type: ignore[arg-type]


__all__ += ["serve"]
