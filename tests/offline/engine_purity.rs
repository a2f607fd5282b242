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

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("src/engine is readable") {
        let path = entry.expect("directory entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn engine_imports_no_io_runtime_or_clock() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/engine");
    let mut files = Vec::new();
    rust_files(&root, &mut files);
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
