#!/usr/bin/env bash
# Check for (and install) what building settle needs on Debian/Ubuntu.
#
#   scripts/setup.sh           check, install missing system packages, check the Rust toolchain
#   scripts/setup.sh --check   only check; exit 1 and list what is missing
#
# System packages (Debian names):
#   build-essential  gcc, g++, make, libc headers: RocksDB (C++) and librdkafka (C) are
#                    compiled from source by the rocksdb and rdkafka crates
#   pkg-config       finds OpenSSL and zlib for librdkafka's configure script
#   libssl-dev       rdkafka feature "ssl"
#   zlib1g-dev       rdkafka feature "libz"
#   libclang-dev     bindgen (rocksdb crate) loads libclang at build time
#   perl, python3    librdkafka's build scripts
#   chromium, chromium-driver
#                    UI tests: tests/e2e/ui_browser.rs drives headless Chromium through WebDriver
# Idempotent: when everything is present it only runs dpkg-query and exits in well under a second.
set -euo pipefail
LOG_TAG=setup
# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

CHECK_ONLY=0
case "${1:-}" in
--check) CHECK_ONLY=1 ;;
"") ;;
-h | --help)
    sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
    ;;
*) die "unknown option: $1 (try --help)" ;;
esac

# UI tests: chromium chromium-driver
PACKAGES=(build-essential pkg-config libssl-dev zlib1g-dev libclang-dev perl python3 chromium chromium-driver)

# --- system packages -------------------------------------------------------------------------
if command -v dpkg-query >/dev/null 2>&1; then
    missing=()
    for p in "${PACKAGES[@]}"; do
        deb_installed "$p" || missing+=("$p")
    done
    if [ "${#missing[@]}" -eq 0 ]; then
        log "system packages present: ${PACKAGES[*]}"
    elif [ "$CHECK_ONLY" -eq 1 ]; then
        die "missing system packages: ${missing[*]}
  install them with: apt-get update && apt-get install -y ${missing[*]}"
    else
        log "missing system packages: ${missing[*]}"
        apt_install "${missing[@]}"
    fi
else
    # Not Debian: check the tools themselves and tell what to install.
    for t in cc c++ make pkg-config perl python3; do
        command -v "$t" >/dev/null 2>&1 ||
            die "'$t' not found. Install a C/C++ toolchain, make, pkg-config, perl, python3 and the development files of OpenSSL, zlib and libclang (Debian names: ${PACKAGES[*]})"
    done
    warn "not a Debian system: cannot verify OpenSSL, zlib and libclang development files; the build will tell"
fi

# --- Rust toolchain ------------------------------------------------------------------------
RUSTUP_HINT="install Rust with rustup (https://rustup.rs), then: rustup component add rustfmt clippy"
command -v cargo >/dev/null 2>&1 || die "cargo not found on PATH ($PATH). $RUSTUP_HINT"
command -v rustc >/dev/null 2>&1 || die "rustc not found on PATH. $RUSTUP_HINT"

need_rust="$(sed -n 's/^rust-version *= *"\([0-9.]*\)".*/\1/p' "$ROOT/Cargo.toml" | head -n1)"
have_rust="$(rustc --version | awk '{print $2}')"
if [ -n "$need_rust" ] &&
    [ "$(printf '%s\n%s\n' "$need_rust" "$have_rust" | sort -V | head -n1)" != "$need_rust" ]; then
    die "rustc $have_rust is older than the crate's rust-version $need_rust: run 'rustup update stable'"
fi

tool_missing=()
cargo fmt --version >/dev/null 2>&1 || tool_missing+=(rustfmt)
cargo clippy --version >/dev/null 2>&1 || tool_missing+=(clippy)
if [ "${#tool_missing[@]}" -gt 0 ]; then
    die "Rust components missing: ${tool_missing[*]}; run: rustup component add ${tool_missing[*]}"
fi
log "rust toolchain: rustc $have_rust (crate needs >= ${need_rust:-?}), $(cargo --version | awk '{print $1, $2}'), rustfmt, clippy"
