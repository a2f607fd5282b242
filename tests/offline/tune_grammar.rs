//! The `--sweep` grammar: what it expands to, and errors that name the bad token.

use settle::cli::tune::{describe, SpecError, Sweep, DEFAULT_SWEEP};
use settle::engine::PolicySpec;

fn labels(spec: &str) -> Vec<String> {
    let sweep: Sweep = spec.parse().unwrap();
    sweep.settings.iter().map(describe).collect()
}

fn error(spec: &str) -> String {
    spec.parse::<Sweep>().unwrap_err().to_string()
}

#[test]
fn groups_expand_to_the_cross_product_in_written_order() {
    assert_eq!(
        labels(" fixed: 5s, 10s ; adaptive:5s/10m ; max-wait: none, 30m ;"),
        [
            "fixed 5s",
            "fixed 5s, max-wait 30m",
            "fixed 10s",
            "fixed 10s, max-wait 30m",
            "adaptive 5s/10m",
            "adaptive 5s/10m, max-wait 30m",
        ]
    );
    // Without a max-wait group there is no max-wait; duplicates are dropped.
    assert_eq!(
        labels("leading-trailing:1m,60s;fixed:500ms"),
        ["leading-trailing 1m", "fixed 500ms"]
    );
    let sweep: Sweep = "adaptive:5s/10m;max-wait:30m".parse().unwrap();
    assert_eq!(
        sweep.settings,
        [PolicySpec::adaptive(5_000, 600_000).with_max_wait(1_800_000)]
    );
}

#[test]
fn default_sweep_is_the_documented_one() {
    let labels = labels(DEFAULT_SWEEP);
    assert_eq!(labels.len(), 34);
    for want in [
        "fixed 5s",
        "fixed 10s",
        "fixed 30s",
        "fixed 1m",
        "fixed 2m",
        "fixed 5m",
        "leading-trailing 10s",
        "leading-trailing 1m",
        "leading-trailing 5m",
        "adaptive 5s/10m",
        "adaptive 10s/10m",
        "adaptive 5s/2m",
        "adaptive 30s/10m",
    ] {
        assert!(labels.iter().any(|l| l == want), "{want}");
        assert!(
            labels.iter().any(|l| *l == format!("{want}, max-wait 30m")),
            "{want} with max-wait"
        );
        // Adaptive settings also come with learned initial delays; the others do not.
        let learned = format!("{want}, learn");
        assert_eq!(
            labels.contains(&learned),
            want.starts_with("adaptive"),
            "{learned}"
        );
        assert_eq!(
            labels
                .iter()
                .any(|l| *l == format!("{learned}, max-wait 30m")),
            want.starts_with("adaptive"),
            "{learned} with max-wait"
        );
    }
}

#[test]
fn learn_doubles_the_adaptive_settings_only() {
    assert_eq!(
        labels("fixed:5s;adaptive:5s/10m;learn:off,on;max-wait:none,30m"),
        [
            "fixed 5s",
            "fixed 5s, max-wait 30m",
            "adaptive 5s/10m",
            "adaptive 5s/10m, max-wait 30m",
            "adaptive 5s/10m, learn",
            "adaptive 5s/10m, learn, max-wait 30m",
        ]
    );
    let sweep: Sweep = "adaptive:5s/10m;learn:on".parse().unwrap();
    assert_eq!(
        sweep.settings,
        [PolicySpec::adaptive(5_000, 600_000).with_learned_initial_delay(true)]
    );
}

#[test]
fn errors_name_the_bad_token() {
    let cases = [
        ("fixed:5s,10q", "`10q`"),
        ("fixd:5s", "`fixd`"),
        ("fixed 5s", "`fixed 5s`"),
        ("adaptive:5s-10m", "`5s-10m`"),
        ("adaptive:5s/10x", "`10x`"),
        ("adaptive:10m/5s", "`10m/5s`"),
        ("fixed:0s", "`0s`"),
        ("fixed:5s;max-wait:soon", "`soon`"),
        ("fixed:5s;max-wait:0ms", "`0ms`"),
        ("fixed:5s,,10s", "`5s,,10s`"),
        ("leading-trailing:", "`leading-trailing`"),
        ("adaptive:5s/10m;learn:maybe", "`maybe`"),
    ];
    for (spec, token) in cases {
        let e = error(spec);
        assert!(e.contains(token), "{spec:?}: {e}");
    }
    assert!(error("adaptive:10m/5s").contains("max-delay"));
    assert!(
        error("fixed:5s,10q").contains("10s, 1m"),
        "says how to write it"
    );
}

#[test]
fn empty_and_max_wait_only_sweeps_are_refused() {
    assert_eq!("".parse::<Sweep>(), Err(SpecError::Empty));
    assert_eq!(" ; ".parse::<Sweep>(), Err(SpecError::Empty));
    assert_eq!("max-wait:30m".parse::<Sweep>(), Err(SpecError::NoPolicy));
    assert_eq!("learn:on,off".parse::<Sweep>(), Err(SpecError::NoPolicy));
}
