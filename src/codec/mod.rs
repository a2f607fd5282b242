//! Record codecs (SEMANTICS §2): the "upload" input record, the "session ready" output record,
//! and the time helpers every module uses to print and read instants.
//!
//! What this module owns:
//! * [`decode_upload`]: bytes from the broker → a validated [`Upload`] or a [`DecodeError`]
//!   whose [`DecodeError::reason`] is the dead-letter reason and metrics label. Every check of
//!   §2 is here and nowhere else; the engine trusts what it gets.
//! * [`decode_trace_line`]: a line of the JSONL trace format of `settle simulate` and
//!   `settle tune` (an upload record plus `"ts"` and `"partition"`), in the same single pass.
//! * [`encode_ready`] / [`encode_ready_into`] / [`decode_ready`]: an engine [`Emission`] → the
//!   §2 output record and back ([`ReadyRecord`]).
//! * [`action`]: operator actions as records of the input topic, their outcomes and the audit
//!   records (SEMANTICS §7).
//! * [`format_rfc3339_ms`], [`write_rfc3339_ms`], [`parse_rfc3339_ms`], [`parse_timestamp`]:
//!   instants on the wire are RFC 3339 UTC with milliseconds, `2026-11-30T03:34:47.123Z`.
//!
//! Both directions are on the hot path (≥ 1 M uploads/s per core). Decoding walks the JSON
//! object once with a hand-written serde map visitor: strings are borrowed from the payload
//! unless they contain escapes, `attributes` is captured as its raw text without building a
//! tree, and unknown fields are skipped without allocating. (A `#[derive(Deserialize)]` struct
//! is just as fast but cannot tell which field had the wrong type, and the dead-letter reason
//! must.) Encoding writes the record's bytes directly (integers with `itoa`, instants digit by
//! digit), never through `format!`; tests hold it to the bytes `serde_json` writes for
//! [`ReadyRecord`] and the instants to the `time` crate's formatting.

pub mod action;

use crate::engine::{Emission, EventIds, Millis, Part, PolicyName, SessionKey, Trigger, Upload};
use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::value::RawValue;
use std::borrow::Cow;
use std::fmt;

/// Most bytes in a `tenant` (SEMANTICS §2).
pub const TENANT_MAX_BYTES: usize = 128;
/// Most bytes in a `session` (SEMANTICS §2).
pub const SESSION_MAX_BYTES: usize = 256;
/// Most bytes in an `event_id` (SEMANTICS §2).
pub const EVENT_ID_MAX_BYTES: usize = 128;
/// Most bytes of the `attributes` object as it appears in the record (16 KiB, SEMANTICS §2).
pub const ATTRIBUTES_MAX_BYTES: usize = 16 * 1024;
/// Most levels of nesting in `attributes` (SEMANTICS §2): the object itself is level 1, each
/// object or array inside another one more. Emitted records then nest at most 65 levels, which
/// every common JSON parser reads (`serde_json` stops at 128, Python's `json` near 1 000).
pub const ATTRIBUTES_MAX_DEPTH: usize = 64;
/// Header of every output record carrying its `emission_id` (SEMANTICS §2).
pub const EMISSION_ID_HEADER: &str = "settle-emission-id";

/// Why an input record is not applied (SEMANTICS §2): one variant per rule. The record goes to
/// the dead-letter topic with [`DecodeError::reason`] and the partition's offset advances.
///
/// When a record breaks several rules the first one found is reported: the payload's bytes and
/// JSON syntax first, then field types in the order the fields appear, then `tenant`,
/// `session`, `event_id`, `part`, `attributes` and last the record key.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The payload is not UTF-8.
    #[error("payload is not valid UTF-8")]
    InvalidUtf8,
    /// The payload is not JSON (message from the JSON parser, with line and column).
    #[error("payload is not valid JSON: {0}")]
    InvalidJson(String),
    /// The payload is JSON but not an object.
    #[error("payload must be a JSON object")]
    NotAnObject,
    /// A field this decoder reads appears twice in the object (ambiguous record).
    #[error("field `{0}` appears more than once")]
    DuplicateField(&'static str),
    /// No `tenant` field.
    #[error("required field `tenant` is missing")]
    MissingTenant,
    /// `tenant` is not a string.
    #[error("field `tenant` must be a string")]
    TenantNotString,
    /// `tenant` is the empty string.
    #[error("field `tenant` must be 1-128 bytes, got 0")]
    EmptyTenant,
    /// `tenant` is longer than [`TENANT_MAX_BYTES`].
    #[error("field `tenant` must be 1-128 bytes, got {0}")]
    TenantTooLong(usize),
    /// `tenant` has a character outside `[A-Za-z0-9._:-]`.
    #[error("field `tenant` may only contain [A-Za-z0-9._:-], found {0:?}")]
    BadTenant(char),
    /// No `session` field.
    #[error("required field `session` is missing")]
    MissingSession,
    /// `session` is not a string.
    #[error("field `session` must be a string")]
    SessionNotString,
    /// `session` is the empty string.
    #[error("field `session` must be 1-256 bytes, got 0")]
    EmptySession,
    /// `session` is longer than [`SESSION_MAX_BYTES`].
    #[error("field `session` must be 1-256 bytes, got {0}")]
    SessionTooLong(usize),
    /// `session` has a control character (Unicode category Cc: U+0000–U+001F, U+007F–U+009F).
    #[error("field `session` must not contain control characters, found {0:?}")]
    SessionControlChar(char),
    /// `event_id` is present but not a string (or null).
    #[error("field `event_id` must be a string")]
    EventIdNotString,
    /// `event_id` is longer than [`EVENT_ID_MAX_BYTES`].
    #[error("field `event_id` must be at most 128 bytes, got {0}")]
    EventIdTooLong(usize),
    /// `part` is not an object `{"index": u32, "count": u32}` (or null).
    #[error("field `part` must be an object {{\"index\": u32, \"count\": u32}}: {0}")]
    BadPart(String),
    /// `part.count` is 0.
    #[error("field `part.count` must be at least 1")]
    PartCountZero,
    /// `part.index` is not in `1..=part.count`.
    #[error("field `part.index` must be in 1..={count}, got {index}")]
    PartIndexOutOfRange {
        /// The record's `part.index`.
        index: u32,
        /// The record's `part.count`.
        count: u32,
    },
    /// `final` is present but not a boolean (or null).
    #[error("field `final` must be a boolean")]
    FinalNotBool,
    /// `attributes` is present but not a JSON object (or null).
    #[error("field `attributes` must be a JSON object")]
    AttributesNotObject,
    /// `attributes` is longer than [`ATTRIBUTES_MAX_BYTES`] as written in the record.
    #[error("field `attributes` must be at most 16384 bytes, got {0}")]
    AttributesTooLarge(usize),
    /// `attributes` nests objects and arrays deeper than [`ATTRIBUTES_MAX_DEPTH`] levels.
    #[error("field `attributes` must nest at most 64 levels")]
    AttributesTooDeep,
    /// The record has no key: its session's uploads could be spread over partitions.
    #[error("record key is missing (it must be `tenant/session`)")]
    MissingKey,
    /// The record key is not UTF-8.
    #[error("record key is not valid UTF-8")]
    KeyNotUtf8,
    /// The record key differs from `tenant/session`.
    #[error("record key {key:?} must equal `tenant/session` {expected:?}")]
    KeyMismatch {
        /// The record key (cut to 300 bytes).
        key: String,
        /// `tenant/session` from the payload.
        expected: String,
    },
    /// The record arrived on a partition other than the one its key hashes to, on a
    /// transport where settle's partitioner decides (NATS: 32-bit FNV-1a of the key modulo
    /// `nats.partitions`). Its session's other uploads live on that other partition, so
    /// applying it here would split the session (SEMANTICS §2).
    #[error("record arrived on partition {partition}, but its key hashes to partition {expected}")]
    WrongPartition {
        /// The partition the record was read from.
        partition: i32,
        /// The partition its key hashes to.
        expected: i32,
    },
}

impl DecodeError {
    /// Every [`DecodeError::reason`] code, in declaration order.
    pub const ALL_REASONS: [&'static str; 27] = [
        "invalid_utf8",
        "invalid_json",
        "not_an_object",
        "duplicate_field",
        "missing_tenant",
        "tenant_not_string",
        "empty_tenant",
        "tenant_too_long",
        "bad_tenant",
        "missing_session",
        "session_not_string",
        "empty_session",
        "session_too_long",
        "session_control_char",
        "event_id_not_string",
        "event_id_too_long",
        "bad_part",
        "part_count_zero",
        "part_index_out_of_range",
        "final_not_bool",
        "attributes_not_object",
        "attributes_too_large",
        "attributes_too_deep",
        "missing_key",
        "key_not_utf8",
        "key_mismatch",
        "wrong_partition",
    ];

    /// Short stable snake_case code of the rule that failed: the dead-letter reason header and
    /// the metrics label. One of [`DecodeError::ALL_REASONS`].
    pub fn reason(&self) -> &'static str {
        match self {
            DecodeError::InvalidUtf8 => "invalid_utf8",
            DecodeError::InvalidJson(_) => "invalid_json",
            DecodeError::NotAnObject => "not_an_object",
            DecodeError::DuplicateField(_) => "duplicate_field",
            DecodeError::MissingTenant => "missing_tenant",
            DecodeError::TenantNotString => "tenant_not_string",
            DecodeError::EmptyTenant => "empty_tenant",
            DecodeError::TenantTooLong(_) => "tenant_too_long",
            DecodeError::BadTenant(_) => "bad_tenant",
            DecodeError::MissingSession => "missing_session",
            DecodeError::SessionNotString => "session_not_string",
            DecodeError::EmptySession => "empty_session",
            DecodeError::SessionTooLong(_) => "session_too_long",
            DecodeError::SessionControlChar(_) => "session_control_char",
            DecodeError::EventIdNotString => "event_id_not_string",
            DecodeError::EventIdTooLong(_) => "event_id_too_long",
            DecodeError::BadPart(_) => "bad_part",
            DecodeError::PartCountZero => "part_count_zero",
            DecodeError::PartIndexOutOfRange { .. } => "part_index_out_of_range",
            DecodeError::FinalNotBool => "final_not_bool",
            DecodeError::AttributesNotObject => "attributes_not_object",
            DecodeError::AttributesTooLarge(_) => "attributes_too_large",
            DecodeError::AttributesTooDeep => "attributes_too_deep",
            DecodeError::MissingKey => "missing_key",
            DecodeError::KeyNotUtf8 => "key_not_utf8",
            DecodeError::KeyMismatch { .. } => "key_mismatch",
            DecodeError::WrongPartition { .. } => "wrong_partition",
        }
    }
}

/// Checks a tenant name (SEMANTICS §2): 1–128 bytes of `[A-Za-z0-9._:-]`. Also used for the
/// tenant names of the config.
///
/// Errors: [`DecodeError::EmptyTenant`], [`DecodeError::TenantTooLong`],
/// [`DecodeError::BadTenant`].
pub fn validate_tenant(tenant: &str) -> Result<(), DecodeError> {
    if tenant.is_empty() {
        return Err(DecodeError::EmptyTenant);
    }
    if tenant.len() > TENANT_MAX_BYTES {
        return Err(DecodeError::TenantTooLong(tenant.len()));
    }
    match tenant.bytes().position(|b| !TENANT_BYTES[usize::from(b)]) {
        // `i` is a char boundary: every byte before it is ASCII.
        Some(i) => Err(DecodeError::BadTenant(
            tenant[i..].chars().next().unwrap_or_default(),
        )),
        None => Ok(()),
    }
}

/// `TENANT_BYTES[b]`: byte `b` may appear in a tenant (`[A-Za-z0-9._:-]`).
const TENANT_BYTES: [bool; 256] = {
    let mut table = [false; 256];
    let mut b = 0;
    while b < 256 {
        let c = b as u8;
        table[b] = c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b':' | b'-');
        b += 1;
    }
    table
};

/// Checks a session id (SEMANTICS §2): 1–256 bytes of UTF-8 without control characters
/// (Unicode category Cc). `/` is allowed: the first `/` of a session key ends the tenant.
///
/// Errors: [`DecodeError::EmptySession`], [`DecodeError::SessionTooLong`],
/// [`DecodeError::SessionControlChar`].
pub fn validate_session(session: &str) -> Result<(), DecodeError> {
    if session.is_empty() {
        return Err(DecodeError::EmptySession);
    }
    if session.len() > SESSION_MAX_BYTES {
        return Err(DecodeError::SessionTooLong(session.len()));
    }
    // Cc is U+0000–U+001F and U+007F (one byte each) and U+0080–U+009F (`C2 80`–`C2 9F`);
    // scanning bytes finds them without decoding chars.
    let bytes = session.as_bytes();
    let hit = bytes.iter().enumerate().position(|(i, &b)| {
        b < 0x20 || b == 0x7f || (b == 0xc2 && matches!(bytes.get(i + 1), Some(0x80..=0x9f)))
    });
    match hit {
        Some(i) => Err(DecodeError::SessionControlChar(
            session[i..].chars().next().unwrap_or_default(),
        )),
        None => Ok(()),
    }
}

