"""``Client.send_many``: one send request per message, a window of them in flight.

When it fails midway the error says exactly what happened to each message:

* ``sent``: the SendResults of the messages the broker acknowledged, in the messages'
  order (the others have no result);
* ``unanswered`` (ConnectionLostError): the messages written whose answer never came,
  as given: each may or may not be stored;
* ``unsent``: the messages never written: none is stored, each is safe to send again.

An error answer for one message (e.g. TopicNotFoundError) stops the writing; the
messages already in flight are still awaited, so ``sent`` is complete when it is raised.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from equeue.client import args
from equeue.client.calls import Call
from equeue.client.core import DECODERS
from equeue.errors import ConnectionLostError, EQueueError, InvalidMessageError
from equeue.store.types import SendResult

if TYPE_CHECKING:
    from equeue.client.sync import Client, _Connection, _Slot


def send_many(client: Client, topic: str, messages: object, window: int) -> list[SendResult]:
    if not args.is_int(window) or window < 1:
        raise InvalidMessageError(f"window must be an int >= 1, got {window!r}")
    name = args.topic(topic)
    items = args.batch_items(messages)
    batch: list[Call] = []
    for item in items:
        fields = args.outgoing(item, name)
        fields["topic"] = name
        batch.append(Call("send", fields, [item]))
    decode = DECODERS["send"]
    results: list[SendResult | None] = [None] * len(batch)
    in_flight: deque[tuple[int, _Slot]] = deque()
    lost: list[int] = []  # written, then the connection broke before their answer
    written = 0
    conn: _Connection | None = None
    failure: EQueueError | None = None
    while in_flight or (failure is None and written < len(batch)):
        if failure is None and written < len(batch):
            welcome = client.welcome
            room = min(window, welcome.limits["max_in_flight"]) if welcome else window
            count = min(room - len(in_flight), len(batch) - written)
            # Refill a quarter of the window at a time: one write for many requests.
            if count >= min(max(room // 4, 1), len(batch) - written) or not in_flight:
                try:
                    conn, slots = client._submit(
                        batch[written : written + count], conn if in_flight else None
                    )  # (a connection that broke under sends in flight is not replaced)
                except ConnectionLostError as exc:  # nothing of this part was written
                    failure = exc
                    lost.extend(i for i, _ in in_flight)  # (that connection is gone)
                    break
                in_flight.extend(zip(range(written, written + count), slots, strict=True))
                written += count
        assert conn is not None  # (set by the write that put the slots in flight)
        while in_flight:  # the oldest, then every one answered behind it
            index, slot = in_flight.popleft()
            try:
                results[index] = decode(client._wait(conn, slot), client.url)
            except ConnectionLostError as exc:
                failure = exc
                lost.append(index)
                lost.extend(i for i, _ in in_flight)  # every request on it failed with it
                in_flight.clear()
                break
            except EQueueError as exc:
                if failure is None:
                    failure = exc  # stop writing; the rest in flight are still awaited
            if in_flight and not in_flight[0][1].done:
                break
        if isinstance(failure, ConnectionLostError):
            break
    if failure is None:
        return results  # type: ignore[return-value]  # (every one is filled)
    failure.sent = [result for result in results if result is not None]
    failure.unsent = items[written:]
    if isinstance(failure, ConnectionLostError):
        failure.unanswered = [items[i] for i in sorted(lost)]
    raise failure
