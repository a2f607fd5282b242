//! `settle tune --report`: the SVG chart is well-formed, names both axes, has a log time
//! axis and a key numbering every setting; the HTML page holds the table and the chart.

use settle::cli::tune::{self, describe, Goal, Sweep, TuneArgs, TuneReport, X_AXIS, Y_AXIS};
use std::path::PathBuf;

fn run_with_report(file_name: &str) -> (TuneReport, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(file_name);
    let report = tune::run(
        TuneArgs {
            input: PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/traces/mixed.jsonl"),
            sweep: Sweep::default(),
            goal: Goal::default(),
            report: Some(path.clone()),
        },
        &mut Vec::new(),
    )
    .unwrap();
    (report, std::fs::read_to_string(&path).unwrap())
}

/// All text content under `node`, joined by spaces.
fn texts(node: roxmltree::Node) -> String {
    node.descendants()
        .filter(|n| n.is_text())
        .filter_map(|n| n.text())
        .collect::<Vec<_>>()
        .join(" ")
}

#[test]
fn svg_report_is_well_formed_and_names_both_axes() {
    let (report, svg) = run_with_report("tune.svg");
    let doc = roxmltree::Document::parse(&svg).expect("well-formed SVG");
    let root = doc.root_element();
    assert_eq!(root.tag_name().name(), "svg");
    let text = texts(root);
    assert!(text.contains(X_AXIS), "x axis name missing");
    assert!(text.contains(Y_AXIS), "y axis name missing");
    assert!(
        text.contains("settle tune: cost vs p99 time-to-ready"),
        "title missing"
    );
    assert!(text.contains("Pareto-optimal"), "legend missing");
    // Every setting is in the chart's key, numbered as the table's rows, Pareto-optimal
    // ones marked.
    for (n, r) in report.rows.iter().enumerate() {
        let mark = if r.pareto { " *" } else { "" };
        let entry = format!("{:>2}  {}{mark}", n + 1, describe(&r.spec));
        assert!(text.contains(&entry), "{entry:?} not in the key: {text}");
    }
    // The time axis is logarithmic with ticks people read: 5 s, 10 s, 30 s, 1 min, ...
    for tick in [
        "5.0s", "10.0s", "30.0s", "1m00s", "2m00s", "5m00s", "10m00s",
    ] {
        assert!(text.contains(tick), "tick {tick} missing: {text}");
    }
    // One marker per setting (plus the legend's and the recommendation ring).
    let circles = root
        .descendants()
        .filter(|n| n.has_tag_name("circle"))
        .count();
    assert!(circles >= report.rows.len(), "{circles} circles");
}

#[test]
fn html_report_has_the_table_and_the_svg() {
    let (report, html) = run_with_report("tune.html");
    // `<!DOCTYPE html>` is a DTD to an XML parser: allow it.
    let options = roxmltree::ParsingOptions {
        allow_dtd: true,
        ..Default::default()
    };
    let doc = roxmltree::Document::parse_with_options(&html, options).expect("well-formed HTML");
    let table = doc
        .descendants()
        .find(|n| n.has_tag_name("table"))
        .expect("a table");
    let body_rows: Vec<_> = table
        .descendants()
        .filter(|n| n.has_tag_name("tr") && n.parent().is_some_and(|p| p.has_tag_name("tbody")))
        .collect();
    assert_eq!(body_rows.len(), report.rows.len());
    for (tr, row) in body_rows.iter().zip(&report.rows) {
        let cells: Vec<String> = tr
            .children()
            .filter(|n| n.has_tag_name("td"))
            .map(texts)
            .collect();
        assert_eq!(cells[0] == "*", row.pareto);
        assert_eq!(cells[1], describe(&row.spec));
        assert_eq!(cells[2], row.stats.emissions.to_string());
    }
    let svg = doc
        .descendants()
        .find(|n| n.has_tag_name("svg"))
        .expect("the chart");
    let text = texts(svg);
    assert!(text.contains(X_AXIS) && text.contains(Y_AXIS));
    assert!(texts(doc.root_element()).contains("recommended for goal"));
}
