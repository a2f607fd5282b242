#!/usr/bin/env bash
# A local Kafka-compatible broker for tests and demos: tansu (crates.io), in-memory storage.
#
#   scripts/kafka.sh up                           install, start, wait, and create settle's default
#                                                 topics (settle.uploads:8, settle.changelog:8, the tier topics,
#                                                 settle.tier-events, settle.dead-letter, settle.tier-counts)
#   scripts/kafka.sh install                      cargo install tansu, unless it is already there
#   scripts/kafka.sh bin                          print the tansu binary's path (fails when none)
#   scripts/kafka.sh start                        start a broker in the background (idempotent)
#   scripts/kafka.sh wait                         wait until the broker answers a Metadata request
#   scripts/kafka.sh create-topics NAME[:N[:compact]] ...   create topics with N partitions
#                                                 (default 3), compacted with ':compact'
#   scripts/kafka.sh status                       exit 0 when a broker answers, print what it says
#   scripts/kafka.sh stop                         stop the broker that 'start' started (only that)
#
# Environment:
#   KAFKA_BOOTSTRAP       host:port to listen on / probe (default 127.0.0.1:9092)
#   TANSU_BIN             tansu binary to use (default: 'tansu' on PATH, then ~/.cargo/bin/tansu)
#   TANSU_VERSION         version 'install' builds (default 0.6.0)
#   TANSU_FEATURES        features 'install' builds (default dynostore,postgres)
#   KAFKA_WAIT_TIMEOUT    seconds 'wait' waits (default 60)
#   SETTLE_SERVICES_DIR   pid file and log folder (default target/services)
#
# Any Kafka broker works for 'wait', 'status' and the tests (the probe speaks the protocol
# itself); 'start' and 'create-topics' need tansu.
set -euo pipefail
LOG_TAG=kafka
# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

KAFKA_BOOTSTRAP="${KAFKA_BOOTSTRAP:-127.0.0.1:9092}"
TANSU_VERSION="${TANSU_VERSION:-0.6.0}"
KAFKA_WAIT_TIMEOUT="${KAFKA_WAIT_TIMEOUT:-60}"
split_addr "$KAFKA_BOOTSTRAP" HOST PORT
PIDFILE="$SERVICES_DIR/tansu.pid"
LOGFILE="$SERVICES_DIR/tansu.log"
PROBE=(python3 "$ROOT/scripts/kafka-probe.py" "$HOST:$PORT")

# Prints the tansu binary path, or fails. TANSU_BIN, when set, is the only candidate.
find_tansu() {
    local c
    if [ -n "${TANSU_BIN:-}" ]; then
        [ -x "$TANSU_BIN" ] && echo "$TANSU_BIN"
        return
    fi
    for c in "$(command -v tansu 2>/dev/null || true)" "${CARGO_HOME:-$HOME/.cargo}/bin/tansu"; do
        if [ -n "$c" ] && [ -x "$c" ]; then
            echo "$c"
            return 0
        fi
    done
    return 1
}

answers() { "${PROBE[@]}" --quiet --timeout "${1:-2}" 2>/dev/null; }

