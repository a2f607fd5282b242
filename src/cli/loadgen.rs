//! `settle loadgen`: realistic upload traffic into the Kafka input topic (or, with `--nats`,
//! the NATS JetStream input subjects). The scenarios are [`crate::cli::scenario`]'s; the
//! Kafka tooling (create topics, produce and read records back) is
//! `crate::transport::kafka::topics`.
//!
//! # Scenarios
//!
//! The traffic shapes of `settle demo` (SEMANTICS §1), one session at a time
//! ([`Scenario::session`]), drawing from the random source exactly as the demo's schedule
//! does, so the demo can be built from the same generators:
//!
//! | scenario | one session |
//! |---|---|
//! | `burst` | `burst-machines` CI machines (700) upload once each within `burst-spread` (1.5 s) |
//! | `split` | one upload split in 2 requests (`part` 1/2, 2/2) `split-gap` (300 ms) apart |
//! | `trickle` | a slow sender: `trickle-uploads` (5) uploads, 2–3 s apart |
//! | `tenants` | a small burst of `tenant-uploads` (10) within 600 ms; sessions spread over many tenants |
//! | `mix` | each session one of the above, weighted so uploads split 40/20/10/30 % |
//! | `noisy` | the seed's noisy-neighbour experiment ([`crate::cli::noisy`]): 100 `tenants`-shaped sessions of `normal-co` and 1 000 of `noisy-co`, all starting within `--duration`, so both tenants finish at about the same time |
//!
//! `noisy` is a fixed plan: `--rate`, `--tenants`, `--sessions` and `--burst-machines` do not
//! apply; `--duration` is its window (10 s in `benches/tiers.rs`) and `--seed` its seed. Its
//! target rate is its own (11 000 uploads over the window: 367/s for 30 s), and the summary
//! says so; its sessions have their own `noisy` row.
//!
//! # Run id
//!
//! Every session name starts with the run id, `<run-id>-<scenario>-<n>` (`7-692d7f41-split-10`;
//! noisy: `<run-id>-run-0042`), so a second run against the same settle opens new sessions
//! instead of joining the first run's (whose rounds would then span the gap between the runs,
//! and whose event ids the second run repeats: an upload whose `event_id` equals the
//! session's last applied one is ignored, SEMANTICS §2). The run id is `<seed>-<start time,
//! unix seconds in hex>` and is printed at start and in the summary; `--run-id ID` sets it,
//! so the same `--run-id` and `--seed` give the same uploads (a reproducible run).
//!
//! # Rate
//!
//! Open loop: session `n + 1` starts `uploads of session n / rate` seconds after session `n`,
//! so on average `--rate` uploads per second go out, in the bursts the scenarios make (a
//! 700-machine burst is 700 uploads within 1.5 s whatever the rate). Sessions are spread
//! round-robin over `--tenants` tenants (`tenant-0000`, ...). No session starts after
//! `--duration` (or after `--sessions` sessions); the started ones finish. When the broker
//! cannot keep up, uploads go out late and the summary's achieved rate says so.
//!
//! Every upload is sent as it falls due, keyed `tenant/session`, stamped with the producer's
//! clock (or the broker's, for `LogAppendTime` topics), through an idempotent producer; up
//! to [`MAX_IN_FLIGHT`] deliveries are awaited concurrently.
//!
//! # NATS
//!
//! `--nats URL` publishes to JetStream instead: each upload goes to
//! `<--topic>.<partition>` (`settle.uploads.3`) with the partition computed from the session
//! key by [`crate::transport::nats::partition_for_key`] over `--nats-partitions` (settle's
//! `nats.partitions`), header `settle-key` = the key (left out with `--nats-no-key-header`:
//! settle then takes the key from the body, SEMANTICS §2), and is counted once its publish
//! ack came.
//! The input stream `--nats-stream` is created with settle's defaults if missing
//! (`--create-topic` does not apply). The trace's `"offset"` is the stream sequence and its
//! `"ts"` the JetStream timestamp, read back from the stream at the end.
//!
//! # Trace
//!
//! `--trace-out FILE` writes one line per delivered upload: the upload record plus `"ts"`
//! (the record timestamp from the delivery report, ms), `"partition"` and `"offset"`, sorted
//! by `(ts, partition, offset)` (lines are kept in memory until the end, about 150 bytes per
//! upload). That is the `settle simulate` trace format, so a run can be replayed offline and
//! compared with what settle emitted.

