//! `settle simulate`: replay a trace through the engine in event time (no broker, no disk).
//!
//! Trace format (JSONL): each line is an upload record (SEMANTICS §2) plus `"ts"` — the
//! upload's event time, an epoch-ms integer or an RFC 3339 string — and an optional
//! `"partition"` (u32, informational: with every partition caught up, emissions do not
//! depend on it). Blank lines and lines starting with `#` are skipped. A trace has no record
//! keys: each line's session key is its own `tenant/session` (`codec::decode_trace_line`), as
//! if the producer had keyed it correctly.
//!
//! Before a line is applied, every round due at or before its `ts` fires; at end of input all
//! pending rounds fire. Output: one ready record per emission (`emitted_at = due_at`,
//! tier `normal`), in emission order, ties ordered by session key. A bad line (also one that
//! is not UTF-8) is reported with its line number and skipped; the run goes on.

pub use super::trace::{parse_trace_line, TraceError, TraceLine};
use crate::codec;
use crate::engine::{Applied, Driver, Emission, Engine, MemTable, Millis};

use super::report::RunStats;
use super::trace::Trace;
use super::trace_source::{self, SourceArgs};
use crate::config::Config;
use anyhow::Context as _;
use std::io::{BufRead, Write};
use std::io::{BufReader, BufWriter};
use std::path::Path;

/// Tier written on simulated ready records (tiers do not exist offline).
pub const SIMULATED_TIER: &str = "normal";

/// Replays `input` through `engine`. Every emission is handed to `emit` in order;
/// bad lines to `reject`. Returns the run's figures (`emitted_at = due_at`).
pub fn replay<R: BufRead>(
    engine: Engine,
    input: R,
    mut emit: impl FnMut(&Emission) -> std::io::Result<()>,
    reject: impl FnMut(&TraceError),
) -> std::io::Result<RunStats> {
    let mut emitted = RunStats::new();
    let (inputs, _state) = replay_parsed(
        engine,
        TraceLines::new(input),
        |e| {
            emitted.record_emission(&e, e.due_at);
            emit(&e)
        },
        reject,
    )?;
    Ok(emitted.with_inputs_of(&inputs))
}

/// One trace line as the reader hands it over: `Ok(None)` for a blank or comment line.
type Parsed = Result<Option<TraceLine>, TraceError>;

/// The lines of a JSONL trace, parsed one by one (one line buffer for the whole input, no
/// allocation per line); a line that is not UTF-8 is a bad line like any other, not the end of
/// the run. Yields I/O errors.
struct TraceLines<R> {
    input: R,
    text: Vec<u8>,
    number: usize,
}

impl<R: BufRead> TraceLines<R> {
    fn new(input: R) -> Self {
        TraceLines {
            input,
            text: Vec::new(),
            number: 0,
        }
    }
}

impl<R: BufRead> Iterator for TraceLines<R> {
    type Item = std::io::Result<Parsed>;

    fn next(&mut self) -> Option<Self::Item> {
        self.text.clear();
        match self.input.read_until(b'\n', &mut self.text) {
            Ok(0) => return None,
            Ok(_) => {}
            Err(e) => return Some(Err(e)),
        }
        self.number += 1;
        Some(Ok(match std::str::from_utf8(&self.text) {
            Ok(text) => parse_trace_line(text, self.number),
            Err(_) => Err(TraceError::Upload {
                line: self.number,
                source: codec::DecodeError::InvalidUtf8,
            }),
        }))
    }
}

/// The engine's state at the end of a replay (every pending round fired): what is left to
/// free.
type EndState = (Driver, MemTable);

