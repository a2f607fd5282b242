//! Helpers shared by the runtime and crash integration tests (real RocksDB in a temp dir,
//! the memory transport, paused tokio time).
#![allow(dead_code)]

use settle::engine::{Emission, Engine, Millis, PolicySpec, PolicyTable};
use settle::runtime::{RunSummary, Runtime, RuntimeOptions, StatusBoard, StatusMap, TokioClock};
use settle::store::{partition_path, PartitionStore, StoreOptions};
use settle::transport::memory::MemoryBroker;
use std::path::Path;
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// 2026-01-01T00:00:00Z in ms: the wall clock at the start of every paused-time test.
pub const T0: Millis = 1_767_225_600_000;

/// Input topic of the test broker.
pub const TOPIC: &str = "uploads";

/// Consumer group of the test runtime.
pub const GROUP: &str = "settle";

/// An upload record for `tenant/session`.
pub fn upload(tenant: &str, session: &str) -> String {
    format!(r#"{{"tenant":"{tenant}","session":"{session}"}}"#)
}

/// Appends an upload of `tenant/session` with record timestamp `ts`.
pub fn produce(broker: &MemoryBroker, tenant: &str, session: &str, ts: Millis) -> (i32, i64) {
    broker.produce_upload(&format!("{tenant}/{session}"), &upload(tenant, session), ts)
}

/// An engine with one policy for every tenant.
pub fn engine(spec: PolicySpec) -> Engine {
    Engine::new(PolicyTable::uniform(spec))
}

/// Runtime options for tests: stores under `dir`, batch 100, idle tick 100 ms, no catch-up
/// pacing, shutdown deadline 2 s.
pub fn options(dir: &Path) -> RuntimeOptions {
    let mut o = RuntimeOptions::from_config(&settle::config::Config::default());
    o.data_dir = dir.to_path_buf();
    o.batch_size = 100;
    o.idle_tick = Duration::from_millis(100);
    o.catch_up_rate = 0;
    o.shutdown_deadline = Duration::from_secs(2);
    o
}

/// A running runtime: its status, its shutdown token and its task.
pub struct Running {
    pub status: StatusBoard,
    pub shutdown: CancellationToken,
    pub task: JoinHandle<Result<RunSummary, settle::runtime::Error>>,
}

impl Running {
    /// Waits until `pred` holds for the status of every partition.
    pub async fn until(&self, pred: impl FnMut(&StatusMap) -> bool) {
        self.status.wait_for(pred).await;
    }

    /// Graceful stop; returns the summary.
    pub async fn stop(self) -> RunSummary {
        self.shutdown.cancel();
        self.task
            .await
            .expect("runtime task")
            .expect("runtime result")
    }
}

/// Starts the real runtime on `broker` (sink = the broker) with wall clock `clock`.
pub fn start(
    broker: &MemoryBroker,
    engine: Engine,
    options: RuntimeOptions,
    clock: TokioClock,
) -> Running {
    let runtime = Runtime::new(engine, broker.sink(), clock, options).expect("valid options");
    let status = runtime.status();
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(runtime.run(broker.source(GROUP), shutdown.clone()));
    Running {
        status,
        shutdown,
        task,
    }
}

/// Every partition in `n` is present and `f` holds for each.
pub fn all(m: &StatusMap, n: i32, f: impl Fn(&settle::runtime::PartitionStatus) -> bool) -> bool {
    (0..n).all(|p| m.get(&p).is_some_and(&f))
}

/// Opens the store of `partition` (the runtime must be stopped).
pub fn open_store(dir: &Path, partition: i32) -> PartitionStore {
    PartitionStore::open(
        &partition_path(dir, TOPIC, partition),
        &StoreOptions::default(),
    )
    .expect("store opens")
}

/// Decodes the emissions the broker acknowledged, with `emitted_at`.
pub fn emitted(broker: &MemoryBroker) -> Vec<(Emission, Millis)> {
    broker
        .output()
        .iter()
        .filter(|m| m.topic != settle::transport::memory::MEMORY_AUDIT_TOPIC)
        .map(|m| {
            let r = settle::codec::decode_ready(&m.payload).expect("ready record");
            (r.emission(), r.emitted_at)
        })
        .collect()
}

/// What an in-memory `Driver` + `MemTable` replay of `uploads` (sorted by event time, as
/// one stream: partition time = the largest event time so far) emits, all rounds flushed at
/// the end. The reference the runtime is compared with.
pub fn reference(engine: &Engine, uploads: &[settle::engine::Upload]) -> Vec<Emission> {
    use settle::engine::{Driver, MemTable};
    let mut driver = Driver::new(engine.clone());
    let mut table = MemTable::new();
    let mut out = Vec::new();
    let mut now = Millis::MIN;
    for u in uploads {
        now = now.max(u.event_time);
        let Ok(_) = driver.apply(&mut table, now, u, &mut out);
    }
    let Ok(_) = driver.advance(&mut table, Millis::MAX, &mut out);
    out
}

/// `emissions` sorted by id, for comparing runs that interleave keys differently.
pub fn by_id(mut emissions: Vec<Emission>) -> Vec<Emission> {
    emissions.sort_by_key(|e| (e.key.clone(), e.generation));
    emissions
}

/// A temp data dir, a memory broker, a paused-time wall clock at [`T0`] and an engine.
pub struct Fixture {
    pub dir: tempfile::TempDir,
    pub broker: MemoryBroker,
    pub clock: TokioClock,
    pub engine: Engine,
}

/// A [`Fixture`] with `partitions` input partitions and policy `spec` for every tenant.
pub fn fixture(partitions: i32, spec: PolicySpec) -> Fixture {
    Fixture {
        dir: tempfile::tempdir().expect("temp dir"),
        broker: MemoryBroker::new(TOPIC, partitions),
        clock: TokioClock::starting_at(T0),
        engine: engine(spec),
    }
}

impl Fixture {
    /// Starts the runtime with [`options`].
    pub fn start(&self) -> Running {
        self.start_with(options(self.dir.path()))
    }

    /// Starts the runtime with `options`.
    pub fn start_with(&self, options: RuntimeOptions) -> Running {
        start(&self.broker, self.engine.clone(), options, self.clock)
    }

    /// Starts a runtime named `member` (its own memory source, as one instance of a
    /// consumer group) with stores under `dir`, owning `partitions` at start.
    pub fn start_member(&self, member: &str, dir: &Path, partitions: &[i32]) -> Running {
        let runtime = Runtime::new(
            self.engine.clone(),
            self.broker.sink(),
            self.clock,
            options(dir),
        )
        .expect("valid options");
        let status = runtime.status();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(runtime.run(
            self.broker.source_with(member, partitions),
            shutdown.clone(),
        ));
        Running {
            status,
            shutdown,
            task,
        }
    }

    /// Opens the store of `partition` (the runtime must be stopped).
    pub fn store(&self, partition: i32) -> PartitionStore {
        open_store(self.dir.path(), partition)
    }

    /// Runs the runtime until `pred` holds, then stops it.
    pub async fn run_until(&self, pred: impl FnMut(&StatusMap) -> bool) -> RunSummary {
        let run = self.start();
        run.until(pred).await;
        run.stop().await
    }
}
