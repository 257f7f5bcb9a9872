"""``equeue delete-group STORE GROUP``: a consumer group deleted from a store no writer
holds (``MessageStore.delete_group``). A store a broker serves is refused, as every
writer is (the store's lock): there the group is deleted through the broker, whose
coordinator knows the group's live members (``client.delete_group``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from equeue.errors import NotAStoreError, StoreLockedError
from equeue.store.meta import IDENTITY_FILE
from equeue.store.store import MessageStore

EXIT_OK = 0


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("store", type=Path, metavar="STORE")
    parser.add_argument("group", metavar="GROUP")
    parser.add_argument(
        "--dead-letters",
        action="store_true",
        help="delete its dead-letter topic equeue.dlq.GROUP too (kept by default)",
    )


def run(args: argparse.Namespace) -> int:
    if not (args.store / IDENTITY_FILE).exists():  # no store made where there was none
        raise NotAStoreError(f"{args.store} is not an equeue store (no store.json)")
    try:
        store = MessageStore.open(args.store)
    except StoreLockedError as exc:
        raise StoreLockedError(
            f"{exc.command_line_advice('delete-group')}. If 'equeue serve' serves it, "
            "delete the group through the broker "
            f"(equeue.connect(...).delete_group({args.group!r})), which refuses while the "
            "group has live members"
        ) from None
    with store:
        deleted = store.delete_group(args.group, delete_dead_letters=args.dead_letters)
    if args.json:
        print(json.dumps({"group": deleted.group, "offsets": deleted.offsets,
                          "topics": list(deleted.topics)}))  # fmt: skip
        return EXIT_OK
    topics = ", ".join(deleted.topics) or "none"
    print(
        f"group {deleted.group!r} deleted: {deleted.offsets} committed offsets; topics "
        f"deleted: {topics}"
    )
    return EXIT_OK
