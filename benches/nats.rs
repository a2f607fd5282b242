//! settle's throughput on NATS JetStream, as real processes, against a bare JetStream pull
//! consumer reading the same stream in the same run: `settle loadgen --nats` fills a fresh
//! input stream with a backlog of the demo's mixed scenarios, the bare reader reads it all,
//! then `settle run` (transport `nats`, RocksDB stores in a temporary directory) works it off.
//!
//! Measured: the load generator's publish rate (its own report), the **drain** rate (uploads
//! of the backlog / time from spawning `settle run` until every partition's durable consumer
//! has nothing pending and nothing unacked, i.e. every upload is durable in a store and
//! acked; settle's own metrics are watched until it has applied the backlog, then the
//! consumers are asked every 20 ms: see [`drain`] for why not before), settle's CPU by then
//! (`/proc`, startup included) and, with a local server, nats-server's CPU during the bare
//! read and during settle's drain, and the emissions published by then and once every round is
//! out. Then one line compares settle with the bare reader: the bare rate, settle's drain
//! rate from its first record (the first look that finds uploads applied) to the drain,
//! which leaves out startup (stores opened, changelog streams, consumers bound), the rate
//! counting startup, and settle as % of bare (issue 37's goal: ≥ 90 %; never asserted).
//!
//! **The bare reader** is what settle's input does with nothing behind it, on the same
//! terms: one connection (settle shares one among its partitions), a multi-threaded tokio
//! runtime with the default worker count (as `settle run`), and per partition one
//! **ephemeral pull consumer** filtered on that partition's subject, configured like
//! settle's durable ones (**ack policy "all"**, `nats.ack-wait`, `nats.max-ack-pending`,
//! deliver all, the stream's file storage), read by its own task with no-wait fetches of
//! `runtime.batch-size` messages (settle's default, 1000). Each message's metadata is parsed
//! (stream sequence, as settle does for its offsets), its payload and headers copied out
//! (no decode), and the last message of each fetch is **acked** (an empty publish on its
//! reply subject, acknowledging the fetch, as settle's ack task sends one ack per durable
//! commit). Its time runs from the first fetch to the last message, plus a flush of the
//! connection so every ack has left. `NATS_BENCH_BARE_ACKS=explicit` acks every message
//! (explicit ack policy: what settle did before 2026-12-07, and a common consumer);
//! `NATS_BENCH_BARE_ACKS=none` reads with `AckPolicy::None` and sends no acks (a reader that
//! cannot resume: an
//! upper bound). The bare consumers are deleted before settle starts; both read a stream
//! written just before, so the server's caches are alike for both.
//!
//! * `cargo bench --bench nats`: `NATS_BENCH_UPLOADS` uploads (default 200 000).
//! * `cargo test --bench nats`: a smoke run of 5 000 uploads; it fails only if the bare
//!   reader does not read every message once, in order per partition, or settle does not drain.
//!
//! Environment: `NATS_BENCH_SERVER` (host:port; default `SETTLE_TEST_NATS`, else
//! 127.0.0.1:4222), `NATS_BENCH_UPLOADS`, `NATS_BENCH_PARTITIONS` (default 4),
//! `NATS_BENCH_RATE` (loadgen `--rate`, default 50 000 uploads/s), `NATS_BENCH_BARE_ACKS`
//! (`all`, default, `explicit` or `none`), `NATS_BENCH_SETTLE_LOG` (`SETTLE_LOG` of `settle run`,
//! default `warn`; its log goes to stderr), `NATS_BENCH_VERBOSE` (set: print each look at
//! the consumers, time since spawn, uploads left and delivered). Policy: `fixed` 2 s, `catch-up-rate` 1 000 000 (the
//! replayed backlog's rounds are not paced), file storage. The streams are deleted at the
//! end. Without a server it says so and exits 0.

use anyhow::{anyhow, ensure, Context as _, Result};
use async_nats::jetstream::consumer::{pull, AckPolicy, PullConsumer};
use futures::StreamExt;
use settle::config::RuntimeConfig;
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

