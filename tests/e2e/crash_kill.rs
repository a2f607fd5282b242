//! Crash test with a real `settle` process (SEMANTICS §6 "no lost emission" across kill -9):
//! `settle run-file` replays a trace on the file-fed memory transport with RocksDB stores;
//! the test SIGKILLs it mid-run, starts it again on the same data directory, and checks that
//! every round of the trace was emitted — compared with an in-memory `Driver` + `MemTable`
//! replay of the same trace (`simulate::replay`) — and that no `emission_id` appears more
//! than twice (once before the kill, once re-published from the outbox after it).
//!
//! Needs `src/main.rs` to dispatch the hidden `run-file` subcommand to
//! `settle::cli::run_file::run`.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use settle::codec::decode_ready;
use settle::config::Config;
use settle::engine::{Emission, Engine};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const CONFIG: &str = r#"
[debounce]
policy = "fixed"
delay = "2s"

[runtime]
catch-up-rate = 150
idle-tick = "50ms"
batch-size = 100
shutdown-deadline = "5s"
"#;

/// A trace of `sessions` sessions in 7 tenants over 5 minutes of event time ending 5 minutes
/// ago: bursts, split uploads, `final` flags, exact redeliveries and a few bad lines.
fn write_trace(path: &Path, sessions: usize) -> usize {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    let start = now - 600_000;
    let mut rng = StdRng::seed_from_u64(42);
    let mut lines: Vec<(i64, String)> = Vec::new();
    for s in 0..sessions {
        let (tenant, session) = (format!("tenant-{}", s % 7), format!("run-{s}"));
        let mut t = start + rng.random_range(0..300_000);
        for i in 0..rng.random_range(1..12) {
            let mut extra = String::new();
            match rng.random_range(0..20) {
                0 => extra.push_str(r#","final":true"#),
                1 => extra.push_str(r#","part":{"index":1,"count":2}"#),
                2 => extra.push_str(r#","part":{"index":2,"count":2}"#),
                _ => {}
            }
            let line = format!(
                r#"{{"tenant":"{tenant}","session":"{session}","event_id":"e{i}","ts":{t}{extra}}}"#
            );
            if rng.random_range(0..25) == 0 {
                lines.push((t, line.clone())); // exact redelivery
            }
            lines.push((t, line));
            t += if rng.random_bool(0.15) {
                rng.random_range(2_500..10_000)
            } else {
                rng.random_range(1..1_500)
            };
        }
    }
    for i in 0..5 {
        let t = start + i * 1_000;
        lines.push((
            t,
            format!(r#"{{"tenant":"bad tenant!","session":"x","ts":{t}}}"#),
        ));
    }
    lines.sort_by_key(|(t, _)| *t);
    let mut f = std::fs::File::create(path).unwrap();
    for (_, l) in &lines {
        writeln!(f, "{l}").unwrap();
    }
    lines.len()
}

fn expected(trace: &Path, config: &Path) -> Vec<Emission> {
    let cfg = Config::load(Some(config)).unwrap();
    let mut out = Vec::new();
    let reader = std::io::BufReader::new(std::fs::File::open(trace).unwrap());
    settle::cli::simulate::replay(
        Engine::new(cfg.policy_table()),
        reader,
        |e| {
            out.push(e.clone());
            Ok(())
        },
        |_| {},
    )
    .unwrap();
    out
}

struct Paths {
    trace: PathBuf,
    config: PathBuf,
    data: PathBuf,
    output: PathBuf,
}

fn spawn(p: &Paths) -> Child {
    spawn_with(p, &[])
}

fn spawn_with(p: &Paths, env: &[(&str, &str)]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_settle"))
        .envs(env.iter().copied())
        .arg("run-file")
        .arg("--input")
        .arg(&p.trace)
        .arg("--data-dir")
        .arg(&p.data)
        .arg("--output")
        .arg(&p.output)
        .arg("--config")
        .arg(&p.config)
        .arg("--partitions")
        .arg("4")
        .env("SETTLE_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("settle binary starts")
}

fn output_lines(p: &Path) -> Vec<String> {
    std::fs::read_to_string(p)
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

/// Compares ignoring `emitted_at` and `tier` (they depend on when it was sent).
fn by_id(emissions: impl IntoIterator<Item = Emission>) -> BTreeMap<String, Emission> {
    emissions
        .into_iter()
        .map(|e| (e.emission_id(), e))
        .collect()
}

/// A trace, a config and empty data/output paths in `dir`; the rounds the trace must yield.
fn setup(dir: &Path) -> (Paths, BTreeMap<String, Emission>) {
    let p = Paths {
        trace: dir.join("trace.jsonl"),
        config: dir.join("settle.toml"),
        data: dir.join("data"),
        output: dir.join("out.jsonl"),
    };
    std::fs::write(&p.config, CONFIG).unwrap();
    write_trace(&p.trace, 400);
    let want = by_id(expected(&p.trace, &p.config));
    assert!(want.len() > 300, "{} rounds", want.len());
    (p, want)
}

/// Waits until the output has `lines` lines; the child must still be running.
fn wait_for_output(child: &mut Child, p: &Paths, lines: usize) {
    let begun = Instant::now();
    while output_lines(&p.output).len() < lines {
        assert!(
            child.try_wait().unwrap().is_none(),
            "run-file exited early (is `run-file` wired in src/main.rs?)"
        );
        assert!(begun.elapsed() < Duration::from_secs(60), "no progress");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits for the child to exit by itself within `limit`.
fn wait_exit(child: &mut Child, limit: Duration) -> ExitStatus {
    let begun = Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        if begun.elapsed() > limit {
            child.kill().unwrap();
            panic!("run-file did not exit within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Checks the output against the rounds of the trace; returns how often each id appeared.
fn check_output(p: &Paths, want: &BTreeMap<String, Emission>) -> BTreeMap<String, usize> {
    let mut count: BTreeMap<String, usize> = BTreeMap::new();
    let mut got = Vec::new();
    for line in output_lines(&p.output) {
        let r = decode_ready(line.as_bytes()).expect("a ready record per line");
        *count.entry(r.emission_id.clone()).or_default() += 1;
        got.push(r.emission());
    }
    let got = by_id(got);
    let missing: Vec<&String> = want.keys().filter(|k| !got.contains_key(*k)).collect();
    assert!(missing.is_empty(), "rounds never emitted: {missing:?}");
    let extra: Vec<&String> = got.keys().filter(|k| !want.contains_key(*k)).collect();
    assert!(
        extra.is_empty(),
        "emissions the replay does not have: {extra:?}"
    );
    for (id, e) in want {
        assert_eq!(
            &got[id], e,
            "emission {id} differs from the in-memory replay"
        );
    }
    count
}

#[test]
fn sigkill_mid_run_then_restart_emits_every_round_at_most_twice() {
    let dir = tempfile::tempdir().unwrap();
    let (p, want) = setup(dir.path());

    // Run 1: killed with SIGKILL once a quarter of the rounds is out.
    let mut child = spawn(&p);
    wait_for_output(&mut child, &p, want.len() / 4);
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let at_kill = output_lines(&p.output).len();
    assert!(
        at_kill < want.len(),
        "killed mid-run ({at_kill} of {})",
        want.len()
    );

    // Run 2: resumes from the stores and runs to the end.
    let status = wait_exit(&mut spawn(&p), Duration::from_secs(120));
    assert!(status.success(), "restarted run-file failed: {status}");

    let count = check_output(&p, &want);
    assert!(
        count.values().all(|&n| n <= 2),
        "an emission_id appeared more than twice"
    );
    let twice = count.values().filter(|&&n| n == 2).count();
    eprintln!(
        "{} rounds; {at_kill} out at the kill; {twice} re-published after it",
        want.len()
    );
}

#[test]
fn sigterm_stops_gracefully_and_the_restart_publishes_each_round_once() {
    let dir = tempfile::tempdir().unwrap();
    let (p, want) = setup(dir.path());

    let mut child = spawn(&p);
    wait_for_output(&mut child, &p, want.len() / 4);
    let term = Command::new("kill")
        .arg("-TERM")
        .arg(child.id().to_string())
        .status()
        .unwrap();
    assert!(term.success());
    // Graceful: finishes its step, drains the outbox, closes the stores (deadline 5 s).
    let status = wait_exit(&mut child, Duration::from_secs(10));
    assert!(status.success(), "graceful stop exits 0: {status}");
    let at_stop = output_lines(&p.output).len();
    assert!(
        at_stop < want.len(),
        "stopped mid-run ({at_stop} of {})",
        want.len()
    );

    let status = wait_exit(&mut spawn(&p), Duration::from_secs(120));
    assert!(status.success(), "restarted run-file failed: {status}");
    let count = check_output(&p, &want);
    let repeated: Vec<&String> = count
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(id, _)| id)
        .collect();
    assert!(
        repeated.is_empty(),
        "a drained outbox publishes nothing twice: {repeated:?}"
    );
}

/// Every copy of one emission id decodes to the same emission (`emitted_at` and `tier`
/// aside): a replay after a crash decided exactly what the first run published.
fn assert_copies_identical(p: &Paths) {
    let mut first: BTreeMap<String, Emission> = BTreeMap::new();
    for line in output_lines(&p.output) {
        let r = decode_ready(line.as_bytes()).expect("a ready record per line");
        let e = r.emission();
        match first.get(&r.emission_id) {
            Some(seen) => assert_eq!(seen, &e, "copies of {} differ", r.emission_id),
            None => {
                first.insert(r.emission_id.clone(), e);
            }
        }
    }
}

/// Runs to a crash drill (the process aborts itself at a flush), restarts, and checks that
/// every round is out and every copy identical.
fn crash_at_a_flush_then_restart(drill: &str) {
    let dir = tempfile::tempdir().unwrap();
    let (p, want) = setup(dir.path());
    let status = wait_exit(
        &mut spawn_with(&p, &[(drill, "12")]),
        Duration::from_secs(60),
    );
    assert!(!status.success(), "the drill aborts the process: {status}");
    let at_crash = output_lines(&p.output).len();
    assert!(
        at_crash < want.len(),
        "crashed mid-run ({at_crash} of {})",
        want.len()
    );
    let status = wait_exit(&mut spawn(&p), Duration::from_secs(120));
    assert!(status.success(), "restarted run-file failed: {status}");
    let count = check_output(&p, &want);
    assert_copies_identical(&p);
    assert!(
        count.values().all(|&n| n <= 2),
        "an emission_id appeared more than twice"
    );
    eprintln!(
        "{drill}: {} rounds; {at_crash} out at the crash",
        want.len()
    );
}

#[test]
fn crash_after_updates_applied_in_memory_before_their_flush_loses_no_round() {
    crash_at_a_flush_then_restart(settle::runtime::partition::CRASH_BEFORE_FLUSH_ENV);
}

#[test]
fn crash_after_a_flush_before_its_emissions_are_acknowledged_loses_no_round() {
    crash_at_a_flush_then_restart(settle::runtime::partition::CRASH_AFTER_FLUSH_ENV);
}

#[test]
fn sigkill_copies_of_one_emission_are_identical() {
    let dir = tempfile::tempdir().unwrap();
    let (p, want) = setup(dir.path());
    let mut child = spawn(&p);
    wait_for_output(&mut child, &p, want.len() / 3);
    child.kill().unwrap();
    child.wait().unwrap();
    let status = wait_exit(&mut spawn(&p), Duration::from_secs(120));
    assert!(status.success(), "restarted run-file failed: {status}");
    check_output(&p, &want);
    assert_copies_identical(&p);
}
