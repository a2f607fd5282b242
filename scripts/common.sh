# shellcheck shell=bash
# Helpers shared by the scripts in this folder. Source it, do not run it.
#
#   ROOT          repository root (the folder holding Cargo.toml)
#   SERVICES_DIR  where the service scripts keep pid files, logs and data
#                 (default: $ROOT/target/services, override with SETTLE_SERVICES_DIR)

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC2034 # used by the scripts that source this file
SERVICES_DIR="${SETTLE_SERVICES_DIR:-$ROOT/target/services}"

# Messages go to stderr so that stdout stays usable for data (status, probes).
log() { printf '[%s] %s\n' "${LOG_TAG:-settle}" "$*" >&2; }
warn() { printf '[%s] WARNING: %s\n' "${LOG_TAG:-settle}" "$*" >&2; }
die() {
    printf '[%s] ERROR: %s\n' "${LOG_TAG:-settle}" "$*" >&2
    exit 1
}

# as_root CMD...: run CMD as root: directly when we are root, else through sudo
# when it works without a password prompt; otherwise fail with the exact command.
as_root() {
    if [ "$(id -u)" -eq 0 ]; then
        "$@"
    elif can_be_root; then
        sudo -n "$@"
    else
        die "root is needed for: $*
  run it yourself as root (e.g. 'sudo $*'), then run this script again"
    fi
}

# can_be_root: true when we are root or have passwordless sudo.
can_be_root() {
    [ "$(id -u)" -eq 0 ] || { command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; }
}

APT_UPDATED=0
# apt_install PKG...: install Debian packages (runs 'apt-get update' once per process).
apt_install() {
    command -v apt-get >/dev/null 2>&1 ||
        die "apt-get not found: install these packages with your system's package manager: $*"
    can_be_root ||
        die "installing packages needs root; run as root: apt-get update && apt-get install -y $*
  then run this script again"
    if [ "$APT_UPDATED" -eq 0 ]; then
        log "apt-get update"
        as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq ||
            die "apt-get update failed"
        APT_UPDATED=1
    fi
    log "apt-get install $*"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" ||
        die "apt-get install failed; run: apt-get install -y $*"
}

# deb_installed PKG: true when the Debian package is installed.
deb_installed() {
    [ "$(dpkg-query -W -f='${db:Status-Status}' "$1" 2>/dev/null)" = "installed" ]
}

# split_addr HOST:PORT VAR_HOST VAR_PORT
split_addr() {
    local addr="$1"
    addr="${addr#*://}" # tolerate tcp://host:port and nats://host:port
    addr="${addr%%,*}"  # first of a comma-separated bootstrap list
    printf -v "$2" '%s' "${addr%:*}"
    printf -v "$3" '%s' "${addr##*:}"
}

# tcp_open HOST PORT: true when something accepts a TCP connection there (1 s timeout).
tcp_open() {
    timeout 1 bash -c "exec 3<>/dev/tcp/$1/$2" 2>/dev/null
}

# pid_alive PIDFILE: true when the pid file names a running process.
pid_alive() {
    local pid
    [ -f "$1" ] || return 1
    pid="$(cat "$1" 2>/dev/null)"
    [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null
}

# stop_pid PIDFILE NAME: stop the process the pid file names (TERM, then KILL after 10 s)
# and remove the pid file. Only processes whose command line contains NAME are signalled,
# so a stale pid file never kills an unrelated process that reused the pid.
stop_pid() {
    local pidfile="$1" name="$2" pid
    if [ ! -f "$pidfile" ]; then
        log "$name: not started by these scripts (no $pidfile); nothing to stop"
        return 0
    fi
    pid="$(cat "$pidfile")"
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null &&
        tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q -- "$name"; then
        log "$name: stopping pid $pid"
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 1 100); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        if kill -0 "$pid" 2>/dev/null; then
            warn "$name: pid $pid still alive after 10 s; sending KILL"
            kill -KILL "$pid" 2>/dev/null || true
        fi
    else
        log "$name: pid file $pidfile is stale (pid ${pid:-none} not running)"
    fi
    rm -f "$pidfile"
}

# seconds_since EPOCH: whole seconds elapsed.
seconds_since() { echo $(($(date +%s) - $1)); }

# fmt_secs N: 75 -> 1m15s
fmt_secs() {
    if [ "$1" -ge 60 ]; then printf '%dm%02ds' $(($1 / 60)) $(($1 % 60)); else printf '%ds' "$1"; fi
}
