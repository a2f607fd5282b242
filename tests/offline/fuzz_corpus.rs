//! The fuzz seed corpus (`fuzz/corpus/`, written by `fuzz/make-corpus.py`) through the checks
//! of the fuzz targets (`fuzz/src/harness.rs`, included here so that the same checks run on
//! every test run without libFuzzer). A seed's name says what settle must do with it:
//! `reject-<reason>-<n>` is dead-lettered with that reason, `apply-*` is applied and its
//! ready records read back, `accept-*`/`reject-*` configs and trace lines load or are refused.
//! Crashes the fuzzer found are kept under `fuzz/corpus/<target>/regress-*` and must pass.

use settle::{codec, config, engine};
use std::path::{Path, PathBuf};

#[path = "../../fuzz/src/harness.rs"]
mod harness;

fn seeds(target: &str) -> Vec<(String, Vec<u8>)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target);
    let mut out: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e} (run fuzz/make-corpus.py)", dir.display()))
        .map(|e| e.expect("a directory entry").path())
        .map(|p: PathBuf| {
            let name = p
                .file_name()
                .expect("a name")
                .to_string_lossy()
                .into_owned();
            (name, std::fs::read(&p).expect("a seed"))
        })
        .collect();
    out.sort();
    assert!(!out.is_empty(), "no seeds in {}", dir.display());
    out
}

#[test]
fn every_record_seed_is_rejected_with_its_reason_or_applied() {
    let policies = harness::policies();
    let mut reasons = std::collections::BTreeSet::new();
    let mut applied = 0;
    for (name, bytes) in seeds("decode_upload") {
        let outcome = harness::check_record(&harness::Record::parse(&bytes), &policies);
        harness::check_ready_bytes(harness::Record::parse(&bytes).payload);
        if let Some(rest) = name.strip_prefix("reject-") {
            let reason = rest.rsplit_once('-').map_or(rest, |(r, _)| r);
            assert_eq!(
                outcome,
                harness::Outcome::Rejected(reason_of(reason)),
                "seed {name}"
            );
            reasons.insert(reason.to_owned());
        } else if name.starts_with("apply-") {
            match outcome {
                // Three uploads (one a redelivery, one final): at least the final flush.
                harness::Outcome::Applied(n) => assert!(n >= 1, "seed {name}: no emission"),
                other => panic!("seed {name}: {other:?}"),
            }
            applied += 1;
        } else {
            // A saved crash or a corpus entry the fuzzer added: only the checks apply.
            assert!(name.starts_with("regress-"), "unexpected seed name {name}");
        }
    }
    // Every reason a Kafka record can have (wrong_partition needs a NATS partition).
    let mut expected: Vec<&str> = codec::DecodeError::ALL_REASONS
        .iter()
        .copied()
        .filter(|r| *r != "wrong_partition")
        .collect();
    expected.sort_unstable();
    let got: Vec<&str> = reasons.iter().map(String::as_str).collect();
    assert_eq!(
        got, expected,
        "a reason without a seed (fuzz/make-corpus.py)"
    );
    assert!(applied >= 8, "{applied} apply seeds");
}

fn reason_of(name: &str) -> &'static str {
    codec::DecodeError::ALL_REASONS
        .iter()
        .copied()
        .find(|r| *r == name)
        .unwrap_or_else(|| panic!("{name} is not a reason"))
}

#[test]
fn a_record_without_its_key_is_never_applied() {
    // The harness's key-from-payload flag must not turn a keyless record into an applied one.
    let rec = harness::Record {
        key: None,
        payload: br#"{"tenant":"h","session":"s"}"#,
        timestamp_ms: 1,
        wall_ms: harness::DEFAULT_WALL_MS,
        policy: 0,
    };
    let back = rec.to_bytes();
    let parsed = harness::Record::parse(&back);
    assert_eq!(parsed.key, None);
    assert_eq!(
        harness::check_record(&parsed, &harness::policies()),
        harness::Outcome::Rejected("missing_key")
    );
}

#[test]
fn config_and_trace_seeds_load_or_are_refused_as_named() {
    for (target, check) in [
        ("config_toml", harness::check_config as fn(&str) -> bool),
        ("trace_line", harness::check_trace_line as fn(&str) -> bool),
    ] {
        for (name, bytes) in seeds(target) {
            let text = String::from_utf8(bytes).expect("a text seed");
            let accepted = check(&text);
            if name.starts_with("accept-") {
                assert!(accepted, "{target}/{name} is refused");
            } else if name.starts_with("reject-") {
                assert!(!accepted, "{target}/{name} is accepted");
            }
        }
    }
}
