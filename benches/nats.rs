//! settle's throughput on NATS JetStream, as real processes: `settle loadgen --nats` fills a
//! fresh input stream with a backlog of the demo's mixed scenarios, then `settle run`
//! (transport `nats`, RocksDB stores in a temporary directory) works it off.
//!
//! Measured: the load generator's publish rate (its own report), the **drain** rate (uploads
//! of the backlog / time from spawning `settle run` until every partition's durable consumer
//! has nothing pending and nothing unacked, i.e. every upload is durable in a store and
//! acked), and the emissions published by then and once every round is out.
//!
//! * `cargo bench --bench nats`: `NATS_BENCH_UPLOADS` uploads (default 200 000).
//! * `cargo test --bench nats`: a smoke run of 5 000 uploads.
//!
//! Environment: `NATS_BENCH_SERVER` (host:port; default `SETTLE_TEST_NATS`, else
//! 127.0.0.1:4222), `NATS_BENCH_UPLOADS`, `NATS_BENCH_PARTITIONS` (default 4),
//! `NATS_BENCH_RATE` (loadgen `--rate`, default 50 000 uploads/s). Policy: `fixed` 2 s,
//! `catch-up-rate` 1 000 000 (the replayed backlog's rounds are not paced), file storage.
//! The streams are deleted at the end. Without a server it says so and exits 0.

use anyhow::{ensure, Context as _, Result};
use settle::transport::nats::{self, NatsConfig};
use std::net::ToSocketAddrs;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

fn env<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Sum of `num_pending + num_ack_pending` over the partitions' consumers (0 when drained;
/// a consumer not created yet counts as not drained).
async fn undrained(js: &async_nats::jetstream::Context, n: &NatsConfig) -> Result<u64> {
    let stream = js.get_stream(&n.input_stream).await?;
    let mut left = 0;
    for p in 0..n.partitions as i32 {
        match stream.consumer_info(n.consumer_name(p)).await {
            Ok(i) => left += i.num_pending + i.num_ack_pending as u64,
            Err(_) => left += 1,
        }
    }
    Ok(left)
}

async fn messages(js: &async_nats::jetstream::Context, stream: &str) -> Result<u64> {
    Ok(js.get_stream(stream).await?.info().await?.state.messages)
}