/// Over the partitions' durable consumers: how much is not yet durable and acked (the sum of
/// `num_pending + num_ack_pending`, 0 when drained; a consumer not created yet counts 1),
/// and how many messages they have delivered.
async fn progress(js: &async_nats::jetstream::Context, n: &NatsConfig) -> Result<(u64, u64)> {
    let stream = js.get_stream(&n.input_stream).await?;
    let (mut left, mut delivered) = (0, 0);
    for p in 0..n.partitions as i32 {
        match stream.consumer_info(n.consumer_name(p)).await {
            Ok(i) => {
                left += i.num_pending + i.num_ack_pending as u64;
                delivered += i.delivered.consumer_sequence;
            }
            Err(_) => left += 1,
        }
    }
    Ok((left, delivered))
}

/// What the bare reader copies out of one message, as a consumer would (no decode).
struct Copied {
    sequence: u64,
    headers: Vec<(String, Vec<u8>)>,
    payload: Vec<u8>,
}

/// What the bare reader read: messages, bytes of payload and headers copied, and the time
/// from its first fetch to its last message (acks flushed).
struct BareRead {
    messages: u64,
    bytes: u64,
    took: Duration,
}

/// Reads `expected` messages of one partition's bare consumer with no-wait fetches of
/// `batch`, copying each out and acking as `acks` says: `All`, the last message of each
/// fetch (as settle acks the last message of each commit); `Explicit`, every message;
/// `None`, none. Fails unless the stream sequences rise (every message once, in order).
async fn read_partition(
    consumer: PullConsumer,
    expected: u64,
    batch: usize,
    acks: AckPolicy,
) -> Result<Vec<Copied>> {
    let mut out: Vec<Copied> = Vec::with_capacity(expected as usize);
    let deadline = Instant::now() + Duration::from_secs(600);
    while (out.len() as u64) < expected {
        ensure!(
            Instant::now() < deadline,
            "bare reader: not done within 600 s"
        );
        let before = out.len();
        let mut messages = consumer
            .fetch()
            .max_messages(batch)
            .messages()
            .await
            .map_err(|e| anyhow!("bare fetch: {e}"))?;
        let mut last = None;
        while let Some(m) = messages.next().await {
            let m = m.map_err(|e| anyhow!("bare fetch: {e}"))?;
            let sequence = m.info().map_err(|e| anyhow!("{e}"))?.stream_sequence;
            ensure!(
                out.last().is_none_or(|l| l.sequence < sequence),
                "bare reader: sequence {sequence} out of order"
            );
            let headers = m
                .headers
                .iter()
                .flat_map(|h| h.iter())
                .flat_map(|(k, vs)| {
                    vs.iter()
                        .map(move |v| (k.to_string(), v.as_str().as_bytes().to_vec()))
                })
                .collect();
            out.push(Copied {
                sequence,
                headers,
                payload: m.payload.to_vec(),
            });
            match acks {
                AckPolicy::Explicit => m.ack().await.map_err(|e| anyhow!("bare ack: {e}"))?,
                AckPolicy::All => last = Some(m),
                _ => {}
            }
        }
        if let Some(m) = last {
            m.ack().await.map_err(|e| anyhow!("bare ack: {e}"))?;
        }
        if out.len() == before {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    Ok(out)
}

/// The bare JetStream reader (module docs): one ephemeral pull consumer per partition, all
/// read at once, on a runtime and connection of its own; the consumers are deleted after.
fn bare_read(n: &NatsConfig, acks: AckPolicy) -> Result<BareRead> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let batch = RuntimeConfig::default().batch_size as usize;
    rt.block_on(async {
        let client = nats::connect(n).await?;
        let js = nats::jetstream(client.clone(), 64);
        let stream = js.get_stream(&n.input_stream).await?;
        let mut consumers = Vec::new();
        for p in 0..n.partitions as i32 {
            let consumer: PullConsumer = stream
                .create_consumer(pull::Config {
                    filter_subject: n.input_subject(p),
                    ack_policy: acks,
                    ack_wait: n.ack_wait,
                    max_ack_pending: i64::from(n.max_ack_pending),
                    inactive_threshold: Duration::from_secs(60),
                    ..pull::Config::default()
                })
                .await
                .map_err(|e| anyhow!("bare consumer of partition {p}: {e}"))?;
            consumers.push(consumer);
        }
        let t = Instant::now();
        let tasks: Vec<_> = consumers
            .iter()
            .map(|c| {
                let expected = c.cached_info().num_pending;
                tokio::spawn(read_partition(c.clone(), expected, batch, acks))
            })
            .collect();
        let mut read = Vec::new();
        for task in tasks {
            read.push(task.await??);
        }
        client.flush().await?;
        let took = t.elapsed();
        for c in &consumers {
            let _ = stream.delete_consumer(&c.cached_info().name).await;
        }
        let copied = read.iter().flatten();
        Ok(BareRead {
            messages: read.iter().map(|r| r.len() as u64).sum(),
            bytes: copied
                .map(|c| {
                    c.payload.len()
                        + c.headers
                            .iter()
                            .map(|(k, v)| k.len() + v.len())
                            .sum::<usize>()
                })
                .sum::<usize>() as u64,
            took,
        })
    })
}

async fn messages(js: &async_nats::jetstream::Context, stream: &str) -> Result<u64> {
    Ok(js.get_stream(stream).await?.info().await?.state.messages)
}

/// What `settle run` did with the backlog, timed from `t0` (its spawn).
struct Drain {
    /// When a look first found uploads applied by settle, and how many.
    first: Option<(Duration, u64)>,
    /// When every partition's consumer had nothing pending and nothing unacked.
    drained: Duration,
    /// CPU (user + system) settle had used by `drained`, startup included ([`cpu_of`]).
    cpu: Option<Duration>,
    /// CPU the nats-server (`server`, its pid) had used by `drained`, since it started.
    server_cpu: Option<Duration>,
    /// Emissions in the output stream at `drained`, and once every round was out.
    at_drain: u64,
    last: u64,
    /// When every round was out: the output had not grown for 3 s (delay 2 s).
    all_out: Duration,
}

/// CPU time (user + system, all threads) process `pid` has used so far, from
/// `/proc/<pid>/stat` (fields 14 and 15, in clock ticks of 10 ms: Linux's `USER_HZ`);
/// `None` off Linux or once the process is gone.
fn cpu_of(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces) start at field 3, the state.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split(' ').collect();
    let ticks = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some(Duration::from_millis(ticks * 10))
}

