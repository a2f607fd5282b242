#!/usr/bin/env bash
# The shared vs-redis comparison (../shared/bench/vs-redis.sh, unchanged) with rounds that
# keep their event ids (debounce.event-ids, SEMANTICS §2): settle reads the same trace with an
# `event_id` on every upload (a UUID, 36 bytes) and lists the first N ids of each round.
#
#   scripts/vs-redis-event-ids.sh SETTLE_BIN [N] [UPLOADS]      (run from the project root)
#
# How: vs-redis.sh takes the settle binary as its first argument; this script hands it
# itself as that binary. Called as `settle run-file ...` by vs-redis.sh, it swaps the trace
# for the same trace with ids (made once, before vs-redis.sh starts: not in the timing) and
# the config for the same config plus `event-ids = N` under [debounce], then execs the real
# binary. The Redis-Lua baseline reads vs-redis.sh's own trace (it keeps no ids either way).
# N = 0 runs the id-carrying trace with ids off (what the ids themselves cost to parse).
set -euo pipefail
if [ "${1:-}" = run-file ]; then
  # Called by vs-redis.sh in place of settle.
  args=()
  while [ $# -gt 0 ]; do
    case "$1" in
      --input) args+=(--input "$EVENT_IDS_TRACE"); shift 2 ;;
      --config)
        sed "s/^\[debounce\]\$/[debounce]\nevent-ids = $EVENT_IDS_N/" "$2" > "$2.ids"
        args+=(--config "$2.ids"); shift 2 ;;
      *) args+=("$1"); shift ;;
    esac
  done
  exec "$EVENT_IDS_BIN" "${args[@]}"
fi
# The shared bench directory (the project's `../shared/bench`).
shared=${SHARED_BENCH:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../../shared/bench" && pwd)}
bin=$(realpath "${1:?usage: $0 SETTLE_BIN [N] [UPLOADS]}")
n_ids=${2:-64}
n=${3:-1000000}
[ -x "$bin" ] || { echo "no settle binary at $bin"; exit 1; }
w=$(mktemp -d); trap 'rm -rf "$w"' EXIT
python3 "$shared/bench-trace.py" "$w/plain.jsonl" "$n"
python3 - "$w/plain.jsonl" "$w/ids.jsonl" <<'EOF'
import json, random, sys, uuid
r = random.Random(36)
with open(sys.argv[1]) as src, open(sys.argv[2], "w") as out:
    for line in src:
        u = json.loads(line)
        u["event_id"] = str(uuid.UUID(int=r.getrandbits(128), version=4))
        out.write(json.dumps(u) + "\n")
EOF
echo "event-ids = $n_ids, every upload with a 36-byte event_id"
EVENT_IDS_BIN="$bin" EVENT_IDS_TRACE="$w/ids.jsonl" EVENT_IDS_N="$n_ids" \
  "$shared/vs-redis.sh" "$(realpath "${BASH_SOURCE[0]}")" "$n"