pub use super::scenario::{upload_json, PlannedUpload, Scenario, Shape, SCENARIOS};
/// The Kafka tooling around the load generator (create topics, produce and read records
/// back, a group's committed offsets), for its users: it lives in the transport.
pub use crate::transport::kafka::{
    committed_offsets, create_topics, partition_count, produce_all, read_topic, Delivered,
    OutRecord, TopicRecord,
};

use super::{parse_property, progress_bar};
use crate::transport::kafka::{KafkaConfig, LogContext, Role};
use crate::transport::nats::{self, NatsConfig};
use anyhow::Context as _;
use futures::future::BoxFuture;
use futures::stream::{FuturesUnordered, StreamExt};
use rand::rngs::StdRng;
use rand::SeedableRng;
use rdkafka::consumer::BaseConsumer;
use rdkafka::producer::{FutureProducer, FutureRecord};
use std::collections::BinaryHeap;
use std::fmt;
use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

// ---------------------------------------------------------------------------------------------
// The load generator

/// Most deliveries awaited at once; sending pauses at this many.
pub const MAX_IN_FLIGHT: usize = 50_000;

/// `settle loadgen`: its command-line arguments (clap).
#[derive(Clone, Debug, clap::Args)]
pub struct LoadgenArgs {
    /// Kafka bootstrap servers (host:port, comma-separated).
    #[arg(
        long,
        default_value = "127.0.0.1:9092",
        env = "SETTLE_KAFKA__BOOTSTRAP_SERVERS"
    )]
    pub bootstrap_servers: String,
    /// Topic the uploads go to (settle's input topic).
    #[arg(long, default_value = "settle.uploads")]
    pub topic: String,
    /// librdkafka property for the producer, KEY=VALUE (repeatable; SASL, TLS, ...).
    #[arg(short = 'X', long = "property", value_name = "KEY=VALUE", value_parser = parse_property)]
    pub properties: Vec<(String, String)>,
    /// Traffic shape.
    #[arg(long, value_enum, default_value_t = Scenario::Mix)]
    pub scenario: Scenario,
    /// Target uploads per second (average; scenarios burst above it).
    #[arg(long, default_value_t = 1000.0)]
    pub rate: f64,
    /// How long new sessions start (e.g. "60s", "5m"); started sessions then finish.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub duration: Duration,
    /// Tenants the sessions are spread over.
    #[arg(long, default_value_t = 100)]
    pub tenants: u32,
    /// Start at most this many sessions (default: as many as the duration allows).
    #[arg(long)]
    pub sessions: Option<u64>,
    /// Uploads of a `burst` session (CI machines).
    #[arg(long, default_value_t = 700)]
    pub burst_machines: u32,
    /// Seed of the schedule's randomness (same seed, same schedule).
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// Prefix of every session name (letters, digits, '.', '_', '-'); default
    /// "SEED-STARTTIME" (unix seconds in hex), so two runs never share a session.
    #[arg(long, value_name = "ID", value_parser = parse_run_id)]
    pub run_id: Option<String>,
    /// Write every delivered upload as a trace line (upload + "ts", "partition", "offset").
    #[arg(long, value_name = "FILE")]
    pub trace_out: Option<PathBuf>,
    /// Create the topic with this many partitions first, if it does not exist.
    #[arg(long, value_name = "PARTITIONS")]
    pub create_topic: Option<i32>,
    /// No progress bar.
    #[arg(long)]
    pub no_progress: bool,
    /// NATS mode (module docs): `--nats URL`, `--nats-partitions`, `--nats-stream`.
    #[command(flatten)]
    pub nats: NatsTarget,
}

