#!/usr/bin/env bash
# What shadow policies cost (SEMANTICS §8, `[[shadow]]`): the shared vs-redis comparison
# (../shared/bench/vs-redis.sh, unchanged) run on the same binary without shadows and with
# two `[[shadow]]` policies, alternating, in one run (A B A B), so the ratios to the
# Redis-Lua baseline of the same minutes can be compared.
#
#   scripts/vs-redis-shadow.sh SETTLE_BIN [UPLOADS]      (run from the project root)
#
# How: vs-redis.sh takes the settle binary as its first argument; for the B runs this script
# hands it itself as that binary. Called as `settle run-file ...` by vs-redis.sh, it swaps
# the config for the same config plus two shadows (fixed 30 s; leading-trailing 10 s with
# max-wait 2 min) and `runtime.shadow-max-sessions` large enough that they follow every
# session key of the trace (470 774 keys: nothing refused, the full cost), then runs the
# real binary.
set -euo pipefail
if [ "${1:-}" = run-file ]; then
  # Called by vs-redis.sh in place of settle.
  args=()
  while [ $# -gt 0 ]; do
    case "$1" in
      --config)
        sed "s/^\[runtime\]\$/[runtime]\nshadow-max-sessions = 1000000/" "$2" > "$2.shadow"
        cat >> "$2.shadow" <<'EOF'

[[shadow]]
name = "fixed-30s"
policy = "fixed"
delay = "30s"

[[shadow]]
name = "lt-10s"
policy = "leading-trailing"
delay = "10s"
max-wait = "2m"
EOF
        args+=(--config "$2.shadow"); shift 2 ;;
      *) args+=("$1"); shift ;;
    esac
  done
  # run-file prints each policy's figures as JSON lines (live first); vs-redis.sh drops
  # them with its log, so they are appended to $SHADOW_FIGURES too.
  "$SHADOW_BIN" "${args[@]}" | tee -a "$SHADOW_FIGURES"
  exit
fi
shared=${SHARED_BENCH:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../../shared/bench" && pwd)}
bin=$(realpath "${1:?usage: $0 SETTLE_BIN [UPLOADS]}")
n=${2:-1000000}
[ -x "$bin" ] || { echo "no settle binary at $bin"; exit 1; }
export SHADOW_FIGURES=${SHADOW_FIGURES:-/dev/stderr}
for pass in 1 2; do
  echo "== pass $pass, A: no [[shadow]]"
  "$shared/vs-redis.sh" "$bin" "$n"
  echo "== pass $pass, B: two [[shadow]] policies"
  SHADOW_BIN="$bin" "$shared/vs-redis.sh" "$(realpath "${BASH_SOURCE[0]}")" "$n"
done
