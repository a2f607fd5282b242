//! Prometheus metrics of one runtime: every metric name and help text of settle is defined in
//! this module (STYLE §7), and served by the admin endpoint `/metrics` (`crate::admin`).
//!
//! # Registry
//!
//! One [`prometheus::Registry`] per [`Metrics`], and one [`Metrics`] per
//! `runtime::Runtime` (not the process-wide default registry), so tests can run several
//! runtimes in one process and read each one's figures.
//!
//! # Labels
//!
//! Bounded only: `topic`, `partition`, `tier`, `trigger`, `policy`, `reason` (a
//! `codec::DecodeError::reason` code or a `tiers::ChangeReason`), `state` (partition life
//! cycle), `version`, `change` (a tenant override change), `shadow` (a `[[shadow]]` name, at
//! most `engine::shadow::MAX_SHADOWS`, or `live`), `class` (a tenant class: `default`, `own`) and `quantile` (`0.5`, `0.99`). Never a tenant or session id:
//! a tenant's figures are on the admin endpoint `/v1/tenants/{tenant}`.
//!
//! # Where each figure comes from
//!
//! * Counters and histograms are recorded where the event happens, through label handles
//!   resolved once per partition task ([`PartitionMetrics`]) or per outbox publisher
//!   ([`PublishMetrics`]), so the hot path costs an atomic add, not a label lookup:
//!   consumed and rejected records and the store write latency in the partition task;
//!   emissions, lateness, time-to-ready and failed publishes in the publisher, when the broker
//!   acknowledged the record (`emitted_at` = the wall clock of the successful attempt).
//! * Gauges (pending rounds, outbox size, consumer lag, partition clock, partitions by state,
//!   restore) and the tier figures are refreshed at scrape time ([`Metrics::refresh`]) from
//!   what the runtime hands over: one [`PartitionGauges`] per partition of its status board
//!   and the tier router's counters. So are the shadow policies' figures
//!   ([`Metrics::refresh_shadows`], SEMANTICS §8): the partitions' figures added up, which
//!   start again when a partition is assigned (hence gauges, not counters). This module
//!   knows nothing of the runtime.
//!
//! Units: seconds for durations (Prometheus convention), records for lag, counts otherwise.

use crate::engine::{Emission, Figures, Millis, PolicyName, TenantClass, Trigger};
use crate::tiers::{ChangeReason, TierCounters};
use prometheus::core::Collector;
use prometheus::{
    Gauge, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry,
};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

/// Counter `{topic, partition}`: input records applied to the partition store (offset
/// advanced): uploads and the bad records that were dead-lettered.
pub const UPLOADS_CONSUMED: &str = "settle_uploads_consumed_total";
/// Counter `{topic, partition, reason}`: input records dead-lettered, by
/// `codec::DecodeError::reason` code (SEMANTICS §2).
pub const UPLOADS_REJECTED: &str = "settle_uploads_rejected_total";
/// Counter `{topic, partition}`: input records the transport read and dropped because they lie
/// below the partition's next offset (already applied: read again while the fetcher was sent
/// back, or redelivered); each drop is logged by the transport too.
pub const INPUT_SKIPPED: &str = "settle_input_skipped_total";
/// Counter `{trigger, tier, policy}`: emissions acknowledged by the broker (SEMANTICS §2, §4).
pub const EMISSIONS: &str = "settle_emissions_total";
/// Counter `{tier, policy}`: uploads coalesced into acknowledged emissions (the `uploads`
/// field summed). Coalescing per tier and policy = this / [`EMISSIONS`] summed over
/// triggers (`sum by (tier, policy) (rate(...))` of both).
pub const EMISSION_UPLOADS: &str = "settle_emission_uploads_total";
/// Gauge: uploads per acknowledged emission since the runtime started.
pub const COALESCING_RATIO: &str = "settle_coalescing_ratio";
/// Counter `{tier}`: publish attempts that failed (each is retried; nothing is dropped).
pub const PUBLISH_FAILURES: &str = "settle_publish_failures_total";
/// Histogram `{trigger}`, seconds: `emitted_at - due_at` of acknowledged emissions
/// (SEMANTICS §3 lateness).
pub const EMISSION_LATENESS: &str = "settle_emission_lateness_seconds";
/// Histogram `{tier, policy}`, seconds: `emitted_at - last_upload_at` of acknowledged
/// emissions (the figure `settle tune` sweeps, live).
pub const TIME_TO_READY: &str = "settle_time_to_ready_seconds";
/// Histogram `{topic, partition}`, seconds: one store write batch (state, timers, outbox,
/// offset) committed.
pub const STORE_WRITE: &str = "settle_store_write_seconds";
/// Histogram: seconds from a changelog append to its acknowledgement as the partition task
/// saw it, per topic and partition (on NATS an emission is published only after the append
/// that holds it is acknowledged: part of its lateness).
pub const CHANGELOG_APPEND: &str = "settle_changelog_append_seconds";
/// Gauge `{topic, partition}`: keys with an open round.
pub const PENDING_ROUNDS: &str = "settle_pending_rounds";
/// Gauge `{topic, partition}`: owed emissions not yet acknowledged by the broker.
pub const OUTBOX_SIZE: &str = "settle_outbox_size";
/// Gauge `{topic, partition}`, records: records the broker holds after the last one applied
/// (only where the transport knows it).
pub const CONSUMER_LAG: &str = "settle_consumer_lag_records";
/// Gauge `{topic, partition}`, seconds: wall clock minus partition time (SEMANTICS §3).
pub const CLOCK_BEHIND: &str = "settle_partition_clock_behind_seconds";
/// Gauge `{topic, partition}`, records: changelog records still to replay before the
/// partition processes input (0: nothing to restore), an estimate from the changelog's end
/// offset.
pub const RESTORE_REMAINING: &str = "settle_restore_remaining_records";
/// Counter `{topic, partition}`: times a partition of this process stopped because another
/// process wrote its changelog after this one (NATS: the changelog is the fence, SEMANTICS §6
/// "Single writer"); the partition publishes, appends and acks nothing more here.
pub const PARTITIONS_FENCED: &str = "settle_partitions_fenced_total";
/// Counter `{kind,result}`: operator actions applied by this process's partitions (SEMANTICS
/// §7): kind `flush` or `cancel`; result as in the action's outcome (`flushed`,
/// `cancelled`, `would_flush`, `would_cancel`, `no_open_round`, `no_state`, `done`,
/// `would_do`, `duplicate`).
pub const ACTIONS_APPLIED: &str = "settle_actions_applied_total";
/// Gauge `{state}`: partitions of this process by life-cycle state.
pub const PARTITIONS: &str = "settle_partitions";
/// Counter `{reason}`: tier changes (SEMANTICS §5): `rate_exceeded` (demotion) or
/// `recovered` (promotion).
pub const TIER_CHANGES: &str = "settle_tier_changes_total";
/// Gauge: tenants the tier router tracks (an emission in the last period, or demoted).
pub const TENANTS_TRACKED: &str = "settle_tenants_tracked";
/// Gauge: tenants demoted automatically now.
pub const TENANTS_DEMOTED: &str = "settle_tenants_demoted";
/// Gauge `{version}`: always 1; the version of the running binary.
pub const BUILD_INFO: &str = "settle_build_info";
/// Gauge: tenant overrides in force on this instance now (SEMANTICS §7: set, not removed,
/// not expired).
pub const OVERRIDES: &str = "settle_overrides";
/// Counter `{change}`: tenant override changes seen by this instance (SEMANTICS §7): `set`
/// (a new or updated override applied), `removed` (deleted through the API), `expired`
/// (its expiry passed), `refused` (a request refused: stale version, invalid override).
pub const OVERRIDE_CHANGES: &str = "settle_override_changes_total";

