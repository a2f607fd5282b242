//! settle end to end on a real NATS JetStream server: the partition runtime (RocksDB stores,
//! outbox publisher) over the NATS transport, in process. Every test uses streams, subjects
//! and consumers of its own and deletes its streams at the end.
//!
//! 1. `nats_pipeline_matches_simulate`: uploads of every scenario published to their
//!    partitions' subjects, read back with their JetStream timestamps and replayed by
//!    `simulate::replay`; each tier subject holds exactly the emissions the replay makes for
//!    the tenants of that tier (every field but `emitted_at`), with `Nats-Msg-Id`,
//!    `settle-emission-id` and `settle-key` headers; every consumer is then acked to its
//!    partition's end, with ack policy "all" (partition 0's consumer, made beforehand with
//!    explicit acks as an older settle left it, re-created) and one ack per commit: at most
//!    a quarter as many acks on the wire as uploads.
//! 2. `nats_bad_records_are_dead_lettered`: messages that fail decoding land on the
//!    dead-letter subject with the reason and source headers; the uploads around them are
//!    applied.
//! 3. `nats_server_restart_loses_no_round`: a nats-server of the test's own (free port, own
//!    store directory) is stopped and restarted while uploads flow and settle runs: every
//!    round is emitted, each emission id once (JetStream de-duplication).
//!
//! They use the server of `SETTLE_TEST_NATS` (scripts/test.sh sets it), else 127.0.0.1:4222;
//! with no server there they fail under CI and say they did not run elsewhere. Test 3 also
//! needs the `nats-server` binary. `SETTLE_LOG` filters the log output.

use crate::kafka_support;
use crate::nats_support;

use anyhow::{ensure, Context as _, Result};
use async_nats::jetstream::consumer::AckPolicy;
use futures::StreamExt;
use kafka_support::{by_id, reference, same_emissions};
use nats_support::{server, trace_of, Setup, STEP};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use settle::cli::loadgen::{self, PlannedUpload, Scenario, Shape};
use settle::codec;
use settle::config::Config;
use settle::engine::Emission;
use settle::transport::kafka::{
    DLQ_REASON_HEADER, DLQ_SOURCE_OFFSET_HEADER, DLQ_SOURCE_PARTITION_HEADER,
    DLQ_SOURCE_TOPIC_HEADER,
};
use settle::transport::nats::{Storage, KEY_HEADER};
use std::collections::BTreeMap;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Adaptive with short delays and a max-wait, a leading-trailing tenant.
const CONFIG: &str = r#"
[debounce]
policy = "adaptive"
min-delay = "1s"
max-delay = "5s"
max-wait = "3s"
[debounce.tenants.lt]
policy = "leading-trailing"
delay = "1s"
"#;

/// The tenant pinned to the `limited` tier.
const PINNED: &str = "pin";