/// `settle loadgen --nats`: where uploads go on NATS JetStream (`--topic` is the subject
/// prefix). `Default` is "not NATS" with the same defaults as the flags.
#[derive(Clone, Debug, PartialEq, Eq, clap::Args)]
pub struct NatsTarget {
    /// Publish to NATS JetStream at this server URL (e.g. nats://127.0.0.1:4222) instead of
    /// Kafka; uploads go to `<--topic>.<partition>`.
    #[arg(long = "nats", value_name = "URL")]
    pub url: Option<String>,
    /// NATS: input partitions (settle's `nats.partitions`); the partition of an upload is
    /// FNV-1a-32(session key) mod this.
    #[arg(long = "nats-partitions", default_value_t = 8)]
    pub partitions: u32,
    /// NATS: input stream (settle's `nats.input-stream`), created if missing.
    #[arg(long = "nats-stream", default_value = "SETTLE_UPLOADS")]
    pub stream: String,
    /// NATS: publish without the `settle-key` header (settle takes the session key from the
    /// body's tenant and session).
    #[arg(long = "nats-no-key-header")]
    pub no_key_header: bool,
}

impl Default for NatsTarget {
    fn default() -> Self {
        NatsTarget {
            url: None,
            partitions: 8,
            stream: "SETTLE_UPLOADS".to_owned(),
            no_key_header: false,
        }
    }
}

impl LoadgenArgs {
    /// The Kafka settings these arguments describe (the producer side of `[kafka]`).
    pub fn kafka(&self) -> KafkaConfig {
        KafkaConfig {
            bootstrap_servers: self.bootstrap_servers.clone(),
            input_topic: self.topic.clone(),
            properties: self.properties.iter().cloned().collect(),
            ..KafkaConfig::default()
        }
    }

    /// The NATS settings these arguments describe (the producer side of `[nats]`), if
    /// `--nats` is given.
    pub fn nats_config(&self) -> Option<NatsConfig> {
        Some(NatsConfig {
            servers: self.nats.url.clone()?,
            input_stream: self.nats.stream.clone(),
            input_subject_prefix: self.topic.clone(),
            partitions: self.nats.partitions,
            ..NatsConfig::default()
        })
    }

    fn shape(&self) -> Shape {
        Shape {
            burst_machines: self.burst_machines.max(1),
            ..Shape::default()
        }
    }

    /// The run id of a run started at `start` (module docs "Run id"): `--run-id`, or
    /// `<seed>-<unix seconds in hex>`.
    pub fn run_id(&self, start: SystemTime) -> String {
        self.run_id.clone().unwrap_or_else(|| {
            let secs = start.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
            format!("{}-{secs:x}", self.seed)
        })
    }
}

/// Parses `--run-id`: 1 to 64 of `A-Z a-z 0-9 . _ -` (it goes into session names and keys).
///
/// Errors: empty, too long, or another character.
pub fn parse_run_id(text: &str) -> Result<String, String> {
    let ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
    if text.is_empty() || text.len() > 64 || !text.chars().all(ok) {
        return Err(format!(
            "expected 1 to 64 letters, digits, '.', '_' or '-', got {text:?}"
        ));
    }
    Ok(text.to_owned())
}

/// The sessions of a `settle loadgen` run (not `noisy`), in start order: the scenario drawn
/// from the seed, tenants round-robin, names `<run-id>-<scenario>-<n>` (module docs).
pub struct SessionPlan {
    rng: StdRng,
    shape: Shape,
    scenario: Scenario,
    tenants: u64,
    run_id: String,
    started: u64,
}

impl SessionPlan {
    /// The plan of `args` for the run `run_id` ([`LoadgenArgs::run_id`]).
    pub fn new(args: &LoadgenArgs, run_id: &str) -> SessionPlan {
        SessionPlan {
            rng: StdRng::seed_from_u64(args.seed),
            shape: args.shape(),
            scenario: args.scenario,
            tenants: u64::from(args.tenants.max(1)),
            run_id: run_id.to_owned(),
            started: 0,
        }
    }

