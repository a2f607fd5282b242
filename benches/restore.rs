//! Restore time of one partition store from the changelog (issue "state handoff"): a store
//! with `SETTLE_BENCH_SESSIONS` (default 100 000) pending sessions is built through the real
//! engine and store with change recording on, its changes are appended to a changelog, then
//! `runtime::restore::open_and_restore` rebuilds it in an empty directory, as a new owner
//! does after a rebalance.
//!
//! Three changelogs: the memory sink's (the RocksDB side alone), Kafka's (a fresh one-
//! partition topic on `SETTLE_TEST_KAFKA`, default `127.0.0.1:9092`) and JetStream's (fresh
//! changelog streams on `SETTLE_TEST_NATS`, default `127.0.0.1:4222`, file storage, issue
//! 15); a broker that does not answer is skipped with a message. Run: `cargo bench --bench
//! restore` (release). Prints one line per changelog: sessions, changelog records and bytes,
//! restore time, records/s. JetStream keeps one message per key (`max-msgs-per-subject = 1`),
//! so its restore reads fewer records than were appended (each batch's `meta` keys once).

use settle::engine::{Driver, Engine, Millis, PolicySpec, PolicyTable, SessionKey, Upload};
use settle::runtime::restore::open_and_restore;
use settle::runtime::StatusBoard;
use settle::store::{Change, MemoryBudget, PartitionStore, StoreOptions};
use settle::transport::kafka::{KafkaConfig, KafkaSink};
use settle::transport::memory::MemoryBroker;
use settle::transport::nats::{self, NatsConfig, NatsSink, Storage};
use settle::transport::Sink;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

const T0: Millis = 1_767_225_600_000;
const BATCH: usize = 1_000;

/// Builds a store of `sessions` pending sessions (one upload each, 1 h fixed delay) and
/// returns its recorded changes, in store-write order.
fn build_changes(dir: &std::path::Path, sessions: usize) -> Vec<Vec<Change>> {
    let mut store = PartitionStore::open(dir, &StoreOptions::default()).expect("store");
    store.record_changes(true);
    let engine = Engine::new(PolicyTable::uniform(PolicySpec::fixed(3_600_000)));
    let mut driver = Driver::new(engine);
    let mut writes = Vec::new();
    let mut offset = 0i64;
    for chunk in (0..sessions).collect::<Vec<_>>().chunks(BATCH) {
        let mut out = Vec::new();
        let mut batch = store.batch();
        for &i in chunk {
            let now = T0 + i as Millis;
            let key = SessionKey::new(&format!("tenant-{}", i % 100), &format!("session-{i}"));
            driver
                .apply(&mut batch, now, &Upload::plain(key, now), &mut out)
                .expect("apply");
            offset += 1;
        }
        batch.set_offset(offset);
        batch.set_partition_time(T0 + offset);
        batch.commit().expect("commit");
        writes.push(store.take_changes());
    }
    assert_eq!(store.pending_rounds(), sessions as u64);
    writes
}

async fn append_all<K: Sink>(sink: &K, writes: &[Vec<Change>]) {
    let mut acks = Vec::new();
    for w in writes {
        acks.push(sink.append_changes(0, w).expect("append"));
    }
    for a in acks {
        a.await.expect("changelog ack");
    }
}

async fn restore<K: Sink>(
    label: &str,
    sink: &K,
    sessions: usize,
    records: usize,
    bytes: usize,
    exact: bool,
) {
    let dir = tempfile::tempdir().expect("temp dir");
    let options = StoreOptions::default();
    let budget = MemoryBudget::new(&options);
    let status = StatusBoard::new();
    let t = Instant::now();
    let engine = Engine::new(PolicyTable::uniform(PolicySpec::fixed(3_600_000)));
    let (store, report) = open_and_restore(
        sink,
        &engine,
        false,
        &dir.path().join("p0"),
        &options,
        &budget,
        0,
        &status,
        &CancellationToken::new(),
    )
    .await
    .expect("restore")
    .expect("not cancelled");
    let elapsed = t.elapsed();
    assert_eq!(
        store.pending_rounds(),
        sessions as u64,
        "every pending round restored"
    );
    if exact {
        assert_eq!(report.records, records as u64);
    } else {
        assert!(report.records >= sessions as u64 && report.records <= records as u64);
    }
    let records = report.records as usize;
    println!(
        "{label:>6}: {sessions} pending sessions, {records} changelog records ({:.1} MiB): restored in {:.2} s ({:.0} records/s)",
        bytes as f64 / 1_048_576.0,
        elapsed.as_secs_f64(),
        records as f64 / elapsed.as_secs_f64()
    );
}

