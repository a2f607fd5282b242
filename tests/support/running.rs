//! A settle runtime running in process on the test's tokio runtime (the Kafka and NATS
//! pipeline tests): wait until it is idle, stop it gracefully.
#![allow(dead_code)]

use anyhow::{bail, ensure, Context as _, Result};
use settle::runtime::{RunSummary, Runtime, StatusBoard, StatusMap};
use settle::transport::{Sink, Source};
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// A settle instance running in process.
pub struct Running {
    /// Its partitions' status.
    pub status: StatusBoard,
    shutdown: CancellationToken,
    task: JoinHandle<Result<RunSummary, settle::runtime::Error>>,
    /// Input partitions it is expected to own (`0..partitions`).
    partitions: i32,
    /// Bound on one wait.
    step: Duration,
}

impl Running {
    /// Spawns `runtime.run(source)` on the current tokio runtime.
    pub fn spawn<K: Sink, C: settle::runtime::Clock, S: Source + Send + 'static>(
        runtime: Runtime<K, C>,
        source: S,
        partitions: i32,
        step: Duration,
    ) -> Running {
        let status = runtime.status();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(runtime.run(source, shutdown.clone()));
        Running {
            status,
            shutdown,
            task,
            partitions,
            step,
        }
    }

    /// Waits until every input partition is caught up with nothing pending or owed; fails
    /// if a partition failed.
    pub async fn until_idle(&self) -> Result<StatusMap> {
        let n = self.partitions;
        let idle = |m: &StatusMap| {
            m.values().any(|s| s.is_failed())
                || (0..n).all(|p| m.get(&p).is_some_and(|s| s.is_idle()))
        };
        let step = self.step;
        tokio::time::timeout(step, self.status.wait_for(idle))
            .await
            .with_context(|| format!("not idle within {step:?}: {:#?}", self.status.snapshot()))?;
        let m = self.status.snapshot();
        if let Some(s) = m.values().find(|s| s.is_failed()) {
            bail!("partition {} failed: {:?}", s.partition, s.state);
        }
        Ok(m)
    }

    /// Graceful stop; fails if a partition failed.
    pub async fn stop(self) -> Result<RunSummary> {
        self.shutdown.cancel();
        let summary = tokio::time::timeout(self.step, self.task).await???;
        ensure!(
            summary.failed().is_empty(),
            "failed: {:?}",
            summary.failed()
        );
        Ok(summary)
    }
}
