//! The seed's noisy-neighbour experiment (SEMANTICS §5) on the real pipeline, no broker:
//! `settle::cli::noisy` drives the runtime (RocksDB stores, tier router, outbox publisher) on the
//! memory transport in real time, three times — the normal tenant alone, both tenants with
//! tiers, both with one topic — and replays each run's emissions through a simulated worker
//! pool (100 ms per job, first tier first). It prints when the normal tenant's last job is
//! done in each case, for several pool sizes.
//!
//! * `cargo bench --bench tiers`: the experiment's size (100 + 1 000 sessions within 10 s;
//!   about 40 s).
//! * `cargo test --bench tiers` (and `cargo test --all-targets`): a smoke run at a tenth of
//!   the size (about 8 s); prints the same table.
//!
//! Environment: `TIERS_BENCH_PARTITIONS` (default 4), `TIERS_BENCH_SEED` (default 7),
//! `TIERS_BENCH_PERIOD_MS` (`tiers.period`, default the whole window; `tiers.limit` is always
//! twice the normal tenant's average emissions per period).

use settle::cli::noisy::{self, CaseRun, NoisyParams};
use settle::tiers::TiersConfig;
use std::time::Duration;

/// Work per job downstream (ms), as in the seed.
const SERVICE_MS: i64 = 100;

/// Worker pool sizes reported; the first row marked is the headline figure.
const WORKERS: [usize; 5] = [2, 3, 4, 6, 8];

/// The pool size of the headline figure (and the goal): 40 jobs/s, 4× the normal tenant's
/// average rate and well below the 110 jobs/s of both tenants together.
const HEADLINE_WORKERS: usize = 4;

fn env<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn secs(ms: i64) -> String {
    format!("{:.2} s", ms as f64 / 1000.0)
}

fn main() -> anyhow::Result<()> {
    let full = std::env::args().any(|a| a == "--bench");
    let seed = env("TIERS_BENCH_SEED", 7);
    let partitions = env("TIERS_BENCH_PARTITIONS", 4);
    let params = if full {
        NoisyParams {
            seed,
            ..NoisyParams::default()
        }
    } else {
        NoisyParams {
            normal_sessions: 10,
            noisy_sessions: 100,
            window_ms: 1_000,
            seed,
            ..NoisyParams::default()
        }
    };
    // The operator's choice: twice the normal tenant's average emissions per period pass.
    let period_ms: u64 = env("TIERS_BENCH_PERIOD_MS", params.window_ms).max(1);
    let period = Duration::from_millis(period_ms);
    let limit = (2 * u64::from(params.normal_sessions) * period_ms).div_ceil(params.window_ms);
    let tiers = TiersConfig {
        limit: limit.max(1),
        period,
        recover_ratio: 0.5,
        cooldown: Duration::from_secs(30),
        ..TiersConfig::default()
    };
    println!(
        "noisy neighbour ({}): {} sessions of {} and {} of {} within {}, 10 uploads each, \
         fixed 1 s debounce, {partitions} partitions; real runtime on the memory transport",
        if full {
            "full size"
        } else {
            "smoke size; --bench for full"
        },
        params.normal_sessions,
        noisy::NORMAL_TENANT,
        params.noisy_sessions,
        noisy::NOISY_TENANT,
        humantime::format_duration(Duration::from_millis(params.window_ms)),
    );
    println!(
        "tiers: limit {} per {}, recover-ratio {}, cooldown {}; jobs {} ms each, first tier first",
        tiers.limit,
        humantime::format_duration(tiers.period),
        tiers.recover_ratio,
        humantime::format_duration(tiers.cooldown),
        SERVICE_MS
    );
    let alone_plan = noisy::plan(&params, false);
    let both_plan = noisy::plan(&params, true);
    let cases: Vec<(&str, CaseRun)> = settle::runtime::block_on(async {
        let alone = noisy::run_case(&alone_plan, &tiers, partitions).await?;
        let with_tiers = noisy::run_case(&both_plan, &tiers, partitions).await?;
        let one_topic = noisy::run_case(&both_plan, &noisy::one_topic(), partitions).await?;
        anyhow::Ok(vec![
            ("alone", alone),
            ("with tiers", with_tiers),
            ("one topic", one_topic),
        ])
    })??;

    println!();
    println!(
        "{:<11} {:>8} {:>9}  {:<34} tier changes",
        "case", "sessions", "emissions", "per tier"
    );
    for (name, run) in &cases {
        let per_tier: Vec<String> = run
            .per_tier
            .iter()
            .map(|(t, n)| format!("{t} {n}"))
            .collect();
        let changes: Vec<String> = run
            .tier_changes
            .iter()
            .map(|c| format!("{} {}->{} at rate {}", c.tenant, c.from, c.to, c.rate))
            .collect();
        println!(
            "{:<11} {:>8} {:>9}  {:<34} {}",
            name,
            run.sessions,
            run.jobs.len(),
            per_tier.join(", "),
            if changes.is_empty() {
                "-".to_owned()
            } else {
                changes.join("; ")
            }
        );
    }

    println!();
    println!("normal tenant's completion (first upload -> its last job done):");
    println!(
        "{:>7} {:>9} {:>11} {:>10} {:>11} {:>10}   normal job wait p99 (emission -> done)",
        "workers", "alone", "with tiers", "one topic", "tiers/alone", "one/alone"
    );
    for workers in WORKERS {
        let [alone, tiered, one] = [0, 1, 2].map(|i| cases[i].1.completion(workers, SERVICE_MS));
        println!(
            "{:>6}{} {:>9} {:>11} {:>10} {:>10.2}x {:>9.2}x   alone {} · tiers {} · one {}",
            workers,
            if workers == HEADLINE_WORKERS {
                "*"
            } else {
                " "
            },
            secs(alone.normal_ms),
            secs(tiered.normal_ms),
            secs(one.normal_ms),
            tiered.normal_ms as f64 / alone.normal_ms.max(1) as f64,
            one.normal_ms as f64 / alone.normal_ms.max(1) as f64,
            secs(alone.normal_wait_p99_ms),
            secs(tiered.normal_wait_p99_ms),
            secs(one.normal_wait_p99_ms),
        );
    }
    let alone = cases[0].1.completion(HEADLINE_WORKERS, SERVICE_MS);
    let tiered = cases[1].1.completion(HEADLINE_WORKERS, SERVICE_MS);
    let ratio = tiered.normal_ms as f64 / alone.normal_ms.max(1) as f64;
    println!(
        "goal (with tiers <= 1.2x alone, {HEADLINE_WORKERS} workers): {:.2}x {}; noisy tenant done after {} with tiers",
        ratio,
        if ratio <= 1.2 { "met" } else { "NOT met" },
        secs(tiered.noisy_ms)
    );
    Ok(())
}