/// Gauge `{shadow, tier, class}`: emissions of the live policy (`shadow="live"`, `manual` ones
/// left out) and would-be emissions of each `[[shadow]]` policy since
/// [`SHADOW_SINCE`] (SEMANTICS §8). `class` is the tenant class (`engine::TenantClass`):
/// `default` (the live policy times it with `[debounce]`) or `own` (a rule of its own).
pub const SHADOW_EMISSIONS: &str = "settle_shadow_emissions";
/// Gauge `{shadow, tier, class}`: uploads in those emissions (their `uploads` summed).
pub const SHADOW_UPLOADS: &str = "settle_shadow_uploads";
/// Gauge `{shadow, tier, class}`: [`SHADOW_UPLOADS`] / [`SHADOW_EMISSIONS`] (0 before the first).
pub const SHADOW_UPLOADS_PER_EMISSION: &str = "settle_shadow_uploads_per_emission";
/// Gauge `{shadow, tier, class, quantile}`, seconds: time-to-ready `due_at − last_upload_at` of those
/// emissions at quantile `0.5` and `0.99` (as `settle tune` computes it).
pub const SHADOW_TIME_TO_READY: &str = "settle_shadow_time_to_ready_seconds";
/// Gauge `{shadow}`: session keys a shadow policy holds now (its memory, bounded by
/// `runtime.shadow-max-sessions` per partition).
pub const SHADOW_SESSIONS: &str = "settle_shadow_sessions";
/// Gauge `{shadow}`: sessions a shadow policy could not follow within its budget since
/// [`SHADOW_SINCE`] (its figures leave them out).
pub const SHADOW_REFUSED_SESSIONS: &str = "settle_shadow_refused_sessions";
/// Gauge, seconds since the epoch: when the shadow figures start (the earliest assignment of
/// a partition counted); 0 without `[[shadow]]` or before a partition is assigned.
pub const SHADOW_SINCE: &str = "settle_shadow_since_seconds";

/// The `quantile` label values of [`SHADOW_TIME_TO_READY`] and the quantiles they are.
const SHADOW_QUANTILES: [&str; 2] = ["0.5", "0.99"];

/// Every value of the `change` label of [`OVERRIDE_CHANGES`].
pub const OVERRIDE_CHANGE_KINDS: [&str; 4] = ["set", "removed", "expired", "refused"];
/// Counter `{reason}`: admin API requests refused by the credential check (SEMANTICS §7,
/// `crate::admin::auth`): `missing_token`, `bad_token` (401), `forbidden` (a read token on
/// an action), `actions_disabled` (`admin.actions = false`) (403).
pub const ADMIN_REFUSED: &str = "settle_admin_refused_total";

/// Every value of the `reason` label of [`ADMIN_REFUSED`].
const ADMIN_REFUSED_REASONS: [&str; 4] = [
    "missing_token",
    "bad_token",
    "forbidden",
    "actions_disabled",
];
/// Gauge: NATS input partitions no live instance owns, as this instance sees the assignment
/// records in the tier-counts bucket (`nats.heartbeat-interval`): after a scale-down that
/// left `nats.instances` too high, or while an instance is down. 0 elsewhere.
pub const PARTITIONS_UNOWNED: &str = "settle_partitions_unowned";
/// Gauge: live NATS instances whose `nats.instances` differs from this instance's.
pub const INSTANCES_DISAGREEING: &str = "settle_instances_disagreeing";

