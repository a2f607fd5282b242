//! NATS deployments apart and uploads without a key header (issue 33, items 5 and 6), on a
//! real JetStream server, settle in process:
//!
//! 1. `nats_two_deployments_with_default_names_run_side_by_side`: two deployments on one
//!    server that differ only in `input-stream` and `consumer-prefix` (changelog and
//!    tier-counts names left to their defaults) run at once: each emits exactly its own
//!    rounds, each has its own changelog streams (the derived names), and each restarted on
//!    an empty data dir restores its own state (the next round of a session is generation 2).
//! 2. `nats_changelog_of_another_input_is_refused`: a deployment pointed at another
//!    deployment's changelog (`changelog-stream` set to it) stops its partitions with a
//!    message naming both inputs and the setting to change, instead of restoring it.
//! 3. `nats_upload_without_key_header_is_applied_wrong_header_dead_lettered`: an upload
//!    without `settle-key` is applied (the key comes from the body), one whose header
//!    disagrees with the body is dead-lettered as `key_mismatch`; `settle loadgen
//!    --nats-no-key-header` publishes without it, and all of that is applied.
//! 4. `nats_scale_down_leaves_partitions_unowned_and_says_so` (item 7): two `settle run`
//!    processes, instances 0 and 1 of 2, heartbeat every second; instance 1 is killed with
//!    SIGKILL: once its assignment record is older than 3 intervals, instance 0 exports
//!    `settle_partitions_unowned` = its 2 partitions and logs the WARN naming them (0 while
//!    both ran).
//!
//! Uses the server of `SETTLE_TEST_NATS`, else 127.0.0.1:4222; under CI a missing server is
//! a failure.

use crate::admin_support::{try_get, Scrape};
use crate::nats_support;
use crate::process_support::{self, json_log, start_run_logged, JsonLog};

use anyhow::{ensure, Context as _, Result};
use nats_support::{server, Setup, STEP};
use settle::cli::loadgen::upload_json;
use settle::config::Config;
use settle::engine::Emission;
use settle::runtime::StatusMap;
use settle::transport::kafka::DLQ_REASON_HEADER;
use settle::transport::nats::{self, Storage};

/// Fixed 1 s rounds.
const CONFIG: &str = "[debounce]\npolicy = \"fixed\"\ndelay = \"1s\"\n";

/// A setup whose changelog and tier-counts names are left to their defaults (derived from
/// its input stream and consumer prefix).
async fn default_names(addr: &str, name: &str) -> Result<Setup> {
    let mut setup = Setup::new(addr, name, Storage::Memory, 2).await?;
    setup.nats.changelog_stream = None;
    setup.nats.changelog_subject_prefix = None;
    setup.nats.tier_counts_bucket = None;
    setup.nats.validate()?;
    ensure!(!setup.nats.is_default_deployment());
    Ok(setup)
}

/// Publishes one upload of each of `sessions` of tenant `tenant`.
async fn publish(setup: &Setup, tenant: &str, sessions: &[&str], id: &str) -> Result<()> {
    for s in sessions {
        let key = format!("{tenant}/{s}");
        setup
            .publish(&key, upload_json(tenant, s, id, "").as_bytes(), None)
            .await?;
    }
    Ok(())
}