    /// The next session: the index of its pure scenario in [`SCENARIOS`], and its uploads
    /// (times relative to its start, ms).
    pub fn next_session(&mut self) -> (usize, Vec<PlannedUpload>) {
        let scenario = self.scenario.pick(&mut self.rng, &self.shape);
        let index = SCENARIOS.iter().position(|s| *s == scenario).unwrap_or(3);
        let tenant = format!("tenant-{:04}", self.started % self.tenants);
        let name = format!("{scenario:?}").to_lowercase();
        let session = format!("{}-{name}-{}", self.run_id, self.started);
        self.started += 1;
        let uploads = scenario.session(&mut self.rng, &tenant, &session, &self.shape);
        (index, uploads)
    }
}

/// Where one upload went: (record timestamp in ms, -1 until known; partition; offset).
type Sent = (i64, i32, i64);

/// The acknowledgement of one upload: where it went, or why it failed.
type SendFuture = BoxFuture<'static, Result<Sent, String>>;

/// The client `settle loadgen` sends through.
enum Producer {
    Kafka {
        producer: FutureProducer<LogContext>,
        topic: String,
    },
    Nats {
        js: Box<async_nats::jetstream::Context>,
        config: Box<NatsConfig>,
        /// Send header `settle-key` (not `--nats-no-key-header`).
        key_header: bool,
    },
}

impl Producer {
    /// Creates the client of `args` (and the topic or stream, see the module docs).
    async fn new(args: &LoadgenArgs) -> anyhow::Result<Producer> {
        if let Some(config) = args.nats_config() {
            config.validate()?;
            let client = nats::connect(&config).await?;
            let js = nats::jetstream(client, MAX_IN_FLIGHT);
            nats::ensure_input_stream(&js, &config).await?;
            return Ok(Producer::Nats {
                js: Box::new(js),
                config: Box::new(config),
                key_header: !args.nats.no_key_header,
            });
        }
        let kafka = args.kafka();
        if let Some(partitions) = args.create_topic {
            create_topics(&kafka, &[(&kafka.input_topic, partitions.max(1))]).await?;
        } else {
            // A missing topic would only show as delivery timeouts 30 s later: say it now.
            let check = kafka.clone();
            let topic = kafka.input_topic.clone();
            let found = tokio::task::spawn_blocking(move || {
                let reader: BaseConsumer<LogContext> = check
                    .client_config(Role::Consumer)
                    .create_with_context(LogContext)?;
                partition_count(&reader, &check.input_topic)
            })
            .await
            .context("topic check task")?;
            if let Err(e) = found {
                return Err(e.context(format!(
                    "topic {topic} is not available on {}: create it (scripts/kafka.sh up creates settle.uploads, or pass --create-topic PARTITIONS)",
                    kafka.bootstrap_servers
                )));
            }
        }
        let producer = kafka
            .client_config(Role::Producer)
            .create_with_context(LogContext)
            .context("cannot create the Kafka producer (check the -X properties)")?;
        Ok(Producer::Kafka {
            producer,
            topic: kafka.input_topic,
        })
    }

    /// Hands `upload` to the client, in call order. `Ok(None)`: the local queue is full,
    /// try again after some acknowledgements. Errors: the client refused it.
    async fn send(&self, upload: &PlannedUpload) -> Result<Option<SendFuture>, String> {
        match self {
            Producer::Kafka { producer, topic } => {
                let record = FutureRecord::to(topic)
                    .key(upload.key.as_bytes())
                    .payload(upload.json.as_bytes());
                match producer.send_result(record) {
                    Ok(delivery) => Ok(Some(Box::pin(async move {
                        match delivery.await {
                            Ok(Ok(d)) => {
                                Ok((d.timestamp.to_millis().unwrap_or(-1), d.partition, d.offset))
                            }
                            Ok(Err((e, _))) => Err(e.to_string()),
                            Err(_) => Err("producer dropped the delivery report".to_owned()),
                        }
                    }))),
                    Err((e, _)) => {
                        tracing::debug!(error = %e, "producer queue full");
                        Ok(None)
                    }
                }
            }
            Producer::Nats {
                js,
                config,
                key_header,
            } => {
                let (partition, ack) = nats::publish_upload(
                    js,
                    &config.input_subject_prefix,
                    config.partitions,
                    &upload.key,
                    upload.json.as_bytes(),
                    None,
                    *key_header,
                )
                .await
                .map_err(|e| format!("{e:#}"))?;
                Ok(Some(Box::pin(async move {
                    ack.await
                        .map(|a| (-1, partition, a.sequence as i64))
                        .map_err(|e| e.to_string())
                })))
            }
        }
    }

