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
//!
//! One concern per file besides [`action`], re-exported here (every item keeps its
//! `crate::codec::` path):
//! * `error`: [`DecodeError`], one variant per rule of §2, and its reason codes;
//! * `key`: tenant and session names ([`validate_tenant`], [`validate_session`]) and the rule
//!   that a record key equals `tenant/session`;
//! * `upload`: the upload record → [`Upload`] ([`decode_upload`], [`KeyRule`], the field
//!   limits), the one-pass decoder and its serde visitor;
//! * `trace`: trace lines ([`decode_trace_line`]);
//! * `scan`: the JSON scanner ([`plain_object`]; depth, `\u` escapes and number range of
//!   `attributes`);
//! * `ready`: the ready record ([`ReadyRecord`], [`encode_ready`], [`decode_ready`],
//!   [`EMISSION_ID_HEADER`]);
//! * `time`: RFC 3339 instants ([`format_rfc3339_ms`], [`parse_timestamp`], [`TimeError`]).
//!
//! [`Upload`]: crate::engine::Upload
//! [`Emission`]: crate::engine::Emission

pub mod action;
mod error;
mod key;
mod ready;
mod scan;
mod time;
mod trace;
mod upload;

pub use error::DecodeError;
pub use key::{validate_session, validate_tenant, SESSION_MAX_BYTES, TENANT_MAX_BYTES};
pub use ready::{decode_ready, encode_ready, encode_ready_into, ReadyRecord, EMISSION_ID_HEADER};
pub use scan::{plain_object, PlainValue};
pub use time::{
    format_rfc3339_ms, parse_rfc3339_ms, parse_timestamp, write_rfc3339_ms, TimeError,
    RFC3339_MAX_MS, RFC3339_MIN_MS, RFC3339_MS_LEN,
};
pub use trace::{decode_trace_line, TraceLineError, TraceRecord};
pub use upload::{
    decode_upload, decode_upload_with, KeyRule, ATTRIBUTES_MAX_BYTES, ATTRIBUTES_MAX_DEPTH,
    EVENT_ID_MAX_BYTES,
};
