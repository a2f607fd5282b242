//! `settle run`: the one place that assembles the service from the config, for every
//! transport. It builds the transport's source and sink (`transport::kafka` or
//! `transport::nats`, chosen by `transport`), the runtime with its stores, tier router and
//! tier-events task (`crate::runtime`), the liveness lease (Kafka: two thirds of
//! `session.timeout.ms`), the admin server (`crate::admin`) and the progress watch, then
//! runs until SIGINT/SIGTERM ([`signals`]: on a thread of their own, with the hard stop
//! `runtime.shutdown-deadline` + [`SHUTDOWN_GRACE`] after the stop began) and turns how it
//! ended into the exit status. On Kafka in exactly-once mode it first checks that the
//! cluster supports transactions ([`kafka::check_transactions`]) and refuses to start
//! otherwise.
//!
//! One code path: the transport decides only how the source and sink are made and whether
//! there is a lease; everything after that ([`run_until`]'s `serve`) is the same for every
//! transport. Nothing below this module starts a runtime or an admin server.
//!
//! Exit status of `settle run` (`main` prints the error): 0 after a graceful stop, whose last
//! log line is `settle run stopped` (partitions ended, how many flushed their outbox); 1 when
//! the config is invalid, a client or the admin listener cannot be set up, the cluster has
//! no transactions in exactly-once mode, the source failed, the lease expired (the process
//! was paused longer than it may own partitions), a partition failed (the message names the
//! first one and why), or the stop outlived its hard stop; 130 on a second signal.

pub mod assignments;
pub mod signals;

pub use signals::{shutdown_on_signals, SignalThread};

use crate::admin::{AdminServer, WhatIf, WhatIfFactory};
use crate::config::kafka::ProcessingGuarantee;
use crate::config::{Config, Transport};
use crate::engine::Engine;
use crate::metrics::Metrics;
use crate::runtime::{
    progress, ActionLog, Clock as _, PartitionExit, RunSummary, Runtime, RuntimeOptions,
    SystemClock,
};
use crate::transport::kafka::{self, KafkaSink, KafkaSource};
use crate::transport::nats::{self, NatsSink, NatsSource};
use crate::transport::{ActionChannel, OverrideStore, Sink, Source, TierCounts};
use anyhow::Context as _;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// `settle run`: loads the config (`file`, then `SETTLE_*` variables), applies the
/// `--transport` override, logs what it starts with, makes the What-if view's sweep runner
/// with `whatif` from that config (`main` passes the tools' one: they sit above this
/// module), and runs [`run_until`] on a new tokio
/// runtime until SIGINT/SIGTERM (a second signal exits at once; a stop still running
/// `runtime.shutdown-deadline` + [`SHUTDOWN_GRACE`] after it began ends the process with
/// status 1: [`signals`]).
///
/// Errors (exit status 1, module docs): an invalid config, anything [`run_until`] returns,
/// and a failed partition (the first one, with its reason).
pub fn run(
    file: Option<&Path>,
    transport: Option<Transport>,
    whatif: Option<WhatIfFactory>,
) -> anyhow::Result<()> {
    let mut config = Config::load(file)?;
    if let Some(t) = transport {
        config.transport = t;
        config.validate()?;
    }
    log_start(&config, file);
    // Before the runtime: its signal thread must not depend on it (module docs).
    let shutdown = CancellationToken::new();
    let _signals = shutdown_on_signals(
        shutdown.clone(),
        Some(config.runtime.shutdown_deadline + SHUTDOWN_GRACE),
    )
    .context("cannot install signal handlers")?;
    let (partitions, flushed) = crate::runtime::block_on(async {
        let summary = run_until(&config, shutdown, whatif.map(|make| make(&config))).await?;
        if let Some((p, reason)) = summary.failed().first() {
            anyhow::bail!("partition {p} failed: {reason}");
        }
        let flushed = summary
            .partitions
            .values()
            .filter(|e| matches!(e, PartitionExit::Stopped { flushed: true }))
            .count();
        anyhow::Ok((summary.partitions.len(), flushed))
    })??;
    // The last line of a clean stop: every partition task has ended, the stores closed, and
    // the runtime is gone with every broker client (a client's own thread could otherwise
    // still log a connection error after this line).
    tracing::info!(partitions, flushed, "settle run stopped");
    Ok(())
}

/// How long past `runtime.shutdown-deadline` a stop may take before the hard stop of
/// [`signals`] ends the process (a client library blocked in its close, e.g. librdkafka
/// waiting for a group coordinator that stopped answering, or a blocked runtime).
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);

