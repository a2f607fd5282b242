//! Learned initial delays (`adaptive` with `learn-initial-delay`, `engine::learn`) against
//! plain adaptive, on a tenant whose sessions always upload in two requests 20 s apart: fewer
//! emissions, and p99 time-to-ready higher by no more than the learned delay. Also the
//! Pareto marks of a small hand-checked sweep with a learned setting, and the chart naming
//! the learned settings.

use settle::cli::tune::{self, describe, Goal, Sweep, Trace, TuneArgs, TuneReport, X_AXIS, Y_AXIS};
use settle::engine::{
    Driver, Engine, MemTable, Millis, PolicySpec, PolicyTable, SessionKey, Upload,
};
use std::path::PathBuf;

/// 2026-01-01T00:00:00Z in ms.
const T0: Millis = 1_767_225_600_000;

/// `sessions` sessions of tenant `twostep`, one a minute, each uploading twice, `gap` ms
/// apart (no part markers).
fn two_requests(sessions: usize, gap: Millis) -> Vec<Upload> {
    let mut uploads = Vec::new();
    for s in 0..sessions {
        let key = SessionKey::new("twostep", &format!("job-{s}"));
        let t = T0 + s as Millis * 60_000;
        uploads.push(Upload::plain(key.clone(), t));
        uploads.push(Upload::plain(key, t + gap));
    }
    uploads.sort_by_key(|u| u.event_time);
    uploads
}

fn plain() -> PolicySpec {
    PolicySpec::adaptive(5_000, 600_000)
}

fn learning() -> PolicySpec {
    plain().with_learned_initial_delay(true)
}

/// The delay `twostep` learned over `uploads` under `spec` (replayed through the driver).
fn learned_delay(spec: &PolicySpec, uploads: &[Upload]) -> Millis {
    let mut driver = Driver::new(Engine::new(PolicyTable::uniform(spec.clone())));
    let mut table = MemTable::new();
    let mut out = Vec::new();
    for u in uploads {
        let Ok(_) = driver.apply(&mut table, u.event_time, u, &mut out);
    }
    table
        .tenant("twostep")
        .and_then(|s| s.learned_delay(spec))
        .expect("twostep learned a delay")
}

#[test]
fn learned_delays_coalesce_two_requests_20s_apart() {
    let uploads = two_requests(100, 20_000);
    let trace = Trace::from_uploads(uploads.clone());
    let sweep = Sweep {
        settings: vec![plain(), learning()],
    };
    let report = TuneReport::build("two requests", &trace, &sweep, Goal::default());
    let (p, l) = (&report.rows[0], &report.rows[1]);
    assert_eq!(describe(&l.spec), "adaptive 5s/10m, learn");

    // Plain adaptive: min-delay 5 s fires before the second request comes 20 s later, so
    // every session emits twice.
    assert_eq!(p.stats.emissions, 200);
    // Learned: the first 8 sessions teach the 20 s interval (twice each), then every
    // session starts at the learned 25 s and emits once.
    let delay = learned_delay(&learning(), &uploads);
    assert_eq!(delay, 25_000, "p90 20 s + 25 %");
    assert_eq!(l.stats.emissions, 8 * 2 + 92);
    assert!(l.stats.emissions < p.stats.emissions);
    assert!(l.stats.coalescing_ratio() > p.stats.coalescing_ratio());

    // p99 time-to-ready rises (20 s -> 25 s) by no more than the learned delay.
    let (p99_plain, p99_learned) = (p.p99(), l.p99());
    assert!(
        (19_990..=20_020).contains(&p99_plain),
        "plain p99 {p99_plain}"
    );
    assert!(
        (24_990..=25_020).contains(&p99_learned),
        "learned p99 {p99_learned}"
    );
    assert!(p99_learned.saturating_sub(p99_plain) <= delay as u64);
}

