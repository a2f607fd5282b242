#!/usr/bin/env python3
"""CPU time of a command, by thread name: where a `settle run-file` run's CPU goes.

BENCHMARKS.md "2026-12-07 (ninth session): what the 1 µs goal is up against" (issue 37) was
measured with it:

    scripts/cpu-by-thread.py settle run-file --input trace.jsonl --data-dir d \
        --output o.jsonl --config settle.toml --partitions 1

runs the command (its standard output discarded; its log on standard error passes through), reads every thread's user + sys time from
`/proc/<pid>/task/<tid>/stat` every 50 ms while it runs, and prints the process's wall time,
its CPU time and max RSS as `wait4` reports them, then the CPU seconds and share of each
thread name (threads of one name summed: tokio's workers are all `tokio-rt-worker`). A
thread that ends between two samples loses up to 50 ms of its time, so the sum by thread can
be a little below the process's total. Exits with the command's exit code.
"""
import collections
import os
import subprocess
import sys
import time

SAMPLE_S = 0.05


def thread_times(pid, last):
    """Updates `last` (tid -> (name, cpu seconds)) from /proc; threads gone keep their value."""
    tick = os.sysconf("SC_CLK_TCK")
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # The name is in parentheses and may hold spaces; the fields after it are plain.
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        last[tid] = (name, (int(fields[11]) + int(fields[12])) / tick)


def main():
    if len(sys.argv) < 2:
        sys.exit(f"usage: {sys.argv[0]} COMMAND [ARG...]")
    started = time.time()
    proc = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL)
    last = {}
    while True:
        thread_times(proc.pid, last)
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        time.sleep(SAMPLE_S)
    wall = time.time() - started
    code = os.waitstatus_to_exitcode(status)
    by_name = collections.Counter()
    for name, cpu in last.values():
        by_name[name] += cpu
    total = sum(by_name.values()) or 1.0
    cpu = usage.ru_utime + usage.ru_stime
    print(
        f"wall {wall:.2f} s, CPU {cpu:.2f} s (user {usage.ru_utime:.2f} s, sys "
        f"{usage.ru_stime:.2f} s), max RSS {usage.ru_maxrss / 1024:.0f} MiB, exit code {code}"
    )
    for name, seconds in by_name.most_common():
        print(f"  {name:20s} {seconds:6.2f} s  {100 * seconds / total:5.1f} %")
    sys.exit(code)


if __name__ == "__main__":
    main()