    /// Fills in the timestamps the acknowledgements did not give (NATS: read back from the
    /// stream by sequence).
    async fn stamp(&self, trace: &mut [(i64, i32, i64, String)]) -> anyhow::Result<()> {
        let Producer::Nats { js, config, .. } = self else {
            return Ok(());
        };
        let stored = nats::read_stream(
            js,
            &config.input_stream,
            &config.input_pattern(),
            0,
            Duration::from_secs(120),
        )
        .await?;
        let ts: std::collections::HashMap<u64, i64> = stored
            .iter()
            .map(|r| (r.sequence, r.timestamp_ms))
            .collect();
        for entry in trace.iter_mut() {
            entry.0 = ts.get(&(entry.2 as u64)).copied().unwrap_or(-1);
        }
        Ok(())
    }
}

/// What a `settle loadgen` run did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LoadgenReport {
    /// Uploads the broker acknowledged.
    pub produced: u64,
    /// Uploads whose delivery failed.
    pub failed: u64,
    /// Sessions started, per scenario in [`REPORTED`] order.
    pub sessions: [u64; 5],
    /// Uploads acknowledged, per scenario in [`REPORTED`] order.
    pub uploads: [u64; 5],
    /// Wall time from the first send to the last delivery report (ms).
    pub elapsed_ms: u64,
    /// Length of the window in which sessions started (`--duration`, ms).
    pub window_ms: u64,
    /// How long the started sessions' uploads were planned to go on after the window (ms).
    pub tail_ms: u64,
    /// The rate aimed at (uploads/s): `--rate`, or for `noisy` the plan's own (its uploads
    /// over the window; `fixed_plan`).
    pub target_rate: f64,
    /// The run was `noisy`'s fixed plan of this many uploads (`--rate` did not apply).
    pub fixed_plan: Option<u64>,
    /// Deliveries that came later than 1 s after their planned time (the producer fell behind).
    pub late: u64,
    /// Where the trace went, if anywhere.
    pub trace: Option<PathBuf>,
    /// The run id every session name starts with (module docs "Run id").
    pub run_id: String,
}

/// The rows of the summary: the four pure scenarios ([`SCENARIOS`]), then `noisy`.
pub const REPORTED: [Scenario; 5] = [
    Scenario::Burst,
    Scenario::Split,
    Scenario::Trickle,
    Scenario::Tenants,
    Scenario::Noisy,
];

/// Index of `noisy` in [`REPORTED`].
const NOISY_ROW: usize = 4;

impl LoadgenReport {
    /// The rate achieved (uploads/s): acknowledged uploads over the window, stretched by how
    /// far the last delivery came after the last planned send (the producer falling behind).
    pub fn rate(&self) -> f64 {
        let behind = self
            .elapsed_ms
            .saturating_sub(self.window_ms + self.tail_ms);
        self.produced as f64 * 1000.0 / (self.window_ms + behind).max(1) as f64
    }
}

