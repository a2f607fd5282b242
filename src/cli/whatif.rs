//! The What-if view's sweep runner for `settle run` (issue 35, view 6): `settle tune` over
//! the last minutes of the input the service consumes, behind the admin server's
//! [`WhatIf`]. It lives with the tools because the replay and the range readers do (the
//! admin server sits below them in the crate's layers); `main` hands [`for_config`] to
//! `crate::service::run`, which makes it from the service's own config.
//!
//! A sweep reads the input topic (`--from-kafka`) or stream (`--from-nats`) of
//! `config.transport` over `[now − minutes, now]` with the range readers of `settle tune`
//! ([`trace_source::read_input`]: no consumer group is joined, nothing acknowledged), at most
//! [`MAX_UPLOADS`] uploads, then builds `settle tune`'s report ([`TuneReport::build`]: every
//! setting replayed in parallel, Pareto marks, the recommendation) and its chart. The admin
//! server calls it on a blocking thread, one at a time.

use super::trace_source::{self, TimeArg, TimeRange, TooManyUploads};
use super::tune::{describe, Goal, Sweep, TuneReport, DEFAULT_GOAL, DEFAULT_SWEEP};
use crate::admin::whatif::{
    WhatIf, WhatIfError, WhatIfRequest, WhatIfResult, WhatIfRow, MAX_MINUTES, MAX_UPLOADS,
};
use crate::config::Config;
use crate::engine::Millis;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

/// Most settings one sweep replays (each one replays every upload of the range).
pub const MAX_SETTINGS: usize = 200;

/// The sweeps of a `settle run` with `config`: its transport's input, its broker settings.
#[derive(Clone, Debug)]
pub struct InputSweeps {
    config: Config,
}

/// [`InputSweeps`] of `config`, as the admin server takes it (the `admin::WhatIfFactory`
/// `main` passes to `crate::service::run`).
pub fn for_config(config: &Config) -> Arc<dyn WhatIf> {
    Arc::new(InputSweeps {
        config: config.clone(),
    })
}

fn wall_ms() -> Millis {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| {
        Millis::try_from(d.as_millis()).unwrap_or(Millis::MAX)
    })
}

impl WhatIf for InputSweeps {
    fn default_sweep(&self) -> &str {
        DEFAULT_SWEEP
    }

    fn default_goal(&self) -> &str {
        DEFAULT_GOAL
    }

    fn sweep(&self, request: &WhatIfRequest) -> Result<WhatIfResult, WhatIfError> {
        let refused = WhatIfError::Refused;
        if !(1..=MAX_MINUTES).contains(&request.minutes) {
            return Err(refused(format!(
                "minutes {}: from 1 to {MAX_MINUTES}",
                request.minutes
            )));
        }
        let sweep = request
            .sweep
            .as_deref()
            .unwrap_or(DEFAULT_SWEEP)
            .parse::<Sweep>()
            .map_err(|e| refused(format!("sweep: {e}")))?;
        if sweep.settings.len() > MAX_SETTINGS {
            return Err(refused(format!(
                "sweep: {} settings, at most {MAX_SETTINGS}",
                sweep.settings.len()
            )));
        }
        let goal = request
            .goal
            .as_deref()
            .unwrap_or(DEFAULT_GOAL)
            .parse::<Goal>()
            .map_err(|e| refused(format!("goal: {e}")))?;
        let range = TimeRange::resolve(
            Some(TimeArg::Ago(Millis::from(request.minutes) * 60_000)),
            None,
            wall_ms(),
        )
        .map_err(|e| refused(e.to_string()))?;
        let read = trace_source::read_input(
            &self.config,
            self.config.transport,
            None,
            range,
            false,
            Some(MAX_UPLOADS),
        )
        .map_err(|e| match e.downcast_ref::<TooManyUploads>() {
            Some(too_many) => refused(format!("the last {} minutes: {too_many}", request.minutes)),
            None => WhatIfError::Failed(format!("{e:#}")),
        })?;
        tracing::info!(summary = %read.summary, "what-if sweep: input read");
        let source = format!("{}, {range}", read.summary.source);
        if read.trace.uploads.is_empty() {
            return Err(refused(format!(
                "{source}: no usable upload in the last {} minutes ({} unusable skipped): nothing to replay",
                request.minutes,
                read.trace.rejected_count()
            )));
        }
        let report = TuneReport::build(&source, &read.trace, &sweep, goal);
        let svg = match report.render_svg_element() {
            Ok(svg) => Some(svg),
            Err(e) => {
                tracing::warn!(error = %e, "what-if sweep: no chart");
                None
            }
        };
        let rows = report
            .rows
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let ttr = r.stats.time_to_ready();
                WhatIfRow {
                    setting: describe(&r.spec),
                    emissions: r.stats.emissions,
                    uploads_per_emission: r.stats.coalescing_ratio(),
                    time_to_ready_p50_ms: ttr.p50,
                    time_to_ready_p99_ms: ttr.p99,
                    meets_goal: r.meets_goal,
                    pareto: r.pareto,
                    recommended: report.recommended == Some(i),
                }
            })
            .collect();
        Ok(WhatIfResult {
            source: report.source.clone(),
            uploads: report.uploads,
            rejected: report.rejected,
            goal: report.goal.to_string(),
            verdict: report.verdict(),
            rows,
            svg,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ask(minutes: u32, sweep: Option<&str>, goal: Option<&str>) -> WhatIfRequest {
        WhatIfRequest {
            minutes,
            sweep: sweep.map(str::to_owned),
            goal: goal.map(str::to_owned),
        }
    }

    #[test]
    fn bad_requests_are_refused_before_any_read() {
        // No broker on this config's addresses is needed: each is refused first.
        let sweeps = InputSweeps {
            config: Config::default(),
        };
        let refused = |r: WhatIfRequest| match sweeps.sweep(&r) {
            Err(WhatIfError::Refused(m)) => m,
            other => panic!("{other:?}"),
        };
        assert!(refused(ask(0, None, None)).contains("from 1 to 60"));
        assert!(refused(ask(61, None, None)).contains("from 1 to 60"));
        assert!(refused(ask(5, Some("fixed"), None)).starts_with("sweep:"));
        assert!(refused(ask(5, None, Some("p42<=1s"))).starts_with("goal:"));
        let many: Vec<String> = (1..=MAX_SETTINGS + 1).map(|s| format!("{s}s")).collect();
        let many = format!("fixed:{}", many.join(","));
        assert!(refused(ask(5, Some(&many), None)).contains("at most 200"));
        assert_eq!(sweeps.default_sweep(), DEFAULT_SWEEP);
        assert_eq!(sweeps.default_goal(), DEFAULT_GOAL);
    }
}
