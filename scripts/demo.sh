#!/usr/bin/env bash
# The main job on an embedded default: settle's real runtime on RocksDB with an in-memory
# broker, driven through the seed's scenarios (700-way parallel bursts, split uploads, slow
# trickles, many tenants). No broker needed; about 20 s once built.
#
#   scripts/demo.sh [DEMO ARGS...]     e.g. scripts/demo.sh --data-dir /tmp/settle-demo
#
# Installs the system packages the build needs (scripts/setup.sh), builds the release
# binary (several minutes the first time: RocksDB and librdkafka compile from source), then
# runs `settle demo`. Afterwards, `target/release/settle inspect --data-dir DIR` reads the
# stores when you passed --data-dir.
set -euo pipefail
LOG_TAG=demo
# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cd "$ROOT"

bash scripts/setup.sh
log "building the release binary (first build compiles RocksDB and librdkafka: several minutes)"
cargo build --release --bin settle
exec "${CARGO_TARGET_DIR:-$ROOT/target}/release/settle" demo "$@"