/// Buckets of [`EMISSION_LATENESS`] (seconds).
const LATENESS_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];
/// Buckets of [`TIME_TO_READY`] (seconds): from `final` (milliseconds) to `max-wait` (hours).
const TIME_TO_READY_BUCKETS: &[f64] = &[
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0,
    1800.0, 3600.0,
];
/// Buckets of [`STORE_WRITE`] (seconds).
const STORE_WRITE_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
];

const TOPIC_PARTITION: &[&str] = &["topic", "partition"];

/// Every value of the `state` label of [`PARTITIONS`] (`PartitionState::as_str`).
const STATES: [&str; 7] = [
    "starting",
    "restoring",
    "catching_up",
    "live",
    "stopping",
    "stopped",
    "failed",
];

/// What the gauges show of one partition, handed to [`Metrics::refresh`] by the runtime
/// (from its status board) at scrape time.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PartitionGauges<'a> {
    /// Input topic (label `topic`).
    pub topic: &'a str,
    /// Partition number (label `partition`).
    pub partition: i32,
    /// Life-cycle state, one of the values of the `state` label of [`PARTITIONS`]
    /// (`starting`, `restoring`, `catching_up`, `live`, `stopping`, `stopped`, `failed`). A
    /// `stopped` partition (revoked or shut down) only counts in [`PARTITIONS`].
    pub state: &'a str,
    /// Keys with an open round ([`PENDING_ROUNDS`]).
    pub pending_rounds: u64,
    /// Owed emissions not yet acknowledged ([`OUTBOX_SIZE`]).
    pub outbox_len: u64,
    /// Changelog records still to replay ([`RESTORE_REMAINING`]).
    pub restore_remaining: u64,
    /// Consumer lag in records, where the transport knows it ([`CONSUMER_LAG`]).
    pub lag: Option<u64>,
    /// Wall clock minus partition time, ms, once the partition clock runs (not while
    /// starting or restoring) ([`CLOCK_BEHIND`]).
    pub clock_behind_ms: Option<Millis>,
}

/// The metrics of one runtime. Cheap to clone (shared).
#[derive(Clone)]
pub struct Metrics {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics")
            .field("names", &self.inner.names)
            .finish_non_exhaustive()
    }
}

struct Inner {
    registry: Registry,
    names: Vec<String>,
    uploads_consumed: IntCounterVec,
    uploads_rejected: IntCounterVec,
    input_skipped: IntCounterVec,
    emissions: IntCounterVec,
    emission_uploads: IntCounterVec,
    coalescing_ratio: Gauge,
    publish_failures: IntCounterVec,
    lateness: HistogramVec,
    time_to_ready: HistogramVec,
    store_write: HistogramVec,
    changelog_append: HistogramVec,
    pending_rounds: IntGaugeVec,
    outbox_size: IntGaugeVec,
    consumer_lag: IntGaugeVec,
    clock_behind: GaugeVec,
    restore_remaining: IntGaugeVec,
    partitions_fenced: IntCounterVec,
    actions_applied: IntCounterVec,
    partitions: IntGaugeVec,
    tier_changes: IntCounterVec,
    tenants_tracked: IntGauge,
    tenants_demoted: IntGauge,
    overrides: IntGauge,
    override_changes: IntCounterVec,
    admin_refused: IntCounterVec,
    partitions_unowned: IntGauge,
    instances_disagreeing: IntGauge,
    shadow_emissions: IntGaugeVec,
    shadow_uploads: IntGaugeVec,
    shadow_uploads_per_emission: GaugeVec,
    shadow_time_to_ready: GaugeVec,
    shadow_sessions: IntGaugeVec,
    shadow_refused: IntGaugeVec,
    shadow_since: Gauge,
    /// Acknowledged emissions and the uploads in them (for [`COALESCING_RATIO`]).
    emitted: AtomicU64,
    coalesced: AtomicU64,
    /// Serializes [`Metrics::refresh`] (it turns totals into counter increments).
    refreshing: Mutex<()>,
}

/// Registers collectors and remembers their names.
struct Builder {
    registry: Registry,
    names: Vec<String>,
}

