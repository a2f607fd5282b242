#!/usr/bin/env python3
"""The checks of scripts/check-deploy.sh that no off-the-shelf validator does.

    check-deploy.py compose FILE               images pinned; broker addresses, volumes and the
                                               transport of the settle and kafka services
    check-deploy.py topics ROOT                topic names and partition counts: compose vs
                                               scripts/kafka.sh vs config/settle.toml vs the
                                               README table vs the Kubernetes replicas
    check-deploy.py dashboard-rules DASH OUT   the dashboard's PromQL as a rules file for
                                               `promtool check rules`
    check-deploy.py dashboard-metrics DASH RS  every metric the dashboard names is defined in
                                               src/metrics.rs (RS), and every one defined there
                                               has a panel
    check-deploy.py prometheus-k8s IN OUT      kubernetes_sd_configs of IN checked for known keys
                                               and roles, OUT = IN with them replaced by a static
                                               target (Debian's promtool has no Kubernetes
                                               discovery, so it rejects the original)
    check-deploy.py kubernetes-nats YAML       the rendered NATS overlay: SETTLE_NATS__INSTANCES
                                               is the replica count, the wrapper derives the
                                               instance from the pod name (run with /bin/sh)

Prints one line per fact checked ("ok ..." or "FAIL ..."); exits 1 when any failed.
Needs PyYAML (the check-deploy venv has it) and Python 3.11+ (tomllib).
"""

import json
import os
import re
import subprocess
import sys
import tomllib

import yaml

FAILED = []


def ok(msg):
    print(f"  ok    {msg}")


def fail(msg):
    print(f"  FAIL  {msg}")
    FAILED.append(msg)


def check(cond, msg):
    (ok if cond else fail)(msg)
    return cond


def load_yaml(path):
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)


# ---------------------------------------------------------------------------------------------
# compose