fn main() -> Result<()> {
    let full = std::env::args().any(|a| a == "--bench");
    let default_server =
        std::env::var("SETTLE_TEST_NATS").unwrap_or_else(|_| "127.0.0.1:4222".to_owned());
    let server: String = env("NATS_BENCH_SERVER", default_server);
    let uploads: u64 = if full {
        env("NATS_BENCH_UPLOADS", 200_000)
    } else {
        5_000
    };
    let partitions: u32 = env("NATS_BENCH_PARTITIONS", 4);
    // At least a 1 s window: the rate never exceeds the uploads asked for.
    let rate: f64 = env("NATS_BENCH_RATE", 50_000.0_f64).min(uploads as f64);
    let answers = server.to_socket_addrs().ok().is_some_and(|mut a| {
        a.any(|a| std::net::TcpStream::connect_timeout(&a, Duration::from_secs(2)).is_ok())
    });
    if !answers {
        println!("no NATS server on {server}: the NATS bench did NOT run (scripts/nats.sh start)");
        return Ok(());
    }
    let id = SystemTime::now().duration_since(UNIX_EPOCH)?.as_millis() % 1_000_000_000;
    let n = NatsConfig {
        servers: format!("nats://{server}"),
        input_stream: format!("BENCH_{id}_IN"),
        output_stream: format!("BENCH_{id}_OUT"),
        input_subject_prefix: format!("bench{id}.uploads"),
        dead_letter_subject: format!("bench{id}.dlq"),
        consumer_prefix: format!("bench{id}"),
        partitions,
        ..NatsConfig::default()
    };
    let dir = tempfile::tempdir()?;
    let config = dir.path().join("settle.toml");
    std::fs::write(
        &config,
        format!(
            r#"transport = "nats"
[debounce]
policy = "fixed"
delay = "2s"
[store]
data-dir = "{data}"
[runtime]
catch-up-rate = 1000000
[nats]
servers = "{servers}"
input-stream = "{input}"
input-subject-prefix = "{prefix}"
partitions = {partitions}
consumer-prefix = "{consumers}"
dead-letter-subject = "{dlq}"
output-stream = "{output}"
changelog-stream = "BENCH_{id}_CL"
changelog-subject-prefix = "bench{id}.changelog"
[tiers]
events-topic = "bench{id}.tier-events"
[[tiers.tier]]
name = "normal"
topic = "bench{id}.ready.normal"
[[tiers.tier]]
name = "limited"
topic = "bench{id}.ready.limited"
"#,
            data = dir.path().join("data").display(),
            servers = n.servers,
            input = n.input_stream,
            prefix = n.input_subject_prefix,
            consumers = n.consumer_prefix,
            dlq = n.dead_letter_subject,
            output = n.output_stream,
        ),
    )?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let js = rt.block_on(async {
        let client = nats::connect(&n).await?;
        anyhow::Ok(nats::jetstream(client, 64))
    })?;
    let bin = env!("CARGO_BIN_EXE_settle");

    // 1. The backlog.
    let seconds = uploads as f64 / rate;
    let gen = Command::new(bin)
        .args([
            "loadgen",
            "--nats",
            &n.servers,
            "--topic",
            &n.input_subject_prefix,
        ])
        .args(["--nats-stream", &n.input_stream])
        .args(["--nats-partitions", &partitions.to_string()])
        .args(["--scenario", "mix", "--tenants", "100", "--no-progress"])
        .args(["--rate", &rate.to_string(), "--duration"])
        .arg(format!("{seconds:.3}s"))
        .stderr(Stdio::inherit())
        .output()
        .context("settle loadgen")?;
    ensure!(gen.status.success(), "loadgen failed: {}", gen.status);
    let report = String::from_utf8_lossy(&gen.stdout);
    let backlog = rt.block_on(messages(&js, &n.input_stream))?;
    println!(
        "loadgen --nats: {}",
        report.lines().next().unwrap_or_default()
    );

    // 2. settle run works it off.
    let t0 = Instant::now();
    let mut run = Command::new(bin)
        .args(["run", "--config"])
        .arg(&config)
        .env("SETTLE_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .context("settle run")?;
    let limit = Duration::from_secs(600);
    let drained = loop {
        if rt.block_on(undrained(&js, &n)).unwrap_or(1) == 0 {
            break t0.elapsed();
        }
        ensure!(run.try_wait()?.is_none(), "settle run exited");
        ensure!(t0.elapsed() < limit, "not drained within {limit:?}");
        std::thread::sleep(Duration::from_millis(20));
    };
    let at_drain = rt.block_on(messages(&js, &n.output_stream))?;
    // Every round is out once the output has not grown for 3 s (delay 2 s).
    let (mut last, mut since) = (at_drain, Instant::now());
    while since.elapsed() < Duration::from_secs(3) {
        std::thread::sleep(Duration::from_millis(100));
        let now = rt.block_on(messages(&js, &n.output_stream))?;
        if now != last {
            (last, since) = (now, Instant::now());
        }
    }
    let all_out = since.duration_since(t0);
    let _ = Command::new("kill")
        .args(["-TERM", &run.id().to_string()])
        .status();
    let _ = run.wait();
    rt.block_on(async {
        for s in [&n.input_stream, &n.output_stream] {
            let _ = js.delete_stream(s).await;
        }
        for p in 0..partitions as i32 {
            let _ = js.delete_stream(format!("BENCH_{id}_CL-{p}")).await;
        }
    });
    println!(
        "settle run on NATS ({partitions} partitions, fixed 2 s): {backlog} uploads drained \
         (durable + acked) in {:.2} s = {:.0} uploads/s; {at_drain} emissions out by then, \
         {last} when all rounds were out ({:.2} s, ratio {:.1})",
        drained.as_secs_f64(),
        backlog as f64 / drained.as_secs_f64(),
        all_out.as_secs_f64(),
        backlog as f64 / last.max(1) as f64
    );
    Ok(())
}