/// Decodes and validates one input record (SEMANTICS §2) with its event time (§3).
///
/// * `record_key`: the broker record key (on NATS the `settle-key` header). It must be there
///   (`None`: [`DecodeError::MissingKey`]; [`decode_upload_with`] and [`KeyRule::Optional`]
///   for NATS, where it may be absent), be UTF-8 and equal `tenant/session` byte for byte.
///   Records of formats that have no key (trace files) go through [`decode_trace_line`].
/// * `payload`: the record value, a JSON object. Fields other than `tenant`, `session`,
///   `event_id`, `part`, `final` and `attributes` are ignored. `null` for an optional field
///   means absent.
/// * `timestamp_ms`: the record timestamp (ms since the epoch); `wall_clock_ms`: the
///   processor's wall clock (ms). Event time = `min(timestamp_ms, wall_clock_ms)`.
///
/// `attributes` is kept as its raw JSON text (as written in the record, ≤ 16 KiB, nesting
/// ≤ [`ATTRIBUTES_MAX_DEPTH`]).
///
/// Errors: the first rule broken, see [`DecodeError`].
pub fn decode_upload(
    record_key: Option<&[u8]>,
    payload: &[u8],
    timestamp_ms: Millis,
    wall_clock_ms: Millis,
) -> Result<Upload, DecodeError> {
    decode_upload_with(
        KeyRule::Required,
        record_key,
        payload,
        timestamp_ms,
        wall_clock_ms,
    )
}

/// Whether an input record must carry a record key (SEMANTICS §2).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KeyRule {
    /// Kafka: the record key decides the partition, so it must be there
    /// ([`DecodeError::MissingKey`] otherwise) and equal `tenant/session`.
    #[default]
    Required,
    /// NATS: a message has no record key; the session key is the record's own
    /// `tenant/session`. A key the producer adds (the `settle-key` header) must still equal
    /// it ([`DecodeError::KeyMismatch`]).
    Optional,
}

/// [`decode_upload`] under `rule`: with [`KeyRule::Optional`] a record without a key is
/// decoded with `tenant/session` from its payload as its session key.
///
/// Errors: as [`decode_upload`] (no [`DecodeError::MissingKey`] under
/// [`KeyRule::Optional`]).
pub fn decode_upload_with(
    rule: KeyRule,
    record_key: Option<&[u8]>,
    payload: &[u8],
    timestamp_ms: Millis,
    wall_clock_ms: Millis,
) -> Result<Upload, DecodeError> {
    let text = std::str::from_utf8(payload).map_err(|_| DecodeError::InvalidUtf8)?;
    let wire = match plain_wire(text) {
        Some(wire) => wire,
        None => parse_wire(text, None)?,
    };
    let fields = wire.check()?;
    match (record_key, rule) {
        (Some(key), _) => check_record_key(key, &fields.tenant, &fields.session)?,
        (None, KeyRule::Optional) => {}
        (None, KeyRule::Required) => return Err(DecodeError::MissingKey),
    }
    Ok(fields.into_upload(timestamp_ms.min(wall_clock_ms)))
}

/// A trace line of `settle simulate` and `settle tune` (the JSONL trace format): an upload
/// record (SEMANTICS §2) plus `"ts"`, its event time (epoch-ms integer or RFC 3339 string),
/// and an optional `"partition"` (u32).
#[derive(Clone, Debug, PartialEq)]
pub struct TraceRecord {
    /// The `partition` field, if present.
    pub partition: Option<u32>,
    /// The decoded upload; its event time is `ts` (ms, not capped: a trace has no wall clock).
    pub upload: Upload,
}

/// Why a trace line is not a usable [`TraceRecord`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TraceLineError {
    /// Not a JSON object, or `ts`/`partition` missing or of the wrong type (what is wrong).
    #[error("{0}")]
    NotATrace(String),
    /// The upload record in the line breaks a rule of §2.
    #[error(transparent)]
    Upload(DecodeError),
}

/// Decodes one trace line ([`TraceRecord`]). A trace has no record key: the session key is
/// `tenant/session` from the line itself, so no key rule applies.
///
/// The line is parsed once: `ts` and `partition` are captured as raw JSON while the upload's
/// fields are read. Only when that fails (or `ts` is negative or an escaped string) is the line
/// read again field by field, to report the same error as always.
///
/// Errors: [`TraceLineError::NotATrace`] first (not a JSON object, `ts` missing or not a
/// timestamp, `partition` not a u32), then [`TraceLineError::Upload`] with the rule broken.
pub fn decode_trace_line(text: &str) -> Result<TraceRecord, TraceLineError> {
    let mut trace = TraceFields::default();
    let fast = parse_wire(text, Some(&mut trace))
        .ok()
        .and_then(|wire| wire.check().ok())
        .and_then(|fields| {
            let ts = trace.ts.and_then(plain_ts)?;
            let partition = match trace.partition.map(RawValue::get) {
                None | Some("null") => None,
                Some(digits) => Some(digits.parse::<u32>().ok()?),
            };
            Some(TraceRecord {
                partition,
                upload: fields.into_upload(ts),
            })
        });
    match fast {
        Some(record) => Ok(record),
        None => decode_trace_line_checked(text),
    }
}

/// `ts` given as a non-negative integer or an RFC 3339 string without escapes; `None` for
/// anything else (left to [`parse_timestamp`] on the slow path).
fn plain_ts(raw: &RawValue) -> Option<Millis> {
    let text = raw.get();
    if text.bytes().all(|b| b.is_ascii_digit()) {
        return text.parse().ok();
    }
    let inner = text.strip_prefix('"')?.strip_suffix('"')?;
    if inner.contains('\\') {
        return None;
    }
    parse_rfc3339_ms(inner).ok()
}

/// The trace fields of a line as `serde` reads them (the slow path).
#[derive(Deserialize)]
struct TraceMeta {
    ts: Option<serde_json::Value>,
    partition: Option<u32>,
}

/// Raw `ts` and `partition` captured during the one pass of [`decode_trace_line`].
#[derive(Default)]
struct TraceFields<'de> {
    ts: Option<&'de RawValue>,
    partition: Option<&'de RawValue>,
}

/// [`decode_trace_line`] field by field: the trace fields first, then the upload.
fn decode_trace_line_checked(text: &str) -> Result<TraceRecord, TraceLineError> {
    let bad = TraceLineError::NotATrace;
    let meta: TraceMeta = serde_json::from_str(text)
        .map_err(|e| bad(format!("not a trace record (JSON object with \"ts\"): {e}")))?;
    let ts = meta
        .ts
        .ok_or_else(|| bad("missing \"ts\" (epoch ms integer or RFC 3339 string)".into()))?;
    let ts = parse_timestamp(&ts).map_err(|e| bad(format!("bad \"ts\": {e}")))?;
    let fields = parse_wire(text, None)
        .and_then(Wire::check)
        .map_err(TraceLineError::Upload)?;
    Ok(TraceRecord {
        partition: meta.partition,
        upload: fields.into_upload(ts),
    })
}

/// The record key must be exactly `tenant/session`.
fn check_record_key(key: &[u8], tenant: &str, session: &str) -> Result<(), DecodeError> {
    let (t, s) = (tenant.as_bytes(), session.as_bytes());
    if key.len() == t.len() + 1 + s.len()
        && key.starts_with(t)
        && key[t.len()] == b'/'
        && key.ends_with(s)
    {
        return Ok(());
    }
    let key = std::str::from_utf8(key).map_err(|_| DecodeError::KeyNotUtf8)?;
    let mut cut = key.len().min(300);
    while !key.is_char_boundary(cut) {
        cut -= 1;
    }
    Err(DecodeError::KeyMismatch {
        key: key[..cut].to_owned(),
        expected: format!("{tenant}/{session}"),
    })
}

/// The fields of an upload that passed every payload rule of §2, still borrowed from the
/// payload where they had no escapes.
struct Checked<'de> {
    tenant: Cow<'de, str>,
    session: Cow<'de, str>,
    event_id: Option<Cow<'de, str>>,
    part: Option<Part>,
    final_flag: bool,
    attributes: Option<&'de RawValue>,
}

impl Checked<'_> {
    /// The engine's upload with event time `event_time` (ms): the key and the optional
    /// strings are the only allocations.
    fn into_upload(self, event_time: Millis) -> Upload {
        Upload {
            key: SessionKey::new(&self.tenant, &self.session),
            event_time,
            event_id: self.event_id.map(Cow::into_owned),
            part: self.part,
            final_flag: self.final_flag,
            attributes: self.attributes.map(|raw| raw.get().to_owned()),
        }
    }
}

impl<'de> Wire<'de> {
    /// Applies the limits of §2 in the documented order (`tenant`, `session`, `event_id`,
    /// `part`, `attributes`).
    fn check(self) -> Result<Checked<'de>, DecodeError> {
        let tenant = self.tenant.ok_or(DecodeError::MissingTenant)?;
        validate_tenant(&tenant)?;
        let session = self.session.ok_or(DecodeError::MissingSession)?;
        validate_session(&session)?;
        if let Some(id) = &self.event_id {
            if id.len() > EVENT_ID_MAX_BYTES {
                return Err(DecodeError::EventIdTooLong(id.len()));
            }
        }
        let part = match self.part {
            None => None,
            Some(p) if p.count == 0 => return Err(DecodeError::PartCountZero),
            Some(p) if p.index == 0 || p.index > p.count => {
                return Err(DecodeError::PartIndexOutOfRange {
                    index: p.index,
                    count: p.count,
                })
            }
            Some(p) => Some(Part {
                index: p.index,
                count: p.count,
            }),
        };
        let attributes = match self.attributes {
            Some(raw) if raw.get() != "null" => {
                let text = raw.get();
                if !text.starts_with('{') {
                    return Err(DecodeError::AttributesNotObject);
                }
                if text.len() > ATTRIBUTES_MAX_BYTES {
                    return Err(DecodeError::AttributesTooLarge(text.len()));
                }
                match scan_json(text, ATTRIBUTES_MAX_DEPTH) {
                    Ok(()) => {}
                    Err(Scan::TooDeep) => return Err(DecodeError::AttributesTooDeep),
                    Err(Scan::LoneSurrogate(unit)) => {
                        return Err(DecodeError::InvalidJson(format!(
                            "field `attributes` has a lone surrogate escape \\u{unit:04X} (it names no character; strict JSON parsers reject it)"
                        )))
                    }
                    Err(Scan::NumberOutOfRange(number)) => {
                        return Err(DecodeError::InvalidJson(format!(
                            "field `attributes` has the number {number} beyond the range of a double (JSON parsers such as serde_json reject it)"
                        )))
                    }
                }
                Some(raw)
            }
            _ => None,
        };
        Ok(Checked {
            tenant,
            session,
            event_id: self.event_id,
            part,
            final_flag: self.final_flag.unwrap_or(false),
            attributes,
        })
    }
}

/// The fields of an upload as they are in the JSON object, types checked, limits not yet.
#[derive(Default)]
struct Wire<'de> {
    tenant: Option<Cow<'de, str>>,
    session: Option<Cow<'de, str>>,
    event_id: Option<Cow<'de, str>>,
    part: Option<WirePart>,
    final_flag: Option<bool>,
    attributes: Option<&'de RawValue>,
}

/// `part` as written: an object (not an array, as a derived struct would also accept) with
/// `index` and `count`, each a u32; other members are ignored.
struct WirePart {
    index: u32,
    count: u32,
}

impl<'de> Deserialize<'de> for WirePart {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = WirePart;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object {\"index\": u32, \"count\": u32}")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<WirePart, A::Error> {
                let (mut index, mut count) = (None, None);
                while let Some(CowStr(name)) = map.next_key::<CowStr<'de>>()? {
                    let slot = match &*name {
                        "index" => &mut index,
                        "count" => &mut count,
                        _ => {
                            map.next_value::<IgnoredAny>()?;
                            continue;
                        }
                    };
                    if slot.is_some() {
                        return Err(de::Error::custom(format_args!("duplicate field `{name}`")));
                    }
                    *slot = Some(map.next_value::<u32>()?);
                }
                Ok(WirePart {
                    index: index.ok_or_else(|| de::Error::missing_field("index"))?,
                    count: count.ok_or_else(|| de::Error::missing_field("count"))?,
                })
            }
        }
        d.deserialize_map(V)
    }
}

/// The upload fields a payload may carry (SEMANTICS §2), in [`Wire`]'s order.
const UPLOAD_FIELDS: [&str; 6] = [
    "tenant",
    "session",
    "event_id",
    "part",
    "final",
    "attributes",
];

