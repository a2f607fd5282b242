//! What the fuzz targets check (SEMANTICS §2: every input record is either applied or
//! rejected with a reason; every record settle emits parses with a standard JSON parser),
//! shared by `fuzz/fuzz_targets/*` and by `tests/offline/fuzz_corpus.rs`, which runs the seed
//! corpus of `fuzz/corpus/` through the same functions on every test run.
//!
//! Written against `super::{codec, config, engine}` so that the same file compiles inside the
//! fuzz crate (modules included by path) and inside settle's offline tests (`settle::…`).
//! A check that fails panics with what it saw: libFuzzer reports the panic as a crash and
//! saves the input.

use super::codec::{self, DecodeError};
use super::config::Config;
use super::engine::partition::{Driver, MemTable};
use super::engine::{Emission, Engine, Millis, PolicyTable, Upload};

/// Wall clock (ms since the epoch) the record harness decodes at when the input does not give
/// one: 2026-12-01T00:00:00Z.
pub const DEFAULT_WALL_MS: Millis = 1_796_083_200_000;

/// Latest wall clock (ms) an input may choose: year 2200. A processor's clock is never far
/// from now; record timestamps (the producer's) may be anything.
const MAX_WALL_MS: u64 = 7_258_118_400_000;

/// One broker record as the fuzzer builds it from raw bytes (layout of [`Record::parse`]).
#[derive(Debug)]
pub struct Record<'a> {
    /// Record key (Kafka key, NATS `Settle-Key` header); `None`: no key.
    pub key: Option<Vec<u8>>,
    /// Record value.
    pub payload: &'a [u8],
    /// Record timestamp (ms, any `i64`: producers set it).
    pub timestamp_ms: Millis,
    /// Processor wall clock (ms), `0..=MAX_WALL_MS`.
    pub wall_ms: Millis,
    /// Selects the policy the upload is applied under (0..=3, see [`policies`]).
    pub policy: u8,
}

impl<'a> Record<'a> {
    /// Input layout: byte 0 = flags, then 8 bytes timestamp (i64 LE), 8 bytes wall clock
    /// (u64 LE, reduced into `0..=MAX_WALL_MS`), 1 byte key length `n`, `n` key bytes, the rest
    /// the payload. Flags: bit 0 set = the record has no key; bit 1 set = the key is taken
    /// from the payload's own `tenant`/`session` (so the fuzzer reaches the applied path
    /// without guessing them) instead of the key bytes; bits 2–3 the policy. Short inputs
    /// read missing bytes as 0; the defaults then are wall clock = [`DEFAULT_WALL_MS`].
    pub fn parse(data: &'a [u8]) -> Record<'a> {
        let byte = |i: usize| data.get(i).copied().unwrap_or(0);
        let flags = byte(0);
        let word = |at: usize| {
            let mut b = [0u8; 8];
            for (k, slot) in b.iter_mut().enumerate() {
                *slot = byte(at + k);
            }
            b
        };
        let timestamp_ms = i64::from_le_bytes(word(1));
        let wall = u64::from_le_bytes(word(9));
        let wall_ms = if wall == 0 {
            DEFAULT_WALL_MS
        } else {
            (wall % (MAX_WALL_MS + 1)) as Millis
        };
        let n = usize::from(byte(17));
        let key_start = 18.min(data.len());
        let key_end = (key_start + n).min(data.len());
        let key_bytes = &data[key_start..key_end];
        let payload = &data[key_end..];
        let key = if flags & 1 == 1 {
            None
        } else if flags & 2 == 2 {
            Some(key_of_payload(payload).unwrap_or_else(|| key_bytes.to_vec()))
        } else {
            Some(key_bytes.to_vec())
        };
        Record {
            key,
            payload,
            timestamp_ms,
            wall_ms,
            policy: (flags >> 2) & 3,
        }
    }

    /// The bytes [`Record::parse`] reads back as this record (used to write the seed corpus).
    pub fn to_bytes(&self) -> Vec<u8> {
        let key = self.key.clone().unwrap_or_default();
        assert!(key.len() <= 255, "a seed key is at most 255 bytes");
        let mut out = vec![u8::from(self.key.is_none()) | (self.policy & 3) << 2];
        out.extend_from_slice(&self.timestamp_ms.to_le_bytes());
        out.extend_from_slice(&(self.wall_ms as u64).to_le_bytes());
        out.push(key.len() as u8);
        out.extend_from_slice(&key);
        out.extend_from_slice(self.payload);
        out
    }
}

/// `tenant/session` of an upload payload, read leniently (any JSON object with two string
/// fields), or `None`.
fn key_of_payload(payload: &[u8]) -> Option<Vec<u8>> {
    let v: serde_json::Value = serde_json::from_slice(payload).ok()?;
    let (t, s) = (v.get("tenant")?.as_str()?, v.get("session")?.as_str()?);
    Some(format!("{t}/{s}").into_bytes())
}

/// The four policy tables the record harness applies uploads under: the defaults (fixed),
/// leading-trailing, adaptive (the seeds' v3 numbers) and fixed with max-wait and learned
/// initial delays.
pub fn policies() -> [PolicyTable; 4] {
    let load = |toml: &str| {
        Config::from_toml_str(toml)
            .unwrap_or_else(|e| panic!("harness config {toml:?} is refused: {e}"))
            .policy_table()
    };
    [
        load(""),
        load("[debounce]\npolicy = \"leading-trailing\"\ndelay = \"30s\"\n"),
        load("[debounce]\npolicy = \"adaptive\"\nmin-delay = \"5s\"\nmax-delay = \"10m\"\n"),
        load(
            "[debounce]\ndelay = \"2m\"\nmax-wait = \"5m\"\nstate-ttl = \"10m\"\nlearn-initial-delay = true\n",
        ),
    ]
}

/// Outcome of [`check_record`], for the corpus test's counts.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Decoded and applied; this many ready records came out of it (all checked).
    Applied(usize),
    /// Rejected with this dead-letter reason.
    Rejected(&'static str),
}

/// Decodes `record` as settle's consumers do (`codec::decode_upload`); a rejection must name
/// one of `DecodeError::ALL_REASONS`. An accepted upload must satisfy SEMANTICS §2 (key =
/// `tenant/session` of the payload, event time capped at the wall clock, attributes a JSON
/// object of at most 64 levels and 16 KiB); it is then applied twice (a redelivery) and once
/// more as `final` to an engine partition under `policies[record.policy]`, time is advanced
/// past every timer, and every emission is encoded as a ready record that must parse with
/// serde_json, read back with `codec::decode_ready` and carry the emission's id.
///
/// Panics when a check fails.
pub fn check_record(record: &Record<'_>, policies: &[PolicyTable; 4]) -> Outcome {
    let decoded = codec::decode_upload(
        record.key.as_deref(),
        record.payload,
        record.timestamp_ms,
        record.wall_ms,
    );
    let upload = match decoded {
        Ok(u) => u,
        Err(e) => return Outcome::Rejected(check_rejection(&e)),
    };
    check_upload(record, &upload);
    let table = policies[usize::from(record.policy & 3)].clone();
    Outcome::Applied(run_engine(table, &upload, record.wall_ms))
}

fn check_rejection(e: &DecodeError) -> &'static str {
    let reason = e.reason();
    assert!(
        DecodeError::ALL_REASONS.contains(&reason),
        "reason {reason:?} of {e:?} is not in DecodeError::ALL_REASONS"
    );
    assert!(!e.to_string().is_empty(), "{e:?} has an empty message");
    reason
}

