#!/usr/bin/env bash
# A local NATS server with JetStream for tests and demos.
#
#   scripts/nats.sh start    start nats-server -js in the background, unless a server already
#                            answers on the address (installs Debian's nats-server if missing)
#   scripts/nats.sh wait     wait until a NATS server with JetStream answers
#   scripts/nats.sh status   exit 0 when a NATS server with JetStream answers
#   scripts/nats.sh stop     stop the server that 'start' started (never one it found running)
#
# Environment:
#   NATS_ADDR             host:port (default 127.0.0.1:4222)
#   NATS_WAIT_TIMEOUT     seconds 'wait' waits (default 30)
#   SETTLE_SERVICES_DIR   pid file, log and JetStream store folder (default target/services)
set -euo pipefail
LOG_TAG=nats
# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

NATS_ADDR="${NATS_ADDR:-127.0.0.1:4222}"
NATS_WAIT_TIMEOUT="${NATS_WAIT_TIMEOUT:-30}"
split_addr "$NATS_ADDR" HOST PORT
PIDFILE="$SERVICES_DIR/nats.pid"
LOGFILE="$SERVICES_DIR/nats.log"
STORE="$SERVICES_DIR/nats-js"

# Prints the server's INFO line (NATS greets every client with one) and answers a PING;
# fails when nothing, or something else, listens there.
info_line() {
    # shellcheck disable=SC2016 # expanded by the inner shell
    timeout 3 bash -c '
        exec 3<>"/dev/tcp/$1/$2" || exit 1
        IFS= read -r -t 2 line <&3 || exit 1
        case "$line" in INFO\ *) ;; *) exit 1 ;; esac
        printf "CONNECT {\"verbose\":false,\"name\":\"settle-probe\"}\r\nPING\r\n" >&3
        IFS= read -r -t 2 pong <&3 || exit 1
        case "$pong" in PONG*) printf "%s\n" "$line" ;; *) exit 1 ;; esac
    ' _ "$HOST" "$PORT" 2>/dev/null
}

# 0: NATS with JetStream answers; 1: nothing/not NATS; 2: NATS without JetStream.
probe() {
    local info
    info="$(info_line)" || return 1
    case "$info" in *'"jetstream":true'*) return 0 ;; *) return 2 ;; esac
}

find_server() {
    command -v nats-server 2>/dev/null || { [ -x /usr/sbin/nats-server ] && echo /usr/sbin/nats-server; }
}

cmd_start() {
    local rc=0 bin
    probe || rc=$?
    case "$rc" in
    0)
        if pid_alive "$PIDFILE"; then
            log "nats-server already running (pid $(cat "$PIDFILE")) on $HOST:$PORT"
        else
            log "a NATS server with JetStream already answers on $HOST:$PORT (not started by this script); using it"
        fi
        return 0
        ;;
    2) die "the NATS server on $HOST:$PORT runs without JetStream; restart it with -js (or set NATS_ADDR)" ;;
    esac
    if pid_alive "$PIDFILE"; then
        log "nats-server already started (pid $(cat "$PIDFILE")), not answering yet; 'wait' for it"
        return 0
    fi
    tcp_open "$HOST" "$PORT" && die "$HOST:$PORT accepts connections but is not a NATS server: free the port or set NATS_ADDR"
    if ! bin="$(find_server)"; then
        log "nats-server not found; installing Debian's nats-server package"
        apt_install nats-server
        bin="$(find_server)" || die "nats-server still not found after installing the nats-server package"
    fi
    mkdir -p "$SERVICES_DIR" "$STORE"
    printf '\n=== %s: %s on %s:%s\n' "$(date -u +%FT%TZ)" "$bin" "$HOST" "$PORT" >>"$LOGFILE"
    nohup "$bin" -a "$HOST" -p "$PORT" -js -sd "$STORE" </dev/null >>"$LOGFILE" 2>&1 &
    echo $! >"$PIDFILE"
    log "nats-server started (pid $!) on $HOST:$PORT; log: $LOGFILE"
}

cmd_wait() {
    local t0 rc pid
    t0=$(date +%s)
    while true; do
        rc=0
        probe || rc=$?
        [ "$rc" -eq 0 ] && break
        [ "$rc" -eq 2 ] && die "the NATS server on $HOST:$PORT runs without JetStream (start it with -js)"
        if [ -f "$PIDFILE" ] && ! pid_alive "$PIDFILE"; then
            pid="$(cat "$PIDFILE")"
            rm -f "$PIDFILE"
            tail -n 30 "$LOGFILE" >&2 2>/dev/null || true
            die "nats-server (pid $pid) exited before answering on $HOST:$PORT; its log is above ($LOGFILE)"
        fi
        if [ "$(seconds_since "$t0")" -ge "$NATS_WAIT_TIMEOUT" ]; then
            die "no NATS server with JetStream answered on $HOST:$PORT within ${NATS_WAIT_TIMEOUT}s (start one with: scripts/nats.sh start)"
        fi
        sleep 0.3
    done
    log "NATS with JetStream answers on $HOST:$PORT (after $(fmt_secs "$(seconds_since "$t0")"))"
}

cmd_status() {
    local rc=0 info
    if pid_alive "$PIDFILE"; then
        log "nats-server started by this script: pid $(cat "$PIDFILE"), log $LOGFILE"
    else
        log "no nats-server started by this script is running"
    fi
    info="$(info_line)" || rc=1
    if [ "$rc" -ne 0 ]; then
        log "no NATS server answers on $HOST:$PORT"
        return 1
    fi
    printf '%s\n' "$info"
    probe || rc=$?
    if [ "$rc" -eq 2 ]; then
        log "NATS answers on $HOST:$PORT but JetStream is OFF"
        return 1
    fi
    log "NATS with JetStream answers on $HOST:$PORT"
}

case "${1:-}" in
start) cmd_start ;;
wait) cmd_wait ;;
status) cmd_status ;;
stop) stop_pid "$PIDFILE" nats-server ;;
-h | --help | help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//' ;;
*)
    sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
    ;;
esac