/// Short sessions of every scenario over about `window_ms`: `(at_ms, key, json)` sorted.
fn plan(seed: u64, window_ms: u64) -> Vec<PlannedUpload> {
    let mut rng = StdRng::seed_from_u64(seed);
    let shape = Shape {
        burst_machines: 30,
        burst_spread_ms: 800,
        split_gap_ms: 200,
        trickle_uploads: 8,
        trickle_gap_ms: 300..700,
        tenant_uploads: 6,
        tenant_spread_ms: 400,
    };
    let mut uploads = Vec::new();
    let mut add = |start: u64, plan: Vec<PlannedUpload>| {
        uploads.extend(plan.into_iter().map(|u| PlannedUpload {
            at_ms: start + u.at_ms,
            ..u
        }));
    };
    for s in 0..2 {
        let start = rng.random_range(0..window_ms);
        add(
            start,
            Scenario::Burst.session(&mut rng, "burst", &format!("b{s}"), &shape),
        );
    }
    for s in 0..8 {
        let start = rng.random_range(0..window_ms);
        add(
            start,
            Scenario::Split.session(&mut rng, "split", &format!("run-{s}"), &shape),
        );
    }
    for (tenant, n) in [("trickle", 4), ("lt", 4)] {
        for s in 0..n {
            let start = rng.random_range(0..window_ms);
            add(
                start,
                Scenario::Trickle.session(&mut rng, tenant, &format!("n{s}"), &shape),
            );
        }
    }
    for s in 0..10 {
        let start = rng.random_range(0..window_ms);
        let tenant = if s % 3 == 0 {
            PINNED.to_owned()
        } else {
            format!("t-{}", s % 4)
        };
        add(
            start,
            Scenario::Tenants.session(&mut rng, &tenant, &format!("s{s}"), &shape),
        );
    }
    for s in 0..2 {
        let start = rng.random_range(0..window_ms);
        let mut p = Scenario::Trickle.session(&mut rng, "fin", &format!("job-{s}"), &shape);
        let last = p.last().map_or(0, |u| u.at_ms) + 200;
        p.push(PlannedUpload {
            at_ms: last,
            key: format!("fin/job-{s}"),
            json: loadgen::upload_json("fin", &format!("job-{s}"), "done", r#","final":true"#),
        });
        add(start, p);
    }
    uploads.sort_by(|a, b| (a.at_ms, &a.key).cmp(&(b.at_ms, &b.key)));
    uploads
}

/// Publishes `uploads` in real time (each at its `at_ms` after the start), retrying each
/// until acknowledged (with `Nats-Msg-Id` = key/index, so a retry never duplicates).
async fn publish_live(setup: &Setup, uploads: &[PlannedUpload]) -> Result<()> {
    let start = tokio::time::Instant::now();
    for (i, u) in uploads.iter().enumerate() {
        tokio::time::sleep_until(start + Duration::from_millis(u.at_ms)).await;
        let id = format!("{}/{i}", u.key);
        let t0 = Instant::now();
        loop {
            match setup.publish(&u.key, u.json.as_bytes(), Some(&id)).await {
                Ok(_) => break,
                Err(e) => {
                    ensure!(t0.elapsed() < STEP, "publish of {id} failing: {e:#}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }
    Ok(())
}

/// Emissions of `want` whose tenant is (`pinned`) or is not the pinned one.
fn of_tier(want: &[Emission], pinned: bool) -> Vec<Emission> {
    want.iter()
        .filter(|e| (e.key.tenant() == PINNED) == pinned)
        .cloned()
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_pipeline_matches_simulate() -> Result<()> {
    let Some(addr) = server("nats_pipeline_matches_simulate") else {
        return Ok(());
    };
    let mut setup = Setup::new(&addr, "pipe", Storage::Memory, 3).await?;
    setup
        .tiers
        .pinned
        .insert(PINNED.to_owned(), "limited".to_owned());
    let config = Config::from_toml_str(CONFIG)?;
    // A backlog: published in real time (JetStream stamps the time), then consumed.
    let uploads = plan(21, 3_000);
    publish_live(&setup, &uploads).await?;
    let input = setup.input(uploads.len()).await?;
    ensure!(input.len() == uploads.len(), "read back {}", input.len());
    let want = by_id(reference(
        &config,
        &trace_of(&input, setup.nats.partitions)?,
    )?);

    // Partition 0's consumer as a settle before 2026-12-07 left it: explicit acks. The bind
    // must re-create it with ack policy "all" at the position.
    let stream = setup.js.get_stream(&setup.nats.input_stream).await?;
    stream
        .create_consumer(async_nats::jetstream::consumer::pull::Config {
            durable_name: Some(setup.nats.consumer_name(0)),
            filter_subject: setup.nats.input_subject(0),
            ack_policy: AckPolicy::Explicit,
            ..Default::default()
        })
        .await?;
    // Every ack settle sends, counted on the wire (a core subscriber sees them too).
    let mut acks = setup
        .js
        .client()
        .subscribe(format!("$JS.ACK.{}.>", setup.nats.input_stream))
        .await?;
    setup.js.client().flush().await?;

    let dir = tempfile::tempdir()?;
    let running = setup.start(&config, dir.path()).await?;
    let status = running.until_idle().await?;
    let consumed: u64 = status.values().map(|s| s.records).sum();
    ensure!(
        consumed == uploads.len() as u64,
        "consumed {consumed} of {}",
        uploads.len()
    );
    // Every message acked: each consumer's ack floor is at or past its partition's last
    // sequence (a filtered consumer's floor also passes other partitions' sequences).
    let floors = setup.consumers_settled().await?;
    for r in &input {
        let p = r.partition().context("partition")? as usize;
        ensure!(
            floors[p] >= r.sequence,
            "ack floors {floors:?}: {} of partition {p} not acked",
            r.sequence
        );
    }
    // ... with one ack per commit (ack policy "all"), not one per message.
    for p in 0..setup.nats.partitions as i32 {
        let info = stream.consumer_info(setup.nats.consumer_name(p)).await?;
        ensure!(
            info.config.ack_policy == AckPolicy::All,
            "partition {p}'s consumer acks {:?}",
            info.config.ack_policy
        );
    }
    let mut sent = 0usize;
    while let Ok(Some(_)) = tokio::time::timeout(Duration::from_millis(300), acks.next()).await {
        sent += 1;
    }
    ensure!(
        sent > 0 && sent * 4 <= uploads.len(),
        "{sent} acks for {} uploads: expected one per commit",
        uploads.len()
    );
    running.stop().await?;

    let normal = by_id(setup.emitted("normal", 1).await?);
    same_emissions(&normal, &of_tier(&want, false))?;
    let limited = by_id(setup.emitted("limited", 1).await?);
    same_emissions(&limited, &of_tier(&want, true))?;
    ensure!(!limited.is_empty(), "the pinned tenant emitted nothing");
    let triggers: std::collections::BTreeSet<_> = want.iter().map(|e| e.trigger).collect();
    println!(
        "nats: {} uploads -> {} emissions ({} normal, {} limited) equal to simulate (triggers {triggers:?}); ack floors {floors:?} after {sent} acks",
        uploads.len(),
        want.len(),
        normal.len(),
        limited.len()
    );
    setup.cleanup().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_bad_records_are_dead_lettered() -> Result<()> {
    let Some(addr) = server("nats_bad_records_are_dead_lettered") else {
        return Ok(());
    };
    let setup = Setup::new(&addr, "dlq", Storage::Memory, 3).await?;
    let config = Config::from_toml_str(CONFIG)?;
    // Per key: a good upload, three bad records, a good upload: all in the key's partition;
    // then a good upload in another partition (wrong_partition, not applied anywhere).
    let mut bad: BTreeMap<u64, (String, &str)> = BTreeMap::new();
    let mut published = 0;
    for key in ["dl/a", "dl/b", "dl/c", "dl/d"] {
        let session = &key[3..];
        let good = |id: &str| loadgen::upload_json("dl", session, id, "").into_bytes();
        let recs = [
            (good("u1"), None),
            (b"not json".to_vec(), Some("invalid_json")),
            (
                format!(r#"{{"session":"{session}"}}"#).into_bytes(),
                Some("missing_tenant"),
            ),
            (
                br#"{"tenant":"dl","session":"other"}"#.to_vec(),
                Some("key_mismatch"),
            ),
            (good("u2"), None),
        ];
        let mut home = None;
        for (payload, reason) in recs {
            if let Some(r) = reason {
                let e = codec::decode_upload(Some(key.as_bytes()), &payload, 0, 0)
                    .expect_err("a bad record");
                assert_eq!(e.reason(), r);
            }
            let (p, seq) = setup.publish(key, &payload, None).await?;
            home = Some(p);
            published += 1;
            if let Some(r) = reason {
                bad.insert(seq, (key.to_owned(), r));
            }
        }
        // A well-formed upload on the subject of another partition than its key's.
        let elsewhere = (home.context("published")? + 1) % setup.nats.partitions as i32;
        let seq = setup.publish_to(elsewhere, key, &good("u3")).await?;
        published += 1;
        bad.insert(seq, (key.to_owned(), "wrong_partition"));
    }
    let input = setup.input(published).await?;
    let want = by_id(reference(
        &config,
        &trace_of(&input, setup.nats.partitions)?,
    )?);

    let dir = tempfile::tempdir()?;
    let running = setup.start(&config, dir.path()).await?;
    let status = running.until_idle().await?;
    let dead: u64 = status.values().map(|s| s.dead_letters).sum();
    ensure!(
        dead == bad.len() as u64,
        "{dead} dead letters, want {}",
        bad.len()
    );
    setup.consumers_settled().await?;
    running.stop().await?;

    let dlq = setup.dead_letters(bad.len()).await?;
    ensure!(
        dlq.len() == bad.len(),
        "dead-letter subject holds {}",
        dlq.len()
    );
    for d in &dlq {
        let seq: u64 = d
            .header(DLQ_SOURCE_OFFSET_HEADER)
            .context("offset header")?
            .parse()?;
        let (key, reason) = bad.get(&seq).context("a dead letter of no bad record")?;
        let source = input
            .iter()
            .find(|r| r.sequence == seq)
            .context("source message")?;
        ensure!(
            d.header(DLQ_REASON_HEADER) == Some(*reason),
            "{seq}: {:?}",
            d.headers
        );
        ensure!(d.header(DLQ_SOURCE_TOPIC_HEADER) == Some(setup.nats.input_stream.as_str()));
        ensure!(
            d.header(DLQ_SOURCE_PARTITION_HEADER)
                == source.partition().map(|p| p.to_string()).as_deref()
        );
        ensure!(d.header(KEY_HEADER) == Some(key.as_str()));
        ensure!(d.payload == source.payload, "payload of {seq}");
    }
    let got = by_id(setup.emitted("normal", want.len()).await?);
    same_emissions(&got, &want)?;
    ensure!(
        got.len() == 4 && got.iter().all(|e| e.uploads == 2),
        "good uploads around the bad ones: {got:?}"
    );
    println!(
        "nats: {} bad records dead-lettered with reasons; {} rounds emitted",
        dlq.len(),
        got.len()
    );
    setup.cleanup().await;
    Ok(())
}

/// A nats-server child of the test: its own port and store directory.
struct OwnServer {
    bin: String,
    port: u16,
    store: tempfile::TempDir,
    child: Option<Child>,
}

impl OwnServer {
    /// Starts `nats-server -js` on a free port; `None` (after saying so, or failing under CI)
    /// when the binary is missing.
    fn start() -> Result<Option<OwnServer>> {
        let bin = [
            "nats-server",
            "/usr/sbin/nats-server",
            "/usr/bin/nats-server",
        ]
        .into_iter()
        .find(|b| {
            Command::new(b)
                .arg("--version")
                .stdout(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        });
        let Some(bin) = bin else {
            assert!(
                std::env::var_os("CI").is_none(),
                "CI is set but nats-server is not installed (scripts/nats.sh start installs it)"
            );
            println!("nats-server not found: nats_server_restart_loses_no_round did NOT run");
            return Ok(None);
        };
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let mut server = OwnServer {
            bin: bin.to_owned(),
            port,
            store: tempfile::tempdir()?,
            child: None,
        };
        server.up()?;
        Ok(Some(server))
    }

    fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Starts the process and waits until it accepts connections.
    fn up(&mut self) -> Result<()> {
        let child = Command::new(&self.bin)
            .args([
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-js",
                "-sd",
            ])
            .arg(self.store.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("spawn nats-server")?;
        self.child = Some(child);
        let t0 = Instant::now();
        while std::net::TcpStream::connect(self.addr()).is_err() {
            ensure!(t0.elapsed() < Duration::from_secs(20), "nats-server not up");
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    /// Stops the process with SIGTERM (a restart, not a crash: JetStream flushes its files)
    /// and waits for it.
    fn down(&mut self) -> Result<()> {
        if let Some(mut child) = self.child.take() {
            let ok = Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status()?
                .success();
            ensure!(ok, "kill -TERM nats-server");
            child.wait()?;
        }
        Ok(())
    }
}

impl Drop for OwnServer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_server_restart_loses_no_round() -> Result<()> {
    let Some(mut own) = OwnServer::start()? else {
        return Ok(());
    };
    let setup = Setup::new(&own.addr(), "restart", Storage::File, 3).await?;
    // Every gap inside a session (≤ 0.7 s, plus the outage and the client's reconnect
    // backoff, a few seconds) is shorter than the delay: each session is one round, and no
    // upload can land within the pipeline's latency of a deadline, so live equals replay.
    let config = Config::from_toml_str("[debounce]\npolicy = \"fixed\"\ndelay = \"8s\"")?;
    let uploads = plan(5, 6_000);
    let dir = tempfile::tempdir()?;
    let running = setup.start(&config, dir.path()).await?;

    let publisher = publish_live(&setup, &uploads);
    let restart = async {
        tokio::time::sleep(Duration::from_secs(3)).await;
        tokio::task::block_in_place(|| -> Result<()> {
            own.down()?;
            std::thread::sleep(Duration::from_millis(1_500));
            own.up()
        })
    };
    let (published, restarted) = tokio::join!(publisher, restart);
    published?;
    restarted?;
    println!(
        "nats-server restarted mid-stream; {} uploads published",
        uploads.len()
    );

    let input = setup.input(uploads.len()).await?;
    ensure!(
        input.len() == uploads.len(),
        "the input stream holds {} of {} uploads",
        input.len(),
        uploads.len()
    );
    let want = by_id(reference(
        &config,
        &trace_of(&input, setup.nats.partitions)?,
    )?);
    running.until_idle().await?;
    setup.consumers_settled().await?;
    running.stop().await?;

    let got = setup.emitted("normal", want.len()).await?;
    let mut ids: BTreeMap<String, usize> = BTreeMap::new();
    for e in &got {
        *ids.entry(e.emission_id()).or_default() += 1;
    }
    ensure!(
        ids.values().all(|&n| n == 1),
        "duplicates on the tier subject: {:?}",
        ids.iter().filter(|(_, &n)| n > 1).collect::<Vec<_>>()
    );
    same_emissions(&by_id(got), &want)?;
    println!(
        "nats: {} uploads, {} rounds, all emitted once across a nats-server restart",
        input.len(),
        want.len()
    );
    setup.cleanup().await;
    Ok(())
}