/// How long one try of the exactly-once start-up check waits for a broker's answer.
const TRANSACTIONS_CHECK_WAIT: Duration = Duration::from_secs(10);

/// Exactly-once mode: [`kafka::check_transactions`] until a broker answered, retrying every
/// second while none does (warned once), or until `shutdown`. `Ok(false)`: stopped first.
///
/// Errors: the cluster lacks transactions (the message says what to do).
async fn check_transactions(
    k: &kafka::KafkaConfig,
    shutdown: &CancellationToken,
) -> anyhow::Result<bool> {
    let mut warned = false;
    loop {
        let config = k.clone();
        let tried = tokio::task::spawn_blocking(move || {
            kafka::check_transactions(&config, TRANSACTIONS_CHECK_WAIT)
        });
        let tried = tokio::select! {
            () = shutdown.cancelled() => return Ok(false),
            t = tried => t.context("the transactions check task failed")?,
        };
        match tried {
            Ok(checked) => {
                tracing::info!(
                    took_ms = checked.took.as_millis() as u64,
                    brokers = ?checked.brokers,
                    "kafka: the cluster supports transactions (exactly-once)"
                );
                return Ok(true);
            }
            Err(e) if e.is_retryable() => {
                if !warned {
                    warned = true;
                    tracing::warn!(error = %e, "kafka: waiting for the cluster to check that it supports transactions (exactly-once)");
                }
                tokio::select! {
                    () = shutdown.cancelled() => return Ok(false),
                    () = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// Runs settle on the transport `config.transport` until `shutdown` is cancelled: the
/// partition runtime ([`Runtime::run`]) over that transport's source and sink, stores under
/// `store.data-dir`, the debounce policies of `[debounce]`, each emission to its tenant's
/// tier topic and tier changes to `tiers.events-topic` (one router for the process), the
/// admin endpoints of `[admin]` until the runtime has stopped, their What-if view's sweeps
/// through `whatif` (none: the view only says how to run `settle tune`). Must run inside a
/// tokio runtime.
///
/// * Kafka: the consumer group of `[kafka]` and an idempotent producer (exactly-once: the
///   transactions commit that group's offsets, once the cluster was seen to support them);
///   a warning per configured topic the cluster lacks; the liveness lease.
/// * NATS: the partitions `[nats]` assigns to this instance, JetStream publishes with room
///   for a publish window per owned partition.
///
/// Errors: an invalid `[kafka]` or `[nats]` section or tier subject (the message names the
/// key), an `[admin]` that may not start (operator actions on a non-loopback
/// `admin.listen` without a token, unreadable tokens or TLS files), clients the library rejects, an unreadable credentials file, a Kafka cluster
/// without transactions in exactly-once mode, an `admin.listen` address that cannot be
/// bound, a fatal source error, an expired lease. Partitions that failed are in the summary.
pub async fn run_until(
    config: &Config,
    shutdown: CancellationToken,
    whatif: Option<Arc<dyn WhatIf>>,
) -> anyhow::Result<RunSummary> {
    // Before any client connects: a refused admin setup (actions on a public address
    // without a token, an unreadable tokens or TLS file) stops the start here.
    crate::admin::preflight(&config.admin)?;
    let mut options = RuntimeOptions::from_config(config);
    match config.transport {
        Transport::Kafka => {
            let k = &config.kafka;
            k.validate()?;
            if k.processing_guarantee == ProcessingGuarantee::ExactlyOnce
                && !check_transactions(k, &shutdown).await?
            {
                return Ok(RunSummary::default());
            }
            let sink = KafkaSink::new(k)?;
            let source = KafkaSource::new(k)?;
            sink.attach_group(&source);
            kafka::warn_missing_topics(k, &config.tiers).await;
            options.lease = Some(k.lease());
            let counts = kafka::TierCountsTopic::new(k)?
                .map(|c| (c as Arc<dyn TierCounts>, k.instance_id()));
            let actions = kafka::KafkaActions::new(k)?;
            // In the background: a broker slow to create topics must not delay the start.
            let creating = actions.clone();
            tokio::spawn(async move { creating.ensure_audit_topic().await });
            let log = ActionLog::new(Some(kafka::KafkaActions::audit_topic(k)), &k.instance_id());
            let actions = (Arc::new(actions) as Arc<dyn ActionChannel>, log);
            let overrides = kafka::OverridesTopic::new(k)?;
            // In the background too; the feed finds the topic once it exists.
            let creating = Arc::clone(&overrides);
            tokio::spawn(async move { creating.ensure_topic().await });
            let overrides = Some(overrides as Arc<dyn OverrideStore>);
            let shared = Shared {
                counts,
                actions,
                overrides,
                beside: None,
                whatif,
            };
            serve(config, options, source, sink, shared, shutdown).await
        }
        Transport::Nats => {
            let n = &config.nats;
            n.validate()?;
            n.check_output_subjects(&config.tiers)?;
            let client = nats::connect(n).await?;
            let partitions = n.owned_partitions().len().max(1);
            let in_flight = options.publish_window.max(1) * partitions * 2;
            let js = nats::jetstream(client, in_flight);
            // The changelog's appends (a message per store change, every partition) on a
            // connection of their own, and the input's fetches and acks on another (below):
            // one NATS connection is one handler task and one socket, and on a shared one
            // each partition's fetch waited behind everyone's appends (issue 33's soak).
            // At least `APPEND_WINDOW` acks in flight per partition (its docs).
            let changelog_js = nats::jetstream(
                nats::connect(n).await?,
                in_flight.max(nats::changelog::APPEND_WINDOW * partitions),
            );
            let sink = NatsSink::with_changelog_on(js.clone(), changelog_js, n);
            let counts = nats::TierCountsBucket::new(js.clone(), n)
                .map(|c| (Arc::new(c) as Arc<dyn TierCounts>, n.instance_name()));
            let actions = nats::NatsActions::new(js.clone(), n);
            if let Err(e) = actions.ensure_audit_stream().await {
                tracing::warn!(error = %e, "nats: cannot create the audit stream; operator actions are applied but their outcomes may not be readable by other instances");
            }
            let log = ActionLog::new(Some(actions.subject().to_owned()), &n.instance_name());
            let actions = (Arc::new(actions) as Arc<dyn ActionChannel>, log);
            let heartbeat: Option<Beside> = match nats::TierCountsBucket::new(js.clone(), n) {
                Some(bucket) => {
                    let n = n.clone();
                    Some(Box::new(move |metrics, stop| {
                        Box::pin(assignments::watch(bucket, n, metrics, stop))
                    }))
                }
                None => {
                    tracing::warn!("nats.tier-counts-bucket is off: the instances do not exchange their assignments, so partitions nobody owns (a scale-down that left nats.instances too high) go unnoticed");
                    None
                }
            };
            let overrides = nats::OverridesBucket::new(js.clone(), n)
                .map(|b| Arc::new(b) as Arc<dyn OverrideStore>);
            let input_js = nats::jetstream(nats::connect(n).await?, 1);
            let source = NatsSource::new(input_js, n, &config.tiers);
            let shared = Shared {
                counts,
                actions,
                overrides,
                beside: heartbeat,
                whatif,
            };
            serve(config, options, source, sink, shared, shutdown).await
        }
    }
}

/// A task of a transport that runs beside the runtime for as long as it runs, given the
/// runtime's metrics and a token cancelled when it stops (NATS: [`assignments::watch`]).
type Beside =
    Box<dyn FnOnce(Metrics, CancellationToken) -> futures::future::BoxFuture<'static, ()> + Send>;

/// What the instances of a deployment share through the broker besides the input and
/// output: tier counts (with this instance's name), the action channel with this
/// instance's action log, the tenant overrides; the transport's task beside the runtime;
/// and the What-if view's sweep runner.
struct Shared {
    counts: Option<(Arc<dyn TierCounts>, String)>,
    actions: (Arc<dyn ActionChannel>, ActionLog),
    overrides: Option<Arc<dyn OverrideStore>>,
    beside: Option<Beside>,
    /// The What-if view's sweeps (the admin server's [`WhatIf`]).
    whatif: Option<Arc<dyn WhatIf>>,
}

/// What every transport shares: the runtime over `source` and `sink`, the admin server, the
/// progress watch and the transport's `beside` task, until `shutdown`.
async fn serve<S: Source, K: Sink>(
    config: &Config,
    options: RuntimeOptions,
    source: S,
    sink: K,
    shared: Shared,
    shutdown: CancellationToken,
) -> anyhow::Result<RunSummary> {
    let Shared {
        counts,
        actions: (channel, log),
        overrides,
        beside,
        whatif,
    } = shared;
    let mut runtime = Runtime::new(
        Engine::new(config.policy_table()),
        sink,
        SystemClock,
        options,
    )?
    .with_actions(log.clone())
    .with_shadows(config.shadow_specs());
    if let Some(store) = overrides {
        tracing::info!(store = store.name(), "tenant overrides from the broker");
        runtime = runtime.with_overrides(store);
    }
    if let Some((counts, instance)) = counts {
        let tiers = &config.tiers;
        if tiers.share_interval * 4 > tiers.period {
            tracing::warn!(
                share_interval_ms = tiers.share_interval.as_millis() as u64,
                period_ms = tiers.period.as_millis() as u64,
                "tiers.share-interval is more than a quarter of tiers.period: the other instances' counts are too old to catch a noisy tenant in time; shorten share-interval or lengthen period"
            );
        }
        tracing::info!(log = counts.name(), %instance, every_ms = config.tiers.share_interval.as_millis() as u64, "sharing tier counts with the other instances");
        runtime = runtime.with_tier_counts(counts, &instance);
    }
    let tail = tokio::spawn(tail_audit(Arc::clone(&channel), log));
    let admin = AdminServer::start_for(&config.admin, &runtime, Some(channel), whatif).await?;
    let watch = tokio::spawn(progress::watch(runtime.status(), shutdown.clone()));
    let beside = beside.map(|task| tokio::spawn(task(runtime.metrics(), shutdown.child_token())));
    let drill = signals::drill_block_workers(runtime.status());
    let summary = runtime.run(source, shutdown).await;
    watch.abort();
    if let Some(beside) = beside {
        beside.abort();
    }
    tail.abort();
    if let Some(drill) = drill {
        drill.abort();
    }
    if let Some(admin) = admin {
        admin.stop().await;
    }
    Ok(summary?)
}

/// How far back an instance reads the audit log at start (ms): outcomes of requests
/// accepted by other instances, or applied by a partition's previous owner, in that window
/// are known here (`runtime::actions`).
const AUDIT_LOOKBACK_MS: i64 = 24 * 3_600_000;

/// Reads the deployment's audit records into `log` for as long as the run lasts (aborted
/// at its end), reading again after a backoff when the broker is away.
async fn tail_audit(channel: Arc<dyn ActionChannel>, log: ActionLog) {
    let mut backoff = crate::transport::Backoff::new(std::time::Duration::from_secs(10));
    loop {
        let since = SystemClock.now_ms() - AUDIT_LOOKBACK_MS;
        let feed = log.clone();
        let each = Box::new(move |payload: &[u8]| {
            if let Ok(record) = crate::codec::action::AuditRecord::decode(payload) {
                feed.add(record);
            }
        });
        if let Err(e) = channel.tail_audit(since, each).await {
            tracing::debug!(error = %e, "reading the audit log; again after a backoff");
        }
        tokio::time::sleep(backoff.next_delay()).await;
    }
}

/// The debounce rules a run starts with (`[debounce]` and its tenant overrides), as one log
/// line: what the partitions apply to every upload from now on (SEMANTICS §7). Each
/// partition then says how many of its pending rounds were timed under other rules. One
/// more line per `[[shadow]]` policy (SEMANTICS §8).
pub fn log_rules(config: &Config) {
    let table = config.policy_table();
    tracing::info!(
        rules = %table,
        tenant_overrides = table.tenants.len(),
        "debounce rules in force"
    );
    for s in config.shadow_specs() {
        tracing::info!(
            shadow = %s.name,
            rules = %s.policy,
            max_sessions = s.max_sessions,
            "shadow policy runs beside the live one in every partition, emitting nothing (SEMANTICS §8; GET /v1/shadow)"
        );
    }
}

/// The start line of `settle run`: the config file and what it says of the transport.
fn log_start(config: &Config, file: Option<&Path>) {
    log_rules(config);
    let shown = file.map_or("(defaults)".into(), |p| p.display().to_string());
    let data_dir = config.store.data_dir.display();
    match config.transport {
        Transport::Kafka => {
            let k = &config.kafka;
            tracing::info!(
                config = %shown,
                bootstrap = %k.bootstrap_servers,
                group = %k.group_id,
                input = %k.input_topic,
                changelog = k.changelog().as_deref().unwrap_or("(off)"),
                guarantee = ?k.processing_guarantee,
                instance = %k.instance_id(),
                data_dir = %data_dir,
                "settle run starting on kafka"
            );
        }
        Transport::Nats => {
            let n = &config.nats;
            tracing::info!(
                config = %shown,
                servers = %n.servers_shown(),
                stream = %n.input_stream,
                changelog = n.changelog().as_deref().unwrap_or("(off)"),
                tier_counts = n.tier_counts().as_deref().unwrap_or("(off)"),
                instance = n.instance,
                instances = n.instances,
                partitions = ?n.owned_partitions(),
                data_dir = %data_dir,
                "settle run starting on nats"
            );
        }
    }
}
