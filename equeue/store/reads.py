"""The read path: message records decoded, checked against the queue entries that
point to them, and read a queue's run at a time.
"""

from __future__ import annotations

from collections.abc import Iterable, Sized
from types import ModuleType
from typing import Final

from equeue import speedups
from equeue.chunks import ChunkManager, ChunkReader
from equeue.chunks.chunk import Chunk
from equeue.errors import (
    ChunkRemovedError,
    CompactedAwayError,
    CorruptionError,
    CorruptRecordError,
    EQueueError,
    InvalidMessageError,
    InvalidTypeError,
    PositionNotFoundError,
)
from equeue.format.chunk import HEADER_SIZE
from equeue.format.message import (
    FLAG_HAS_KEY,
    MESSAGE_HEAD,
    MESSAGE_HEAD_SIZE,
    QUEUE_RECORD,
    QUEUE_RECORD_SIZE,
    TAG_HASH,
    TAG_HASH_OFFSET,
    decode_properties,
)
from equeue.store.append import message_id
from equeue.store.entrycheck import unreadable_entry
from equeue.store.queue import Queue
from equeue.store.types import Message
from equeue.store.validate import check_tag


class LogReader:
    def __init__(self, messages: ChunkManager, id_prefix: str, *, read_only: bool) -> None:
        self._messages = messages
        self._reader = ChunkReader(messages)
        self._id_prefix = id_prefix
        self.read_only = read_only

    def read(self, position: int) -> Message:
        """The message at ``position``; a read-only view first catches up with the writer."""
        if self.read_only and position >= self._messages.committed_position:
            self._messages.refresh()
        try:
            return self.decode(position, self._reader.read(position))
        except PositionNotFoundError:
            if not self.read_only:
                raise
        # Past a view whose refresh came up short: once more, caught up.
        self._messages.refresh()
        return self.decode(position, self._reader.read(position))

    def pull_run(
        self,
        queue: Queue,
        offset: int,
        max_count: int,
        wanted: dict[int, set[str]] | None,
        max_bytes: int | None = None,
    ) -> tuple[list[Message], int]:
        """A pull's messages from ``offset`` on, each checked against its queue entry (topic,
        queue, offset, tag hash), and the offset to go on from. With ``max_bytes``, the run
        stops before its bodies would add up to more (after one message at least)."""
        messages: list[Message] = []
        fast = speedups.SPEEDUPS
        budget, counted = max_bytes, 0  # bytes left; messages counted against it
        while len(messages) < max_count:
            if budget is not None and counted < len(messages):
                budget, counted, offset = _trim(messages, counted, budget, offset)
                if budget <= 0:
                    return messages, offset
            if wanted is None and fast is not None:
                taken = self._pull_chunks(fast, queue, offset, max_count, messages)
                if taken:  # (where it stopped short, the next round's general path reads)
                    offset = max(offset + taken, queue.first_offset)
                    continue
            entries = queue.entries(offset, max_count if wanted is None else 256)
            if not entries:
                break
            kept = [p for p, hashed in entries if wanted is None or hashed in wanted]
            try:
                found = self.read_run(kept)
            except (PositionNotFoundError, CorruptRecordError) as exc:
                found = self._read_again(queue, offset, entries, kept, exc)
            if wanted is None and fast is not None:
                offset, bad = fast.collect(
                    entries, found, offset, queue.queue_id, queue.topic,
                    min(max_count - len(messages), len(entries)), messages,
                )  # fmt: skip
                if bad >= 0:  # offset is that entry's
                    position, hashed = entries[bad]
                    message, stored_hash = found[position]
                    raise self.wrong_message(queue, offset, message, hashed, stored_hash)
                offset = max(offset, queue.first_offset)
                continue
            for position, hashed in entries:
                offset += 1
                if wanted is not None and hashed not in wanted:
                    continue
                read = found.get(position)
                if read is None:
                    continue  # removed by retention or compaction
                message, stored_hash = read
                if (
                    message.queue_offset != offset - 1
                    or message.queue_id != queue.queue_id
                    or message.topic != queue.topic
                    or stored_hash != hashed
                ):
                    raise self.wrong_message(queue, offset - 1, message, hashed, stored_hash)
                if wanted is not None and message.tag not in wanted[hashed]:
                    continue  # a hash collision
                messages.append(message)
                if len(messages) == max_count:
                    break
            offset = max(offset, queue.first_offset)
        if budget is not None and counted < len(messages):
            offset = _trim(messages, counted, budget, offset)[2]
        return messages, offset

    def _pull_chunks(
        self, fast: ModuleType, queue: Queue, offset: int, max_count: int, messages: list[Message]
    ) -> int:
        """The untagged pull's common case in C, a log chunk at a time, from the queue's
        raw entries (no tuple per entry): how many entries from queue offset ``offset``
        it took, their messages appended to ``messages``. It stops at anything else (a
        chunk removed or compacted, a record not intact, a message that does not match
        its entry), which the general path then reads, and raises about, as it does
        without this."""
        block = entry_block(queue, offset, max_count - len(messages))
        count = len(block) // QUEUE_RECORD_SIZE
        if not count:
            return 0
        manager, position = self._messages, QUEUE_RECORD.unpack_from
        if self.read_only and position(block, len(block) - QUEUE_RECORD_SIZE)[0] > (
            manager.committed_position
        ):
            manager.refresh()
        taken = 0
        while taken < count and len(messages) < max_count:
            first = position(block, taken * QUEUE_RECORD_SIZE)[0] - 1
            try:
                chunk = manager.get_chunk_for(first)
                if chunk.header.compacted:
                    break
                mm = chunk.mapping()
                chunk.mark_used()  # as read_many does: a chunk in use stays mapped
            except (EQueueError, OSError):  # the general path meets it again, and says
                break
            took = fast.pull_chunk(
                mm, HEADER_SIZE, chunk.physical_end, chunk.base, block, taken, offset + taken,
                queue.queue_id, queue.topic, min(max_count - len(messages), count - taken),
                messages, Message, self._id_prefix, decode_properties,
            )  # fmt: skip
            if took:
                last = position(block, (taken + took - 1) * QUEUE_RECORD_SIZE)[0] - 1
                chunk.release_behind(first - chunk.base, last - chunk.base)
            taken += took
            if took == 0 or (
                taken < count
                and position(block, taken * QUEUE_RECORD_SIZE)[0] - 1 < chunk.end_position
            ):
                break  # not a chunk boundary: the general path reads that entry
        return taken

    def wrong_message(
        self, queue: Queue, offset: int, message: Message, hashed: int, stored_hash: int
    ) -> CorruptRecordError:
        file, at = queue.entry_location(offset)
        return CorruptRecordError(
            f"queue {queue.topic}/{queue.queue_id} entry for offset {offset} (tag hash "
            f"{hashed:#x}) points at position {message.position}, which holds "
            f"{message.topic}/{message.queue_id} offset {message.queue_offset} (tag hash "
            f"{stored_hash:#x}): the queue entry is damaged",
            file=file,
            offset=at,
        )

    def _read_again(
        self,
        queue: Queue,
        first: int,
        entries: list[tuple[int, int]],
        kept: list[int],
        exc: PositionNotFoundError | CorruptRecordError,
    ) -> dict[int, tuple[Message, int]]:
        """``read_run(kept)`` failed with ``exc``: a read-only handle refreshes its view
        of the log and reads the run again (a view whose refresh came up short is behind
        the entries, which is no damage); failing again, or on the writer's handle, the
        error names the first entry whose message cannot be read."""
        if self.read_only:
            self._messages.refresh()
            try:
                return self.read_run(kept)
            except (PositionNotFoundError, CorruptRecordError) as again:
                exc = again
        raise self.bad_entry(queue, first, entries, exc) from exc

    def bad_entry(
        self, queue: Queue, first: int, entries: list[tuple[int, int]], exc: Exception
    ) -> CorruptRecordError:
        """The entry of a run whose message cannot be read, named with its queue file."""
        offset, position = first, entries[0][0]
        for offset, (position, _) in enumerate(entries, first):  # noqa: B007 - used below
            try:
                self.read_run([position])
            except (PositionNotFoundError, CorruptRecordError) as found:
                exc = found
                break
        return unreadable_entry(queue, offset, position, exc)

    def read_run(self, positions: list[int]) -> dict[int, tuple[Message, int]]:
        """The messages at ``positions`` (ascending, as in a queue), read chunk by chunk,
        each with the tag hash its record holds; a message removed by retention or
        compaction is left out."""
        manager = self._messages
        if self.read_only and positions and positions[-1] >= manager.committed_position:
            manager.refresh()
        found: dict[int, tuple[Message, int]] = {}
        decode, stored_hash = self.decode, TAG_HASH.unpack_from
        i = 0
        while i < len(positions):
            try:
                chunk = manager.get_chunk_for(positions[i])
            except ChunkRemovedError:
                i += 1
                continue
            base, end = chunk.base, chunk.end_position
            j = i + 1
            while j < len(positions) and positions[j] < end:
                j += 1
            run = positions[i:j]
            fast = speedups.SPEEDUPS
            if fast is not None and not chunk.header.compacted:
                try:
                    mm = chunk.mapping()
                    chunk.mark_used()  # as read_many does: a chunk in use stays mapped
                except ChunkRemovedError:
                    mm = None
                if mm is not None:
                    decoded = fast.decode_run(
                        mm, HEADER_SIZE, chunk.physical_end, base, run, Message,
                        self._id_prefix, decode_properties,
                    )  # fmt: skip
                    for position, pair in zip(run, decoded, strict=True):
                        # None: not an intact record; decode() says what is wrong
                        pair = pair or self._decode_slow(chunk, position)
                        if pair is not None:
                            found[position] = pair
                    chunk.release_behind(run[0] - base, run[-1] - base)
                    i = j
                    continue
            try:
                payloads: list[bytes | None] = list(chunk.read_many([p - base for p in run]))
            except (ChunkRemovedError, CompactedAwayError):
                payloads = [self._payload_or_none(p) for p in run]
            for position, payload in zip(run, payloads, strict=True):
                if payload is not None:
                    found[position] = (
                        decode(position, payload),
                        stored_hash(payload, TAG_HASH_OFFSET)[0],
                    )
            if not chunk.header.compacted:  # (a compacted chunk's offsets are not positions)
                chunk.release_behind(run[0] - base, run[-1] - base)
            i = j
        return found

    def _decode_slow(self, chunk: Chunk, position: int) -> tuple[Message, int] | None:
        """The record the C decoder left: None if retention or compaction removed it
        meanwhile (as the Python path skips it), else decoded or the precise error."""
        try:
            payload = chunk.read_at(position - chunk.base)  # raises what is wrong there
        except (ChunkRemovedError, CompactedAwayError):
            return None
        return self.decode(position, payload), TAG_HASH.unpack_from(payload, TAG_HASH_OFFSET)[0]

    def _payload_or_none(self, position: int) -> bytes | None:
        try:
            return self._reader.read(position)
        except (ChunkRemovedError, CompactedAwayError):
            return None

    def decode(self, position: int, payload: bytes) -> Message:
        if len(payload) < MESSAGE_HEAD_SIZE:  # a checksummed frame too short for a message
            raise CorruptRecordError(
                f"the record at position {position} is {len(payload)} bytes, shorter than "
                f"a message head ({MESSAGE_HEAD_SIZE})",
                file=str(self._messages.get_chunk_for(position).path),
                expected=MESSAGE_HEAD_SIZE,
                found=len(payload),
            )
        (pos, stored, created, qoff, qid, code, _, flags, tl, gl, kl, pl, bl) = (
            MESSAGE_HEAD.unpack_from(payload)
        )
        if MESSAGE_HEAD_SIZE + tl + gl + kl + pl + bl != len(payload):
            raise CorruptRecordError(
                f"the record at position {position} holds {len(payload)} bytes, but its "
                "head's field lengths add up to another size",
                file=str(self._messages.get_chunk_for(position).path),
                expected=MESSAGE_HEAD_SIZE + tl + gl + kl + pl + bl,
                found=len(payload),
            )
        if pos != position:
            raise CorruptRecordError(
                f"the record at position {position} names another position",
                file=str(self._messages.get_chunk_for(position).path),
                expected=position,
                found=pos,
            )
        p = MESSAGE_HEAD_SIZE + tl
        try:  # (its checksum held: written so, or crafted)
            topic = payload[MESSAGE_HEAD_SIZE:p].decode()
            tag = payload[p : p + gl].decode() if gl else ""
            p += gl
            key = payload[p : p + kl].decode() if flags & FLAG_HAS_KEY else None
        except UnicodeDecodeError as exc:  # (not CorruptRecordError: get reads that as
            # a position that names no record, MessageNotFoundError)
            raise CorruptionError(
                f"the record at position {position} has a topic, tag or key that is not "
                f"UTF-8: {exc}",
                file=str(self._messages.get_chunk_for(position).path),
            ) from exc
        p += kl
        props = decode_properties(payload[p : p + pl]) if pl else {}
        return Message(
            message_id(self._id_prefix, position),
            topic,
            qid,
            qoff,
            position,
            tag,
            key,
            props,
            code,
            payload[p + pl :],
            created,
            stored,
        )


