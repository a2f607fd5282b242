//! The `settle` command line (clap): it parses the arguments and dispatches, nothing else.
//! `settle run` is `settle::service`; every other subcommand is a tool of `settle::cli`.

use clap::{Parser, Subcommand, ValueEnum};
use settle::cli;
use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

/// settle: server-side debounce for "test result uploaded" streams (Kafka, NATS JetStream).
#[derive(Parser, Debug)]
#[command(name = "settle", version, about, long_about = None)]
struct Cli {
    /// Log format: `text` for people, `json` for log pipelines.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text, env = "SETTLE_LOG_FORMAT")]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// The long-running service: consume uploads from Kafka (consumer group) or NATS
    /// JetStream (durable pull consumers), debounce per session, publish session-ready records
    /// to the tier topics. Stops on SIGINT/SIGTERM.
    Run {
        /// Config file (TOML, see config/settle.toml); `SETTLE_*` variables override it.
        /// Without one, the defaults apply (Kafka on 127.0.0.1:9092).
        #[arg(long, short = 'c', env = "SETTLE_CONFIG")]
        config: Option<PathBuf>,
        /// Broker to use, overriding the config's `transport` (`SETTLE_TRANSPORT`).
        #[arg(long, value_enum)]
        transport: Option<settle::config::Transport>,
    },
    /// Produce realistic upload traffic to a Kafka topic, or with --nats to JetStream subjects
    /// (the demo's scenarios), for trying settle, tests and benchmarks.
    Loadgen(cli::loadgen::LoadgenArgs),
    /// Operate a running instance through its admin API: whoami, partitions, pending work,
    /// flush or cancel rounds, tenant overrides, the audit trail (URL from --url or SETTLE_ADMIN_URL, token
    /// from --token-file or SETTLE_ADMIN_TOKEN).
    Admin(cli::admin::AdminArgs),
    /// Print the records of Kafka topics (or, with --nats, NATS JetStream subjects) as JSON
    /// lines (ready records, tier changes, dead letters); no consumer group is joined.
    Consume(cli::consume::ConsumeArgs),
    /// Run the real runtime on RocksDB with an in-memory broker through the seed's scenarios
    /// (700-way bursts, split uploads, slow trickles, many tenants); about 20 s.
    Demo {
        /// Keep the partition stores here (a temporary directory otherwise).
        #[arg(long)]
        data_dir: Option<PathBuf>,
        /// Partitions of the in-memory input topic.
        #[arg(long, default_value_t = 4)]
        partitions: i32,
        /// Seed of the scenario generators.
        #[arg(long, default_value_t = 7)]
        seed: u64,
        /// No progress bar (for logs and CI).
        #[arg(long)]
        no_progress: bool,
    },
    /// Read partition stores offline: pending rounds, next due times, outbox size, offsets.
    Inspect {
        /// The `store.data-dir` of the instance (stores live in DIR/TOPIC/PARTITION).
        #[arg(long)]
        data_dir: PathBuf,
        /// Only this input topic.
        #[arg(long)]
        topic: Option<String>,
        /// Only this partition.
        #[arg(long)]
        partition: Option<i32>,
        /// Show only this session's state (CallTrack, open round, next due) and the store it
        /// lives in: tenant/session; exits 1 when no store read holds it.
        #[arg(long)]
        session: Option<String>,
        /// How many upcoming timers to list per partition.
        #[arg(long, default_value_t = 5)]
        timers: usize,
        /// Show this tenant's learned initial delay (from every store that has it).
        #[arg(long)]
        tenant: Option<String>,
        /// How many tenants' learned initial delays to list per partition (most recently
        /// seen first).
        #[arg(long, default_value_t = 5)]
        tenants: usize,
        /// Config file, to show due times and learned delays with the policies in force.
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Test harness: run the runtime on a file-fed memory transport until the input is done.
    #[command(hide = true)]
    RunFile {
        /// Trace (as for `simulate`).
        #[arg(long)]
        input: PathBuf,
        /// Store directory (kept across restarts).
        #[arg(long)]
        data_dir: PathBuf,
        /// Every published ready record is appended here (JSONL).
        #[arg(long)]
        output: PathBuf,
        /// Config file.
        #[arg(long)]
        config: Option<PathBuf>,
        /// Partitions of the in-memory input topic.
        #[arg(long, default_value_t = 4)]
        partitions: i32,
    },
    /// Replay a trace (a JSONL file, or the uploads of a Kafka topic or NATS stream over a
    /// time range) through the engine in event time and print the ready records.
    Simulate {
        /// Config file (TOML): the policies, and the broker for --from-kafka/--from-nats;
        /// without it the defaults of config/settle.toml apply.
        #[arg(long)]
        config: Option<PathBuf>,
        /// Where the trace comes from.
        #[command(flatten)]
        source: cli::trace_source::SourceArgs,
        /// Where to write the ready records (JSONL); standard output when absent.
        #[arg(long)]
        output: Option<PathBuf>,
    },
    /// Replay a trace (a JSONL file, or the uploads of a Kafka topic or NATS stream over a
    /// time range) under many debounce settings; compare cost (emissions) with time-to-ready,
    /// mark the Pareto-optimal settings and recommend one for a goal.
    Tune {
        /// Where the trace comes from.
        #[command(flatten)]
        source: cli::trace_source::SourceArgs,
        /// Config file (TOML) with the broker for --from-kafka/--from-nats (`[kafka]`,
        /// `[nats]`); `SETTLE_*` variables override it. Policies come from --sweep.
        #[arg(long, short = 'c', env = "SETTLE_CONFIG")]
        config: Option<PathBuf>,
        /// Settings to replay: POLICY:VALUES groups separated by ';', e.g.
        /// "fixed:5s,1m;leading-trailing:10s;adaptive:5s/10m;learn:off,on;max-wait:none,30m"
        /// (learn: adaptive with learned initial delays).
        #[arg(long, value_name = "SPEC", default_value = cli::tune::DEFAULT_SWEEP)]
        sweep: cli::tune::Sweep,
        /// Goal of the recommendation: pNN<=DURATION with NN = 50, 90 or 99.
        #[arg(long, default_value = cli::tune::DEFAULT_GOAL)]
        goal: cli::tune::Goal,
        /// Also write the cost/latency chart: FILE.svg (chart) or FILE.html (table and chart).
        #[arg(long, value_name = "FILE")]
        report: Option<PathBuf>,
    },
    /// Validate a config file without connecting to anything.
    CheckConfig {
        /// Config file (TOML).
        file: PathBuf,
    },
}

/// Logs go to stderr; `SETTLE_LOG` (tracing filter syntax) overrides `default_level`.
fn init_logging(format: LogFormat, default_level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("SETTLE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The demo draws a progress bar and a table: only warnings would disturb them.
    let default_level = match cli.command {
        Command::Demo { .. } | Command::Loadgen(_) | Command::Consume(_) | Command::Admin(_) => {
            "warn"
        }
        _ => "info",
    };
    init_logging(cli.log_format, default_level);
    match run(cli.command) {
        Ok(code) => code,
        // The reader of standard output went away (`settle inspect | head`): what it wanted
        // is printed, so end quietly with status 0, as the tool would have at its end.
        Err(e) if is_broken_pipe(&e) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// True when `e` (or any error it wraps) is an `EPIPE` write: standard output's reader closed.
fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

/// Writes a tool's summary and a newline to standard output (an error, not a panic as with
/// `println!`, when its reader is gone).
fn print_summary(summary: &impl std::fmt::Display) -> std::io::Result<()> {
    writeln!(std::io::stdout().lock(), "{summary}")
}

fn run(command: Command) -> anyhow::Result<ExitCode> {
    match command {
        Command::Run { config, transport } => {
            settle::service::run(config.as_deref(), transport, Some(cli::whatif::for_config))?
        }
        Command::Admin(args) => cli::admin::run(&args, &mut std::io::stdout().lock())?,
        Command::Consume(args) => {
            let report = cli::consume::run(&args, &mut std::io::stdout().lock(), &|| false)?;
            eprintln!("{} record(s)", report.records);
        }
        Command::Loadgen(args) => {
            let report = cli::loadgen::run(&args)?;
            print_summary(&report)?;
            if report.failed > 0 {
                return Ok(ExitCode::FAILURE);
            }
        }
        Command::Demo {
            data_dir,
            partitions,
            seed,
            no_progress,
        } => {
            let report = cli::demo::run(cli::demo::DemoArgs {
                data_dir,
                partitions,
                seed,
                progress: !no_progress,
            })?;
            print_summary(&report)?;
        }
        Command::Inspect {
            data_dir,
            topic,
            partition,
            session,
            timers,
            tenant,
            tenants,
            config,
        } => {
            cli::inspect::run(
                cli::inspect::InspectArgs {
                    data_dir,
                    topic,
                    partition,
                    session,
                    timers,
                    tenant,
                    tenants,
                    config,
                },
                &mut std::io::stdout().lock(),
            )?;
        }
        Command::RunFile {
            input,
            data_dir,
            output,
            config,
            partitions,
        } => {
            let report = cli::run_file::run(cli::run_file::RunFileArgs {
                input,
                data_dir,
                output,
                config,
                partitions,
            })?;
            // With [[shadow]]: one JSON line per policy (live first).
            for figures in &report.shadows {
                println!("{}", serde_json::to_string(figures)?);
            }
        }
        Command::Simulate {
            config,
            source,
            output,
        } => cli::simulate::command(config.as_deref(), &source, output.as_deref())?,
        Command::Tune {
            source,
            config,
            sweep,
            goal,
            report,
        } => cli::tune::command(&source, config.as_deref(), &sweep, goal, report.as_deref())?,
        Command::CheckConfig { file } => {
            cli::check_config::run(&file, &mut std::io::stdout().lock())?
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn help_texts_read_as_text() {
        // Doc comments clap shows: no rustdoc links or crate paths.
        let mut root = Cli::command();
        let mut pages = vec![root.render_long_help().to_string()];
        for sub in root.get_subcommands_mut() {
            pages.push(sub.render_long_help().to_string());
        }
        assert!(pages.len() > 8, "{}", pages.len());
        for page in pages {
            for code in ["crate::", "[`", "`]", "module docs"] {
                assert!(!page.contains(code), "{code:?} in:\n{page}");
            }
        }
    }
}