/// The pid of the nats-server the bench talks to, when `server` is on this machine
/// (127.0.0.1 or localhost) and exactly one live process named `nats-server` runs here;
/// `None` otherwise (its CPU is then not reported).
fn local_server_pid(server: &str) -> Option<u32> {
    if !(server.starts_with("127.0.0.1") || server.starts_with("localhost")) {
        return None;
    }
    let mut found = std::fs::read_dir("/proc").ok()?.filter_map(|e| {
        let e = e.ok()?;
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let comm = std::fs::read_to_string(e.path().join("comm")).ok()?;
        // A zombie (exited, not yet reaped) is not a server.
        let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
        let running = stat
            .rfind(") ")
            .is_some_and(|i| !stat[i + 2..].starts_with('Z'));
        (comm.trim_end() == "nats-server" && running).then_some(pid)
    });
    let pid = found.next()?;
    found.next().is_none().then_some(pid)
}

/// `settle_uploads_consumed_total` of the `settle run` whose admin port is `admin` (summed
/// over partitions), read from its `/metrics` with a plain HTTP/1.0 GET; `None` while the
/// port does not answer (startup).
fn consumed(admin: u16) -> Option<u64> {
    use std::io::{Read, Write};
    let mut conn = std::net::TcpStream::connect(("127.0.0.1", admin)).ok()?;
    conn.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    conn.write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .ok()?;
    let mut text = String::new();
    conn.read_to_string(&mut text).ok()?;
    let mut total = 0.0;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(settle::metrics::UPLOADS_CONSUMED) else {
            continue;
        };
        if rest.starts_with('{') || rest.starts_with(' ') {
            total += rest
                .rsplit(' ')
                .next()
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or(0.0);
        }
    }
    Some(total as u64)
}