/// [`replay`] over lines already parsed (by this thread or another), handing each emission
/// over by value (`emit` counts it: the figures returned are the inputs' only). Returns them
/// and the end state, which the caller frees (or, when the process exits next, need not).
fn replay_parsed(
    engine: Engine,
    lines: impl Iterator<Item = std::io::Result<Parsed>>,
    mut emit: impl FnMut(Emission) -> std::io::Result<()>,
    mut reject: impl FnMut(&TraceError),
) -> std::io::Result<(RunStats, EndState)> {
    let mut driver = Driver::new(engine);
    let mut table = MemTable::new();
    let mut stats = RunStats::new();
    let mut out = Vec::new();
    let mut now = Millis::MIN;
    let mut flush =
        |out: &mut Vec<Emission>| -> std::io::Result<()> { out.drain(..).try_for_each(&mut emit) };
    for parsed in lines {
        let line = match parsed? {
            Ok(Some(line)) => line,
            Ok(None) => continue,
            Err(e) => {
                stats.rejected += 1;
                reject(&e);
                continue;
            }
        };
        // Simulated partition time: the largest `ts` seen (never backwards), so a line with
        // an earlier `ts` is a late upload, exactly as on a live partition.
        now = now.max(line.upload.event_time);
        stats.uploads += 1;
        let Ok(applied) = driver.apply(&mut table, now, &line.upload, &mut out);
        match applied {
            Applied::Late => stats.late += 1,
            Applied::Redelivered => stats.redelivered += 1,
            Applied::OnTime => {}
        }
        flush(&mut out)?;
    }
    fire_pending(&mut driver, &mut table, &mut out);
    flush(&mut out)?;
    Ok((stats, (driver, table)))
}

/// Lines or emissions handed between the threads of [`replay_file`] at a time.
const HANDOFF_BATCH: usize = 4096;

/// Batches in flight between two threads of [`replay_file`] (bounds its memory: about
/// 2 × 4 × 4096 lines or records).
const HANDOFF_DEPTH: usize = 4;

/// [`replay_to_jsonl`] of a file on three threads: one reads and parses the lines, this one
/// runs the engine, one encodes and writes the ready records, handing batches of
/// [`HANDOFF_BATCH`] over bounded queues. Same records in the same order as
/// [`replay_to_jsonl`]; the engine's end state is not freed (the process exits next).
///
/// Errors: reading the input or writing the output failed (the first error of either).
fn replay_file<R, W>(
    engine: Engine,
    input: R,
    output: W,
    reject: impl FnMut(&TraceError),
) -> std::io::Result<RunStats>
where
    R: BufRead + Send,
    W: Write + Send,
{
    use std::sync::mpsc::sync_channel;
    std::thread::scope(|scope| {
        let (lines_tx, lines_rx) = sync_channel::<Vec<std::io::Result<Parsed>>>(HANDOFF_DEPTH);
        scope.spawn(move || {
            let mut batch = Vec::with_capacity(HANDOFF_BATCH);
            for parsed in TraceLines::new(input) {
                let parsed = parsed.map_err(|e| context(e, "cannot read the trace"));
                let failed = parsed.is_err();
                batch.push(parsed);
                if batch.len() == HANDOFF_BATCH || failed {
                    let full = std::mem::replace(&mut batch, Vec::with_capacity(HANDOFF_BATCH));
                    if lines_tx.send(full).is_err() || failed {
                        return;
                    }
                }
            }
            // The engine may have stopped (a failed write): nothing more to hand over.
            let _ = lines_tx.send(batch);
        });
        let (records_tx, records_rx) = sync_channel::<Vec<Emission>>(HANDOFF_DEPTH);
        let writer = scope.spawn(move || -> std::io::Result<RunStats> {
            let mut output = output;
            let mut record = Vec::with_capacity(512);
            let mut emitted = RunStats::new();
            for batch in records_rx {
                for e in &batch {
                    emitted.record_emission(e, e.due_at);
                    record.clear();
                    codec::encode_ready_into(e, e.due_at, SIMULATED_TIER, &mut record);
                    record.push(b'\n');
                    output
                        .write_all(&record)
                        .map_err(|e| context(e, "cannot write the ready records"))?;
                }
            }
            output
                .flush()
                .map_err(|e| context(e, "cannot write the ready records"))?;
            Ok(emitted)
        });
        let mut pending = Vec::with_capacity(HANDOFF_BATCH);
        let broken = || std::io::Error::other("the output writer stopped");
        let replayed = replay_parsed(
            engine,
            lines_rx.into_iter().flatten(),
            |e| {
                pending.push(e);
                if pending.len() == HANDOFF_BATCH {
                    let full = std::mem::replace(&mut pending, Vec::with_capacity(HANDOFF_BATCH));
                    records_tx.send(full).map_err(|_| broken())?;
                }
                Ok(())
            },
            reject,
        );
        // The last records, then the end of the queue; the writer's own error comes first.
        let sent = match &replayed {
            Ok(_) => records_tx.send(pending).map_err(|_| broken()),
            Err(_) => Ok(()),
        };
        drop(records_tx);
        let written = writer
            .join()
            .unwrap_or_else(|_| Err(std::io::Error::other("the output writer panicked")));
        let emitted = written?;
        sent?;
        let (inputs, end) = replayed?;
        // Freeing every state and timer one by one takes longer than the process has left.
        std::mem::forget(end);
        Ok(emitted.with_inputs_of(&inputs))
    })
}

