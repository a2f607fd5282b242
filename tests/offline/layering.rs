//! Imports run one way (ARCHITECTURE.md "Layers", STYLE.md §13): every top-level module of
//! `src/` sits on one layer of [`STACK`] and may import only modules of lower layers, so no
//! two modules import each other; and no two tools of `src/cli/` import each other. This
//! test reads the `crate::…` (and, in a module's root file, `super::…`) references of every
//! file and fails, naming the file, the line and the import, when one climbs.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The stack as built, bottom first. A module may import the modules of the layers below
/// its own, never its own layer's or one above. A new top-level module must be placed here.
const STACK: &[&[&str]] = &[
    &["engine"],
    &["codec"],
    &["config"],
    &["store", "tiers"],
    &["transport", "metrics"],
    &["runtime"],
    &["admin"],
    &["service"],
    &["cli"],
];

/// One reference of a file to a top-level module.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Import {
    /// 1-based line.
    line: usize,
    /// The top-level module named.
    target: String,
    /// The line, trimmed (for the failure message).
    text: String,
}

/// The top-level modules a source text names through `crate::x`, `crate::{x, y::z}` and, when
/// `module_root` (the text is `src/m.rs` or `src/m/mod.rs`), `super::x`. Comments are left
/// out (everything after `//` on a line, as in `engine_purity`).
fn imports(text: &str, module_root: bool) -> Vec<Import> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let code = line.split("//").next().unwrap_or("");
        let mut prefixes = vec!["crate::"];
        if module_root {
            prefixes.push("super::");
        }
        for prefix in prefixes {
            let mut rest = code;
            while let Some(at) = rest.find(prefix) {
                let after = &rest[at + prefix.len()..];
                let names: Vec<String> = match after.strip_prefix('{') {
                    Some(group) => top_level_items(group),
                    None => vec![ident(after)],
                };
                for target in names.into_iter().filter(|t| !t.is_empty()) {
                    out.push(Import {
                        line: n + 1,
                        target,
                        text: line.trim().to_owned(),
                    });
                }
                rest = after;
            }
        }
    }
    out
}

/// The leading identifier of `s` (empty when it starts with anything else, e.g. `*`).
fn ident(s: &str) -> String {
    s.chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect()
}

/// The leading identifier of each top-level item of a `{a, b::{c, d}, e}` group (the text
/// after its `{`; a group spanning lines is read up to the line's end).
fn top_level_items(group: &str) -> Vec<String> {
    let mut items = vec![String::new()];
    let mut depth = 0;
    for c in group.chars() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => break,
            '}' => depth -= 1,
            ',' if depth == 0 => items.push(String::new()),
            _ => {}
        }
        if depth == 0 && c != ',' {
            if let Some(last) = items.last_mut() {
                last.push(c);
            }
        }
    }
    items.iter().map(|i| ident(i.trim())).collect()
}

/// The layer of each module of [`STACK`].
fn layers() -> BTreeMap<&'static str, usize> {
    STACK
        .iter()
        .enumerate()
        .flat_map(|(i, mods)| mods.iter().map(move |m| (*m, i)))
        .collect()
}

