//! The noisy-neighbour experiment of the seed (SEMANTICS §1, §5): a normal tenant finishes
//! 100 sessions while a noisy tenant finishes 1 000 at about the same time; every "session
//! ready" emission is a job of 100 ms for a downstream worker pool of fixed capacity that
//! consumes the tier topics, the first tier served first. How long does the normal tenant
//! wait for its last job — alone, with tiers, and with one topic for everybody?
//!
//! * [`plan`]: the uploads (also `settle loadgen --scenario noisy`, for Kafka). Each session
//!   is a `tenants`-shaped burst (10 uploads within 600 ms); sessions of both tenants start
//!   uniformly within the window, so both finish at about the same time. The normal
//!   tenant's sessions are drawn from their own random stream: identical with and without
//!   the noisy tenant.
//! * [`run_case`]: the real pipeline — [`Runtime`] with RocksDB stores in a temporary
//!   directory and the tier router — on the memory transport, fed in real time; returns the
//!   emissions as jobs (tenant, tier rank, arrival = `emitted_at`).
//! * [`simulate_workers`]: a discrete-event simulation of the worker pool over those
//!   arrivals (non-preemptive strict priority by tier, first come first served within a
//!   tier, fixed service time). Worker time is simulated; the emission times are measured.
//!
//! `benches/tiers.rs` runs the three cases and prints the figures (see BENCHMARKS.md).

use super::scenario::{PlannedUpload, Scenario, Shape};
use crate::codec;
use crate::config::Config;
use crate::engine::{Engine, Millis, PolicySpec, PolicyTable};
use crate::runtime::{Clock, Runtime, RuntimeOptions, SystemClock};
use crate::tiers::{TierSpec, TiersConfig};
use crate::transport::memory::MemoryBroker;
use anyhow::Context as _;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Tenant name of the normal tenant.
pub const NORMAL_TENANT: &str = "normal-co";

/// Tenant name of the noisy tenant.
pub const NOISY_TENANT: &str = "noisy-co";

/// Size of the experiment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NoisyParams {
    /// Sessions of the normal tenant (seed: 100).
    pub normal_sessions: u32,
    /// Sessions of the noisy tenant (seed: 1 000).
    pub noisy_sessions: u32,
    /// Sessions start uniformly within this window (ms).
    pub window_ms: u64,
    /// Seed of the schedule.
    pub seed: u64,
    /// Prepended to every session name (`run-0042`): `settle loadgen`'s `<run-id>-`, so
    /// two runs never share a session; empty here.
    pub session_prefix: String,
}

impl Default for NoisyParams {
    /// 100 normal and 1 000 noisy sessions within 10 s, seed 7, no session prefix.
    fn default() -> Self {
        NoisyParams {
            normal_sessions: 100,
            noisy_sessions: 1_000,
            window_ms: 10_000,
            seed: 7,
            session_prefix: String::new(),
        }
    }
}

/// The uploads of the experiment, sorted by time; `at_ms` is relative to the start of the
/// plan. Without `with_noisy`, only the normal tenant's (the same as with it).
pub fn plan(params: &NoisyParams, with_noisy: bool) -> Vec<PlannedUpload> {
    let shape = Shape::default();
    let tenants = [
        (NORMAL_TENANT, params.normal_sessions, 0),
        (NOISY_TENANT, params.noisy_sessions, 1),
    ];
    let mut plan = Vec::new();
    for (tenant, sessions, stream) in tenants {
        if tenant == NOISY_TENANT && !with_noisy {
            continue;
        }
        let mut rng = StdRng::seed_from_u64(params.seed.wrapping_mul(2).wrapping_add(stream));
        for s in 0..sessions {
            let start = rng.random_range(0..params.window_ms.max(1));
            let session = format!("{}run-{s:04}", params.session_prefix);
            for u in Scenario::Tenants.session(&mut rng, tenant, &session, &shape) {
                plan.push(PlannedUpload {
                    at_ms: start + u.at_ms,
                    ..u
                });
            }
        }
    }
    plan.sort_by(|a, b| (a.at_ms, &a.key).cmp(&(b.at_ms, &b.key)));
    plan
}

