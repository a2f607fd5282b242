//! Pareto marks and the recommendation on a small trace checked by hand.

use settle::cli::tune::{describe, Goal, Sweep, Trace, TuneReport};
use settle::engine::{SessionKey, Upload};

/// Key `t/a` uploads at 0 s and 4 s; key `t/b` uploads once at 100 s.
fn trace() -> Trace {
    let a = SessionKey::new("t", "a");
    let b = SessionKey::new("t", "b");
    Trace::from_uploads([
        Upload::plain(a.clone(), 0),
        Upload::plain(a, 4_000),
        Upload::plain(b, 100_000),
    ])
}

/// The text table of `report`.
fn table(report: &TuneReport) -> String {
    let mut out = Vec::new();
    report.write_table(&mut out).unwrap();
    String::from_utf8(out).unwrap()
}

const SWEEP: &str = "fixed:1s,5s,30s;leading-trailing:1s,5s;adaptive:1s/10s,5s/5s";

// By hand (time-to-ready = due_at − last upload of the round, in ms):
//
// | setting               | emissions (time-to-ready)                                 | n | p99  |
// |-----------------------|-----------------------------------------------------------|---|------|
// | fixed 1s              | a@1000 (1000), a@5000 (1000), b (1000)                      | 3 | 1000 |
// | fixed 5s              | a@9000 (5000: 0 and 4000 coalesced), b (5000)             | 2 | 5000 |
// | fixed 30s             | a@34000 (30000), b (30000)                                | 2 | 30000|
// | leading-trailing 1s   | a leading@0, round closes silently @1000; a leading@4000;  |   |      |
// |                       | b leading — all time-to-ready 0                           | 3 | 0    |
// | leading-trailing 5s   | a leading@0 (0), 4000 in the round → trailing@9000 (5000), |   |      |
// |                       | b leading (0)                                             | 3 | 5000 |
// | adaptive 1s/10s       | a: delay 1000 → @1000 (1000); 4000: interval 4000 > 1000 → |   |      |
// |                       | delay 4000 → @8000 (4000); b: first upload, 1000          | 3 | 4000 |
// | adaptive 5s/5s        | delay always 5000: same as fixed 5s                       | 2 | 5000 |
//
// Pareto (fewer-or-equal emissions and lower-or-equal p99, one strictly):
// * fixed 1s (3, 1000): dominated by leading-trailing 1s (3, 0).
// * fixed 5s (2, 5000): nothing has < 2 emissions; the only other 2-emission rows are
//   fixed 30s (worse p99) and adaptive 5s/5s (equal): kept.
// * fixed 30s (2, 30000): dominated by fixed 5s.
// * leading-trailing 1s (3, 0): nothing has p99 < 0 or ≤ 3 emissions with p99 0 other than
//   itself: kept.
// * leading-trailing 5s (3, 5000): dominated by leading-trailing 1s (and fixed 5s).
// * adaptive 1s/10s (3, 4000): dominated by leading-trailing 1s.
// * adaptive 5s/5s (2, 5000): ties fixed 5s, nobody dominates it: kept.
// (The histogram rounds 5000 to 5003 and 30000 to 30015 for both tied rows alike, which
// changes no comparison.)
const PARETO: [bool; 7] = [false, true, false, true, false, false, true];
const EMISSIONS: [u64; 7] = [3, 2, 2, 3, 3, 3, 2];

#[test]
fn pareto_marks_match_the_hand_computation() {
    let sweep: Sweep = SWEEP.parse().unwrap();
    let report = TuneReport::build("hand", &trace(), &sweep, Goal::default());
    let emissions: Vec<u64> = report.rows.iter().map(|r| r.stats.emissions).collect();
    assert_eq!(emissions, EMISSIONS);
    let p99: Vec<u64> = report.rows.iter().map(|r| r.p99()).collect();
    assert_eq!(p99[0], 1_000);
    assert_eq!(p99[3], 0);
    assert!(
        p99[1] == p99[6] && (5_000..5_010).contains(&p99[1]),
        "{p99:?}"
    );
    let marks: Vec<(String, bool)> = report
        .rows
        .iter()
        .map(|r| (describe(&r.spec), r.pareto))
        .collect();
    let expected: Vec<(String, bool)> = sweep.settings.iter().map(describe).zip(PARETO).collect();
    assert_eq!(marks, expected);

    // The text table carries the same marks in its first column.
    let text = table(&report);
    for (label, pareto) in expected {
        let line = text
            .lines()
            .find(|l| {
                l.get(2..)
                    .is_some_and(|l| l.starts_with(&format!("{label} ")))
            })
            .unwrap();
        assert_eq!(line.starts_with('*'), pareto, "{line}");
    }
}

#[test]
fn recommends_the_cheapest_row_meeting_the_goal() {
    let sweep: Sweep = SWEEP.parse().unwrap();
    // p99 ≤ 10 s: every row but fixed 30s meets it; the cheapest are fixed 5s and
    // adaptive 5s/5s (2 emissions, same p99): the earlier row wins.
    let report = TuneReport::build("hand", &trace(), &sweep, "p99<=10s".parse().unwrap());
    let meets: Vec<bool> = report.rows.iter().map(|r| r.meets_goal).collect();
    assert_eq!(meets, [true, true, false, true, true, true, true]);
    assert_eq!(report.recommended, Some(1));
    let text = table(&report);
    assert!(
        text.contains("recommended for goal \"p99 time-to-ready ≤ 10s at least cost\": fixed 5s"),
        "{text}"
    );

    // p99 ≤ 1 s: fixed 1s (exactly 1000) and leading-trailing 1s (0) meet it, both with 3
    // emissions; the lower p99 wins.
    let report = TuneReport::build("hand", &trace(), &sweep, "p99<=1s".parse().unwrap());
    assert_eq!(report.recommended, Some(3));

    // p99 ≤ 5 s is met by fixed 5s although the histogram shows 5003 ms: the goal is decided
    // from the exact times.
    let report = TuneReport::build("hand", &trace(), &sweep, "p99<=5s".parse().unwrap());
    assert!(report.rows[1].meets_goal);
    assert_eq!(report.recommended, Some(1));
}

#[test]
fn says_so_when_no_row_meets_the_goal() {
    let sweep: Sweep = "fixed:5s,30s".parse().unwrap();
    let report = TuneReport::build("hand", &trace(), &sweep, "p99<=1s".parse().unwrap());
    assert_eq!(report.recommended, None);
    let text = table(&report);
    assert!(
        text.contains("NO setting meets the goal \"p99 time-to-ready ≤ 1s\""),
        "{text}"
    );
    assert!(text.contains("closest: fixed 5s"), "{text}");
    assert!(!text.contains("<- recommended"), "{text}");
}
