#!/usr/bin/env python3
"""Soak benchmark: one `settle run` on a real broker for a long time at a constant rate of
ever-new sessions, with per-minute figures (BENCHMARKS.md "Soak", issue 33).

    scripts/soak.py --transport kafka [--minutes 15] [--rate 2000] [--bin target/release/settle]
    scripts/soak.py --transport nats  [--minutes 15] [--rate 2000]

What runs (every process is started and stopped by this script; nothing shared is touched):

* the broker, of its own, on ports of its own and emptied at start: tansu (in-memory storage,
  `scripts/kafka.sh`) on 127.0.0.1:19092 with settle's default topics, or nats-server with
  JetStream (`scripts/nats.sh`) on 127.0.0.1:14222 with its store in the work folder;
  `--bootstrap HOST:PORT` uses a Kafka broker that is already running instead (Apache
  Kafka, say: then the topics must exist, and no broker CPU is sampled);
* `settle run` with the defaults but `debounce.state-ttl` (30 s: state keeps being created
  and forgotten), its store and admin endpoint in the work folder;
* `settle loadgen` at `--rate` uploads/s of new sessions (`--scenario`, default `mix`: 700-way
  bursts, split uploads, trickles, small bursts over `--tenants` tenants) for `--minutes`;
* `settle consume` of the ready topics (every emission: `emitted_at - due_at` is settle's timer
  lateness, SEMANTICS §3; the time it is read minus `due_at` adds the broker's delivery);
* a bare consumer beside settle: `settle consume` of the input topic (plain librdkafka, or an
  ordered JetStream consumer; no group, no store), whose delay (time read minus the record's
  broker/producer timestamp) tells a slow broker from a slow settle.

Every minute it prints one row: uploads settle applied, emissions read, timer lateness
p50/p99/max (`emitted_at - due_at` of `trailing` and `max_wait` emissions), their end-to-end p99
(read time minus due_at), the p99 of the immediate triggers (`leading`, `complete`, `final`:
their due_at is the upload's own timestamp, so theirs is the whole produce -> fetch -> apply
-> publish path), the bare consumer's delay p50/p99 and its CPU µs per record read (`settle consume`: decode
and print; a broker that hands out smaller fetches costs a consumer more per record), the p99 of changelog appends from append to the ack seen
by the partition (`settle_changelog_append_seconds`: a bucket's upper bound), settle's CPU
(% of one core, from /proc/<pid>/stat) and RSS, CPU µs per applied upload, the broker's CPU
and RSS, the load generator's CPU, partitions caught up, records read again while rewinding
(`settle_input_skipped_total`), the load average. `--json FILE` also writes the rows.

Needs: a release build of settle (`cargo build --release`), python3, and tansu (`scripts/kafka.sh
install`) or nats-server (`scripts/nats.sh start` installs it).
"""

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from datetime import datetime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TICK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--transport", choices=["kafka", "nats"], default="kafka")
    p.add_argument("--minutes", type=float, default=15.0, help="how long uploads go in (default 15)")
    p.add_argument("--rate", type=float, default=2000.0, help="uploads/s (default 2000)")
    p.add_argument("--scenario", default="mix", help="settle loadgen --scenario (default mix)")
    p.add_argument("--tenants", type=int, default=100, help="tenants (default 100)")
    p.add_argument("--state-ttl", default="30s", help="debounce.state-ttl (default 30s)")
    p.add_argument("--bin", default=os.path.join(ROOT, "target/release/settle"),
                   help="the settle binary (default target/release/settle)")
    p.add_argument("--bootstrap", help="use this running Kafka broker instead of starting tansu")
    p.add_argument("--kafka-port", type=int, default=19092, help="port of the soak's own tansu")
    p.add_argument("--nats-port", type=int, default=14222, help="port of the soak's own nats-server")
    p.add_argument("--admin-port", type=int, default=19464, help="settle's admin port")
    p.add_argument("--no-bare", action="store_true", help="no bare consumer beside settle")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra settle environment setting, e.g. SETTLE_STORE__FLUSH_INTERVAL=20ms")
    p.add_argument("--work", help="work folder (default: a new temporary one, removed at the end)")
    p.add_argument("--keep", action="store_true", help="keep the work folder (logs, store)")
    p.add_argument("--json", help="also write the per-minute rows to this file")
    p.add_argument("--interval", type=float, default=60.0, help="seconds per row (default 60)")
    p.add_argument("--perf-at", default="", metavar="ROW,ROW",
                   help="record settle and the broker with `perf record` for 20 s at the start of these "
                        "rows (e.g. 2,12), into perf-<who>-<row>.data in the work folder (implies --keep)")
    return p.parse_args()


