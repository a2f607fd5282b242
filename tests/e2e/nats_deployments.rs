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
//!    disagrees with the body is dead-lettered as `key_mismatch`.
//!
//! Uses the server of `SETTLE_TEST_NATS`, else 127.0.0.1:4222; under CI a missing server is
//! a failure.

use crate::nats_support;

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
    ensure!(cl_a.as_deref() == Some(format!("{}_{}_CHANGELOG", a.nats.input_stream, a.nats.consumer_prefix).as_str()));
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
            got.len() == 4 && got.iter().all(|e| e.key.tenant() == tenant && e.generation == 1),
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
            ensure!(text.contains(&words), "partition {}: {text} lacks {words:?}", s.partition);
        }
    }
    ensure!(run.stop().await.is_err(), "the failed partitions are reported");
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
            .publish_to(p, &format!("kh/{s}-other"), upload_json("kh", s, "u3", "").as_bytes())
            .await?;
    }
    let dir = tempfile::tempdir()?;
    let run = setup.start(&config, dir.path()).await?;
    let status = run.until_idle().await?;
    let dead: u64 = status.values().map(|s| s.dead_letters).sum();
    run.stop().await?;
    let got = emitted(&setup, 4).await?;
    ensure!(
        got.len() == 4 && got.iter().all(|e| e.uploads == 2),
        "each round holds the upload without header and the one with the right header: {got:?}"
    );
    let dlq = setup.dead_letters(4).await?;
    ensure!(dead == 4 && dlq.len() == 4, "{dead} dead letters, {} on the subject", dlq.len());
    for d in &dlq {
        ensure!(d.header(DLQ_REASON_HEADER) == Some("key_mismatch"), "{:?}", d.headers);
        ensure!(d.header(nats::KEY_HEADER).is_some_and(|k| k.ends_with("-other")));
    }
    println!("uploads without settle-key applied; 4 wrong headers dead-lettered");
    setup.cleanup().await;
    Ok(())
}
