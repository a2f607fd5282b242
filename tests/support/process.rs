//! Helpers of the tests that run `settle` as a real child process (`tests/e2e/*_process.rs`,
//! `tests/e2e/kafka_rebalance.rs`, `tests/e2e/kafka_eos.rs`): spawning `settle run` (optionally with its JSON log captured
//! to a file, read back by [`json_log`]), waiting for every round, stopping it with SIGTERM.
#![allow(dead_code)]

use anyhow::{ensure, Context as _, Result};
use std::collections::BTreeSet;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// The `settle` binary with a clean environment for a test: no `SETTLE_CONFIG` or
/// `SETTLE_TRANSPORT` from the caller, the admin server on any free port (a settle already on
/// the default port must not make this one fail to start), stdout discarded, stderr shown.
/// A TCP port on 127.0.0.1 free at the time of asking (for a child's admin listener).
///
/// Errors: no port can be bound.
pub fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

pub fn settle() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_settle"));
    c.env_remove("SETTLE_CONFIG")
        .env_remove("SETTLE_TRANSPORT")
        .env("SETTLE_ADMIN__LISTEN", "127.0.0.1:0")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    c
}

/// `settle consume --from-beginning --exit-at-end` of `topic` on `bootstrap`: its stdout
/// (one line per record); fails when it exits non-zero.
pub fn consume_topic(bootstrap: &str, topic: &str) -> Result<Vec<u8>> {
    let printed = settle()
        .args([
            "consume",
            "--bootstrap-servers",
            bootstrap,
            "--topic",
            topic,
        ])
        .args(["--from-beginning", "--exit-at-end"])
        .stdout(Stdio::piped())
        .output()
        .context("settle consume")?;
    ensure!(
        printed.status.success(),
        "settle consume of {topic}: {}",
        printed.status
    );
    Ok(printed.stdout)
}

/// The non-empty lines of `text`.
pub fn lines_of(text: &[u8]) -> Vec<&[u8]> {
    text.split(|&b| b == b'\n')
        .filter(|l| !l.is_empty())
        .collect()
}

/// Starts `settle run --config CONFIG EXTRA...`, logging at `SETTLE_TEST_RUN_LOG` (default
/// `warn`).
pub fn start_run(config: &Path, extra: &[&str]) -> Result<Child> {
    settle()
        .args(["run", "--config"])
        .arg(config)
        .args(extra)
        .env(
            "SETTLE_LOG",
            std::env::var("SETTLE_TEST_RUN_LOG").unwrap_or_else(|_| "warn".to_owned()),
        )
        .spawn()
        .context("spawn settle run")
}

/// Starts `settle run --config CONFIG --log-format json` with `envs` set, logging at
/// `SETTLE_TEST_JSON_LOG` (default `info`; the tests read INFO events, so keep `info` in it,
/// e.g. `info,librdkafka=debug`), its stderr (the JSON log) written to the new file `log`
/// (read it with [`json_log`]).
pub fn start_run_logged(config: &Path, envs: &[(&str, &str)], log: &Path) -> Result<Child> {
    let file = std::fs::File::create(log)
        .with_context(|| format!("create the log file {}", log.display()))?;
    settle()
        .args(["run", "--log-format", "json", "--config"])
        .arg(config)
        .env(
            "SETTLE_LOG",
            std::env::var("SETTLE_TEST_JSON_LOG").unwrap_or_else(|_| "info".to_owned()),
        )
        .envs(envs.iter().copied())
        .stderr(Stdio::from(file))
        .spawn()
        .context("spawn settle run")
}

/// One event of a `--log-format json` log (tracing-subscriber's JSON layout).
#[derive(Clone, Debug)]
pub struct LogEvent {
    /// The event's `timestamp`, ms since the epoch.
    pub at_ms: i64,
    /// `INFO`, `WARN`, ...
    pub level: String,
    /// `target` (module path, or `librdkafka`).
    pub target: String,
    /// `fields.message`.
    pub message: String,
    /// `fields` (the message included).
    pub fields: serde_json::Map<String, serde_json::Value>,
}