# ---------------------------------------------------------------------------------------------
# Processes

def proc_cpu_s(pid):
    """utime + stime of `pid` (and its threads) in seconds, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICK
    except (OSError, IndexError, ValueError):
        return None


def proc_rss_mib(pid):
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE / 2**20
    except (OSError, IndexError, ValueError):
        return None


def loadavg():
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def parse_ms(text):
    """RFC 3339 with milliseconds and Z (settle's output records) -> epoch ms."""
    return int(datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() * 1000)


def pct(values, q):
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


class Reader(threading.Thread):
    """Reads JSON lines of a `settle consume --with-meta` and keeps per-row samples."""

    def __init__(self, proc, kind):
        super().__init__(daemon=True)
        self.proc, self.kind = proc, kind
        self.lock = threading.Lock()
        self.samples = []  # (lateness or delay ms, e2e ms, timer trigger)
        self.count = 0
        self.errors = 0

    def run(self):
        for line in self.proc.stdout:
            now = time.time() * 1000
            try:
                rec = json.loads(line)
                value = rec.get("value") or {}
                if self.kind == "ready":
                    due = parse_ms(value["due_at"])
                    timer = value.get("trigger") in ("trailing", "max_wait")
                    sample = (parse_ms(value["emitted_at"]) - due, now - due, timer)
                else:
                    sample = (now - rec["timestamp"], None, None)
            except (ValueError, KeyError, TypeError):
                self.errors += 1
                continue
            with self.lock:
                self.samples.append(sample)
                self.count += 1

    def take(self):
        with self.lock:
            s, self.samples = self.samples, []
        return s


def http_get(url, timeout=5):
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.read().decode()
    except Exception:  # noqa: BLE001 (a sample is skipped, the row says "-")
        return None


def metric_sum(text, name):
    """Sum of every series of Prometheus metric `name` in `text`."""
    total, found = 0.0, False
    for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text or "", re.M):
        total += float(m.group(1))
        found = True
    return total if found else None


def hist_buckets(text, name):
    """Cumulative bucket counts of Prometheus histogram `name` in `text`, summed over its
    series: {le (float, inf for +Inf): count}."""
    out = {}
    for m in re.finditer(rf'^{re.escape(name)}_bucket{{[^}}]*le="([^"]+)"[^}}]*}} ([0-9.e+-]+)$', text or "", re.M):
        le = float("inf") if m.group(1) == "+Inf" else float(m.group(1))
        out[le] = out.get(le, 0.0) + float(m.group(2))
    return out


def hist_quantile_ms(b0, b1, q):
    """Upper bound (ms) of the bucket holding quantile `q` of what was observed between two
    samples of `hist_buckets`; None when nothing was."""
    if not b1:
        return None
    les = sorted(b1)
    total = b1[les[-1]] - b0.get(les[-1], 0.0)
    if total <= 0:
        return None
    for le in les:
        if b1[le] - b0.get(le, 0.0) >= q * total:
            return le * 1000
    return None