/// Every violation among `files` (path relative to `src/`, text): an import of a module on
/// the importer's layer or above, two modules importing each other, two `cli` tools
/// importing each other, a top-level module missing from [`STACK`].
fn violations(files: &[(String, String)]) -> Vec<String> {
    let layer = layers();
    let mut bad = Vec::new();
    // module -> modules it imports, with the first place each is imported.
    let mut graph: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    let mut tools: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    let known: BTreeSet<&str> = layer.keys().copied().collect();
    for (path, text) in files {
        let parts: Vec<&str> = path.split('/').collect();
        let module = parts[0].trim_end_matches(".rs").to_owned();
        if module == "lib" || module == "main" {
            continue;
        }
        let Some(&own) = layer.get(module.as_str()) else {
            bad.push(format!(
                "src/{path}: module `{module}` is on no layer of STACK (tests/offline/layering.rs): place it"
            ));
            continue;
        };
        let root = parts.len() == 1 || (parts.len() == 2 && parts[1] == "mod.rs");
        for i in imports(text, root) {
            let place = format!("src/{path}:{}: {}", i.line, i.text);
            if i.target == module || !known.contains(i.target.as_str()) {
                // Within the module (cli's tools are checked below), or not a module.
                continue;
            }
            let theirs = layer[i.target.as_str()];
            if theirs >= own {
                bad.push(format!(
                    "{place}\n    `{module}` (layer {own}) imports `{}` (layer {theirs}): an import may only go down the stack",
                    i.target
                ));
            }
            graph
                .entry(module.clone())
                .or_default()
                .entry(i.target.clone())
                .or_insert(place);
        }
        if module == "cli" && parts.len() == 2 {
            let tool = parts[1].trim_end_matches(".rs").to_owned();
            for (n, line) in text.lines().enumerate() {
                let code = line.split("//").next().unwrap_or("");
                for prefix in ["super::", "crate::cli::"] {
                    let mut rest = code;
                    while let Some(at) = rest.find(prefix) {
                        let after = &rest[at + prefix.len()..];
                        let names = match after.strip_prefix('{') {
                            Some(group) => top_level_items(group),
                            None => vec![ident(after)],
                        };
                        for other in names.into_iter().filter(|o| !o.is_empty() && *o != tool) {
                            tools
                                .entry(tool.clone())
                                .or_default()
                                .entry(other)
                                .or_insert(format!("src/{path}:{}: {}", n + 1, line.trim()));
                        }
                        rest = after;
                    }
                }
            }
        }
    }
    for (what, g) in [("modules", &graph), ("cli tools", &tools)] {
        for (a, targets) in g {
            for (b, place) in targets {
                if a < b {
                    if let Some(back) = g.get(b).and_then(|t| t.get(a)) {
                        bad.push(format!(
                            "{what} `{a}` and `{b}` import each other:\n    {place}\n    {back}"
                        ));
                    }
                }
            }
        }
    }
    bad
}

#[test]
fn imports_run_down_the_stack() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let paths = crate::source_support::rust_files(&src);
    let files: Vec<(String, String)> = paths
        .iter()
        .map(|p| {
            let rel = p.strip_prefix(&src).expect("below src").to_string_lossy();
            (
                rel.replace('\\', "/"),
                std::fs::read_to_string(p).expect("readable source"),
            )
        })
        .collect();
    assert!(files.len() > 40, "expected the sources under {src:?}");
    // Every layer is populated: a module renamed away must be renamed here too.
    let present: BTreeSet<String> = files
        .iter()
        .map(|(p, _)| {
            p.split('/')
                .next()
                .unwrap_or("")
                .trim_end_matches(".rs")
                .to_owned()
        })
        .collect();
    for m in STACK.iter().flat_map(|l| l.iter()) {
        assert!(present.contains(*m), "STACK names `{m}`, which src/ lacks");
    }
    let bad = violations(&files);
    assert!(
        bad.is_empty(),
        "imports must run down the stack (ARCHITECTURE.md \"Layers\"):\n{}",
        bad.join("\n")
    );
}

#[test]
fn the_check_detects_climbing_and_mutual_imports() {
    // Guard against a check that cannot fail: planted sources with each kind of violation.
    let file = |p: &str, t: &str| (p.to_owned(), t.to_owned());
    let bad = violations(&[
        file(
            "config/mod.rs",
            "use crate::codec::validate_tenant;\nuse crate::{engine::Millis, transport::kafka::KafkaConfig};",
        ),
        file("store/mod.rs", "pub fn f() { crate::tiers::x(); }"),
        file("tiers/mod.rs", "use crate::store::Change; // fine below, not beside"),
        file("metrics.rs", "use super::runtime::StatusMap;"),
        file("cli/tune.rs", "use super::trace_source::load;"),
        file("cli/trace_source.rs", "use crate::cli::tune::Trace;"),
        file("cli/simulate.rs", "use super::{report::RunStats, trace};"),
        file("newmod.rs", "pub fn g() {}"),
        file("engine/mod.rs", "// crate::runtime in a comment is no import"),
    ]);
    let text = bad.join("\n");
    for expected in [
        "src/config/mod.rs:2: use crate::{engine::Millis, transport::kafka::KafkaConfig};",
        "`config` (layer 2) imports `transport` (layer 4)",
        "src/store/mod.rs:1",
        "`tiers` (layer 3) imports `store` (layer 3)",
        "modules `store` and `tiers` import each other",
        "src/metrics.rs:1: use super::runtime::StatusMap;",
        "cli tools `trace_source` and `tune` import each other",
        "module `newmod` is on no layer",
    ] {
        assert!(text.contains(expected), "missing {expected:?} in:\n{text}");
    }
    assert!(
        !text.contains("src/engine/"),
        "a comment was read as an import:\n{text}"
    );
    assert!(
        !text.contains("src/cli/simulate"),
        "a one-way cli import was flagged:\n{text}"
    );
}