impl Builder {
    fn add<C: Collector + Clone + 'static>(&mut self, c: C) -> C {
        self.names
            .extend(c.desc().iter().map(|d| d.fq_name.clone()));
        // Invariant: every name below is a valid, distinct metric name and the registry is
        // new, so registration cannot fail (the unit tests build one).
        self.registry
            .register(Box::new(c.clone()))
            .expect("distinct valid metric names");
        c
    }

    fn counter(&mut self, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
        // Invariant: valid name and labels (see `add`).
        self.add(IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric"))
    }

    fn gauge(&mut self, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
        self.add(IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric"))
    }

    fn histogram(&mut self, name: &str, help: &str, labels: &[&str], b: &[f64]) -> HistogramVec {
        let opts = HistogramOpts::new(name, help).buckets(b.to_vec());
        self.add(HistogramVec::new(opts, labels).expect("valid metric"))
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A new registry with every settle metric registered (no samples yet, except
    /// [`BUILD_INFO`] and the zero [`PARTITIONS`] and [`TIER_CHANGES`] series).
    pub fn new() -> Self {
        let mut b = Builder {
            registry: Registry::new(),
            names: Vec::new(),
        };
        let uploads_consumed = b.counter(
            UPLOADS_CONSUMED,
            "Input records applied to the partition store (uploads and dead-lettered bad records).",
            TOPIC_PARTITION,
        );
        let uploads_rejected = b.counter(
            UPLOADS_REJECTED,
            "Input records dead-lettered, by decode failure reason (SEMANTICS §2).",
            &["topic", "partition", "reason"],
        );
        let input_skipped = b.counter(
            INPUT_SKIPPED,
            "Input records read and dropped because they lie below the partition's next offset (already applied).",
            TOPIC_PARTITION,
        );
        let emissions = b.counter(
            EMISSIONS,
            "Session-ready emissions acknowledged by the broker, by trigger, tier and policy.",
            &["trigger", "tier", "policy"],
        );
        let emission_uploads = b.counter(
            EMISSION_UPLOADS,
            "Uploads coalesced into acknowledged emissions (sum of their uploads field).",
            &["tier", "policy"],
        );
        // Invariant: valid name (see `Builder::add`).
        let coalescing_ratio = b.add(
            Gauge::new(
                COALESCING_RATIO,
                "Uploads per acknowledged emission since the runtime started (0 before the first).",
            )
            .expect("valid metric"),
        );
        let publish_failures = b.counter(
            PUBLISH_FAILURES,
            "Publish attempts of emissions that failed and are retried, by tier.",
            &["tier"],
        );
        let lateness = b.histogram(
            EMISSION_LATENESS,
            "Seconds between an emission's due time and its acknowledged publish (emitted_at - due_at).",
            &["trigger"],
            LATENESS_BUCKETS,
        );
        let time_to_ready = b.histogram(
            TIME_TO_READY,
            "Seconds between the last coalesced upload and the acknowledged publish (emitted_at - last_upload_at), by tier and policy.",
            &["tier", "policy"],
            TIME_TO_READY_BUCKETS,
        );
        let store_write = b.histogram(
            STORE_WRITE,
            "Seconds to commit one partition store write batch (state, timers, outbox, offset).",
            TOPIC_PARTITION,
            STORE_WRITE_BUCKETS,
        );
        let changelog_append = b.histogram(
            CHANGELOG_APPEND,
            "Seconds from a changelog append to its acknowledgement as the partition task saw it.",
            TOPIC_PARTITION,
            STORE_WRITE_BUCKETS,
        );
        let pending_rounds = b.gauge(
            PENDING_ROUNDS,
            "Keys with an open round, per owned partition.",
            TOPIC_PARTITION,
        );
        let outbox_size = b.gauge(
            OUTBOX_SIZE,
            "Owed emissions not yet acknowledged by the broker, per owned partition.",
            TOPIC_PARTITION,
        );
        let consumer_lag = b.gauge(
            CONSUMER_LAG,
            "Records the broker holds after the last one applied, per owned partition (where the transport knows it).",
            TOPIC_PARTITION,
        );
        let clock_behind = b.add(
            GaugeVec::new(
                Opts::new(
                    CLOCK_BEHIND,
                    "Seconds the partition clock is behind the wall clock (SEMANTICS §3), per owned partition.",
                ),
                TOPIC_PARTITION,
            )
            .expect("valid metric"),
        );
        let restore_remaining = b.gauge(
            RESTORE_REMAINING,
            "Changelog records still to replay before the partition processes input (0: nothing to restore).",
            TOPIC_PARTITION,
        );
        let partitions_fenced = b.counter(
            PARTITIONS_FENCED,
            "Times a partition stopped because another process wrote its changelog after this one (NATS fence).",
            TOPIC_PARTITION,
        );
        let actions_applied = b.counter(
            ACTIONS_APPLIED,
            "Operator actions applied by this process's partitions, by kind (flush, cancel) and result (one per partition that applied the action record).",
            &["kind", "result"],
        );
        let partitions = b.gauge(
            PARTITIONS,
            "Partitions of this process by state (starting, catching_up, live, stopping, stopped, failed).",
            &["state"],
        );
        let tier_changes = b.counter(
            TIER_CHANGES,
            "Tier changes of tenants (SEMANTICS §5): rate_exceeded (demotion) or recovered (promotion).",
            &["reason"],
        );
        let tenants_tracked = b.add(
            IntGauge::new(
                TENANTS_TRACKED,
                "Tenants the tier router tracks (an emission within the last period, or demoted).",
            )
            .expect("valid metric"),
        );
        let tenants_demoted = b.add(
            IntGauge::new(TENANTS_DEMOTED, "Tenants demoted automatically now.")
                .expect("valid metric"),
        );
        let build_info = b.gauge(
            BUILD_INFO,
            "Always 1; the version label is the settle version running.",
            &["version"],
        );
        build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION")])
            .set(1);
        let admin_refused = b.counter(
            ADMIN_REFUSED,
            "Admin API requests refused by the credential check, by reason (missing_token, bad_token, forbidden, actions_disabled).",
            &["reason"],
        );
        for reason in ADMIN_REFUSED_REASONS {
            admin_refused.with_label_values(&[reason]);
        }
        let partitions_unowned = b.add(
            IntGauge::new(
                PARTITIONS_UNOWNED,
                "NATS input partitions no live instance owns (assignment records, nats.heartbeat-interval).",
            )
            .expect("valid metric"),
        );
        let instances_disagreeing = b.add(
            IntGauge::new(
                INSTANCES_DISAGREEING,
                "Live NATS instances whose nats.instances differs from this instance's.",
            )
            .expect("valid metric"),
        );
        for state in STATES {
            partitions.with_label_values(&[state]).set(0);
        }
        for reason in [ChangeReason::RateExceeded, ChangeReason::Recovered] {
            tier_changes.with_label_values(&[reason.as_str()]);
        }
        let overrides = b.add(
            IntGauge::new(
                OVERRIDES,
                "Tenant overrides in force on this instance (SEMANTICS §7).",
            )
            .expect("valid metric"),
        );
        let override_changes = b.counter(
            OVERRIDE_CHANGES,
            "Tenant override changes seen by this instance: set, removed, expired, refused (SEMANTICS §7).",
            &["change"],
        );
        for change in OVERRIDE_CHANGE_KINDS {
            override_changes.with_label_values(&[change]);
        }
        let shadow_emissions = b.gauge(
            SHADOW_EMISSIONS,
            "Emissions of the live policy (shadow=\"live\") and would-be emissions of each shadow policy, by tier and tenant class (default: the tenant runs [debounce]; own: a rule of its own), since settle_shadow_since_seconds (SEMANTICS §8).",
            &["shadow", "tier", "class"],
        );
        let shadow_uploads = b.gauge(
            SHADOW_UPLOADS,
            "Uploads in those emissions, by shadow policy (or live), tier and tenant class.",
            &["shadow", "tier", "class"],
        );
        let float_gauge = |b: &mut Builder, name: &str, help: &str, labels: &[&str]| {
            b.add(GaugeVec::new(Opts::new(name, help), labels).expect("valid metric"))
        };
        let shadow_uploads_per_emission = float_gauge(
            &mut b,
            SHADOW_UPLOADS_PER_EMISSION,
            "Uploads per emission of the live policy and of each shadow policy, by tier and tenant class (0 before the first).",
            &["shadow", "tier", "class"],
        );
        let shadow_time_to_ready = float_gauge(
            &mut b,
            SHADOW_TIME_TO_READY,
            "Time-to-ready (due_at - last_upload_at) of the live policy's and each shadow policy's emissions, seconds, at quantile 0.5 and 0.99, by tier and tenant class.",
            &["shadow", "tier", "class", "quantile"],
        );
        let shadow_sessions = b.gauge(
            SHADOW_SESSIONS,
            "Session keys each shadow policy holds now (bounded by runtime.shadow-max-sessions per partition).",
            &["shadow"],
        );
        let shadow_refused = b.gauge(
            SHADOW_REFUSED_SESSIONS,
            "Sessions each shadow policy could not follow within runtime.shadow-max-sessions (left out of its figures).",
            &["shadow"],
        );
        let shadow_since = b.add(
            Gauge::new(
                SHADOW_SINCE,
                "When the shadow figures start: seconds since the epoch of the earliest partition assignment counted.",
            )
            .expect("valid metric"),
        );
        Metrics {
            inner: Arc::new(Inner {
                registry: b.registry,
                names: b.names,
                uploads_consumed,
                uploads_rejected,
                input_skipped,
                emissions,
                emission_uploads,
                coalescing_ratio,
                publish_failures,
                lateness,
                time_to_ready,
                store_write,
                changelog_append,
                pending_rounds,
                outbox_size,
                consumer_lag,
                clock_behind,
                restore_remaining,
                partitions_fenced,
                actions_applied,
                partitions,
                tier_changes,
                tenants_tracked,
                tenants_demoted,
                overrides,
                override_changes,
                admin_refused,
                partitions_unowned,
                instances_disagreeing,
                shadow_emissions,
                shadow_uploads,
                shadow_uploads_per_emission,
                shadow_time_to_ready,
                shadow_sessions,
                shadow_refused,
                shadow_since,
                emitted: AtomicU64::new(0),
                coalesced: AtomicU64::new(0),
                refreshing: Mutex::new(()),
            }),
        }
    }

    /// The admin API refused a request for `reason` (one of the [`ADMIN_REFUSED`] reasons).
    pub fn admin_refused(&self, reason: &str) {
        self.inner.admin_refused.with_label_values(&[reason]).inc();
    }

    /// Sets [`PARTITIONS_UNOWNED`] and [`INSTANCES_DISAGREEING`] (NATS assignment check).
    pub fn set_assignment(&self, unowned: usize, disagreeing: usize) {
        self.inner.partitions_unowned.set(unowned as i64);
        self.inner.instances_disagreeing.set(disagreeing as i64);
    }

    /// The registry (to gather or encode).
    pub fn registry(&self) -> &Registry {
        &self.inner.registry
    }

    /// Names of every registered metric family, in registration order (histograms without
    /// their `_bucket`, `_sum`, `_count` suffixes).
    pub fn names(&self) -> &[String] {
        &self.inner.names
    }

    /// The label handles of one partition task (resolved once).
    pub fn partition(&self, topic: &str, partition: i32) -> PartitionMetrics {
        let p = partition.to_string();
        let labels = [topic, p.as_str()];
        PartitionMetrics {
            consumed: self.inner.uploads_consumed.with_label_values(&labels),
            skipped: self.inner.input_skipped.with_label_values(&labels),
            store_write: self.inner.store_write.with_label_values(&labels),
            changelog_append: self.inner.changelog_append.with_label_values(&labels),
            topic: topic.to_owned(),
            partition: p,
            metrics: self.clone(),
        }
    }

    /// The label handles of one outbox publisher; `tiers` are the tier names in config
    /// order (handles for other names are made when first seen).
    pub fn publisher<'a>(&self, tiers: impl IntoIterator<Item = &'a str>) -> PublishMetrics {
        let mut p = PublishMetrics {
            metrics: self.clone(),
            tiers: Vec::new(),
            lateness: Trigger::ALL.map(|t| self.inner.lateness.with_label_values(&[t.as_str()])),
        };
        for tier in tiers {
            p.tier_index(tier);
        }
        p
    }

    /// Sets the gauges from `partitions` (one entry per partition the runtime owns or
    /// owned, from its status board) and the tier router's `counters`. Call before encoding
    /// a scrape.
    pub fn refresh<'a>(
        &self,
        partitions: impl IntoIterator<Item = PartitionGauges<'a>>,
        counters: &TierCounters,
    ) {
        let m = &*self.inner;
        let _guard = m.refreshing.lock().unwrap_or_else(PoisonError::into_inner);
        for g in [
            &m.pending_rounds,
            &m.outbox_size,
            &m.consumer_lag,
            &m.restore_remaining,
        ] {
            g.reset();
        }
        m.clock_behind.reset();
        let mut by_state = [0_i64; STATES.len()];
        for s in partitions {
            if let Some(i) = STATES.iter().position(|l| *l == s.state) {
                by_state[i] += 1;
            }
            if s.state == "stopped" {
                continue;
            }
            let p = s.partition.to_string();
            let labels = [s.topic, p.as_str()];
            let gauge = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
            m.pending_rounds
                .with_label_values(&labels)
                .set(gauge(s.pending_rounds));
            m.outbox_size
                .with_label_values(&labels)
                .set(gauge(s.outbox_len));
            m.restore_remaining
                .with_label_values(&labels)
                .set(gauge(s.restore_remaining));
            if let Some(lag) = s.lag {
                m.consumer_lag.with_label_values(&labels).set(gauge(lag));
            }
            if let Some(behind) = s.clock_behind_ms {
                m.clock_behind
                    .with_label_values(&labels)
                    .set(behind.max(0) as f64 / 1000.0);
            }
        }
        for (state, n) in STATES.iter().zip(by_state) {
            m.partitions.with_label_values(&[state]).set(n);
        }
        for (reason, total) in [
            (ChangeReason::RateExceeded, counters.demotions),
            (ChangeReason::Recovered, counters.recoveries),
        ] {
            let c = m.tier_changes.with_label_values(&[reason.as_str()]);
            c.inc_by(total.saturating_sub(c.get()));
        }
        m.tenants_tracked
            .set(i64::try_from(counters.tenants_tracked).unwrap_or(i64::MAX));
        m.tenants_demoted
            .set(i64::try_from(counters.tenants_demoted).unwrap_or(i64::MAX));
        let emitted = m.emitted.load(Ordering::Relaxed);
        let coalesced = m.coalesced.load(Ordering::Relaxed);
        m.coalescing_ratio.set(if emitted == 0 {
            0.0
        } else {
            coalesced as f64 / emitted as f64
        });
    }

    /// Sets the `settle_shadow_*` gauges (SEMANTICS §8) from `policies`: the live policy's
    /// figures (named `live`) and each shadow's, added up over the partitions, whose figures
    /// start at `since` (ms since the epoch; `None`: no partition, the series are removed).
    /// `tiers` are the tier names in tier-list order (the index of `Figures::tiers`). Call
    /// before encoding a scrape.
    pub fn refresh_shadows<'a>(
        &self,
        tiers: &[&str],
        policies: impl IntoIterator<Item = (&'a str, &'a Figures)>,
        since: Option<Millis>,
    ) {
        let m = &*self.inner;
        let _guard = m.refreshing.lock().unwrap_or_else(PoisonError::into_inner);
        m.shadow_emissions.reset();
        m.shadow_uploads.reset();
        m.shadow_uploads_per_emission.reset();
        m.shadow_time_to_ready.reset();
        m.shadow_sessions.reset();
        m.shadow_refused.reset();
        let Some(since) = since else {
            m.shadow_since.set(0.0);
            return;
        };
        m.shadow_since.set(since as f64 / 1000.0);
        let gauge = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        for (name, f) in policies {
            if name != crate::engine::LIVE {
                m.shadow_sessions
                    .with_label_values(&[name])
                    .set(gauge(f.sessions));
                m.shadow_refused
                    .with_label_values(&[name])
                    .set(gauge(f.refused_sessions));
            }
            for (i, &tier) in tiers.iter().enumerate() {
                for class in TenantClass::ALL {
                    let t = f.cell(i, class);
                    let labels = [name, tier, class.name()];
                    m.shadow_emissions
                        .with_label_values(&labels)
                        .set(gauge(t.emissions));
                    m.shadow_uploads
                        .with_label_values(&labels)
                        .set(gauge(t.uploads));
                    m.shadow_uploads_per_emission
                        .with_label_values(&labels)
                        .set(t.uploads_per_emission());
                    let p = t.time_to_ready.percentiles();
                    for (q, ms) in SHADOW_QUANTILES.into_iter().zip([p.p50, p.p99]) {
                        m.shadow_time_to_ready
                            .with_label_values(&[name, tier, class.name(), q])
                            .set(ms as f64 / 1000.0);
                    }
                }
            }
        }
    }

    /// Sets [`OVERRIDES`]: `n` tenant overrides are in force.
    pub fn set_overrides(&self, n: usize) {
        self.inner
            .overrides
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// Counts one [`OVERRIDE_CHANGES`] of kind `change` (one of [`OVERRIDE_CHANGE_KINDS`]).
    pub fn override_change(&self, change: &str) {
        self.inner
            .override_changes
            .with_label_values(&[change])
            .inc();
    }

    /// Every metric in the Prometheus text exposition format (call [`Metrics::refresh`]
    /// first for current gauges).
    pub fn encode(&self) -> String {
        let families = self.inner.registry.gather();
        // Encoding into a String fails only on a write error, which a String cannot have.
        prometheus::TextEncoder::new()
            .encode_to_string(&families)
            .unwrap_or_default()
    }
}

/// Metrics of one partition task, labels resolved once.
#[derive(Clone, Debug)]
pub struct PartitionMetrics {
    consumed: IntCounter,
    skipped: IntCounter,
    store_write: Histogram,
    changelog_append: Histogram,
    topic: String,
    partition: String,
    metrics: Metrics,
}

impl PartitionMetrics {
    /// `n` input records were applied (their store batch committed).
    pub fn consumed(&self, n: u64) {
        self.consumed.inc_by(n);
    }

    /// The partition applied an operator action of `kind` (`flush`, `cancel`) with `result`
    /// (the outcome's, or `duplicate`).
    pub fn action(&self, kind: &str, result: &str) {
        self.metrics
            .inner
            .actions_applied
            .with_label_values(&[kind, result])
            .inc();
    }

    /// The partition was fenced: another process wrote its changelog after this one.
    pub fn fenced(&self) {
        self.metrics
            .inner
            .partitions_fenced
            .with_label_values(&[self.topic.as_str(), self.partition.as_str()])
            .inc();
    }

    /// `n` input records were read and dropped below the partition's next offset
    /// (`transport::InputBatch::skipped`).
    pub fn skipped(&self, n: u64) {
        self.skipped.inc_by(n);
    }

    /// One record was dead-lettered with `reason` (a `codec::DecodeError::reason` code: a
    /// bounded set).
    pub fn rejected(&self, reason: &str) {
        self.metrics
            .inner
            .uploads_rejected
            .with_label_values(&[self.topic.as_str(), self.partition.as_str(), reason])
            .inc();
    }

    /// One store write batch took `elapsed` to commit.
    pub fn store_write(&self, elapsed: Duration) {
        self.store_write.observe(elapsed.as_secs_f64());
    }

    /// One changelog append was acknowledged `elapsed` after it was made.
    pub fn changelog_append(&self, elapsed: Duration) {
        self.changelog_append.observe(elapsed.as_secs_f64());
    }
}

/// Handles of one tier.
#[derive(Debug)]
struct TierHandles {
    name: String,
    /// `[policy][trigger]`, made when first used.
    emissions: [[Option<IntCounter>; Trigger::ALL.len()]; 3],
    /// `[policy]`.
    uploads: [Option<IntCounter>; 3],
    /// `[policy]`.
    time_to_ready: [Option<Histogram>; 3],
    failures: IntCounter,
}

/// Metrics of one outbox publisher (owned by its task; label handles resolved once).
#[derive(Debug)]
pub struct PublishMetrics {
    metrics: Metrics,
    tiers: Vec<TierHandles>,
    /// By `Trigger::ALL` index.
    lateness: [Histogram; Trigger::ALL.len()],
}

fn policy_index(p: PolicyName) -> usize {
    match p {
        PolicyName::Fixed => 0,
        PolicyName::LeadingTrailing => 1,
        PolicyName::Adaptive => 2,
    }
}

fn trigger_index(t: Trigger) -> usize {
    match t {
        Trigger::Leading => 0,
        Trigger::Trailing => 1,
        Trigger::MaxWait => 2,
        Trigger::Complete => 3,
        Trigger::Final => 4,
        Trigger::Manual => 5,
    }
}

impl PublishMetrics {
    fn tier_index(&mut self, tier: &str) -> usize {
        if let Some(i) = self.tiers.iter().position(|t| t.name == tier) {
            return i;
        }
        let m = &self.metrics.inner;
        self.tiers.push(TierHandles {
            name: tier.to_owned(),
            emissions: Default::default(),
            uploads: Default::default(),
            time_to_ready: Default::default(),
            failures: m.publish_failures.with_label_values(&[tier]),
        });
        self.tiers.len() - 1
    }

    /// `e` was acknowledged on tier `tier`'s topic, sent at wall-clock `emitted_at` (ms).
    pub fn published(&mut self, tier: &str, e: &Emission, emitted_at: Millis) {
        let (p, g) = (policy_index(e.policy), trigger_index(e.trigger));
        let i = self.tier_index(tier);
        let inner = Arc::clone(&self.metrics.inner);
        let h = &mut self.tiers[i];
        h.emissions[p][g]
            .get_or_insert_with(|| {
                inner
                    .emissions
                    .with_label_values(&[e.trigger.as_str(), tier, e.policy.as_str()])
            })
            .inc();
        h.uploads[p]
            .get_or_insert_with(|| {
                inner
                    .emission_uploads
                    .with_label_values(&[tier, e.policy.as_str()])
            })
            .inc_by(u64::from(e.uploads));
        let seconds = |from: Millis| emitted_at.saturating_sub(from).max(0) as f64 / 1000.0;
        h.time_to_ready[p]
            .get_or_insert_with(|| {
                inner
                    .time_to_ready
                    .with_label_values(&[tier, e.policy.as_str()])
            })
            .observe(seconds(e.last_upload_at));
        self.lateness[g].observe(seconds(e.due_at));
        inner.emitted.fetch_add(1, Ordering::Relaxed);
        inner
            .coalesced
            .fetch_add(u64::from(e.uploads), Ordering::Relaxed);
    }

    /// One publish attempt on tier `tier`'s topic failed (it is retried).
    pub fn publish_failed(&mut self, tier: &str) {
        let i = self.tier_index(tier);
        self.tiers[i].failures.inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::SessionKey;

    fn sample(text: &str, series: &str) -> Option<f64> {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    }

    #[test]
    fn every_family_is_registered_once_with_a_settle_name() {
        let m = Metrics::new();
        let mut names = m.names().to_vec();
        assert!(names.iter().all(|n| n.starts_with("settle_")), "{names:?}");
        let n = names.len();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), n);
        assert_eq!(n, 35);
    }

    #[test]
    fn shadow_gauges_show_each_policy_by_tier() {
        let m = Metrics::new();
        let mut f = Figures::default();
        let e = Emission {
            key: SessionKey::new("t", "s"),
            state_created_at: 0,
            generation: 1,
            trigger: Trigger::Trailing,
            uploads: 4,
            first_upload_at: 1_000,
            last_upload_at: 2_000,
            due_at: 32_000,
            delay_ms: 30_000,
            policy: PolicyName::Fixed,
            last_event_id: None,
            attributes: None,
            event_ids: None,
        };
        f.record(1, TenantClass::Own, &e);
        f.refused_sessions = 3;
        m.refresh_shadows(
            &["normal", "limited"],
            [("live", &Figures::default()), ("slow", &f)],
            Some(1_700_000_000_000),
        );
        let text = m.encode();
        for (series, want) in [
            (
                r#"settle_shadow_emissions{class="own",shadow="slow",tier="limited"}"#,
                1.0,
            ),
            (
                r#"settle_shadow_emissions{class="default",shadow="slow",tier="limited"}"#,
                0.0,
            ),
            (
                r#"settle_shadow_emissions{class="default",shadow="live",tier="normal"}"#,
                0.0,
            ),
            (
                r#"settle_shadow_uploads_per_emission{class="own",shadow="slow",tier="limited"}"#,
                4.0,
            ),
            (
                r#"settle_shadow_time_to_ready_seconds{class="own",quantile="0.99",shadow="slow",tier="limited"}"#,
                30.0,
            ),
            (r#"settle_shadow_refused_sessions{shadow="slow"}"#, 3.0),
            ("settle_shadow_since_seconds", 1_700_000_000.0),
        ] {
            assert_eq!(sample(&text, series), Some(want), "{series} in\n{text}");
        }
        assert!(!text.contains(r#"settle_shadow_sessions{shadow="live"}"#));
        m.refresh_shadows(&["normal"], [], None);
        assert!(!m.encode().contains("settle_shadow_emissions{"));
    }

    #[test]
    fn handles_record_and_refresh_sets_gauges_from_the_status() {
        let m = Metrics::new();
        let p = m.partition("uploads", 3);
        p.consumed(5);
        p.rejected("invalid_json");
        p.store_write(Duration::from_millis(2));
        let mut publisher = m.publisher(["normal", "limited"]);
        let e = Emission {
            key: SessionKey::new("t", "s"),
            state_created_at: 0,
            generation: 1,
            trigger: Trigger::Trailing,
            uploads: 4,
            first_upload_at: 1_000,
            last_upload_at: 2_000,
            due_at: 3_000,
            delay_ms: 1_000,
            policy: PolicyName::Fixed,
            last_event_id: None,
            attributes: None,
            event_ids: None,
        };
        publisher.published("limited", &e, 3_500);
        publisher.publish_failed("normal");
        let status = [PartitionGauges {
            topic: "uploads",
            partition: 3,
            state: "live",
            pending_rounds: 7,
            lag: Some(11),
            clock_behind_ms: Some(1_500),
            ..PartitionGauges::default()
        }];
        let counters = TierCounters {
            demotions: 2,
            recoveries: 1,
            ..TierCounters::default()
        };
        m.refresh(status.clone(), &counters);
        m.refresh(status, &counters);
        let text = m.encode();
        let tp = r#"{partition="3",topic="uploads"}"#;
        assert_eq!(sample(&text, &format!("{UPLOADS_CONSUMED}{tp}")), Some(5.0));
        assert_eq!(
            sample(
                &text,
                &format!(
                    r#"{UPLOADS_REJECTED}{{partition="3",reason="invalid_json",topic="uploads"}}"#
                )
            ),
            Some(1.0)
        );
        assert_eq!(
            sample(
                &text,
                &format!(r#"{EMISSIONS}{{policy="fixed",tier="limited",trigger="trailing"}}"#)
            ),
            Some(1.0)
        );
        assert_eq!(sample(&text, COALESCING_RATIO), Some(4.0));
        assert_eq!(
            sample(
                &text,
                &format!(r#"{TIME_TO_READY}_sum{{policy="fixed",tier="limited"}}"#)
            ),
            Some(1.5)
        );
        assert_eq!(
            sample(
                &text,
                &format!(r#"{EMISSION_LATENESS}_sum{{trigger="trailing"}}"#)
            ),
            Some(0.5)
        );
        assert_eq!(
            sample(&text, &format!(r#"{PUBLISH_FAILURES}{{tier="normal"}}"#)),
            Some(1.0)
        );
        assert_eq!(sample(&text, &format!("{PENDING_ROUNDS}{tp}")), Some(7.0));
        assert_eq!(sample(&text, &format!("{CONSUMER_LAG}{tp}")), Some(11.0));
        assert_eq!(sample(&text, &format!("{CLOCK_BEHIND}{tp}")), Some(1.5));
        assert_eq!(
            sample(&text, &format!("{RESTORE_REMAINING}{tp}")),
            Some(0.0)
        );
        assert_eq!(
            sample(&text, &format!(r#"{PARTITIONS}{{state="live"}}"#)),
            Some(1.0)
        );
        // Refreshing twice does not count the router's totals twice.
        assert_eq!(
            sample(
                &text,
                &format!(r#"{TIER_CHANGES}{{reason="rate_exceeded"}}"#)
            ),
            Some(2.0)
        );
        assert_eq!(
            sample(&text, &format!(r#"{TIER_CHANGES}{{reason="recovered"}}"#)),
            Some(1.0)
        );
        assert!(
            text.contains(&format!("{STORE_WRITE}_count{tp} 1")),
            "{text}"
        );
    }
}
