#!/usr/bin/env bash
# The test command of settle (CI runs exactly this, through .ci/run).
#
#   scripts/test.sh [--quick] [--no-services] [--keep-services] [--fuzz] [-- CARGO_TEST_ARGS...]
#
# Steps: system packages and toolchain (scripts/setup.sh) -> the deploy files checked
# statically (scripts/check-deploy.sh: compose, Kubernetes, Prometheus, Grafana; no build) ->
# tansu and NATS started and waited for (scripts/kafka.sh, scripts/nats.sh) -> cargo fmt
# --check -> cargo clippy -D warnings -> build all test targets -> cargo test --all-targets ->
# cargo test --doc -> summary -> stop the services this run started. Exit status non-zero
# when any step failed.
#
# The integration tests are three binaries (ARCHITECTURE.md, "Tests"): tests/offline (no
# service), tests/e2e (brokers, settle processes) and tests/config_load.rs. They find the
# brokers through SETTLE_TEST_KAFKA and SETTLE_TEST_NATS (exported here); a test that needs
# a broker FAILS when its variable is set and the broker is absent, and only skips when the
# variable is unset. SETTLE_TEST_TANSU (exported here too) is the tansu binary of
# the tests that start a broker of their own (to restart it).
#
#   --quick           skip cargo fmt and cargo clippy
#   --no-services     start no broker; SETTLE_TEST_KAFKA / SETTLE_TEST_NATS are left as the
#                     caller set them (point them at your own brokers, or leave them unset)
#   --keep-services   leave the brokers this run started running afterwards
#   --fuzz            also fuzz the input side for about a minute after the tests
#                     (scripts/fuzz.sh --seconds 20: three targets, 20 s each; its first run
#                     installs cargo-fuzz and builds the fuzz crate, a few minutes)
#   -- ARGS           passed to the test binaries of both cargo test runs, e.g. a name
#                     filter (a test of tests/offline or tests/e2e is named
#                     FILE::TEST, FILE its file's name):
#                     scripts/test.sh --quick -- kafka_process::
#
# Environment: KAFKA_BOOTSTRAP (default 127.0.0.1:9092), NATS_ADDR (default 127.0.0.1:4222),
# SETTLE_TEST_TIMEOUT (seconds the test run may take, default 2400), SETTLE_TEST_LOG (copy of
# the test output, default target/test-output.log), plus what the scripts named above read.
set -euo pipefail
LOG_TAG="test"
# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cd "$ROOT"

QUICK=0
SERVICES=1
KEEP_SERVICES=0
FUZZ=0
CARGO_TEST_ARGS=()
while [ "$#" -gt 0 ]; do
    case "$1" in
    --quick) QUICK=1 ;;
    --no-services) SERVICES=0 ;;
    --keep-services) KEEP_SERVICES=1 ;;
    --fuzz) FUZZ=1 ;;
    --)
        shift
        CARGO_TEST_ARGS=("$@")
        break
        ;;
    -h | --help)
        sed -n '2,34p' "$ROOT/scripts/test.sh" | sed 's/^# \{0,1\}//'
        exit 0
        ;;
    *) die "unknown option: $1 (try --help)" ;;
    esac
    shift
done

export KAFKA_BOOTSTRAP="${KAFKA_BOOTSTRAP:-127.0.0.1:9092}"
export NATS_ADDR="${NATS_ADDR:-127.0.0.1:4222}"
SETTLE_TEST_TIMEOUT="${SETTLE_TEST_TIMEOUT:-2400}"
TEST_LOG="${SETTLE_TEST_LOG:-$ROOT/target/test-output.log}"
mkdir -p "$(dirname "$TEST_LOG")"

T0=$(date +%s)
STEP_NAMES=()
STEP_STATES=()
STEP_SECS=()
FAILED_STEPS=()
STARTED_KAFKA=0
STARTED_NATS=0

banner() {
    printf '\n==> [%s] %s\n' "$(fmt_secs "$(seconds_since "$T0")")" "$*"
}

record() { # NAME STATE SECONDS
    STEP_NAMES+=("$1")
    STEP_STATES+=("$2")
    STEP_SECS+=("$3")
    [ "$2" != FAILED ] || FAILED_STEPS+=("$1")
}

# step NAME CMD...: run CMD, record the outcome, keep going. Returns CMD's status.
step() {
    local name="$1" t rc=0
    shift
    banner "$name: $*"
    t=$(date +%s)
    "$@" || rc=$?
    if [ "$rc" -eq 0 ]; then
        record "$name" ok "$(seconds_since "$t")"
        log "$name: ok ($(fmt_secs "$(seconds_since "$t")"))"
    else
        record "$name" FAILED "$(seconds_since "$t")"
        log "$name: FAILED with exit status $rc ($(fmt_secs "$(seconds_since "$t")"))"
    fi
    return "$rc"
}

# must NAME CMD...: like step, but a failure ends the run (nothing after it can work).
must() {
    step "$@" || die "step '$1' failed; stopping here (see the output above)"
}

# logged CMD...: run CMD with its output also appended to $TEST_LOG (for the summary).
logged() { "$@" 2>&1 | tee -a "$TEST_LOG"; }

