//! `settle tune`: policy what-if. Replays one trace under many debounce settings and puts the
//! cost (emissions) next to the wait (time-to-ready), so the delay is chosen from data.
//!
//! Owns the sweep grammar ([`Sweep`]), the goal grammar ([`Goal`]), the parallel replay of
//! independent settings ([`evaluate`]), the Pareto marks ([`pareto_front`]), the
//! recommendation ([`recommend`]), and the renderings (text table, SVG chart, HTML page).
//!
//! Invariants:
//! * every setting is replayed over the same uploads, in trace order, with the same rules as
//!   `settle simulate` (partition time = largest event time seen; at end of input every
//!   pending round fires, `emitted_at = due_at`), so a row's figures equal a
//!   `simulate::replay` of that setting (a test in `tests/tune_sweep.rs` keeps that true);
//! * rows come out in sweep order whatever the thread scheduling;
//! * the trace source is an iterator of [`Upload`]s ([`Trace::from_uploads`]): a JSONL file
//!   ([`Trace::read_jsonl`]) or the input topic / stream of a broker over a time range
//!   (`--from-kafka`, `--from-nats`: `crate::cli::trace_source`).
//!
//! One policy applies to every tenant of the trace (`PolicyTable::uniform`), with the default
//! `state-ttl` (24 h). An `adaptive` setting with `learn` starts each tenant's learning from
//! nothing at the start of the trace (`engine::learn`).

pub use super::simulate::replay_trace;
pub use super::trace::{read_trace_file, Trace, MAX_REJECTED_KEPT};
use crate::engine::{Engine, Millis, PolicyName, PolicySpec, PolicyTable};

use super::trace_source::SourceArgs;

use super::report::{human_ms, RunStats};
use anyhow::Context;
use std::fmt;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// The sweep used when `--sweep` is not given, written in the [`Sweep`] grammar:
/// 13 policy settings, the 4 adaptive ones also with learned initial delays, each without and
/// with `max-wait` 30 min (34 rows).
pub const DEFAULT_SWEEP: &str = "fixed:5s,10s,30s,1m,2m,5m;\
leading-trailing:10s,1m,5m;\
adaptive:5s/10m,10s/10m,5s/2m,30s/10m;\
learn:off,on;\
max-wait:none,30m";

/// The goal used when `--goal` is not given: p99 time-to-ready ≤ 60 s, at least cost.
pub const DEFAULT_GOAL: &str = "p99<=60s";

/// What `--sweep` or `--goal` text got wrong. Every variant names the offending token.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    /// The sweep has no group at all.
    #[error("empty sweep: give at least one group, e.g. `fixed:10s,1m`")]
    Empty,
    /// A group without `POLICY:`.
    #[error("sweep group `{group}` has no `:`; write POLICY:VALUES, e.g. `fixed:5s,10s`")]
    MissingColon {
        /// The group as written.
        group: String,
    },
    /// A group name that is not a policy nor `learn` or `max-wait`.
    #[error(
        "unknown policy `{token}`; expected `fixed`, `leading-trailing`, `adaptive`, `learn` or `max-wait`"
    )]
    UnknownPolicy {
        /// The name as written.
        token: String,
    },
    /// `POLICY:` followed by nothing, or `a,,b`.
    #[error("`{group}`: empty value in `{values}`")]
    EmptyValue {
        /// Group name (`fixed`, `max-wait`, ...).
        group: String,
        /// The value list as written.
        values: String,
    },
    /// A duration that humantime cannot read, or one too large for milliseconds.
    #[error("`{group}`: bad duration `{token}`: {reason}; write e.g. 500ms, 10s, 1m, 1h")]
    BadDuration {
        /// Group name (`fixed`, `adaptive`, `max-wait`, ...).
        group: String,
        /// The duration as written.
        token: String,
        /// What humantime said.
        reason: String,
    },
    /// An `adaptive` value that is not `MIN/MAX`.
    #[error("`adaptive`: `{token}` is not MIN/MAX, e.g. `5s/10m`")]
    NotMinMax {
        /// The value as written.
        token: String,
    },
    /// A setting that parses but breaks a policy invariant (`PolicySpec::validate`).
    #[error("`{group}`: `{token}`: {reason}")]
    Invalid {
        /// Group name.
        group: String,
        /// The value as written.
        token: String,
        /// The broken rule, naming the config key (`delay`, `max-delay`, ...).
        reason: String,
    },
    /// A `learn` value that is not `off` or `on`.
    #[error("`learn`: `{token}` is not `off` or `on`")]
    BadLearn {
        /// The value as written.
        token: String,
    },
    /// Only `max-wait:` and/or `learn:` were given.
    #[error("sweep has `max-wait` or `learn` values but no policy group; add e.g. `fixed:10s`")]
    NoPolicy,
    /// A goal that is not `pNN<=DURATION`.
    #[error("goal `{token}`: {reason}; write e.g. `p99<=60s` (p50, p90 or p99)")]
    BadGoal {
        /// The offending part of the goal.
        token: String,
        /// What is wrong.
        reason: String,
    },
}