def env_of(service):
    """A compose service's environment as a dict (mapping or KEY=VALUE list form)."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        return dict(e.split("=", 1) if "=" in e else (e, None) for e in env)
    return env


# A pinned tag names a release down to its patch version: 3.9.1, v3.5.0, 2.11.8-alpine.
PINNED = re.compile(r"^v?\d+\.\d+\.\d+([-.+].*)?$")


def cmd_compose(path):
    compose = load_yaml(path)
    services = compose["services"]
    volumes = compose.get("volumes") or {}
    for name, svc in sorted(services.items()):
        image = svc.get("image")
        if "build" in svc:
            ok(f"{name}: built from this repository ({image})")
            continue
        tag = image.rsplit(":", 1)[1] if image and ":" in image.split("/")[-1] else ""
        check(PINNED.match(tag), f"{name}: image {image} pinned to a release (x.y.z)")

    settle = env_of(services["settle"])
    check(
        settle.get("SETTLE_KAFKA__BOOTSTRAP_SERVERS", "").split(":")[0] in services,
        f"settle: SETTLE_KAFKA__BOOTSTRAP_SERVERS={settle.get('SETTLE_KAFKA__BOOTSTRAP_SERVERS')} is a compose service",
    )
    nats = settle.get("SETTLE_NATS__SERVERS") or ""
    host = re.sub(r"^\w+://", "", nats).split(":")[0]
    check(host in services, f"settle: SETTLE_NATS__SERVERS={nats or '<unset>'} is a compose service")
    check(
        "SETTLE_TRANSPORT" in settle and settle["SETTLE_TRANSPORT"] is None,
        "settle: SETTLE_TRANSPORT passed from the shell, unset otherwise (config/settle.toml decides)",
    )
    deps = services["settle"].get("depends_on") or {}
    check(
        isinstance(deps, dict)
        and (deps.get("kafka-init") or {}).get("condition") == "service_completed_successfully",
        "settle: starts once kafka-init created the topics",
    )

    # The broker's log must outlive the container, like settle's stores (settle-data).
    kafka = services["kafka"]
    log_dirs = env_of(kafka).get("KAFKA_LOG_DIRS")
    mounts = {}
    for v in kafka.get("volumes") or []:
        src, _, dst = (v if isinstance(v, str) else f"{v['source']}:{v['target']}").partition(":")
        mounts[dst.split(":")[0]] = src
    check(
        log_dirs is not None and mounts.get(log_dirs) in volumes,
        f"kafka: KAFKA_LOG_DIRS={log_dirs} is on a named volume ({mounts.get(log_dirs)})",
    )
    init_deps = services["kafka-init"].get("depends_on") or {}
    check(
        (init_deps.get("kafka") or {}).get("condition") == "service_healthy",
        "kafka-init: waits for a healthy broker",
    )
    for name in ("settle", "nats"):
        svc_mounts = [v.split(":")[0] for v in services[name].get("volumes") or [] if isinstance(v, str)]
        check(
            any(m in volumes for m in svc_mounts),
            f"{name}: its data is on a named volume ({', '.join(m for m in svc_mounts if m in volumes)})",
        )


# ---------------------------------------------------------------------------------------------
# topics


def parse_specs(specs):
    """["name:8", "name:8:compact"] -> {name: (8, compact?)}."""
    out = {}
    for spec in specs:
        parts = spec.split(":")
        out[parts[0]] = (int(parts[1]), len(parts) > 2 and parts[2] == "compact")
    return out


def kafka_sh_topics(path):
    text = open(path, encoding="utf-8").read()
    m = re.search(r"^DEFAULT_TOPICS=\(([^)]*)\)", text, re.M)
    if not m:
        fail(f"{path}: no DEFAULT_TOPICS=(...) line")
        return {}
    return parse_specs(m.group(1).split())


def settle_toml_topics(path):
    """The default topics of config/settle.toml: key -> topic name."""
    with open(path, "rb") as f:
        cfg = tomllib.load(f)
    kafka = cfg.get("kafka", {})
    tiers = cfg.get("tiers", {})
    group = kafka.get("group-id", "settle")
    topics = {
        "kafka.input-topic": kafka.get("input-topic", "settle.uploads"),
        "kafka.changelog-topic": kafka.get("changelog-topic", f"{group}.changelog"),
        "kafka.tier-counts-topic": kafka.get("tier-counts-topic", f"{group}.tier-counts"),
        "kafka.dead-letter-topic": kafka.get("dead-letter-topic", "settle.dead-letter"),
        "tiers.events-topic": tiers.get("events-topic", "settle.tier-events"),
    }
    for t in tiers.get("tier", []):
        topics[f"tiers.tier {t['name']}"] = t["topic"]
    return topics, cfg


def readme_topics(path):
    """README "Run on Kafka" table: topic -> the partitions cell."""
    rows = {}
    for line in open(path, encoding="utf-8"):
        m = re.match(r"^\| `(settle\.[^`]+)`[^|]*\|[^|]*\|([^|]*)\|", line)
        if m:
            rows[m.group(1)] = m.group(2).strip()
    return rows


def cmd_topics(root):
    compose = load_yaml(os.path.join(root, "docker-compose.yml"))
    init_env = env_of(compose["services"]["kafka-init"])
    in_compose = parse_specs(init_env["KAFKA_TOPICS"].split())
    in_kafka_sh = kafka_sh_topics(os.path.join(root, "scripts/kafka.sh"))
    defaults, cfg = settle_toml_topics(os.path.join(root, "config/settle.toml"))
    in_readme = readme_topics(os.path.join(root, "README.md"))

    input_topic = defaults["kafka.input-topic"]
    changelog = defaults["kafka.changelog-topic"]
    tier_counts = defaults["kafka.tier-counts-topic"]
    for key, topic in defaults.items():
        check(topic in in_compose, f"{key} = {topic}: created by compose (kafka-init)")
        check(topic in in_kafka_sh, f"{key} = {topic}: created by scripts/kafka.sh up")
        check(topic in in_readme, f"{key} = {topic}: in the README topic table")
    extra = set(in_compose) - set(defaults.values())
    check(not extra, f"compose creates no topic settle does not use ({', '.join(sorted(extra)) or 'none'})")
    check(
        in_compose == in_kafka_sh,
        "compose and scripts/kafka.sh up create the same topics with the same partitions and policy "
        f"({' '.join(f'{t}:{p}' for t, (p, _) in sorted(in_compose.items()))})",
    )
    for name, specs in (("compose", in_compose), ("scripts/kafka.sh", in_kafka_sh)):
        if input_topic in specs and changelog in specs:
            check(
                specs[changelog][0] == specs[input_topic][0] and specs[changelog][1],
                f"{name}: {changelog} compacted, with the partitions of {input_topic} ({specs[input_topic][0]})",
            )
            compacted = sorted(t for t, (_, c) in specs.items() if c)
            check(
                compacted == sorted([changelog, tier_counts]),
                f"{name}: only the changelog and the tier counts are compacted ({', '.join(compacted)})",
            )
    # The README states a count where it prescribes one ("1") or where it names what
    # kafka.sh up / compose create ("any; 8 by ..."); each must be what compose creates.
    for topic, cell in sorted(in_readme.items()):
        counts = re.findall(r"(?:^|\b)(\d+)(?= by\b)|^(\d+)$", re.sub(r"[`*]", "", cell))
        stated = [int(a or b) for a, b in counts]
        if topic in in_compose:
            check(
                all(n == in_compose[topic][0] for n in stated),
                f"README: {topic} partitions '{cell}' agree with compose ({in_compose[topic][0]})",
            )

    # Replicas vs partitions.
    sts_docs = list(yaml.safe_load_all(open(os.path.join(root, "deploy/kubernetes/statefulset.yaml"), encoding="utf-8")))
    sts = next(d for d in sts_docs if d and d.get("kind") == "StatefulSet")
    replicas = sts["spec"]["replicas"]
    parts = in_compose.get(input_topic, (0, False))[0]
    check(
        replicas <= parts,
        f"Kubernetes replicas ({replicas}) <= partitions of {input_topic} ({parts}): every pod owns a partition",
    )
    nats_partitions = cfg.get("nats", {}).get("partitions", 8)
    check(
        nats_partitions == parts,
        f"config/settle.toml nats.partitions ({nats_partitions}) = partitions of {input_topic} ({parts})",
    )


# ---------------------------------------------------------------------------------------------
# dashboard


def dashboard_exprs(path):
    """(panel title, expr) of every query of the Grafana dashboard."""
    with open(path, encoding="utf-8") as f:
        dash = json.load(f)
    found = []

    def walk(node, title):
        if isinstance(node, dict):
            title = node.get("title", title) if "type" in node else title
            for k, v in node.items():
                if k in ("expr", "query") and isinstance(v, str) and v.strip():
                    found.append((title, v))
                else:
                    walk(v, title)
        elif isinstance(node, list):
            for v in node:
                walk(v, title)

    walk(dash.get("panels", []), None)
    return found


# Grafana's variables, replaced by what Prometheus would see.
GRAFANA_VARS = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}


def promql(expr):
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    expr = re.sub(r"\$\{?__\w+\}?", "5m", expr)
    return expr


def cmd_dashboard_rules(dash, out):
    exprs = dashboard_exprs(dash)
    if not check(exprs, f"{dash}: {len(exprs)} queries"):
        return
    leftover = [e for _, e in exprs if "$" in promql(e)]
    check(not leftover, f"no dashboard variable left unreplaced ({'; '.join(leftover) or 'none'})")
    rules = {
        "groups": [
            {
                "name": "settle-dashboard",
                "rules": [
                    {"record": f"dashboard:query_{i}:expr", "expr": promql(e), "labels": {"panel": t or "?"}}
                    for i, (t, e) in enumerate(exprs)
                ],
            }
        ]
    }
    with open(out, "w", encoding="utf-8") as f:
        yaml.safe_dump(rules, f, sort_keys=False, allow_unicode=True)
    ok(f"{len(exprs)} queries written as recording rules to {out}")


# PromQL words that are not metric names.
KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
    "unless", "offset", "inf", "nan", "start", "end",
}


def metric_names(expr):
    """The metric names an expression selects (functions, labels, keywords left out)."""
    e = promql(expr)
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', e)  # strings
    e = re.sub(r"\{[^}]*\}", "", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)  # ranges
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)  # label lists
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        word = m.group(0)
        following = e[m.end():].lstrip()
        if following.startswith("(") or word.lower() in KEYWORDS:
            continue  # a function or aggregation, or a keyword
        if re.fullmatch(r"\d+[smhdwy]", word):
            continue
        names.add(word)
    return names


def defined_metrics(path):
    """src/metrics.rs: {name: kind} of the `pub const X: &str = "settle_..."` metric names,
    kind from how each is registered (counter, gauge or histogram)."""
    text = open(path, encoding="utf-8").read()
    consts = dict(re.findall(r'pub const ([A-Z][A-Z0-9_]*): &str = "(settle_[a-z0-9_]+)";', text))
    kinds = {}
    for fn_name, const in re.findall(
        r"\b(counter|gauge|float_gauge|histogram|Gauge::new|IntGauge::new|GaugeVec::new|Opts::new|HistogramOpts::new)\(\s*(?:&mut b,\s*)?([A-Z][A-Z0-9_]*)\s*,",
        text,
    ):
        if const in consts:
            kinds[const] = "histogram" if "istogram" in fn_name else "other"
    return consts, kinds


def cmd_dashboard_metrics(dash, rs):
    consts, kinds = defined_metrics(rs)
    if not check(len(consts) >= 10, f"{rs}: {len(consts)} metric names defined"):
        return
    unregistered = sorted(set(consts) - set(kinds))
    check(not unregistered, f"every metric name of {rs} is registered ({', '.join(unregistered) or 'all'})")
    series = {}
    for const, name in consts.items():
        if kinds.get(const) == "histogram":
            for suffix in ("_bucket", "_sum", "_count"):
                series[name + suffix] = name
        else:
            series[name] = name
    series["up"] = None  # Prometheus's own series per target
    used = set()
    for title, expr in dashboard_exprs(dash):
        for name in sorted(metric_names(expr)):
            if check(name in series, f"panel '{title}': {name} is a series settle exports"):
                if series[name]:
                    used.add(series[name])
    missing = sorted(set(consts.values()) - used)
    check(not missing, f"every settle metric has a panel ({', '.join(missing) or 'all ' + str(len(used))})")


# ---------------------------------------------------------------------------------------------
# Prometheus on Kubernetes

K8S_SD_KEYS = {
    "api_server", "role", "kubeconfig_file", "namespaces", "selectors", "attach_metadata",
    "basic_auth", "authorization", "oauth2", "proxy_url", "no_proxy", "proxy_from_environment",
    "proxy_connect_header", "follow_redirects", "enable_http2", "tls_config", "http_headers",
}
K8S_ROLES = {"node", "service", "pod", "endpoints", "endpointslice", "ingress"}


def cmd_prometheus_k8s(src, out):
    cfg = load_yaml(src)
    jobs = cfg.get("scrape_configs") or []
    check(jobs, f"{src}: {len(jobs)} scrape job(s)")
    for job in jobs:
        sds = job.pop("kubernetes_sd_configs", None)
        if sds is None:
            continue
        for sd in sds:
            unknown = sorted(set(sd) - K8S_SD_KEYS)
            check(not unknown, f"job {job['job_name']}: kubernetes_sd_configs keys known ({', '.join(unknown) or ', '.join(sorted(sd))})")
            check(sd.get("role") in K8S_ROLES, f"job {job['job_name']}: kubernetes_sd_configs role '{sd.get('role')}' exists")
        job["static_configs"] = [{"targets": ["kubernetes-sd.invalid:9464"]}]
    with open(out, "w", encoding="utf-8") as f:
        yaml.safe_dump(cfg, f, sort_keys=False)


# ---------------------------------------------------------------------------------------------
# the NATS overlay


def cmd_kubernetes_nats(path):
    docs = [d for d in yaml.safe_load_all(open(path, encoding="utf-8")) if d]
    sts = next(d for d in docs if d["kind"] == "StatefulSet")
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    replicas = sts["spec"]["replicas"]
    container = next(c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == "settle")
    env = {e["name"]: e for e in container.get("env", [])}
    value = lambda n: (env.get(n) or {}).get("value")  # noqa: E731
    check(value("SETTLE_TRANSPORT") == "nats", f"SETTLE_TRANSPORT = {value('SETTLE_TRANSPORT')}")
    check(value("SETTLE_NATS__SERVERS"), f"SETTLE_NATS__SERVERS = {value('SETTLE_NATS__SERVERS')}")
    check(
        value("SETTLE_NATS__INSTANCES") == str(replicas),
        f"SETTLE_NATS__INSTANCES ({value('SETTLE_NATS__INSTANCES')}) = replicas ({replicas})",
    )
    check(
        (env.get("POD_NAME") or {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name",
        "POD_NAME from the downward API (metadata.name)",
    )
    settle_toml = tomllib.loads(cm["data"]["settle.toml"])
    check("transport" not in settle_toml, "the ConfigMap sets no transport (SETTLE_TRANSPORT does)")
    partitions = settle_toml.get("nats", {}).get("partitions", 8)
    check(replicas <= partitions, f"replicas ({replicas}) <= nats.partitions ({partitions})")
    check(
        "SETTLE_NATS__INSTANCE" not in env,
        "SETTLE_NATS__INSTANCE is not a fixed value (the wrapper sets it per pod)",
    )

    # Run the wrapper as the pod would, with the last step replaced by printing what settle
    # would get.
    cmd = container.get("command") or []
    if not check(cmd[:4] == ["/usr/bin/tini", "--", "/bin/sh", "-c"] and len(cmd) >= 6,
                 f"command: tini, then a /bin/sh wrapper ({' '.join(cmd[:4])})"):
        return
    script = cmd[4]
    check("exec /usr/local/bin/settle \"$@\"" in script, "the wrapper ends in exec /usr/local/bin/settle \"$@\"")
    check("$(" not in script, "the wrapper has no $( (kubelet would expand $(VAR) references)")
    probe = script.replace('exec /usr/local/bin/settle "$@"', 'echo "instance=$SETTLE_NATS__INSTANCE args=$*"')
    for pod, want in ((f"{sts['metadata']['name']}-0", "0"), (f"{sts['metadata']['name']}-{replicas - 1}", str(replicas - 1)),
                      ("settle-12", "12")):
        r = subprocess.run(["/bin/sh", "-c", probe, *cmd[5:], *container.get("args", [])],
                           env={"POD_NAME": pod, "PATH": "/usr/bin:/bin"}, capture_output=True, text=True)
        check(
            r.returncode == 0 and r.stdout.strip() == f"instance={want} args={' '.join(container.get('args', []))}",
            f"pod {pod}: SETTLE_NATS__INSTANCE={want}, args passed ({r.stdout.strip() or r.stderr.strip()})",
        )
    for pod in ("settle", "", "settle-x"):
        r = subprocess.run(["/bin/sh", "-c", probe, *cmd[5:]], env={"POD_NAME": pod, "PATH": "/usr/bin:/bin"},
                           capture_output=True, text=True)
        check(r.returncode != 0 and r.stderr.strip(), f"pod name '{pod}': the wrapper refuses ({r.stderr.strip()})")


COMMANDS = {
    "compose": cmd_compose,
    "topics": cmd_topics,
    "dashboard-rules": cmd_dashboard_rules,
    "dashboard-metrics": cmd_dashboard_metrics,
    "prometheus-k8s": cmd_prometheus_k8s,
    "kubernetes-nats": cmd_kubernetes_nats,
}


def main(argv):
    if len(argv) < 2 or argv[1] not in COMMANDS:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        COMMANDS[argv[1]](*argv[2:])
    except (OSError, KeyError, ValueError, StopIteration, yaml.YAMLError, tomllib.TOMLDecodeError) as e:
        fail(f"{argv[1]}: {type(e).__name__}: {e}")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