impl LogEvent {
    /// Field `name` as an integer: a JSON number, or a string holding one.
    pub fn int(&self, name: &str) -> Option<i64> {
        match self.fields.get(name)? {
            serde_json::Value::Number(n) => n.as_i64().or_else(|| n.as_f64().map(|f| f as i64)),
            serde_json::Value::String(s) => s.trim().parse().ok(),
            _ => None,
        }
    }

    /// Field `name` as a list of partitions: a JSON array of numbers, or a string in Rust's
    /// Debug format of a `Vec<i32>` (`"[0, 3]"`), or a single number.
    pub fn partitions(&self, name: &str) -> Option<Vec<i32>> {
        match self.fields.get(name)? {
            serde_json::Value::Array(a) => a
                .iter()
                .map(|v| v.as_i64().and_then(|n| i32::try_from(n).ok()))
                .collect(),
            serde_json::Value::String(s) => {
                let inner = s.trim().strip_prefix('[')?.strip_suffix(']')?;
                inner
                    .split(',')
                    .map(str::trim)
                    .filter(|t| !t.is_empty())
                    .map(|t| t.parse().ok())
                    .collect()
            }
            serde_json::Value::Number(n) => Some(vec![i32::try_from(n.as_i64()?).ok()?]),
            _ => None,
        }
    }

    /// The event as one short line (for failure messages).
    pub fn brief(&self) -> String {
        let fields: Vec<String> = self
            .fields
            .iter()
            .filter(|(k, _)| k.as_str() != "message")
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        format!(
            "{} {} {}: {} {}",
            self.at_ms,
            self.level,
            self.target,
            self.message,
            fields.join(" ")
        )
    }
}

/// A `--log-format json` log read back: its events, and the lines that are not JSON events
/// (say, `error: ...` printed by `main` on a failed start), in file order.
#[derive(Clone, Debug, Default)]
pub struct JsonLog {
    /// The JSON events.
    pub events: Vec<LogEvent>,
    /// Every other non-empty line.
    pub other: Vec<String>,
}

impl JsonLog {
    /// The events whose message is exactly `message`.
    pub fn with_message<'a>(&'a self, message: &'a str) -> impl Iterator<Item = &'a LogEvent> {
        self.events.iter().filter(move |e| e.message == message)
    }

    /// The last `n` warnings and errors (not librdkafka's own log), and every non-JSON line,
    /// one per line (for failure messages).
    pub fn trouble(&self, n: usize) -> String {
        let bad: Vec<String> = self
            .events
            .iter()
            .filter(|e| (e.level == "WARN" || e.level == "ERROR") && e.target != "librdkafka")
            .map(LogEvent::brief)
            .collect();
        let mut lines: Vec<String> = bad[bad.len().saturating_sub(n)..].to_vec();
        lines.extend(self.other.iter().cloned());
        lines.join("\n")
    }
}

/// Reads the JSON log at `path` (a partial last line, still being written, is left out).
pub fn json_log(path: &Path) -> Result<JsonLog> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("read the log {}", path.display()))?;
    let complete = match text.rfind('\n') {
        Some(i) => &text[..=i],
        None => "",
    };
    let mut log = JsonLog::default();
    for line in complete.lines().filter(|l| !l.trim().is_empty()) {
        match parse_event(line) {
            Some(e) => log.events.push(e),
            None => log.other.push(line.to_owned()),
        }
    }
    Ok(log)
}

fn parse_event(line: &str) -> Option<LogEvent> {
    let v: serde_json::Value = serde_json::from_str(line).ok()?;
    let obj = v.as_object()?;
    let ts = obj.get("timestamp")?.as_str()?;
    let at =
        time::OffsetDateTime::parse(ts, &time::format_description::well_known::Rfc3339).ok()?;
    let fields = obj.get("fields")?.as_object()?.clone();
    Some(LogEvent {
        at_ms: i64::try_from(at.unix_timestamp_nanos() / 1_000_000).ok()?,
        level: obj.get("level")?.as_str()?.to_owned(),
        target: obj
            .get("target")
            .and_then(|t| t.as_str())
            .unwrap_or_default()
            .to_owned(),
        message: fields
            .get("message")
            .and_then(|m| m.as_str())
            .unwrap_or_default()
            .to_owned(),
        fields,
    })
}

