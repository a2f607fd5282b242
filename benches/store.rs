//! Partition store throughput and footprint.
//!
//! * `cargo bench --bench store`: criterion. One input batch of 1 000 uploads over a mix of
//!   keys applied through `engine::Driver` into a store batch, its emissions pushed to the
//!   outbox, committed in one write (WAL on; also fsync per commit and WAL off for
//!   comparison). Reported as uploads/s (criterion "elem/s").
//! * `STORE_BENCH_PENDING=1000000 STORE_BENCH_DIR=/tmp/settle-1m cargo bench --bench store`:
//!   not criterion. If `STORE_BENCH_DIR` holds no store, creates one with that many pending
//!   sessions (one open round each) and prints RSS; then, and on every later run, times
//!   opening the store and finding the first due timer, and prints RSS after it; then walks
//!   every pending round in the admin listing's slices (`runtime::pending`) and prints the
//!   time per slice (what a listing costs the partition's input) and for the whole walk.

use criterion::{BatchSize, Criterion, Throughput};
use settle::engine::{Driver, Engine, Millis, PolicySpec, PolicyTable, SessionKey, Upload};
use settle::store::{PartitionStore, StoreOptions};
use std::path::Path;
use std::time::{Duration, Instant};

const BATCH: usize = 1_000;
const KEYS: u64 = 20_000;

fn engine() -> Engine {
    Engine::new(PolicyTable::uniform(PolicySpec::fixed(2_000)))
}

/// The next input batch: 1 000 uploads 5 ms apart, keys drawn from `KEYS` with a hot set
/// (half the uploads go to 1% of the keys, so rounds coalesce and timers move).
struct Feed {
    seed: u64,
    now: Millis,
}

impl Feed {
    fn next_batch(&mut self) -> Vec<Upload> {
        (0..BATCH)
            .map(|_| {
                self.seed = self
                    .seed
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                let r = self.seed >> 33;
                let k = if r & 1 == 0 {
                    r % (KEYS / 100)
                } else {
                    r % KEYS
                };
                self.now += 5;
                let mut u = Upload::plain(
                    SessionKey::new(&format!("t{}", k % 7), &k.to_string()),
                    self.now,
                );
                u.event_id = Some(format!("e{}", self.now));
                u
            })
            .collect()
    }
}

fn apply_and_commit(
    store: &mut PartitionStore,
    driver: &mut Driver,
    uploads: &[Upload],
    offset: &mut i64,
) {
    let mut batch = store.batch();
    let mut out = Vec::new();
    let mut now = 0;
    for u in uploads {
        now = u.event_time;
        driver.apply(&mut batch, now, u, &mut out).expect("apply");
    }
    for e in &out {
        batch.push_outbox(e).expect("push");
    }
    *offset += uploads.len() as i64;
    batch.set_offset(*offset);
    batch.set_partition_time(now);
    batch.commit().expect("commit");
    // The publisher acknowledges what it sent.
    let seqs: Vec<u64> = store
        .outbox_peek(usize::MAX)
        .expect("peek")
        .iter()
        .map(|e| e.seq)
        .collect();
    store.outbox_ack(&seqs).expect("ack");
}

fn bench_batches(c: &mut Criterion) {
    let mut group = c.benchmark_group("store");
    group.throughput(Throughput::Elements(BATCH as u64));
    group.measurement_time(Duration::from_secs(10));
    let variants = [
        ("wal", StoreOptions::default()),
        (
            "wal_fsync",
            StoreOptions {
                sync: true,
                ..StoreOptions::default()
            },
        ),
        (
            "no_wal",
            StoreOptions {
                wal: false,
                ..StoreOptions::default()
            },
        ),
    ];
    for (name, options) in variants {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut store = PartitionStore::open(dir.path(), &options).expect("open");
        let mut driver = Driver::new(engine());
        let mut feed = Feed {
            seed: 7,
            now: 1_700_000_000_000,
        };
        let mut offset = 0;
        // Warm up to a steady state: every key known, timers firing.
        for _ in 0..50 {
            let uploads = feed.next_batch();
            apply_and_commit(&mut store, &mut driver, &uploads, &mut offset);
        }
        group.bench_function(format!("apply_1000_uploads_commit/{name}"), |b| {
            b.iter_batched(
                || feed.next_batch(),
                |uploads| apply_and_commit(&mut store, &mut driver, &uploads, &mut offset),
                BatchSize::SmallInput,
            )
        });
    }
    group.finish();
}