/// One member value of a plain JSON object ([`plain_object`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlainValue<'a> {
    /// A string without escapes (its contents).
    Str(&'a str),
    /// An integer: `-?(0|[1-9][0-9]*)` (its text).
    Int(&'a str),
    /// `true` or `false`.
    Bool(bool),
    /// `null`.
    Null,
}

/// Walks a *plain* JSON object, the shape nearly every upload and trace line has, without
/// serde: `{`, members separated by commas, `}`, with JSON whitespace anywhere between
/// tokens and nothing after; each member a name and a value that is a string without
/// escapes or control characters, an integer (no fraction, exponent or leading zero, at
/// most 19 digits), `true`, `false` or `null`. Calls `member(name, value)` for each member in order; it
/// returns `false` to give up. Returns `false` when the text is not of that shape or
/// `member` gave up: the caller then parses it with serde_json, which also says what is
/// wrong. A text of that shape is valid JSON, and serde_json reads the same members from it.
pub fn plain_object<'a>(
    text: &'a str,
    mut member: impl FnMut(&'a str, PlainValue<'a>) -> bool,
) -> bool {
    let b = text.as_bytes();
    let mut i = 0;
    let ws = |i: &mut usize| {
        while b
            .get(*i)
            .is_some_and(|c| matches!(c, b' ' | b'\t' | b'\n' | b'\r'))
        {
            *i += 1;
        }
    };
    // A string without escapes or control characters at `*i`: its contents. (The text is
    // UTF-8 and `"` is ASCII, so the contents are whole characters.)
    let string = |i: &mut usize| -> Option<&'a str> {
        if b.get(*i) != Some(&b'"') {
            return None;
        }
        let start = *i + 1;
        let len = b[start..]
            .iter()
            .position(|&c| c == b'"' || c == b'\\' || c < 0x20)?;
        if b[start + len] != b'"' {
            return None;
        }
        *i = start + len + 1;
        Some(&text[start..start + len])
    };
    ws(&mut i);
    if b.get(i) != Some(&b'{') {
        return false;
    }
    i += 1;
    ws(&mut i);
    if b.get(i) == Some(&b'}') {
        i += 1;
    } else {
        loop {
            ws(&mut i);
            let Some(name) = string(&mut i) else {
                return false;
            };
            ws(&mut i);
            if b.get(i) != Some(&b':') {
                return false;
            }
            i += 1;
            ws(&mut i);
            let value = match b.get(i) {
                Some(b'"') => match string(&mut i) {
                    Some(v) => PlainValue::Str(v),
                    None => return false,
                },
                Some(b'-' | b'0'..=b'9') => {
                    let start = i;
                    i += usize::from(b[i] == b'-');
                    let digits = b[i..].iter().take_while(|c| c.is_ascii_digit()).count();
                    // (More than 19 digits: left to serde_json, which reads a huge integer
                    // as a double and refuses one beyond its range.)
                    if digits == 0 || digits > 19 || (digits > 1 && b[i] == b'0') {
                        return false;
                    }
                    i += digits;
                    if matches!(b.get(i), Some(b'.' | b'e' | b'E')) {
                        return false;
                    }
                    PlainValue::Int(&text[start..i])
                }
                _ => {
                    let rest = &b[i..];
                    let (v, n) = if rest.starts_with(b"true") {
                        (PlainValue::Bool(true), 4)
                    } else if rest.starts_with(b"false") {
                        (PlainValue::Bool(false), 5)
                    } else if rest.starts_with(b"null") {
                        (PlainValue::Null, 4)
                    } else {
                        return false;
                    };
                    i += n;
                    v
                }
            };
            if !member(name, value) {
                return false;
            }
            ws(&mut i);
            match b.get(i) {
                Some(b',') => i += 1,
                Some(b'}') => {
                    i += 1;
                    break;
                }
                _ => return false,
            }
        }
    }
    ws(&mut i);
    i == b.len()
}

/// [`parse_wire`] for a plain object ([`plain_object`]) whose upload fields are of their
/// types (`tenant`, `session` strings; `event_id` a string or null; `final` a bool or null),
/// each at most once, without `part` or `attributes`: the same [`Wire`] serde's pass gives.
/// `None` for any other payload (serde's pass then reads it, and says what is wrong).
fn plain_wire(text: &str) -> Option<Wire<'_>> {
    let mut w = Wire::default();
    let mut seen = [false; 6];
    let plain = plain_object(text, |name, value| {
        let Some(i) = UPLOAD_FIELDS.iter().position(|n| *n == name) else {
            return true;
        };
        if std::mem::replace(&mut seen[i], true) {
            return false;
        }
        match (i, value) {
            (0, PlainValue::Str(v)) => w.tenant = Some(Cow::Borrowed(v)),
            (1, PlainValue::Str(v)) => w.session = Some(Cow::Borrowed(v)),
            (2, PlainValue::Str(v)) => w.event_id = Some(Cow::Borrowed(v)),
            (4, PlainValue::Bool(v)) => w.final_flag = Some(v),
            (2 | 4, PlainValue::Null) => {}
            _ => return false,
        }
        true
    });
    plain.then_some(w)
}

/// Parses the object once (the caller checked the payload is UTF-8 as a whole, one fast pass,
/// so the JSON parser need not re-check every string). A field-level fault (wrong type,
/// duplicate) is recorded in `fault` by the visitor, which then aborts the parse with a serde
/// "data" error. With `trace`, the top-level `ts` and `partition` are captured as raw JSON in
/// the same pass.
fn parse_wire<'de>(
    text: &'de str,
    trace: Option<&mut TraceFields<'de>>,
) -> Result<Wire<'de>, DecodeError> {
    let mut fault = None;
    let mut de = serde_json::Deserializer::from_str(text);
    let parsed = UploadSeed {
        fault: &mut fault,
        trace,
    }
    .deserialize(&mut de)
    .and_then(|wire| de.end().map(|()| wire));
    match parsed {
        Ok(wire) => Ok(wire),
        Err(e) => Err(classify_failure(text, e, fault)),
    }
}

/// Error path only: decides which rule a failed parse broke. A fault seen by the visitor is
/// reported only if the whole payload is valid JSON (syntax errors win).
fn classify_failure(text: &str, e: serde_json::Error, fault: Option<DecodeError>) -> DecodeError {
    if !e.is_data() {
        return DecodeError::InvalidJson(e.to_string());
    }
    if let Err(syntax) = serde_json::from_str::<IgnoredAny>(text) {
        return DecodeError::InvalidJson(syntax.to_string());
    }
    fault.unwrap_or(DecodeError::NotAnObject)
}

struct UploadSeed<'a, 'de> {
    fault: &'a mut Option<DecodeError>,
    trace: Option<&'a mut TraceFields<'de>>,
}

impl<'de> DeserializeSeed<'de> for UploadSeed<'_, 'de> {
    type Value = Wire<'de>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Wire<'de>, D::Error> {
        d.deserialize_map(self)
    }
}

/// Reads the next value as `T`; on a failure records `fault` for [`classify_failure`].
fn field<'de, T: Deserialize<'de>, A: MapAccess<'de>>(
    map: &mut A,
    fault: &mut Option<DecodeError>,
    on_error: DecodeError,
) -> Result<T, A::Error> {
    map.next_value::<T>()
        .inspect_err(|_| *fault = Some(on_error))
}

impl<'de> Visitor<'de> for UploadSeed<'_, 'de> {
    type Value = Wire<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an upload record (JSON object)")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Wire<'de>, A::Error> {
        const NAMES: [&str; 6] = UPLOAD_FIELDS;
        let (fault, mut trace) = (self.fault, self.trace);
        let mut w = Wire::default();
        let mut seen = [false; 6];
        while let Some(CowStr(name)) = map.next_key::<CowStr<'de>>()? {
            let Some(i) = NAMES.iter().position(|n| *n == name) else {
                let slot = match (&mut trace, &*name) {
                    (Some(t), "ts") => &mut t.ts,
                    (Some(t), "partition") => &mut t.partition,
                    _ => {
                        map.next_value::<IgnoredAny>()?;
                        continue;
                    }
                };
                let raw: &'de RawValue = map.next_value()?;
                if slot.replace(raw).is_some() {
                    // A repeated trace field: left to the slow path to report.
                    return Err(de::Error::custom("duplicate trace field"));
                }
                continue;
            };
            if std::mem::replace(&mut seen[i], true) {
                *fault = Some(DecodeError::DuplicateField(NAMES[i]));
                return Err(de::Error::custom("duplicate field"));
            }
            match i {
                0 => {
                    let CowStr(v) = field(&mut map, fault, DecodeError::TenantNotString)?;
                    w.tenant = Some(v);
                }
                1 => {
                    let CowStr(v) = field(&mut map, fault, DecodeError::SessionNotString)?;
                    w.session = Some(v);
                }
                2 => {
                    let v: Option<CowStr> = field(&mut map, fault, DecodeError::EventIdNotString)?;
                    w.event_id = v.map(|CowStr(s)| s);
                }
                3 => {
                    // The part's own error message says what is wrong inside it.
                    w.part = map.next_value().inspect_err(|e| {
                        *fault = Some(DecodeError::BadPart(strip_position(e)));
                    })?;
                }
                4 => w.final_flag = field(&mut map, fault, DecodeError::FinalNotBool)?,
                _ => {
                    let raw: &'de RawValue =
                        field(&mut map, fault, DecodeError::AttributesNotObject)?;
                    w.attributes = Some(raw);
                }
            }
        }
        Ok(w)
    }
}

/// Whether JSON text nests objects and arrays deeper than `limit` levels, found in one pass
/// without recursion, so any depth is safe to check. String contents are skipped by their
/// quotes and escapes. (The parser skips and captures values without recursing, so a payload
/// is read whatever its depth before this check.)
#[cfg(test)]
fn too_deep(text: &str, limit: usize) -> bool {
    matches!(scan_json(text, limit), Err(Scan::TooDeep))
}

/// What [`scan_json`] found wrong.
#[derive(Debug, PartialEq, Eq)]
enum Scan {
    /// Nested deeper than the limit.
    TooDeep,
    /// A `\uXXXX` escape of a UTF-16 surrogate without its other half (the code unit).
    /// serde_json and other strict parsers reject such text; it names no character.
    LoneSurrogate(u16),
    /// A number beyond the range of a double (`1e400`, or an integer of more than 308
    /// digits): serde_json refuses to parse it into a value ("number out of range").
    NumberOutOfRange(String),
}