impl fmt::Display for LoadgenReport {
    /// The summary printed at the end of `settle loadgen`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let target = match self.fixed_plan {
            Some(n) => format!(
                "target {:.0}: noisy is a fixed plan of {n} uploads within --duration, --rate does not apply",
                self.target_rate
            ),
            None => format!("target {:.0}", self.target_rate),
        };
        writeln!(
            f,
            "produced {} uploads: {:.0} uploads/s during the {:.1} s window ({target}), all sessions done after {:.1} s{}",
            self.produced,
            self.rate(),
            self.window_ms as f64 / 1000.0,
            self.elapsed_ms as f64 / 1000.0,
            if self.failed > 0 {
                format!(", {} FAILED", self.failed)
            } else {
                String::new()
            }
        )?;
        for (i, s) in REPORTED.iter().enumerate() {
            if self.sessions[i] > 0 {
                let of_whom = if i == NOISY_ROW {
                    let p = super::noisy::NoisyParams::default();
                    format!(
                        " ({} of {}, {} of {})",
                        p.normal_sessions,
                        super::noisy::NORMAL_TENANT,
                        p.noisy_sessions,
                        super::noisy::NOISY_TENANT
                    )
                } else {
                    String::new()
                };
                writeln!(
                    f,
                    "  {:<8} {:>7} sessions {:>9} uploads{of_whom}",
                    format!("{s:?}").to_lowercase(),
                    self.sessions[i],
                    self.uploads[i]
                )?;
            }
        }
        if self.late > 0 {
            writeln!(
                f,
                "  {} uploads delivered more than 1 s after their planned time (producer behind)",
                self.late
            )?;
        }
        writeln!(f, "  run id {} (session names start with it)", self.run_id)?;
        match &self.trace {
            Some(path) => write!(f, "trace: {}", path.display()),
            None => write!(f, "trace: not written (--trace-out FILE)"),
        }
    }
}

/// Runs `settle loadgen` (builds its own tokio runtime; call it from a plain thread).
///
/// Errors: as [`run_async`].
pub fn run(args: &LoadgenArgs) -> anyhow::Result<LoadgenReport> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the tokio runtime")?
        .block_on(run_async(args))
}

/// One upload waiting for its time.
struct Due {
    at: tokio::time::Instant,
    seq: u64,
    scenario: usize,
    upload: PlannedUpload,
}