fn check_upload(record: &Record<'_>, u: &Upload) {
    let key = record
        .key
        .as_deref()
        .expect("an upload without a record key was applied");
    assert_eq!(
        u.key.as_str().as_bytes(),
        key,
        "applied under another key than the record's"
    );
    assert!(
        u.event_time <= record.wall_ms,
        "event time {} is past the wall clock {}",
        u.event_time,
        record.wall_ms
    );
    assert_eq!(u.event_time, record.timestamp_ms.min(record.wall_ms));
    if let Some(attrs) = &u.attributes {
        assert!(
            attrs.len() <= 16 * 1024,
            "attributes of {} bytes",
            attrs.len()
        );
        let v: serde_json::Value = serde_json::from_str(attrs)
            .unwrap_or_else(|e| panic!("accepted attributes do not parse: {e}: {attrs:?}"));
        assert!(
            v.is_object(),
            "accepted attributes are not an object: {attrs:?}"
        );
        assert!(
            depth(&v) <= 64,
            "accepted attributes nest {} levels",
            depth(&v)
        );
    }
    if let Some(p) = u.part {
        assert!(p.index >= 1 && p.index <= p.count, "part {p:?}");
    }
    if let Some(id) = &u.event_id {
        assert!(id.len() <= 128, "event_id of {} bytes", id.len());
    }
}

/// The value of a `MemTable` operation (its error type is `Infallible`).
fn ok<T>(r: Result<T, std::convert::Infallible>) -> T {
    match r {
        Ok(v) => v,
        Err(e) => match e {},
    }
}

/// Nesting depth of `v` (a scalar is 0, `{}` is 1).
fn depth(v: &serde_json::Value) -> usize {
    match v {
        serde_json::Value::Object(m) => 1 + m.values().map(depth).max().unwrap_or(0),
        serde_json::Value::Array(a) => 1 + a.iter().map(depth).max().unwrap_or(0),
        _ => 0,
    }
}

