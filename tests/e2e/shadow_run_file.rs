//! Shadow policies on a replayed trace (SEMANTICS §8): `settle run-file` with `[[shadow]]`
//! policies, as a real process on 4 partitions, prints each policy's figures once every
//! partition is idle; for each shadow (and for the live policy) the emission count, the
//! uploads in them and the time-to-ready quantiles equal those `settle tune` computes for the
//! same policy on the same trace (`cli::tune::run_trace`). The trace is time-ordered and lies
//! in the past, so every round has fired when the run ends.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::Value;
use settle::cli::report::RunStats;
use settle::cli::tune::{run_trace, Goal, Sweep, Trace};
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{SystemTime, UNIX_EPOCH};

const CONFIG: &str = r#"
[debounce]
policy = "fixed"
delay = "2s"

[runtime]
idle-tick = "50ms"
batch-size = 100
shutdown-deadline = "5s"

[[shadow]]
name = "fixed-5s"
delay = "5s"

[[shadow]]
name = "lt-3s"
policy = "leading-trailing"
delay = "3s"

[[shadow]]
name = "adaptive"
policy = "adaptive"
min-delay = "1s"
max-delay = "20s"
max-wait = "15s"
"#;

/// The same policies in the `settle tune` sweep grammar, in the order of `CONFIG` (live
/// first). One sweep each: a sweep crosses every policy with every max-wait.
const SWEEPS: [(&str, &str); 4] = [
    ("live", "fixed:2s"),
    ("fixed-5s", "fixed:5s"),
    ("lt-3s", "leading-trailing:3s"),
    ("adaptive", "adaptive:1s/20s;max-wait:15s"),
];

/// `sessions` sessions in 6 tenants over 4 minutes of event time ending 5 minutes ago, in
/// time order: bursts, pauses, split uploads, `final` flags and exact redeliveries.
fn write_trace(path: &Path, sessions: usize) {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    let start = now - 9 * 60 * 1000;
    let mut rng = StdRng::seed_from_u64(36);
    let mut lines: Vec<(i64, String)> = Vec::new();
    for s in 0..sessions {
        let tenant = format!("t{}", s % 6);
        let mut t = start + rng.random_range(0..200_000);
        for u in 0..rng.random_range(1..12) {
            let extra = match rng.random_range(0..20) {
                0 => r#","final":true"#.to_owned(),
                1 | 2 => format!(r#","part":{{"index":{},"count":2}}"#, u % 2 + 1),
                _ => String::new(),
            };
            let id = format!("e{s}-{u}");
            let line = format!(
                r#"{{"tenant":"{tenant}","session":"s{s}","event_id":"{id}","ts":{t}{extra}}}"#
            );
            if rng.random_bool(0.05) {
                lines.push((t, line.clone()));
            }
            lines.push((t, line));
            t += if rng.random_bool(0.2) {
                rng.random_range(2_500..12_000)
            } else {
                rng.random_range(1..1_500)
            };
        }
    }
    lines.sort_by_key(|(t, _)| *t);
    let mut f = std::fs::File::create(path).unwrap();
    for (_, l) in &lines {
        writeln!(f, "{l}").unwrap();
    }
}

/// What `settle tune` computes for the one setting of `sweep` on `trace`.
fn tune(trace: &Trace, sweep: &str) -> RunStats {
    let sweep: Sweep = sweep.parse().unwrap();
    let report = run_trace(
        "trace",
        trace,
        &sweep,
        Goal::default(),
        None,
        &mut Vec::new(),
    )
    .unwrap();
    assert_eq!(report.rows.len(), 1, "{sweep:?}");
    report.rows[0].stats.clone()
}

#[test]
fn run_file_shadow_figures_equal_settle_tune() {
    let dir = tempfile::tempdir().unwrap();
    let (trace_path, config) = (dir.path().join("trace.jsonl"), dir.path().join("s.toml"));
    std::fs::write(&config, CONFIG).unwrap();
    write_trace(&trace_path, 300);
    let run = Command::new(env!("CARGO_BIN_EXE_settle"))
        .env_remove("SETTLE_CONFIG")
        .env("SETTLE_LOG", "warn")
        .arg("run-file")
        .arg("--input")
        .arg(&trace_path)
        .arg("--data-dir")
        .arg(dir.path().join("data"))
        .arg("--output")
        .arg(dir.path().join("out.jsonl"))
        .arg("--config")
        .arg(&config)
        .arg("--partitions")
        .arg("4")
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .expect("settle binary runs");
    assert!(run.status.success(), "run-file failed: {}", run.status);
    let printed: Vec<Value> = String::from_utf8(run.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect();
    let names: Vec<&str> = printed
        .iter()
        .map(|v| v["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, SWEEPS.map(|(name, _)| name));

    let trace = settle::cli::tune::read_trace_file(&trace_path).unwrap();
    let published = std::fs::read_to_string(dir.path().join("out.jsonl"))
        .unwrap()
        .lines()
        .count() as u64;
    for ((name, sweep), got) in SWEEPS.iter().zip(&printed) {
        let want = tune(&trace, sweep);
        let ttr = want.time_to_ready();
        let figures = [
            ("emissions", want.emissions),
            ("uploads", want.uploads - want.redelivered),
            ("refused_sessions", 0),
        ];
        for (field, value) in figures {
            assert_eq!(got[field].as_u64(), Some(value), "{name} {field}: {got}");
        }
        for (q, value) in [
            ("p50", ttr.p50),
            ("p90", ttr.p90),
            ("p99", ttr.p99),
            ("max", ttr.max),
        ] {
            assert_eq!(
                got["time_to_ready_ms"][q].as_u64(),
                Some(value),
                "{name} time-to-ready {q}: {got}"
            );
        }
        if *name == "live" {
            // The live policy's figures count what it published.
            assert_eq!(want.emissions, published);
        }
        assert!(want.emissions > 100, "{name}: {} emissions", want.emissions);
    }
    // The shadows differ from the live policy and each other: the check compares something.
    let emissions: Vec<u64> = printed
        .iter()
        .map(|v| v["emissions"].as_u64().unwrap())
        .collect();
    let mut distinct = emissions.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(distinct.len(), emissions.len(), "{emissions:?}");
}
