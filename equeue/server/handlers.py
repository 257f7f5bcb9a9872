"""Requests to store calls: each op of equeue/protocol/ops.py, on the loop thread.

An op returns its wire result, or DEFERRED when the answer comes later: a send under
``--flush sync`` (after the fdatasync that covers it, groupcommit.py) or a long-poll
pull (holds.py); the connection then counts it in flight until ``finish`` is called.
Errors are raised: the connection answers them with the class name as the code.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final, Protocol

import msgpack

from equeue import speedups
from equeue.errors import InvalidMessageError, LimitExceededError, ProtocolError
from equeue.format.message import message_id_prefix
from equeue.protocol import pullcols
from equeue.protocol.faults import hide_store_path
from equeue.protocol.frames import (
    ANSWER_OVERHEAD,
    FRAME_HEADER,
    SEND_RESULT_OVERHEAD,
    STATS_GROUP_VERSION,
    STATUS_OK,
    encode,
)
from equeue.protocol.ops import check_args
from equeue.protocol.records import (
    pack_columns,
    pack_message,
    pack_pull_result,
    pack_send_result,
)
from equeue.protocol.retries import RESERVED_PREFIX, check_client_write
from equeue.server.groupdelete import GroupDeleter
from equeue.server.holds import HeldPull, Holds
from equeue.server.stats import COUNTERS, Counters, group_detail, groups_summary
from equeue.store import storereads
from equeue.store.bodies import plain, send_columns, send_packed
from equeue.store.store import MessageStore
from equeue.store.types import Message, OutgoingMessage, PullResult, SendResult
from equeue.store.validate import MAX_DELAY_MS, MAX_WAIT, check_commit

if TYPE_CHECKING:
    from equeue.server.config import ServerConfig
    from equeue.server.groupcommit import CrossClientCommit
    from equeue.server.offsetcommit import OffsetCommitter

log = logging.getLogger("equeue.server")

DEFERRED: Final = object()
MS = 1000.0
PULL_RESULT_OVERHEAD: Final = 15  # [messages, next_offset]: both headers, a uint64


class Packed:
    """A result already msgpack-encoded (a pull's, measured against max_frame_bytes)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


class Frame(bytes):
    """A whole answer frame, its header included (a plain send's under --flush sync):
    queued and written as it is. A type of its own so that no other result that is bytes
    (a body, say) can be taken for a frame and written raw; a bytes subclass so that the
    C answer packer makes it directly (cext/sendframe.c), with no wrapper per send."""

    __slots__ = ()


class Peer(Protocol):
    """What an op needs of the connection it came on."""

    where: str
    version: int  # the protocol version the connection was welcomed with

    def finish(self, request_id: int, outcome: object) -> None: ...


class Coordinator(Protocol):
    """equeue/server/groups.py's GroupCoordinator, as the broker calls it (loop thread)."""

    def call(self, op: str, args: dict[str, Any]) -> Any: ...  # join, heartbeat, leave, nack
    def check_owner(
        self, group: str, consumer: str, topic: str, queue_id: int, join_id: int | None = None
    ) -> None: ...
    def tick(self) -> None: ...
    def live(self) -> list[str]: ...
    def summary(self, name: str) -> dict[str, Any]: ...
    def detail(self, name: str) -> dict[str, Any] | None: ...
    def skipped_counts(self) -> dict[str, int]: ...
    def persist_with(self, run: Callable[[Callable[[], None]], Any]) -> None: ...
    def note_skip(self, group: str, topic: str, queue_id: int, start: int, first: int) -> None: ...
    def skips(self, only: str | None = None) -> dict[str, dict[str, Any]]: ...

    deleting: set[str]  # (groupdelete.py's)

    def live_members(self, group: str) -> list[str]: ...
    def forget_group(self, group: str) -> None: ...


class Handlers:
    def __init__(
        self,
        store: MessageStore,
        holds: Holds,
        commit: CrossClientCommit | None,
        coordinator: Coordinator,
        counters: Counters,
        extra_stats: Callable[[], dict[str, Any]],
        config: ServerConfig,
        packer: msgpack.Packer,
        offsets: OffsetCommitter,
    ) -> None:
        self.store = store
        hide_store_path(store.path)  # errors sent to clients name files relative to it
        self.holds = holds
        self.commit = commit
        self.config = config
        self.packer = packer
        self.offsets = offsets
        self.coordinator = coordinator
        coordinator.persist_with(offsets.run)  # the retry mover's fdatasync off the loop
        self.counters = counters
        fast = speedups.SPEEDUPS
        self._send_answer = fast.send_answer if fast is not None else None
        self._answer_around = fast.answer_around if fast is not None else _answer_around
        self._id_prefix = message_id_prefix(store.store_id)
        self._extra_stats = extra_stats
        self.ops: dict[str, Callable[[Peer, int, dict[str, Any]], object]] = {
            "ping": lambda peer, rid, args: None,
            "send": self.send,
            "send_batch": self.send_batch,
            "send_bodies": self.send_bodies,
            "pull": self.pull,
            "pull_columns": self.pull_columns,
            "get": lambda peer, rid, a: pack_message(store.get(a["message_id"])),
            "query_by_key": self.by_key_whole,
            "query_by_key_page": self.by_key_page,
            "offset_for_time": lambda peer, rid, a: store.offset_for_time(
                a["topic"], a["queue_id"], a["timestamp"]
            ),
            "commit_offset": self.commit_offset,
            "committed_offset": lambda peer, rid, a: store.committed_offset(
                a["group"], a["topic"], a["queue_id"]
            ),
            "create_topic": lambda peer, rid, a: store.create_topic(
                a["topic"], a.get("queue_count")
            ),
            "topics": lambda peer, rid, a: store.topics(),
            "deleted_topics": lambda peer, rid, a: store.deleted_topics(),
            "queue_ids": lambda peer, rid, a: store.queue_ids(a["topic"]),
            "queue_range": lambda peer, rid, a: list(store.queue_range(a["topic"], a["queue_id"])),
            "stats": self.stats_op,
            "join": lambda peer, rid, a: self.coordinator.call("join", a),
            "heartbeat": lambda peer, rid, a: self.coordinator.call("heartbeat", a),
            "leave": lambda peer, rid, a: self.coordinator.call("leave", a),
            "nack": self.nack,
            "delete_group": self.delete_group,
            # protocol version 6: True if a held pull of this connection was answered
            "cancel_pull": lambda peer, rid, a: holds.cancel(peer, a["request_id"]),
        }
        self._deleter = GroupDeleter(store, coordinator, holds, offsets)
        for op in ("send", "send_batch", "send_bodies", "create_topic", "commit_offset"):
            self.ops[op] = _guarded(op, self.ops[op])

    def delete_group(self, peer: Peer, rid: int, a: dict[str, Any]) -> object:
        self._deleter.delete(peer, rid, a)
        return DEFERRED

    def nack(self, peer: Peer, rid: int, a: dict[str, Any]) -> object:
        delay_ms = a.get("delay_ms")
        if delay_ms is not None and delay_ms > MAX_DELAY_MS:
            raise InvalidMessageError(
                f"{peer.where}: nack delay_ms={delay_ms} must lie in [0, {MAX_DELAY_MS}] "
                "(one day, as a pull's wait_ms; a delay past the longest delay level waits "
                "that level)"
            )
        # The retry copy is an append: under --flush sync acknowledged once it is durable.
        return self._durable(peer, rid, self.coordinator.call("nack", a), 1)

    # --- sends -----------------------------------------------------------------

    def _durable(self, peer: Peer, rid: int, result: object, messages: int) -> object:
        """The answer now, or (``--flush sync``) once an fdatasync covers the append of
        ``messages`` (for sends_per_flush: a nack's retry copy is one, an empty batch 0)."""
        commit = self.commit
        if commit is None:
            return result
        commit.add(peer, rid, result, messages)
        return DEFERRED

    def send_plain(self, peer: Peer, rid: int, topic: str, body: bytes) -> object:
        """A send of a topic and a body alone (the commonest request), as ``send`` answers
        it: the same checks and counts, without the args map, the op table and the wrapper
        (connection.py calls it for ``send`` requests of exactly those two arguments).
        The result is the answer's whole frame (bytes, the header included), or under
        --flush sync DEFERRED with the frame handed to commit as a Frame (connection.py's
        release_durable writes it as it is)."""
        if topic.startswith(RESERVED_PREFIX):
            check_client_write("send", {"topic": topic}, peer.where)
        sent = self.store.send(topic, body)
        counters = self.counters
        counters.sends += 1
        counters.send_requests += 1
        if self.holds.count:
            self.holds.note(topic, sent.queue_id, sent.queue_offset, "")
        # The whole answer frame, made here: the connection queues it as it is; under
        # --flush sync a Frame made by the C packer itself (no wrapper per send).
        commit = self.commit
        kind = bytes if commit is None else Frame
        pack = self._send_answer
        frame = pack(rid, sent, kind) if pack is not None else None
        if frame is None:
            frame = kind(encode([rid, STATUS_OK, pack_send_result(sent)]))
        if commit is None:
            return frame
        commit.add(peer, rid, frame, 1)
        return DEFERRED

    def send(self, peer: Peer, rid: int, a: dict[str, Any]) -> object:
        if len(a) == 2:  # topic and body: the store's fast path, without keywords
            sent: SendResult = self.store.send(a["topic"], a["body"])
        else:
            sent = self.store.send(
                a["topic"], a["body"], tag=a.get("tag", ""), key=a.get("key"),
                properties=a.get("properties"), code=a.get("code", 0), queue_id=a.get("queue_id"),
            )  # fmt: skip
        counters = self.counters
        counters.sends += 1
        counters.send_requests += 1
        if self.holds.count:
            self.holds.note(sent.topic, sent.queue_id, sent.queue_offset, a.get("tag", ""))
        return self._durable(peer, rid, pack_send_result(sent), 1)

    def send_batch(self, peer: Peer, rid: int, a: dict[str, Any]) -> object:
        topic, messages = a["topic"], a["messages"]
        self._check_batch(peer, topic, len(messages))
        items = _batch_items(peer, topic, messages)
        results = self.store.send_batch(topic, items)
        self._batch_sent(results, items)
        return self._durable(peer, rid, list(map(pack_send_result, results)), len(results))

    def send_bodies(self, peer: Peer, rid: int, a: dict[str, Any]) -> object:
        """send_batch of bodies alone (protocol version 2): the decoded array goes to the
        store as it is, and the results go back in columns (records.pack_columns): packed
        by the C append as it goes (bodies.send_packed, no object per message) unless a
        pull is held, when the columns (bodies.send_columns) say which pulls to wake."""
        topic, bodies = a["topic"], a["bodies"]
        store = self.store
        checked = plain(store, bodies)
        if not checked and not set(map(type, bodies)) <= {bytes}:
            raise ProtocolError(f"{peer.where}: op 'send_bodies': each body must be bin")
        self._check_batch(peer, topic, len(bodies))
        if checked and not self.holds.count:  # the answer packed as the C append goes
            packed = send_packed(store, topic, bodies, checked=True)
            if packed is not None:
                counters = self.counters
                counters.sends += len(bodies)
                counters.send_requests += 1
                commit = self.commit
                if commit is None:
                    return Packed(packed)
                commit.add(peer, rid, Frame(self._answer_around(rid, packed)), len(bodies))
                return DEFERRED
        columns = send_columns(store, topic, bodies)
        counters = self.counters
        counters.sends += len(bodies)
        counters.send_requests += 1
        if self.holds.count and bodies:
            # Per queue, its first and last offset of the batch: what a note per message
            # leaves (offsets rise within a queue, every tag is "")
            queue_ids, offsets = columns.queue_ids, columns.queue_offsets
            last = dict(zip(queue_ids, offsets, strict=True))
            first = dict(zip(reversed(queue_ids), reversed(offsets), strict=True))
            note = self.holds.note
            for queue_id, offset in first.items():
                note(topic, queue_id, offset, "")
                note(topic, queue_id, last[queue_id], "")
        return self._durable(peer, rid, Packed(pack_columns(columns, self.packer)), len(bodies))

    def send_spans(self, peer: Peer, rid: int, topic: str, bodies: Sequence[bytes]) -> Any:
        """A send_bodies read by C from its frame (connection.py, cext/bodyspans.c): the
        bodies stay where they lie in the frame (or the read buffer) until the C append
        frames them into the log chunk, no bytes object each. Its answer's whole frame
        (bytes, the length header included: answer_around), or DEFERRED under --flush
        sync; None (nothing done) anywhere else (a reserved topic, a held pull, a batch
        past its limits, a body past max_body), and the caller decodes the frame and
        serves it the general way, which answers or refuses it as send_bodies does.
        Under --flush sync the frame waits for its fdatasync as a Frame, as a plain
        send's does, so release_durable answers it in C (cext/release.c); a Packed
        result went answer by answer in Python (release._release_each), ~17 Python
        calls a flush on the path of a client shared by many tasks (docs/benchmarks.md,
        "durable (round 18)")."""
        store = self.store
        if self.holds.count or topic.startswith(RESERVED_PREFIX) or not plain(store, bodies):
            return None
        count = len(bodies)
        if not self._batch_fits(topic, count):  # the general path refuses it
            return None
        packed = send_packed(store, topic, bodies, checked=True)
        if packed is None:
            return None
        counters = self.counters
        counters.sends += count
        counters.send_requests += 1
        frame = self._answer_around(rid, packed)
        commit = self.commit
        if commit is None:
            return frame
        commit.add(peer, rid, Frame(frame), count)
        return DEFERRED

    def _batch_sent(self, results: list[SendResult], items: list[Any]) -> None:
        """Count a batch's sends and wake the pulls held on its queues."""
        counters = self.counters
        counters.sends += len(results)
        counters.send_requests += 1
        if self.holds.count:
            note = self.holds.note
            for sent, item in zip(results, items, strict=True):
                tag = "" if type(item) is bytes else item.tag
                note(sent.topic, sent.queue_id, sent.queue_offset, tag)

    def _batch_fits(self, topic: str, count: int) -> bool:
        """Within _check_batch's limits (asked without an error: send_spans)."""
        config = self.config
        return (
            count <= config.max_batch_messages
            and _answer_size(topic, count) <= config.max_frame_bytes
        )

    def _check_batch(self, peer: Peer, topic: str, count: int) -> None:
        """Refused before anything is appended: more messages than max_batch_messages, or
        so many that their answer (a SendResult each) would pass max_frame_bytes."""
        config = self.config
        if count > config.max_batch_messages:
            raise LimitExceededError(
                f"{peer.where}: a send_batch of {count} messages; at most "
                f"max_batch_messages={config.max_batch_messages} (equeue serve "
                "--max-batch-messages); split it"
            )
        answer = _answer_size(topic, count)
        if answer > config.max_frame_bytes:
            fits = (config.max_frame_bytes - ANSWER_OVERHEAD) // (
                SEND_RESULT_OVERHEAD + len(topic.encode())
            )
            raise LimitExceededError(
                f"{peer.where}: the answer to a send_batch of {count} messages to {topic!r} "
                f"could take {answer} bytes, past max_frame_bytes={config.max_frame_bytes} "
                f"(equeue serve --max-frame-bytes); at most {fits} messages to this topic a batch"
            )

    # --- reads -----------------------------------------------------------------

    def pull(self, peer: Peer, rid: int, a: dict[str, Any]) -> object:
        return self._pull(peer, rid, a, columns=False)

    def pull_columns(self, peer: Peer, rid: int, a: dict[str, Any]) -> object:
        """pull, answered in columns (protocol version 3: protocol/pullcols.py)."""
        return self._pull(peer, rid, a, columns=True)

    def _pull(self, peer: Peer, rid: int, a: dict[str, Any], *, columns: bool) -> object:
        topic, queue_id = a["topic"], a["queue_id"]
        self._check_owner(a, topic, queue_id)
        wait_ms = a.get("wait_ms", 0)
        if wait_ms > MAX_WAIT * MS:
            raise InvalidMessageError(
                f"{peer.where}: pull wait_ms={wait_ms} must lie in [0, {MAX_WAIT * MS:.0f}]"
            )
        args = self._pull_args(a)
        found = self.store.pull(
            topic, queue_id, a["offset"], args["max_count"], args["tags"], 0.0,
            max_bytes=args["max_bytes"],
        )  # fmt: skip
        self.counters.pulls += 1
        offset = a["offset"]
        if (found.messages[0].queue_offset if found.messages else found.next_offset) > offset:
            self._skipped(a, topic, queue_id, offset)  # retention, or a tag filter
        if found.messages or wait_ms == 0:
            if columns:
                return self.fit_columns(found, peer.where, topic, queue_id)
            return self.fit_pull(found, peer.where)
        if not self._hold(peer, rid, a, args, found, columns):
            # past max_held_pulls or the connection's max_held_filter_bytes: answered as
            # without a wait (nothing skipped, nothing kept), at the next tick (holds.py)
            self.holds.later(
                peer, rid,
                self.fit_columns(found, peer.where, topic, queue_id)
                if columns
                else self.fit_pull(found, peer.where),
            )  # fmt: skip
        return DEFERRED

    def _hold(
        self, peer: Peer, rid: int, a: dict[str, Any], args: dict[str, Any], found: PullResult,
        columns: bool,
    ) -> bool:  # fmt: skip
        """Hold the pull ``a`` whose answer is empty now (``found``); False if not held."""
        topic, queue_id = a["topic"], a["queue_id"]
        group, consumer = a.get("group"), a.get("consumer")
        check = None
        if group is not None and consumer is not None:  # checked again when answered
            owner, join_id = self.coordinator.check_owner, a.get("join_id")

            def check() -> None:
                owner(group, consumer, topic, queue_id, join_id)

        held = HeldPull(
            peer, rid, (topic, queue_id), found.next_offset, args, check,
            group if check is not None else None,
        )  # fmt: skip
        if columns:  # (else serve.py's fit_pull packs it, as a pull's)
            where = peer.where
            held.pack = lambda result: self.fit_columns(result, where, topic, queue_id)
        return self.holds.hold(held, args["tags"], a["wait_ms"] / MS)

    def _pull_args(self, a: dict[str, Any]) -> dict[str, Any]:
        """A pull's count and bytes within the broker's bounds: max_pull_count messages,
        bodies of max_frame_bytes (fit_pull then cuts the answer to the frame)."""
        config = self.config
        max_bytes = a.get("max_bytes")
        return {
            "max_count": min(a.get("max_count", 32), config.max_pull_count),
            "tags": a.get("tags"),
            "max_bytes": config.max_frame_bytes
            if max_bytes is None
            else min(max_bytes, config.max_frame_bytes),
        }

    def fit_columns(self, found: PullResult, where: str, topic: str, queue_id: int) -> Packed:
        """A pull_columns answer, packed (in C where the accelerator is loaded), cut before
        the messages that would take it past max_frame_bytes."""
        room = self.config.max_frame_bytes - ANSWER_OVERHEAD
        messages = found.messages
        if messages:
            # The messages' own topic str (their queue's, equal to the request's, which
            # msgpack made anew): the C packer's check of every message's topic is then
            # an identity test, not a string comparison (perfgroup: ~90 instructions a
            # message; the id prefix likewise, one str: message_id_prefix)
            topic = messages[0].topic
        data, _ = pullcols.pack(found, topic, queue_id, self._id_prefix, room)
        if data is None:
            first = found.messages[0]
            raise self._too_large(first, len(first.body), where)
        return Packed(data)

    def fit_pull(self, found: PullResult | Packed, where: str) -> Packed:
        """The pull's answer, packed, cut before the messages that would take it past
        max_frame_bytes (next_offset then says where to go on). (A Packed one, a held
        pull_columns answered by holds.py, as it is.)"""
        if type(found) is Packed:
            return found
        assert isinstance(found, PullResult)
        packer = self.packer
        data: bytes = packer.pack(pack_pull_result(found))
        room = self.config.max_frame_bytes - ANSWER_OVERHEAD
        if len(data) <= room:
            return Packed(data)
        messages = found.messages
        total, kept = PULL_RESULT_OVERHEAD, 0
        for message in messages:
            size = len(packer.pack(pack_message(message)))
            if total + size > room:
                if kept == 0:
                    raise self._too_large(message, size, where)
                break
            total += size
            kept += 1
        cut = PullResult(messages[:kept], messages[kept].queue_offset)
        return Packed(packer.pack(pack_pull_result(cut)))

    def by_key_whole(self, peer: Peer, rid: int, a: dict[str, Any]) -> Packed:
        """query_by_key (protocol versions 1 to 3): every message up to ``limit``, or
        LimitExceededError. Its answer (an array) has no place to say that more follow, and
        a caller asking for a key's messages must not take the newest few for all of them
        (review4 R5: 21 of 30, silently); before reviewg F12 such an answer passed the frame
        and broke the connection."""
        messages, after = self.by_key(peer, a)
        # (cut by the count, the key may have no more below: then it is whole, review5 F4)
        if after is not None and self.store.key_positions(a["topic"], a["key"], 1, before=after):
            config = self.config
            raise LimitExceededError(
                f"{peer.where}: the messages of key {a['key'][:80]!r} in {a['topic']} up to "
                f"limit={a.get('limit', 32)} do not fit one answer (max_frame_bytes="
                f"{config.max_frame_bytes}, max_pull_count={config.max_pull_count}; equeue "
                "serve --max-frame-bytes, --max-pull-count): ask for fewer, or with "
                "query_by_key_page (protocol version 4), which answers them in pages"
            )
        return Packed(messages)

    def by_key_page(self, peer: Peer, rid: int, a: dict[str, Any]) -> Packed:
        """query_by_key_page (protocol version 4): [messages, next]."""
        messages, after = self.by_key(peer, a)
        return Packed(b"\x92" + messages + self.packer.pack(after))

    def by_key(self, peer: Peer, a: dict[str, Any]) -> tuple[bytes, int | None]:
        """A query_by_key's messages, newest first, packed (an array), and where the rest
        begins (a log position to pass as ``before``) or None when they are all there. At
        most max_pull_count messages, read one at a time and cut before the one that would
        take the answer past max_frame_bytes, as a pull's (reviewg F12: a common key's
        answer of any size was built whole: 315 MB, 1.1 GB of broker)."""
        topic, key, limit = a["topic"], a["key"], a.get("limit", 32)
        most = min(limit, self.config.max_pull_count)
        positions = self.store.key_positions(topic, key, most, before=a.get("before"))
        packer = self.packer
        room = self.config.max_frame_bytes - ANSWER_OVERHEAD - PULL_RESULT_OVERHEAD
        # Read until the bodies alone pass the frame (so at most a frame and a message are
        # read), packed whole as the common answer is; measured message by message only
        # when that is too large, as fit_pull does.
        found: list[Message] = []
        bodies = 0
        for message in storereads.messages_at(self.store, topic, key, positions):
            found.append(message)
            bodies += len(message.body)
            if bodies > room:
                break
        else:
            data: bytes = packer.pack(list(map(pack_message, found)))
            if len(data) <= room:
                # The index gave fewer than asked: there are no more. It gave the broker's
                # count and the client asked for more: there may be, below its last one.
                more = most < limit and len(positions) == most
                return data, positions[-1] if more else None
        total = kept = 0
        for message in found:
            size = len(packer.pack(pack_message(message)))
            if total + size > room:
                if kept == 0:
                    raise self._too_large(message, size, peer.where)
                break
            total += size
            kept += 1
        cut = found[:kept]  # the rest lies below the last one answered
        return packer.pack(list(map(pack_message, cut))), cut[-1].position

    def _too_large(self, message: Message, size: int, where: str) -> LimitExceededError:
        return LimitExceededError(
            f"{where}: the message at offset {message.queue_offset} of "
            f"{message.topic}/{message.queue_id} packs to {size} bytes or more, more than "
            f"a frame may carry (max_frame_bytes={self.config.max_frame_bytes}; "
            "equeue serve --max-frame-bytes must exceed the store's "
            f"max_message_size={self.store.config.max_message_size} plus its "
            "properties)"
        )

    def commit_offset(self, peer: Peer, rid: int, a: dict[str, Any]) -> object:
        group, topic, queue_id, offset = a["group"], a["topic"], a["queue_id"], a["offset"]
        self._check_owner(a, topic, queue_id)
        # refused here, as the store would, before anything is handed to the committer
        check_commit(group, offset, self.store.queue_range(topic, queue_id)[1])
        self.offsets.add((group, topic, queue_id), offset, lambda error: peer.finish(rid, error))
        return DEFERRED

    def _skipped(self, a: dict[str, Any], topic: str, queue_id: int, offset: int) -> None:
        """A group member's pull went past offsets: count those retention removed."""
        group = a.get("group")
        if group is None or a.get("consumer") is None:
            return
        first = self.store.queue_range(topic, queue_id)[0]
        if offset < first:
            # Not below the group's commit: the group consumed those before it committed
            # (a pull from below it is a seek back; review5 F8). The grant's note starts
            # at the commit (reviewh F2), so this takes nothing of it.
            committed = self.store.committed_offset(group, topic, queue_id)
            start = offset if committed is None else max(offset, committed)
            if start < first:
                self.coordinator.note_skip(group, topic, queue_id, start, first)

    def _check_owner(self, a: dict[str, Any], topic: str, queue_id: int) -> None:
        group, consumer = a.get("group"), a.get("consumer")
        if consumer is None or group is None:
            return
        self.coordinator.check_owner(group, consumer, topic, queue_id, a.get("join_id"))

    # --- stats -----------------------------------------------------------------

    def stats(self, group: str | None = None) -> dict[str, Any]:
        c = self.counters
        answer: dict[str, Any] = {name: getattr(c, name) for name in COUNTERS}
        answer["rates"] = c.rates()
        holds = self.holds
        answer["held_pulls"] = holds.count
        # pulls with a wait answered empty, not held, because max_held_pulls or their
        # connection's max_held_filter_bytes was reached; the weight of held tag filters
        answer["pulls_not_held"] = holds.not_held
        answer["held_filter_bytes"] = holds.filter_bytes
        commit = self.commit
        answer["flushes"] = commit.flushes if commit else 0
        answer["sends_per_flush"] = (
            round(commit.sends_flushed / commit.flushes, 2) if commit and commit.flushes else 0.0
        )
        # the group-commit wait's: flushes that waited, and of those the ones whose expected
        # sends all came before the bound (the others are its latency cost)
        answer["group_commit_waits"] = commit.waits if commit else 0
        answer["group_commit_waits_full"] = commit.waits_full if commit else 0
        # --group-commit-overlap: flushes after which the next started before a round's
        # last sends were back (overlapping cohorts)
        answer["group_commit_overlapped"] = commit.overlapped if commit else 0
        # the adds the send lane made in C (cext/commitadd.c), in this process (all its
        # brokers): the rest went through CrossClientCommit.add
        answer["group_commit_adds_in_c"] = (
            speedups.SPEEDUPS.commit_adds_in_c() if speedups.SPEEDUPS is not None else 0
        )
        # answers (joined ones counted each) sent whole to the socket by C
        # (cext/answerwrite.c: a flush's, and the send lane's without a group commit),
        # in this process
        answer["answers_written_directly"] = (
            speedups.SPEEDUPS.answers_written_directly() if speedups.SPEEDUPS is not None else 0
        )
        answer.update(self._extra_stats())
        if group is None:  # bounded by stats_max_listed (reviewg F11)
            listed = self.config.stats_max_listed
            answer.update(groups_summary(self.store, self.coordinator, listed))
        else:
            answer.update(group_detail(self.store, self.coordinator, group))
        return answer

    def stats_op(self, peer: Peer, rid: int, a: dict[str, Any]) -> dict[str, Any]:
        group = a.get("group")
        if group is not None and peer.version < STATS_GROUP_VERSION:
            raise ProtocolError(
                f"{peer.where}: stats' argument 'group' is of protocol version "
                f"{STATS_GROUP_VERSION}; this connection was welcomed with version "
                f"{peer.version} (offer {STATS_GROUP_VERSION} in the hello to use it)"
            )
        return self.stats(group)

    # The two a plain send or a send_bodies read whole in C goes past: a connection is
    # made with those reads only while its broker's Handlers class finds these
    # (connection.py _reads_own; reviewd F4).
    _c_reads: Final = (send_plain, send_bodies)


