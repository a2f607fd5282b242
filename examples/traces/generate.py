#!/usr/bin/env python3
"""Regenerates the bundled example traces (deterministic; seed fixed).

Each trace is JSONL: an upload record (SEMANTICS §2) plus "ts" (epoch ms) and "partition".
Scenarios come from the seed talk:
  burst-700.jsonl    one CI run split over 700 parallel machines: 700 uploads into the same
                     session within ~3 s, three such runs of one tenant 10 min apart
  trickle.jsonl      slow trickle: a long session uploading every 20-90 s for 30 min
  split-upload.jsonl clients that split one big upload into 2 requests a few seconds apart
  sparse.jsonl       a sparse sender: single uploads, minutes to hours apart
  mixed.jsonl        all of the above for several tenants, merged in time order
  two-requests-20s.jsonl
                     a tenant whose sessions always upload in two requests 20 s apart
                     (no part markers): what learned initial delays are for
Usage: python3 examples/traces/generate.py  (writes next to this file)
"""
import json, os, random, zlib

T0 = 1_767_225_600_000  # 2026-01-01T00:00:00Z
PARTITIONS = 8
HERE = os.path.dirname(os.path.abspath(__file__))


def partition(tenant, session):
    # Same rule as the transports: crc32 of the session key, modulo the partition count.
    return zlib.crc32(f"{tenant}/{session}".encode()) % PARTITIONS


def rec(tenant, session, ts, **extra):
    r = {"tenant": tenant, "session": session, "ts": ts, "partition": partition(tenant, session)}
    r.update(extra)
    return r


def burst(rng, tenant="bigco", runs=3, start=T0):
    out = []
    for run in range(runs):
        session = f"run-{1000 + run}"
        t0 = start + run * 600_000
        for m in range(700):
            out.append(rec(tenant, session, t0 + int(rng.uniform(0, 3000)),
                           event_id=f"{session}-m{m:03d}", attributes={"machine": m}))
    return out


def trickle(rng, tenant="slowci", sessions=2, start=T0):
    out = []
    for s in range(sessions):
        t = start + s * 45_000
        end = t + 30 * 60_000
        n = 0
        while t < end:
            out.append(rec(tenant, f"nightly-{s}", t, event_id=f"n{s}-{n}"))
            t += int(rng.uniform(20_000, 90_000))
            n += 1
    return out


def split(rng, tenant="splitter", sessions=20, start=T0):
    out = []
    for s in range(sessions):
        t = start + s * 30_000 + int(rng.uniform(0, 5000))
        gap = int(rng.uniform(1000, 8000))
        out.append(rec(tenant, f"s-{s}", t, event_id=f"s{s}-p1", part={"index": 1, "count": 2}))
        out.append(rec(tenant, f"s-{s}", t + gap, event_id=f"s{s}-p2", part={"index": 2, "count": 2}))
    return out


def sparse(rng, tenant="sparse", start=T0):
    out = []
    t = start
    for n in range(12):
        out.append(rec(tenant, "daily-smoke", t, event_id=f"d{n}"))
        t += int(rng.uniform(5 * 60_000, 3 * 3_600_000))
    return out


def two_requests(rng, tenant="twostep", sessions=60, start=T0):
    out = []
    for s in range(sessions):
        t = start + s * 60_000 + int(rng.uniform(0, 10_000))
        gap = 20_000 + int(rng.uniform(-500, 500))
        out.append(rec(tenant, f"job-{s}", t, event_id=f"j{s}-1"))
        out.append(rec(tenant, f"job-{s}", t + gap, event_id=f"j{s}-2"))
    return out


def write(name, records):
    records.sort(key=lambda r: (r["ts"], r["tenant"], r["session"]))
    with open(os.path.join(HERE, name), "w") as f:
        for r in records:
            f.write(json.dumps(r, separators=(",", ":")) + "\n")


def main():
    write("burst-700.jsonl", burst(random.Random(1)))
    write("trickle.jsonl", trickle(random.Random(2)))
    write("split-upload.jsonl", split(random.Random(3)))
    write("sparse.jsonl", sparse(random.Random(4)))
    write("two-requests-20s.jsonl", two_requests(random.Random(6)))
    rng = random.Random(5)
    mixed = []
    for i in range(3):
        mixed += burst(rng, tenant=f"bigco-{i}", runs=2, start=T0 + i * 120_000)
        mixed += trickle(rng, tenant=f"slowci-{i}", sessions=1, start=T0 + i * 60_000)
        mixed += split(rng, tenant=f"splitter-{i}", sessions=10, start=T0 + i * 10_000)
        mixed += sparse(rng, tenant=f"sparse-{i}", start=T0 + i * 1_000)
    write("mixed.jsonl", mixed)


if __name__ == "__main__":
    main()
