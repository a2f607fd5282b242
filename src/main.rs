//! The `settle` command line (clap). Each subcommand is a thin shell over a library module.

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use settle::config::{Config, Transport};
use settle::engine::Engine;
use std::io::{BufReader, BufWriter, Write};
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
    Loadgen(settle::loadgen::LoadgenArgs),
    /// Print the records of Kafka topics as JSON lines (ready records, tier changes, dead
    /// letters); no consumer group is joined.
    Consume(settle::consume::ConsumeArgs),
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
        /// Show one session's state (CallTrack, open round, next due): tenant/session.
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
        source: settle::trace_source::SourceArgs,
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
        source: settle::trace_source::SourceArgs,
        /// Config file (TOML) with the broker for --from-kafka/--from-nats (`[kafka]`,
        /// `[nats]`); `SETTLE_*` variables override it. Policies come from --sweep.
        #[arg(long, short = 'c', env = "SETTLE_CONFIG")]
        config: Option<PathBuf>,
        /// Settings to replay: POLICY:VALUES groups separated by ';', e.g.
        /// "fixed:5s,1m;leading-trailing:10s;adaptive:5s/10m;learn:off,on;max-wait:none,30m"
        /// (learn: adaptive with learned initial delays).
        #[arg(long, value_name = "SPEC", default_value = settle::tune::DEFAULT_SWEEP)]
        sweep: settle::tune::Sweep,
        /// Goal of the recommendation: pNN<=DURATION with NN = 50, 90 or 99.
        #[arg(long, default_value = settle::tune::DEFAULT_GOAL)]
        goal: settle::tune::Goal,
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
        Command::Demo { .. } | Command::Loadgen(_) | Command::Consume(_) => "warn",
        _ => "info",
    };
    init_logging(cli.log_format, default_level);
    match run(cli.command) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(command: Command) -> anyhow::Result<ExitCode> {
    match command {
        Command::Run { config, transport } => {
            let mut cfg = Config::load(config.as_deref())?;
            if let Some(t) = transport {
                cfg.transport = t;
                cfg.validate()?;
            }
            let shown = config
                .as_deref()
                .map_or("(defaults)".into(), |p| p.display().to_string());
            match cfg.transport {
                Transport::Kafka => {
                    tracing::info!(
                        config = %shown,
                        bootstrap = %cfg.kafka.bootstrap_servers,
                        group = %cfg.kafka.group_id,
                        input = %cfg.kafka.input_topic,
                        changelog = cfg.kafka.changelog().as_deref().unwrap_or("(off)"),
                        guarantee = ?cfg.kafka.processing_guarantee,
                        instance = %cfg.kafka.instance_id(),
                        data_dir = %cfg.store.data_dir.display(),
                        "settle run starting on kafka"
                    );
                    settle::transport::kafka::run(&cfg, &cfg.kafka, &cfg.tiers)?;
                }
                Transport::Nats => {
                    tracing::info!(
                        config = %shown,
                        servers = %cfg.nats.servers,
                        stream = %cfg.nats.input_stream,
                        instance = cfg.nats.instance,
                        instances = cfg.nats.instances,
                        partitions = ?cfg.nats.owned_partitions(),
                        data_dir = %cfg.store.data_dir.display(),
                        "settle run starting on nats"
                    );
                    settle::transport::nats::run(&cfg, &cfg.nats, &cfg.tiers)?;
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Consume(args) => {
            let report = settle::consume::run(&args, &mut std::io::stdout().lock(), &|| false)?;
            eprintln!("{} record(s)", report.records);
            Ok(ExitCode::SUCCESS)
        }
        Command::Loadgen(args) => {
            let report = settle::loadgen::run(&args)?;
            println!("{report}");
            Ok(if report.failed > 0 {
                ExitCode::FAILURE
            } else {
                ExitCode::SUCCESS
            })
        }
        Command::Demo {
            data_dir,
            partitions,
            seed,
            no_progress,
        } => {
            let report = settle::demo::run(settle::demo::DemoArgs {
                data_dir,
                partitions,
                seed,
                progress: !no_progress,
            })?;
            println!("{report}");
            Ok(ExitCode::SUCCESS)
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
            settle::inspect::run(
                settle::inspect::InspectArgs {
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
            Ok(ExitCode::SUCCESS)
        }
        Command::RunFile {
            input,
            data_dir,
            output,
            config,
            partitions,
        } => {
            settle::runtime::run_file::run(settle::runtime::run_file::RunFileArgs {
                input,
                data_dir,
                output,
                config,
                partitions,
            })?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Simulate {
            config,
            source,
            output,
        } => simulate(config, source, output),
        Command::Tune {
            source,
            config,
            sweep,
            goal,
            report,
        } => {
            // Check the report path before minutes of reading and replay, not after.
            if let Some(path) = &report {
                settle::tune::check_report_path(path)?;
            }
            let cfg = Config::load(config.as_deref())?;
            let loaded = settle::trace_source::load(&source, &cfg)?;
            settle::tune::run_trace(
                &loaded.source,
                &loaded.trace,
                &sweep,
                goal,
                report.as_deref(),
                &mut std::io::stdout().lock(),
            )?;
            Ok(ExitCode::SUCCESS)
        }
        Command::CheckConfig { file } => {
            let cfg = Config::load(Some(&file))?;
            println!("{}: ok", file.display());
            let table = cfg.policy_table();
            println!(
                "debounce: policy {} ({} tenant override(s))",
                table.default.name.as_str(),
                table.tenants.len()
            );
            println!("transport: {} (settle run)", cfg.transport.as_str());
            if cfg.admin.enabled {
                println!(
                    "admin: http://{} (/metrics /healthz /readyz /v1/...)",
                    cfg.admin.listen
                );
            } else {
                println!("admin: disabled");
            }
            let k = &cfg.kafka;
            println!(
                "kafka: {} group {} input {} dead-letter {} changelog {} guarantee {} instance {}",
                k.bootstrap_servers,
                k.group_id,
                k.input_topic,
                k.dead_letter_topic,
                k.changelog().as_deref().unwrap_or("(off)"),
                match k.processing_guarantee {
                    settle::transport::kafka::ProcessingGuarantee::AtLeastOnce => "at-least-once",
                    settle::transport::kafka::ProcessingGuarantee::ExactlyOnce => "exactly-once",
                },
                k.instance_id(),
            );
            let n = &cfg.nats;
            println!(
                "nats: {} input {} (subjects {}.0 to .{}) output {} dead-letter {}; instance {} of {} owns partitions {:?}",
                n.servers,
                n.input_stream,
                n.input_subject_prefix,
                n.partitions.saturating_sub(1),
                n.output_stream,
                n.dead_letter_subject,
                n.instance,
                n.instances,
                n.owned_partitions()
            );
            let tiers: Vec<String> = cfg
                .tiers
                .tiers
                .iter()
                .map(|t| format!("{} -> {}", t.name, t.topic))
                .collect();
            println!(
                "tiers: {} (limit {} per {})",
                tiers.join(", "),
                cfg.tiers.limit,
                humantime::format_duration(cfg.tiers.period)
            );
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn simulate(
    config: Option<PathBuf>,
    source: settle::trace_source::SourceArgs,
    output: Option<PathBuf>,
) -> anyhow::Result<ExitCode> {
    let cfg = Config::load(config.as_deref())?;
    let engine = Engine::new(cfg.policy_table());
    let mut out: Box<dyn Write> = match &output {
        Some(p) => Box::new(BufWriter::new(
            std::fs::File::create(p).with_context(|| format!("cannot create {}", p.display()))?,
        )),
        None => Box::new(BufWriter::new(std::io::stdout().lock())),
    };
    let stats = match &source.choice.input {
        // A file streams through the engine line by line.
        Some(input)
            if source.since.is_none() && source.until.is_none() && source.topic.is_none() =>
        {
            let reader = BufReader::new(
                std::fs::File::open(input)
                    .with_context(|| format!("cannot open {}", input.display()))?,
            );
            settle::simulate::replay_to_jsonl(engine, reader, &mut out, |e| {
                eprintln!("{}: skipped {e}", input.display());
            })?
        }
        _ => {
            let loaded = settle::trace_source::load(&source, &cfg)?;
            let mut written = Ok(());
            let stats = settle::tune::replay_trace(engine, &loaded.trace, |e| {
                if written.is_ok() {
                    written = out
                        .write_all(&settle::codec::encode_ready(
                            e,
                            e.due_at,
                            settle::simulate::SIMULATED_TIER,
                        ))
                        .and_then(|()| out.write_all(b"\n"));
                }
            });
            written.context("cannot write the ready records")?;
            stats
        }
    };
    out.flush()?;
    eprintln!("{stats}");
    Ok(ExitCode::SUCCESS)
}