impl PartialEq for Due {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl Eq for Due {}
impl PartialOrd for Due {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Due {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        // Reversed: the heap pops the earliest.
        (other.at, other.seq).cmp(&(self.at, self.seq))
    }
}

/// The async body of [`run`].
///
/// Errors: invalid arguments (rate, properties), the producer cannot be created, the topic
/// cannot be created (`--create-topic`), or the trace file cannot be written.
pub async fn run_async(args: &LoadgenArgs) -> anyhow::Result<LoadgenReport> {
    anyhow::ensure!(
        args.rate.is_finite() && args.rate > 0.0,
        "--rate must be a positive number of uploads per second"
    );
    let producer = Producer::new(args).await?;
    let trace_file = match &args.trace_out {
        Some(path) => Some(
            std::fs::File::create(path)
                .with_context(|| format!("cannot create {}", path.display()))?,
        ),
        None => None,
    };
    let mut trace: Vec<(i64, i32, i64, String)> = Vec::new();
    let run_id = args.run_id(SystemTime::now());
    eprintln!("loadgen run {run_id}: every session name starts with {run_id}- (--run-id sets it)");
    let mut plan = SessionPlan::new(args, &run_id);
    let planned_total = (args.rate * args.duration.as_secs_f64()) as u64;
    let bar = progress_bar(!args.no_progress, planned_total);
    let mut report = LoadgenReport {
        target_rate: args.rate,
        trace: args.trace_out.clone(),
        run_id: run_id.clone(),
        ..LoadgenReport::default()
    };

    let start = tokio::time::Instant::now();
    let stop_at = start + args.duration;
    let mut next_session = start;
    let mut started: u64 = 0;
    let mut seq: u64 = 0;
    let mut last_planned = start;
    let mut due: BinaryHeap<Due> = BinaryHeap::new();
    if args.scenario == Scenario::Noisy {
        // A fixed plan rather than sessions started at a rate.
        let params = super::noisy::NoisyParams {
            window_ms: args.duration.as_millis() as u64,
            seed: args.seed,
            session_prefix: format!("{run_id}-"),
            ..super::noisy::NoisyParams::default()
        };
        report.sessions[NOISY_ROW] = u64::from(params.normal_sessions + params.noisy_sessions);
        let uploads = super::noisy::plan(&params, true);
        report.fixed_plan = Some(uploads.len() as u64);
        report.target_rate = uploads.len() as f64 / args.duration.as_secs_f64().max(0.001);
        for upload in uploads {
            seq += 1;
            let at = start + Duration::from_millis(upload.at_ms);
            last_planned = last_planned.max(at);
            due.push(Due {
                at,
                seq,
                scenario: NOISY_ROW,
                upload,
            });
        }
        next_session = stop_at;
        bar.set_length(due.len() as u64);
    }
    let mut in_flight: FuturesUnordered<BoxFuture<'static, (Result<Sent, String>, Due)>> =
        FuturesUnordered::new();
    let mut failure_logged = false;
    loop {
        let sessions_open = next_session < stop_at && args.sessions.is_none_or(|n| started < n);
        if !sessions_open && due.is_empty() && in_flight.is_empty() {
            break;
        }
        // Start every session whose time has come.
        let now = tokio::time::Instant::now();
        while sessions_open
            && next_session <= now
            && next_session < stop_at
            && args.sessions.is_none_or(|n| started < n)
        {
            let (index, uploads) = plan.next_session();
            next_session += Duration::from_secs_f64(uploads.len() as f64 / args.rate);
            for upload in uploads {
                seq += 1;
                last_planned = last_planned.max(now + Duration::from_millis(upload.at_ms));
                due.push(Due {
                    at: now + Duration::from_millis(upload.at_ms),
                    seq,
                    scenario: index,
                    upload,
                });
            }
            report.sessions[index] += 1;
            started += 1;
        }
        // Send every upload whose time has come (while there is room in flight).
        while in_flight.len() < MAX_IN_FLIGHT && due.peek().is_some_and(|d| d.at <= now) {
            let Some(d) = due.pop() else { break };
            match producer.send(&d.upload).await {
                Ok(Some(ack)) => in_flight.push(Box::pin(async move { (ack.await, d) })),
                Ok(None) => {
                    // Local queue full: wait for deliveries below, retry this one.
                    due.push(d);
                    break;
                }
                Err(e) => in_flight.push(Box::pin(async move { (Err(e), d) })),
            }
        }
        // Wait for the next due time, the next session, or a delivery report.
        let wake = [
            due.peek().map(|d| d.at),
            sessions_open.then_some(next_session),
        ]
        .into_iter()
        .flatten()
        .min()
        .unwrap_or(now + Duration::from_millis(100));
        tokio::select! {
            Some((result, d)) = in_flight.next(), if !in_flight.is_empty() => {
                match result {
                    Ok((ts, partition, offset)) => {
                        report.produced += 1;
                        report.uploads[d.scenario] += 1;
                        if d.at.elapsed() > Duration::from_secs(1) {
                            report.late += 1;
                        }
                        if trace_file.is_some() {
                            trace.push((ts, partition, offset, d.upload.json));
                        }
                    }
                    Err(e) => {
                        report.failed += 1;
                        if !failure_logged {
                            failure_logged = true;
                            tracing::warn!(error = %e, "delivery failed (later failures are only counted)");
                        }
                    }
                }
                if report.produced % 1000 == 0 {
                    bar.set_position(report.produced);
                    bar.set_message(format!("{:.0} uploads/s, {} in flight", report.produced as f64 / start.elapsed().as_secs_f64().max(0.001), in_flight.len()));
                }
            }
            () = tokio::time::sleep_until(wake), if in_flight.len() < MAX_IN_FLIGHT => {}
        }
    }
    report.elapsed_ms = start.elapsed().as_millis() as u64;
    report.window_ms = args.duration.as_millis() as u64;
    report.tail_ms = last_planned.saturating_duration_since(stop_at).as_millis() as u64;
    bar.finish_and_clear();
    if let Some(file) = trace_file {
        producer.stamp(&mut trace).await?;
        trace.sort_unstable();
        let mut out = std::io::BufWriter::new(file);
        for (ts, p, o, json) in &trace {
            writeln!(out, "{}", trace_line(json, *ts, *p, *o)).context("cannot write the trace")?;
        }
        out.flush().context("cannot write the trace")?;
    }
    Ok(report)
}

/// One trace line: `json` with `"ts"`, `"partition"` and `"offset"` added.
fn trace_line(json: &str, ts: i64, p: i32, o: i64) -> String {
    let body = json.strip_suffix('}').unwrap_or(json);
    format!(r#"{body},"ts":{ts},"partition":{p},"offset":{o}}}"#)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use std::collections::BTreeSet;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: LoadgenArgs,
    }

    fn args(extra: &[&str]) -> LoadgenArgs {
        Cli::parse_from(["loadgen"].iter().chain(extra)).args
    }

    /// The session keys of the first `n` sessions of a plan started at `start`.
    fn keys(args: &LoadgenArgs, start: SystemTime, n: usize) -> Vec<String> {
        let mut plan = SessionPlan::new(args, &args.run_id(start));
        (0..n)
            .flat_map(|_| plan.next_session().1)
            .map(|u| u.key)
            .collect()
    }

    #[test]
    fn runs_with_different_seeds_share_no_session() {
        let start = UNIX_EPOCH + Duration::from_secs(1_796_039_353);
        let a: BTreeSet<String> = keys(&args(&["--seed", "7"]), start, 300)
            .into_iter()
            .collect();
        let b: BTreeSet<String> = keys(&args(&["--seed", "8"]), start, 300)
            .into_iter()
            .collect();
        assert!(a.len() >= 300 && b.len() >= 300, "{} {}", a.len(), b.len());
        assert_eq!(
            a.intersection(&b).count(),
            0,
            "{:?}",
            a.intersection(&b).next()
        );
        // The same seed a second later: another run, other sessions.
        let later = keys(&args(&["--seed", "7"]), start + Duration::from_secs(1), 300);
        assert!(later.iter().all(|k| !a.contains(k)), "{:?}", later.first());
        // The run id is in every name.
        assert!(
            a.iter().all(|k| k.contains("/7-6b0d62b9-")),
            "{:?}",
            a.first()
        );
    }

    #[test]
    fn a_run_id_makes_a_run_reproducible() {
        let (t1, t2) = (UNIX_EPOCH, UNIX_EPOCH + Duration::from_secs(3_600));
        let x = args(&["--run-id", "bench.1", "--seed", "3"]);
        let plan = |args: &LoadgenArgs, start| {
            let mut plan = SessionPlan::new(args, &args.run_id(start));
            (0..50).map(|_| plan.next_session()).collect::<Vec<_>>()
        };
        assert_eq!(plan(&x, t1), plan(&x, t2));
        assert!(plan(&x, t1)[0].1[0].key.starts_with("tenant-0000/bench.1-"));
        let y = args(&["--run-id", "bench.2", "--seed", "3"]);
        let ys: BTreeSet<String> = keys(&y, t1, 50).into_iter().collect();
        assert!(keys(&x, t1, 50).iter().all(|k| !ys.contains(k)));
        for bad in ["", "a/b", "x y", &"r".repeat(65)] {
            assert!(parse_run_id(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn noisy_sessions_carry_the_run_id() {
        let params = super::super::noisy::NoisyParams {
            session_prefix: "7-abc-".to_owned(),
            ..super::super::noisy::NoisyParams::default()
        };
        let plan = super::super::noisy::plan(&params, true);
        assert!(
            plan.iter().all(|u| u.key.contains("/7-abc-run-")),
            "{:?}",
            plan[0]
        );
    }

    #[test]
    fn a_noisy_summary_says_its_plan_and_tenants() {
        let mut report = LoadgenReport {
            produced: 11_000,
            window_ms: 30_000,
            target_rate: 11_000.0 / 30.0,
            fixed_plan: Some(11_000),
            run_id: "7-abc".to_owned(),
            ..LoadgenReport::default()
        };
        report.sessions[NOISY_ROW] = 1_100;
        report.uploads[NOISY_ROW] = 11_000;
        let text = report.to_string();
        assert!(text.contains("367 uploads/s during the 30.0 s window (target 367: noisy is a fixed plan of 11000 uploads"), "{text}");
        assert!(text.contains("  noisy       1100 sessions     11000 uploads (100 of normal-co, 1000 of noisy-co)"), "{text}");
        assert!(!text.contains("tenants"), "{text}");
    }
}
