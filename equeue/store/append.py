"""The write path: message records into the log, then their queue entries.

Called with the store's write lock held (directly, or by the group commit
leader under flush="sync"). The message record always goes first; a queue
entry is written only once the record it points to is in place, so readers
never find an entry whose message they cannot read.
"""

from __future__ import annotations

import mmap
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import xxhash

from equeue import speedups
from equeue.chunks import ChunkWriter
from equeue.chunks.chunk import Chunk
from equeue.errors import ClosedError, StoreWriteError, TopicNotFoundError
from equeue.format.chunk import FRAME_OVERHEAD, HEADER_SIZE
from equeue.format.message import (
    FLAG_HAS_KEY,
    MESSAGE_HEAD_SIZE,
    message_length,
    pack_message,
)
from equeue.store.keyindex import KeyIndex
from equeue.store.queue import Queue
from equeue.store.types import SendResult
from equeue.store.validate import Checked

_xxh32 = xxhash.xxh32_intdigest


def pick_queue(
    queue_id: int | None, key: str | None, key_bytes: bytes, count: int, turn: int
) -> tuple[int, int]:
    """(queue id, next round-robin turn): the one asked for; else by key hash, so a key
    always lands in the same queue; else the next in turn."""
    if queue_id is not None:
        return queue_id, turn
    if key is not None:
        return xxhash.xxh32_intdigest(key_bytes) % count, turn
    queue_id = turn % count
    return queue_id, queue_id + 1


def message_id(prefix: str, position: int) -> str:
    """``encode_message_id`` with the store id's 8 hex digits already formatted."""
    return prefix + format(position, "016x")