/// Sessions in a plan (distinct keys).
fn sessions(plan: &[PlannedUpload]) -> usize {
    let mut keys: Vec<&str> = plan.iter().map(|u| u.key.as_str()).collect();
    keys.sort_unstable();
    keys.dedup();
    keys.len()
}

/// One downstream job: one emission.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Job {
    /// The emission's tenant.
    pub tenant: String,
    /// Position of its topic in the tier list (0 = first tier, served first).
    pub rank: usize,
    /// When it reached its topic (ms): the record's `emitted_at`.
    pub arrival_ms: Millis,
}

/// Completion time (ms) of each job in `jobs` (same order) on `workers` identical workers
/// taking `service_ms` per job: a free worker takes the oldest job of the first non-empty
/// tier (strict priority, non-preemptive; a job in progress is never interrupted).
pub fn simulate_workers(jobs: &[Job], workers: usize, service_ms: Millis) -> Vec<Millis> {
    let mut arrivals: Vec<usize> = (0..jobs.len()).collect();
    arrivals.sort_by_key(|&i| (jobs[i].arrival_ms, i));
    let mut arrivals = arrivals.into_iter().peekable();
    let ranks = jobs.iter().map(|j| j.rank + 1).max().unwrap_or(0);
    let mut queues: Vec<VecDeque<usize>> = vec![VecDeque::new(); ranks];
    // Moves every job arrived by `t` into its tier's queue.
    let mut enqueue = |t: Millis, queues: &mut Vec<VecDeque<usize>>| -> Option<Millis> {
        while let Some(&i) = arrivals.peek().filter(|&&i| jobs[i].arrival_ms <= t) {
            queues[jobs[i].rank].push_back(i);
            arrivals.next();
        }
        arrivals.peek().map(|&i| jobs[i].arrival_ms)
    };
    let mut done = vec![0; jobs.len()];
    // When each worker is free next; the earliest free worker takes the next job.
    let mut free: BinaryHeap<Reverse<Millis>> =
        (0..workers.max(1)).map(|_| Reverse(Millis::MIN)).collect();
    // Simulated time: never goes back. A worker free before it was idle with nothing queued.
    let mut now = Millis::MIN;
    while let Some(Reverse(free_at)) = free.pop() {
        now = now.max(free_at);
        let next_arrival = enqueue(now, &mut queues);
        if queues.iter().all(VecDeque::is_empty) {
            // Idle until the next arrival, if any.
            let Some(t) = next_arrival else { break };
            now = t;
            enqueue(now, &mut queues);
        }
        let Some(i) = queues.iter_mut().find_map(VecDeque::pop_front) else {
            break;
        };
        done[i] = now + service_ms;
        free.push(Reverse(done[i]));
    }
    done
}

/// What the worker pool made of one case's emissions (ms relative to the first upload).
#[derive(Clone, Debug, PartialEq)]
pub struct Completion {
    /// When the normal tenant's last job finished.
    pub normal_ms: Millis,
    /// When the noisy tenant's last job finished (0 without it).
    pub noisy_ms: Millis,
    /// Normal tenant: time from emission to job done, median.
    pub normal_wait_p50_ms: Millis,
    /// Normal tenant: time from emission to job done, 99th percentile.
    pub normal_wait_p99_ms: Millis,
}

/// The emissions of one run of the pipeline as jobs.
#[derive(Clone, Debug, PartialEq)]
pub struct CaseRun {
    /// One job per emission, in publish order.
    pub jobs: Vec<Job>,
    /// Wall-clock time of the first upload (ms): time 0 of the experiment.
    pub t0_ms: Millis,
    /// Sessions in the plan.
    pub sessions: usize,
    /// Emissions on each tier topic, in tier order.
    pub per_tier: Vec<(String, usize)>,
    /// Tier changes published (the tier-events records).
    pub tier_changes: Vec<crate::tiers::TierChange>,
}