/// Replays a trace and writes one ready record per line to `output`. See [`replay`].
pub fn replay_to_jsonl<R: BufRead, W: Write>(
    engine: Engine,
    input: R,
    output: &mut W,
    reject: impl FnMut(&TraceError),
) -> std::io::Result<RunStats> {
    let mut record = Vec::with_capacity(512);
    replay(
        engine,
        input,
        |e| {
            record.clear();
            codec::encode_ready_into(e, e.due_at, SIMULATED_TIER, &mut record);
            record.push(b'\n');
            output.write_all(&record)
        },
        reject,
    )
}

/// Replays `trace` through `engine` the way `simulate::replay` does (partition time = the
/// largest event time seen, every pending round fires at end of input, `emitted_at = due_at`),
/// handing each emission to `emit` in order. `RunStats::rejected` = the trace's unusable
/// inputs.
pub fn replay_trace(engine: Engine, trace: &Trace, mut emit: impl FnMut(&Emission)) -> RunStats {
    let mut driver = Driver::new(engine);
    let mut table = MemTable::new();
    let mut stats = RunStats::new();
    stats.rejected = trace.rejected_count();
    let mut out = Vec::new();
    let mut flush = |out: &mut Vec<Emission>, stats: &mut RunStats| {
        for e in out.drain(..) {
            stats.record_emission(&e, e.due_at);
            emit(&e);
        }
    };
    let mut now = Millis::MIN;
    for upload in &trace.uploads {
        now = now.max(upload.event_time);
        stats.uploads += 1;
        let Ok(applied) = driver.apply(&mut table, now, upload, &mut out);
        match applied {
            Applied::Late => stats.late += 1,
            Applied::Redelivered => stats.redelivered += 1,
            Applied::OnTime => {}
        }
        flush(&mut out, &mut stats);
    }
    fire_pending(&mut driver, &mut table, &mut out);
    flush(&mut out, &mut stats);
    stats
}

/// `e` with `what` before its message, of the same kind (a broken pipe stays one: the command
/// line ends quietly when its reader is gone).
fn context(e: std::io::Error, what: &str) -> std::io::Error {
    std::io::Error::new(e.kind(), format!("{what}: {e}"))
}

/// End of input: every pending round fires. Partition time moves to the latest round's due
/// time (again, while a max-wait continuation opens a later one), not to the end of time: the
/// state expiries behind the rounds would fire silently, one timer per key.
fn fire_pending(driver: &mut Driver, table: &mut MemTable, out: &mut Vec<Emission>) {
    while let Some(last) = table.last_round_due() {
        let Ok(fired) = driver.advance(table, last, out);
        if fired == 0 {
            // Cannot happen (every round has its timer); never loop on it.
            break;
        }
    }
}