class Appender:
    def __init__(
        self,
        writer: ChunkWriter,
        keys: KeyIndex,
        id_prefix: str,
        topic_bytes: dict[str, bytes],
        round_robin: dict[str, int],
        store_path: Path,
        closed: Callable[[], bool],
        sender: Any = None,
    ) -> None:
        self._writer = writer
        self._keys = keys
        self._id_prefix = id_prefix
        self._topic_bytes = topic_bytes  # shared with the store, which adds topics
        self._round_robin = round_robin
        self._store_path = store_path
        self._closed = closed
        self._sender = sender  # _speedups.Sender, for single sends (write_checked)

    @property
    def sender(self) -> Any:
        return self._sender

    def check_open(self, topic: str, queues: list[Queue]) -> None:
        """Under the write lock, before a batch's first write."""
        if self._closed():
            raise ClosedError(f"store {self._store_path} is closed")
        if queues[0].closed:  # delete_topic ran while this send waited for the lock
            raise TopicNotFoundError(
                f"topic {topic!r} in {self._store_path} was deleted while this send waited; "
                "nothing was written"
            )

    def append_all(
        self, topic: str, queues: list[Queue], checked: list[Checked]
    ) -> list[SendResult]:
        self.check_open(topic, queues)
        if self._sender is not None and len(checked) == 1:
            # None (nothing written) when it needs a new chunk: append() below does it
            result = self._sender.write_checked(topic, queues, checked[0])
            if result is not None:
                return [result]
        results: list[SendResult] = []
        try:
            i = 0
            while i < len(checked):
                if len(checked) - i > 1:
                    i = self._run(topic, queues, checked, i, results)
                if i < len(checked):  # one that starts a new chunk, or a single send
                    results.append(self.append(topic, queues, *checked[i]))
                    i += 1
        except StoreWriteError as exc:
            exc.sent = results  # a batch cut short by the disk: what was stored before it
            raise
        return results

    def append(
        self,
        topic: str,
        queues: list[Queue],
        body: bytes,
        tag_bytes: bytes,
        hashed: int,
        key_bytes: bytes,
        key: str | None,
        props: bytes,
        code: int,
        queue_id: int | None,
    ) -> SendResult:
        """Under the write lock: the message record, then its queue entry."""
        queue_id, self._round_robin[topic] = pick_queue(
            queue_id, key, key_bytes, len(queues), self._round_robin[topic]
        )
        queue = queues[queue_id]
        queue.make_room()  # a queue chunk that cannot be created fails the send before any write
        offset = queue.next_offset
        now = time.time_ns()
        topic_bytes = self._topic_bytes[topic]
        writer = self._writer
        position = writer.position_for(
            message_length(topic_bytes, tag_bytes, key_bytes, props, body)
        )
        record = pack_message(
            position,
            now,
            now,
            offset,
            queue_id,
            code,
            hashed,
            FLAG_HAS_KEY if key is not None else 0,
            topic_bytes,
            tag_bytes,
            key_bytes,
            props,
            body,
        )
        written = writer.unlocked_write(record)
        assert written == position, "position_for() and the write disagree"
        queue.append(position, hashed)
        if key is not None:
            self._keys.add(topic, key, position)
        return SendResult(
            message_id(self._id_prefix, position), topic, queue_id, offset, position, now / 1e9
        )

    def _run(
        self,
        topic: str,
        queues: list[Queue],
        checked: list[Checked],
        i: int,
        results: list[SendResult],
    ) -> int:
        """Under the write lock: ``append`` for the run of messages from ``checked[i]``
        that fit the current log chunk and their queues' current chunks, written as
        one block: frames first, then one publish, then the queue entries (so no
        entry points at a record readers cannot see yet). Returns where it stopped."""
        chunk = self._writer._chunk
        if chunk is None:
            return i
        fast = speedups.SPEEDUPS
        if fast is not None:
            return self._run_fast(fast, chunk, topic, queues, checked, i, results)
        topic_bytes = self._topic_bytes[topic]
        # Up to the allocated end: the message that passes it goes through append(),
        # which allocates the next step (Chunk.reserve) before writing.
        base, start, room = chunk.base, chunk.data_end, chunk.writable_end
        end = start
        fixed = MESSAGE_HEAD_SIZE + len(topic_bytes) + FRAME_OVERHEAD
        count = len(queues)
        turn = self._round_robin[topic]
        taken: dict[Queue, int] = {}
        entries: list[tuple[Queue, int, int]] = []
        keys: list[tuple[str, int]] = []
        id_prefix = self._id_prefix
        now = time.time_ns()
        stored_at = now / 1e9
        write = chunk.write_frame_at
        first = i
        for body, tag_bytes, hashed, key_bytes, key, props, code, queue_id in checked[i:]:
            if end + fixed + len(tag_bytes) + len(key_bytes) + len(props) + len(body) > room:
                break
            by_turn = queue_id is None and key is None
            queue_id, turn = pick_queue(queue_id, key, key_bytes, count, turn)
            queue = queues[queue_id]
            pending = taken.get(queue, 0)
            if pending >= queue.free_slots():
                if by_turn:
                    turn = queue_id  # this one goes through append(), which takes the turn
                break
            taken[queue] = pending + 1
            offset = queue.next_offset + pending
            position = base + end
            end = write(
                end,
                pack_message(
                    position, now, now, offset, queue_id, code, hashed,
                    FLAG_HAS_KEY if key is not None else 0,
                    topic_bytes, tag_bytes, key_bytes, props, body,
                ),
            )  # fmt: skip
            entries.append((queue, position, hashed))
            if key is not None:
                keys.append((key, position))
            results.append(
                SendResult(
                    message_id(id_prefix, position),
                    topic, queue_id, offset, position, stored_at,
                )
            )  # fmt: skip
            i += 1
        if i == first:
            return i
        self._round_robin[topic] = turn
        chunk.publish(end, i - first)
        for queue, position, hashed in entries:
            queue.append(position, hashed)
        for key, position in keys:
            self._keys.add(topic, key, position)
        return i

    def _run_fast(
        self,
        fast: ModuleType,
        chunk: Chunk,
        topic: str,
        queues: list[Queue],
        checked: list[Checked],
        i: int,
        results: list[SendResult],
    ) -> int:
        """``_run`` in C: the frames, then the queue entries, written in one call."""
        maps: list[mmap.mmap | None] = []
        ends: list[int] = []
        sizes: list[int] = []
        for queue in queues:
            current = queue.current_chunk()
            maps.append(current.writable_mapping() if current is not None else None)
            ends.append(current.data_end if current is not None else 0)
            sizes.append(current.writable_end if current is not None else 0)
        now = time.time_ns()
        before = len(results)
        stop: int
        taken: list[int]
        keyed: list[tuple[str, int]]
        try:
            stop, end, turn, taken, keyed = fast.write_run(
                chunk.writable_mapping(), HEADER_SIZE, chunk.data_end, chunk.writable_end,
                chunk.base, now, topic, self._topic_bytes[topic], checked, i,
                self._round_robin[topic], maps, ends, sizes,
                [queue.next_offset for queue in queues], self._id_prefix, SendResult,
                now / 1e9, _xxh32, results,
            )  # fmt: skip
        except BaseException:
            del results[before:]  # nothing was published: none of them was sent
            raise
        if stop == i:
            return i
        self._round_robin[topic] = turn
        chunk.publish(end, stop - i)
        for queue, count in zip(queues, taken, strict=True):
            if count:
                queue.advance(count)
        for key, position in keyed:
            self._keys.add(topic, key, position)
        return stop