cmd_install() {
    local bin t0 other
    if bin="$(find_tansu)"; then
        log "tansu present: $bin ($("$bin" --version 2>/dev/null || echo 'version unknown'))"
        return 0
    fi
    [ -z "${TANSU_BIN:-}" ] || die "TANSU_BIN=$TANSU_BIN is not an executable file"
    command -v cargo >/dev/null 2>&1 || die "cargo not found: install Rust first (scripts/setup.sh tells how)"
    # Another 'cargo install tansu' (say, a provisioning step) is running: wait for it rather
    # than compiling tansu twice on the same cores.
    other="$(pgrep -f 'cargo install .*tansu' || true)"
    if [ -n "$other" ]; then
        log "another 'cargo install tansu' is running (pid $(echo "$other" | tr '\n' ' ')); waiting for it"
        while pgrep -f 'cargo install .*tansu' >/dev/null; do sleep 5; done
        if bin="$(find_tansu)"; then
            log "tansu installed by the other process: $bin"
            return 0
        fi
        warn "the other install finished without a tansu binary; installing here"
    fi
    log "installing tansu $TANSU_VERSION from crates.io (compiles ~400 crates: 8 to 34 minutes measured on fresh 2-core machines, longer on a busy one)"
    t0=$(date +%s)
    # A broker for tests needs no LTO, no debug info and no single codegen unit: these
    # profile overrides (cargo config, which wins over the crate's own [profile.release])
    # roughly halve the install on 2 cores. `postgres` is a persistent storage engine (it needs
    # tansu's schema, which the crate does not ship); `libsql` (sqlite://) would be another, but
    # tansu 0.6's panics after a restart (tests/e2e/kafka_outage.rs says more).
    CARGO_PROFILE_RELEASE_LTO=false CARGO_PROFILE_RELEASE_CODEGEN_UNITS=16 \
        CARGO_PROFILE_RELEASE_DEBUG=0 CARGO_PROFILE_RELEASE_INCREMENTAL=false \
        cargo install tansu --locked --version "$TANSU_VERSION" --features "${TANSU_FEATURES:-dynostore,postgres}" ||
        die "cargo install tansu failed (needs network access to crates.io and a C toolchain: scripts/setup.sh)"
    bin="$(find_tansu)" || die "cargo install finished but no tansu binary found on PATH or in ${CARGO_HOME:-$HOME/.cargo}/bin"
    log "tansu installed in $(fmt_secs "$(seconds_since "$t0")"): $bin"
}

cmd_start() {
    local bin
    if answers; then
        if pid_alive "$PIDFILE"; then
            log "tansu already running (pid $(cat "$PIDFILE")) on $HOST:$PORT"
        else
            log "a Kafka broker already answers on $HOST:$PORT (not started by this script); using it"
        fi
        return 0
    fi
    if pid_alive "$PIDFILE"; then
        log "tansu already started (pid $(cat "$PIDFILE")), not answering yet; 'wait' for it"
        return 0
    fi
    if tcp_open "$HOST" "$PORT"; then
        die "$HOST:$PORT accepts connections but does not answer a Kafka Metadata request: free the port or set KAFKA_BOOTSTRAP"
    fi
    bin="$(find_tansu)" || die "tansu not found (looked at TANSU_BIN, PATH, ${CARGO_HOME:-$HOME/.cargo}/bin): run scripts/kafka.sh install"
    mkdir -p "$SERVICES_DIR"
    printf '\n=== %s: %s broker on %s:%s\n' "$(date -u +%FT%TZ)" "$bin" "$HOST" "$PORT" >>"$LOGFILE"
    # In-memory storage: every start is an empty cluster, which is what tests want.
    nohup "$bin" broker \
        --listener-url "tcp://$HOST:$PORT" \
        --advertised-listener-url "tcp://$HOST:$PORT" \
        --storage-engine "memory://tansu/" \
        </dev/null >>"$LOGFILE" 2>&1 &
    echo $! >"$PIDFILE"
    log "tansu started (pid $!) on $HOST:$PORT; log: $LOGFILE"
}

cmd_wait() {
    local t0 pid
    t0=$(date +%s)
    until answers 2; do
        if [ -f "$PIDFILE" ] && ! pid_alive "$PIDFILE"; then
            pid="$(cat "$PIDFILE")"
            rm -f "$PIDFILE"
            tail -n 30 "$LOGFILE" >&2 2>/dev/null || true
            die "tansu (pid $pid) exited before answering on $HOST:$PORT; its log is above ($LOGFILE)"
        fi
        if [ "$(seconds_since "$t0")" -ge "$KAFKA_WAIT_TIMEOUT" ]; then
            [ -f "$LOGFILE" ] && tail -n 30 "$LOGFILE" >&2
            "${PROBE[@]}" --quiet || true # prints why the probe fails
            die "no Kafka broker answered a Metadata request on $HOST:$PORT within ${KAFKA_WAIT_TIMEOUT}s (start one with: scripts/kafka.sh start)"
        fi
        sleep 0.5
    done
    log "Kafka broker answers on $HOST:$PORT (after $(fmt_secs "$(seconds_since "$t0")"))"
}

