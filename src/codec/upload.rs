//! The "upload" input record (SEMANTICS §2) → a validated engine [`Upload`] with its event
//! time (§3): [`decode_upload`] / [`decode_upload_with`] ([`KeyRule`]: Kafka requires a record
//! key, NATS may omit it), and the limits of the optional fields ([`EVENT_ID_MAX_BYTES`],
//! [`ATTRIBUTES_MAX_BYTES`], [`ATTRIBUTES_MAX_DEPTH`]). Every check of §2 is applied here (the
//! name rules of `key`, the `attributes` scan of `scan`), in the order [`DecodeError`]
//! documents; the engine trusts what it gets.
//!
//! One pass over the payload: a plain object is read by the scanner without serde
//! (`plain_wire`), anything else by a hand-written serde map visitor (`parse_wire`) that
//! borrows strings without escapes, captures `attributes` as raw text and skips unknown
//! fields without allocating, and records which field had the wrong type. The same visitor
//! captures a trace line's `ts` and `partition` for `trace`.

use super::key::check_record_key;
use super::scan::{plain_object, scan_json, PlainValue, Scan};
use super::{validate_session, validate_tenant, DecodeError};
use crate::engine::{Millis, Part, SessionKey, Upload};
use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, Visitor};
use serde::{Deserialize, Deserializer};
use serde_json::value::RawValue;
use std::borrow::Cow;
use std::fmt;

/// Most bytes in an `event_id` (SEMANTICS §2).
pub const EVENT_ID_MAX_BYTES: usize = 128;
/// Most bytes of the `attributes` object as it appears in the record (16 KiB, SEMANTICS §2).
pub const ATTRIBUTES_MAX_BYTES: usize = 16 * 1024;
/// Most levels of nesting in `attributes` (SEMANTICS §2): the object itself is level 1, each
/// object or array inside another one more. Emitted records then nest at most 65 levels, which
/// every common JSON parser reads (`serde_json` stops at 128, Python's `json` near 1 000).
pub const ATTRIBUTES_MAX_DEPTH: usize = 64;

/// Decodes and validates one input record (SEMANTICS §2) with its event time (§3).
///
/// * `record_key`: the broker record key (on NATS the `settle-key` header). It must be there
///   (`None`: [`DecodeError::MissingKey`]; [`decode_upload_with`] and [`KeyRule::Optional`]
///   for NATS, where it may be absent), be UTF-8 and equal `tenant/session` byte for byte.
///   Records of formats that have no key (trace files) go through
///   [`decode_trace_line`](super::decode_trace_line).
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

/// The fields of an upload that passed every payload rule of §2, still borrowed from the
/// payload where they had no escapes.
pub(super) struct Checked<'de> {
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
    pub(super) fn into_upload(self, event_time: Millis) -> Upload {
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
    pub(super) fn check(self) -> Result<Checked<'de>, DecodeError> {
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
pub(super) struct Wire<'de> {
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

/// [`parse_wire`] for a plain object ([`plain_object`]) whose upload fields are of their
/// types (`tenant`, `session` strings; `event_id` a string or null; `final` a bool or null),
/// each at most once, without `part` or `attributes`: the same [`Wire`] serde's pass gives.
/// `None` for any other payload (serde's pass then reads it, and says what is wrong).
fn plain_wire(text: &str) -> Option<Wire<'_>> {
    plain_wire_with(text, None)
}

/// The top-level `ts` and `partition` of a plain trace line as [`plain_wire_with`] saw
/// them (each at most once; `None`: absent).
#[derive(Default)]
pub(super) struct PlainTraceFields<'a> {
    pub(super) ts: Option<PlainValue<'a>>,
    pub(super) partition: Option<PlainValue<'a>>,
}

/// [`plain_wire`] that, with `trace`, also captures the top-level `ts` and `partition` of a
/// trace line (`None` when either appears twice: serde's pass then decides).
pub(super) fn plain_wire_with<'a>(
    text: &'a str,
    mut trace: Option<&mut PlainTraceFields<'a>>,
) -> Option<Wire<'a>> {
    let mut w = Wire::default();
    let mut seen = [false; 6];
    let plain = plain_object(text, |name, value| {
        let Some(i) = UPLOAD_FIELDS.iter().position(|n| *n == name) else {
            if let Some(t) = trace.as_deref_mut() {
                let field = match name {
                    "ts" => &mut t.ts,
                    "partition" => &mut t.partition,
                    _ => return true,
                };
                return field.replace(value).is_none();
            }
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
pub(super) fn parse_wire<'de>(
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

/// Raw `ts` and `partition` captured during the one pass of
/// [`decode_trace_line`](super::decode_trace_line).
#[derive(Default)]
pub(super) struct TraceFields<'de> {
    pub(super) ts: Option<&'de RawValue>,
    pub(super) partition: Option<&'de RawValue>,
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::Strategy;

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
    fn attributes_out_of_range_numbers_and_lone_surrogates_are_invalid_json() {
        let big = decode(r#"{"tenant":"a","session":"s","attributes":{"k":1e999}}"#);
        assert_eq!(big.unwrap_err().reason(), "invalid_json");
        let lone = decode(r#"{"tenant":"a","session":"s","attributes":{"k":"\udfff"}}"#);
        assert_eq!(lone.unwrap_err().reason(), "invalid_json");
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
}