skip() { # NAME WHY
    banner "$1: skipped ($2)"
    record "$1" skipped 0
}

summary() {
    local i total
    total="$(fmt_secs "$(seconds_since "$T0")")"
    printf '\n==> summary (%s)\n' "$total"
    for i in "${!STEP_NAMES[@]}"; do
        printf '  %-8s %-14s %8s\n' "${STEP_STATES[$i]}" "${STEP_NAMES[$i]}" "$(fmt_secs "${STEP_SECS[$i]}")"
    done
    if [ -s "$TEST_LOG" ] && grep -qE '^test .* \.\.\. FAILED$' "$TEST_LOG"; then
        printf 'failed tests (full output above, and in %s):\n' "$TEST_LOG"
        grep -E '^test .* \.\.\. FAILED$' "$TEST_LOG" | sed 's/^test /  /; s/ \.\.\. FAILED$//'
    fi
    if [ "${#FAILED_STEPS[@]}" -eq 0 ] && [ "${1:-0}" -eq 0 ]; then
        printf 'settle test.sh: SUCCESS in %s\n' "$total"
    else
        local why="${FAILED_STEPS[*]:-}"
        if [ "${1:-0}" -ge 128 ]; then why="${why:+$why, }interrupted by a signal"; fi
        printf 'settle test.sh: FAILED (%s) after %s\n' "${why:-aborted}" "$total"
    fi
}

stop_services() {
    if [ "$KEEP_SERVICES" -eq 1 ]; then
        [ "$STARTED_KAFKA$STARTED_NATS" = 00 ] || log "--keep-services: leaving the brokers running (scripts/kafka.sh stop, scripts/nats.sh stop)"
        return 0
    fi
    [ "$STARTED_KAFKA" -eq 0 ] || bash scripts/kafka.sh stop || true
    [ "$STARTED_NATS" -eq 0 ] || bash scripts/nats.sh stop || true
}

on_exit() {
    local rc=$?
    trap - EXIT INT TERM
    stop_services
    summary "$rc"
    if [ "$rc" -eq 0 ] && [ "${#FAILED_STEPS[@]}" -gt 0 ]; then rc=1; fi
    exit "$rc"
}
trap on_exit EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# pid_file_alive FILE: the service script's pid file names a live process (= it started one).
started_by_script() { pid_alive "$SERVICES_DIR/$1.pid"; }

banner "settle test.sh in $ROOT ($(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo 'no git'))" \
    "quick=$QUICK services=$SERVICES"

must setup bash scripts/setup.sh
step deploy-check bash scripts/check-deploy.sh || true

if [ "$SERVICES" -eq 1 ]; then
    must tansu-install bash scripts/kafka.sh install

    kafka_before=0
    started_by_script tansu && kafka_before=1
    must kafka-start bash scripts/kafka.sh start
    if [ "$kafka_before" -eq 0 ] && started_by_script tansu; then STARTED_KAFKA=1; fi

    nats_before=0
    started_by_script nats && nats_before=1
    must nats-start bash scripts/nats.sh start
    if [ "$nats_before" -eq 0 ] && started_by_script nats; then STARTED_NATS=1; fi

    must kafka-wait bash scripts/kafka.sh wait
    must nats-wait bash scripts/nats.sh wait

    export SETTLE_TEST_KAFKA="$KAFKA_BOOTSTRAP"
    export SETTLE_TEST_NATS="$NATS_ADDR"
    # The tests that restart a broker run a tansu of their own on another port.
    SETTLE_TEST_TANSU="$(bash scripts/kafka.sh bin)"
    export SETTLE_TEST_TANSU
else
    skip services "--no-services"
fi
log "SETTLE_TEST_KAFKA=${SETTLE_TEST_KAFKA:-<unset>} SETTLE_TEST_NATS=${SETTLE_TEST_NATS:-<unset>} SETTLE_TEST_TANSU=${SETTLE_TEST_TANSU:-<unset>}"

if [ "$QUICK" -eq 1 ]; then
    skip fmt "--quick"
    skip clippy "--quick"
else
    step fmt cargo fmt --all -- --check || true
    step clippy cargo clippy --all-targets -- -D warnings || true
fi

# Compile first, as its own step, so that build time and test time show apart and a
# compile error does not hide behind the test timeout. --no-fail-fast: one failing test
# binary must not keep the others (the broker tests, say) from running.
if step build cargo test --all-targets --no-run; then
    : >"$TEST_LOG"
    step test logged timeout --kill-after=30 "$SETTLE_TEST_TIMEOUT" \
        cargo test --all-targets --no-fail-fast -- "${CARGO_TEST_ARGS[@]}" || true
    # `cargo test --all-targets` runs no doc tests.
    step doctest logged timeout --kill-after=30 "$SETTLE_TEST_TIMEOUT" \
        cargo test --doc --no-fail-fast -- "${CARGO_TEST_ARGS[@]}" || true
else
    skip test "build failed"
    skip doctest "build failed"
fi

if [ "$FUZZ" -eq 1 ]; then
    step fuzz bash scripts/fuzz.sh --seconds 20 || true
fi
