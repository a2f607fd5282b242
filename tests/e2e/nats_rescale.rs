//! Issue 15: on NATS JetStream a partition moves with its pending rounds (the changelog
//! streams, `transport::nats::changelog`), and the changelog fences a second writer.
//!
//! * `nats_two_instances_sigkill_rescale_to_three`: 2 `settle run` processes (instance 0 and
//!   1 of 2, 8 partitions, each its own data dir) under `settle loadgen --nats` traffic (the
//!   mixed scenarios over 30 tenants); instance 1 is SIGKILLed and instance 0 stopped, then the
//!   deployment starts again as 3 instances (index 0 and 1 on their old data dirs, index 2 on
//!   a new one), so partitions 2, 3, 4 and 5 change owner, two of them from the killed
//!   instance. Afterwards every upload is covered: for each session, the `uploads` of its
//!   distinct emissions add up to the uploads produced for it; all copies of one emission id
//!   are identical; and the restores are in the logs.
//! * `nats_same_index_twice_is_fenced`: two processes given the same index (both own every
//!   partition) under traffic. The second claims each partition in its changelog; the first
//!   is fenced at its next append and stops (exit code 1), so it publishes nothing more; the
//!   second is never fenced; no upload is lost.
//!
//! Uses the server of `SETTLE_TEST_NATS`, else 127.0.0.1:4222; under CI a missing server is
//! a failure.

use crate::nats_support;
use crate::process_support;

use anyhow::{ensure, Context as _, Result};
use nats_support::{server, Setup, STEP};
use process_support::{json_log, sigterm, start_run_logged, wait_exit, JsonLog};
use settle::engine::Emission;
use settle::transport::nats::{self, Storage, StreamRecord};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

const SHUTDOWN_DEADLINE: Duration = Duration::from_secs(10);
const PARTITIONS: u32 = 8;
/// The log line of a partition's claim at the end of its restore (`runtime::restore`).
const CLAIMED: &str =
    "partition claimed in its changelog: any other writer of it is fenced at its next append";
/// The log line of a fenced partition (`runtime::partition`).
const FENCED: &str = "partition fenced by its changelog: this instance stops publishing, appending and acking input for it; the other owner continues it";

/// Writes the config of instance `index` of `instances` with stores in `data_dir`.
fn config(
    setup: &Setup,
    dir: &Path,
    name: &str,
    data_dir: &Path,
    index: u32,
    instances: u32,
) -> Result<PathBuf> {
    let text = format!(
        "transport = \"nats\"\n{}{}",
        process_support::debounce_store_runtime(data_dir, SHUTDOWN_DEADLINE),
        setup.run_config_sections(index, instances)
    );
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, text)?;
    Ok(path)
}

/// A running `settle run` and its JSON log.
struct Proc {
    name: String,
    child: Child,
    log: PathBuf,
}

impl Proc {
    fn start(dir: &Path, name: &str, config: &Path) -> Result<Proc> {
        let log = dir.join(format!("{name}.log"));
        let child = start_run_logged(config, &[], &log)?;
        Ok(Proc {
            name: name.to_owned(),
            child,
            log,
        })
    }

    fn log(&self) -> Result<JsonLog> {
        json_log(&self.log)
    }

    fn ensure_running(&mut self) -> Result<()> {
        if let Some(status) = self.child.try_wait()? {
            anyhow::bail!(
                "{} exited early ({status}):\n{}",
                self.name,
                self.log()?.trouble(20)
            );
        }
        Ok(())
    }

