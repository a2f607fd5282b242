#!/usr/bin/env python3
"""Ask a Kafka broker for its metadata, speaking the wire protocol directly.

    scripts/kafka-probe.py [HOST:PORT] [--timeout SECONDS] [--quiet]

Sends one Metadata request (API key 3, version 4: supported by Kafka 1.0 to 4.x and by
tansu) and parses the answer. Exit 0 and print the brokers and topics when the broker
answers; exit 1 with the reason when it does not (refused, timeout, not Kafka, ...).
A TCP connect alone proves nothing; this proves the listener speaks Kafka.
Standard library only, so it works before anything is built.
"""

import argparse
import signal
import socket
import struct
import sys

API_METADATA = 3
VERSION = 4
CORRELATION_ID = 0x5E771E


class Reader:
    def __init__(self, buf):
        self.buf = buf
        self.pos = 0

    def take(self, fmt):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise ValueError("response truncated")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def int16(self):
        return self.take(">h")

    def int32(self):
        return self.take(">i")

    def boolean(self):
        return self.take(">b") != 0

    def string(self):
        n = self.int16()
        if n < 0:
            return None
        if self.pos + n > len(self.buf):
            raise ValueError("response truncated")
        s = self.buf[self.pos : self.pos + n].decode("utf-8", "replace")
        self.pos += n
        return s

    def array(self, item):
        n = self.int32()
        if n < 0:
            return None
        if n > 100_000:
            raise ValueError(f"implausible array length {n}: not a Kafka response")
        return [item() for _ in range(n)]


def request():
    client_id = b"settle-probe"
    header = struct.pack(">hhih", API_METADATA, VERSION, CORRELATION_ID, len(client_id)) + client_id
    body = struct.pack(">i", -1) + struct.pack(">b", 0)  # all topics; no auto-create
    msg = header + body
    return struct.pack(">i", len(msg)) + msg


def recv_exact(sock, n):
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError("connection closed by the peer before a full response")
        out += chunk
    return bytes(out)


def metadata(host, port, timeout):
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.settimeout(timeout)
        sock.sendall(request())
        size = struct.unpack(">i", recv_exact(sock, 4))[0]
        if size <= 0 or size > 64 * 1024 * 1024:
            raise ValueError(f"implausible response size {size}: not a Kafka broker")
        r = Reader(recv_exact(sock, size))
    if r.int32() != CORRELATION_ID:
        raise ValueError("correlation id mismatch: not a Kafka response")
    r.int32()  # throttle_time_ms

    def broker():
        node, host_, port_, _rack = r.int32(), r.string(), r.int32(), r.string()
        return node, host_, port_

    brokers = r.array(broker)
    cluster_id = r.string()
    controller = r.int32()

    def partition():
        err, index, leader = r.int16(), r.int32(), r.int32()
        r.array(r.int32)  # replicas
        r.array(r.int32)  # isr
        return index, err, leader

    def topic():
        err, name, _internal = r.int16(), r.string(), r.boolean()
        parts = r.array(partition)
        return name, err, parts or []

    topics = r.array(topic) or []
    return brokers or [], cluster_id, controller, topics


def main():
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `probe | head` ends quietly
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("address", nargs="?", default="127.0.0.1:9092")
    ap.add_argument("--timeout", type=float, default=3.0)
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args()
    addr = args.address.split(",")[0].split("://")[-1]
    host, _, port = addr.rpartition(":")
    try:
        brokers, cluster_id, controller, topics = metadata(host or "127.0.0.1", int(port), args.timeout)
    except (OSError, ValueError, struct.error) as e:
        print(f"kafka-probe: no Kafka metadata from {addr}: {e}", file=sys.stderr)
        return 1
    if not brokers:
        print(f"kafka-probe: {addr} answered but lists no brokers", file=sys.stderr)
        return 1
    if not args.quiet:
        print(f"cluster {cluster_id} controller {controller}")
        for node, h, p in brokers:
            print(f"broker {node} {h}:{p}")
        for name, err, parts in sorted(topics, key=lambda t: t[0] or ""):
            suffix = f" error {err}" if err else ""
            print(f"topic {name} partitions {len(parts)}{suffix}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
