//! A line of the JSONL trace format of `settle simulate` and `settle tune`: an upload record
//! (SEMANTICS §2) plus `"ts"`, its event time, and an optional `"partition"`
//! ([`decode_trace_line`] → [`TraceRecord`]). The line is read in the upload decoder's one
//! pass; only a line that fails it is read again field by field, for the error message.

use super::scan::PlainValue;
use super::upload::{parse_wire, plain_wire_with, PlainTraceFields, TraceFields, Wire};
use super::{parse_rfc3339_ms, parse_timestamp, DecodeError};
use crate::engine::{Millis, Upload};
use serde::Deserialize;
use serde_json::value::RawValue;

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
    if let Some(record) = decode_plain_trace_line(text) {
        return Ok(record);
    }
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

/// [`decode_trace_line`] of a plain line ([`super::plain_object`]: no escapes, no nested
/// values), the shape nearly every trace line has, without serde; `None` for any other
/// line, or one whose upload, `ts` or `partition` is not valid (serde's pass then decides,
/// and says what is wrong). A line it decodes decodes to the same record by serde's pass.
fn decode_plain_trace_line(text: &str) -> Option<TraceRecord> {
    let mut trace = PlainTraceFields::default();
    let fields = plain_wire_with(text, Some(&mut trace))?.check().ok()?;
    let ts = match trace.ts? {
        // A non-negative integer (`plain_object` allows a sign, `plain_ts` does not).
        v @ PlainValue::Int(digits) if !digits.starts_with('-') => v.as_i64()?,
        PlainValue::Str(text) => parse_rfc3339_ms(text).ok()?,
        _ => return None,
    };
    let partition = match trace.partition {
        None | Some(PlainValue::Null) => None,
        Some(v @ PlainValue::Int(_)) => Some(u32::try_from(v.as_i64()?).ok()?),
        Some(_) => return None,
    };
    Some(TraceRecord {
        partition,
        upload: fields.into_upload(ts),
    })
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::SessionKey;

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
        // The plain lines take the path without serde; the others do not.
        for i in [0, 1, 2, 3] {
            assert!(decode_plain_trace_line(lines[i]).is_some(), "{}", lines[i]);
        }
        for i in [
            4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22,
        ] {
            assert!(decode_plain_trace_line(lines[i]).is_none(), "{}", lines[i]);
        }
    }

    proptest::proptest! {
        /// Lines of plain and not-so-plain members decode alike with and without the plain
        /// path, and whatever the plain path decodes, serde's field-by-field pass decodes
        /// the same.
        #[test]
        fn plain_trace_lines_decode_as_serde_decodes_them(
            members in proptest::collection::vec(
                (
                    "tenant|session|event_id|final|ts|partition|x",
                    proptest::prop_oneof![
                        "\"[a-z0-9/ -]{0,5}\"",
                        "\"2026-01-0[1-9]T00:00:0[0-9](\\.[0-9]{3})?Z\"",
                        "-?[0-9]{1,21}",
                        "true|false|null",
                        "[0-9]\\.[0-9]",
                        "\"\\\\u00[0-9a-f]{2}\"",
                        "\\{\"index\":1,\"count\":2\\}",
                    ],
                ),
                0..8,
            ),
            space in " {0,2}",
            valid_first in proptest::bool::ANY,
        ) {
            // Half the lines start with a valid upload and `ts`, so that many decode.
            let first = valid_first.then(|| r#""tenant":"t","session":"s","ts":7"#.to_owned());
            let body: Vec<String> = first
                .into_iter()
                .chain(members.iter().map(|(k, v)| format!("\"{k}\"{space}:{space}{v}")))
                .collect();
            let line = format!("{space}{{{}}}{space}", body.join(","));
            let checked = decode_trace_line_checked(&line);
            proptest::prop_assert_eq!(&decode_trace_line(&line), &checked, "{}", line);
            if let Some(plain) = decode_plain_trace_line(&line) {
                proptest::prop_assert_eq!(Ok(plain), checked, "{}", line);
            }
        }
    }
}
