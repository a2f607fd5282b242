#!/usr/bin/env bash
# Restart to first emission after `kill -9`, with and without Kafka static membership
# (kafka.group-instance-id), on the broker at KAFKA_BOOTSTRAP (scripts/kafka.sh start).
#
#   scripts/bench-restart.sh [--runs N] [--session-timeout MS] [MODE...]
#
# MODE is `dynamic` or `static` (default: both). For each mode and run: fresh topics
# (4 partitions) and consumer group, `settle run` under steady `settle loadgen` traffic
# (trickles, 100 uploads/s, fixed delay 2 s), SIGKILL after 15 s, a new `settle run` on the
# same data dir at once; measured from that start: the first `/readyz` 200 and the first
# ready record published after it (its broker timestamp). Prints one line per run and a
# summary; BENCHMARKS.md "Static membership" has the figures.
#
# Environment: SETTLE_BIN (default target/release/settle), KAFKA_BOOTSTRAP (127.0.0.1:9092).
set -euo pipefail
LOG_TAG=bench-restart
# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

SETTLE_BIN="${SETTLE_BIN:-$ROOT/target/release/settle}"
KAFKA_BOOTSTRAP="${KAFKA_BOOTSTRAP:-127.0.0.1:9092}"
RUNS=1
SESSION_TIMEOUT=45000
MODES=()
while [ "$#" -gt 0 ]; do
    case "$1" in
    --runs) RUNS="$2"; shift 2 ;;
    --session-timeout) SESSION_TIMEOUT="$2"; shift 2 ;;
    dynamic | static) MODES+=("$1"); shift ;;
    -h | --help) sed -n '2,15p' "$0"; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
    esac
done
[ "${#MODES[@]}" -gt 0 ] || MODES=(dynamic static)
[ -x "$SETTLE_BIN" ] || die "$SETTLE_BIN not found: cargo build --release (or set SETTLE_BIN)"
bash "$ROOT/scripts/kafka.sh" status >/dev/null || die "no broker on $KAFKA_BOOTSTRAP: scripts/kafka.sh start && scripts/kafka.sh wait"

WORK="$(mktemp -d)"
PIDS=()
cleanup() {
    for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; done
    rm -rf "$WORK"
}
trap cleanup EXIT

now_ms() { date +%s%3N; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# wait_ready PORT LIMIT_S: epoch ms of the first /readyz 200 ("" after LIMIT_S).
wait_ready() {
    local t0
    t0=$(date +%s)
    until curl -sf "http://127.0.0.1:$1/readyz" >/dev/null 2>&1; do
        [ $(($(date +%s) - t0)) -lt "$2" ] || return 0
        sleep 0.1
    done
    now_ms
}

# first_after TOPIC MS LIMIT_S: broker timestamp of the first ready record on TOPIC
# stamped after MS ("" after LIMIT_S).
first_after() {
    local t0 ts
    t0=$(date +%s)
    while [ $(($(date +%s) - t0)) -lt "$3" ]; do
        ts=$("$SETTLE_BIN" consume --bootstrap-servers "$KAFKA_BOOTSTRAP" --topic "$1" \
            --from-beginning --exit-at-end --with-meta 2>/dev/null |
            python3 -c 'import json,sys
after=int(sys.argv[1]); ts=[json.loads(l)["timestamp"] for l in sys.stdin if l.strip()]
later=[t for t in ts if t>after]; print(min(later) if later else "")' "$2")
        if [ -n "$ts" ]; then
            echo "$ts"
            return 0
        fi
        sleep 0.5
    done
}

start_run() { # CONFIG PORT LOG
    SETTLE_ADMIN__LISTEN="127.0.0.1:$2" SETTLE_LOG=info "$SETTLE_BIN" run --config "$1" >>"$3" 2>&1 &
    echo $!
}

declare -A READY_SUM FIRST_SUM COUNT
for mode in "${MODES[@]}"; do
    for run in $(seq 1 "$RUNS"); do
        id="bench-restart-$mode-$(date +%s)-$run"
        bash "$ROOT/scripts/kafka.sh" create-topics "$id.uploads:4" "$id.ready:4" "$id.dlq:1" "$id.changelog:4:compact" >/dev/null
        cfg="$WORK/$id.toml"
        static_line=""
        [ "$mode" = static ] && static_line="group-instance-id = \"$id-0\""
        cat >"$cfg" <<EOF
[debounce]
policy = "fixed"
delay = "2s"
[store]
data-dir = "$WORK/$id-data"
[kafka]
bootstrap-servers = "$KAFKA_BOOTSTRAP"
group-id = "$id"
input-topic = "$id.uploads"
dead-letter-topic = "$id.dlq"
changelog-topic = "$id.changelog"
$static_line
[kafka.properties]
"session.timeout.ms" = $SESSION_TIMEOUT
[[tiers.tier]]
name = "normal"
topic = "$id.ready"
EOF
        port=$(free_port)
        log="$WORK/$id.log"
        pid=$(start_run "$cfg" "$port" "$log")
        PIDS+=("$pid")
        [ -n "$(wait_ready "$port" 120)" ] || die "$mode: settle run never got ready (log: $(tail -5 "$log"))"
        "$SETTLE_BIN" loadgen --bootstrap-servers "$KAFKA_BOOTSTRAP" --topic "$id.uploads" \
            --scenario trickle --rate 100 --duration 120s --no-progress >/dev/null 2>&1 &
        PIDS+=("$!")
        gen=$!
        sleep 15
        kill -9 "$pid"
        wait "$pid" 2>/dev/null || true
        t0=$(now_ms)
        pid=$(start_run "$cfg" "$port" "$log")
        PIDS+=("$pid")
        ready=$(wait_ready "$port" 150)
        first=$(first_after "$id.ready" "$t0" 150)
        kill "$gen" 2>/dev/null || true
        kill -TERM "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
        [ -n "$ready" ] && [ -n "$first" ] || die "$mode run $run: no readiness ($ready) or no emission ($first) within 150 s of the restart"
        r=$((ready - t0))
        f=$((first - t0))
        printf '%-8s run %d: restart -> /readyz 200 in %6.2f s, -> first emission in %6.2f s\n' \
            "$mode" "$run" "$(echo "$r/1000" | bc -l)" "$(echo "$f/1000" | bc -l)"
        READY_SUM[$mode]=$((${READY_SUM[$mode]:-0} + r))
        FIRST_SUM[$mode]=$((${FIRST_SUM[$mode]:-0} + f))
        COUNT[$mode]=$((${COUNT[$mode]:-0} + 1))
    done
done
echo "summary (session.timeout.ms = $SESSION_TIMEOUT, broker $KAFKA_BOOTSTRAP):"
for mode in "${MODES[@]}"; do
    n=${COUNT[$mode]}
    printf '  %-8s mean of %d: /readyz %.2f s, first emission %.2f s\n' "$mode" "$n" \
        "$(echo "${READY_SUM[$mode]}/$n/1000" | bc -l)" "$(echo "${FIRST_SUM[$mode]}/$n/1000" | bc -l)"
done
