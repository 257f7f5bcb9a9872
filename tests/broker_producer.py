"""A producer process for the broker's kill and drain tests, speaking the wire protocol
by hand (equeue/protocol only).

    python tests/broker_producer.py URL NAME [--window W] [--limit N] [--ready FILE]

Sends messages ``NAME:SEQ`` (seq 0, 1, ...) to topic ``p`` with up to W in flight and
prints, in one write each, ``A <seq> <message id>`` for every send answered OK. Stops
when the broker closes the connection (or after N sends); exits 0 either way, 3 on
anything else. ``--ready FILE``: the file is made once the first send is answered OK (a
test waits for every producer's before it signals the broker).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

from equeue.protocol.frames import FrameReader, check_answer, decode_body, encode

TOPIC = "p"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("name")
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--limit", type=int, default=1_000_000)
    parser.add_argument("--ready", default=None)
    args = parser.parse_args()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(args.url[len("unix:") :])
    reader = FrameReader(1 << 26, "producer")
    pending: list[object] = []

    def recv() -> object | None:
        while not pending:
            try:
                data = sock.recv(1 << 16)
            except OSError:
                return None
            if not data:
                return None
            pending.extend(decode_body(b, "producer") for b in reader.feed(data))
        return pending.pop(0)

    sock.sendall(encode({"versions": [1], "token": None, "client": args.name}))
    if not isinstance(recv(), dict):
        return 3
    sent = answered = 0
    in_flight: dict[int, int] = {}
    while answered < args.limit:
        try:
            while sent < args.limit and len(in_flight) < args.window:
                body = f"{args.name}:{sent}".encode()
                sock.sendall(encode([sent + 1, "send", {"topic": TOPIC, "body": body}]))
                in_flight[sent + 1] = sent
                sent += 1
        except OSError:
            break
        answer = recv()
        if answer is None:
            break
        rid, status, result = check_answer(answer, "producer")
        seq = in_flight.pop(rid)
        answered += 1
        if status == 0:
            os.write(1, f"A {seq} {result[0]}\n".encode())
            if args.ready is not None:
                open(args.ready, "a").close()
                args.ready = None
    os.write(1, f"END {answered}\n".encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