/// Applies `upload`, its redelivery and a `final` copy at `wall_ms`, then advances one year
/// past its event time; checks every emission's ready record. Returns how many came out.
fn run_engine(table: PolicyTable, upload: &Upload, wall_ms: Millis) -> usize {
    let mut driver = Driver::new(Engine::new(table));
    let mut mem = MemTable::new();
    let mut out: Vec<Emission> = Vec::new();
    let now = wall_ms;
    ok(driver.apply(&mut mem, now, upload, &mut out));
    ok(driver.apply(&mut mem, now, upload, &mut out));
    let mut last = upload.clone();
    last.final_flag = true;
    last.part = None;
    last.event_id = Some("fuzz-final".to_owned());
    ok(driver.apply(&mut mem, now, &last, &mut out));
    let end = now.max(upload.event_time).saturating_add(366 * 86_400_000);
    ok(driver.advance(&mut mem, end, &mut out));
    assert_eq!(mem.open_rounds(), 0, "rounds still open a year later");
    for em in &out {
        check_emission(em, end);
    }
    out.len()
}

/// Encodes `em` as `settle run` publishes it and checks it reads back.
pub fn check_emission(em: &Emission, emitted_at: Millis) {
    let bytes = codec::encode_ready(em, emitted_at, "normal");
    let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_else(|e| {
        panic!(
            "ready record does not parse: {e}: {}",
            String::from_utf8_lossy(&bytes)
        )
    });
    assert_eq!(
        v.get("emission_id").and_then(|i| i.as_str()),
        Some(em.emission_id().as_str()),
        "emission_id"
    );
    let back = codec::decode_ready(&bytes).unwrap_or_else(|e| {
        panic!(
            "decode_ready refuses a ready record: {e}: {}",
            String::from_utf8_lossy(&bytes)
        )
    });
    assert_eq!(back.emission_id, em.emission_id());
    assert_eq!(back.key(), em.key);
    assert_eq!(back.uploads, em.uploads);
    assert_eq!(back.generation, em.generation);
}

/// Loads `text` as a settle.toml (`Config::from_toml_str`): either refused with a message or
/// accepted; an accepted config must validate again, build its policy table, and drive a short
/// trace (a burst, a split upload, a final flush: 50 uploads per tenant into 20 sessions)
/// through the engine under every tenant's policy with every emission checked. Returns whether
/// it was accepted.
///
/// Panics when a check fails.
pub fn check_config(text: &str) -> bool {
    let config = match Config::from_toml_str(text) {
        Ok(c) => c,
        Err(e) => {
            assert!(
                !e.to_string().is_empty(),
                "empty error message for {text:?}"
            );
            return false;
        }
    };
    config
        .validate()
        .unwrap_or_else(|e| panic!("an accepted config fails validate(): {e}"));
    let table = config.policy_table();
    let mut tenants: Vec<String> = table.tenants.keys().cloned().collect();
    tenants.sort();
    tenants.truncate(4);
    tenants.push("fuzz-default".to_owned());
    let mut driver = Driver::new(Engine::new(table));
    let mut mem = MemTable::new();
    let mut out = Vec::new();
    let t0: Millis = DEFAULT_WALL_MS;
    for (ti, tenant) in tenants.iter().enumerate() {
        // 50 uploads per tenant: enough for every policy path, and a config with a tiny
        // max-wait and a long delay (delay / max-wait silent renewals per round) stays under
        // a second per input.
        for i in 0..50_i64 {
            let session = format!("s{}", i % 20);
            let key = super::engine::SessionKey::new(tenant, &session);
            let at = t0 + (ti as i64) * 1_000 + i * i * 2_000;
            let mut u = Upload::plain(key, at);
            u.event_id = Some(format!("e{i}"));
            if i % 17 == 7 {
                u.part = Some(super::engine::Part { index: 1, count: 2 });
            }
            u.final_flag = i % 23 == 22;
            ok(driver.apply(&mut mem, at, &u, &mut out));
        }
    }
    let end = t0.saturating_add(400 * 86_400_000);
    ok(driver.advance(&mut mem, end, &mut out));
    for em in &out {
        check_emission(em, end);
    }
    true
}

/// A trace line (`settle simulate`/`tune` input) is decoded or refused with a message; a
/// decoded one carries a valid key.
pub fn check_trace_line(text: &str) -> bool {
    match codec::decode_trace_line(text) {
        Ok(rec) => {
            let key = rec.upload.key.as_str().to_owned();
            let (tenant, session) = key.split_once('/').expect("trace key without '/'");
            codec::validate_tenant(tenant).expect("trace line accepted with a bad tenant");
            codec::validate_session(session).expect("trace line accepted with a bad session");
            true
        }
        Err(e) => {
            assert!(!e.to_string().is_empty(), "empty error for {text:?}");
            false
        }
    }
}

/// `codec::decode_ready` on arbitrary bytes (what `settle consume` and `settle tune
/// --from-kafka` read from output topics) never panics; a record it accepts encodes back to a
/// record it accepts.
pub fn check_ready_bytes(bytes: &[u8]) {
    if let Ok(rec) = codec::decode_ready(bytes) {
        if codec::validate_tenant(&rec.tenant).is_ok()
            && codec::validate_session(&rec.session).is_ok()
        {
            check_emission(&rec.emission(), rec.emitted_at);
        }
    }
}