# Budgets the C trim takes: within it, budget minus the bodies in memory cannot overflow
TRIM_BUDGET_LIMIT = 1 << 62


def _trim(messages: list[Message], counted: int, budget: int, offset: int) -> tuple[int, int, int]:
    """Count ``messages[counted:]`` against ``budget`` bytes of bodies, cutting before the
    first that does not fit (never the pull's first message). Returns (the bytes left,
    <= 0 when the pull is full; the messages counted; the offset to go on from). In C
    (trim.c) with the accelerator: every broker pull has a budget (its frame limit)."""
    fast = speedups.SPEEDUPS
    if fast is not None and -TRIM_BUDGET_LIMIT <= budget <= TRIM_BUDGET_LIMIT:
        result: tuple[int, int, int] = fast.trim_run(messages, counted, budget, offset)
        return result
    return trim_python(messages, counted, budget, offset)


def trim_python(
    messages: list[Message], counted: int, budget: int, offset: int
) -> tuple[int, int, int]:
    """_trim without the accelerator (and the reference its tests hold trim_run to)."""
    for i in range(counted, len(messages)):
        size = len(messages[i].body)
        if size > budget and i > 0:
            offset = messages[i].queue_offset
            del messages[i:]
            return 0, i, offset
        budget -= size
    return budget, len(messages), offset


