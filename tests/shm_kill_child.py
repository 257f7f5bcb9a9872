"""Attaches to a broker's shared rings by hand, writes the first part of a send frame
into the request ring, wakes the broker, says so and waits to be SIGKILLed."""

from __future__ import annotations

import sys
import time

from shm_helpers import RawShm

from equeue.protocol.frames import encode

peer = RawShm(sys.argv[1])
frame = encode([1, "send", {"topic": "t", "body": b"y" * 200}])
peer.write(frame[: len(frame) // 2])
peer.wake()
print("written", flush=True)
time.sleep(60)