/// What [`drain`] reads besides the process: settle's admin port, the backlog it must apply,
/// and the local nats-server's pid ([`local_server_pid`]).
struct Watched {
    admin: u16,
    backlog: u64,
    server: Option<u32>,
}

/// Watches `settle run` (`run`, spawned at `t0`) work off `watched.backlog`.
///
/// Until settle has applied the whole backlog it is watched through its own metrics
/// ([`consumed`], every 20 ms), not through the server: on nats-server 2.9.10 a consumer-info
/// request recounts a filtered consumer's pending messages and can leave it recounting them
/// (a scan of its message block) for every message it delivers afterwards, until it is past
/// the middle of that block (fixed in 2.9.15: "Do not re-calculate NumPending on consumer
/// info calls"). Asked every 250 ms during the drain, those requests made settle's drains
/// 5-15x slower than its reading speed; the bare reader is never asked. Once everything is
/// applied (nothing left to deliver, so a recount costs nothing), the consumers are asked
/// every 20 ms until nothing is pending or unacked. Startup (stores opened, changelog
/// streams, consumers bound) is timed apart: the first look that finds uploads applied
/// starts the reading.
fn drain(
    rt: &tokio::runtime::Runtime,
    js: &async_nats::jetstream::Context,
    n: &NatsConfig,
    run: &mut std::process::Child,
    t0: Instant,
    watched: Watched,
) -> Result<Drain> {
    let Watched {
        admin,
        backlog,
        server,
    } = watched;
    let limit = Duration::from_secs(600);
    let verbose = std::env::var_os("NATS_BENCH_VERBOSE").is_some();
    let mut first = None;
    loop {
        let applied = consumed(admin).unwrap_or(0);
        if applied > 0 && first.is_none() {
            first = Some((t0.elapsed(), applied));
        }
        if verbose {
            eprintln!("[{:>7.3} s] applied {applied}", t0.elapsed().as_secs_f64());
        }
        if applied >= backlog {
            break;
        }
        ensure!(run.try_wait()?.is_none(), "settle run exited");
        ensure!(t0.elapsed() < limit, "not drained within {limit:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    let drained = loop {
        let (left, delivered) = rt.block_on(progress(js, n)).unwrap_or((1, 0));
        if verbose {
            eprintln!(
                "[{:>7.3} s] left {left}, delivered {delivered}",
                t0.elapsed().as_secs_f64()
            );
        }
        if left == 0 {
            break t0.elapsed();
        }
        ensure!(run.try_wait()?.is_none(), "settle run exited");
        ensure!(t0.elapsed() < limit, "not drained within {limit:?}");
        std::thread::sleep(Duration::from_millis(20));
    };
    let cpu = cpu_of(run.id());
    let server_cpu = server.and_then(cpu_of);
    let at_drain = rt.block_on(messages(js, &n.output_stream))?;
    let (mut last, mut since) = (at_drain, Instant::now());
    while since.elapsed() < Duration::from_secs(3) {
        std::thread::sleep(Duration::from_millis(100));
        let now = rt.block_on(messages(js, &n.output_stream))?;
        if now != last {
            (last, since) = (now, Instant::now());
        }
    }
    Ok(Drain {
        first,
        drained,
        cpu,
        server_cpu,
        at_drain,
        last,
        all_out: since.duration_since(t0),
    })
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
    let bare_acks = match std::env::var("NATS_BENCH_BARE_ACKS").as_deref() {
        Ok("none") => AckPolicy::None,
        Ok("all") | Err(_) => AckPolicy::All,
        Ok("explicit") => AckPolicy::Explicit,
        Ok(other) => anyhow::bail!("NATS_BENCH_BARE_ACKS={other}: expected all, explicit or none"),
    };
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
    // A port of its own: another settle on the machine holds the default 9464. settle's
    // metrics there tell the drain how far it is (`drain`).
    let admin_port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    std::fs::write(
        &config,
        format!(
            r#"transport = "nats"
[debounce]
policy = "fixed"
delay = "{delay}"
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
[admin]
listen = "127.0.0.1:{admin_port}"
[tiers]
events-topic = "bench{id}.tier-events"
[[tiers.tier]]
name = "normal"
topic = "bench{id}.ready.normal"
[[tiers.tier]]
name = "limited"
topic = "bench{id}.ready.limited"
"#,
            delay = std::env::var("NATS_BENCH_DELAY").unwrap_or_else(|_| "2s".to_owned()),
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

    // 2. A bare JetStream pull consumer per partition reads it all.
    let server_pid = local_server_pid(&server);
    let server_cpu = || server_pid.and_then(cpu_of);
    let bare_server0 = server_cpu();
    let bare = bare_read(&n, bare_acks)?;
    let bare_server = bare_server0
        .zip(server_cpu())
        .map(|(a, b)| b.saturating_sub(a));
    ensure!(
        bare.messages == backlog,
        "bare reader read {} of {backlog} messages",
        bare.messages
    );
    let bare_rate = bare.messages as f64 / bare.took.as_secs_f64();
    println!(
        "bare JetStream pull consumers ({partitions}, acks {}): {} messages ({:.1} MB copied) \
         in {:.2} s = {bare_rate:.0} uploads/s",
        match bare_acks {
            AckPolicy::None => "none",
            AckPolicy::All => "all, one per fetch",
            _ => "explicit, one per message",
        },
        bare.messages,
        bare.bytes as f64 / 1e6,
        bare.took.as_secs_f64()
    );
    if let Some(cpu) = bare_server {
        println!(
            "nats-server CPU during the bare read (consumers created and deleted included): {:.2} s",
            cpu.as_secs_f64()
        );
    }

    // 3. settle run works it off.
    let settle_server0 = server_cpu();
    let t0 = Instant::now();
    let mut run = Command::new(bin)
        .args(["run", "--config"])
        .arg(&config)
        .env(
            "SETTLE_LOG",
            std::env::var("NATS_BENCH_SETTLE_LOG").unwrap_or_else(|_| "warn".to_owned()),
        )
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .context("settle run")?;
    let watched = Watched {
        admin: admin_port,
        backlog,
        server: server_pid,
    };
    let measured = drain(&rt, &js, &n, &mut run, t0, watched);
    // settle stopped and the streams deleted whether or not it drained.
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
    let Drain {
        first,
        drained,
        cpu,
        server_cpu: settle_server,
        at_drain,
        last,
        all_out,
    } = measured?;
    println!(
        "settle run on NATS ({partitions} partitions, fixed 2 s): {backlog} uploads drained \
         (durable + acked) in {:.2} s = {:.0} uploads/s; {at_drain} emissions out by then, \
         {last} when all rounds were out ({:.2} s, ratio {:.1})",
        drained.as_secs_f64(),
        backlog as f64 / drained.as_secs_f64(),
        all_out.as_secs_f64(),
        backlog as f64 / last.max(1) as f64
    );
    if let Some(cpu) = cpu {
        println!(
            "settle CPU (user + system) until drained, startup included: {:.2} s = {:.2} us per upload",
            cpu.as_secs_f64(),
            cpu.as_secs_f64() * 1e6 / backlog as f64
        );
    }
    if let Some(cpu) = settle_server0
        .zip(settle_server)
        .map(|(a, b)| b.saturating_sub(a))
    {
        println!(
            "nats-server CPU from settle's spawn until drained: {:.2} s",
            cpu.as_secs_f64()
        );
    }
    let with_startup = backlog as f64 / drained.as_secs_f64();
    let (startup, settle_rate) = match first {
        Some((at, delivered)) if delivered < backlog && at < drained => (
            at,
            (backlog - delivered) as f64 / (drained - at).as_secs_f64(),
        ),
        // Seen only once drained (a tiny backlog): no reading time apart from startup.
        _ => (Duration::ZERO, with_startup),
    };
    println!(
        "NATS throughput on {backlog} uploads, {partitions} partitions: bare JetStream pull \
         consumer {bare_rate:.0} uploads/s; settle {settle_rate:.0} uploads/s ({:.0} % of bare) \
         from its first record to drained (durable + acked); {with_startup:.0} uploads/s \
         counting its {:.2} s of startup",
        100.0 * settle_rate / bare_rate,
        startup.as_secs_f64()
    );
    Ok(())
}