# The most tags one filter may name. A filter picks a few kinds of message (RocketMQ's
# "TagA || TagB" subscriptions); a long-poll pull keeps its filter as long as it is held
# (up to a day), so the filter's size is memory a client holds in the broker: 1,024 tags of
# at most 255 bytes are under 1 MiB a held pull, where 100,000 held 20 MB (reviewg F10).
MAX_FILTER_TAGS: Final = 1024


def tag_filter(tags: str | Iterable[str] | None) -> dict[int, set[str]] | None:
    """{tag hash: tags} for a tag filter; None means every message. More than
    MAX_FILTER_TAGS tags is InvalidMessageError (the store's pull and consumer, and the
    broker's pull and pull_columns, all check a filter here)."""
    if tags is None or tags == "*":
        return None
    if isinstance(tags, str):
        tags = [tags]
    elif isinstance(tags, bytes | bytearray | memoryview | dict) or not hasattr(tags, "__iter__"):
        raise InvalidTypeError(
            f"tags must be None, a str or an iterable of str, got {type(tags).__name__}"
        )
    wanted: dict[int, set[str]] = {}
    for count, tag in enumerate(tags, 1):
        if count > MAX_FILTER_TAGS:  # (counted as they come: tags may be any iterable)
            raise InvalidMessageError(
                f"tags names more than {MAX_FILTER_TAGS} tags (equeue.store.reads.MAX_FILTER_TAGS) "
                f"({len(tags) if isinstance(tags, Sized) else 'an iterable of more'}); a "
                "filter names the few kinds of message to keep: pull every message "
                "(tags=None) and filter them yourself, or split the filter over consumers"
            )
        if not isinstance(tag, str):
            raise InvalidTypeError(f"tags must be str values, got {type(tag).__name__}")
        wanted.setdefault(check_tag(tag)[1], set()).add(tag)  # (refuses what cannot be sent)
    if not wanted:  # a filter that keeps nothing is a mistake, not a query
        raise InvalidMessageError(
            "tags is empty, which would match no message; pass tags=None (or '*') for "
            "every message, or the tags to keep"
        )
    return wanted


def entry_block(queue: Queue, offset: int, count: int) -> bytes:
    """Up to ``count`` of the queue's records from ``offset`` on, raw (QUEUE_RECORD:
    position + 1, tag hash), from one queue chunk: what ``Queue.entries`` decodes, for
    pull_chunk to read in C. Empty where that chunk is gone (the general path says)."""
    end = min(queue.next_offset, offset + count)
    if offset >= end:
        return b""
    try:
        chunk = queue.manager.get_chunk_for(offset * QUEUE_RECORD_SIZE)
    except ChunkRemovedError:
        return b""
    start = HEADER_SIZE + offset * QUEUE_RECORD_SIZE - chunk.base
    stop = min(end, (chunk.base + chunk.data_end) // QUEUE_RECORD_SIZE)
    if stop <= offset:
        return b""
    block = chunk.mapping()[start : start + (stop - offset) * QUEUE_RECORD_SIZE]
    chunk.release_behind(start - HEADER_SIZE, start - HEADER_SIZE + len(block))
    return block