impl CaseRun {
    /// Runs the worker simulation over the jobs.
    pub fn completion(&self, workers: usize, service_ms: Millis) -> Completion {
        let done = simulate_workers(&self.jobs, workers, service_ms);
        let last = |tenant: &str| {
            self.jobs
                .iter()
                .zip(&done)
                .filter(|(j, _)| j.tenant == tenant)
                .map(|(_, d)| d - self.t0_ms)
                .max()
                .unwrap_or(0)
        };
        let mut waits: Vec<Millis> = self
            .jobs
            .iter()
            .zip(&done)
            .filter(|(j, _)| j.tenant == NORMAL_TENANT)
            .map(|(j, d)| d - j.arrival_ms)
            .collect();
        waits.sort_unstable();
        let pct = |p: f64| {
            let i = ((waits.len() as f64 * p).ceil() as usize).clamp(1, waits.len().max(1)) - 1;
            waits.get(i).copied().unwrap_or(0)
        };
        Completion {
            normal_ms: last(NORMAL_TENANT),
            noisy_ms: last(NOISY_TENANT),
            normal_wait_p50_ms: pct(0.5),
            normal_wait_p99_ms: pct(0.99),
        }
    }
}

/// One tier per topic: what "without tiers" means (everything on `settle.ready`).
pub fn one_topic() -> TiersConfig {
    TiersConfig {
        tiers: vec![TierSpec::new("normal", "settle.ready")],
        ..TiersConfig::default()
    }
}

/// The debounce policy of the experiment: fixed 1 s (a session's uploads, within 600 ms,
/// make exactly one emission, so jobs = sessions).
pub fn policy() -> PolicySpec {
    PolicySpec::fixed(1_000)
}