/// One pass over JSON text already known to be well-formed apart from escapes (captured by
/// serde_json as a raw value, which does not check that `\u` surrogates pair up): the
/// nesting depth against `limit`, every `\u` escape, and that every number fits a double
/// (found by fuzzing: `{"a":5e308}` was accepted and emitted, and serde_json consumers cannot
/// parse the ready record). No recursion.
fn scan_json(text: &str, limit: usize) -> Result<(), Scan> {
    let b = text.as_bytes();
    let hex = |at: usize| -> Option<u16> {
        let digits = b.get(at..at + 4)?;
        u16::from_str_radix(std::str::from_utf8(digits).ok()?, 16).ok()
    };
    let (mut depth, mut in_string, mut i) = (0_usize, false, 0);
    while i < b.len() {
        let c = b[i];
        i += 1;
        if in_string {
            match c {
                b'"' => in_string = false,
                b'\\' if b.get(i) == Some(&b'u') => {
                    let unit = hex(i + 1).unwrap_or(0);
                    i += 5;
                    match unit {
                        0xD800..=0xDBFF => {
                            let low = (b.get(i) == Some(&b'\\') && b.get(i + 1) == Some(&b'u'))
                                .then(|| hex(i + 2))
                                .flatten();
                            match low {
                                Some(0xDC00..=0xDFFF) => i += 6,
                                _ => return Err(Scan::LoneSurrogate(unit)),
                            }
                        }
                        0xDC00..=0xDFFF => return Err(Scan::LoneSurrogate(unit)),
                        _ => {}
                    }
                }
                b'\\' => i += 1,
                _ => {}
            }
            continue;
        }
        match c {
            b'"' => in_string = true,
            b'{' | b'[' => {
                depth += 1;
                if depth > limit {
                    return Err(Scan::TooDeep);
                }
            }
            b'}' | b']' => depth = depth.saturating_sub(1),
            b'-' | b'0'..=b'9' => {
                let start = i - 1;
                while i < b.len() && matches!(b[i], b'0'..=b'9' | b'.' | b'e' | b'E' | b'+' | b'-')
                {
                    i += 1;
                }
                let number = &text[start..i];
                // Only an exponent or a very long literal can leave a double's range.
                let suspect = number.len() > 300 || number.bytes().any(|c| c == b'e' || c == b'E');
                if suspect && !number.parse::<f64>().is_ok_and(f64::is_finite) {
                    let shown: String = number.chars().take(40).collect();
                    return Err(Scan::NumberOutOfRange(shown));
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// A serde error's message without the " at line L column C" suffix.
fn strip_position(e: &impl fmt::Display) -> String {
    let s = e.to_string();
    match s.rfind(" at line ") {
        Some(i) => s[..i].to_owned(),
        None => s,
    }
}

/// A string borrowed from the payload when it has no escapes, owned otherwise.
struct CowStr<'de>(Cow<'de, str>);

impl<'de> Deserialize<'de> for CowStr<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = CowStr<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<CowStr<'de>, E> {
                Ok(CowStr(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<CowStr<'de>, E> {
                Ok(CowStr(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<CowStr<'de>, E> {
                Ok(CowStr(Cow::Owned(v)))
            }
        }
        d.deserialize_str(V)
    }
}

// ---------------------------------------------------------------------------------------------
// Output record

/// The "session ready" output record (SEMANTICS §2), exactly its fields, in wire order.
/// Instants are `Millis` here and RFC 3339 UTC strings with milliseconds on the wire.
/// `last_event_id`, `attributes`, `event_ids` and `event_ids_dropped` are omitted from the
/// JSON when `None` (the last two come together, only when the round's rule keeps event ids).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReadyRecord {
    /// Tenant of the session key.
    pub tenant: String,
    /// Session of the session key.
    pub session: String,
    /// `tenant/session/state_created_at/generation` (`Emission::emission_id`): the consumers'
    /// de-duplication id.
    pub emission_id: String,
    /// 1 for the first emission of a key's state, +1 for each next one.
    pub generation: u64,
    /// Why it was emitted (`leading`, `trailing`, `max_wait`, `complete`, `final`).
    pub trigger: Trigger,
    /// Uploads coalesced into this emission.
    pub uploads: u32,
    /// Event time of the first coalesced upload (ms; RFC 3339 on the wire).
    #[serde(with = "rfc3339_ms")]
    pub first_upload_at: Millis,
    /// Event time of the last coalesced upload (ms; RFC 3339 on the wire).
    #[serde(with = "rfc3339_ms")]
    pub last_upload_at: Millis,
    /// When the policy made it due (ms; RFC 3339 on the wire).
    #[serde(with = "rfc3339_ms")]
    pub due_at: Millis,
    /// When it was actually sent (ms; RFC 3339 on the wire).
    #[serde(with = "rfc3339_ms")]
    pub emitted_at: Millis,
    /// Debounce delay in force when it was due (ms).
    pub delay_ms: Millis,
    /// Policy name (`fixed`, `leading-trailing`, `adaptive`).
    pub policy: PolicyName,
    /// The tenant's tier at emission time.
    pub tier: String,
    /// `event_id` of the last coalesced upload.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_event_id: Option<String>,
    /// `attributes` of the last coalesced upload: JSON object text, embedded as an object.
    #[serde(default, skip_serializing_if = "Option::is_none", with = "raw_json")]
    pub attributes: Option<String>,
    /// `event_ids`: the `event_id`s of the round's uploads in the order applied, the first
    /// `event-ids = N` of them (SEMANTICS §2); only when the round's rule keeps event ids.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub event_ids: Option<Vec<String>>,
    /// `event_ids_dropped`: how many more ids the round had than `event_ids` lists; present
    /// exactly when `event_ids` is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub event_ids_dropped: Option<u32>,
}

impl ReadyRecord {
    /// The record for `em`, sent at `emitted_at` (ms) to `tier`'s topic.
    ///
    /// `attributes` text that is not a JSON object nested at most [`ATTRIBUTES_MAX_DEPTH`]
    /// levels is left out; it cannot happen for uploads that went through [`decode_upload`]
    /// (the engine carries the text unchanged).
    pub fn from_emission(em: &Emission, emitted_at: Millis, tier: &str) -> Self {
        ReadyRecord {
            tenant: em.key.tenant().to_owned(),
            session: em.key.session().to_owned(),
            emission_id: em.emission_id(),
            generation: em.generation,
            trigger: em.trigger,
            uploads: em.uploads,
            first_upload_at: em.first_upload_at,
            last_upload_at: em.last_upload_at,
            due_at: em.due_at,
            emitted_at,
            delay_ms: em.delay_ms,
            policy: em.policy,
            tier: tier.to_owned(),
            last_event_id: em.last_event_id.clone(),
            attributes: em.attributes.clone().filter(|t| json_object(t).is_some()),
            event_ids: em
                .event_ids
                .as_ref()
                .map(|ids| ids.iter().map(str::to_owned).collect()),
            event_ids_dropped: em.event_ids.as_ref().map(|ids| ids.dropped()),
        }
    }

    /// `tenant/session`.
    pub fn key(&self) -> SessionKey {
        SessionKey::new(&self.tenant, &self.session)
    }

    /// `state_created_at` of the emission, read from `emission_id`; `None` when the id is not
    /// `tenant/session/<integer>/generation` (which [`decode_ready`] refuses).
    pub fn state_created_at(&self) -> Option<Millis> {
        let rest = self
            .emission_id
            .strip_prefix(self.tenant.as_str())?
            .strip_prefix('/')?
            .strip_prefix(self.session.as_str())?
            .strip_prefix('/')?;
        let (created, generation) = rest.split_once('/')?;
        // Exactly as settle writes them: no sign, no leading zero, the record's generation.
        let at: Millis = created.parse().ok()?;
        let written = itoa::Buffer::new().format(at) == created
            && itoa::Buffer::new().format(self.generation) == generation;
        written.then_some(at)
    }

    /// The engine emission this record was made from (drops `emitted_at` and `tier`;
    /// `state_created_at` from [`ReadyRecord::state_created_at`], 0 if the id has none).
    pub fn emission(&self) -> Emission {
        Emission {
            key: self.key(),
            state_created_at: self.state_created_at().unwrap_or(0),
            generation: self.generation,
            trigger: self.trigger,
            uploads: self.uploads,
            first_upload_at: self.first_upload_at,
            last_upload_at: self.last_upload_at,
            due_at: self.due_at,
            delay_ms: self.delay_ms,
            policy: self.policy,
            last_event_id: self.last_event_id.clone(),
            attributes: self.attributes.clone(),
            event_ids: self.event_ids.as_ref().map(|listed| {
                let mut ids = EventIds::default();
                let cap = u32::try_from(listed.len()).unwrap_or(u32::MAX);
                for id in listed {
                    ids.push(id, cap);
                }
                ids.add_dropped(self.event_ids_dropped.unwrap_or(0));
                Box::new(ids)
            }),
        }
    }
}

/// `text` as a JSON value if it may be `attributes` on the wire: a JSON object nested at most
/// [`ATTRIBUTES_MAX_DEPTH`] levels (what [`decode_upload`] lets through).
fn json_object(text: &str) -> Option<&RawValue> {
    if !text.starts_with('{') || scan_json(text, ATTRIBUTES_MAX_DEPTH).is_err() {
        return None;
    }
    serde_json::from_str::<&RawValue>(text).ok()
}

/// Encodes the output record of `em` (SEMANTICS §2) as JSON bytes: sent at `emitted_at` (ms)
/// to tier `tier`. The record key is `em.key`, the [`EMISSION_ID_HEADER`] value
/// `em.emission_id()`. See [`encode_ready_into`].
pub fn encode_ready(em: &Emission, emitted_at: Millis, tier: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(READY_RECORD_CAPACITY);
    encode_ready_into(em, emitted_at, tier, &mut out);
    out
}

/// Typical size (bytes) of a ready record without attributes: the first allocation.
const READY_RECORD_CAPACITY: usize = 384;

/// Appends the JSON output record of `em` (what [`encode_ready`] returns) to `out`.
///
/// The bytes are those of serializing [`ReadyRecord::from_emission`] with `serde_json` (wire
/// order of the spec table, no whitespace), written field by field: strings escaped by
/// `serde_json` only when they need it, integers with `itoa`, instants with
/// [`write_rfc3339_ms`], `attributes` as their JSON text (left out unless they are a JSON
/// object, as in [`ReadyRecord::from_emission`]). No `fmt` machinery, no allocation beyond
/// `out`'s growth.
pub fn encode_ready_into(em: &Emission, emitted_at: Millis, tier: &str, out: &mut Vec<u8>) {
    let mut n = itoa::Buffer::new();
    out.extend_from_slice(br#"{"tenant":"#);
    push_json_str(out, em.key.tenant());
    out.extend_from_slice(br#","session":"#);
    push_json_str(out, em.key.session());
    out.extend_from_slice(br#","emission_id":"#);
    // `Emission::emission_id` without building it: the escaped key, then the rest of the id
    // (digits and `/`, which JSON never escapes) before the closing quote.
    push_json_str(out, em.key.as_str());
    out.pop();
    out.push(b'/');
    out.extend_from_slice(n.format(em.state_created_at).as_bytes());
    out.push(b'/');
    out.extend_from_slice(n.format(em.generation).as_bytes());
    out.push(b'"');
    out.extend_from_slice(br#","generation":"#);
    out.extend_from_slice(n.format(em.generation).as_bytes());
    out.extend_from_slice(br#","trigger":""#);
    out.extend_from_slice(em.trigger.as_str().as_bytes());
    out.extend_from_slice(br#"","uploads":"#);
    out.extend_from_slice(n.format(em.uploads).as_bytes());
    for (name, at) in [
        (&br#","first_upload_at":""#[..], em.first_upload_at),
        (br#"","last_upload_at":""#, em.last_upload_at),
        (br#"","due_at":""#, em.due_at),
        (br#"","emitted_at":""#, emitted_at),
    ] {
        out.extend_from_slice(name);
        write_rfc3339_ms(at, out);
    }
    out.extend_from_slice(br#"","delay_ms":"#);
    out.extend_from_slice(n.format(em.delay_ms).as_bytes());
    out.extend_from_slice(br#","policy":""#);
    out.extend_from_slice(em.policy.as_str().as_bytes());
    out.extend_from_slice(br#"","tier":"#);
    push_json_str(out, tier);
    if let Some(id) = &em.last_event_id {
        out.extend_from_slice(br#","last_event_id":"#);
        push_json_str(out, id);
    }
    if let Some(raw) = em.attributes.as_deref().and_then(json_object) {
        out.extend_from_slice(br#","attributes":"#);
        out.extend_from_slice(raw.get().as_bytes());
    }
    if let Some(ids) = &em.event_ids {
        out.extend_from_slice(br#","event_ids":["#);
        for (i, id) in ids.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            push_json_str(out, id);
        }
        out.extend_from_slice(br#"],"event_ids_dropped":"#);
        out.extend_from_slice(n.format(ids.dropped()).as_bytes());
    }
    out.push(b'}');
}

/// Appends `s` as a JSON string, byte for byte as `serde_json` writes it: copied between
/// quotes when nothing in it needs an escape (the common case), else through `serde_json`.
fn push_json_str(out: &mut Vec<u8>, s: &str) {
    if s.bytes().all(|b| b >= 0x20 && b != b'"' && b != b'\\') {
        out.push(b'"');
        out.extend_from_slice(s.as_bytes());
        out.push(b'"');
    } else {
        // Invariant: serializing a `str` into a `Vec` cannot fail (`Vec`'s `io::Write` never
        // errors and every `str` is valid JSON string content once escaped).
        let _ = serde::Serializer::serialize_str(&mut serde_json::Serializer::new(&mut *out), s);
    }
}

/// Decodes an output record (for tests and tools). Strict: unknown fields, missing required
/// fields, timestamps that are not RFC 3339 strings, an `emission_id` other than
/// `tenant/session/state_created_at/generation`, and `event_ids` without
/// `event_ids_dropped` (or the reverse) are errors.
pub fn decode_ready(bytes: &[u8]) -> Result<ReadyRecord, serde_json::Error> {
    let record: ReadyRecord = serde_json::from_slice(bytes)?;
    if record.state_created_at().is_none() {
        return Err(de::Error::custom(format_args!(
            "emission_id {:?} is not tenant/session/state_created_at/generation",
            record.emission_id
        )));
    }
    if record.event_ids.is_some() != record.event_ids_dropped.is_some() {
        return Err(de::Error::custom(
            "event_ids and event_ids_dropped come together",
        ));
    }
    Ok(record)
}

/// serde for `Option<String>` holding JSON text: embedded as raw JSON, read back as text.
mod raw_json {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};
    use serde_json::value::RawValue;

    pub fn serialize<S: Serializer>(v: &Option<String>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            None => s.serialize_none(),
            Some(text) => serde_json::from_str::<&RawValue>(text)
                .map_err(serde::ser::Error::custom)?
                .serialize(s),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
        let raw = Option::<Box<RawValue>>::deserialize(d)?;
        Ok(raw.map(|r| r.get().to_owned()))
    }
}

/// serde for `Millis` as an RFC 3339 string with milliseconds.
mod rfc3339_ms {
    use super::{format_rfc3339_ms, parse_rfc3339_ms, Millis};
    use serde::{Deserialize, Deserializer, Serializer};
    use std::borrow::Cow;

    pub fn serialize<S: Serializer>(v: &Millis, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format_rfc3339_ms(*v))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Millis, D::Error> {
        let text = Cow::<str>::deserialize(d)?;
        parse_rfc3339_ms(&text).map_err(serde::de::Error::custom)
    }
}

// ---------------------------------------------------------------------------------------------
// Time

/// `0000-01-01T00:00:00.000Z` in ms: the earliest instant RFC 3339 can write.
pub const RFC3339_MIN_MS: Millis = -62_167_219_200_000;
/// `9999-12-31T23:59:59.999Z` in ms: the latest instant RFC 3339 can write.
pub const RFC3339_MAX_MS: Millis = 253_402_300_799_999;

/// Why a timestamp could not be read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TimeError {
    /// Neither an integer nor a string (names the JSON type found).
    #[error("timestamp must be epoch milliseconds (integer) or an RFC 3339 string, got {0}")]
    WrongType(&'static str),
    /// An integer outside `i64`, or a number with a fraction.
    #[error("timestamp {0} is not an integer number of milliseconds within i64")]
    NotMillis(String),
    /// A string that is not RFC 3339.
    #[error("timestamp {text:?} is not RFC 3339: {message}")]
    NotRfc3339 {
        /// The text given.
        text: String,
        /// What the parser said.
        message: String,
    },
}

/// Bytes of an instant as [`write_rfc3339_ms`] writes it: `YYYY-MM-DDTHH:MM:SS.mmmZ`.
pub const RFC3339_MS_LEN: usize = 24;

/// Formats an instant (ms since the epoch) as RFC 3339 UTC with exactly three fraction digits,
/// e.g. `2026-11-30T03:34:47.123Z`. Instants outside years 0000–9999 are clamped to
/// [`RFC3339_MIN_MS`]..=[`RFC3339_MAX_MS`] (RFC 3339 has four-digit years).
pub fn format_rfc3339_ms(ms: Millis) -> String {
    // Every byte is ASCII (a digit or one of `-T:.Z`), so each is one char.
    rfc3339_ms_bytes(ms).into_iter().map(char::from).collect()
}

/// Appends [`format_rfc3339_ms`]`(ms)` to `out` ([`RFC3339_MS_LEN`] bytes) without allocating
/// or going through `fmt`: the hot path of [`encode_ready_into`].
pub fn write_rfc3339_ms(ms: Millis, out: &mut Vec<u8>) {
    out.extend_from_slice(&rfc3339_ms_bytes(ms));
}

/// The RFC 3339 text of `ms` (clamped as in [`format_rfc3339_ms`]), digits written directly:
/// days since the epoch → civil date with Howard Hinnant's `civil_from_days` (proleptic
/// Gregorian calendar, exact for every year), time of day by division.
fn rfc3339_ms_bytes(ms: Millis) -> [u8; RFC3339_MS_LEN] {
    thread_local! {
        /// The day last written and its `YYYY-MM-DD` (records of one run share a few days).
        static LAST_DAY: std::cell::Cell<(i64, [u8; 10])> =
            const { std::cell::Cell::new((i64::MIN, [0; 10])) };
    }
    let ms = ms.clamp(RFC3339_MIN_MS, RFC3339_MAX_MS);
    let (secs, milli) = (ms.div_euclid(1000), ms.rem_euclid(1000));
    let (days, sod) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let mut b = *b"0000-00-00T00:00:00.000Z";
    let date = LAST_DAY.with(|last| match last.get() {
        (d, date) if d == days => date,
        _ => {
            let (year, month, day) = civil_from_days(days);
            let mut date = *b"0000-00-00";
            // The clamp keeps the year in 0..=9999 and every other field within its digits.
            put2(&mut date[0..2], year / 100);
            put2(&mut date[2..4], year % 100);
            put2(&mut date[5..7], month);
            put2(&mut date[8..10], day);
            last.set((days, date));
            date
        }
    });
    b[..10].copy_from_slice(&date);
    put2(&mut b[11..13], sod / 3600);
    put2(&mut b[14..16], sod / 60 % 60);
    put2(&mut b[17..19], sod % 60);
    b[20] = b'0' + (milli / 100) as u8;
    put2(&mut b[21..23], milli % 100);
    b
}

/// `"00" "01" … "99"`: two digits per table entry.
const DIGIT_PAIRS: &[u8; 200] = b"\
0001020304050607080910111213141516171819202122232425262728293031323334353637383940414243444546474849\
5051525354555657585960616263646566676869707172737475767778798081828384858687888990919293949596979899";

/// Writes `v` (0..=99) as two digits into `slot` (two bytes).
fn put2(slot: &mut [u8], v: i64) {
    let i = (v as usize % 100) * 2;
    slot.copy_from_slice(&DIGIT_PAIRS[i..i + 2]);
}

/// `(year, month 1..=12, day 1..=31)` of the day `z` days after 1970-01-01 (proleptic
/// Gregorian). <https://howardhinnant.github.io/date_algorithms.html#civil_from_days>
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097); // day of era, 0..=146096
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365; // year of era, 0..=399
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100); // day of year from March 1st, 0..=365
    let mp = (5 * doy + 2) / 153; // month from March, 0..=11
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// Parses an RFC 3339 timestamp (any offset, any fraction length) into ms since the epoch.
/// Sub-millisecond digits are truncated toward the past.
///
/// Errors: [`TimeError::NotRfc3339`].
pub fn parse_rfc3339_ms(text: &str) -> Result<Millis, TimeError> {
    let t = time::OffsetDateTime::parse(text, &time::format_description::well_known::Rfc3339)
        .map_err(|e| TimeError::NotRfc3339 {
            text: text.to_owned(),
            message: e.to_string(),
        })?;
    // |years| ≤ 9999 keeps the ms value far inside i64.
    Ok(t.unix_timestamp_nanos().div_euclid(1_000_000) as Millis)
}

/// Reads a timestamp given in JSON as epoch milliseconds (an integer) or an RFC 3339 string
/// (used for trace lines' `"ts"` and admin inputs).
///
/// Errors: [`TimeError::WrongType`] (null, bool, array, object), [`TimeError::NotMillis`]
/// (fraction or out of `i64`), [`TimeError::NotRfc3339`].
pub fn parse_timestamp(v: &serde_json::Value) -> Result<Millis, TimeError> {
    use serde_json::Value;
    match v {
        Value::Number(n) => n
            .as_i64()
            .ok_or_else(|| TimeError::NotMillis(n.to_string())),
        Value::String(s) => parse_rfc3339_ms(s),
        Value::Null => Err(TimeError::WrongType("null")),
        Value::Bool(_) => Err(TimeError::WrongType("a boolean")),
        Value::Array(_) => Err(TimeError::WrongType("an array")),
        Value::Object(_) => Err(TimeError::WrongType("an object")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::PolicyName;
    use proptest::prelude::{any, Strategy};

    const NOW: Millis = 1_800_000_000_000;

    /// The record key of a payload: `tenant/session` when both are strings (any key will do
    /// for payloads that break a rule of their own: those are reported first).
    fn key_of(payload: &str) -> String {
        let v: serde_json::Value = serde_json::from_str(payload).unwrap_or_default();
        match (v["tenant"].as_str(), v["session"].as_str()) {
            (Some(t), Some(s)) => format!("{t}/{s}"),
            _ => "x/y".into(),
        }
    }

    fn decode(payload: &str) -> Result<Upload, DecodeError> {
        let key = key_of(payload);
        decode_upload(Some(key.as_bytes()), payload.as_bytes(), NOW, NOW)
    }

    /// `attributes` nested `levels` deep: an object of arrays, `{"a":[[…[1]…]]}` (2 bytes a
    /// level, so 5 000 levels fit in 16 KiB, as in the issue).
    fn nested(levels: usize) -> String {
        let inner = levels.saturating_sub(1);
        format!(r#"{{"a":{}1{}}}"#, "[".repeat(inner), "]".repeat(inner))
    }

    fn with_attributes(attributes: &str) -> String {
        format!(r#"{{"tenant":"a","session":"s","attributes":{attributes}}}"#)
    }

    fn reason(payload: &str) -> &'static str {
        match decode(payload) {
            Ok(u) => panic!("expected an error for {payload}, decoded {u:?}"),
            Err(e) => e.reason(),
        }
    }

    #[test]
    fn minimal_upload() {
        let u = decode(r#"{"tenant":"acme","session":"s1"}"#).unwrap();
        assert_eq!(u, Upload::plain(SessionKey::new("acme", "s1"), NOW));
    }

    #[test]
    fn full_upload_keeps_every_field() {
        let u = decode(
            r#"{"tenant":"acme.ci:eu-1_x","session":"run/42","event_id":"e-7",
                "part":{"index":2,"count":3},"final":true,
                "attributes": {"branch":"main","n":[1,2]},"other":{"ignored":[1,{}]}}"#,
        )
        .unwrap();
        assert_eq!(u.key.tenant(), "acme.ci:eu-1_x");
        assert_eq!(u.key.session(), "run/42");
        assert_eq!(u.event_id.as_deref(), Some("e-7"));
        assert_eq!(u.part, Some(Part { index: 2, count: 3 }));
        assert!(u.final_flag);
        assert_eq!(
            u.attributes.as_deref(),
            Some(r#"{"branch":"main","n":[1,2]}"#)
        );
    }

    #[test]
    fn nulls_mean_absent_for_optional_fields() {
        let u = decode(
            r#"{"tenant":"a","session":"s","event_id":null,"part":null,"final":null,"attributes":null}"#,
        )
        .unwrap();
        assert_eq!(u, Upload::plain(SessionKey::new("a", "s"), NOW));
        assert_eq!(
            reason(r#"{"tenant":null,"session":"s"}"#),
            "tenant_not_string"
        );
        assert_eq!(
            reason(r#"{"tenant":"a","session":null}"#),
            "session_not_string"
        );
    }

    #[test]
    fn final_false_and_trace_fields_are_fine() {
        let u = decode(r#"{"ts":"2026-01-01T00:00:00Z","partition":3,"tenant":"a","session":"s","final":false}"#)
            .unwrap();
        assert!(!u.final_flag);
        assert_eq!(u.key.as_str(), "a/s");
    }

    #[test]
    fn event_time_is_capped_at_the_wall_clock() {
        let p = br#"{"tenant":"a","session":"s"}"#;
        let key = Some(&b"a/s"[..]);
        assert_eq!(decode_upload(key, p, 1000, 5000).unwrap().event_time, 1000);
        assert_eq!(decode_upload(key, p, 9000, 5000).unwrap().event_time, 5000);
    }

    #[test]
    fn payload_must_be_utf8_json_object() {
        assert_eq!(
            decode_upload(None, b"{\"tenant\":\"a\xff\",\"session\":\"s\"}", 0, 0)
                .unwrap_err()
                .reason(),
            "invalid_utf8"
        );
        assert_eq!(
            decode_upload(None, b"\xfe\xff", 0, 0).unwrap_err().reason(),
            "invalid_utf8"
        );
        assert_eq!(reason(""), "invalid_json");
        assert_eq!(reason("{"), "invalid_json");
        assert_eq!(reason(r#"{"tenant":"a","session":"s"} x"#), "invalid_json");
        assert_eq!(reason(r#"{"tenant":"a","session":"s",}"#), "invalid_json");
        for not_object in [r#"[1]"#, r#""x""#, "42", "null", "true"] {
            assert_eq!(reason(not_object), "not_an_object", "{not_object}");
        }
    }

    #[test]
    fn syntax_errors_win_over_field_faults() {
        // The bad `final` is seen first, but the record is not JSON at all.
        assert_eq!(
            reason(r#"{"final":"yes","tenant":"a" "session":"s"}"#),
            "invalid_json"
        );
        assert_eq!(reason(r#"{"final":"yes""#), "invalid_json");
        assert_eq!(reason(r#"{"final":tru}"#), "invalid_json");
        assert_eq!(reason(r#"{"final":"yes"}"#), "final_not_bool");
    }

    #[test]
    fn duplicate_known_fields_are_rejected_unknown_ones_ignored() {
        assert_eq!(
            decode(r#"{"tenant":"a","tenant":"b","session":"s"}"#),
            Err(DecodeError::DuplicateField("tenant"))
        );
        assert_eq!(
            reason(r#"{"tenant":"a","session":"s","final":null,"final":true}"#),
            "duplicate_field"
        );
        assert!(decode(r#"{"x":1,"x":2,"tenant":"a","session":"s"}"#).is_ok());
    }

    /// [`decode_upload`] with serde's pass only (no [`plain_wire`]).
    fn decode_upload_by_serde(
        key: Option<&[u8]>,
        payload: &[u8],
        ts: Millis,
        wall: Millis,
    ) -> Result<Upload, DecodeError> {
        let text = std::str::from_utf8(payload).map_err(|_| DecodeError::InvalidUtf8)?;
        let fields = parse_wire(text, None)?.check()?;
        let key = key.ok_or(DecodeError::MissingKey)?;
        check_record_key(key, &fields.tenant, &fields.session)?;
        Ok(fields.into_upload(ts.min(wall)))
    }

    #[test]
    fn plain_payloads_decode_as_serde_decodes_them() {
        let payloads: &[&str] = &[
            r#"{"tenant":"acme","session":"b-1"}"#,
            r#" { "tenant" : "acme" , "session" : "b-1" , "event_id" : "e" , "final" : true } "#,
            r#"{"tenant":"acme","session":"b-1","event_id":null,"final":null,"x":[1]}"#,
            r#"{"tenant":"acme","session":"b-1","event_id":7}"#,
            r#"{"tenant":"acme","session":"b-1","final":"yes"}"#,
            r#"{"tenant":"acme","session":"b-1","tenant":"acme"}"#,
            r#"{"tenant":"acme","session":"b-1","n":1,"n":2}"#,
            r#"{"tenant":"acme","session":"b-1","part":{"index":1,"count":2}}"#,
            r#"{"tenant":"acme","session":"b-1","attributes":{"a":1}}"#,
            r#"{"tenant":"acme","session":""}"#,
            r#"{"tenant":"","session":"s"}"#,
            r#"{"tenant":"a/b","session":"s"}"#,
            "{\"tenant\":\"acme\",\"session\":\"b\u{1}\"}",
            "{\"tenant\":\"acme\",\"session\":\"b\u{80}\u{e9}\"}",
            r#"{"tenant":"acme","session":"b\u0041"}"#,
            r#"{"tenant":"acme","session":"b-1","big":1e400}"#,
            r#"{"tenant":"acme","session":"b-1","big":123456789012345678901234567890}"#,
            r#"{"tenant":"acme","session":"b-1","n":-0}"#,
            r#"{"tenant":"acme","session":"b-1","n":01}"#,
            r#"{"tenant":"acme","session":"b-1"} x"#,
            r#"{"tenant":"acme","session":"b-1",}"#,
            r#"{"tenant":"acme"}"#,
            r#"{}"#,
            r#"[]"#,
            r#"{"tenant":null,"session":"b-1"}"#,
        ];
        for p in payloads {
            for key in [Some(&b"acme/b-1"[..]), Some(b"other/k"), None] {
                assert_eq!(
                    decode_upload(key, p.as_bytes(), 10, 20),
                    decode_upload_by_serde(key, p.as_bytes(), 10, 20),
                    "{p}"
                );
            }
        }
        assert!(plain_wire(r#"{"tenant":"acme","session":"b-1","ts":1}"#).is_some());
    }

    proptest::proptest! {
        /// Payloads made of plain and not-so-plain pieces decode alike either way.
        #[test]
        fn plain_and_serde_decoding_agree(
            members in proptest::collection::vec(
                (
                    proptest::prop_oneof![
                        proptest::sample::select(UPLOAD_FIELDS.to_vec()).prop_map(str::to_owned),
                        "ts|x|[a-z]{1,2}",
                    ],
                    proptest::prop_oneof![
                        "\"[a-z0-9/ -]{0,5}\"",
                        "-?[0-9]{1,22}",
                        "true|false|null",
                        "[0-9]\\.[0-9]e[0-9]",
                        "\\{\"index\":1,\"count\":2\\}",
                        "\"\\\\u00[0-9a-f]{2}\"",
                    ],
                ),
                0..7,
            ),
            space in " {0,2}",
        ) {
            let body: Vec<String> = members
                .iter()
                .map(|(k, v)| format!("\"{k}\"{space}:{space}{v}"))
                .collect();
            let payload = format!("{space}{{{}}}{space}", body.join(","));
            let key = members
                .iter()
                .find(|(k, _)| k == "tenant")
                .zip(members.iter().find(|(k, _)| k == "session"))
                .map(|((_, t), (_, s))| format!("{}/{}", t.trim_matches('"'), s.trim_matches('"')));
            let key = key.as_deref().map(str::as_bytes);
            proptest::prop_assert_eq!(
                decode_upload(key, payload.as_bytes(), 10, 20),
                decode_upload_by_serde(key, payload.as_bytes(), 10, 20),
                "{}", payload
            );
        }
    }

    #[test]
    fn escaped_field_names_and_values_decode() {
        let u = decode(r#"{"ten\u0061nt":"a\u002Eb","session":"caf\u00e9 \"q\""}"#).unwrap();
        assert_eq!(u.key.tenant(), "a.b");
        assert_eq!(u.key.session(), "café \"q\"");
    }

    #[test]
    fn tenant_rules() {
        assert_eq!(reason(r#"{"session":"s"}"#), "missing_tenant");
        assert_eq!(reason(r#"{"tenant":7,"session":"s"}"#), "tenant_not_string");
        assert_eq!(
            reason(r#"{"tenant":["a"],"session":"s"}"#),
            "tenant_not_string"
        );
        assert_eq!(reason(r#"{"tenant":"","session":"s"}"#), "empty_tenant");
        let t128 = "t".repeat(128);
        assert!(decode(&format!(r#"{{"tenant":"{t128}","session":"s"}}"#)).is_ok());
        let t129 = "t".repeat(129);
        assert_eq!(
            decode(&format!(r#"{{"tenant":"{t129}","session":"s"}}"#)),
            Err(DecodeError::TenantTooLong(129))
        );
        for bad in ["a/b", "a b", "é", "a+b", "a\\u0000"] {
            let got = reason(&format!(r#"{{"tenant":"{bad}","session":"s"}}"#));
            assert_eq!(got, "bad_tenant", "{bad}");
        }
        assert_eq!(
            decode(r#"{"tenant":"ok/no","session":"s"}"#),
            Err(DecodeError::BadTenant('/'))
        );
        assert!(decode(r#"{"tenant":"AZaz09._:-","session":"s"}"#).is_ok());
    }

    #[test]
    fn session_rules() {
        assert_eq!(reason(r#"{"tenant":"a"}"#), "missing_session");
        assert_eq!(
            reason(r#"{"tenant":"a","session":1}"#),
            "session_not_string"
        );
        assert_eq!(
            reason(r#"{"tenant":"a","session":{}}"#),
            "session_not_string"
        );
        assert_eq!(reason(r#"{"tenant":"a","session":""}"#), "empty_session");
        let s256 = "s".repeat(256);
        assert!(decode(&format!(r#"{{"tenant":"a","session":"{s256}"}}"#)).is_ok());
        let s257 = "s".repeat(257);
        assert_eq!(
            decode(&format!(r#"{{"tenant":"a","session":"{s257}"}}"#)),
            Err(DecodeError::SessionTooLong(257))
        );
        // Bytes, not characters: 128 × "é" is 256 bytes, 129 × is 258.
        let e128 = "é".repeat(128);
        assert!(decode(&format!(r#"{{"tenant":"a","session":"{e128}"}}"#)).is_ok());
        let e129 = "é".repeat(129);
        assert_eq!(
            decode(&format!(r#"{{"tenant":"a","session":"{e129}"}}"#)),
            Err(DecodeError::SessionTooLong(258))
        );
        for (text, c) in [
            ("a\\u0000b", '\0'),
            ("a\\nb", '\n'),
            ("a\\tb", '\t'),
            ("a\u{7f}b", '\u{7f}'),
            ("a\u{85}b", '\u{85}'),
            ("a\\u009fb", '\u{9f}'),
        ] {
            assert_eq!(
                decode(&format!(r#"{{"tenant":"a","session":"{text}"}}"#)),
                Err(DecodeError::SessionControlChar(c)),
                "{text}"
            );
        }
        // Unicode that is not a control character is fine, `/` too.
        let u = decode(r#"{"tenant":"a","session":"日本語/テスト 🚀\u00a0x"}"#).unwrap();
        assert_eq!(u.key.session(), "日本語/テスト 🚀\u{a0}x");
        assert_eq!(u.key.tenant(), "a");
    }

    #[test]
    fn event_id_rules() {
        let id128 = "i".repeat(128);
        let u = decode(&format!(
            r#"{{"tenant":"a","session":"s","event_id":"{id128}"}}"#
        ))
        .unwrap();
        assert_eq!(u.event_id.as_deref(), Some(id128.as_str()));
        let id129 = "i".repeat(129);
        assert_eq!(
            decode(&format!(
                r#"{{"tenant":"a","session":"s","event_id":"{id129}"}}"#
            )),
            Err(DecodeError::EventIdTooLong(129))
        );
        // 43 × "€" (3 bytes) = 129 bytes.
        let multi = "€".repeat(43);
        assert_eq!(
            decode(&format!(
                r#"{{"tenant":"a","session":"s","event_id":"{multi}"}}"#
            )),
            Err(DecodeError::EventIdTooLong(129))
        );
        assert_eq!(
            reason(r#"{"tenant":"a","session":"s","event_id":5}"#),
            "event_id_not_string"
        );
        assert_eq!(
            decode(r#"{"tenant":"a","session":"s","event_id":""}"#)
                .unwrap()
                .event_id,
            Some(String::new())
        );
    }

    #[test]
    fn part_rules() {
        let ok = |p: &str| decode(&format!(r#"{{"tenant":"a","session":"s","part":{p}}}"#));
        assert_eq!(
            ok(r#"{"index":1,"count":1}"#).unwrap().part,
            Some(Part { index: 1, count: 1 })
        );
        assert_eq!(
            ok(r#"{"count":4294967295,"index":4294967295,"extra":true}"#)
                .unwrap()
                .part,
            Some(Part {
                index: u32::MAX,
                count: u32::MAX
            })
        );
        assert_eq!(
            ok(r#"{"index":0,"count":2}"#),
            Err(DecodeError::PartIndexOutOfRange { index: 0, count: 2 })
        );
        assert_eq!(
            ok(r#"{"index":3,"count":2}"#),
            Err(DecodeError::PartIndexOutOfRange { index: 3, count: 2 })
        );
        assert_eq!(
            ok(r#"{"index":1,"count":0}"#),
            Err(DecodeError::PartCountZero)
        );
        for bad in [
            r#"{"index":1}"#,
            r#"{"count":1}"#,
            r#"{"index":-1,"count":2}"#,
            r#"{"index":1,"count":4294967296}"#,
            r#"{"index":1.5,"count":2}"#,
            r#"{"index":"1","count":2}"#,
            r#"{"index":1,"index":1,"count":2}"#,
            r#"[1,2]"#,
            r#""1/2""#,
            "true",
        ] {
            let e = ok(bad).unwrap_err();
            assert_eq!(e.reason(), "bad_part", "{bad}");
            assert!(e.to_string().contains("`part`"), "{e}");
        }
        let e = ok(r#"{"index":1}"#).unwrap_err();
        assert!(e.to_string().contains("missing field `count`"), "{e}");
    }

    #[test]
    fn final_rules() {
        assert!(
            decode(r#"{"tenant":"a","session":"s","final":true}"#)
                .unwrap()
                .final_flag
        );
        for bad in [r#""yes""#, "1", "0", r#"{}"#, "[]"] {
            assert_eq!(
                reason(&format!(r#"{{"tenant":"a","session":"s","final":{bad}}}"#)),
                "final_not_bool",
                "{bad}"
            );
        }
    }

    #[test]
    fn attributes_rules() {
        let with = |a: &str| {
            decode(&format!(
                r#"{{"tenant":"a","session":"s","attributes":{a}}}"#
            ))
        };
        assert_eq!(with("{}").unwrap().attributes.as_deref(), Some("{}"));
        // Kept as written, whitespace and escapes included.
        assert_eq!(
            with(r#"{ "k" : "v\n" }"#).unwrap().attributes.as_deref(),
            Some(r#"{ "k" : "v\n" }"#)
        );
        for bad in ["[]", "1", r#""{}""#, "true"] {
            assert_eq!(
                with(bad).unwrap_err().reason(),
                "attributes_not_object",
                "{bad}"
            );
        }
        // 16 KiB exactly: {"k":"…"} is 8 bytes around the filler.
        let exact = format!(r#"{{"k":"{}"}}"#, "x".repeat(ATTRIBUTES_MAX_BYTES - 8));
        assert_eq!(exact.len(), ATTRIBUTES_MAX_BYTES);
        assert_eq!(
            with(&exact).unwrap().attributes.as_deref(),
            Some(exact.as_str())
        );
        let over = format!(r#"{{"k":"{}"}}"#, "x".repeat(ATTRIBUTES_MAX_BYTES - 7));
        assert_eq!(
            with(&over),
            Err(DecodeError::AttributesTooLarge(ATTRIBUTES_MAX_BYTES + 1))
        );
    }

    #[test]
    fn attributes_nest_at_most_64_levels_checked_without_recursion() {
        assert_eq!(nested(1), r#"{"a":1}"#);
        assert_eq!(nested(3), r#"{"a":[[1]]}"#);
        let ok = decode(&with_attributes(&nested(ATTRIBUTES_MAX_DEPTH))).unwrap();
        assert_eq!(
            ok.attributes.as_deref(),
            Some(nested(ATTRIBUTES_MAX_DEPTH).as_str())
        );
        for levels in [65, 100, 126, 127, 128, 200, 5_000] {
            assert_eq!(
                decode(&with_attributes(&nested(levels))),
                Err(DecodeError::AttributesTooDeep),
                "{levels} levels"
            );
        }
        // Brackets inside strings are not nesting; escaped quotes do not end a string.
        let tricky = format!(r#"{{"s":"{}\"[[[","t":[{{}}]}}"#, "{".repeat(200));
        assert!(decode(&with_attributes(&tricky)).is_ok());
        // A field settle ignores is skipped whatever its depth (it is never emitted).
        let deep_other = format!(r#"{{"tenant":"a","session":"s","x":{}}}"#, nested(5_000));
        assert!(decode_upload(Some(b"a/s"), deep_other.as_bytes(), 0, 0).is_ok());
        // Deep attributes are reported after the record's other faults.
        let deep_and_bad_tenant = format!(
            r#"{{"tenant":"a b","session":"s","attributes":{}}}"#,
            nested(100)
        );
        assert_eq!(reason(&deep_and_bad_tenant), "bad_tenant");
    }

    #[test]
    fn depth_is_counted_outside_strings() {
        assert_eq!(
            scan_json(r#"{"a":"\ud83d\ude00 \\ud800 \u00e9"}"#, 4),
            Ok(())
        );
        assert_eq!(
            scan_json(r#"{"a":"\ud800"}"#, 4),
            Err(Scan::LoneSurrogate(0xD800))
        );
        assert_eq!(
            scan_json(r#"{"a":"x\udc00y"}"#, 4),
            Err(Scan::LoneSurrogate(0xDC00))
        );
        assert_eq!(
            scan_json(r#"{"a":"\ud83d\u0041"}"#, 4),
            Err(Scan::LoneSurrogate(0xD83D))
        );
        assert_eq!(scan_json(r#"{"a":[1e308,-1.5E-400,-0,12]}"#, 4), Ok(()));
        assert_eq!(
            scan_json(r#"{"a":5e308}"#, 4),
            Err(Scan::NumberOutOfRange("5e308".into()))
        );
        assert_eq!(
            scan_json(r#"{"a":-1E+309}"#, 4),
            Err(Scan::NumberOutOfRange("-1E+309".into()))
        );
        assert_eq!(scan_json(r#"{"a":"5e308"}"#, 4), Ok(()), "inside a string");
        let huge = format!(r#"{{"a":{}}}"#, "9".repeat(400));
        assert!(matches!(
            scan_json(&huge, 4),
            Err(Scan::NumberOutOfRange(_))
        ));
        let big = decode(r#"{"tenant":"a","session":"s","attributes":{"k":1e999}}"#);
        assert_eq!(big.unwrap_err().reason(), "invalid_json");
        let lone = decode(r#"{"tenant":"a","session":"s","attributes":{"k":"\udfff"}}"#);
        assert_eq!(lone.unwrap_err().reason(), "invalid_json");
        assert!(!too_deep("{}", 1));
        assert!(too_deep("{}", 0));
        assert!(too_deep(r#"{"a":{"b":1}}"#, 1));
        assert!(!too_deep(r#"{"x":"{{{[[","y":"\"{{"}"#, 1));
        assert!(too_deep(r#"[[1]]"#, 1));
        assert!(!too_deep(r#"[1],[2],{"a":3}"#, 1));
    }

    #[test]
    fn an_optional_key_may_be_absent_but_never_wrong() {
        let p = br#"{"tenant":"acme","session":"run/1"}"#;
        let u = decode_upload_with(KeyRule::Optional, None, p, 5, 9).unwrap();
        assert_eq!(u.key.as_str(), "acme/run/1");
        assert_eq!(u.event_time, 5);
        assert!(decode_upload_with(KeyRule::Optional, Some(b"acme/run/1"), p, 0, 0).is_ok());
        assert_eq!(
            decode_upload_with(KeyRule::Optional, Some(b"acme/run/2"), p, 0, 0)
                .unwrap_err()
                .reason(),
            "key_mismatch"
        );
        assert_eq!(
            decode_upload_with(KeyRule::Required, None, p, 0, 0),
            Err(DecodeError::MissingKey)
        );
    }

    #[test]
    fn record_key_rules() {
        let p = br#"{"tenant":"acme","session":"run/1"}"#;
        assert!(decode_upload(Some(b"acme/run/1"), p, 0, 0).is_ok());
        assert_eq!(decode_upload(None, p, 0, 0), Err(DecodeError::MissingKey));
        // The payload's own faults come first.
        assert_eq!(
            decode_upload(None, br#"{"tenant":"acme"}"#, 0, 0),
            Err(DecodeError::MissingSession)
        );
        for bad in [
            &b"acme/run/2"[..],
            b"acme",
            b"",
            b"acme/run/1 ",
            b"acme-run/1",
            b"ACME/run/1",
        ] {
            assert_eq!(
                decode_upload(Some(bad), p, 0, 0).unwrap_err().reason(),
                "key_mismatch"
            );
        }
        assert_eq!(
            decode_upload(Some(b"acme/x"), p, 0, 0),
            Err(DecodeError::KeyMismatch {
                key: "acme/x".into(),
                expected: "acme/run/1".into()
            })
        );
        assert_eq!(
            decode_upload(Some(b"acme/\xff"), p, 0, 0),
            Err(DecodeError::KeyNotUtf8)
        );
        // Unicode keys compare byte for byte; long keys are cut in the message.
        let u = br#"{"tenant":"a","session":"\u00e9"}"#;
        assert!(decode_upload(Some("a/é".as_bytes()), u, 0, 0).is_ok());
        let long = format!("a/{}é", "x".repeat(298));
        match decode_upload(Some(long.as_bytes()), u, 0, 0) {
            Err(DecodeError::KeyMismatch { key, .. }) => assert_eq!(key.len(), 300),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn every_reason_is_listed_once_and_messages_name_the_field() {
        let samples: Vec<DecodeError> = vec![
            decode_upload(None, b"\xff", 0, 0).unwrap_err(),
            decode("{").unwrap_err(),
            decode("[]").unwrap_err(),
            decode(r#"{"session":"s","session":"t"}"#).unwrap_err(),
            decode(r#"{"session":"s"}"#).unwrap_err(),
            decode(r#"{"tenant":1}"#).unwrap_err(),
            decode(r#"{"tenant":"","session":"s"}"#).unwrap_err(),
            DecodeError::TenantTooLong(129),
            decode(r#"{"tenant":"a b","session":"s"}"#).unwrap_err(),
            decode(r#"{"tenant":"a"}"#).unwrap_err(),
            decode(r#"{"tenant":"a","session":false}"#).unwrap_err(),
            decode(r#"{"tenant":"a","session":""}"#).unwrap_err(),
            DecodeError::SessionTooLong(257),
            decode(r#"{"tenant":"a","session":"\n"}"#).unwrap_err(),
            decode(r#"{"tenant":"a","session":"s","event_id":{}}"#).unwrap_err(),
            DecodeError::EventIdTooLong(129),
            decode(r#"{"tenant":"a","session":"s","part":1}"#).unwrap_err(),
            decode(r#"{"tenant":"a","session":"s","part":{"index":1,"count":0}}"#).unwrap_err(),
            decode(r#"{"tenant":"a","session":"s","part":{"index":2,"count":1}}"#).unwrap_err(),
            decode(r#"{"tenant":"a","session":"s","final":0}"#).unwrap_err(),
            decode(r#"{"tenant":"a","session":"s","attributes":[]}"#).unwrap_err(),
            DecodeError::AttributesTooLarge(20_000),
            decode(&with_attributes(&nested(65))).unwrap_err(),
            decode_upload(None, br#"{"tenant":"a","session":"s"}"#, 0, 0).unwrap_err(),
            decode_upload(Some(b"\xff"), br#"{"tenant":"a","session":"s"}"#, 0, 0).unwrap_err(),
            decode_upload(Some(b"a/t"), br#"{"tenant":"a","session":"s"}"#, 0, 0).unwrap_err(),
            DecodeError::WrongPartition {
                partition: 1,
                expected: 2,
            },
        ];
        let reasons: Vec<&str> = samples.iter().map(DecodeError::reason).collect();
        assert_eq!(reasons, DecodeError::ALL_REASONS.to_vec());
        let mut unique = reasons.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), reasons.len());
        for r in reasons {
            assert!(
                r.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'),
                "{r}"
            );
        }
        let fields = [
            ("tenant", 4..9),
            ("session", 9..14),
            ("event_id", 14..16),
            ("part", 16..19),
            ("final", 19..20),
            ("attributes", 20..23),
            ("record key", 23..26),
            ("partition", 26..27),
        ];
        for (name, range) in fields {
            for e in &samples[range] {
                assert!(e.to_string().contains(name), "{e} should name {name}");
            }
        }
    }

    #[test]
    fn validators_are_public_for_config_and_tools() {
        assert!(validate_tenant("acme").is_ok());
        assert_eq!(validate_tenant("a!"), Err(DecodeError::BadTenant('!')));
        assert!(validate_session("x/y z").is_ok());
        assert_eq!(validate_session(""), Err(DecodeError::EmptySession));
    }

    // ------------------------------------------------------------------ trace lines

    #[test]
    fn trace_lines_decode_in_one_pass_as_field_by_field() {
        let lines = [
            r#"{"tenant":"a","session":"s","ts":1767225600001}"#,
            r#"{"tenant": "t1", "session": "s103500", "ts": 1767225600001, "partition": 3}"#,
            r#"{"ts":"2026-01-01T00:00:00.250Z","tenant":"a","session":"s","partition":null}"#,
            r#"{"ts":"2026-01-01T01:00:00+01:00","tenant":"a","session":"s"}"#,
            r#"{"ts":"2026\u002d01-01T00:00:00Z","tenant":"a","session":"s"}"#,
            r#"{"ts":-5,"tenant":"a","session":"s"}"#,
            r#"{"ts":0,"tenant":"a","session":"s","event_id":"e\n","final":true,"part":{"index":1,"count":2},"attributes":{"k":[1]}}"#,
            r#"{"ts":99999999999999999999,"tenant":"a","session":"s"}"#,
            r#"{"ts":1.5,"tenant":"a","session":"s"}"#,
            r#"{"ts":-0,"tenant":"a","session":"s"}"#,
            r#"{"ts":null,"tenant":"a","session":"s"}"#,
            r#"{"tenant":"a","session":"s"}"#,
            r#"{"ts":1,"ts":2,"tenant":"a","session":"s"}"#,
            r#"{"ts":1,"partition":-1,"tenant":"a","session":"s"}"#,
            r#"{"ts":1,"partition":4294967296,"tenant":"a","session":"s"}"#,
            r#"{"ts":1,"partition":"1","tenant":"a","session":"s"}"#,
            r#"{"ts":1,"partition":1,"partition":1,"tenant":"a","session":"s"}"#,
            r#"{"ts":1,"tenant":"a b","session":"s"}"#,
            r#"{"ts":1,"tenant":"a"}"#,
            r#"{"tenant":7}"#,
            r#"{"ts":"yesterday","tenant":"a","session":"s"}"#,
            "[1]",
            "{",
        ];
        for line in lines {
            assert_eq!(
                decode_trace_line(line),
                decode_trace_line_checked(line),
                "{line}"
            );
        }
        let ok = decode_trace_line(lines[1]).unwrap();
        assert_eq!(ok.partition, Some(3));
        assert_eq!(
            ok.upload,
            Upload::plain(SessionKey::new("t1", "s103500"), 1_767_225_600_001)
        );
        assert_eq!(
            decode_trace_line(lines[2]).unwrap().upload.event_time,
            1_767_225_600_250
        );
        assert_eq!(decode_trace_line(lines[5]).unwrap().upload.event_time, -5);
        let reason = |line: &str| match decode_trace_line(line) {
            Err(TraceLineError::NotATrace(m)) => m,
            other => panic!("{line}: {other:?}"),
        };
        assert!(reason(lines[11]).starts_with("missing \"ts\""));
        assert!(reason(lines[8]).starts_with("bad \"ts\""));
        assert!(reason(lines[12]).contains("duplicate field `ts`"));
        assert!(reason(lines[13]).starts_with("not a trace record"));
        assert_eq!(
            decode_trace_line(lines[17]),
            Err(TraceLineError::Upload(DecodeError::BadTenant(' ')))
        );
        // A missing `ts` is reported before the upload's own faults, as always.
        assert!(reason(lines[19]).starts_with("missing \"ts\""));
    }

    // ------------------------------------------------------------------ time

    #[test]
    fn rfc3339_format_and_parse() {
        assert_eq!(format_rfc3339_ms(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(
            format_rfc3339_ms(1_796_009_687_123),
            "2026-11-30T03:34:47.123Z"
        );
        assert_eq!(format_rfc3339_ms(-1), "1969-12-31T23:59:59.999Z");
        assert_eq!(format_rfc3339_ms(Millis::MAX), "9999-12-31T23:59:59.999Z");
        assert_eq!(format_rfc3339_ms(Millis::MIN), "0000-01-01T00:00:00.000Z");
        for ms in [
            0,
            1,
            -1,
            999,
            1_796_009_687_123,
            RFC3339_MIN_MS,
            RFC3339_MAX_MS,
        ] {
            assert_eq!(parse_rfc3339_ms(&format_rfc3339_ms(ms)), Ok(ms), "{ms}");
        }
        assert_eq!(
            parse_rfc3339_ms("2026-11-30T04:34:47.123+01:00"),
            Ok(1_796_009_687_123)
        );
        assert_eq!(
            parse_rfc3339_ms("2026-11-30T03:34:47Z"),
            Ok(1_796_009_687_000)
        );
        // Sub-millisecond digits go toward the past.
        assert_eq!(
            parse_rfc3339_ms("2026-11-30T03:34:47.123999Z"),
            Ok(1_796_009_687_123)
        );
        assert_eq!(parse_rfc3339_ms("1969-12-31T23:59:59.9995Z"), Ok(-1));
        assert!(matches!(
            parse_rfc3339_ms("2026-11-30"),
            Err(TimeError::NotRfc3339 { .. })
        ));
        assert!(parse_rfc3339_ms("yesterday").is_err());
    }

    /// `time`'s own formatting of `ms` (clamped as settle clamps), the reference.
    fn time_crate_rfc3339(ms: Millis) -> String {
        let ms = ms.clamp(RFC3339_MIN_MS, RFC3339_MAX_MS);
        let t =
            time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000).unwrap();
        t.format(time::macros::format_description!(
            "[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:3]Z"
        ))
        .unwrap()
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(20_000))]

        /// The digit writer agrees with the `time` crate over every i64 settle accepts:
        /// years 0000-9999 exactly, everything beyond clamped.
        #[test]
        fn rfc3339_writer_matches_the_time_crate(
            ms in proptest::prop_oneof![
                RFC3339_MIN_MS..=RFC3339_MAX_MS,
                proptest::num::i64::ANY,
                -86_400_000_i64..86_400_000,
                proptest::sample::select(vec![
                    Millis::MIN, Millis::MAX, RFC3339_MIN_MS, RFC3339_MAX_MS,
                    RFC3339_MIN_MS - 1, RFC3339_MAX_MS + 1, 0, -1,
                    // 1600-02-29, 1900-03-01, 2000-02-29, 2100-03-01 (leap-year rules).
                    -11_670_912_000_000, -2_203_891_200_000, 951_782_400_000,
                    4_107_542_400_000,
                ]),
            ]
        ) {
            let expected = time_crate_rfc3339(ms);
            proptest::prop_assert_eq!(format_rfc3339_ms(ms), expected.clone());
            let mut out = b"x".to_vec();
            write_rfc3339_ms(ms, &mut out);
            proptest::prop_assert_eq!(&out[1..], expected.as_bytes());
            proptest::prop_assert_eq!(out.len(), 1 + RFC3339_MS_LEN);
            // The same day again (its date is remembered), and the next and previous ones.
            for later in [ms.saturating_add(1), ms.saturating_add(86_400_000), ms.saturating_sub(86_399_999)] {
                proptest::prop_assert_eq!(format_rfc3339_ms(later), time_crate_rfc3339(later));
            }
        }
    }

    #[test]
    fn timestamps_from_json() {
        use serde_json::json;
        assert_eq!(
            parse_timestamp(&json!(1_796_009_687_123_i64)),
            Ok(1_796_009_687_123)
        );
        assert_eq!(parse_timestamp(&json!(-5)), Ok(-5));
        assert_eq!(
            parse_timestamp(&json!("2026-11-30T03:34:47.123Z")),
            Ok(1_796_009_687_123)
        );
        assert!(matches!(
            parse_timestamp(&json!(1.5)),
            Err(TimeError::NotMillis(_))
        ));
        assert!(matches!(
            parse_timestamp(&json!(u64::MAX)),
            Err(TimeError::NotMillis(_))
        ));
        assert_eq!(
            parse_timestamp(&json!(null)),
            Err(TimeError::WrongType("null"))
        );
        assert!(matches!(
            parse_timestamp(&json!({})),
            Err(TimeError::WrongType(_))
        ));
        assert!(matches!(
            parse_timestamp(&json!("1796009687123")),
            Err(TimeError::NotRfc3339 { .. })
        ));
    }

    // ------------------------------------------------------------------ ready record

    fn emission() -> Emission {
        Emission {
            key: SessionKey::new("acme", "run/42"),
            state_created_at: 1_796_008_000_000,
            generation: 3,
            trigger: Trigger::MaxWait,
            uploads: 17,
            first_upload_at: 1_796_009_000_000,
            last_upload_at: 1_796_009_687_123,
            due_at: 1_796_009_697_123,
            delay_ms: 10_000,
            policy: PolicyName::LeadingTrailing,
            last_event_id: Some("e-17".into()),
            attributes: Some(r#"{"branch":"main","n":[1,{"x":null}]}"#.into()),
            event_ids: None,
        }
    }

    /// Event ids as the engine keeps them: `listed` listed (cap = their number), `dropped`
    /// more.
    fn event_ids(listed: &[&str], dropped: u32) -> Option<Box<EventIds>> {
        let mut ids = EventIds::default();
        for id in listed {
            ids.push(id, listed.len() as u32);
        }
        ids.add_dropped(dropped);
        Some(Box::new(ids))
    }

    /// A round whose rule keeps no event ids gives exactly the bytes settle wrote before
    /// `event-ids` existed (SEMANTICS §2: the fields only when the rule keeps ids).
    #[test]
    fn ready_record_without_event_ids_is_todays_bytes() {
        let bytes = encode_ready(&emission(), 1_796_009_697_200, "normal");
        assert_eq!(
            String::from_utf8(bytes).unwrap(),
            concat!(
                r#"{"tenant":"acme","session":"run/42","emission_id":"acme/run/42/1796008000000/3","#,
                r#""generation":3,"trigger":"max_wait","uploads":17,"#,
                r#""first_upload_at":"2026-11-30T03:23:20.000Z","last_upload_at":"2026-11-30T03:34:47.123Z","#,
                r#""due_at":"2026-11-30T03:34:57.123Z","emitted_at":"2026-11-30T03:34:57.200Z","#,
                r#""delay_ms":10000,"policy":"leading-trailing","tier":"normal","last_event_id":"e-17","#,
                r#""attributes":{"branch":"main","n":[1,{"x":null}]}}"#
            )
        );
    }

    #[test]
    fn ready_record_lists_event_ids_last() {
        let em = Emission {
            event_ids: event_ids(&["e-1", "e-\"e\"", "é"], 14),
            ..emission()
        };
        let bytes = encode_ready(&em, 1_796_009_697_200, "normal");
        let text = String::from_utf8(bytes.clone()).unwrap();
        assert!(
            text.ends_with(
                r#""attributes":{"branch":"main","n":[1,{"x":null}]},"event_ids":["e-1","e-\"e\"","é"],"event_ids_dropped":14}"#
            ),
            "{text}"
        );
        let rec = decode_ready(&bytes).unwrap();
        assert_eq!(
            rec.event_ids.as_deref(),
            Some(&["e-1".to_string(), "e-\"e\"".into(), "é".into()][..])
        );
        assert_eq!(rec.event_ids_dropped, Some(14));
        assert_eq!(rec.emission(), em);
        // A round that keeps ids but had none: both fields, empty.
        let none = Emission {
            event_ids: event_ids(&[], 0),
            ..emission()
        };
        let text = String::from_utf8(encode_ready(&none, 0, "normal")).unwrap();
        assert!(
            text.ends_with(r#","event_ids":[],"event_ids_dropped":0}"#),
            "{text}"
        );
        assert_eq!(decode_ready(text.as_bytes()).unwrap().emission(), none);
        // One without the other is not a record settle writes.
        let half = text.replace(r#","event_ids_dropped":0"#, "");
        assert!(decode_ready(half.as_bytes()).is_err());
    }

    #[test]
    fn ready_record_has_exactly_the_spec_fields() {
        let bytes = encode_ready(&emission(), 1_796_009_697_200, "normal");
        let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        let expected = serde_json::json!({
            "tenant": "acme",
            "session": "run/42",
            "emission_id": "acme/run/42/1796008000000/3",
            "generation": 3,
            "trigger": "max_wait",
            "uploads": 17,
            "first_upload_at": "2026-11-30T03:23:20.000Z",
            "last_upload_at": "2026-11-30T03:34:47.123Z",
            "due_at": "2026-11-30T03:34:57.123Z",
            "emitted_at": "2026-11-30T03:34:57.200Z",
            "delay_ms": 10000,
            "policy": "leading-trailing",
            "tier": "normal",
            "last_event_id": "e-17",
            "attributes": {"branch": "main", "n": [1, {"x": null}]}
        });
        assert_eq!(v, expected);
        // Wire order follows the spec table.
        let text = String::from_utf8(bytes).unwrap();
        assert!(
            text.starts_with(r#"{"tenant":"acme","session":"run/42","emission_id""#),
            "{text}"
        );
        assert!(
            text.ends_with(r#""attributes":{"branch":"main","n":[1,{"x":null}]}}"#),
            "{text}"
        );
    }

    #[test]
    fn ready_record_omits_absent_optionals() {
        let em = Emission {
            last_event_id: None,
            attributes: None,
            ..emission()
        };
        let v: serde_json::Value =
            serde_json::from_slice(&encode_ready(&em, 0, "limited")).unwrap();
        let obj = v.as_object().unwrap();
        assert_eq!(obj.len(), 13);
        assert!(!obj.contains_key("last_event_id") && !obj.contains_key("attributes"));
        assert_eq!(obj["tier"], "limited");
        assert_eq!(obj["emitted_at"], "1970-01-01T00:00:00.000Z");
    }

    #[test]
    fn ready_record_round_trips() {
        for trigger in Trigger::ALL {
            for policy in [
                PolicyName::Fixed,
                PolicyName::LeadingTrailing,
                PolicyName::Adaptive,
            ] {
                let em = Emission {
                    trigger,
                    policy,
                    ..emission()
                };
                let rec = decode_ready(&encode_ready(&em, 1_796_009_697_201, "limited")).unwrap();
                assert_eq!(rec.emission(), em);
                assert_eq!(rec.emitted_at, 1_796_009_697_201);
                assert_eq!(rec.tier, "limited");
                assert_eq!(rec.emission_id, em.emission_id());
                assert_eq!(rec.key(), em.key);
                assert_eq!(
                    rec,
                    ReadyRecord::from_emission(&em, 1_796_009_697_201, "limited")
                );
            }
        }
        let bare = Emission {
            last_event_id: None,
            attributes: None,
            ..emission()
        };
        assert_eq!(
            decode_ready(&encode_ready(&bare, 5, "normal"))
                .unwrap()
                .emission(),
            bare
        );
    }

    fn any_emission(instant: std::ops::RangeInclusive<Millis>) -> impl Strategy<Value = Emission> {
        // Strings that need every kind of escape (quote, backslash, control characters).
        let text = r#"[a-z/"\\\x00-\x1f\x7fé€🚀 ]{1,12}"#;
        let attributes = proptest::sample::select(vec![
            None,
            Some("{}"),
            Some(r#"{ "k" : "v\n", "n": [1, 2.5e3, {"x": null}] }"#),
            Some(r#"{"\u00e9":"\ud83d\ude80"}"#),
            Some("[1]"),
            Some("not json"),
            Some("{\"a\":"),
        ]);
        (
            ("[A-Za-z0-9._:-]{1,8}", text, proptest::option::of(text)),
            (any::<u64>(), any::<u32>(), any::<i64>(), any::<i64>()),
            (instant.clone(), instant.clone(), instant),
            (0..Trigger::ALL.len(), 0..3_usize, attributes),
            proptest::option::of((proptest::collection::vec(text, 0..5), any::<u32>())),
        )
            .prop_map(
                |(
                    (tenant, session, id),
                    (generation, uploads, delay_ms, state_created_at),
                    (first, last, due),
                    (t, p, attributes),
                    ids,
                )| Emission {
                    key: SessionKey::new(&tenant, &session),
                    state_created_at,
                    generation,
                    trigger: Trigger::ALL[t],
                    uploads,
                    first_upload_at: first,
                    last_upload_at: last,
                    due_at: due,
                    delay_ms,
                    policy: [
                        PolicyName::Fixed,
                        PolicyName::LeadingTrailing,
                        PolicyName::Adaptive,
                    ][p],
                    last_event_id: id,
                    attributes: attributes.map(str::to_owned),
                    event_ids: ids.and_then(|(listed, dropped)| {
                        let listed: Vec<&str> = listed.iter().map(String::as_str).collect();
                        event_ids(&listed, dropped)
                    }),
                },
            )
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2_000))]

        /// The hand-written encoder writes exactly the bytes `serde_json` writes for the
        /// record (any instant, strings that need escapes, attributes that are dropped).
        #[test]
        fn ready_encoder_writes_the_serde_bytes(
            em in any_emission(Millis::MIN..=Millis::MAX),
            emitted_at in any::<i64>(),
            tier in r#"[a-z"\\]{1,8}"#,
        ) {
            let reference =
                serde_json::to_vec(&ReadyRecord::from_emission(&em, emitted_at, &tier)).unwrap();
            let mut out = b"prefix".to_vec();
            encode_ready_into(&em, emitted_at, &tier, &mut out);
            proptest::prop_assert_eq!(&out[6..], &reference[..]);
            proptest::prop_assert_eq!(encode_ready(&em, emitted_at, &tier), reference);
        }

        /// encode → decode gives the emission back (attributes that are not an object are
        /// left out on the wire, so they come back as none).
        #[test]
        fn ready_records_round_trip(
            em in any_emission(RFC3339_MIN_MS..=RFC3339_MAX_MS),
            emitted_at in RFC3339_MIN_MS..=RFC3339_MAX_MS,
        ) {
            let rec = decode_ready(&encode_ready(&em, emitted_at, "normal")).unwrap();
            proptest::prop_assert_eq!(rec.emitted_at, emitted_at);
            proptest::prop_assert_eq!(&rec.tier, "normal");
            proptest::prop_assert_eq!(&rec.emission_id, &em.emission_id());
            let kept = em.attributes.clone().filter(|a| json_object(a).is_some());
            let expected = Emission { attributes: kept.map(|a| json_object(&a).unwrap().get().to_owned()), ..em };
            proptest::prop_assert_eq!(rec.emission(), expected);
        }
    }

    #[test]
    fn attributes_from_a_decoded_upload_ride_unchanged() {
        let u = decode(r#"{"tenant":"a","session":"s","attributes":{ "k" : "\u00e9" }}"#).unwrap();
        let em = Emission {
            attributes: u.attributes.clone(),
            ..emission()
        };
        let rec = decode_ready(&encode_ready(&em, 0, "normal")).unwrap();
        assert_eq!(rec.attributes, u.attributes);
    }

    #[test]
    fn attributes_that_are_not_an_object_are_dropped() {
        for bad in ["not json", "[1]", "{\"a\":"] {
            let em = Emission {
                attributes: Some(bad.into()),
                ..emission()
            };
            let rec = decode_ready(&encode_ready(&em, 0, "normal")).unwrap();
            assert_eq!(rec.attributes, None, "{bad}");
        }
    }

    #[test]
    fn decode_ready_is_strict() {
        let good = String::from_utf8(encode_ready(&emission(), 0, "normal")).unwrap();
        assert!(decode_ready(good.as_bytes()).is_ok());
        let extra = good.replacen('{', r#"{"surprise":1,"#, 1);
        assert!(decode_ready(extra.as_bytes()).is_err());
        let epoch = good.replace(
            r#""due_at":"2026-11-30T03:34:57.123Z""#,
            r#""due_at":1796009697123"#,
        );
        assert!(decode_ready(epoch.as_bytes()).is_err());
        let missing = good.replace(r#""tier":"normal","#, "");
        assert!(decode_ready(missing.as_bytes()).is_err());
        let bad_trigger = good.replace("max_wait", "sometime");
        assert!(decode_ready(bad_trigger.as_bytes()).is_err());
        // The emission id must be tenant/session/state_created_at/generation, exactly.
        for id in [
            "acme/run/42/3",
            "acme/run/42/1796008000000/4",
            "acme/run/42/01796008000000/3",
            "acme/run/42/+1796008000000/3",
            "acme/run/4/1796008000000/3",
            "acme/run/42/x/3",
        ] {
            let other = good.replace("acme/run/42/1796008000000/3", id);
            assert!(decode_ready(other.as_bytes()).is_err(), "{id}");
        }
        let negative = good.replace("/1796008000000/", "/-5/");
        assert_eq!(
            decode_ready(negative.as_bytes())
                .unwrap()
                .state_created_at(),
            Some(-5)
        );
    }
}