/// Waits up to `limit` for `child` to exit (`None`: still running).
pub fn wait_exit(child: &mut Child, limit: Duration) -> Result<Option<ExitStatus>> {
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        if let Some(status) = child.try_wait()? {
            return Ok(Some(status));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(child.try_wait()?)
}

/// Polls `emitted_now` every 300 ms until it holds at least `rounds` distinct ids (by
/// `id_of`), while `running` keeps running, for at most `limit`; returns the last read.
pub fn wait_for_rounds<T>(
    running: &mut Child,
    rounds: usize,
    limit: Duration,
    emitted_now: impl FnMut() -> Result<Vec<T>>,
    id_of: impl Fn(&T) -> String,
) -> Result<Vec<T>> {
    wait_for_rounds_of(
        &mut [("settle run", running)],
        rounds,
        limit,
        emitted_now,
        id_of,
    )
}

/// [`wait_for_rounds`] while every one of the named `running` processes keeps running (the
/// first that exits is a failure, with its name).
pub fn wait_for_rounds_of<T>(
    running: &mut [(&str, &mut Child)],
    rounds: usize,
    limit: Duration,
    mut emitted_now: impl FnMut() -> Result<Vec<T>>,
    id_of: impl Fn(&T) -> String,
) -> Result<Vec<T>> {
    let t0 = Instant::now();
    loop {
        let got = emitted_now()?;
        let ids: BTreeSet<String> = got.iter().map(&id_of).collect();
        if ids.len() >= rounds {
            return Ok(got);
        }
        for (name, child) in running.iter_mut() {
            if let Some(status) = child.try_wait()? {
                anyhow::bail!(
                    "{name} exited ({status}) with {} of {rounds} rounds out",
                    ids.len()
                );
            }
        }
        ensure!(
            t0.elapsed() < limit,
            "{} of {rounds} rounds out after {limit:?}",
            ids.len()
        );
        std::thread::sleep(Duration::from_millis(300));
    }
}

/// Sends SIGTERM to `child` and requires a successful exit within `deadline` + 5 s; returns
/// how long it took. Kills the child if it is still running then.
pub fn sigterm(child: &mut Child, deadline: Duration) -> Result<Duration> {
    let term = Instant::now();
    send_sigterm(child)?;
    wait_sigterm_exit(child, term, deadline)
}

/// Sends SIGTERM to `child` (no wait).
pub fn send_sigterm(child: &Child) -> Result<()> {
    let kill = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()?;
    ensure!(kill.success(), "kill -TERM {} failed", child.id());
    Ok(())
}

/// After SIGTERM was sent at `term`: requires a successful exit of `child` within
/// `deadline` + 5 s of it; returns how long it took since `term`. Kills the child if it is
/// still running then.
pub fn wait_sigterm_exit(child: &mut Child, term: Instant, deadline: Duration) -> Result<Duration> {
    let limit = (deadline + Duration::from_secs(5)).saturating_sub(term.elapsed());
    let status = wait_exit(child, limit)?;
    let stopped_in = term.elapsed();
    let Some(status) = status else {
        child.kill()?;
        anyhow::bail!("settle run still running {stopped_in:?} after SIGTERM");
    };
    ensure!(
        status.success(),
        "settle run exited with {status} on SIGTERM"
    );
    Ok(stopped_in)
}

/// The `[debounce]`, `[store]` and `[runtime]` sections of the process tests: delays of 4 s
/// and more (longer than any gap inside a session of the load generator's scenarios, so live
/// and replay agree exactly), a leading-trailing and an adaptive tenant, stores in
/// `data_dir`, `shutdown_deadline`, a 50 ms idle tick.
pub fn debounce_store_runtime(data_dir: &Path, shutdown_deadline: Duration) -> String {
    format!(
        r#"
[debounce]
policy = "fixed"
delay = "4s"
[debounce.tenants.tenant-0001]
policy = "leading-trailing"
delay = "4s"
[debounce.tenants.tenant-0002]
policy = "adaptive"
min-delay = "4s"
max-delay = "10s"

[store]
data-dir = "{}"

[runtime]
shutdown-deadline = "{}s"
idle-tick = "50ms"
"#,
        data_dir.display(),
        shutdown_deadline.as_secs()
    )
}

/// Writes `dir/settle.toml` for a `settle run` test process on Kafka ([`kafka_config_text`],
/// stores in `dir/data`, 6 s session timeout) and loads it: (its path, the config).
pub fn write_kafka_config(
    dir: &Path,
    kafka: &settle::transport::kafka::KafkaConfig,
    output: &str,
    shutdown_deadline: Duration,
) -> Result<(std::path::PathBuf, settle::config::Config)> {
    let path = dir.join("settle.toml");
    std::fs::write(
        &path,
        kafka_config_text(kafka, output, &dir.join("data"), shutdown_deadline, 6_000),
    )?;
    let config = settle::config::Config::load(Some(&path)).context("the test's config")?;
    Ok((path, config))
}

/// The config file of a `settle run` test process on Kafka: [`debounce_store_runtime`] with
/// `data_dir` and `shutdown_deadline`, the `[kafka]` section of `kafka` (servers, group,
/// topics) with `session.timeout.ms` = `session_timeout_ms` and 500 ms heartbeats, and one
/// tier `normal` publishing to `output`.
pub fn kafka_config_text(
    kafka: &settle::transport::kafka::KafkaConfig,
    output: &str,
    data_dir: &Path,
    shutdown_deadline: Duration,
    session_timeout_ms: u32,
) -> String {
    format!(
        r#"
{common}

[kafka]
bootstrap-servers = "{bootstrap}"
group-id = "{group}"
input-topic = "{input}"
dead-letter-topic = "{dlq}"
[kafka.properties]
"session.timeout.ms" = {session_timeout_ms}
"heartbeat.interval.ms" = 500

[tiers]
[[tiers.tier]]
name = "normal"
topic = "{output}"
"#,
        common = debounce_store_runtime(data_dir, shutdown_deadline),
        bootstrap = kafka.bootstrap_servers,
        group = kafka.group_id,
        input = kafka.input_topic,
        dlq = kafka.dead_letter_topic,
    )
}

/// `settle loadgen` as the Kafka process tests run it (not spawned): the mixed scenarios
/// ([`loadgen_mix`]) to `topic` on `bootstrap`.
pub fn kafka_loadgen(
    bootstrap: &str,
    topic: &str,
    duration: &str,
    tenants: &str,
    seed: &str,
) -> Command {
    let mut c = settle();
    c.args([
        "loadgen",
        "--bootstrap-servers",
        bootstrap,
        "--topic",
        topic,
    ]);
    loadgen_mix(&mut c, duration, tenants, seed);
    c
}

/// `settle loadgen --nats` as the NATS process tests run it (not spawned): the mixed
/// scenarios ([`loadgen_mix`]) to the input stream and partition subjects of `nats`.
pub fn nats_loadgen(
    nats: &settle::transport::nats::NatsConfig,
    duration: &str,
    tenants: &str,
    seed: &str,
) -> Command {
    let mut c = settle();
    c.args(["loadgen", "--nats", &nats.servers, "--topic"])
        .arg(&nats.input_subject_prefix)
        .arg("--nats-partitions")
        .arg(nats.partitions.to_string())
        .arg("--nats-stream")
        .arg(&nats.input_stream);
    loadgen_mix(&mut c, duration, tenants, seed);
    c
}

/// The traffic of the process tests: the mixed scenarios at 300 uploads/s for `duration`
/// over `tenants` tenants, 40 burst machines, seed `seed`, no progress bar.
fn loadgen_mix(c: &mut Command, duration: &str, tenants: &str, seed: &str) {
    c.args(["--scenario", "mix", "--rate", "300", "--duration", duration])
        .args([
            "--tenants",
            tenants,
            "--burst-machines",
            "40",
            "--seed",
            seed,
        ])
        .arg("--no-progress");
}

/// Starts `settle run --config CONFIG`, waits (at most `limit`) until `rounds` distinct
/// emission ids are out (as [`wait_for_rounds`]), then stops it with SIGTERM within
/// `shutdown_deadline` (as [`sigterm`]).
pub fn run_until_rounds<T>(
    config: &Path,
    rounds: usize,
    limit: Duration,
    emitted_now: impl FnMut() -> Result<Vec<T>>,
    id_of: impl Fn(&T) -> String,
    shutdown_deadline: Duration,
) -> Result<()> {
    let mut run = start_run(config, &[])?;
    wait_for_rounds(&mut run, rounds, limit, emitted_now, id_of)?;
    sigterm(&mut run, shutdown_deadline)?;
    Ok(())
}

/// The tansu binary for the tests that run a broker of their own: `SETTLE_TEST_TANSU` (set
/// by scripts/test.sh), else `tansu` on `PATH`, else `~/.cargo/bin/tansu`. Not found: `None`
/// after saying loudly that `test` did not run, except under CI (`CI` set), where it is a
/// failure.
pub fn tansu_bin(test: &str) -> Option<std::path::PathBuf> {
    let from_env = std::env::var_os("SETTLE_TEST_TANSU").filter(|v| !v.is_empty());
    let on_path = std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|d| d.join("tansu"))
            .find(|p| p.is_file())
    });
    let in_cargo = std::env::var_os("CARGO_HOME")
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cargo")))
        .map(|d| d.join("bin/tansu"))
        .filter(|p| p.is_file());
    let found = from_env
        .map(std::path::PathBuf::from)
        .or(on_path)
        .or(in_cargo);
    if found.is_none() {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI is set but no tansu binary was found (SETTLE_TEST_TANSU, PATH, ~/.cargo/bin): {test} needs one (scripts/kafka.sh install)"
        );
        println!("no tansu binary (SETTLE_TEST_TANSU, PATH, ~/.cargo/bin): {test} did NOT run");
    }
    found
}