class Soak:
    def __init__(self, args):
        self.args = args
        self.procs = []
        self.work = args.work or tempfile.mkdtemp(prefix="settle-soak-")
        os.makedirs(self.work, exist_ok=True)
        self.services = os.path.join(self.work, "services")
        self.env = dict(os.environ, SETTLE_SERVICES_DIR=self.services)
        self.broker_pid = None
        self.started_broker = False

    def log(self, msg):
        print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    def spawn(self, name, cmd, env=None, stdout=None):
        logf = open(os.path.join(self.work, f"{name}.log"), "w")
        p = subprocess.Popen(cmd, env=env or self.env, stdout=stdout or logf, stderr=logf,
                             text=True, start_new_session=True)
        self.procs.append((name, p))
        self.log(f"{name}: pid {p.pid}: {' '.join(cmd)}")
        return p

    # -- broker ---------------------------------------------------------------------------------
    def start_broker(self):
        a = self.args
        if a.transport == "kafka":
            if a.bootstrap:
                self.bootstrap = a.bootstrap
                return
            self.bootstrap = f"127.0.0.1:{a.kafka_port}"
            env = dict(self.env, KAFKA_BOOTSTRAP=self.bootstrap)
            if subprocess.run([f"{ROOT}/scripts/kafka.sh", "status"], env=env,
                              capture_output=True).returncode == 0:
                sys.exit(f"a Kafka broker already answers on {self.bootstrap}: stop it or pass "
                         "--kafka-port (the soak wants an empty broker of its own)")
            subprocess.run([f"{ROOT}/scripts/kafka.sh", "up"], env=env, check=True)
            self.started_broker = True
            with open(os.path.join(self.services, "tansu.pid")) as f:
                self.broker_pid = int(f.read())
        else:
            self.nats_url = f"nats://127.0.0.1:{a.nats_port}"
            env = dict(self.env, NATS_ADDR=f"127.0.0.1:{a.nats_port}")
            if subprocess.run([f"{ROOT}/scripts/nats.sh", "status"], env=env,
                              capture_output=True).returncode == 0:
                sys.exit(f"a NATS server already answers on port {a.nats_port}: stop it or pass "
                         "--nats-port (the soak wants an empty server of its own)")
            subprocess.run([f"{ROOT}/scripts/nats.sh", "start"], env=env, check=True)
            subprocess.run([f"{ROOT}/scripts/nats.sh", "wait"], env=env, check=True)
            self.started_broker = True
            with open(os.path.join(self.services, "nats.pid")) as f:
                self.broker_pid = int(f.read())

    def stop_broker(self):
        if not self.started_broker:
            return
        if self.args.transport == "kafka":
            env = dict(self.env, KAFKA_BOOTSTRAP=self.bootstrap)
            subprocess.run([f"{ROOT}/scripts/kafka.sh", "stop"], env=env)
        else:
            env = dict(self.env, NATS_ADDR=f"127.0.0.1:{self.args.nats_port}")
            subprocess.run([f"{ROOT}/scripts/nats.sh", "stop"], env=env)

    # -- settle -----------------------------------------------------------------------------------
    def settle_env(self):
        a = self.args
        env = dict(self.env,
                   SETTLE_DEBOUNCE__STATE_TTL=a.state_ttl,
                   SETTLE_STORE__DATA_DIR=os.path.join(self.work, "data"),
                   SETTLE_ADMIN__LISTEN=f"127.0.0.1:{a.admin_port}",
                   RUST_LOG=os.environ.get("RUST_LOG", "info"))
        if a.transport == "kafka":
            env["SETTLE_KAFKA__BOOTSTRAP_SERVERS"] = self.bootstrap
        else:
            env["SETTLE_NATS__SERVERS"] = self.nats_url
        for kv in a.set:
            k, _, v = kv.partition("=")
            env[k] = v
        return env

    def wait_ready(self, settle, timeout=120):
        t0 = time.time()
        while time.time() - t0 < timeout:
            if settle.poll() is not None:
                sys.exit(f"settle run exited ({settle.returncode}); see {self.work}/settle.log")
            body = http_get(f"http://127.0.0.1:{self.args.admin_port}/v1/partitions")
            if body:
                parts = json.loads(body).get("partitions", [])
                if len(parts) >= 8 and all(p["state"] not in ("starting", "restoring") for p in parts):
                    return
            time.sleep(0.5)
        sys.exit(f"settle did not own 8 partitions within {timeout} s; see {self.work}/settle.log")

    def consume(self, name, topics):
        b = self.args.bin
        cmd = [b, "consume", "--with-meta"]
        if self.args.transport == "kafka":
            cmd += ["--bootstrap-servers", self.bootstrap]
        else:
            cmd += ["--nats", self.nats_url]
        for t in topics:
            cmd += ["--topic", t]
        return self.spawn(name, cmd, stdout=subprocess.PIPE)

    def run(self):
        a = self.args
        if not os.access(a.bin, os.X_OK):
            sys.exit(f"{a.bin} is not an executable (cargo build --release, or pass --bin)")
        self.log(f"work folder {self.work}; {a.transport}, {a.rate:.0f} uploads/s for "
                 f"{a.minutes:g} min, state-ttl {a.state_ttl}, load {loadavg():.2f}")
        self.start_broker()
        settle = self.spawn("settle", [a.bin, "run"] + (["--transport", "nats"] if a.transport == "nats" else []),
                            env=self.settle_env())
        self.wait_ready(settle)
        if a.transport == "kafka":
            ready = self.consume("ready", ["settle.ready.normal", "settle.ready.limited"])
            bare = None if a.no_bare else self.consume("bare", ["settle.uploads"])
        else:
            ready = self.consume("ready", ["settle.ready.>"])
            bare = None if a.no_bare else self.consume("bare", ["settle.uploads.>"])
        readers = {"ready": Reader(ready, "ready")}
        if bare:
            readers["bare"] = Reader(bare, "bare")
        for r in readers.values():
            r.start()
        time.sleep(2)  # the readers are positioned at the end before the first upload
        gen = [a.bin, "loadgen", "--no-progress", "--rate", str(a.rate), "--scenario", a.scenario,
               "--tenants", str(a.tenants), "--duration", f"{int(a.minutes * 60)}s"]
        gen += ["--bootstrap-servers", self.bootstrap] if a.transport == "kafka" else ["--nats", self.nats_url]
        loadgen = self.spawn("loadgen", gen)
        rows = []
        header = ("min", "uploads", "emitted", "timer late p50", "p99", "max", "e2e p99", "immediate p99", "bare p50",
                  "bare p99", "bare µs/record", "changelog p99", "settle CPU", "RSS MiB", "µs/upload", "broker CPU", "broker MiB",
                  "loadgen CPU", "caught up", "reread", "load")
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header), flush=True)
        metrics_url = f"http://127.0.0.1:{a.admin_port}/metrics"
        parts_url = f"http://127.0.0.1:{a.admin_port}/v1/partitions"
        pids = {"settle": settle.pid, "broker": self.broker_pid, "loadgen": loadgen.pid,
                "bare": bare.pid if bare else None}
        cpu0 = {k: proc_cpu_s(p) if p else None for k, p in pids.items()}
        m0 = http_get(metrics_url)
        consumed0 = metric_sum(m0, "settle_uploads_consumed_total") or 0
        skipped0 = metric_sum(m0, "settle_input_skipped_total") or 0
        cl0 = hist_buckets(m0, "settle_changelog_append_seconds")
        perf_rows = {int(x) for x in a.perf_at.split(",") if x.strip()}
        t0 = time.time()
        start = t0
        n = 0
        total = a.minutes * 60
        try:
            while (n + 1) * a.interval <= total + 1:
                n += 1
                if n in perf_rows:
                    self.perf(n, pids)
                time.sleep(max(0, start + n * a.interval - time.time()))
                t1 = time.time()
                dt = t1 - t0
                cpu1 = {k: proc_cpu_s(p) if p else None for k, p in pids.items()}
                use = {k: (None if cpu0[k] is None or cpu1[k] is None else (cpu1[k] - cpu0[k]) / dt * 100)
                       for k in pids}
                m1 = http_get(metrics_url)
                consumed1 = metric_sum(m1, "settle_uploads_consumed_total") or consumed0
                skipped1 = metric_sum(m1, "settle_input_skipped_total") or skipped0
                cl1 = hist_buckets(m1, "settle_changelog_append_seconds") or cl0
                body = http_get(parts_url)
                plist = json.loads(body).get("partitions", []) if body else []
                caught = sum(1 for p in plist if p.get("caught_up"))
                ready_s = readers["ready"].take()
                late = [s[0] for s in ready_s if s[2]]
                e2e = [s[1] for s in ready_s if s[2]]
                imm = [s[0] for s in ready_s if not s[2]]
                bare_s = [s[0] for s in readers["bare"].take()] if "bare" in readers else []
                uploads = consumed1 - consumed0
                settle_cpu_s = None if use["settle"] is None else use["settle"] * dt / 100
                row = {
                    "minute": n if a.interval == 60 else round((t1 - start) / 60, 2),
                    "uploads": int(uploads),
                    "emitted": len(ready_s),
                    "late_p50_ms": pct(late, 0.5), "late_p99_ms": pct(late, 0.99),
                    "late_max_ms": max(late) if late else None,
                    "e2e_p99_ms": pct(e2e, 0.99),
                    "immediate_p99_ms": pct(imm, 0.99),
                    "bare_p50_ms": pct(bare_s, 0.5), "bare_p99_ms": pct(bare_s, 0.99),
                    "bare_cpu_us_per_record": (use["bare"] * dt / 100 * 1e6 / len(bare_s))
                    if bare_s and use.get("bare") is not None else None,
                    "changelog_p99_ms": hist_quantile_ms(cl0, cl1, 0.99),
                    "settle_cpu_pct": use["settle"], "settle_rss_mib": proc_rss_mib(settle.pid),
                    "cpu_us_per_upload": (settle_cpu_s * 1e6 / uploads) if uploads and settle_cpu_s else None,
                    "broker_cpu_pct": use["broker"],
                    "broker_rss_mib": proc_rss_mib(self.broker_pid) if self.broker_pid else None,
                    "loadgen_cpu_pct": use["loadgen"],
                    "caught_up": f"{caught}/{len(plist)}",
                    "reread": int(skipped1 - skipped0),
                    "load": loadavg(),
                }
                rows.append(row)
                print(self.format(row), flush=True)
                t0, cpu0, consumed0, skipped0, cl0 = t1, cpu1, consumed1, skipped1, cl1
                if settle.poll() is not None:
                    self.log(f"settle exited ({settle.returncode}); see {self.work}/settle.log")
                    break
        finally:
            if a.json:
                with open(a.json, "w") as f:
                    json.dump({"args": vars(a), "rows": rows}, f, indent=1)
            self.summary(rows, readers)
        return rows

    def perf(self, row, pids):
        """`perf record` (flat, no call graph: the binaries have no frame pointers) of settle
        and the broker for 20 s, in the background."""
        for who in ("settle", "broker"):
            if pids.get(who):
                out = os.path.join(self.work, f"perf-{who}-{row}.data")
                subprocess.Popen(["perf", "record", "-F", "499", "-p", str(pids[who]), "-o", out,
                                  "--", "sleep", "20"], stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, start_new_session=True)
        self.log(f"perf record of settle and the broker for 20 s (row {row})")

    @staticmethod
    def format(r):
        def ms(v):
            return "-" if v is None else (f"{v / 1000:.2f} s" if v >= 10_000 else f"{v:.0f}")

        def f(v, fmt):
            return "-" if v is None else format(v, fmt)

        cells = [f"{r['minute']:g}", str(r["uploads"]), str(r["emitted"]), ms(r["late_p50_ms"]),
                 ms(r["late_p99_ms"]), ms(r["late_max_ms"]), ms(r["e2e_p99_ms"]), ms(r["immediate_p99_ms"]),
                 ms(r["bare_p50_ms"]),
                 ms(r["bare_p99_ms"]), f(r.get("bare_cpu_us_per_record"), ".0f"), ("≤ " + ms(r["changelog_p99_ms"])) if r.get("changelog_p99_ms") else "-",
                 f(r["settle_cpu_pct"], ".0f") + " %", f(r["settle_rss_mib"], ".0f"),
                 f(r["cpu_us_per_upload"], ".0f"), f(r["broker_cpu_pct"], ".0f") + " %",
                 f(r["broker_rss_mib"], ".0f"), f(r["loadgen_cpu_pct"], ".0f") + " %", r["caught_up"],
                 str(r["reread"]), f"{r['load']:.1f}"]
        return "| " + " | ".join(cells) + " |"

    def summary(self, rows, readers):
        if not rows:
            return
        first, last = rows[0], rows[-1]
        parse_errors = sum(r.errors for r in readers.values())
        msg = (f"lateness p99 first row {first['late_p99_ms']} ms, last row {last['late_p99_ms']} ms; "
               f"CPU per upload {first['cpu_us_per_upload'] or 0:.0f} -> {last['cpu_us_per_upload'] or 0:.0f} µs")
        if first["late_p99_ms"] and last["late_p99_ms"] is not None:
            msg += f" (last/first lateness p99 {last['late_p99_ms'] / max(first['late_p99_ms'], 1):.2f}x)"
        if parse_errors:
            msg += f"; {parse_errors} lines not understood"
        print(msg, flush=True)

    def stop(self):
        for name, p in reversed(self.procs):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for name, p in self.procs:
            try:
                p.wait(timeout=40)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        self.stop_broker()
        if not self.args.keep and not self.args.work and not self.args.perf_at:
            shutil.rmtree(self.work, ignore_errors=True)
        else:
            self.log(f"logs and store kept in {self.work}")


def main():
    args = parse_args()
    soak = Soak(args)
    try:
        soak.run()
    except KeyboardInterrupt:
        pass
    finally:
        soak.stop()


if __name__ == "__main__":
    main()
