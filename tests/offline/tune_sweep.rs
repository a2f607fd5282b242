//! `settle tune` on the bundled seed traces: every setting of the sweep is listed, and each
//! row's figures equal a direct `simulate::replay` of the same setting.

use settle::cli::report::{human_ms, RunStats};
use settle::cli::simulate;
use settle::cli::tune::{self, describe, Goal, Sweep, TuneArgs};
use settle::engine::{Engine, PolicyTable};
use std::io::BufReader;
use std::path::{Path, PathBuf};

const TRACES: [&str; 6] = [
    "burst-700.jsonl",
    "mixed.jsonl",
    "sparse.jsonl",
    "split-upload.jsonl",
    "trickle.jsonl",
    "two-requests-20s.jsonl",
];

fn trace_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("examples/traces")
        .join(name)
}

/// `settle tune --input examples/traces/NAME [--sweep ..] [--report ..]` with the default goal.
fn tune_trace(
    name: &str,
    sweep: &Sweep,
    report: Option<PathBuf>,
) -> anyhow::Result<(tune::TuneReport, String)> {
    let mut out = Vec::new();
    let report = tune::run(
        TuneArgs {
            input: trace_path(name),
            sweep: sweep.clone(),
            goal: Goal::default(),
            report,
        },
        &mut out,
    )?;
    Ok((report, String::from_utf8(out)?))
}

fn direct_replay(path: &Path, spec: &settle::engine::PolicySpec) -> RunStats {
    let file = std::fs::File::open(path).unwrap();
    simulate::replay(
        Engine::new(PolicyTable::uniform(spec.clone())),
        BufReader::new(file),
        |_| Ok(()),
        |_| {},
    )
    .unwrap()
}

fn assert_same(what: &str, a: &RunStats, b: &RunStats) {
    assert_eq!(a.uploads, b.uploads, "{what}: uploads");
    assert_eq!(a.late, b.late, "{what}: late");
    assert_eq!(a.redelivered, b.redelivered, "{what}: redelivered");
    assert_eq!(a.rejected, b.rejected, "{what}: rejected");
    assert_eq!(a.emissions, b.emissions, "{what}: emissions");
    assert_eq!(a.by_trigger, b.by_trigger, "{what}: emissions per trigger");
    assert_eq!(
        a.coalescing_ratio(),
        b.coalescing_ratio(),
        "{what}: coalescing"
    );
    assert_eq!(
        a.time_to_ready(),
        b.time_to_ready(),
        "{what}: time-to-ready"
    );
    assert_eq!(a.max_wait_share(), b.max_wait_share(), "{what}: max-wait");
}

#[test]
fn default_sweep_on_seed_traces_lists_every_setting_and_agrees_with_simulate() {
    let sweep = Sweep::default();
    assert_eq!(sweep.settings.len(), 34);
    for name in TRACES {
        let (report, text) = tune_trace(name, &sweep, None).unwrap();
        assert_eq!(report.rows.len(), sweep.settings.len(), "{name}");
        for (row, spec) in report.rows.iter().zip(&sweep.settings) {
            assert_eq!(&row.spec, spec, "{name}: rows keep sweep order");
            let label = describe(spec);
            // The table has one line per setting, starting with the mark and the setting.
            let line = text
                .lines()
                .find(|l| {
                    l.get(2..)
                        .is_some_and(|l| l.starts_with(&format!("{label} ")))
                })
                .unwrap_or_else(|| panic!("{name}: no table line for `{label}`:\n{text}"));
            let ttr = row.stats.time_to_ready();
            let cells: Vec<&str> = line[2..].split_whitespace().collect();
            assert!(
                cells.contains(&row.stats.emissions.to_string().as_str())
                    && cells.contains(&human_ms(ttr.p99).as_str()),
                "{name}: `{line}`"
            );
            assert_eq!(line.starts_with('*'), row.pareto, "{name}: `{line}`");
            let direct = direct_replay(&trace_path(name), spec);
            assert_same(&format!("{name} {label}"), &row.stats, &direct);
        }
        assert!(text.contains("recommended") || text.contains("NO setting meets"));
    }
}

#[test]
fn custom_sweep_with_max_wait_agrees_with_simulate() {
    // max-wait short enough to fire on the trickle trace, so `max_wait` rows are exercised.
    let sweep: Sweep = "fixed:1m;adaptive:5s/10m;max-wait:none,2m".parse().unwrap();
    let (report, _) = tune_trace("trickle.jsonl", &sweep, None).unwrap();
    let labels: Vec<String> = report.rows.iter().map(|r| describe(&r.spec)).collect();
    assert_eq!(
        labels,
        [
            "fixed 1m",
            "fixed 1m, max-wait 2m",
            "adaptive 5s/10m",
            "adaptive 5s/10m, max-wait 2m"
        ]
    );
    assert!(
        report.rows.iter().any(|r| r.stats.max_wait_share() > 0.0),
        "max-wait 2m should cap some rounds of the trickle trace"
    );
    for row in &report.rows {
        let direct = direct_replay(&trace_path("trickle.jsonl"), &row.spec);
        assert_same(&describe(&row.spec), &row.stats, &direct);
    }
}

#[test]
fn recommendation_is_the_cheapest_row_meeting_the_goal() {
    let (report, _) = tune_trace("mixed.jsonl", &Sweep::default(), None).unwrap();
    let i = report
        .recommended
        .expect("short fixed delays meet p99 <= 60s on mixed.jsonl");
    let best = &report.rows[i];
    assert!(best.meets_goal && best.pareto);
    for r in report.rows.iter().filter(|r| r.meets_goal) {
        assert!(r.stats.emissions >= best.stats.emissions, "{:?}", r.spec);
    }
}

#[test]
fn missing_trace_and_bad_report_extension_are_errors() {
    let err = tune_trace("no-such-trace.jsonl", &Sweep::default(), None).unwrap_err();
    assert!(err.to_string().contains("no-such-trace.jsonl"), "{err}");
    let png = Some(PathBuf::from("chart.png"));
    let err = tune_trace("sparse.jsonl", &Sweep::default(), png).unwrap_err();
    assert!(err.to_string().contains("chart.png"), "{err}");
}
