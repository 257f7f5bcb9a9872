"""The broker's ``delete_group`` (protocol version 5): a consumer group with no live
member deleted from the store (``MessageStore.delete_group``: its committed offsets, its
retry topic, with ``delete_dead_letters`` its dead-letter topic), and from the broker's
memory: the coordinator's skip counts, the retry mover's remembered nacks, the group's
held pulls (answered now). A group with a live member (one whose session has not ended)
is refused: deleting it under a member would pull its retry topic away while it reads,
and the member's next commit would make the group again at once.

The store's deletion runs on the offset committer's thread after the commits handed over
before it (``OffsetCommitter.after_commits``): a commit of the group made before the
deletion does not make the group again after it. Joins of the group are refused while it
runs (``GroupCoordinator.deleting``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Protocol

from equeue.errors import GroupError
from equeue.protocol.frames import PROTOCOL_VERSION, UNFINISHED_VERSION
from equeue.protocol.retries import retry_topic
from equeue.store.groupdeletion import DeletedGroup, check_deletable

if TYPE_CHECKING:
    from equeue.server.holds import Holds
    from equeue.server.offsetcommit import OffsetCommitter
    from equeue.store.store import MessageStore

log = logging.getLogger("equeue.groups")


class Peer(Protocol):
    where: str
    version: int  # the protocol version the connection was welcomed with

    def finish(self, request_id: int, outcome: object) -> None: ...


class Members(Protocol):
    """What of equeue/server/groups.py's GroupCoordinator a deletion needs."""

    deleting: set[str]

    def live_members(self, group: str) -> list[str]: ...
    def forget_group(self, group: str) -> None: ...


def answer(deleted: DeletedGroup, version: int = PROTOCOL_VERSION) -> dict[str, Any]:
    """The wire result: the group, how many committed offsets went, the topics deleted;
    to a connection welcomed with version 6 or later, also ``unfinished`` when a step
    after the deletion's commit point failed (what a later open finishes: without it a
    client saw a deletion reported whole that the store reported unfinished)."""
    result: dict[str, Any] = {
        "group": deleted.group,
        "offsets": deleted.offsets,
        "topics": list(deleted.topics),
    }
    if deleted.unfinished and version >= UNFINISHED_VERSION:
        result["unfinished"] = deleted.unfinished
    return result


class GroupDeleter:
    def __init__(
        self, store: MessageStore, coordinator: Members, holds: Holds, offsets: OffsetCommitter
    ) -> None:
        self.store = store
        self.coordinator = coordinator
        self.holds = holds
        self.offsets = offsets

    def delete(self, peer: Peer, rid: int, a: dict[str, Any]) -> asyncio.Future[Any]:
        """Start the deletion (refused at once with a live member); answered by ``peer.
        finish`` once the store's deletion ended."""
        group, dead_letters = a["group"], a.get("delete_dead_letters", False)
        check_deletable(group, dead_letters)
        coordinator = self.coordinator
        if group in coordinator.deleting:
            raise GroupError(f"{peer.where}: group {group!r} is being deleted already")
        live = coordinator.live_members(group)
        if live:
            shown = ", ".join(map(repr, live[:5])) + (" ..." if len(live) > 5 else "")
            raise GroupError(
                f"{peer.where}: group {group!r} has {len(live)} live member(s) ({shown}); "
                "a group is deleted only without members: stop its consumers (close() "
                "leaves at once; a killed one leaves when its session_timeout ends), then "
                "delete it again"
            )
        coordinator.deleting.add(group)
        store = self.store
        job = self.offsets.after_commits(
            lambda: store.delete_group(group, delete_dead_letters=dead_letters)
        )
        job.add_done_callback(lambda done: self._done(peer, rid, group, done))
        return job

    def _done(self, peer: Peer, rid: int, group: str, done: asyncio.Future[Any]) -> None:
        self.coordinator.deleting.discard(group)
        if done.cancelled():
            peer.finish(rid, GroupError(f"the broker stopped before group {group!r} was deleted"))
            return
        error = done.exception()
        if error is not None:
            peer.finish(rid, error)
            return
        self.coordinator.forget_group(group)
        self.holds.answer_group(group, retry_topic(group))
        log.warning("group %r deleted by %s: %s", group, peer.where, answer(done.result()))
        peer.finish(rid, answer(done.result(), peer.version))