/// A list of settings to replay, parsed from the sweep grammar:
///
/// ```text
/// SWEEP  := GROUP (';' GROUP)*
/// GROUP  := 'fixed' ':' DUR (',' DUR)*
///         | 'leading-trailing' ':' DUR (',' DUR)*
///         | 'adaptive' ':' DUR '/' DUR (',' DUR '/' DUR)*     (min-delay/max-delay)
///         | 'learn' ':' ('off' | 'on') (',' ('off' | 'on'))*   (learn-initial-delay)
///         | 'max-wait' ':' ('none' | DUR) (',' ('none' | DUR))*
/// DUR    := a humantime duration: 500ms, 10s, 1m, 1m30s, 2h
/// ```
///
/// Every policy value is combined with every `learn` value (`off` only when no `learn`
/// group is given; `on` changes `adaptive` settings only) and every `max-wait` value (`none`
/// only when no `max-wait` group is given), in the order written; duplicates are dropped.
/// Whitespace around tokens is ignored; a trailing `;` is allowed. Example: [`DEFAULT_SWEEP`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sweep {
    /// The settings, in row order.
    pub settings: Vec<PolicySpec>,
}

impl Default for Sweep {
    /// The [`DEFAULT_SWEEP`] settings.
    fn default() -> Self {
        // Invariant: DEFAULT_SWEEP is a constant in the grammar; a unit test parses it.
        DEFAULT_SWEEP
            .parse()
            .expect("DEFAULT_SWEEP is a valid sweep")
    }
}

impl FromStr for Sweep {
    type Err = SpecError;

    fn from_str(text: &str) -> Result<Self, SpecError> {
        let mut policies: Vec<PolicySpec> = Vec::new();
        let mut learns: Vec<bool> = Vec::new();
        let mut max_waits: Vec<Option<Millis>> = Vec::new();
        for group in text.split(';').map(str::trim).filter(|g| !g.is_empty()) {
            let (name, values) = group
                .split_once(':')
                .ok_or_else(|| SpecError::MissingColon {
                    group: group.to_owned(),
                })?;
            let name = name.trim();
            for value in values.split(',').map(str::trim) {
                if value.is_empty() {
                    return Err(SpecError::EmptyValue {
                        group: name.to_owned(),
                        values: values.trim().to_owned(),
                    });
                }
                let spec = match name {
                    "fixed" => PolicySpec::fixed(parse_ms(name, value)?),
                    "leading-trailing" => PolicySpec::leading_trailing(parse_ms(name, value)?),
                    "adaptive" => {
                        let (min, max) =
                            value.split_once('/').ok_or_else(|| SpecError::NotMinMax {
                                token: value.to_owned(),
                            })?;
                        PolicySpec::adaptive(
                            parse_ms(name, min.trim())?,
                            parse_ms(name, max.trim())?,
                        )
                    }
                    "learn" => {
                        learns.push(match value {
                            "off" => false,
                            "on" => true,
                            other => {
                                return Err(SpecError::BadLearn {
                                    token: other.to_owned(),
                                })
                            }
                        });
                        continue;
                    }
                    "max-wait" => {
                        let wait = match value {
                            "none" => None,
                            v => Some(parse_ms(name, v)?),
                        };
                        if wait.is_some_and(|w| w < 1) {
                            return Err(SpecError::Invalid {
                                group: name.to_owned(),
                                token: value.to_owned(),
                                reason: "max-wait must be at least 1ms".to_owned(),
                            });
                        }
                        max_waits.push(wait);
                        continue;
                    }
                    other => {
                        return Err(SpecError::UnknownPolicy {
                            token: other.to_owned(),
                        })
                    }
                };
                spec.validate().map_err(|reason| SpecError::Invalid {
                    group: name.to_owned(),
                    token: value.to_owned(),
                    reason,
                })?;
                policies.push(spec);
            }
        }
        if policies.is_empty() {
            return Err(if max_waits.is_empty() && learns.is_empty() {
                SpecError::Empty
            } else {
                SpecError::NoPolicy
            });
        }
        if max_waits.is_empty() {
            max_waits.push(None);
        }
        if learns.is_empty() {
            learns.push(false);
        }
        let mut settings: Vec<PolicySpec> = Vec::new();
        for spec in &policies {
            for learn in &learns {
                for wait in &max_waits {
                    let spec = PolicySpec {
                        max_wait: *wait,
                        learn_initial_delay: *learn && spec.name == PolicyName::Adaptive,
                        ..spec.clone()
                    };
                    if !settings.contains(&spec) {
                        settings.push(spec);
                    }
                }
            }
        }
        Ok(Sweep { settings })
    }
}