    /// Waits until the log says every partition of `partitions` was restored.
    fn wait_restored(&mut self, partitions: &BTreeSet<i32>) -> Result<()> {
        let t0 = Instant::now();
        loop {
            self.ensure_running()?;
            let done: BTreeSet<i32> = self
                .log()?
                .with_message(CLAIMED)
                .filter_map(|e| e.int("partition"))
                .map(|p| p as i32)
                .collect();
            if partitions.is_subset(&done) {
                return Ok(());
            }
            ensure!(
                t0.elapsed() < STEP,
                "{}: partitions {:?} not claimed within {STEP:?}:\n{}",
                self.name,
                partitions.difference(&done).collect::<Vec<_>>(),
                self.log()?.trouble(20)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// The test's directory (logs, configs, stores): kept after the test when
/// `SETTLE_TEST_KEEP_DIR` is set (its path is printed), else removed.
fn keep_or_temp() -> Result<tempfile::TempDir> {
    let mut dir = tempfile::tempdir()?;
    if std::env::var_os("SETTLE_TEST_KEEP_DIR").is_some() {
        dir.disable_cleanup(true);
        println!("test directory kept: {}", dir.path().display());
    }
    Ok(dir)
}

impl Drop for Proc {
    /// A test that fails leaves no process behind.
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Uploads produced per session key, from the input stream read back.
fn uploads_per_key(input: &[StreamRecord]) -> BTreeMap<String, u32> {
    let mut out = BTreeMap::new();
    for r in input {
        if let Some(k) = r.header(nats::KEY_HEADER) {
            *out.entry(k.to_owned()).or_default() += 1;
        }
    }
    out
}

/// The two checks on the ready records `got` (every copy, as read from the tier
/// subjects): copies of one id are identical, and each session's distinct emissions cover
/// exactly its uploads. Returns (distinct emissions, copies beyond the first).
fn check_coverage(got: &[Emission], produced: &BTreeMap<String, u32>) -> Result<(usize, usize)> {
    let mut by_id: BTreeMap<String, &Emission> = BTreeMap::new();
    let mut copies = 0;
    for e in got {
        match by_id.get(&e.emission_id()) {
            Some(first) => {
                ensure!(
                    *first == e,
                    "two different records under emission id {}:\n{first:?}\n{e:?}",
                    e.emission_id()
                );
                copies += 1;
            }
            None => {
                by_id.insert(e.emission_id(), e);
            }
        }
    }
    let mut covered: BTreeMap<String, u32> = BTreeMap::new();
    for e in by_id.values() {
        *covered.entry(e.key.as_str().to_owned()).or_default() += e.uploads;
    }
    let wrong: Vec<String> = produced
        .iter()
        .filter(|(k, n)| covered.get(*k) != Some(n))
        .map(|(k, n)| {
            format!(
                "{k}: {n} produced, {} emitted",
                covered.get(k).copied().unwrap_or(0)
            )
        })
        .chain(
            covered
                .iter()
                .filter(|(k, _)| !produced.contains_key(*k))
                .map(|(k, n)| format!("{k}: {n} emitted, none produced")),
        )
        .collect();
    let lost: u32 = produced
        .iter()
        .map(|(k, n)| n.saturating_sub(covered.get(k).copied().unwrap_or(0)))
        .sum();
    ensure!(
        wrong.is_empty(),
        "{} of {} sessions not covered exactly ({lost} uploads missing), e.g.:\n{}",
        wrong.len(),
        produced.len(),
        wrong
            .iter()
            .take(10)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
    Ok((by_id.len(), copies))
}

/// Every ready record on both tier subjects, waiting until the sessions' emissions cover
/// `produced` (or `STEP` passed): the rounds of the last uploads come out a few seconds after
/// loadgen ends.
fn wait_covered(
    rt: &tokio::runtime::Runtime,
    setup: &Setup,
    produced: &BTreeMap<String, u32>,
    procs: &mut [&mut Proc],
) -> Result<Vec<Emission>> {
    let want: u32 = produced.values().sum();
    let t0 = Instant::now();
    loop {
        let mut got = rt.block_on(setup.emitted("normal", 0))?;
        got.extend(rt.block_on(setup.emitted("limited", 0))?);
        let mut seen = BTreeSet::new();
        let covered: u32 = got
            .iter()
            .filter(|e| seen.insert(e.emission_id()))
            .map(|e| e.uploads)
            .sum();
        if covered >= want || t0.elapsed() >= STEP {
            return Ok(got);
        }
        for p in procs.iter_mut() {
            p.ensure_running()?;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// Waits for loadgen `gen` to finish, then until the ready records cover every upload of the
/// input stream (`wait_covered`, `procs` checked running meanwhile), and checks the coverage
/// (`check_coverage`). Returns (uploads, sessions, distinct emissions, copies).
fn loadgen_done_and_covered(
    rt: &tokio::runtime::Runtime,
    setup: &Setup,
    gen: &mut Child,
    procs: &mut [&mut Proc],
) -> Result<(usize, usize, usize, usize)> {
    let status = wait_exit(gen, STEP)?.context("loadgen did not finish")?;
    ensure!(status.success(), "loadgen failed: {status}");
    let input = rt.block_on(setup.input(1))?;
    let produced = uploads_per_key(&input);
    let got = wait_covered(rt, setup, &produced, procs)?;
    let (distinct, copies) = check_coverage(&got, &produced)?;
    Ok((input.len(), produced.len(), distinct, copies))
}

#[test]
fn nats_two_instances_sigkill_rescale_to_three() -> Result<()> {
    let Some(addr) = server("nats_two_instances_sigkill_rescale_to_three") else {
        return Ok(());
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let setup = rt.block_on(Setup::new(&addr, "rescale", Storage::Memory, PARTITIONS))?;
    let dir = keep_or_temp()?;
    let data: Vec<PathBuf> = (0..3)
        .map(|i| dir.path().join(format!("data{i}")))
        .collect();

    // Two instances, then ~24 s of traffic over 30 tenants.
    let mut a = Proc::start(
        dir.path(),
        "a0of2",
        &config(&setup, dir.path(), "a0of2", &data[0], 0, 2)?,
    )?;
    let mut b = Proc::start(
        dir.path(),
        "b1of2",
        &config(&setup, dir.path(), "b1of2", &data[1], 1, 2)?,
    )?;
    a.wait_restored(&[0, 2, 4, 6].into())?;
    b.wait_restored(&[1, 3, 5, 7].into())?;
    let mut gen = process_support::nats_loadgen(&setup.nats, "24s", "30", "15")
        .spawn()
        .context("spawn settle loadgen")?;
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(8) {
        a.ensure_running()?;
        b.ensure_running()?;
        std::thread::sleep(Duration::from_millis(50));
    }
    // SIGKILL one, stop the other: the deployment goes down, pending rounds on both.
    b.child.kill()?;
    b.child.wait()?;
    sigterm(&mut a.child, SHUTDOWN_DEADLINE)?;
    ensure!(
        gen.try_wait()?.is_none(),
        "loadgen finished before the re-scale"
    );
    let before = rt.block_on(setup.emitted("normal", 0))?.len();
    println!("instance 1 SIGKILLed and instance 0 stopped 8 s into the traffic ({before} records out); starting 3 instances");

    let mut three: Vec<Proc> = Vec::new();
    for i in 0..3u32 {
        let name = format!("r{i}of3");
        let cfg = config(&setup, dir.path(), &name, &data[i as usize], i, 3)?;
        three.push(Proc::start(dir.path(), &name, &cfg)?);
    }
    for (i, p) in three.iter_mut().enumerate() {
        let owned: BTreeSet<i32> = nats::owned_partitions(PARTITIONS, i as u32, 3)
            .into_iter()
            .collect();
        p.wait_restored(&owned)?;
    }
    let (uploads, sessions, distinct, copies) = {
        let mut refs: Vec<&mut Proc> = three.iter_mut().collect();
        loadgen_done_and_covered(&rt, &setup, &mut gen, &mut refs)?
    };

    // The moved partitions were restored from their changelogs by their new owners.
    let mut restored = BTreeMap::new();
    for p in &three {
        for e in p.log()?.with_message("partition restored from changelog") {
            if let (Some(part), Some(records)) = (e.int("partition"), e.int("records")) {
                restored.insert(
                    part,
                    (p.name.clone(), records, e.int("elapsed_ms").unwrap_or(-1)),
                );
            }
        }
    }
    for moved in [2, 3, 4, 5] {
        let (who, records, _) = restored
            .get(&moved)
            .with_context(|| format!("no restore of partition {moved} in the logs"))?;
        ensure!(
            *records > 0,
            "partition {moved} moved to {who} but restored no record"
        );
    }
    for p in three.iter_mut() {
        sigterm(&mut p.child, SHUTDOWN_DEADLINE)?;
    }
    println!(
        "{} uploads in {} sessions, all covered by {distinct} distinct emissions ({copies} copies, identical); restores (partition: owner, records, ms) {restored:?}",
        uploads,
        sessions
    );
    rt.block_on(setup.cleanup());
    Ok(())
}

#[test]
fn nats_same_index_twice_is_fenced() -> Result<()> {
    let Some(addr) = server("nats_same_index_twice_is_fenced") else {
        return Ok(());
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let setup = rt.block_on(Setup::new(&addr, "twice", Storage::Memory, PARTITIONS))?;
    let dir = keep_or_temp()?;
    let all: BTreeSet<i32> = (0..PARTITIONS as i32).collect();

    let mut first = Proc::start(
        dir.path(),
        "first",
        &config(&setup, dir.path(), "first", &dir.path().join("d1"), 0, 1)?,
    )?;
    first.wait_restored(&all)?;
    let mut gen = process_support::nats_loadgen(&setup.nats, "16s", "20", "16")
        .spawn()
        .context("spawn settle loadgen")?;
    std::thread::sleep(Duration::from_secs(5));
    // The same index again, on its own data dir: it restores every partition from the
    // changelog and claims it.
    let mut second = Proc::start(
        dir.path(),
        "second",
        &config(&setup, dir.path(), "second", &dir.path().join("d2"), 0, 1)?,
    )?;
    second.wait_restored(&all)?;
    let (uploads, sessions, distinct, copies) =
        loadgen_done_and_covered(&rt, &setup, &mut gen, &mut [&mut second])?;

    // The first process was fenced at its next append after the claim (on whichever
    // partition appended first) and stopped with exit code 1, as for any failed partition: it
    // publishes, appends and acks nothing more; the second was never fenced.
    let status = wait_exit(&mut first.child, STEP)?.context("the fenced process kept running")?;
    ensure!(!status.success(), "the fenced process exited with {status}");
    let first_log = first.log()?;
    let fenced: BTreeSet<i32> = first_log
        .with_message(FENCED)
        .filter_map(|e| e.int("partition"))
        .map(|p| p as i32)
        .collect();
    ensure!(
        !fenced.is_empty(),
        "the first process stopped without a fence:\n{}",
        first_log.trouble(20)
    );
    let fenced_at = first_log
        .with_message(FENCED)
        .map(|e| e.at_ms)
        .min()
        .unwrap_or_default();
    let claimed_first = second
        .log()?
        .with_message(CLAIMED)
        .map(|e| e.at_ms)
        .min()
        .unwrap_or_default();
    let second_log = second.log()?;
    ensure!(
        second_log.with_message(FENCED).next().is_none(),
        "the second process was fenced too:\n{}",
        second_log.trouble(20)
    );
    second.ensure_running()?;
    sigterm(&mut second.child, SHUTDOWN_DEADLINE)?;
    println!(
        "{} uploads in {} sessions covered by {distinct} distinct emissions ({copies} copies, identical); first process fenced on {fenced:?} {} ms after the second's first claim, then exited ({status})",
        uploads,
        sessions,
        fenced_at - claimed_first
    );
    rt.block_on(setup.cleanup());
    Ok(())
}

/// A changelog compacted by snapshots (`transport::nats::changelog`, "Compaction";
/// `nats.changelog-snapshot-kib = 16`, so every partition snapshots and purges many times)
/// still moves a partition with its pending rounds, and a store whose checkpoint was
/// purged past is wiped and restored from the snapshot. Under `settle loadgen --nats`
/// traffic: instance A (index 0 of 1) runs, and is stopped; B (the same index, a new data
/// dir) restores every partition from the changelogs and goes on, compacting them past A's
/// checkpoints, and is SIGKILLed; A starts again on its old stores, which it must wipe.
/// Afterwards every upload is covered exactly (as in the re-scale test), every changelog
/// stream was purged (its first message is a snapshot start), and A's log says it wiped.
#[test]
fn nats_compacted_changelog_moves_partitions_and_wipes_stale_stores() -> Result<()> {
    let Some(addr) = server("nats_compacted_changelog_moves_partitions_and_wipes_stale_stores")
    else {
        return Ok(());
    };
    const PARTS: u32 = 4;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let setup = rt.block_on(Setup::new(&addr, "compact", Storage::Memory, PARTS))?;
    let dir = keep_or_temp()?;
    let compacting = |name: &str, data: &Path| -> Result<PathBuf> {
        let path = config(&setup, dir.path(), name, data, 0, 1)?;
        let text = std::fs::read_to_string(&path)?
            .replace("[nats]\n", "[nats]\nchangelog-snapshot-kib = 16\n");
        std::fs::write(&path, text)?;
        Ok(path)
    };
    let (data_a, data_b) = (dir.path().join("a"), dir.path().join("b"));
    let all: BTreeSet<i32> = (0..PARTS as i32).collect();
    let mut a = Proc::start(dir.path(), "a", &compacting("a", &data_a)?)?;
    a.wait_restored(&all)?;
    let mut gen = process_support::nats_loadgen(&setup.nats, "30s", "20", "21")
        .spawn()
        .context("spawn settle loadgen")?;
    let run_for = |p: &mut Proc, secs: u64| -> Result<()> {
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(secs) {
            p.ensure_running()?;
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    };
    run_for(&mut a, 8)?;
    sigterm(&mut a.child, SHUTDOWN_DEADLINE)?;
    let mut b = Proc::start(dir.path(), "b", &compacting("b", &data_b)?)?;
    b.wait_restored(&all)?;
    run_for(&mut b, 12)?;
    b.child.kill()?;
    b.child.wait()?;
    ensure!(
        gen.try_wait()?.is_none(),
        "loadgen finished before A came back"
    );
    let snapshots = b
        .log()?
        .with_message(
            "changelog snapshot appended: the changelog is compacted below it once acknowledged",
        )
        .count();
    ensure!(
        snapshots >= PARTS as usize,
        "B appended {snapshots} snapshots; compaction did not run on every partition"
    );
    let mut a = Proc::start(dir.path(), "a2", &compacting("a2", &data_a)?)?;
    a.wait_restored(&all)?;
    let (uploads, sessions, distinct, copies) =
        loadgen_done_and_covered(&rt, &setup, &mut gen, &mut [&mut a])?;
    let wiped: BTreeSet<i32> = a
        .log()?
        .with_message("the changelog was compacted past this store's checkpoint: wiping the store and restoring it from the changelog's snapshot")
        .filter_map(|e| e.int("partition"))
        .map(|p| p as i32)
        .collect();
    ensure!(
        wiped == all,
        "A wiped the stores of partitions {wiped:?}, not all of {all:?}"
    );
    for p in 0..PARTS as i32 {
        let name = setup.nats.changelog_stream_name(p);
        let first = rt.block_on(async {
            let mut s = setup.js.get_stream(&name).await?;
            let first = s.info().await?.state.first_sequence;
            let m = s.get_raw_message(first).await?;
            anyhow::Ok((
                first,
                m.headers.get(nats::changelog::SNAPSHOT_HEADER).is_some(),
            ))
        })?;
        ensure!(
            first.0 > 1 && first.1,
            "changelog {name}: first message {} is not a snapshot start after compaction",
            first.0
        );
    }
    sigterm(&mut a.child, SHUTDOWN_DEADLINE)?;
    println!(
        "{} uploads in {} sessions, all covered by {distinct} distinct emissions ({copies} copies); B appended {snapshots} snapshots; A wiped {wiped:?}",
        uploads,
        sessions
    );
    rt.block_on(setup.cleanup());
    Ok(())
}