#[test]
fn the_bundled_two_request_trace_shows_the_same() {
    // examples/traces/two-requests-20s.jsonl: 60 sessions, gaps 20 s ± 0.5 s.
    let input =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/traces/two-requests-20s.jsonl");
    let trace = tune::read_trace_file(&input).unwrap();
    assert_eq!((trace.uploads.len(), trace.rejected_count()), (120, 0));
    let mut out = Vec::new();
    let report = tune::run(
        TuneArgs {
            input,
            sweep: "adaptive:5s/10m;learn:off,on".parse().unwrap(),
            goal: Goal::default(),
            report: None,
        },
        &mut out,
    )
    .unwrap();
    let (p, l) = (&report.rows[0], &report.rows[1]);
    assert_eq!(p.stats.emissions, 120);
    assert_eq!(l.stats.emissions, 8 * 2 + 52);
    let delay = learned_delay(&learning(), &trace.uploads);
    assert!((25_000..=25_700).contains(&delay), "learned {delay}");
    assert!(l.p99().saturating_sub(p.p99()) <= delay as u64);
    // Learning is the cheaper row, and both are on the Pareto front (the plain one answers
    // faster).
    assert!(l.pareto && p.pareto);
    let text = String::from_utf8(out).unwrap();
    assert!(text.contains("adaptive 5s/10m, learn "), "{text}");
}

// Hand-checked (time-to-ready = due − last upload of the round): 10 sessions, uploads at
// s·60 s and s·60 s + 20 s.
//
// | setting                 | emissions                                    | n  | p99  |
// |-------------------------|----------------------------------------------|----|------|
// | fixed 5s                | every upload alone, 5 s each                 | 20 | 5 s  |
// | fixed 30s               | both uploads together, 30 s after the second | 10 | 30 s |
// | adaptive 5s/10m         | 5 s after the first, 20 s after the second   | 20 | 20 s |
// | adaptive 5s/10m, learn  | sessions 0-7 as plain (16); sessions 8, 9    |    |      |
// |                         | start at 25 s learned: one each, 25 s        | 18 | 25 s |
//
// Pareto: fixed 5s (20, 5 s) dominates plain adaptive (20, 20 s); learn (18, 25 s) and
// fixed 30s (10, 30 s) are dominated by nothing.
#[test]
fn pareto_marks_with_a_learned_setting_match_the_hand_computation() {
    let trace = Trace::from_uploads(two_requests(10, 20_000));
    let sweep: Sweep = "fixed:5s,30s;adaptive:5s/10m;learn:off,on".parse().unwrap();
    let labels: Vec<String> = sweep.settings.iter().map(describe).collect();
    assert_eq!(
        labels,
        [
            "fixed 5s",
            "fixed 30s",
            "adaptive 5s/10m",
            "adaptive 5s/10m, learn"
        ]
    );
    let report = TuneReport::build("hand", &trace, &sweep, Goal::default());
    let emissions: Vec<u64> = report.rows.iter().map(|r| r.stats.emissions).collect();
    assert_eq!(emissions, [20, 10, 20, 18]);
    // Whole seconds (the histogram reports within 0.1 %: 25 s reads 24.992 s).
    let p99: Vec<u64> = report
        .rows
        .iter()
        .map(|r| (r.p99() + 500) / 1_000)
        .collect();
    assert_eq!(p99, [5, 30, 20, 25]);
    let pareto: Vec<bool> = report.rows.iter().map(|r| r.pareto).collect();
    assert_eq!(pareto, [true, true, false, true]);
    // p99 ≤ 25 s at least cost: the learned setting (18 emissions) beats fixed 5s (20).
    let report = TuneReport::build("hand", &trace, &sweep, "p99<=25s".parse().unwrap());
    assert_eq!(report.recommended, Some(3));
}

#[test]
fn the_chart_names_its_axes_and_the_learned_settings() {
    let trace = Trace::from_uploads(two_requests(20, 20_000));
    let sweep: Sweep = "fixed:5s,30s;adaptive:5s/10m;learn:off,on".parse().unwrap();
    let report = TuneReport::build("two requests", &trace, &sweep, Goal::default());
    let svg = report.render_svg().unwrap();
    let doc = roxmltree::Document::parse(&svg).expect("well-formed SVG");
    let text: String = doc
        .descendants()
        .filter_map(|n| n.text())
        .collect::<Vec<_>>()
        .join(" ");
    assert!(text.contains(X_AXIS) && text.contains(Y_AXIS), "{text}");
    assert!(text.contains("adaptive 5s/10m, learn"), "{text}");
}