def _guarded(
    op: str, handler: Callable[[Peer, int, dict[str, Any]], object]
) -> Callable[[Peer, int, dict[str, Any]], object]:
    """A client's write, refused in the broker's reserved ``equeue.*`` names (the
    coordinator's own writes go to the store directly)."""

    def guarded(peer: Peer, rid: int, a: dict[str, Any]) -> object:
        check_client_write(op, a, peer.where)
        return handler(peer, rid, a)

    return guarded


def _batch_items(peer: Peer, topic: str, messages: list[Any]) -> list[bytes | OutgoingMessage]:
    """send_batch's messages, each held to send's argument types (a ProtocolError
    otherwise, as for a send), as the store takes them fastest: a body alone as bytes."""
    # The common batch, bodies alone, in two passes at C speed.
    bodies = [m.get("body") if type(m) is dict and len(m) == 1 else None for m in messages]
    if all(type(body) is bytes for body in bodies):
        return bodies  # type: ignore[return-value]
    items: list[bytes | OutgoingMessage] = []
    append = items.append
    for index, message in enumerate(messages):
        if type(message) is dict:
            if len(message) == 1:
                body = message.get("body")
                if type(body) is bytes:
                    append(body)
                    continue
            if "topic" not in message:
                check_args("send", {**message, "topic": topic}, peer.where)
                append(OutgoingMessage(**message))
                continue
            raise ProtocolError(
                f"{peer.where}: op 'send_batch': message {index} has the key 'topic'; a "
                "batch's messages take send's arguments but topic (the request's 'topic' "
                "is every message's)"
            )
        raise ProtocolError(
            f"{peer.where}: op 'send_batch': message {index} is a {type(message).__name__}; "
            "each message must be a map of send's arguments but topic"
        )
    return items


def _answer_around(rid: int, packed: bytes) -> bytes:
    """speedups.answer_around in Python: the whole frame of [rid, STATUS_OK, packed]."""
    body: bytes = b"\x93" + msgpack.packb(rid) + msgpack.packb(STATUS_OK) + packed
    return FRAME_HEADER.pack(len(body)) + body


def _answer_size(topic: str, count: int) -> int:
    """The most bytes the answer to a send_batch of ``count`` messages to ``topic`` takes."""
    return count * (SEND_RESULT_OVERHEAD + len(topic.encode())) + ANSWER_OVERHEAD