/// `settle simulate`: loads the config (`config`, else the defaults), reads the trace of
/// `source` (a file streams through line by line; a broker range is read first) and writes
/// the ready records (JSONL) to `output`, standard output when `None`; the run's figures
/// go to standard error.
///
/// Errors: the config is invalid, the trace cannot be read, or the output cannot be written.
pub fn command(
    config: Option<&Path>,
    source: &SourceArgs,
    output: Option<&Path>,
) -> anyhow::Result<()> {
    let cfg = Config::load(config)?;
    let engine = Engine::new(cfg.policy_table());
    let mut out: Box<dyn Write + Send> = match output {
        Some(p) => Box::new(BufWriter::new(
            std::fs::File::create(p).with_context(|| format!("cannot create {}", p.display()))?,
        )),
        None => Box::new(BufWriter::with_capacity(1 << 16, std::io::stdout())),
    };
    let stats = match &source.choice.input {
        // A file streams through the engine line by line.
        Some(input)
            if source.since.is_none() && source.until.is_none() && source.topic.is_none() =>
        {
            let reader = BufReader::with_capacity(
                1 << 20,
                std::fs::File::open(input)
                    .with_context(|| format!("cannot open {}", input.display()))?,
            );
            replay_file(engine, reader, &mut out, |e| {
                eprintln!("{}: skipped {e}", input.display());
            })?
        }
        _ => {
            let loaded = trace_source::load(source, &cfg)?;
            let mut written = Ok(());
            let stats = replay_trace(engine, &loaded.trace, |e| {
                if written.is_ok() {
                    written = out
                        .write_all(&codec::encode_ready(e, e.due_at, SIMULATED_TIER))
                        .and_then(|()| out.write_all(b"\n"));
                }
            });
            written.context("cannot write the ready records")?;
            stats
        }
    };
    out.flush()?;
    eprintln!("{stats}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{PolicySpec, PolicyTable, Trigger, Upload};

    fn run(spec: PolicySpec, trace: &str) -> (Vec<Emission>, RunStats, Vec<String>) {
        let mut ems = Vec::new();
        let mut errs = Vec::new();
        let stats = replay(
            Engine::new(PolicyTable::uniform(spec)),
            trace.as_bytes(),
            |e| {
                ems.push(e.clone());
                Ok(())
            },
            |e| errs.push(e.to_string()),
        )
        .unwrap();
        (ems, stats, errs)
    }

    #[test]
    fn replays_in_event_time_and_flushes_at_end() {
        let trace = r#"
{"tenant":"a","session":"s1","ts":0}
{"tenant":"a","session":"s1","ts":100}
{"tenant":"b","session":"s2","ts":"1970-01-01T00:00:00.200Z"}
{"tenant":"a","session":"s1","ts":5000}
"#;
        let (ems, stats, errs) = run(PolicySpec::fixed(1_000), trace);
        assert!(errs.is_empty(), "{errs:?}");
        let got: Vec<_> = ems
            .iter()
            .map(|e| (e.key.to_string(), e.due_at, e.uploads, e.trigger))
            .collect();
        assert_eq!(
            got,
            vec![
                ("a/s1".into(), 1_100, 2, Trigger::Trailing),
                ("b/s2".into(), 1_200, 1, Trigger::Trailing),
                ("a/s1".into(), 6_000, 1, Trigger::Trailing),
            ]
        );
        assert_eq!((stats.uploads, stats.emissions), (4, 3));
    }

    #[test]
    fn ties_are_ordered_by_session_key() {
        let trace = "{\"tenant\":\"t\",\"session\":\"z\",\"ts\":0}\n{\"tenant\":\"t\",\"session\":\"a\",\"ts\":0}\n";
        let (ems, _, _) = run(PolicySpec::fixed(10), trace);
        let keys: Vec<_> = ems.iter().map(|e| e.key.to_string()).collect();
        assert_eq!(keys, vec!["t/a", "t/z"]);
    }

    #[test]
    fn end_of_input_fires_every_round_as_advancing_to_the_end_of_time_does() {
        // Busy keys with max-wait continuations, sparse keys, short state-ttl.
        let mut trace = String::new();
        let mut uploads = Vec::new();
        for i in 0..400_i64 {
            let (session, ts) = match i % 4 {
                0 | 1 => (format!("hot{}", i % 3), i * 37),
                2 => (format!("s{i}"), i * 37 + 11),
                _ => (format!("s{}", i / 8), i * 41),
            };
            trace.push_str(&format!(
                r#"{{"tenant":"t","session":"{session}","ts":{ts}}}"#
            ));
            trace.push('\n');
            uploads.push(Upload::plain(
                crate::engine::SessionKey::new("t", &session),
                ts,
            ));
        }
        let spec = PolicySpec::adaptive(300, 5_000)
            .with_max_wait(700)
            .with_state_ttl(2_000);
        let (ems, _, errs) = run(spec.clone(), &trace);
        assert!(errs.is_empty(), "{errs:?}");
        let mut driver = Driver::new(Engine::new(PolicyTable::uniform(spec)));
        let mut table = MemTable::new();
        let mut expected = Vec::new();
        let mut now = Millis::MIN;
        for u in &uploads {
            now = now.max(u.event_time);
            driver.apply(&mut table, now, u, &mut expected).unwrap();
        }
        driver
            .advance(&mut table, Millis::MAX / 4, &mut expected)
            .unwrap();
        assert!(expected.iter().any(|e| e.trigger == Trigger::MaxWait));
        assert_eq!(ems.len(), expected.len());
        assert!(ems == expected, "the emissions differ");
    }

    #[test]
    fn a_long_random_replay_with_a_short_state_ttl_repeats_no_emission_id() {
        // Issue 16: random traces with a 60 s state-ttl used to repeat hundreds of ids.
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(16);
        let mut trace = String::new();
        let mut ts: Millis = 1_767_225_600_000;
        for _ in 0..20_000 {
            ts += rng.random_range(0..400);
            let session = rng.random_range(0..300);
            trace.push_str(&format!(
                r#"{{"tenant":"t{}","session":"s{session}","ts":{ts}}}"#,
                session % 3
            ));
            trace.push('\n');
        }
        let mut out = Vec::new();
        let spec = PolicySpec::adaptive(5_000, 600_000).with_state_ttl(60_000);
        let engine = Engine::new(PolicyTable::uniform(spec));
        let stats = replay_to_jsonl(engine, trace.as_bytes(), &mut out, |e| panic!("{e}")).unwrap();
        let records: Vec<codec::ReadyRecord> = out
            .split(|&b| b == b'\n')
            .filter(|l| !l.is_empty())
            .map(|l| codec::decode_ready(l).unwrap())
            .collect();
        assert_eq!(records.len() as u64, stats.emissions);
        let ids: std::collections::BTreeSet<&str> =
            records.iter().map(|r| r.emission_id.as_str()).collect();
        assert_eq!(ids.len(), records.len(), "an emission id repeated");
        // Keys did expire and start again: `tenant/session/generation` alone would repeat.
        let old_ids: std::collections::BTreeSet<(String, u64)> = records
            .iter()
            .map(|r| (r.key().to_string(), r.generation))
            .collect();
        assert!(
            records.len() - old_ids.len() > 100,
            "only {} restarts",
            records.len() - old_ids.len()
        );
    }

    #[test]
    fn the_threaded_file_replay_writes_what_the_one_thread_replay_writes() {
        // Enough lines for many hand-over batches both ways, bad lines (one not UTF-8) among
        // them, and rounds left pending at the end of input.
        let mut trace = Vec::new();
        for i in 0..3 * HANDOFF_BATCH as i64 {
            let line = match i % 97 {
                0 => "not json".to_string(),
                1 => "# a comment".to_string(),
                _ => format!(
                    r#"{{"tenant":"t{}","session":"s{}","ts":{}}}"#,
                    i % 7,
                    (i * 31) % 1_000,
                    i * 13
                ),
            };
            trace.extend_from_slice(line.as_bytes());
            trace.push(b'\n');
        }
        trace.extend_from_slice(b"{\"tenant\":\"t\",\"session\":\"\xff\",\"ts\":1}\n");
        let engine = || Engine::new(PolicyTable::uniform(PolicySpec::adaptive(200, 5_000)));
        let (mut one, mut one_errs) = (Vec::new(), Vec::new());
        let one_stats = replay_to_jsonl(engine(), &trace[..], &mut one, |e| {
            one_errs.push(e.to_string())
        })
        .unwrap();
        let (mut three, mut three_errs) = (Vec::new(), Vec::new());
        let three_stats = replay_file(engine(), &trace[..], &mut three, |e| {
            three_errs.push(e.to_string())
        })
        .unwrap();
        assert!(
            one_stats.emissions as usize > 2 * HANDOFF_BATCH,
            "{}",
            one_stats.emissions
        );
        assert_eq!(one_errs.len(), 3 * HANDOFF_BATCH / 97 + 2, "{one_errs:?}");
        assert_eq!(three_errs, one_errs);
        assert!(three == one, "the ready records differ");
        assert_eq!(three_stats.to_string(), one_stats.to_string());
    }

    #[test]
    fn the_threaded_file_replay_reports_a_failed_write() {
        struct Full;
        impl Write for Full {
            fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
                Err(std::io::Error::other("disk full"))
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let trace: String = (0..5 * HANDOFF_BATCH)
            .map(|i| format!("{{\"tenant\":\"t\",\"session\":\"s{i}\",\"ts\":{i}}}\n"))
            .collect();
        let engine = Engine::new(PolicyTable::uniform(PolicySpec::fixed(1)));
        let err = replay_file(engine, trace.as_bytes(), Full, |e| panic!("{e}")).unwrap_err();
        assert_eq!(err.to_string(), "cannot write the ready records: disk full");
    }

    #[test]
    fn bad_lines_are_reported_with_line_number_and_skipped() {
        let trace = "{\"tenant\":\"t\",\"session\":\"s\",\"ts\":0}\nnot json\n{\"tenant\":\"t\",\"ts\":5}\n{\"tenant\":\"t\",\"session\":\"s\"}\n{\"tenant\":\"t\",\"session\":\"s\",\"ts\":10}\n";
        let (ems, stats, errs) = run(PolicySpec::fixed(100), trace);
        assert_eq!(errs.len(), 3, "{errs:?}");
        assert!(errs[0].starts_with("line 2:"), "{}", errs[0]);
        assert!(
            errs[1].starts_with("line 3:") && errs[1].contains("session"),
            "{}",
            errs[1]
        );
        assert!(
            errs[2].starts_with("line 4:") && errs[2].contains("ts"),
            "{}",
            errs[2]
        );
        assert_eq!(stats.rejected, 3);
        assert_eq!(ems.len(), 1);
        assert_eq!(ems[0].uploads, 2);
    }

    #[test]
    fn the_report_prints_the_delay_measured() {
        // 50 sessions of 3 uploads a second apart, at odd times: every round is ready exactly
        // 5 min after its last upload, and the summary says 5m00s (not the 4m59s of a
        // histogram bucket's lower end cut to whole seconds).
        let trace: String = (0..50)
            .flat_map(|s| (0..3).map(move |u| (s, 7_919 * s + 1_000 * u)))
            .map(|(s, ts)| format!("{{\"tenant\":\"t\",\"session\":\"s{s}\",\"ts\":{ts}}}\n"))
            .collect();
        let (ems, stats, errs) = run(PolicySpec::fixed(300_000), &trace);
        assert!(errs.is_empty(), "{errs:?}");
        assert_eq!(ems.len(), 50);
        assert!(ems.iter().all(|e| e.due_at - e.last_upload_at == 300_000));
        let text = stats.to_string();
        assert!(
            text.contains("time-to-ready: p50 5m00s · p90 5m00s · p99 5m00s · max 5m00s"),
            "{text}"
        );
    }
}