/// Parses a sweep duration to whole ms; `group` names the error's context.
fn parse_ms(group: &str, token: &str) -> Result<Millis, SpecError> {
    duration_ms(token).map_err(|reason| SpecError::BadDuration {
        group: group.to_owned(),
        token: token.to_owned(),
        reason,
    })
}

/// A humantime duration (`500ms`, `10s`, `1m30s`) in whole ms, or why not.
fn duration_ms(token: &str) -> Result<Millis, String> {
    let d = humantime::parse_duration(token).map_err(|e| e.to_string())?;
    Millis::try_from(d.as_millis()).map_err(|_| "too large".to_owned())
}

/// A readable name of one setting: `fixed 10s`, `adaptive 5s/10m, learn, max-wait 30m`
/// (`learn`: learned initial delays).
pub fn describe(spec: &PolicySpec) -> String {
    let d = |ms: Millis| humantime::format_duration(Duration::from_millis(ms.max(0) as u64));
    let mut s = match spec.name {
        PolicyName::Fixed | PolicyName::LeadingTrailing => {
            format!("{} {}", spec.name.as_str(), d(spec.delay))
        }
        PolicyName::Adaptive => format!(
            "{} {}/{}",
            spec.name.as_str(),
            d(spec.min_delay),
            d(spec.max_delay)
        ),
    };
    if spec.learns() {
        s.push_str(", learn");
    }
    if let Some(w) = spec.max_wait {
        s.push_str(&format!(", max-wait {}", d(w)));
    }
    s
}

/// Which time-to-ready percentile a [`Goal`] bounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Quantile {
    /// Median.
    P50,
    /// 90th percentile.
    P90,
    /// 99th percentile.
    P99,
}

impl Quantile {
    /// The percentile as a whole number (50, 90, 99).
    pub fn percent(self) -> u64 {
        match self {
            Quantile::P50 => 50,
            Quantile::P90 => 90,
            Quantile::P99 => 99,
        }
    }

    /// This percentile of `stats`' time-to-ready (ms, as the histogram reports it).
    pub fn of(self, stats: &RunStats) -> u64 {
        let p = stats.time_to_ready();
        match self {
            Quantile::P50 => p.p50,
            Quantile::P90 => p.p90,
            Quantile::P99 => p.p99,
        }
    }
}

/// "Time-to-ready percentile ≤ limit, at least cost". Grammar: `pNN<=DURATION` with
/// `NN` ∈ {50, 90, 99}, `<=` or `≤`, spaces allowed: `p99<=60s`, `p90 <= 2m`.
///
/// Whether a row meets it is decided exactly from the emissions (at least ⌈NN·n/100⌉ of the
/// n emissions have time-to-ready ≤ limit), not from the histogram's rounded percentile, so
/// `fixed 1m` meets `p99<=60s`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Goal {
    /// The bounded percentile.
    pub quantile: Quantile,
    /// The bound (ms).
    pub limit_ms: u64,
}

impl Default for Goal {
    /// [`DEFAULT_GOAL`]: p99 ≤ 60 s.
    fn default() -> Self {
        Goal {
            quantile: Quantile::P99,
            limit_ms: 60_000,
        }
    }
}

impl FromStr for Goal {
    type Err = SpecError;

    fn from_str(text: &str) -> Result<Self, SpecError> {
        let bad = |token: &str, reason: &str| SpecError::BadGoal {
            token: token.to_owned(),
            reason: reason.to_owned(),
        };
        let text = text.trim();
        let (metric, limit) = text
            .split_once("<=")
            .or_else(|| text.split_once('≤'))
            .ok_or_else(|| bad(text, "expected `<=`"))?;
        let quantile = match metric.trim() {
            "p50" => Quantile::P50,
            "p90" => Quantile::P90,
            "p99" => Quantile::P99,
            other => return Err(bad(other, "unknown percentile")),
        };
        let limit = limit.trim();
        let limit_ms = duration_ms(limit).map_err(|e| bad(limit, &format!("bad duration: {e}")))?;
        Ok(Goal {
            quantile,
            limit_ms: limit_ms.max(0) as u64,
        })
    }
}

impl fmt::Display for Goal {
    /// `p99 time-to-ready ≤ 1m`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "p{} time-to-ready ≤ {}",
            self.quantile.percent(),
            humantime::format_duration(Duration::from_millis(self.limit_ms))
        )
    }
}

/// One setting's result.
#[derive(Clone, Debug)]
pub struct Row {
    /// The setting replayed.
    pub spec: PolicySpec,
    /// Its figures (emissions = cost; time-to-ready percentiles in ms).
    pub stats: RunStats,
    /// True when the row meets the goal (decided exactly, see [`Goal`]).
    pub meets_goal: bool,
    /// True when no other row has ≤ emissions and ≤ p99 time-to-ready, < in one (p99 as
    /// [`RunStats`] reports it, 3 significant digits).
    pub pareto: bool,
}