fn main() {
    let sessions: usize = std::env::var("SETTLE_BENCH_SESSIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000);
    let dir = tempfile::tempdir().expect("temp dir");
    let t = Instant::now();
    let writes = build_changes(dir.path(), sessions);
    let records: usize = writes.iter().map(Vec::len).sum();
    let bytes: usize = writes
        .iter()
        .flatten()
        .map(|c| c.key.len() + c.value.as_ref().map_or(0, Vec::len))
        .sum();
    println!(
        "built a store of {sessions} pending sessions in {:.2} s: {records} changelog records",
        t.elapsed().as_secs_f64()
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio");

    let memory = MemoryBroker::new("uploads", 1);
    memory.enable_changelog();
    let sink = memory.sink();
    rt.block_on(async {
        append_all(&sink, &writes).await;
        restore("memory", &sink, sessions, records, bytes, true).await;
    });

    let bootstrap = std::env::var("SETTLE_TEST_KAFKA").unwrap_or_else(|_| "127.0.0.1:9092".into());
    let topic = format!(
        "restore-bench-{}-{}",
        std::process::id(),
        T0 + t.elapsed().as_millis() as i64
    );
    let kafka = KafkaConfig {
        bootstrap_servers: bootstrap.clone(),
        changelog_topic: Some(topic.clone()),
        ..KafkaConfig::default()
    };
    let created = rt.block_on(async {
        tokio::time::timeout(
            Duration::from_secs(20),
            settle::cli::loadgen::create_topics(&kafka, &[(&topic, 1)]),
        )
        .await
    });
    if matches!(created, Ok(Ok(_))) {
        let sink = KafkaSink::new(&kafka).expect("kafka sink");
        rt.block_on(async {
            let t = Instant::now();
            append_all(&sink, &writes).await;
            println!(
                "kafka: appended {records} records to {topic} in {:.2} s",
                t.elapsed().as_secs_f64()
            );
            restore("kafka", &sink, sessions, records, bytes, true).await;
        });
    } else {
        println!("kafka: no broker at {bootstrap} ({created:?}): Kafka restore not measured");
    }

    let server = std::env::var("SETTLE_TEST_NATS").unwrap_or_else(|_| "127.0.0.1:4222".into());
    let nats_config = NatsConfig {
        servers: format!("nats://{server}"),
        changelog_stream: Some(format!("RESTORE_BENCH_{}", std::process::id())),
        changelog_subject_prefix: Some(format!("restore-bench-{}", std::process::id())),
        storage: Storage::File,
        ..NatsConfig::default()
    };
    rt.block_on(async {
        let connected = tokio::time::timeout(Duration::from_secs(5), async {
            let client = nats::connect(&nats_config).await.ok()?;
            client.flush().await.ok()?;
            Some(client)
        })
        .await;
        let Ok(Some(client)) = connected else {
            println!("nats: no server at {server}: JetStream restore not measured");
            return;
        };
        let js = nats::jetstream(client, 4_096);
        let sink = NatsSink::new(js.clone(), &nats_config);
        // The stream is created by the first read, as at a partition's first start.
        drop(sink.read_changelog(0, 0).await.expect("changelog stream"));
        let t = Instant::now();
        append_all(&sink, &writes).await;
        println!(
            "  nats: appended {records} records to {} in {:.2} s",
            nats_config.changelog_stream_name(0),
            t.elapsed().as_secs_f64()
        );
        restore("nats", &sink, sessions, records, bytes, false).await;
        let _ = js.delete_stream(nats_config.changelog_stream_name(0)).await;
    });
}