/// The emissions of `setup`'s normal tier once there are `n`, sorted by key and generation.
async fn emitted(setup: &Setup, n: usize) -> Result<Vec<Emission>> {
    let mut got = setup.emitted("normal", n).await?;
    got.sort_by(|a, b| (a.key.as_str(), a.generation).cmp(&(b.key.as_str(), b.generation)));
    Ok(got)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_two_deployments_with_default_names_run_side_by_side() -> Result<()> {
    let Some(addr) = server("nats_two_deployments_with_default_names_run_side_by_side") else {
        return Ok(());
    };
    let config = Config::from_toml_str(CONFIG)?;
    let a = default_names(&addr, "depa").await?;
    let b = default_names(&addr, "depb").await?;
    let (cl_a, cl_b) = (a.nats.changelog(), b.nats.changelog());
    ensure!(
        cl_a.is_some() && cl_a != cl_b && a.nats.tier_counts() != b.nats.tier_counts(),
        "derived names must differ: {cl_a:?} {cl_b:?}"
    );
    ensure!(
        cl_a.as_deref()
            == Some(
                format!(
                    "{}_{}_CHANGELOG",
                    a.nats.input_stream, a.nats.consumer_prefix
                )
                .as_str()
            )
    );
    let sessions = ["s1", "s2", "s3", "s4"];
    publish(&a, "ta", &sessions, "u1").await?;
    publish(&b, "tb", &sessions, "u1").await?;

    // Both at once, on one server.
    let (dir_a, dir_b) = (tempfile::tempdir()?, tempfile::tempdir()?);
    let run_a = a.start(&config, dir_a.path()).await?;
    let run_b = b.start(&config, dir_b.path()).await?;
    run_a.until_idle().await?;
    run_b.until_idle().await?;
    let (got_a, got_b) = (emitted(&a, 4).await?, emitted(&b, 4).await?);
    for (got, tenant) in [(&got_a, "ta"), (&got_b, "tb")] {
        ensure!(
            got.len() == 4
                && got
                    .iter()
                    .all(|e| e.key.tenant() == tenant && e.generation == 1),
            "{tenant}: its own 4 rounds, got {got:?}"
        );
    }
    run_a.stop().await?;
    run_b.stop().await?;
    for setup in [&a, &b] {
        for p in 0..2 {
            let name = setup.nats.changelog_stream_name(p);
            setup
                .js
                .get_stream(&name)
                .await
                .with_context(|| format!("changelog stream {name}"))?;
        }
    }

    // Restarted on empty data dirs: each restores its own changelog, so the next round of
    // a session is its second.
    publish(&a, "ta", &sessions, "u2").await?;
    publish(&b, "tb", &sessions, "u2").await?;
    let (dir_a, dir_b) = (tempfile::tempdir()?, tempfile::tempdir()?);
    let run_a = a.start(&config, dir_a.path()).await?;
    let run_b = b.start(&config, dir_b.path()).await?;
    run_a.until_idle().await?;
    run_b.until_idle().await?;
    let (got_a, got_b) = (emitted(&a, 8).await?, emitted(&b, 8).await?);
    for (got, tenant) in [(&got_a, "ta"), (&got_b, "tb")] {
        let second: Vec<&Emission> = got.iter().filter(|e| e.generation == 2).collect();
        ensure!(
            got.len() == 8 && second.len() == 4 && got.iter().all(|e| e.key.tenant() == tenant),
            "{tenant}: 4 second rounds after the restore, got {got:?}"
        );
    }
    run_a.stop().await?;
    run_b.stop().await?;
    println!(
        "two deployments side by side: changelogs {} and {}, 8 rounds each, state restored",
        cl_a.unwrap_or_default(),
        cl_b.unwrap_or_default()
    );
    a.cleanup().await;
    b.cleanup().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_changelog_of_another_input_is_refused() -> Result<()> {
    let Some(addr) = server("nats_changelog_of_another_input_is_refused") else {
        return Ok(());
    };
    let config = Config::from_toml_str(CONFIG)?;
    let a = default_names(&addr, "owna").await?;
    publish(&a, "ta", &["s1", "s2", "s3"], "u1").await?;
    let dir = tempfile::tempdir()?;
    let run = a.start(&config, dir.path()).await?;
    run.until_idle().await?;
    run.stop().await?;

    // Another deployment told to use A's changelog.
    let mut c = default_names(&addr, "othc").await?;
    c.nats.changelog_stream = a.nats.changelog();
    c.nats.changelog_subject_prefix = Some(a.nats.changelog_subject_prefix());
    let dir = tempfile::tempdir()?;
    let run = c.start(&config, dir.path()).await?;
    let failed = |m: &StatusMap| m.len() == 2 && m.values().all(|s| s.is_failed());
    tokio::time::timeout(STEP, run.status.wait_for(failed))
        .await
        .with_context(|| format!("partitions not refused: {:#?}", run.status.snapshot()))?;
    for s in run.status.snapshot().values() {
        let text = format!("{:?}", s.state);
        for words in [
            format!("records input stream {}", a.nats.input_stream),
            format!("reads input stream {}", c.nats.input_stream),
            "nats.changelog-stream".to_owned(),
        ] {
            ensure!(
                text.contains(&words),
                "partition {}: {text} lacks {words:?}",
                s.partition
            );
        }
    }
    ensure!(
        run.stop().await.is_err(),
        "the failed partitions are reported"
    );
    // Nothing of A's state was taken: C emitted nothing.
    ensure!(c.emitted("normal", 0).await?.is_empty());
    println!("another input's changelog refused");
    a.cleanup().await;
    c.cleanup().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_upload_without_key_header_is_applied_wrong_header_dead_lettered() -> Result<()> {
    let Some(addr) = server("nats_upload_without_key_header_is_applied_wrong_header_dead_lettered")
    else {
        return Ok(());
    };
    let config = Config::from_toml_str(CONFIG)?;
    let setup = Setup::new(&addr, "nokey", Storage::Memory, 3).await?;
    let sessions = ["a", "b", "c", "d"];
    for s in sessions {
        let key = format!("kh/{s}");
        // Without the header, with the right one, then with a wrong one on the same subject.
        let (p, _) = setup
            .publish_with(&key, upload_json("kh", s, "u1", "").as_bytes(), None, false)
            .await?;
        setup
            .publish_with(&key, upload_json("kh", s, "u2", "").as_bytes(), None, true)
            .await?;
        setup
            .publish_to(
                p,
                &format!("kh/{s}-other"),
                upload_json("kh", s, "u3", "").as_bytes(),
            )
            .await?;
    }
    // And `settle loadgen --nats-no-key-header`: a few seconds of mixed traffic, no header.
    let mut gen = process_support::nats_loadgen(&setup.nats, "2s", "2", "7");
    let status = gen
        .arg("--nats-no-key-header")
        .status()
        .context("settle loadgen")?;
    ensure!(status.success(), "loadgen: {status}");
    let input = setup.input(13).await?;
    let generated: Vec<_> = input
        .iter()
        .filter(|r| !r.payload.starts_with(br#"{"tenant":"kh""#))
        .collect();
    ensure!(
        generated.len() > 10
            && generated
                .iter()
                .all(|r| r.header(nats::KEY_HEADER).is_none()),
        "loadgen published {} uploads, some with a settle-key header",
        generated.len()
    );
    let dir = tempfile::tempdir()?;
    let run = setup.start(&config, dir.path()).await?;
    let status = run.until_idle().await?;
    // Only the 4 wrong headers are dead letters: every upload without a header was applied.
    let dead: u64 = status.values().map(|s| s.dead_letters).sum();
    run.stop().await?;
    let mut got = emitted(&setup, 4).await?;
    got.retain(|e| e.key.tenant() == "kh");
    ensure!(
        got.len() == 4 && got.iter().all(|e| e.uploads == 2),
        "each round holds the upload without header and the one with the right header: {got:?}"
    );
    let dlq = setup.dead_letters(4).await?;
    ensure!(
        dead == 4 && dlq.len() == 4,
        "{dead} dead letters, {} on the subject",
        dlq.len()
    );
    for d in &dlq {
        ensure!(
            d.header(DLQ_REASON_HEADER) == Some("key_mismatch"),
            "{:?}",
            d.headers
        );
        ensure!(d
            .header(nats::KEY_HEADER)
            .is_some_and(|k| k.ends_with("-other")));
    }
    println!("uploads without settle-key applied; 4 wrong headers dead-lettered");
    setup.cleanup().await;
    Ok(())
}

/// The WARN of an instance that sees partitions nobody owns (`service::assignments`).
const UNOWNED: &str = "nats: PARTITIONS NOBODY OWNS: no live instance reads them, their uploads wait and their rounds do not fire. An instance is down, or the deployment was scaled down without lowering nats.instances: start the missing instance(s) or set nats.instances on every instance to the number running (settle_partitions_unowned)";

/// `settle_partitions_unowned` of the process whose admin server is at `admin`, if it
/// answers.
fn unowned_gauge(rt: &tokio::runtime::Runtime, admin: &str) -> Option<f64> {
    let addr = admin.parse().ok()?;
    let (status, text) = rt.block_on(try_get(addr, "/metrics")).ok()?;
    (status == 200).then(|| Scrape::parse(&text).sum("settle_partitions_unowned", &[]))
}

#[test]
fn nats_scale_down_leaves_partitions_unowned_and_says_so() -> Result<()> {
    let Some(addr) = server("nats_scale_down_leaves_partitions_unowned_and_says_so") else {
        return Ok(());
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let setup = rt.block_on(Setup::new(&addr, "scale", Storage::Memory, 4))?;
    let dir = tempfile::tempdir()?;
    // Instance 1 starts first and is ready (its heartbeats written) before instance 0
    // starts: instance 0's first check (after 3 intervals) then sees a live instance 1 even
    // when a loaded machine starts processes seconds apart (CI, 2026-12-06: the WARN
    // asserted absent below was logged, rightly, while instance 1 was not yet there).
    let mut procs = Vec::new();
    for index in [1u32, 0] {
        let text = format!(
            "transport = \"nats\"\n{}{}",
            process_support::debounce_store_runtime(
                &dir.path().join(format!("data-{index}")),
                std::time::Duration::from_secs(10)
            ),
            setup.run_config_sections(index, 2)
        );
        let config = dir.path().join(format!("i{index}.toml"));
        std::fs::write(&config, text)?;
        let admin = process_support::Tansu::free_addr()?;
        let log = dir.path().join(format!("i{index}.log"));
        let child = start_run_logged(
            &config,
            &[
                ("SETTLE_NATS__HEARTBEAT_INTERVAL", "1s"),
                ("SETTLE_ADMIN__LISTEN", admin.as_str()),
            ],
            &log,
        )?;
        procs.push((child, admin, log));
        {
            let started = std::time::Instant::now();
            let (child, admin, log) = procs.last_mut().context("an instance")?;
            let addr: std::net::SocketAddr = admin.parse()?;
            while rt.block_on(try_get(addr, "/readyz")).map(|r| r.0).ok() != Some(200) {
                if let Some(status) = child.try_wait()? {
                    anyhow::bail!(
                        "settle run exited ({status}):\n{}",
                        json_log(log)?.trouble(20)
                    );
                }
                ensure!(
                    started.elapsed() < STEP,
                    "instance {index} not ready after {STEP:?}:\n{}",
                    json_log(log)?.trouble(20)
                );
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
        }
    }
    procs.reverse();
    let log0 = |procs: &[(std::process::Child, String, std::path::PathBuf)]| -> Result<JsonLog> {
        json_log(&procs[0].2)
    };
    // Both running and ready: after more than 3 heartbeats of instance 0 (its first check),
    // nothing is unowned.
    let t0 = std::time::Instant::now();
    while t0.elapsed() < std::time::Duration::from_secs(5) {
        for (child, _, log) in procs.iter_mut() {
            if let Some(status) = child.try_wait()? {
                anyhow::bail!(
                    "settle run exited ({status}):\n{}",
                    json_log(log)?.trouble(20)
                );
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    ensure!(
        unowned_gauge(&rt, &procs[0].1) == Some(0.0),
        "both instances run: {:?}",
        unowned_gauge(&rt, &procs[0].1)
    );
    ensure!(log0(&procs)?.with_message(UNOWNED).next().is_none());

    // Instance 1 is gone (no lowering of nats.instances): its partitions 1 and 3 are unowned.
    procs[1].0.kill()?;
    procs[1].0.wait()?;
    let killed = std::time::Instant::now();
    loop {
        if unowned_gauge(&rt, &procs[0].1) == Some(2.0) {
            break;
        }
        ensure!(
            killed.elapsed() < STEP,
            "settle_partitions_unowned not 2: {:?}\n{}",
            unowned_gauge(&rt, &procs[0].1),
            log0(&procs)?.trouble(20)
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    let noticed = killed.elapsed();
    ensure!(
        noticed >= std::time::Duration::from_secs(2),
        "reported after {noticed:?}, before the record was 3 intervals old"
    );
    let log = log0(&procs)?;
    let warns: Vec<_> = log.with_message(UNOWNED).collect();
    ensure!(
        warns.len() == 1
            && warns[0].level == "WARN"
            && warns[0].partitions("unowned") == Some(vec![1, 3]),
        "one WARN naming partitions 1 and 3: {:?}",
        warns.iter().map(|e| e.brief()).collect::<Vec<_>>()
    );
    process_support::sigterm(&mut procs[0].0, std::time::Duration::from_secs(10))?;
    println!("instance 1 killed: instance 0 reported partitions [1, 3] unowned after {noticed:?}");
    rt.block_on(setup.cleanup());
    Ok(())
}
