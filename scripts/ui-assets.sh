#!/usr/bin/env bash
# Refresh the browser libraries of the operator page (src/admin/ui/assets/) from their npm
# packages, at the versions pinned below, with their licence files. The files are checked
# in and embedded in the binary (include_bytes!): nothing is fetched at run time and there
# is no front-end build step. Needs `npm` (only `npm pack`: nothing is installed).
#
#   scripts/ui-assets.sh          download the pinned versions into src/admin/ui/assets/
#
# To move to another version: change the pin, run this script, look at the page (the UI
# e2e test: cargo test --test e2e ui_), commit the assets with the script.
set -euo pipefail
LOG_TAG=ui-assets
# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

HTMX_VERSION=2.0.11   # htmx.org: partial page updates (hx-get, hx-post, hx-trigger)
UPLOT_VERSION=1.6.32  # uplot: the Overview's small time-series charts

case "${1:-}" in
"") ;;
-h | --help)
    sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
    ;;
*) die "unknown option: $1 (try --help)" ;;
esac

command -v npm >/dev/null 2>&1 || die "npm is needed (apt-get install -y npm)"
DEST="$ROOT/src/admin/ui/assets"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$DEST"

# unpack NAME VERSION: the package's tarball, unpacked under $WORK/NAME/package
unpack() {
    mkdir -p "$WORK/$1"
    (cd "$WORK/$1" && npm pack --silent "$1@$2" >/dev/null && tar xzf ./*.tgz)
}

unpack htmx.org "$HTMX_VERSION"
cp "$WORK/htmx.org/package/dist/htmx.min.js" "$DEST/htmx.min.js"
cp "$WORK/htmx.org/package/LICENSE" "$DEST/htmx.LICENSE"

unpack uplot "$UPLOT_VERSION"
cp "$WORK/uplot/package/dist/uPlot.iife.min.js" "$DEST/uPlot.iife.min.js"
cp "$WORK/uplot/package/dist/uPlot.min.css" "$DEST/uPlot.min.css"
cp "$WORK/uplot/package/LICENSE" "$DEST/uPlot.LICENSE"

printf 'htmx.org %s\nuplot %s\n' "$HTMX_VERSION" "$UPLOT_VERSION" >"$DEST/VERSIONS"
log "htmx.org $HTMX_VERSION, uplot $UPLOT_VERSION in ${DEST#"$ROOT"/}"
