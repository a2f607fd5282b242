//! `settle loadgen`: realistic upload traffic into the Kafka input topic (or, with `--nats`,
//! the NATS JetStream input subjects), and the Kafka tooling around it (create topics,
//! produce and read records back).
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
//! | `noisy` | the seed's noisy-neighbour experiment ([`crate::noisy`]): 100 `tenants`-shaped sessions of `normal-co` and 1 000 of `noisy-co`, all starting within `--duration`, so both tenants finish at about the same time |
//!
//! `noisy` is a fixed plan: `--rate`, `--tenants`, `--sessions` and `--burst-machines` do not
//! apply; `--duration` is its window (10 s in `benches/tiers.rs`) and `--seed` its seed. Its
//! sessions are counted under `tenants` in the summary.
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
//! `nats.partitions`), header `settle-key` = the key, and is counted once its publish ack came.
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

use crate::transport::kafka::{KafkaConfig, LogContext, Role};
use crate::transport::nats::{self, NatsConfig};
use anyhow::{anyhow, Context as _};
use futures::future::BoxFuture;
use futures::stream::{FuturesUnordered, StreamExt};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::KafkaError;
use rdkafka::message::{Headers as _, Message as _};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{Offset, TopicPartitionList};
use std::collections::BTreeSet;
use std::collections::BinaryHeap;
use std::fmt;
use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

// ---------------------------------------------------------------------------------------------
// Scenarios

/// A traffic shape (module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum Scenario {
    /// 700 machines upload into one session within 1.5 s.
    Burst,
    /// One upload in 2 requests (`part` 1/2, 2/2) 300 ms apart.
    Split,
    /// A slow sender: 5 uploads 2–3 s apart.
    Trickle,
    /// Small bursts (10 uploads within 600 ms) spread over many tenants.
    Tenants,
    /// Each session one of the above (uploads split 40/20/10/30 %).
    Mix,
    /// The noisy-neighbour experiment: 100 sessions of `normal-co` and 1 000 of `noisy-co`
    /// within `--duration` (SEMANTICS §5, [`crate::noisy`]).
    Noisy,
}

/// The four pure scenarios, in the order of the module table.
pub const SCENARIOS: [Scenario; 4] = [
    Scenario::Burst,
    Scenario::Split,
    Scenario::Trickle,
    Scenario::Tenants,
];

/// Share of uploads of each pure scenario in [`Scenario::Mix`], in [`SCENARIOS`] order.
const MIX_UPLOAD_SHARE: [f64; 4] = [0.4, 0.2, 0.1, 0.3];

/// Sizes of the scenarios (defaults: the demo's, in real time).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shape {
    /// Uploads of a `burst` session (one per CI machine).
    pub burst_machines: u32,
    /// Time a `burst` session's uploads spread over (ms).
    pub burst_spread_ms: u64,
    /// Time between the 2 parts of a `split` upload (ms).
    pub split_gap_ms: u64,
    /// Uploads of a `trickle` session.
    pub trickle_uploads: u32,
    /// Gap between two `trickle` uploads: drawn from this range (ms).
    pub trickle_gap_ms: std::ops::Range<u64>,
    /// Uploads of a `tenants` session.
    pub tenant_uploads: u32,
    /// Time a `tenants` session's uploads spread over (ms).
    pub tenant_spread_ms: u64,
}

impl Default for Shape {
    fn default() -> Self {
        Shape {
            burst_machines: 700,
            burst_spread_ms: 1_500,
            split_gap_ms: 300,
            trickle_uploads: 5,
            trickle_gap_ms: 2_000..3_000,
            tenant_uploads: 10,
            tenant_spread_ms: 600,
        }
    }
}

/// One upload of a session: `at_ms` after the session's start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlannedUpload {
    /// Time after the session's start (ms).
    pub at_ms: u64,
    /// Record key, `tenant/session`.
    pub key: String,
    /// The upload record (SEMANTICS §2).
    pub json: String,
}

