#!/usr/bin/env python3
"""Inclusive share of one function, and of its direct callees, in a `perf script` dump.

BENCHMARKS.md "where run-file's CPU goes" (issue 37) was read with it:

    perf record -F 1999 --call-graph dwarf,16384 -o perf.data settle run-file ...
    perf script -i perf.data --comm tokio-rt-worker > stacks.txt
    scripts/perf-shares.py stacks.txt 'FireCtx::fire_due' 12

prints the share of the samples whose stack holds a frame matching the pattern (a substring
of the demangled symbol; the outermost match counts), then the frames it called, each with
its share of all samples. Inlined frames count as frames (perf lists them with dwarf).
"""
import collections
import re
import sys


def stacks(path):
    """Yields each sample's frames, leaf first (symbol names only)."""
    cur = []
    for line in open(path, errors="replace"):
        if line and not line[0].isspace():
            if cur:
                yield cur
            cur = []
            continue
        m = re.match(r"\s*[0-9a-f]+\s+(.*?)(\+0x[0-9a-f]+)?\s+\(", line)
        if m:
            cur.append(m.group(1))
    if cur:
        yield cur


def main():
    if len(sys.argv) < 3:
        sys.exit("usage: perf-shares.py STACKS PATTERN [ROWS]")
    path, pattern = sys.argv[1], sys.argv[2]
    rows = int(sys.argv[3]) if len(sys.argv) > 3 else 15
    total, hit, kids = 0, 0, collections.Counter()
    for frames in stacks(path):
        total += 1
        idx = [i for i, f in enumerate(frames) if pattern in f]
        if not idx:
            continue
        hit += 1
        i = max(idx)
        kids[frames[i - 1] if i > 0 else "(self)"] += 1
    if total == 0:
        sys.exit(f"no samples in {path}")
    print(f"{pattern}: {hit}/{total} samples = {100 * hit / total:.1f} %")
    for name, n in kids.most_common(rows):
        print(f"  {100 * n / total:5.1f} %  {name[:150]}")


if __name__ == "__main__":
    main()