impl Row {
    /// p99 time-to-ready (ms), the latency axis of the Pareto front.
    pub fn p99(&self) -> u64 {
        self.stats.time_to_ready().p99
    }
}

/// Replays `trace` under every setting, in parallel (one worker per core, at most one per
/// setting), and returns one [`Row`] per setting in the same order, Pareto marks set.
pub fn evaluate(trace: &Trace, settings: &[PolicySpec], goal: Goal) -> Vec<Row> {
    let workers = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(settings.len())
        .max(1);
    let next = AtomicUsize::new(0);
    let mut results: Vec<(usize, Row)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                scope.spawn(|| {
                    let mut done = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(spec) = settings.get(i) else { break };
                        done.push((i, replay_setting(trace, spec, goal)));
                    }
                    done
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    });
    results.sort_by_key(|(i, _)| *i);
    let mut rows: Vec<Row> = results.into_iter().map(|(_, row)| row).collect();
    let points: Vec<(u64, u64)> = rows.iter().map(|r| (r.stats.emissions, r.p99())).collect();
    for (row, pareto) in rows.iter_mut().zip(pareto_front(&points)) {
        row.pareto = pareto;
    }
    rows
}

fn replay_setting(trace: &Trace, spec: &PolicySpec, goal: Goal) -> Row {
    let engine = Engine::new(PolicyTable::uniform(spec.clone()));
    let mut within = 0u64;
    let stats = replay_trace(engine, trace, |e| {
        // Time-to-ready as `RunStats` records it: emitted_at (= due_at) − last_upload_at.
        if (e.due_at - e.last_upload_at).max(0) as u64 <= goal.limit_ms {
            within += 1;
        }
    });
    let needed = (goal.quantile.percent() * stats.emissions)
        .div_ceil(100)
        .max(1);
    Row {
        spec: spec.clone(),
        meets_goal: stats.emissions == 0 || within >= needed,
        stats,
        pareto: false,
    }
}

/// Pareto marks of `(cost, latency)` points: `true` when no other point has both coordinates
/// ≤ and at least one <. Equal points are all marked. O(n²); n is a sweep's size.
pub fn pareto_front(points: &[(u64, u64)]) -> Vec<bool> {
    points
        .iter()
        .map(|&(c, l)| {
            !points
                .iter()
                .any(|&(oc, ol)| oc <= c && ol <= l && (oc < c || ol < l))
        })
        .collect()
}

/// The row to recommend: the cheapest (fewest emissions) row meeting the goal; ties go to
/// the lower goal percentile, then the lower p99, then the earlier row. `None` when no row
/// meets the goal.
pub fn recommend(rows: &[Row], goal: Goal) -> Option<usize> {
    rows.iter()
        .enumerate()
        .filter(|(_, r)| r.meets_goal)
        .min_by_key(|(i, r)| (r.stats.emissions, goal.quantile.of(&r.stats), r.p99(), *i))
        .map(|(i, _)| i)
}

/// Everything `settle tune` found.
#[derive(Clone, Debug)]
pub struct TuneReport {
    /// Where the trace came from (file path, or broker, topic and time range), for titles.
    pub source: String,
    /// Usable uploads in the trace.
    pub uploads: u64,
    /// Trace lines or broker records skipped as unusable.
    pub rejected: u64,
    /// The goal the recommendation is for.
    pub goal: Goal,
    /// One row per setting, in sweep order.
    pub rows: Vec<Row>,
    /// Index into `rows` of the recommended setting; `None` when no row meets the goal.
    pub recommended: Option<usize>,
}

impl TuneReport {
    /// Replays `trace` under `sweep` and decides the recommendation for `goal`.
    pub fn build(source: &str, trace: &Trace, sweep: &Sweep, goal: Goal) -> Self {
        let rows = evaluate(trace, &sweep.settings, goal);
        TuneReport {
            source: source.to_owned(),
            uploads: trace.uploads.len() as u64,
            rejected: trace.rejected_count(),
            goal,
            recommended: recommend(&rows, goal),
            rows,
        }
    }

    /// The closing sentences: what the columns and marks mean and which setting to take (or
    /// that none meets the goal, with the closest one).
    pub fn verdict(&self) -> Vec<String> {
        let mut lines = vec![
            "columns: emissions = cost (session-ready records); uploads/em = coalescing ratio; \
             p50/p90/p99 = time-to-ready (last upload to ready); max-wait = share of emissions \
             cut by max-wait; goal = the row meets the goal."
                .to_owned(),
            "* = Pareto-optimal: no other setting has both fewer-or-equal emissions and \
             lower-or-equal p99 time-to-ready, with one strictly better."
                .to_owned(),
        ];
        let figures = |r: &Row| {
            format!(
                "{} emissions, {:.1} uploads/emission, p99 time-to-ready {}",
                r.stats.emissions,
                r.stats.coalescing_ratio(),
                human_ms(r.p99())
            )
        };
        match self.recommended.and_then(|i| self.rows.get(i)) {
            Some(r) => lines.push(format!(
                "recommended for goal \"{} at least cost\": {} ({}).",
                self.goal,
                describe(&r.spec),
                figures(r)
            )),
            None => {
                lines.push(format!(
                    "NO setting meets the goal \"{}\": relax the goal or sweep shorter delays.",
                    self.goal
                ));
                let closest = self
                    .rows
                    .iter()
                    .min_by_key(|r| (self.goal.quantile.of(&r.stats), r.stats.emissions));
                if let Some(r) = closest {
                    lines.push(format!("closest: {} ({}).", describe(&r.spec), figures(r)));
                }
            }
        }
        lines
    }