cmd_create_topics() {
    local bin spec name parts out listing
    [ "$#" -gt 0 ] || die "usage: scripts/kafka.sh create-topics NAME[:PARTITIONS] ..."
    bin="$(find_tansu)" || die "create-topics uses the tansu CLI; run scripts/kafka.sh install (or create the topics with your broker's tools)"
    listing="$("${PROBE[@]}")" || die "no Kafka broker answers on $HOST:$PORT (scripts/kafka.sh start && scripts/kafka.sh wait)"
    for spec in "$@"; do
        name="${spec%%:*}"
        parts=3
        config=()
        [ "$spec" = "$name" ] || parts="${spec#*:}"
        if [[ "$parts" == *:compact ]]; then
            parts="${parts%:compact}"
            config=(--config cleanup.policy=compact)
        fi
        [[ "$parts" =~ ^[1-9][0-9]*$ ]] || die "bad partition count in '$spec' (want NAME, NAME:N or NAME:N:compact, N >= 1)"
        if grep -qx "topic $name partitions [0-9]*" <<<"$listing"; then
            log "topic $name exists: $(grep -x "topic $name partitions [0-9]*" <<<"$listing")"
            continue
        fi
        if ! out="$("$bin" topic create "$name" --partitions "$parts" "${config[@]}" --broker "tcp://$HOST:$PORT" 2>&1)" &&
            ! grep -q "already exists" <<<"$out"; then
            printf '%s\n' "$out" >&2
            die "could not create topic $name"
        fi
        listing="$("${PROBE[@]}")" || die "the broker stopped answering after creating $name"
        grep -qx "topic $name partitions [0-9]*" <<<"$listing" ||
            die "topic $name not listed after create: $out"
        log "topic $name: $(grep -x "topic $name partitions [0-9]*" <<<"$listing")"
    done
}

cmd_status() {
    if pid_alive "$PIDFILE"; then
        log "tansu started by this script: pid $(cat "$PIDFILE"), log $LOGFILE"
    else
        log "no tansu started by this script is running"
    fi
    if "${PROBE[@]}"; then
        log "a Kafka broker answers on $HOST:$PORT"
    else
        log "no Kafka broker answers on $HOST:$PORT"
        return 1
    fi
}

# settle's default topics (config/settle.toml): input with 8 partitions (how far settle can
# scale out), the changelog with the same 8 (compacted), one partition for each output and
# the dead letters, and the tier counts the instances exchange (1 partition, compacted).
DEFAULT_TOPICS=(settle.uploads:8 settle.changelog:8:compact settle.ready.normal:1 settle.ready.limited:1 settle.tier-events:1 settle.dead-letter:1 settle.tier-counts:1:compact)

case "${1:-}" in
up)
    cmd_install
    cmd_start
    cmd_wait
    cmd_create_topics "${DEFAULT_TOPICS[@]}"
    log "ready: settle run (or settle run --config config/settle.toml) uses these topics"
    ;;
install) cmd_install ;;
bin) find_tansu || die "tansu not found (looked at TANSU_BIN, PATH, ${CARGO_HOME:-$HOME/.cargo}/bin): run scripts/kafka.sh install" ;;
start) cmd_start ;;
wait) cmd_wait ;;
create-topics)
    shift
    cmd_create_topics "$@"
    ;;
status) cmd_status ;;
stop) stop_pid "$PIDFILE" tansu ;;
-h | --help | help) sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//' ;;
*)
    sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
    ;;
esac
