//! The engine is pure (ARCHITECTURE.md, STYLE.md §1): no runtime, storage, broker or clock
//! imports anywhere under `src/engine/`. This test fails as soon as one appears.

use std::path::Path;

const FORBIDDEN: &[&str] = &[
    "tokio",
    "rocksdb",
    "rdkafka",
    "async_nats",
    "SystemTime",
    "Instant",
    "std::time",
    "std::thread",
    "std::fs",
    "std::net",
    "chrono",
    "time::OffsetDateTime",
];

#[test]
fn engine_imports_no_io_runtime_or_clock() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/engine");
    let files = crate::source_support::rust_files(&root);
    assert!(
        files.len() >= 3,
        "expected the engine sources under {root:?}"
    );
    let mut hits = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).expect("readable source");
        for (n, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            for word in FORBIDDEN {
                if code.contains(word) {
                    hits.push(format!(
                        "{}:{}: {word}: {}",
                        f.display(),
                        n + 1,
                        line.trim()
                    ));
                }
            }
        }
    }
    assert!(
        hits.is_empty(),
        "engine must stay pure:\n{}",
        hits.join("\n")
    );
}

#[test]
fn the_check_detects_a_forbidden_import() {
    // Guard against a check that cannot fail: the same scan finds a planted import.
    let planted = "use tokio::time::sleep; // comment";
    let code = planted.split("//").next().unwrap_or("");
    assert!(FORBIDDEN.iter().any(|w| code.contains(w)));
}