/// Runs `plan` through the real runtime (RocksDB in a temporary directory, `partitions`
/// input partitions, the memory transport, the system clock, tiers `tiers`), producing each
/// upload at its time, until every emission is published. Must run inside a multi-threaded
/// tokio runtime.
///
/// Errors: the temporary directory, the runtime or a partition failed, or the pipeline did
/// not settle within 2 minutes after the last upload.
pub async fn run_case(
    plan: &[PlannedUpload],
    tiers: &TiersConfig,
    partitions: i32,
) -> anyhow::Result<CaseRun> {
    let dir = tempfile::Builder::new()
        .prefix("settle-noisy-")
        .tempdir()
        .context("cannot create a temporary data directory")?;
    let broker = MemoryBroker::new("uploads", partitions.max(1));
    let mut options = RuntimeOptions::from_config(&Config::default());
    options.data_dir = dir.path().to_path_buf();
    options.tiers = tiers.clone();
    options.shutdown_deadline = Duration::from_secs(5);
    let clock = SystemClock;
    let runtime = Runtime::new(
        Engine::new(PolicyTable::uniform(policy())),
        broker.sink(),
        clock,
        options,
    )?;
    let status = runtime.status();
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(runtime.run(broker.source("settle-noisy"), shutdown.clone()));

    let start = tokio::time::Instant::now();
    let t0_ms = clock.now_ms();
    for u in plan {
        tokio::time::sleep_until(start + Duration::from_millis(u.at_ms)).await;
        broker.produce_upload(&u.key, &u.json, clock.now_ms());
    }
    let uploads = plan.len() as u64;
    let n = broker.partitions();
    let settled = tokio::time::timeout(Duration::from_secs(120), async {
        let mut rx = status.subscribe();
        loop {
            let m = rx.borrow_and_update().clone();
            if let Some((p, s)) = m.iter().find(|(_, s)| s.is_failed()) {
                return Err(anyhow::anyhow!("partition {p} failed: {:?}", s.state));
            }
            let consumed: u64 = m.values().map(|s| s.records).sum();
            if consumed == uploads && (0..n).all(|p| m.get(&p).is_some_and(|s| s.is_idle())) {
                return Ok(());
            }
            tokio::select! {
                _ = rx.changed() => {}
                () = tokio::time::sleep(Duration::from_millis(100)) => {}
            }
        }
    })
    .await;
    // Let the tier-events task publish what the last emissions decided, then stop.
    tokio::time::sleep(Duration::from_millis(200)).await;
    shutdown.cancel();
    let summary = task.await.context("runtime task")??;
    settled.context("the pipeline did not settle within 2 minutes")??;
    if let Some((p, reason)) = summary.failed().first() {
        anyhow::bail!("partition {p} failed: {reason}");
    }

    let topics: Vec<&str> = tiers.tiers.iter().map(|t| t.topic.as_str()).collect();
    let mut per_tier: Vec<(String, usize)> =
        tiers.tiers.iter().map(|t| (t.name.clone(), 0)).collect();
    let mut jobs = Vec::new();
    for m in broker.output() {
        let r = codec::decode_ready(&m.payload).context("output is a ready record")?;
        let rank = topics
            .iter()
            .position(|t| *t == m.topic)
            .with_context(|| format!("emission on unknown topic {}", m.topic))?;
        per_tier[rank].1 += 1;
        jobs.push(Job {
            tenant: r.tenant,
            rank,
            arrival_ms: r.emitted_at,
        });
    }
    let tier_changes = broker
        .tier_events()
        .iter()
        .map(|m| serde_json::from_slice(&m.payload))
        .collect::<Result<_, _>>()
        .context("tier-events record")?;
    Ok(CaseRun {
        jobs,
        t0_ms,
        sessions: sessions(plan),
        per_tier,
        tier_changes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(tenant: &str, rank: usize, arrival_ms: Millis) -> Job {
        Job {
            tenant: tenant.to_owned(),
            rank,
            arrival_ms,
        }
    }

    #[test]
    fn workers_serve_the_first_tier_first_and_never_preempt() {
        // One worker, 100 ms per job. At 0 a limited job starts (nothing else is there);
        // at 10 two limited and one normal job wait: the normal one goes next.
        let jobs = [
            job("noisy", 1, 0),
            job("noisy", 1, 10),
            job("noisy", 1, 10),
            job("normal", 0, 20),
        ];
        assert_eq!(simulate_workers(&jobs, 1, 100), [100, 300, 400, 200]);
    }

    #[test]
    fn workers_are_fifo_within_a_tier_and_idle_until_the_next_arrival() {
        let jobs = [job("a", 0, 50), job("b", 0, 0), job("c", 0, 1_000)];
        assert_eq!(simulate_workers(&jobs, 1, 100), [200, 100, 1_100]);
        // Two workers take two jobs at once.
        assert_eq!(simulate_workers(&jobs, 2, 100), [150, 100, 1_100]);
        assert!(simulate_workers(&[], 3, 100).is_empty());
    }

    #[test]
    fn idle_workers_start_when_the_work_arrives() {
        // Three workers, two of them idle until the burst at 1 000.
        let jobs = [
            job("a", 0, 0),
            job("b", 1, 1_000),
            job("c", 0, 1_000),
            job("d", 1, 1_000),
        ];
        assert_eq!(simulate_workers(&jobs, 3, 100), [100, 1_100, 1_100, 1_100]);
        // Two workers at 1 000: c (first tier) and b (older than d); d when one is free.
        assert_eq!(simulate_workers(&jobs, 2, 100), [100, 1_100, 1_100, 1_200]);
    }

    #[test]
    fn one_topic_means_fifo_for_everybody() {
        let jobs: Vec<Job> = (0..10)
            .map(|i| job(if i == 9 { "normal" } else { "noisy" }, 0, i))
            .collect();
        let done = simulate_workers(&jobs, 1, 100);
        assert_eq!(
            done[9], 1_000,
            "the normal job waits behind nine noisy ones"
        );
    }

    #[test]
    fn the_normal_tenant_plan_is_the_same_with_and_without_the_noisy_one() {
        let p = NoisyParams::default();
        let alone = plan(&p, false);
        let both = plan(&p, true);
        let normal: Vec<&PlannedUpload> = both
            .iter()
            .filter(|u| u.key.starts_with(NORMAL_TENANT))
            .collect();
        assert_eq!(normal, alone.iter().collect::<Vec<_>>());
        assert_eq!(sessions(&alone), 100);
        assert_eq!(sessions(&both), 1_100);
        assert_eq!(both.len(), 11_000, "10 uploads per session");
        assert!(both.iter().all(|u| u.at_ms < p.window_ms + 600));
        assert!(both.windows(2).all(|w| w[0].at_ms <= w[1].at_ms));
        assert!(both[0].json.starts_with(&format!(
            r#"{{"tenant":"{}""#,
            both[0].key.split('/').next().unwrap()
        )));
    }
}