    /// Writes the table and the verdict as plain text.
    pub fn write_table(&self, out: &mut impl Write) -> std::io::Result<()> {
        writeln!(
            out,
            "settle tune: {} — {} uploads ({} unusable skipped), {} settings",
            self.source,
            self.uploads,
            self.rejected,
            self.rows.len()
        )?;
        writeln!(out, "goal: {} at least cost", self.goal)?;
        writeln!(out)?;
        let width = self
            .rows
            .iter()
            .map(|r| describe(&r.spec).chars().count())
            .chain([7])
            .max()
            .unwrap_or(7);
        let header = TABLE_COLUMNS;
        writeln!(
            out,
            "  {:<width$}  {:>9}  {:>10}  {:>7}  {:>7}  {:>7}  {:>8}  {:>4}",
            header[1], header[2], header[3], header[4], header[5], header[6], header[7], header[8]
        )?;
        for (i, r) in self.rows.iter().enumerate() {
            let c = self.cells(r);
            writeln!(
                out,
                "{:<1} {:<width$}  {:>9}  {:>10}  {:>7}  {:>7}  {:>7}  {:>8}  {:>4}{}",
                c[0],
                c[1],
                c[2],
                c[3],
                c[4],
                c[5],
                c[6],
                c[7],
                c[8],
                if Some(i) == self.recommended {
                    "  <- recommended"
                } else {
                    ""
                }
            )?;
        }
        writeln!(out)?;
        for line in self.verdict() {
            writeln!(out, "{line}")?;
        }
        Ok(())
    }

    /// The cells of one row, in [`TABLE_COLUMNS`] order.
    fn cells(&self, r: &Row) -> [String; 9] {
        let ttr = r.stats.time_to_ready();
        [
            if r.pareto { "*" } else { "" }.to_owned(),
            describe(&r.spec),
            r.stats.emissions.to_string(),
            format!("{:.1}", r.stats.coalescing_ratio()),
            human_ms(ttr.p50),
            human_ms(ttr.p90),
            human_ms(ttr.p99),
            format!("{:.1}%", 100.0 * r.stats.max_wait_share()),
            if r.meets_goal { "yes" } else { "no" }.to_owned(),
        ]
    }

    /// The chart: emissions (x) against p99 time-to-ready in seconds (y), one point per
    /// setting, Pareto-optimal points highlighted, labelled and joined, the goal drawn as a
    /// line. Returns an SVG document.
    pub fn render_svg(&self) -> Result<String, PlotError> {
        plot_svg(self).map_err(|e| PlotError(e.to_string()))
    }

    /// [`TuneReport::render_svg`] as an element to put inside an HTML page: the `<svg>`
    /// element alone, without the XML prolog.
    pub fn render_svg_element(&self) -> Result<String, PlotError> {
        let mut svg = self.render_svg()?;
        if let Some(i) = svg.find("<svg") {
            svg.replace_range(..i, "");
        }
        Ok(svg)
    }

    /// An HTML page (well-formed XHTML syntax) with the verdict, the table and the SVG chart.
    pub fn render_html(&self) -> Result<String, PlotError> {
        let svg = self.render_svg_element()?;
        let mut html = String::new();
        html.push_str("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\"/>\n");
        html.push_str(&format!(
            "<title>settle tune: {}</title>\n<style>\n{HTML_STYLE}</style>\n</head>\n<body>\n",
            escape(&self.source)
        ));
        html.push_str(&format!(
            "<h1>settle tune: {}</h1>\n<p>{} uploads ({} unusable skipped), {} settings. \
             Goal: {} at least cost.</p>\n<table>\n<thead><tr>",
            escape(&self.source),
            self.uploads,
            self.rejected,
            self.rows.len(),
            escape(&self.goal.to_string())
        ));
        for h in TABLE_COLUMNS {
            html.push_str(&format!("<th>{}</th>", escape(h)));
        }
        html.push_str("</tr></thead>\n<tbody>\n");
        for (i, r) in self.rows.iter().enumerate() {
            let class = match (Some(i) == self.recommended, r.pareto) {
                (true, _) => " class=\"recommended\"",
                (false, true) => " class=\"pareto\"",
                _ => "",
            };
            html.push_str(&format!("<tr{class}>"));
            for c in self.cells(r) {
                html.push_str(&format!("<td>{}</td>", escape(&c)));
            }
            html.push_str("</tr>\n");
        }
        html.push_str("</tbody>\n</table>\n");
        for line in self.verdict() {
            html.push_str(&format!("<p>{}</p>\n", escape(&line)));
        }
        html.push_str(&svg);
        html.push_str("\n</body>\n</html>\n");
        Ok(html)
    }
}