/// `VmRSS` and `VmHWM` (peak) of this process, in MiB.
fn rss_mib() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<u64>().ok())
            .map_or(0, |kb| kb / 1024)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

fn pending_sessions(n: u64, dir: &Path) {
    let options = StoreOptions::default();
    if !dir.join("CURRENT").exists() {
        let start = Instant::now();
        let mut store = PartitionStore::open(dir, &options).expect("open");
        let mut driver = Driver::new(Engine::new(PolicyTable::uniform(PolicySpec::fixed(
            3_600_000,
        ))));
        let t0: Millis = 1_700_000_000_000;
        let mut i = 0;
        while i < n {
            let mut batch = store.batch();
            let mut out = Vec::new();
            for _ in 0..10_000.min(n - i) {
                let key =
                    SessionKey::new(&format!("tenant-{}", i % 97), &format!("session-{i:08}"));
                let mut u = Upload::plain(key, t0 + i as Millis);
                u.event_id = Some(format!("upload-{i}"));
                driver
                    .apply(&mut batch, t0 + i as Millis, &u, &mut out)
                    .expect("apply");
                i += 1;
            }
            assert!(out.is_empty());
            batch.set_offset(i as i64);
            batch.set_partition_time(t0 + i as Millis);
            batch.commit().expect("commit");
        }
        let (rss, hwm) = rss_mib();
        println!(
            "created {n} pending sessions in {:.1?}: pending_rounds={} RSS={rss} MiB peak={hwm} MiB",
            start.elapsed(),
            store.pending_rounds()
        );
        drop(store);
    }
    let start = Instant::now();
    let store = PartitionStore::open(dir, &options).expect("open");
    let opened = start.elapsed();
    let first = store.next_timer().expect("next timer");
    let total = start.elapsed();
    let mut store = store;
    let due_in_batch = {
        let t = Instant::now();
        let first_due = settle::engine::SessionTable::first_due(&mut store.batch(), Millis::MAX)
            .expect("first_due");
        assert_eq!(first_due, first);
        t.elapsed()
    };
    let (rss, hwm) = rss_mib();
    println!(
        "open {opened:.1?}, open + first timer {total:.1?} (batch first_due {due_in_batch:.1?}): \
         first={first:?} pending_rounds={} RSS={rss} MiB peak={hwm} MiB",
        store.pending_rounds()
    );
    list_pending(&mut store);
}

/// The admin's pending-work listing (`runtime::pending`): a walk over every timer in slices
/// of `SLICE_TIMERS`, as the partition task answers them between two polls. Prints the
/// longest slice (how long the partition's input waits at most per query), the median and
/// the whole walk.
fn list_pending(store: &mut PartitionStore) {
    let n = settle::runtime::pending::SLICE_TIMERS;
    for pass in ["first walk (sorts the timer buckets)", "second walk"] {
        let mut after = None;
        let mut times = Vec::new();
        let (mut rounds, mut uploads) = (0u64, 0u64);
        let start = Instant::now();
        loop {
            let t = Instant::now();
            let next = store
                .timer_slice(after.as_ref(), n, |_, _, state| {
                    if let Some(r) = &state.round {
                        rounds += 1;
                        uploads += u64::from(r.uploads);
                    }
                    true
                })
                .expect("slice");
            times.push(t.elapsed());
            match next {
                Some(next) => after = Some(next),
                None => break,
            }
        }
        let whole = start.elapsed();
        times.sort();
        println!(
            "pending listing, {pass}: {rounds} rounds ({uploads} uploads) in {} slices of {n} timers, \
             {whole:.1?} in all; per slice median {:.2?}, p99 {:.2?}, max {:.2?}",
            times.len(),
            times[times.len() / 2],
            times[times.len() * 99 / 100],
            times[times.len() - 1],
        );
    }
}

criterion::criterion_group!(benches, bench_batches);

fn main() {
    if let Some(n) = std::env::var("STORE_BENCH_PENDING")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        let dir =
            std::env::var("STORE_BENCH_DIR").unwrap_or_else(|_| "/tmp/settle-store-bench".into());
        pending_sessions(n, Path::new(&dir));
        return;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