/// A tansu broker of one test on its own loopback port, with in-memory storage by default
/// (every start is an empty cluster, as after `docker compose down` of a broker without a
/// volume). The command line is scripts/kafka.sh's. Killed when dropped.
pub struct Tansu {
    bin: std::path::PathBuf,
    /// `127.0.0.1:PORT`, where it listens.
    pub bootstrap: String,
    /// `--advertised-listener-url` host:port (the bootstrap, unless a proxy fronts it).
    advertised: String,
    /// `--storage-engine` URL.
    storage: String,
    log: std::path::PathBuf,
    child: Option<Child>,
}

impl Tansu {
    /// Starts `bin` on a free loopback port, its output appended to `log`, and waits until
    /// it answers a metadata request.
    pub fn start(bin: &Path, log: &Path) -> Result<Tansu> {
        Tansu::start_with(bin, log, "memory://tansu/", None, None)
    }

    /// A free loopback `127.0.0.1:PORT` to start a broker on.
    pub fn free_addr() -> Result<String> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        Ok(format!("127.0.0.1:{port}"))
    }

    /// As [`Tansu::start`] with storage engine `storage` (`memory://tansu/`,
    /// `sqlite://NAME` — a file in the directory of `log` —, `postgres://...`), listening on `listen` (`host:port`; `None`: a
    /// free port) and, when given, telling clients to connect to `advertised` (`host:port`,
    /// say a proxy in front of it; it must forward by the time the broker is up, since the
    /// readiness probe follows the advertised address).
    pub fn start_with(
        bin: &Path,
        log: &Path,
        storage: &str,
        listen: Option<&str>,
        advertised: Option<&str>,
    ) -> Result<Tansu> {
        let bootstrap = match listen {
            Some(a) => a.to_owned(),
            None => Tansu::free_addr()?,
        };
        let mut t = Tansu {
            bin: bin.to_owned(),
            advertised: advertised.map_or_else(|| bootstrap.clone(), str::to_owned),
            bootstrap,
            storage: storage.to_owned(),
            log: log.to_owned(),
            child: None,
        };
        t.restart()?;
        Ok(t)
    }

    /// Stops the broker (SIGKILL; with memory storage its data is gone) and starts it again
    /// on the same port and storage.
    pub fn restart(&mut self) -> Result<()> {
        self.stop()?;
        self.launch()
    }

    /// Starts the broker (not running) and waits until it answers.
    pub fn launch(&mut self) -> Result<()> {
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .with_context(|| format!("open {}", self.log.display()))?;
        let url = format!("tcp://{}", self.bootstrap);
        let advertised = format!("tcp://{}", self.advertised);
        let child = Command::new(&self.bin)
            .args([
                "broker",
                "--listener-url",
                &url,
                "--advertised-listener-url",
                &advertised,
            ])
            .args(["--storage-engine", &self.storage])
            // tansu reads `sqlite://NAME` relative to its working directory (a leading `/`
            // is dropped): the log's directory holds the database too.
            .current_dir(self.log.parent().unwrap_or(Path::new(".")))
            .stdin(Stdio::null())
            .stdout(Stdio::from(out.try_clone()?))
            .stderr(Stdio::from(out))
            .spawn()
            .with_context(|| format!("spawn {}", self.bin.display()))?;
        self.child = Some(child);
        self.wait_ready(Duration::from_secs(60))
    }

    /// Waits until the broker answers a metadata request (or fails with its log's tail).
    fn wait_ready(&mut self, limit: Duration) -> Result<()> {
        use rdkafka::consumer::{BaseConsumer, Consumer};
        let client: BaseConsumer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", &self.bootstrap)
            .create()
            .context("metadata client")?;
        let t0 = Instant::now();
        loop {
            if client.fetch_metadata(None, Duration::from_secs(1)).is_ok() {
                return Ok(());
            }
            let exited = match self.child.as_mut() {
                Some(c) => c.try_wait()?,
                None => None,
            };
            if exited.is_some() || t0.elapsed() > limit {
                let log = std::fs::read_to_string(&self.log).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(20).collect();
                anyhow::bail!(
                    "tansu on {} not answering ({exited:?}) after {:?}; its log ends:\n{}",
                    self.bootstrap,
                    t0.elapsed(),
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Kills the broker, if running.
    pub fn stop(&mut self) -> Result<()> {
        if let Some(mut c) = self.child.take() {
            c.kill()?;
            c.wait()?;
        }
        Ok(())
    }
}

impl Drop for Tansu {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

/// Runs `settle run --config CONFIG` to its exit (at most `limit`) on stores that are ahead
/// of their input or changelog (the topic or stream started over) and requires what that
/// shows: exit code 1, and an error that names the `log` (`input` or `changelog`) `topic`, a
/// partition `p` of `stored` (partition → next offset its store holds for that log) with
/// exactly that offset, a log end of at most `ends[p]` (the partition's end as the test
/// produced it), and what to do. Returns the `error:` lines of
/// settle's stderr.
pub fn run_expecting_started_over(
    config: &Path,
    log: &str,
    topic: &str,
    stored: &std::collections::BTreeMap<i32, i64>,
    ends: &std::collections::BTreeMap<i32, i64>,
    limit: Duration,
) -> Result<String> {
    let log_file = config.with_extension("started-over.log");
    let file = std::fs::File::create(&log_file)?;
    let mut child = settle()
        .args(["run", "--config"])
        .arg(config)
        .env("SETTLE_LOG", "warn")
        .stderr(Stdio::from(file))
        .spawn()
        .context("spawn settle run")?;
    let status = wait_exit(&mut child, limit)?;
    let stderr = std::fs::read_to_string(&log_file)?;
    let Some(status) = status else {
        child.kill()?;
        anyhow::bail!(
            "settle run still running after {limit:?} on stores ahead of their input:\n{stderr}"
        );
    };
    ensure!(
        status.code() == Some(1),
        "settle run exited with {status} (want exit code 1):\n{stderr}"
    );
    let named = stored.iter().find_map(|(p, next)| {
        let head = format!("{log} {topic} partition {p} ends at offset ");
        let rest = &stderr[stderr.find(&head)? + head.len()..];
        let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
        let end: i64 = digits.parse().ok()?;
        let tail = format!(", below the next offset {next} stored for it");
        rest[digits.len()..].starts_with(&tail).then_some((*p, end))
    });
    let Some((p, end)) = named else {
        anyhow::bail!(
            "no error names {topic}, a partition and its stored offset {stored:?}:\n{stderr}"
        );
    };
    let produced = ends.get(&p).copied().unwrap_or(0);
    ensure!(
        end <= produced,
        "partition {p}: the error says the log ends at {end}, the test produced {produced}"
    );
    ensure!(
        stderr.contains(&format!("error: partition {p} failed"))
            && stderr.contains("wipe this partition's store directory (<store.data-dir>/")
            && stderr.contains(&format!("/{p}) to start it afresh")),
        "the exit does not say what to do:\n{stderr}"
    );
    let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error:")).collect();
    Ok(errors.join("\n"))
}