/// Column headers of the table (text and HTML), in cell order.
pub const TABLE_COLUMNS: [&str; 9] = [
    "Pareto",
    "setting",
    "emissions",
    "uploads/em",
    "p50",
    "p90",
    "p99",
    "max-wait",
    "goal",
];

const HTML_STYLE: &str = "body { font-family: sans-serif; margin: 2em; }
table { border-collapse: collapse; margin: 1em 0; }
th, td { border: 1px solid #ccc; padding: 0.2em 0.6em; text-align: right; }
td:nth-child(2) { text-align: left; }
tr.pareto { background: #fde8e8; }
tr.recommended { background: #c8f0c8; font-weight: bold; }
";

/// Drawing the chart failed (plotters error, as text).
#[derive(Debug, thiserror::Error)]
#[error("cannot draw the tune chart: {0}")]
pub struct PlotError(pub String);

/// Escapes text for HTML/XML content and attribute values.
fn escape(text: &str) -> String {
    let mut s = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => s.push_str("&amp;"),
            '<' => s.push_str("&lt;"),
            '>' => s.push_str("&gt;"),
            '"' => s.push_str("&quot;"),
            c => s.push(c),
        }
    }
    s
}

/// Tick marks of the chart's log time axis (s): 1 s to 1 day in the steps people think in.
const TIME_TICKS_S: [f64; 16] = [
    0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1_800.0, 3_600.0, 7_200.0, 21_600.0,
    43_200.0, 86_400.0,
];

/// X axis name of the chart.
pub const X_AXIS: &str = "cost: emissions (count)";
/// Y axis name of the chart.
pub const Y_AXIS: &str = "p99 time-to-ready (log scale)";

fn plot_svg(report: &TuneReport) -> Result<String, Box<dyn std::error::Error>> {
    use plotters::prelude::*;
    let secs = |ms: u64| ms as f64 / 1000.0;
    // A log time axis: the region that matters (seconds to a minute) gets as much room as
    // the minutes above it. A p99 of 0 sits on the axis' floor.
    let goal_s = secs(report.goal.limit_ms);
    let p99s = report.rows.iter().map(|r| secs(r.p99()));
    let y_min = p99s
        .clone()
        .filter(|&y| y > 0.0)
        .fold(goal_s.max(0.1), f64::min)
        / 2.0;
    let y_max = p99s.fold(goal_s.max(1.0), f64::max) * 2.0;
    let point = |r: &Row| (r.stats.emissions as f64, secs(r.p99()).max(y_min));
    let x_max = report
        .rows
        .iter()
        .map(|r| r.stats.emissions as f64)
        .fold(1.0, f64::max)
        * 1.1;
    let mut front: Vec<&Row> = report.rows.iter().filter(|r| r.pareto).collect();
    front.sort_by_key(|r| (r.stats.emissions, r.p99()));

    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (1400, 720)).into_drawing_area();
        root.fill(&WHITE)?;
        let (plot, side) = root.split_horizontally(1000);
        let mut chart = ChartBuilder::on(&plot)
            .caption(
                format!("settle tune: cost vs p99 time-to-ready ({})", report.source),
                ("sans-serif", 20),
            )
            .margin(20)
            .x_label_area_size(50)
            .y_label_area_size(70)
            .build_cartesian_2d(
                0f64..x_max,
                (y_min..y_max).log_scale().with_key_points(
                    TIME_TICKS_S
                        .iter()
                        .copied()
                        .filter(|t| (y_min..=y_max).contains(t))
                        .collect(),
                ),
            )?;
        chart
            .configure_mesh()
            .x_desc(X_AXIS)
            .y_desc(Y_AXIS)
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_label_formatter(&|y| human_ms((y * 1000.0).round() as u64))
            .draw()?;
        chart
            .draw_series(LineSeries::new(
                [(0.0, goal_s), (x_max, goal_s)],
                GREEN.stroke_width(1),
            ))?
            .label(format!("goal: {}", report.goal))
            .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], GREEN));
        chart
            .draw_series(
                report
                    .rows
                    .iter()
                    .filter(|r| !r.pareto)
                    .map(|r| Circle::new(point(r), 4, BLUE.mix(0.6).filled())),
            )?
            .label("setting")
            .legend(|(x, y)| Circle::new((x + 10, y), 4, BLUE.mix(0.6).filled()));
        chart.draw_series(LineSeries::new(
            front.iter().map(|r| point(r)),
            RED.mix(0.5),
        ))?;
        chart
            .draw_series(front.iter().map(|r| Circle::new(point(r), 6, RED.filled())))?
            .label("Pareto-optimal")
            .legend(|(x, y)| Circle::new((x + 10, y), 6, RED.filled()));
        if let Some(r) = report.recommended.and_then(|i| report.rows.get(i)) {
            chart
                .draw_series([Circle::new(point(r), 10, BLACK.stroke_width(2))])?
                .label(format!("recommended: {}", describe(&r.spec)))
                .legend(|(x, y)| Circle::new((x + 10, y), 6, BLACK.stroke_width(2)));
        }
        // Every point carries the numbers of its settings (rows of the table, from 1). A
        // point that would sit under a label to its left (about the same time, within the
        // label's width on the cost axis: ~7 px a character of ~890 px) joins that label.
        let mut by_cost: Vec<(usize, (f64, f64))> = report
            .rows
            .iter()
            .enumerate()
            .map(|(n, r)| (n + 1, point(r)))
            .collect();
        by_cost.sort_by(|a, b| a.1 .0.total_cmp(&b.1 .0).then(a.0.cmp(&b.0)));
        let width = |numbers: &[usize]| {
            let chars: usize = numbers.iter().map(|n| n.to_string().len() + 1).sum();
            (chars as f64 * 7.0 + 12.0) * x_max / 890.0
        };
        let mut labels: Vec<((f64, f64), Vec<usize>)> = Vec::new();
        for (n, p) in by_cost {
            let under = labels.iter_mut().find(|(q, numbers)| {
                (p.1 / q.1 - 1.0).abs() <= 0.04 && p.0 - q.0 <= width(numbers)
            });
            match under {
                Some((_, numbers)) => numbers.push(n),
                None => labels.push((p, vec![n])),
            }
        }
        for (_, numbers) in &mut labels {
            numbers.sort_unstable();
        }
        chart.draw_series(labels.into_iter().map(|(p, numbers)| {
            let text: Vec<String> = numbers.iter().map(usize::to_string).collect();
            EmptyElement::at(p) + Text::new(text.join(","), (8, -14), ("sans-serif", 11))
        }))?;
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()?;
        // The key: number → setting, Pareto-optimal rows marked.
        let line_h = ((680 / (report.rows.len() + 1).max(1)) as i32).clamp(9, 16);
        let font = ("sans-serif", (line_h - 2).max(8));
        side.draw(&Text::new("settings (* Pareto-optimal)", (10, 24), font))?;
        for (n, r) in report.rows.iter().enumerate() {
            let mark = if report.recommended == Some(n) {
                "* <- recommended"
            } else if r.pareto {
                "*"
            } else {
                ""
            };
            let y = 24 + line_h * (n as i32 + 1);
            let text = format!("{:>2}  {} {mark}", n + 1, describe(&r.spec));
            side.draw(&Text::new(text, (10, y), font))?;
        }
        root.present()?;
    }
    Ok(svg)
}

