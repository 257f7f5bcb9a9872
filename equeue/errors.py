"""Every error equeue raises.

Messages say what was wrong, where (file and offset, in decimal and hex) and,
for a limit, which setting changes it. A rejected operation leaves the store
exactly as it was.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any


def location(file: str | os.PathLike[str] | None, offset: int | None) -> str:
    """'in FILE at offset N (0xN)', as every error and recovery problem says where."""
    return _where(file, offset)


def _where(file: str | os.PathLike[str] | None, offset: int | None) -> str:
    parts = []
    if file is not None:
        parts.append(f"in {os.fspath(file)}")
    if offset is not None:
        parts.append(f"at offset {offset} (0x{offset:x})")
    return " ".join(parts)


class EQueueError(Exception):
    """Base class of every equeue error.

    ``sent``, ``unsent`` and ``unanswered``: what ``Client.send_many`` reports on the
    error it raises, whatever its class (equeue/client/many.py); empty on every other
    error but ConnectionLostError's ``unanswered``.
    """

    sent: Sequence[Any] = ()
    unsent: Sequence[Any] = ()
    unanswered: Sequence[Any] = ()


class ConfigError(EQueueError, ValueError):
    """A setting is out of range or does not match the files on disk."""


# --- corruption -------------------------------------------------------------


class CorruptionError(EQueueError):
    """Bytes on disk are not what the format says they must be."""

    def __init__(
        self,
        reason: str,
        *,
        file: str | os.PathLike[str] | None = None,
        offset: int | None = None,
        expected: int | bytes | None = None,
        found: int | bytes | None = None,
        remedy: str | None = None,
    ) -> None:
        self.reason = reason
        self.file = os.fspath(file) if file is not None else None
        self.offset = offset
        self.expected = expected
        self.found = found
        self.remedy = remedy  # what the operator can do, after the facts
        message = reason
        where = _where(file, offset)
        if where:
            message += " " + where
        if expected is not None or found is not None:
            message += f": expected {_hex(expected)}, found {_hex(found)}"
        self.problem = message  # the message without the remedy
        super().__init__(message if remedy is None else f"{message}; {remedy}")


def _hex(value: int | bytes | None) -> str:
    if value is None:
        return "nothing"
    if isinstance(value, bytes):
        return "0x" + value.hex() if value else "no bytes"
    return f"0x{value:x}"


class NewerFormatError(ConfigError):
    """A file whose own checks hold names a format version above the one this library
    reads: a newer equeue wrote it. Refused as newer, never taken for damage (no file is
    moved, rebuilt or rewritten): every file kind with a version raises this one class
    (docs/format.md, "Newer formats and downgrades"). Not a CorruptionError, so that no
    damage handler (a queue rebuilt, a journal salvaged) takes it for one."""

    def __init__(
        self, what: str, *, file: str | os.PathLike[str], offset: int | None, found: int, reads: str
    ) -> None:
        self.file = os.fspath(file)
        self.offset = offset
        self.found = found
        after = (
            f"but this equeue reads {reads}: written by a newer equeue; open the store with "
            "that version (nothing was changed)"
        )
        self.reason = f"{what} {found}, {after}"
        super().__init__(f"{what} {found} {_where(file, offset)}, {after}")

    @classmethod
    def check(
        cls,
        what: str,
        found: object,
        newest: int,
        *,
        file: str | os.PathLike[str],
        offset: int | None,
        reads: str,
    ) -> None:
        """Raise if ``found`` (a file's version, read where its checksum held) is an
        integer above ``newest``, the highest this library reads."""
        if isinstance(found, int) and not isinstance(found, bool) and found > newest:
            raise cls(what, file=file, offset=offset, found=found, reads=reads)


class ChecksumMismatchError(CorruptionError):
    """A stored checksum does not match the bytes it covers."""


class TruncatedError(CorruptionError):
    """A file ends before a structure it must hold (a short read)."""


class CorruptRecordError(CorruptionError):
    """No valid record frame at a position that must hold one."""


class MissingChunkError(CorruptionError):
    """The chunk sequence has a gap: a chunk file in the middle is missing."""


class ChunkReplacedError(CorruptionError):
    """A chunk's file, opened again by name, is another chunk (another chunk id): the
    file this handle read was deleted and a new one made under its name (its topic
    deleted and made again, or a file replaced from outside)."""


# --- positions --------------------------------------------------------------


class PositionError(EQueueError, LookupError):
    """A position does not name a readable record."""


class PositionNotFoundError(PositionError):
    """The position lies beyond what was written, or never held a record."""


class ChunkRemovedError(PositionError):
    """The position lies in a chunk that retention has removed."""


class CompactedAwayError(PositionError):
    """The record at this position was removed by compaction."""


# --- writes -----------------------------------------------------------------


class InvalidRecordError(EQueueError, ValueError):
    """A record was rejected before anything was written."""


class RecordTooLargeError(InvalidRecordError):
    """A record is larger than a configured limit."""


class ClosedError(EQueueError):
    """The object was closed."""


class ReadOnlyError(EQueueError):
    """A write was attempted through a read-only handle."""


class WriterExistsError(EQueueError):
    """A second writer was attached to a chunk manager that has one."""


class StoreWriteError(EQueueError, OSError):
    """Writing or flushing failed in the operating system; nothing partial is visible.

    ``sent`` lists the messages of a ``send_batch`` that were stored before the
    failure (empty for a single send, or when the failure came first).
    """

    sent: list[Any]

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        self.sent = []


class StoreReadError(EQueueError, OSError):
    """Opening or reading a store's file failed in the operating system (too many open
    files, an I/O error) where nothing was being written; nothing was changed."""


class DiskFullError(StoreWriteError):
    """The file system has no space left (ENOSPC) or a file size limit was hit."""


class StoreReplacedError(StoreWriteError):
    """The store's directory, or its LOCK file, is no longer the one this writer opened
    and locked: it was removed and made again, or moved, while the handle was open. The
    handle writes nothing more by path (it would land in the other store): later sends
    are refused, and ``close()`` raises this after releasing the files. ``expected`` and
    ``found``: (st_dev, st_ino) of the directory and of its LOCK, None where nothing is."""

    expected: tuple[tuple[int, int], tuple[int, int]] | None = None
    found: tuple[tuple[int, int] | None, tuple[int, int] | None] | None = None


class ReentrantSendError(EQueueError, RuntimeError):
    """A send was made on a thread that holds the store's write lock already (from a
    signal handler or a callback run inside another send); nothing was written."""


# --- the message store ------------------------------------------------------


class InvalidMessageError(EQueueError, ValueError):
    """A send was rejected before anything was written (bad topic, tag, key, body, ...)."""


class InvalidTypeError(EQueueError, TypeError):
    """An argument has the wrong type; nothing was written."""


class MessageTooLargeError(InvalidMessageError):
    """A message body or its properties exceed a configured limit."""


class TopicNotFoundError(EQueueError, LookupError):
    """The topic does not exist (and auto_create_topics is off)."""


class QueueNotFoundError(EQueueError, LookupError):
    """The queue id is out of range for the topic."""


class MessageNotFoundError(PositionError):
    """No message has this id or position."""


class StoreLockedError(EQueueError):
    """Another process (or handle) holds the store's writer lock: ``holder`` is its pid
    as the LOCK file says it ("unknown": none written), where that was read."""

    holder: str | None = None

    def command_line_advice(self, command: str) -> str:
        """The message for the ``equeue`` command ``command``: a command line has no
        ``read_only=True`` nor an "other handle" to close (review17 R17-7)."""
        if self.holder is None:
            return str(self)
        text = f"{str(self).split(';', 1)[0]}: stop that process first"
        if command == "serve":
            text += " (if it is an 'equeue serve', the store is served already: connect to it)"
        return text


class UsageError(EQueueError):
    """A command line names something the command cannot work on, or gives an option a
    value it refuses (the ``equeue`` command's exit status 2)."""


class StorePathError(EQueueError):
    """A path inside the store is not what the store made there: a symbolic link (never
    followed: it could lead outside the store), or a file where a directory belongs, or
    the reverse. Nothing was read or written through it."""

    def __init__(self, reason: str, *, file: str | os.PathLike[str]) -> None:
        self.reason = reason
        self.file = os.fspath(file)
        super().__init__(f"{self.file} {reason}")


class NotAStoreError(EQueueError, FileNotFoundError):
    """The path holds no equeue store (no store.json) and was not to be created."""


class SparkUnavailableError(EQueueError):
    """Spark cannot start here: no Java runtime (17 or newer), or pyspark is missing."""


class CompactionError(EQueueError):
    """The compaction job could not go on; the store keeps its chunks as they were."""

    def __init__(
        self,
        reason: str,
        *,
        file: str | os.PathLike[str] | None = None,
        offset: int | None = None,
    ) -> None:
        self.reason = reason
        self.file = os.fspath(file) if file is not None else None
        self.offset = offset
        where = _where(file, offset)
        super().__init__(f"{reason} {where}" if where else reason)


# --- Spark: the data source, the streaming source, the sink -----------------


class SparkOptionError(EQueueError, ValueError):
    """An option given to ``format("equeue")`` is unknown or out of range; the message
    names the option, what it was and what it may be."""


class SparkSchemaError(EQueueError, ValueError):
    """Rows written to the equeue sink have a shape it cannot store (a missing ``body``,
    a column of an unsupported type, an unknown column)."""


class SparkClusterError(EQueueError):
    """The executors cannot run equeue's tasks: equeue does not import there, their Python
    is another minor version than the driver's, or they cannot see the store."""


class DataLossError(EQueueError):
    """Offsets a streaming query was to read are gone (retention, compaction or a deleted
    topic) and ``failOnDataLoss`` is true."""


class SinkCommitError(EQueueError):
    """The sink could not append a job's staged rows; what it appended is recorded, and the
    next commit of the same job appends only the rest."""


# --- the broker and its clients -----------------------------------------------


class ProtocolError(EQueueError):
    """A peer sent bytes that are not the equeue wire protocol (docs/protocol.md): a
    malformed, truncated or oversized frame, an unknown operation, a wrong argument
    shape, or a protocol version the other side does not speak. The connection that
    carried it is closed; other connections and the store are not affected."""


class BrokerTooOldError(ProtocolError):
    """The broker's protocol version (its welcome's) is older than the one an operation
    needs: refused by the client before anything is sent; the connection stays open."""


class FrameTooLargeError(ProtocolError):
    """A frame's declared length exceeds the receiver's ``max_frame_bytes``."""


class AuthenticationError(EQueueError):
    """The broker refused the connection's token (wrong, or missing where one is needed)."""


class ShmRingError(ProtocolError):
    """The shared-memory rings of a connection (``equeue serve --shm``,
    ``equeue.aio.connect(url, shm=True)``; docs/protocol.md) hold an index no well-behaved
    peer writes, or a region that cannot be used (not sealed, not of a ring's size), or
    could not be set up; that connection alone is closed."""


class LimitExceededError(EQueueError):
    """A limit was reached: connections (``max_connections``), requests in flight on
    one connection (``max_in_flight``), consumer groups (``max_groups``) or topics
    (``max_topics``, StoreConfig.max_topics); the message names the setting."""


class ConnectionLostError(EQueueError, ConnectionError):
    """The connection to the broker broke or could not be made.

    ``unanswered`` lists the sends (as the caller gave them) whose answer never came:
    each may or may not have been stored. They are not retried by the client; a
    caller that retries them may store a message twice.
    ``sent`` (send_many): the SendResults of the messages acknowledged, in their order.
    ``unsent`` (send_many): the messages not stored (refused, or never written).
    """

    unanswered: list[Any]
    sent: list[Any]
    unsent: list[Any]

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        self.unanswered = []
        self.sent = []
        self.unsent = []


class BrokerStoppingError(EQueueError):
    """The broker is stopping (SIGTERM, SIGINT: its drain) and served none of the
    requests of this connection that it has not answered (it stopped reading, and drops
    what it read and did not serve): a send among them was not stored and may be sent
    again (to the broker once it is back).
    Sent as the connection's last frame (request id 0, protocol version 6 brokers); the
    clients raise ConnectionLostError from it with those sends in ``unsent``."""


class WrongLoopError(EQueueError, RuntimeError):
    """An asyncio client (equeue.aio) was called from a task on an event loop other than
    the one its connection was made on; nothing was sent, and the client still serves
    its own loop. Connect a client on each loop."""


class BrokerError(EQueueError):
    """The broker failed to serve a request for a reason of its own (a defect, or a
    store it can no longer use); the message says what it logged."""


class GroupError(EQueueError):
    """A consumer-group request the broker cannot honour: a queue pulled or committed
    by a consumer that is not its owner in the group's current generation, or a
    consumer id the group does not know (its session expired)."""


class GroupNotFoundError(GroupError, LookupError):
    """``delete_group`` of a consumer group the store does not have: no committed offset,
    no group file and no retry topic of that name."""


class FencedMemberError(GroupError):
    """A consumer-group request of a member whose consumer id joined the group again
    (from another connection or process) while it was live: the newer member replaced
    it, and the older one must stop (joining again would fence the newer in turn).
    Consumer ids must be unique among a group's live members (docs/groups.md)."""
