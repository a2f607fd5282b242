//! The tools of the `settle` command line, one file per subcommand, and their helpers beside
//! them. The top of the stack (ARCHITECTURE "Layers"): a tool may use anything below, and
//! no two tools import each other (what both need lives in a helper below both).
//!
//! | file | subcommand or role |
//! |---|---|
//! | [`demo`] | `settle demo`: the runtime on RocksDB and the memory transport through the seed's scenarios |
//! | [`simulate`] | `settle simulate`: a trace replayed through the engine in event time |
//! | [`tune`] | `settle tune`: a policy sweep over a trace, Pareto marks, a recommendation, SVG/HTML report |
//! | [`inspect`] | `settle inspect`: partition stores and `tiers.json` read offline |
//! | [`loadgen`] | `settle loadgen`: upload traffic to Kafka or NATS |
//! | [`consume`] | `settle consume`: Kafka topics or NATS JetStream subjects printed as JSON lines |
//! | [`run_file`] | `settle run-file` (hidden): the runtime on a file-fed memory transport, for the shared benchmark and tests |
//! | [`admin`] | `settle admin`: a running instance's admin API (whoami, partitions, pending, flush, cancel, audit) |
//! | [`check_config`] | `settle check-config`: a config file validated and summarised |
//! | [`scenario`] | helper: the traffic shapes of demo, loadgen and noisy |
//! | [`noisy`] | helper: the noisy-neighbour experiment (`settle loadgen --scenario noisy`, `benches/tiers.rs`) |
//! | [`trace`] | helper: the trace format (JSONL lines, loaded traces) of simulate, tune and the trace sources |
//! | [`trace_source`] | helper: where simulate and tune read a trace (a file, a Kafka topic, a NATS stream) |
//! | [`report`] | helper: run figures of simulate, demo and tune |
//! | [`whatif`] | helper of `settle run`: the operator page's What-if sweep (tune over the input's last minutes), handed down to the admin server |
//!
//! `settle run` is not a tool: it is `crate::service`.

pub mod admin;
pub mod check_config;
pub mod consume;
pub mod demo;
pub mod inspect;
pub mod loadgen;
pub mod noisy;
pub mod report;
pub mod run_file;
pub mod scenario;
pub mod simulate;
pub mod trace;
pub mod trace_source;
pub mod tune;
pub mod whatif;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::time::Duration;

/// A progress bar on stderr counting uploads (hidden when `visible` is false); also what
/// `settle demo` draws.
pub fn progress_bar(visible: bool, len: u64) -> ProgressBar {
    if !visible {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr());
    if let Ok(style) = ProgressStyle::with_template(
        "{spinner} [{elapsed_precise}] [{bar:40}] {pos}/{len} uploads · {msg}",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.enable_steady_tick(Duration::from_millis(100));
    bar
}

/// Parses a `KEY=VALUE` librdkafka property argument (`-X`).
///
/// Errors: no `=`, or an empty key.
pub fn parse_property(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_owned(), v.to_owned())),
        _ => Err(format!("expected KEY=VALUE, got {text:?}")),
    }
}