/// Input of [`run`]: what the `settle tune` flags carry for a JSONL trace file (broker
/// traces go through [`run_trace`]).
#[derive(Clone, Debug)]
pub struct TuneArgs {
    /// JSONL trace (format of `settle simulate`).
    pub input: PathBuf,
    /// Settings to replay (`--sweep`; [`Sweep::default`] when absent).
    pub sweep: Sweep,
    /// The goal of the recommendation (`--goal`; [`Goal::default`] when absent).
    pub goal: Goal,
    /// Where to write the chart: `.svg` (chart) or `.html` (table + chart).
    pub report: Option<PathBuf>,
}

/// `settle tune`: reads the trace, replays it under every setting of the sweep (in parallel),
/// writes the table and the verdict to `out`, and the chart to `args.report` when given.
///
/// Errors: the trace or report file cannot be read/written, the report extension is not
/// `svg`/`html`/`htm`, the trace has no usable upload, or the chart cannot be drawn.
pub fn run(args: TuneArgs, out: &mut impl Write) -> anyhow::Result<TuneReport> {
    // Check the report path before minutes of replay, not after.
    if let Some(path) = &args.report {
        check_report_path(path)?;
    }
    let trace = read_trace_file(&args.input)?;
    run_trace(
        &args.input.display().to_string(),
        &trace,
        &args.sweep,
        args.goal,
        args.report.as_deref(),
        out,
    )
}

/// `settle tune` as the command line has it: checks the `report` path first (before
/// minutes of reading and replay), loads the config (`config`, `SETTLE_*` variables) for
/// the broker of a `--from-kafka`/`--from-nats` source, reads the trace of `source`, and
/// runs [`run_trace`] with the table and verdict on standard output.
///
/// Errors: as [`run_trace`], plus an invalid config or a trace that cannot be read.
pub fn command(
    source: &SourceArgs,
    config: Option<&Path>,
    sweep: &Sweep,
    goal: Goal,
    report: Option<&Path>,
) -> anyhow::Result<()> {
    if let Some(path) = report {
        check_report_path(path)?;
    }
    let cfg = crate::config::Config::load(config)?;
    let loaded = super::trace_source::load(source, &cfg)?;
    run_trace(
        &loaded.source,
        &loaded.trace,
        sweep,
        goal,
        report,
        &mut std::io::stdout().lock(),
    )?;
    Ok(())
}