/// An upload record (SEMANTICS §2) with `event_id` and `extra` (`,"field":value...` or empty)
/// appended inside the object.
pub fn upload_json(tenant: &str, session: &str, event_id: &str, extra: &str) -> String {
    format!(r#"{{"tenant":"{tenant}","session":"{session}","event_id":"{event_id}"{extra}}}"#)
}

impl Scenario {
    /// Mean uploads of one session.
    pub fn uploads_per_session(self, shape: &Shape) -> f64 {
        match self {
            Scenario::Burst => f64::from(shape.burst_machines),
            Scenario::Split => 2.0,
            Scenario::Trickle => f64::from(shape.trickle_uploads),
            Scenario::Tenants | Scenario::Noisy => f64::from(shape.tenant_uploads),
            Scenario::Mix => 1.0 / mix_weights(shape).iter().map(|(_, w)| w).sum::<f64>(),
        }
    }

    /// The pure scenario of one session: `self`, or for [`Scenario::Mix`] one drawn from
    /// `rng` (sessions weighted so uploads split as documented).
    pub fn pick(self, rng: &mut impl Rng, shape: &Shape) -> Scenario {
        if self != Scenario::Mix {
            return self;
        }
        let weights = mix_weights(shape);
        let total: f64 = weights.iter().map(|(_, w)| w).sum();
        let mut x = rng.random_range(0.0..total);
        for (scenario, w) in weights {
            if x < w {
                return scenario;
            }
            x -= w;
        }
        Scenario::Tenants
    }

    /// The uploads of one session of `tenant/session`, sorted by time, times relative to the
    /// session's start. Draws from `rng` exactly as `settle demo`'s schedule does for one
    /// session (its start time is the caller's draw). [`Scenario::Mix`] picks first.
    pub fn session(
        self,
        rng: &mut impl Rng,
        tenant: &str,
        session: &str,
        shape: &Shape,
    ) -> Vec<PlannedUpload> {
        let key = format!("{tenant}/{session}");
        let upload = |at_ms: u64, id: String, extra: &str| PlannedUpload {
            at_ms,
            key: key.clone(),
            json: upload_json(tenant, session, &id, extra),
        };
        let mut plan: Vec<PlannedUpload> = match self.pick(rng, shape) {
            Scenario::Burst => (0..shape.burst_machines)
                .map(|m| {
                    let at = rng.random_range(0..shape.burst_spread_ms.max(1));
                    upload(at, format!("m{m}"), "")
                })
                .collect(),
            Scenario::Split => [(1, 0), (2, shape.split_gap_ms)]
                .into_iter()
                .map(|(i, at)| {
                    let extra = format!(r#","part":{{"index":{i},"count":2}}"#);
                    upload(at, format!("p{i}"), &extra)
                })
                .collect(),
            Scenario::Trickle => {
                let mut at = 0;
                (0..shape.trickle_uploads)
                    .map(|i| {
                        let u = upload(at, format!("u{i}"), "");
                        at += rng.random_range(shape.trickle_gap_ms.clone());
                        u
                    })
                    .collect()
            }
            Scenario::Tenants | Scenario::Mix | Scenario::Noisy => (0..shape.tenant_uploads)
                .map(|i| {
                    let at = rng.random_range(0..shape.tenant_spread_ms.max(1));
                    upload(at, format!("u{i}"), "")
                })
                .collect(),
        };
        plan.sort_by_key(|u| u.at_ms);
        plan
    }
}

/// `(scenario, sessions weight)` of [`Scenario::Mix`]: upload share / uploads per session.
fn mix_weights(shape: &Shape) -> [(Scenario, f64); 4] {
    let mut w = [(Scenario::Burst, 0.0); 4];
    for (i, s) in SCENARIOS.into_iter().enumerate() {
        w[i] = (
            s,
            MIX_UPLOAD_SHARE[i] / s.uploads_per_session(shape).max(1.0),
        );
    }
    w
}

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
}

impl Default for NatsTarget {
    fn default() -> Self {
        NatsTarget {
            url: None,
            partitions: 8,
            stream: "SETTLE_UPLOADS".to_owned(),
        }
    }
}

/// Parses a `KEY=VALUE` librdkafka property argument (`-X`).
///
/// Errors: no `=`, or an empty key.
pub fn parse_property(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_owned(), v.to_owned())),
        _ => Err(format!("expected KEY=VALUE, got {text:?}")),
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
        js: async_nats::jetstream::Context,
        config: Box<NatsConfig>,
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
                js,
                config: Box::new(config),
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
            Producer::Nats { js, config } => {
                let (partition, ack) = nats::publish_upload(
                    js,
                    &config.input_subject_prefix,
                    config.partitions,
                    &upload.key,
                    upload.json.as_bytes(),
                    None,
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
        let Producer::Nats { js, config } = self else {
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
    /// Sessions started, per pure scenario in [`SCENARIOS`] order.
    pub sessions: [u64; 4],
    /// Uploads acknowledged, per pure scenario in [`SCENARIOS`] order.
    pub uploads: [u64; 4],
    /// Wall time from the first send to the last delivery report (ms).
    pub elapsed_ms: u64,
    /// Length of the window in which sessions started (`--duration`, ms).
    pub window_ms: u64,
    /// How long the started sessions' uploads were planned to go on after the window (ms).
    pub tail_ms: u64,
    /// The rate asked for (uploads/s).
    pub target_rate: f64,
    /// Deliveries that came later than 1 s after their planned time (the producer fell behind).
    pub late: u64,
    /// Where the trace went, if anywhere.
    pub trace: Option<PathBuf>,
}

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
        writeln!(
            f,
            "produced {} uploads: {:.0} uploads/s during the {:.1} s window (target {:.0}), all sessions done after {:.1} s{}",
            self.produced,
            self.rate(),
            self.window_ms as f64 / 1000.0,
            self.target_rate,
            self.elapsed_ms as f64 / 1000.0,
            if self.failed > 0 {
                format!(", {} FAILED", self.failed)
            } else {
                String::new()
            }
        )?;
        for (i, s) in SCENARIOS.iter().enumerate() {
            if self.sessions[i] > 0 {
                writeln!(
                    f,
                    "  {:<8} {:>7} sessions {:>9} uploads",
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
    let shape = args.shape();
    let mut rng = StdRng::seed_from_u64(args.seed);
    let planned_total = (args.rate * args.duration.as_secs_f64()) as u64;
    let bar = progress_bar(!args.no_progress, planned_total);
    let mut report = LoadgenReport {
        target_rate: args.rate,
        trace: args.trace_out.clone(),
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
        let params = crate::noisy::NoisyParams {
            window_ms: args.duration.as_millis() as u64,
            seed: args.seed,
            ..crate::noisy::NoisyParams::default()
        };
        report.sessions[3] = u64::from(params.normal_sessions + params.noisy_sessions);
        for upload in crate::noisy::plan(&params, true) {
            seq += 1;
            let at = start + Duration::from_millis(upload.at_ms);
            last_planned = last_planned.max(at);
            due.push(Due {
                at,
                seq,
                scenario: 3,
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
            let scenario = args.scenario.pick(&mut rng, &shape);
            let index = SCENARIOS.iter().position(|s| *s == scenario).unwrap_or(3);
            let tenant = format!("tenant-{:04}", started % u64::from(args.tenants.max(1)));
            let session = format!("{}-{started}", format!("{scenario:?}").to_lowercase());
            let uploads = scenario.session(&mut rng, &tenant, &session, &shape);
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

/// A progress bar on stderr counting uploads (hidden when `visible` is false); also what
/// `settle demo` draws.
pub fn progress_bar(visible: bool, len: u64) -> ProgressBar {
    if !visible {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr());
    if let Ok(style) = ProgressStyle::with_template(
        "{spinner} [{elapsed_precise}] [{bar:40}] {pos}/{len} uploads · {msg}",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.enable_steady_tick(Duration::from_millis(100));
    bar
}

// ---------------------------------------------------------------------------------------------
// Kafka tooling

/// Bound on one admin or metadata request.
const ADMIN_TIMEOUT: Duration = Duration::from_secs(30);

/// Creates `topics` (`(name, partitions)`, replication factor 1) on the cluster of `kafka`
/// (its `properties` apply, so SASL/TLS work). A topic that exists already is left as it is.
///
/// Errors: the cluster cannot be reached within 30 s, or refuses a creation for another
/// reason than "already exists".
pub async fn create_topics(kafka: &KafkaConfig, topics: &[(&str, i32)]) -> anyhow::Result<()> {
    let admin: AdminClient<LogContext> = kafka
        .client_config(Role::Producer)
        .create_with_context(LogContext)
        .context("cannot create the Kafka admin client")?;
    let new: Vec<NewTopic<'_>> = topics
        .iter()
        .map(|(name, n)| NewTopic::new(name, *n, TopicReplication::Fixed(1)))
        .collect();
    let options = AdminOptions::new().operation_timeout(Some(ADMIN_TIMEOUT));
    let results = tokio::time::timeout(ADMIN_TIMEOUT, admin.create_topics(&new, &options))
        .await
        .context("CreateTopics timed out")?
        .context("CreateTopics")?;
    for result in results {
        match result {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((name, code)) => return Err(anyhow!("cannot create topic {name}: {code}")),
        }
    }
    Ok(())
}

/// One record to produce with [`produce_all`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutRecord {
    /// Record key (`tenant/session` for an upload).
    pub key: Option<Vec<u8>>,
    /// Record value.
    pub payload: Vec<u8>,
    /// Record timestamp (CreateTime, ms since the epoch); `None`: the producer's clock.
    pub timestamp_ms: Option<i64>,
}

/// Where [`produce_all`] put a record, from its delivery report.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Delivered {
    /// Partition.
    pub partition: i32,
    /// Offset in the partition.
    pub offset: i64,
    /// Record timestamp as reported (ms; `LogAppendTime` where the topic uses it).
    pub timestamp_ms: Option<i64>,
}

/// Produces `records` to `topic` in order with one idempotent producer (the settle producer
/// settings of `kafka`, so a key always lands in the partition the default partitioner
/// picks) and waits for every delivery report. Returns one [`Delivered`] per record, in
/// input order.
///
/// Errors: the producer cannot be created, or a delivery failed (message in the error).
pub async fn produce_all(
    kafka: &KafkaConfig,
    topic: &str,
    records: &[OutRecord],
) -> anyhow::Result<Vec<Delivered>> {
    let producer: FutureProducer<LogContext> = kafka
        .client_config(Role::Producer)
        .create_with_context(LogContext)
        .context("cannot create the Kafka producer")?;
    let mut pending = Vec::with_capacity(records.len());
    for r in records {
        let mut record = FutureRecord::<[u8], [u8]>::to(topic).payload(r.payload.as_slice());
        if let Some(key) = &r.key {
            record = record.key(key.as_slice());
        }
        if let Some(ts) = r.timestamp_ms {
            record = record.timestamp(ts);
        }
        pending.push(producer.send(record, ADMIN_TIMEOUT));
    }
    let mut out = Vec::with_capacity(records.len());
    for (i, delivery) in futures::future::join_all(pending)
        .await
        .into_iter()
        .enumerate()
    {
        let d = delivery.map_err(|(e, _)| anyhow!("delivery of record {i} to {topic}: {e}"))?;
        out.push(Delivered {
            partition: d.partition,
            offset: d.offset,
            timestamp_ms: d.timestamp.to_millis(),
        });
    }
    Ok(out)
}

/// One record read back by [`read_topic`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TopicRecord {
    /// Partition.
    pub partition: i32,
    /// Offset in the partition.
    pub offset: i64,
    /// Record key.
    pub key: Option<Vec<u8>>,
    /// Record value (empty when null).
    pub payload: Vec<u8>,
    /// Record timestamp (ms since the epoch; -1 when the record has none).
    pub timestamp_ms: i64,
    /// Headers in record order (a null value reads as empty).
    pub headers: Vec<(String, Vec<u8>)>,
}

impl TopicRecord {
    /// The value of the first header named `name`, as UTF-8 (lossy).
    pub fn header(&self, name: &str) -> Option<String> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
    }
}

/// Reads `topic` from the beginning (no consumer group, nothing committed) until every
/// partition reached its end and at least `min_records` were read, or until `timeout`.
/// Records come partition by partition in offset order.
///
/// Errors: the topic's metadata cannot be read (missing topic, cluster unreachable), or a
/// consumer error other than partition EOF.
pub async fn read_topic(
    kafka: &KafkaConfig,
    topic: &str,
    min_records: usize,
    timeout: Duration,
) -> anyhow::Result<Vec<TopicRecord>> {
    let config = kafka.clone();
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || read_topic_blocking(&config, &topic, min_records, timeout))
        .await
        .context("read_topic task")?
}

fn read_topic_blocking(
    kafka: &KafkaConfig,
    topic: &str,
    min_records: usize,
    timeout: Duration,
) -> anyhow::Result<Vec<TopicRecord>> {
    // The group id of `kafka` is set but never joined: partitions are assigned, not subscribed.
    let consumer: BaseConsumer<LogContext> = kafka
        .client_config(Role::Consumer)
        .create_with_context(LogContext)
        .context("cannot create a reader")?;
    let partitions = partition_count(&consumer, topic)?;
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition_offset(topic, p, Offset::Beginning)?;
    }
    consumer.assign(&tpl)?;
    let deadline = Instant::now() + timeout;
    let mut at_end = BTreeSet::new();
    let mut records = Vec::new();
    while Instant::now() < deadline {
        if at_end.len() == partitions as usize && records.len() >= min_records {
            break;
        }
        match consumer.poll(Duration::from_millis(100)) {
            None => {}
            Some(Ok(m)) => {
                at_end.remove(&m.partition());
                records.push(TopicRecord {
                    partition: m.partition(),
                    offset: m.offset(),
                    key: m.key().map(<[u8]>::to_vec),
                    payload: m.payload().map(<[u8]>::to_vec).unwrap_or_default(),
                    timestamp_ms: m.timestamp().to_millis().unwrap_or(-1),
                    headers: m
                        .headers()
                        .map(|h| {
                            h.iter()
                                .map(|h| (h.key.to_owned(), h.value.unwrap_or_default().to_vec()))
                                .collect()
                        })
                        .unwrap_or_default(),
                });
            }
            Some(Err(KafkaError::PartitionEOF(p))) => {
                at_end.insert(p);
            }
            Some(Err(e)) => return Err(anyhow!("reading {topic}: {e}")),
        }
    }
    records.sort_by_key(|r| (r.partition, r.offset));
    Ok(records)
}

/// The committed offsets of consumer group `kafka.group-id` for partitions `0..partitions` of
/// `topic` (`None`: nothing committed).
///
/// Errors: the group coordinator cannot be reached within 30 s.
pub async fn committed_offsets(
    kafka: &KafkaConfig,
    topic: &str,
    partitions: i32,
) -> anyhow::Result<Vec<Option<i64>>> {
    let kafka = kafka.clone();
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer<LogContext> = kafka
            .client_config(Role::Consumer)
            .create_with_context(LogContext)?;
        let mut tpl = TopicPartitionList::new();
        for p in 0..partitions {
            tpl.add_partition(&topic, p);
        }
        let committed = consumer
            .committed_offsets(tpl, ADMIN_TIMEOUT)
            .context("OffsetFetch")?;
        Ok(committed
            .elements()
            .iter()
            .map(|e| match e.offset() {
                Offset::Offset(o) => Some(o),
                _ => None,
            })
            .collect())
    })
    .await
    .context("committed_offsets task")?
}

/// Number of partitions of `topic`.
///
/// Errors: metadata cannot be fetched, or the broker reports an error for the topic.
pub fn partition_count<X: ConsumerContext, C: Consumer<X>>(
    consumer: &C,
    topic: &str,
) -> anyhow::Result<i32> {
    let metadata = consumer
        .fetch_metadata(Some(topic), ADMIN_TIMEOUT)
        .with_context(|| format!("metadata of {topic}"))?;
    let t = metadata
        .topics()
        .iter()
        .find(|t| t.name() == topic)
        .ok_or_else(|| anyhow!("topic {topic} not in the metadata"))?;
    if let Some(e) = t.error() {
        return Err(anyhow!("topic {topic}: {:?}", RDKafkaErrorCode::from(e)));
    }
    Ok(t.partitions().len() as i32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sessions_have_the_demo_shapes() {
        let shape = Shape::default();
        let mut rng = StdRng::seed_from_u64(1);
        let burst = Scenario::Burst.session(&mut rng, "ci", "b1", &shape);
        assert_eq!(burst.len(), 700);
        assert!(burst.iter().all(|u| u.at_ms < 1_500 && u.key == "ci/b1"));
        assert!(burst.windows(2).all(|w| w[0].at_ms <= w[1].at_ms));
        let split = Scenario::Split.session(&mut rng, "co", "s1", &shape);
        assert_eq!(
            split.iter().map(|u| u.at_ms).collect::<Vec<_>>(),
            vec![0, 300]
        );
        assert!(split[1].json.contains(r#""part":{"index":2,"count":2}"#));
        let trickle = Scenario::Trickle.session(&mut rng, "co", "t1", &shape);
        assert_eq!(trickle.len(), 5);
        assert!(trickle
            .windows(2)
            .all(|w| (2_000..3_000).contains(&(w[1].at_ms - w[0].at_ms))));
        let tenants = Scenario::Tenants.session(&mut rng, "t-1", "s", &shape);
        assert_eq!(tenants.len(), 10);
        assert!(tenants.iter().all(|u| u.at_ms < 600));
        // Every upload is a valid record for its key.
        for u in burst.iter().chain(&split).chain(&trickle).chain(&tenants) {
            assert!(
                crate::codec::decode_upload(Some(u.key.as_bytes()), u.json.as_bytes(), 0, 0)
                    .is_ok(),
                "{u:?}"
            );
        }
    }

    #[test]
    fn same_seed_same_schedule() {
        let shape = Shape::default();
        let plan = |seed| {
            let mut rng = StdRng::seed_from_u64(seed);
            (0..20)
                .map(|i| Scenario::Mix.session(&mut rng, "t", &format!("s{i}"), &shape))
                .collect::<Vec<_>>()
        };
        assert_eq!(plan(3), plan(3));
        assert_ne!(plan(3), plan(4));
    }

    #[test]
    fn mix_splits_uploads_as_documented() {
        let shape = Shape::default();
        let mut rng = StdRng::seed_from_u64(9);
        let mut uploads = [0.0_f64; 4];
        for _ in 0..20_000 {
            let s = Scenario::Mix.pick(&mut rng, &shape);
            let i = SCENARIOS.iter().position(|x| *x == s).unwrap();
            uploads[i] += s.uploads_per_session(&shape);
        }
        let total: f64 = uploads.iter().sum();
        for (i, share) in MIX_UPLOAD_SHARE.iter().enumerate() {
            let got = uploads[i] / total;
            assert!((got - share).abs() < 0.05, "{:?}: {got}", SCENARIOS[i]);
        }
        let mean = Scenario::Mix.uploads_per_session(&shape);
        assert!((total / 20_000.0 - mean).abs() / mean < 0.1, "{mean}");
    }
}
