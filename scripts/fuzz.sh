#!/usr/bin/env bash
# Fuzzes settle's input side with cargo fuzz (libFuzzer): the fuzz crate in fuzz/ compiles
# src/engine, src/codec/ and src/config by path (no RocksDB, no librdkafka).
#
#   scripts/fuzz.sh [--seconds N] [--jobs J] [TARGET...]
#
# Targets (fuzz/fuzz_targets/): decode_upload (record key, value, timestamp, wall clock ->
# decode, engine, ready record read back), config_toml (settle.toml text), trace_line (JSONL
# trace lines). Default: all three, 60 s each (--seconds 60).
#
# The committed seeds (fuzz/corpus/<target>, written by fuzz/make-corpus.py) are read, never
# written: what the fuzzer adds goes to $FUZZ_WORK/corpus/<target> (default target/fuzz-work),
# a crash to $FUZZ_WORK/artifacts/<target>/. A crash fails the script with the reproducer's path
# (reproduce: cargo fuzz run --fuzz-dir fuzz TARGET FILE). Keep a fixed crash as
# fuzz/corpus/<target>/regress-<name>: tests/offline/fuzz_corpus.rs replays it on every test run.
#
# Needs cargo-fuzz (installed here with `cargo install cargo-fuzz --locked` when missing,
# ~3 min). The machine has only a stable toolchain: cargo fuzz's nightly flags are enabled with
# RUSTC_BOOTSTRAP=1, and the build is without a sanitizer (-s none; settle's input side is
# safe Rust: libFuzzer finds panics, aborts, overflows — debug assertions are on — and
# timeouts). Environment: FUZZ_WORK, FUZZ_TARGET_DIR (default target/fuzz-build),
# FUZZ_SANITIZER (default none).
set -euo pipefail
LOG_TAG="fuzz"
# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cd "$ROOT"

SECONDS_EACH=60
JOBS=1
TARGETS=()
while [ "$#" -gt 0 ]; do
    case "$1" in
    --seconds) SECONDS_EACH="$2"; shift ;;
    --jobs) JOBS="$2"; shift ;;
    -h | --help)
        sed -n '2,23p' "$ROOT/scripts/fuzz.sh" | sed 's/^# \{0,1\}//'
        exit 0
        ;;
    -*) die "unknown option: $1 (try --help)" ;;
    *) TARGETS+=("$1") ;;
    esac
    shift
done
[ "${#TARGETS[@]}" -gt 0 ] || TARGETS=(decode_upload config_toml trace_line)
[[ "$SECONDS_EACH" =~ ^[0-9]+$ ]] || die "--seconds wants a whole number of seconds, not '$SECONDS_EACH'"

if ! cargo fuzz --version >/dev/null 2>&1; then
    log "cargo-fuzz not found: installing it (cargo install cargo-fuzz --locked)"
    cargo install cargo-fuzz --locked
fi
WORK="${FUZZ_WORK:-$ROOT/target/fuzz-work}"
export CARGO_TARGET_DIR="${FUZZ_TARGET_DIR:-$ROOT/target/fuzz-build}"
export RUSTC_BOOTSTRAP=1
SAN="${FUZZ_SANITIZER:-none}"

# -jobs makes libFuzzer write each job's output to ./fuzz-N.log instead: only for --jobs > 1.
PARALLEL=()
[ "$JOBS" -le 1 ] || PARALLEL=(-jobs="$JOBS" -workers="$JOBS")
failed=()
for t in "${TARGETS[@]}"; do
    [ -f "fuzz/fuzz_targets/$t.rs" ] || die "no fuzz target '$t' (fuzz/fuzz_targets/)"
    mkdir -p "$WORK/corpus/$t" "$WORK/artifacts/$t"
    log "$t: building (sanitizer $SAN, debug assertions on)"
    cargo fuzz build --fuzz-dir fuzz -s "$SAN" --debug-assertions "$t"
    log "$t: fuzzing for ${SECONDS_EACH}s (seeds fuzz/corpus/$t, new inputs $WORK/corpus/$t)"
    rc=0
    # libFuzzer's own progress lines (pulse, DONE) and what a crash prints; the whole output is
    # in $WORK/$t.log. pipefail: the status is cargo fuzz's.
    (
        set -o pipefail
        cargo fuzz run --fuzz-dir fuzz -s "$SAN" --debug-assertions "$t" \
            "$WORK/corpus/$t" "fuzz/corpus/$t" -- \
            -max_total_time="$SECONDS_EACH" "${PARALLEL[@]}" \
            -artifact_prefix="$WORK/artifacts/$t/" -print_final_stats=1 2>&1 |
            tee "$WORK/$t.log" |
            awk '/^#[0-9]+ +(pulse|DONE)|^stat::number_of_executed_units|ERROR|panicked|SUMMARY|^artifact_prefix|Test unit written/ { print; fflush() }'
    ) || rc=$?
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$WORK/$t.log" | tail -1)
    if [ "$rc" -ne 0 ] || ls "$WORK/artifacts/$t"/crash-* "$WORK/artifacts/$t"/timeout-* >/dev/null 2>&1; then
        warn "$t: FAILED (exit $rc); reproducers: $(ls "$WORK/artifacts/$t" | tr '\n' ' ')"
        failed+=("$t")
    else
        log "$t: ok, ${execs:-?} executions in ${SECONDS_EACH}s, no crash"
    fi
done
[ "${#failed[@]}" -eq 0 ] || die "fuzz targets with a crash: ${failed[*]} (see $WORK/artifacts)"
log "all targets ok"