/// `settle tune` on a trace already read from `source` (a file name, or a broker, topic and
/// range: used in titles): replays it under every setting of `sweep` (in parallel), writes
/// the table and the verdict to `out`, and the chart to `report` when given.
///
/// Errors: the trace has no usable upload, the report extension is not `svg`/`html`/`htm`,
/// the report cannot be written or the chart cannot be drawn.
pub fn run_trace(
    source: &str,
    trace: &Trace,
    sweep: &Sweep,
    goal: Goal,
    report_path: Option<&Path>,
    out: &mut impl Write,
) -> anyhow::Result<TuneReport> {
    let format = report_path.map(report_format).transpose()?;
    if trace.uploads.is_empty() {
        anyhow::bail!(
            "{source}: no usable upload in the trace ({} unusable skipped: {}); nothing to tune",
            trace.rejected_count(),
            trace.rejected_summary()
        );
    }
    let report = TuneReport::build(source, trace, sweep, goal);
    report.write_table(out)?;
    if let (Some(path), Some(format)) = (report_path, format) {
        let text = match format {
            ReportFormat::Svg => report.render_svg()?,
            ReportFormat::Html => report.render_html()?,
        };
        std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))?;
        writeln!(out, "report written to {}", path.display())?;
    }
    Ok(report)
}

#[derive(Clone, Copy)]
enum ReportFormat {
    Svg,
    Html,
}

/// Checks that `path` names a report `settle tune` can write (`.svg`, `.html` or `.htm`), so
/// a long read or replay is not wasted on a bad name.
///
/// Errors: any other extension (the message names the path).
pub fn check_report_path(path: &Path) -> anyhow::Result<()> {
    report_format(path).map(|_| ())
}

fn report_format(path: &Path) -> anyhow::Result<ReportFormat> {
    match path
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase)
        .as_deref()
    {
        Some("svg") => Ok(ReportFormat::Svg),
        Some("html" | "htm") => Ok(ReportFormat::Html),
        _ => anyhow::bail!(
            "--report {}: the file name must end in .svg or .html",
            path.display()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_sweep_has_34_settings() {
        let s = Sweep::default();
        assert_eq!(s.settings.len(), 34);
        assert_eq!(describe(&s.settings[0]), "fixed 5s");
        assert_eq!(describe(&s.settings[1]), "fixed 5s, max-wait 30m");
        assert_eq!(describe(&s.settings[18]), "adaptive 5s/10m");
        assert_eq!(describe(&s.settings[20]), "adaptive 5s/10m, learn");
        assert_eq!(
            describe(&s.settings[33]),
            "adaptive 30s/10m, learn, max-wait 30m"
        );
    }

    #[test]
    fn learn_applies_to_adaptive_settings_only() {
        let s: Sweep = "fixed:5s;adaptive:5s/10m;learn:off,on".parse().unwrap();
        let labels: Vec<String> = s.settings.iter().map(describe).collect();
        assert_eq!(
            labels,
            ["fixed 5s", "adaptive 5s/10m", "adaptive 5s/10m, learn"]
        );
        assert!(s.settings[2].learns());
        let e = "adaptive:5s/10m;learn:yes".parse::<Sweep>().unwrap_err();
        assert!(e.to_string().contains("`yes`"), "{e}");
        assert_eq!("learn:on".parse::<Sweep>(), Err(SpecError::NoPolicy));
    }

    #[test]
    fn goal_grammar() {
        assert_eq!("p99<=60s".parse::<Goal>(), Ok(Goal::default()));
        let g: Goal = " p90 ≤ 2m ".parse().unwrap();
        assert_eq!((g.quantile, g.limit_ms), (Quantile::P90, 120_000));
        assert_eq!(g.to_string(), "p90 time-to-ready ≤ 2m");
        let e = "p95<=1m".parse::<Goal>().unwrap_err();
        assert!(e.to_string().contains("`p95`"), "{e}");
        let e = "p99<=soon".parse::<Goal>().unwrap_err();
        assert!(e.to_string().contains("`soon`"), "{e}");
    }

    #[test]
    fn pareto_keeps_ties_and_drops_dominated() {
        // (10,5) and (10,5) tie: both kept. (12,5) is dominated by (10,5). (5,9) is cheapest.
        let marks = pareto_front(&[(10, 5), (10, 5), (12, 5), (5, 9), (6, 9)]);
        assert_eq!(marks, vec![true, true, false, true, false]);
    }
}
