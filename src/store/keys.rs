//! Byte layout of the partition store's keys and values (the table is in the `store` module
//! header). Everything here is pure: no RocksDB handle, no I/O.

use super::error::Error;
use crate::engine::{Emission, Millis, SessionKey, SessionState, TenantStats};
use serde::de::DeserializeOwned;

/// Column family of per-key state (each value carries the key's timer, see
/// [`encode_session_into`]).
pub(crate) const CF_SESSIONS: &str = "sessions";
/// Column family of format 1's timers (`due ‖ key`). Format 2 has none: a store that still
/// has it was written by format 1 and is refused at open with what to do.
pub(crate) const CF_TIMERS_V1: &str = "timers";
/// Column family of owed emissions in FIFO order.
pub(crate) const CF_OUTBOX: &str = "outbox";
/// Column family of per-partition bookkeeping.
pub(crate) const CF_META: &str = "meta";
/// Column family of per-tenant learned-delay statistics (`engine::learn`).
pub(crate) const CF_TENANTS: &str = "tenants";
/// Every column family the store opens (RocksDB's `default` is opened too and left empty).
pub(crate) const COLUMN_FAMILIES: [&str; 4] = [CF_SESSIONS, CF_OUTBOX, CF_META, CF_TENANTS];

/// Version of this layout, stored in `meta` under `format_version`. Bump it on any change to a
/// key or value encoding; `PartitionStore::open` refuses a store of another version.
///
/// 2 (store v2, memory first): no `timers` column family; each `sessions` value starts with
/// the key's timer. 1: timers in their own column family, a `timer_floor` in `meta`.
pub const FORMAT_VERSION: u64 = 2;

/// `meta` keys. Values are 8-byte big-endian integers.
pub(crate) const META_FORMAT_VERSION: &[u8] = b"format_version";
pub(crate) const META_OFFSET: &[u8] = b"offset";
pub(crate) const META_PARTITION_TIME: &[u8] = b"partition_time";
pub(crate) const META_OUTBOX_NEXT_SEQ: &[u8] = b"outbox_next_seq";
pub(crate) const META_OUTBOX_HEAD: &[u8] = b"outbox_head";
pub(crate) const META_OUTBOX_LEN: &[u8] = b"outbox_len";
pub(crate) const META_SESSIONS: &[u8] = b"sessions";
pub(crate) const META_OPEN_ROUNDS: &[u8] = b"open_rounds";

/// First byte of a `sessions` value: the key has no timer (the state follows).
const NO_TIMER: u8 = 0;
/// First byte of a `sessions` value: the key's timer follows (8 bytes, [`encode_due`]), then
/// the state.
const TIMER: u8 = 1;

const SIGN_BIT: u64 = 1 << 63;

/// `due` (ms, any `i64`) as 8 bytes whose byte order is numeric order: the sign bit is
/// flipped and the result written big-endian, so `i64::MIN → 00…00`, `-1 → 7F…FF`,
/// `0 → 80…00`, `i64::MAX → FF…FF`.
pub fn encode_due(due: Millis) -> [u8; 8] {
    ((due as u64) ^ SIGN_BIT).to_be_bytes()
}

/// Inverse of [`encode_due`].
pub fn decode_due(bytes: [u8; 8]) -> Millis {
    (u64::from_be_bytes(bytes) ^ SIGN_BIT) as i64
}

/// A session key from its stored bytes (`tenant/session`, UTF-8).
pub(crate) fn decode_session_key(bytes: &[u8]) -> Result<SessionKey, String> {
    let s = std::str::from_utf8(bytes).map_err(|e| format!("session key is not UTF-8: {e}"))?;
    SessionKey::parse(s).ok_or_else(|| "session key is not tenant/session".to_string())
}

/// The session key of a `sessions` record's key bytes. Errors: [`Error::Corrupt`].
pub(crate) fn stored_session_key(bytes: &[u8]) -> Result<SessionKey, Error> {
    decode_session_key(bytes).map_err(|reason| Error::Corrupt {
        cf: CF_SESSIONS,
        key: printable(bytes),
        reason,
    })
}

/// Outbox key: the sequence number, 8 bytes big-endian (FIFO = byte order).
pub fn outbox_key(seq: u64) -> [u8; 8] {
    seq.to_be_bytes()
}

/// Inverse of [`outbox_key`].
pub(crate) fn decode_outbox_key(bytes: &[u8]) -> Result<u64, String> {
    let b: [u8; 8] = bytes
        .try_into()
        .map_err(|_| format!("outbox key of {} bytes, need 8", bytes.len()))?;
    Ok(u64::from_be_bytes(b))
}

/// A `meta` integer value (8 bytes big-endian).
pub(crate) fn decode_meta_u64(key: &[u8], bytes: &[u8]) -> Result<u64, Error> {
    let b: [u8; 8] = bytes.try_into().map_err(|_| Error::Corrupt {
        cf: CF_META,
        key: printable(key),
        reason: format!("value of {} bytes, need 8", bytes.len()),
    })?;
    Ok(u64::from_be_bytes(b))
}

/// Encodes a `sessions` value into `buf`, cleared first, so one buffer serves every state of
/// a flush. Returns the buffer. Shape: `0x01 ‖ encode_due(due)` (9 bytes) for a key with a
/// timer, `0x00` for one without, then the state (postcard), then, for a state with an open
/// round, the round's trailer ([`wire::round_trailer`]: what the postcard form leaves out, as
/// tagged fields). The timer rides with its state so the in-memory
/// timer index is rebuilt at open from one scan of `sessions` (reading the 1–9 byte timer prefix, no
/// decoding), and a flush writes one record per changed key.
///
/// The trailer keeps layout 2 readable both ways: a value written before it existed decodes
/// with the trailer's fields at their defaults (`Round::policy` and `Round::event_ids`
/// `None`), and postcard, which ignores bytes after a value, reads a value with a trailer
/// as before.
pub(crate) fn encode_session_into(
    due: Option<Millis>,
    state: &SessionState,
    mut buf: Vec<u8>,
) -> Result<Vec<u8>, Error> {
    buf.clear();
    match due {
        Some(d) => {
            buf.push(TIMER);
            buf.extend_from_slice(&encode_due(d));
        }
        None => buf.push(NO_TIMER),
    }
    wire::state(&mut buf, state);
    if let Some(round) = &state.round {
        wire::round_trailer(&mut buf, round);
    }
    Ok(buf)
}

/// postcard's encoding of the records the flush writes, by hand: the same bytes as
/// `postcard::to_extend` (a test compares them on arbitrary values), without serde's
/// per-field calls on the hot path. Integers are varints (signed ones zigzag), an `Option`
/// is a 0/1 tag before its value, a string or sequence its length before its items, an
/// enum's unit variant its index, structs their fields in declaration order.
mod wire {
    use crate::engine::{Emission, EventIds, PolicyName, Round, SessionState, Trigger};

    /// Trailer field: [`Round::policy`], its variant index (a varint).
    pub(super) const ROUND_POLICY: u64 = 1;
    /// Trailer field of a round ([`Round::event_ids`]) and of an outbox value
    /// ([`Emission::event_ids`]): [`event_ids`]'s bytes.
    pub(super) const EVENT_IDS: u64 = 2;

    fn varint(out: &mut Vec<u8>, mut v: u64) {
        while v >= 0x80 {
            out.push(v as u8 | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    }

    fn int(out: &mut Vec<u8>, v: i64) {
        varint(out, ((v << 1) ^ (v >> 63)) as u64);
    }

    fn text(out: &mut Vec<u8>, s: &str) {
        varint(out, s.len() as u64);
        out.extend_from_slice(s.as_bytes());
    }

    fn opt<T>(out: &mut Vec<u8>, v: Option<T>, f: impl FnOnce(&mut Vec<u8>, T)) {
        match v {
            None => out.push(0),
            Some(v) => {
                out.push(1);
                f(out, v);
            }
        }
    }

    /// [`SessionState`] as postcard writes it.
    pub(super) fn state(out: &mut Vec<u8>, s: &SessionState) {
        int(out, s.created_at);
        varint(out, s.generation);
        int(out, s.last_upload_at);
        opt(out, s.last_applied_event_id.as_deref(), text);
        opt(out, s.track.as_ref(), |out, t| {
            int(out, t.time);
            int(out, t.delay);
        });
        opt(out, s.round.as_deref(), |out, r| {
            int(out, r.start);
            int(out, r.deadline);
            opt(out, r.max_wait_at, int);
            int(out, r.delay);
            varint(out, u64::from(r.uploads));
            opt(out, r.first_upload_at, int);
            opt(out, r.last_upload_at, int);
            opt(out, r.last_event_id.as_deref(), text);
            opt(out, r.attributes.as_deref(), text);
            varint(out, r.parts.len() as u64);
            for &p in &r.parts {
                varint(out, u64::from(p));
            }
        });
    }

    /// [`Emission`] as postcard writes it.
    pub(super) fn emission(out: &mut Vec<u8>, e: &Emission) {
        text(out, e.key.as_str());
        int(out, e.state_created_at);
        varint(out, e.generation);
        varint(out, trigger_index(e.trigger));
        varint(out, u64::from(e.uploads));
        int(out, e.first_upload_at);
        int(out, e.last_upload_at);
        int(out, e.due_at);
        int(out, e.delay_ms);
        varint(out, policy_index(e.policy));
        opt(out, e.last_event_id.as_deref(), text);
        opt(out, e.attributes.as_deref(), text);
    }

    /// The variant index serde gives a [`Trigger`] (declaration order).
    fn trigger_index(t: Trigger) -> u64 {
        match t {
            Trigger::Leading => 0,
            Trigger::Trailing => 1,
            Trigger::MaxWait => 2,
            Trigger::Complete => 3,
            Trigger::Final => 4,
            Trigger::Manual => 5,
        }
    }

    /// The variant index serde gives a [`PolicyName`] (declaration order).
    fn policy_index(p: PolicyName) -> u64 {
        match p {
            PolicyName::Fixed => 0,
            PolicyName::LeadingTrailing => 1,
            PolicyName::Adaptive => 2,
        }
    }

    /// The [`PolicyName`] of a variant index, `None` for an unknown one.
    pub(super) fn policy_of(index: u64) -> Option<PolicyName> {
        match index {
            0 => Some(PolicyName::Fixed),
            1 => Some(PolicyName::LeadingTrailing),
            2 => Some(PolicyName::Adaptive),
            _ => None,
        }
    }

    /// The round's fields that its postcard form leaves out, after the state: a sequence of
    /// `tag ‖ length ‖ bytes` (tag and length varints), one per field that is set. A reader
    /// skips a tag it does not know, so fields can be added without a new layout.
    pub(super) fn round_trailer(out: &mut Vec<u8>, r: &Round) {
        if let Some(p) = r.policy {
            varint(out, ROUND_POLICY);
            varint(out, 1);
            varint(out, policy_index(p));
        }
        if let Some(ids) = r.event_ids.as_deref() {
            event_ids_field(out, ids);
        }
    }

    /// An emission's fields that its postcard form leaves out, after it: a trailer as
    /// [`round_trailer`]'s (none for an emission without event ids, so such an outbox value
    /// is postcard's bytes alone, as before the trailer existed).
    pub(super) fn emission_trailer(out: &mut Vec<u8>, e: &Emission) {
        if let Some(ids) = e.event_ids.as_deref() {
            event_ids_field(out, ids);
        }
    }

    /// The [`EVENT_IDS`] trailer field: `varint(dropped) ‖ varint(listed) ‖ (varint(len) ‖
    /// bytes)` per listed id, in order (postcard's `(u32, Vec<String>)`).
    fn event_ids_field(out: &mut Vec<u8>, ids: &EventIds) {
        let len = varint_len(u64::from(ids.dropped()))
            + varint_len(u64::from(ids.listed()))
            + ids
                .iter()
                .map(|id| varint_len(id.len() as u64) + id.len())
                .sum::<usize>();
        varint(out, EVENT_IDS);
        varint(out, len as u64);
        varint(out, u64::from(ids.dropped()));
        varint(out, u64::from(ids.listed()));
        for id in ids.iter() {
            text(out, id);
        }
    }

    fn varint_len(v: u64) -> usize {
        (64 - (v | 1).leading_zeros() as usize).div_ceil(7)
    }

    /// Reads an [`EVENT_IDS`] field. Errors: cut short, an id that is not UTF-8 or too long.
    fn read_event_ids(field: &[u8]) -> Result<EventIds, String> {
        let cut = || "event ids cut short".to_string();
        let (dropped, rest) = take_varint(field).ok_or_else(cut)?;
        let (listed, mut rest) = take_varint(rest).ok_or_else(cut)?;
        let too_many = |what: &str, n: u64| format!("event ids: {what} {n} is not a u32");
        let dropped = u32::try_from(dropped).map_err(|_| too_many("dropped", dropped))?;
        let listed = u32::try_from(listed).map_err(|_| too_many("listed", listed))?;
        let mut ids = EventIds::default();
        for _ in 0..listed {
            let (len, tail) = take_varint(rest).ok_or_else(cut)?;
            let len = usize::try_from(len).unwrap_or(usize::MAX);
            let bytes = tail.get(..len).ok_or_else(cut)?;
            let id = std::str::from_utf8(bytes).map_err(|e| format!("event id: {e}"))?;
            if id.len() > EventIds::MAX_ID_BYTES {
                return Err(format!("event id of {} bytes", id.len()));
            }
            ids.push(id, listed);
            rest = &tail[len..];
        }
        ids.add_dropped(dropped);
        Ok(ids)
    }

    /// The trailer fields after a value, `(tag, field bytes)` in order. Errors: a field cut
    /// short (the text says which; nothing is read after it).
    fn trailer_fields(mut bytes: &[u8]) -> impl Iterator<Item = Result<(u64, &[u8]), String>> + '_ {
        std::iter::from_fn(move || {
            if bytes.is_empty() {
                return None;
            }
            Some(match take_field(bytes) {
                Ok((tag, field, rest)) => {
                    bytes = rest;
                    Ok((tag, field))
                }
                Err(e) => {
                    bytes = &[];
                    Err(e)
                }
            })
        })
    }

    /// One `tag ‖ length ‖ bytes` field at the front of `bytes`: `(tag, field, rest)`.
    fn take_field(bytes: &[u8]) -> Result<(u64, &[u8], &[u8]), String> {
        let (tag, rest) = take_varint(bytes).ok_or("trailer: tag cut short")?;
        let (len, rest) = take_varint(rest).ok_or("trailer: length cut short")?;
        let len = usize::try_from(len).unwrap_or(usize::MAX);
        match rest.get(..len) {
            Some(field) => Ok((tag, field, &rest[len..])),
            None => Err(format!("trailer: field {tag} of {len} bytes cut short")),
        }
    }

    /// A varint at the front of `bytes`, and the rest; `None` when it is cut short or longer
    /// than 10 bytes.
    fn take_varint(bytes: &[u8]) -> Option<(u64, &[u8])> {
        let mut v = 0u64;
        for (i, &b) in bytes.iter().enumerate().take(10) {
            v |= u64::from(b & 0x7f) << (7 * i);
            if b & 0x80 == 0 {
                return Some((v, &bytes[i + 1..]));
            }
        }
        None
    }

    /// Reads a trailer written by [`round_trailer`] into `r`. Errors: a field cut short, or a
    /// known field with a value it cannot have (the text says which).
    pub(super) fn read_round_trailer(bytes: &[u8], r: &mut Round) -> Result<(), String> {
        for field in trailer_fields(bytes) {
            match field.map_err(|e| format!("round {e}"))? {
                (ROUND_POLICY, field) => {
                    let index = take_varint(field).map(|(v, _)| v);
                    r.policy = Some(
                        index
                            .and_then(policy_of)
                            .ok_or_else(|| format!("round trailer: unknown policy {index:?}"))?,
                    );
                }
                (EVENT_IDS, field) => {
                    let ids = read_event_ids(field).map_err(|e| format!("round trailer: {e}"))?;
                    r.event_ids = Some(Box::new(ids));
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Reads a trailer written by [`emission_trailer`] into `e`. Errors as
    /// [`read_round_trailer`].
    pub(super) fn read_emission_trailer(bytes: &[u8], e: &mut Emission) -> Result<(), String> {
        for field in trailer_fields(bytes) {
            if let (EVENT_IDS, field) = field.map_err(|err| format!("emission {err}"))? {
                let ids =
                    read_event_ids(field).map_err(|err| format!("emission trailer: {err}"))?;
                e.event_ids = Some(Box::new(ids));
            }
        }
        Ok(())
    }
}

/// The timer of a `sessions` value stored under `key` and where its state starts, without
/// decoding the state. Errors: [`Error::Corrupt`] for a value without a valid timer prefix.
pub(crate) fn session_due(key: &[u8], bytes: &[u8]) -> Result<(Option<Millis>, usize), Error> {
    let corrupt = |reason: String| Error::Corrupt {
        cf: CF_SESSIONS,
        key: printable(key),
        reason,
    };
    match bytes.split_first() {
        Some((&NO_TIMER, _)) => Ok((None, 1)),
        Some((&TIMER, rest)) => {
            let due = rest.first_chunk::<8>().ok_or_else(|| {
                corrupt(format!(
                    "value of {} bytes, need at least 9 (timer)",
                    bytes.len()
                ))
            })?;
            Ok((Some(decode_due(*due)), 9))
        }
        Some((tag, _)) => Err(corrupt(format!("unknown timer tag {tag}"))),
        None => Err(corrupt("empty value".into())),
    }
}

/// Decodes a `sessions` value stored under `key`: `(timer, state)`.
pub(crate) fn decode_session(
    key: &[u8],
    bytes: &[u8],
) -> Result<(Option<Millis>, SessionState), Error> {
    let (due, at) = session_due(key, bytes)?;
    let corrupt = |reason: String| Error::Corrupt {
        cf: CF_SESSIONS,
        key: printable(key),
        reason,
    };
    let (mut state, trailer) = postcard::take_from_bytes::<SessionState>(&bytes[at..])
        .map_err(|e| corrupt(e.to_string()))?;
    match state.round.as_deref_mut() {
        Some(round) => wire::read_round_trailer(trailer, round).map_err(corrupt)?,
        None if trailer.is_empty() => {}
        None => {
            return Err(corrupt(format!(
                "{} bytes after a state without a round",
                trailer.len()
            )))
        }
    }
    Ok((due, state))
}

/// Encodes a `tenants` value (postcard) into `buf`, cleared first (see
/// [`encode_state_into`]).
pub(crate) fn encode_tenant_into(stats: &TenantStats, mut buf: Vec<u8>) -> Result<Vec<u8>, Error> {
    buf.clear();
    postcard::to_extend(stats, buf).map_err(|e| Error::Encode {
        cf: CF_TENANTS,
        reason: e.to_string(),
    })
}

/// Decodes a `tenants` value stored under `key` (the tenant name).
pub(crate) fn decode_tenant(key: &[u8], bytes: &[u8]) -> Result<TenantStats, Error> {
    decode(CF_TENANTS, key, bytes)
}

/// Encodes an `outbox` value into `buf`, cleared first (see [`encode_session_into`]): the
/// emission (postcard), then, for an emission with event ids, its trailer
/// ([`wire::emission_trailer`], read back by [`decode_emission`]; a settle from before it
/// reads the value without its event ids).
pub(crate) fn encode_emission_into(
    emission: &Emission,
    mut buf: Vec<u8>,
) -> Result<Vec<u8>, Error> {
    buf.clear();
    wire::emission(&mut buf, emission);
    wire::emission_trailer(&mut buf, emission);
    Ok(buf)
}

/// Decodes an `outbox` value stored under `key` (with or without a trailer).
pub(crate) fn decode_emission(key: &[u8], bytes: &[u8]) -> Result<Emission, Error> {
    let corrupt = |reason: String| Error::Corrupt {
        cf: CF_OUTBOX,
        key: printable(key),
        reason,
    };
    let (mut emission, trailer) =
        postcard::take_from_bytes::<Emission>(bytes).map_err(|e| corrupt(e.to_string()))?;
    wire::read_emission_trailer(trailer, &mut emission).map_err(corrupt)?;
    Ok(emission)
}

fn decode<T: DeserializeOwned>(cf: &'static str, key: &[u8], bytes: &[u8]) -> Result<T, Error> {
    postcard::from_bytes(bytes).map_err(|e| Error::Corrupt {
        cf,
        key: printable(key),
        reason: e.to_string(),
    })
}

/// A key for error messages: UTF-8 text as is, other bytes escaped (`\xNN`).
pub(crate) fn printable(key: &[u8]) -> String {
    key.escape_ascii().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{PolicyName, Trigger};
    use proptest::prelude::*;

    #[test]
    fn due_encoding_orders_numerically() {
        let dues = [
            i64::MIN,
            i64::MIN + 1,
            -86_400_000,
            -1,
            0,
            1,
            1_700_000_000_000,
            i64::MAX - 1,
            i64::MAX,
        ];
        for w in dues.windows(2) {
            assert!(encode_due(w[0]) < encode_due(w[1]), "{} < {}", w[0], w[1]);
        }
        for d in dues {
            assert_eq!(decode_due(encode_due(d)), d);
        }
        assert_eq!(encode_due(0), [0x80, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(
            encode_due(-1),
            [0x7F, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF]
        );
    }

    #[test]
    fn bad_keys_are_reported() {
        assert!(decode_session_key(&[0xC3]).is_err());
        assert!(decode_session_key(b"no-slash").is_err());
        assert!(decode_outbox_key(b"1234567").is_err());
        assert!(session_due(b"t/s", &[TIMER, 1, 2]).is_err());
        assert!(session_due(b"t/s", &[7]).is_err());
        assert!(session_due(b"t/s", &[]).is_err());
        assert_eq!(printable(b"a/b\x00"), "a/b\\x00");
    }

    #[test]
    fn state_encoded_into_a_reused_buffer_is_the_same_bytes() {
        let state = SessionState {
            generation: 3,
            last_upload_at: 1_700_000_000_000,
            last_applied_event_id: Some("e-1".into()),
            ..SessionState::default()
        };
        let dirty = vec![0xAA; 300];
        let buf = encode_session_into(Some(1_700_000_005_000), &state, dirty).unwrap();
        assert_eq!(buf[0], TIMER);
        assert_eq!(&buf[1..9], &encode_due(1_700_000_005_000));
        assert_eq!(&buf[9..], postcard::to_allocvec(&state).unwrap());
        assert_eq!(
            decode_session(b"t/s", &buf).unwrap(),
            (Some(1_700_000_005_000), state.clone())
        );
        let buf = encode_session_into(None, &state, buf).unwrap();
        assert_eq!(decode_session(b"t/s", &buf).unwrap(), (None, state));
    }

    fn arb_text() -> impl Strategy<Value = Option<String>> {
        proptest::option::of("[a-z0-9\\-\\u{e9}\\u{1F600}]{0,200}")
    }

    /// Event ids as a round keeps them: up to 6 listed (ids up to 128 bytes, any UTF-8),
    /// any dropped count; or none.
    fn arb_event_ids() -> impl Strategy<Value = Option<Box<crate::engine::EventIds>>> {
        proptest::option::of((
            proptest::collection::vec("[a-z0-9\\-\\u{e9}\\u{1F600}]{0,32}", 0..6),
            any::<u32>(),
        ))
        .prop_map(|ids| {
            ids.map(|(listed, dropped)| {
                let mut ids = crate::engine::EventIds::default();
                for id in &listed {
                    ids.push(id, listed.len() as u32);
                }
                ids.add_dropped(dropped);
                Box::new(ids)
            })
        })
    }

    fn arb_millis() -> impl Strategy<Value = Millis> {
        prop_oneof![
            any::<i64>(),
            -1_000i64..1_000,
            1_700_000_000_000i64..1_800_000_000_000
        ]
    }

    prop_compose! {
        fn arb_state()(
            created_at in arb_millis(),
            generation in any::<u64>(),
            last_upload_at in arb_millis(),
            last_applied_event_id in arb_text(),
            track in proptest::option::of((arb_millis(), arb_millis())),
            round in proptest::option::of((
                (arb_millis(), arb_millis(), proptest::option::of(arb_millis()), arb_millis()),
                (any::<u32>(), proptest::option::of(arb_millis()), proptest::option::of(arb_millis())),
                (arb_text(), arb_text(), proptest::collection::vec(any::<u32>(), 0..20)),
            )),
            event_ids in arb_event_ids(),
        ) -> SessionState {
            SessionState {
                created_at,
                generation,
                last_upload_at,
                last_applied_event_id,
                track: track.map(|(time, delay)| crate::engine::CallTrack { time, delay }),
                round: round.map(|((start, deadline, max_wait_at, delay), (uploads, first_upload_at, last_upload_at), (last_event_id, attributes, parts))| {
                    Box::new(crate::engine::Round {
                        start, deadline, max_wait_at, delay, uploads, first_upload_at,
                        last_upload_at, last_event_id, attributes, parts,
                        policy: wire::policy_of(delay.unsigned_abs() % 4),
                        event_ids,
                    })
                }),
            }
        }
    }

    prop_compose! {
        fn arb_emission()(
            tenant in "[a-z]{1,8}",
            session in "[a-z0-9]{1,40}",
            ints in (arb_millis(), any::<u64>(), any::<u32>(), arb_millis(), arb_millis(), arb_millis(), arb_millis()),
            trigger in 0usize..Trigger::ALL.len(),
            policy in 0usize..3,
            last_event_id in arb_text(),
            attributes in arb_text(),
            event_ids in arb_event_ids(),
        ) -> Emission {
            let (state_created_at, generation, uploads, first_upload_at, last_upload_at, due_at, delay_ms) = ints;
            Emission {
                key: SessionKey::new(&tenant, &session),
                state_created_at, generation,
                trigger: Trigger::ALL[trigger],
                uploads, first_upload_at, last_upload_at, due_at, delay_ms,
                policy: [PolicyName::Fixed, PolicyName::LeadingTrailing, PolicyName::Adaptive][policy],
                last_event_id, attributes, event_ids,
            }
        }
    }

    proptest! {
        /// The hand-written encoders give postcard's bytes (a session value: then its
        /// round's trailer), and the decoders read them back whole.
        #[test]
        fn hand_encoding_is_postcard(state in arb_state(), emission in arb_emission()) {
            let buf = encode_session_into(None, &state, vec![9; 40]).unwrap();
            let postcard = postcard::to_allocvec(&state).unwrap();
            prop_assert_eq!(&buf[1..=postcard.len()], &postcard[..]);
            prop_assert_eq!(decode_session(b"t/s", &buf).unwrap(), (None, state.clone()));
            // A value written before the trailer existed: read with the trailer's defaults.
            let mut old = vec![NO_TIMER];
            old.extend_from_slice(&postcard);
            let mut without = state;
            if let Some(r) = without.round.as_deref_mut() {
                r.policy = None;
                r.event_ids = None;
            }
            prop_assert_eq!(decode_session(b"t/s", &old).unwrap(), (None, without));
            // An outbox value: postcard's bytes, then (with event ids) the trailer.
            let buf = encode_emission_into(&emission, vec![9; 40]).unwrap();
            let postcard = postcard::to_allocvec(&emission).unwrap();
            prop_assert_eq!(&buf[..postcard.len()], &postcard[..]);
            prop_assert_eq!(buf.len() == postcard.len(), emission.event_ids.is_none());
            prop_assert_eq!(decode_emission(b"k", &buf).unwrap(), emission);
        }
    }

    #[test]
    fn a_trailer_field_it_does_not_know_is_skipped_and_a_cut_one_is_corrupt() {
        let round = crate::engine::Round {
            start: 1,
            deadline: 2,
            max_wait_at: None,
            delay: 1,
            uploads: 1,
            first_upload_at: Some(1),
            last_upload_at: Some(1),
            last_event_id: None,
            attributes: None,
            parts: vec![],
            policy: Some(PolicyName::LeadingTrailing),
            event_ids: None,
        };
        let state = SessionState {
            round: Some(Box::new(round)),
            ..SessionState::default()
        };
        let buf = encode_session_into(Some(7), &state, Vec::new()).unwrap();
        // A field of a later settle (tag 99, 3 bytes) before the known one: skipped.
        let cut = buf.len() - 3;
        let mut later = buf[..cut].to_vec();
        later.extend_from_slice(&[99, 3, 1, 2, 3]);
        later.extend_from_slice(&buf[cut..]);
        assert_eq!(
            decode_session(b"t/s", &later).unwrap(),
            (Some(7), state.clone())
        );
        // Cut in the middle of a field, or a policy index that names none: corrupt, named.
        let err = decode_session(b"t/s", &buf[..buf.len() - 1])
            .unwrap_err()
            .to_string();
        assert!(err.contains("t/s") && err.contains("cut short"), "{err}");
        let mut bad = buf.clone();
        *bad.last_mut().unwrap() = 9;
        let err = decode_session(b"t/s", &bad).unwrap_err().to_string();
        assert!(err.contains("unknown policy"), "{err}");
    }

    /// A state and an outbox value as settle wrote them before rounds kept event ids (bytes
    /// written down by hand from the layout): read back with no event ids; and a round
    /// or emission without event ids is still written as exactly those bytes.
    #[test]
    fn values_from_before_event_ids_read_back_and_are_written_alike() {
        let old_state: &[u8] = &[
            TIMER, 0x80, 0, 0, 0, 0, 0, 0x05, 0xDC, // timer 1500
            0xD0, 0x0F, 0x02, 0xD0, 0x0F, // created_at 1000, generation 2, last_upload_at
            0x01, 0x03, b'e', b'-', b'1', 0x00, // last_applied_event_id "e-1", no track
            0x01, 0xD0, 0x0F, 0xB8, 0x17, 0x00, 0xE8,
            0x07, // round: start, deadline, -, delay
            0x01, 0x01, 0xD0, 0x0F, 0x01, 0xD0, 0x0F, // uploads 1, first and last at 1000
            0x01, 0x03, b'e', b'-', b'1', 0x00, 0x00, // last_event_id, no attributes, parts
            0x01, 0x01, 0x00, // trailer: policy fixed
        ];
        let state = SessionState {
            created_at: 1_000,
            generation: 2,
            last_upload_at: 1_000,
            last_applied_event_id: Some("e-1".into()),
            track: None,
            round: Some(Box::new(crate::engine::Round {
                start: 1_000,
                deadline: 1_500,
                max_wait_at: None,
                delay: 500,
                uploads: 1,
                first_upload_at: Some(1_000),
                last_upload_at: Some(1_000),
                last_event_id: Some("e-1".into()),
                attributes: None,
                parts: vec![],
                policy: Some(PolicyName::Fixed),
                event_ids: None,
            })),
        };
        assert_eq!(
            decode_session(b"t/s", old_state).unwrap(),
            (Some(1_500), state.clone())
        );
        assert_eq!(
            encode_session_into(Some(1_500), &state, Vec::new()).unwrap(),
            old_state
        );
        let old_outbox: &[u8] = &[
            0x03, b't', b'/', b's', 0xD0, 0x0F, 0x02, 0x01,
            0x01, // key, created, gen, trailing, 1 upload
            0xD0, 0x0F, 0xD0, 0x0F, 0xB8, 0x17, 0xE8, 0x07,
            0x00, // first, last, due, delay, fixed
            0x01, 0x03, b'e', b'-', b'1', 0x00, // last_event_id, no attributes
        ];
        let emission = Emission {
            key: SessionKey::new("t", "s"),
            state_created_at: 1_000,
            generation: 2,
            trigger: Trigger::Trailing,
            uploads: 1,
            first_upload_at: 1_000,
            last_upload_at: 1_000,
            due_at: 1_500,
            delay_ms: 500,
            policy: PolicyName::Fixed,
            last_event_id: Some("e-1".into()),
            attributes: None,
            event_ids: None,
        };
        assert_eq!(decode_emission(b"k", old_outbox).unwrap(), emission);
        assert_eq!(
            encode_emission_into(&emission, Vec::new()).unwrap(),
            old_outbox
        );

        // With event ids: the same bytes, then one trailer field (tag 2) each.
        let mut ids = crate::engine::EventIds::default();
        for id in ["e-1", "e-2", "e-3"] {
            ids.push(id, 2);
        }
        let field: &[u8] = &[
            0x02, 0x0A, 0x01, 0x02, 0x03, b'e', b'-', b'1', 0x03, b'e', b'-', b'2',
        ];
        let mut with = state.clone();
        with.round.as_mut().unwrap().event_ids = Some(Box::new(ids.clone()));
        let buf = encode_session_into(Some(1_500), &with, Vec::new()).unwrap();
        assert_eq!(&buf[..old_state.len()], old_state);
        assert_eq!(&buf[old_state.len()..], field);
        assert_eq!(decode_session(b"t/s", &buf).unwrap(), (Some(1_500), with));
        let with = Emission {
            event_ids: Some(Box::new(ids)),
            ..emission
        };
        let buf = encode_emission_into(&with, Vec::new()).unwrap();
        assert_eq!(&buf[..old_outbox.len()], old_outbox);
        assert_eq!(&buf[old_outbox.len()..], field);
        assert_eq!(decode_emission(b"k", &buf).unwrap(), with);
        // Cut inside the ids, or an id that is not UTF-8: corrupt, named.
        let err = decode_emission(b"k", &buf[..buf.len() - 2])
            .unwrap_err()
            .to_string();
        assert!(err.contains("outbox") && err.contains("cut short"), "{err}");
        let mut bad = buf.clone();
        *bad.last_mut().unwrap() = 0xFF;
        let err = decode_emission(b"k", &bad).unwrap_err().to_string();
        assert!(err.contains("event id"), "{err}");
    }

    /// What a round pays per event id held (the figures in README and BENCHMARKS.md):
    /// `cargo test --lib event_ids_cost -- --nocapture` prints them.
    #[test]
    fn event_ids_cost_per_id() {
        let uuid = |i: u32| format!("{i:08x}-9dad-4b6f-8a3e-2f6c1c0de{:03x}", i % 4096);
        let round = |ids: Option<crate::engine::EventIds>| SessionState {
            round: Some(Box::new(crate::engine::Round {
                start: 1_767_225_600_000,
                deadline: 1_767_225_605_000,
                max_wait_at: None,
                delay: 5_000,
                uploads: 64,
                first_upload_at: Some(1_767_225_600_000),
                last_upload_at: Some(1_767_225_600_000),
                last_event_id: Some(uuid(63)),
                attributes: None,
                parts: vec![],
                policy: Some(PolicyName::Adaptive),
                event_ids: ids.map(Box::new),
            })),
            ..SessionState::default()
        };
        let stored = |s: &SessionState| encode_session_into(Some(0), s, Vec::new()).unwrap().len();
        let base = stored(&round(None));
        let empty = stored(&round(Some(crate::engine::EventIds::default())));
        for n in [1u32, 8, 64, 1_000] {
            let mut ids = crate::engine::EventIds::default();
            for i in 0..n {
                ids.push(&uuid(i), n);
            }
            assert_eq!(uuid(n - 1).len(), 36);
            let heap = ids.heap_bytes();
            let disk = stored(&round(Some(ids))) - base;
            // Stored: the field's tag, length, dropped and listed counts, then 1 + 36 per id.
            assert!(
                disk >= 37 * n as usize && disk <= 37 * n as usize + 8,
                "{disk}"
            );
            // Memory: 1 + 36 per id, up to twice that with the buffer's spare capacity.
            assert!(
                heap >= 37 * n as usize && heap <= 2 * 37 * n as usize,
                "{heap}"
            );
            println!(
                "{n} ids of 36 bytes: stored +{disk} bytes ({:.1}/id), memory +{} bytes \
                 ({:.1}/id: buffer {heap} + 48 for the boxed list)",
                disk as f64 / f64::from(n),
                heap + 48,
                (heap + 48) as f64 / f64::from(n),
            );
        }
        println!(
            "a round that keeps ids but has none: stored +{} bytes",
            empty - base
        );
        assert_eq!(empty - base, 4);
    }

    #[test]
    fn tenant_stats_round_trip() {
        let stats = TenantStats {
            intervals: vec![20_000, 19_800, 0, 600_000],
            last_seen: 1_767_225_600_000,
        };
        let buf = encode_tenant_into(&stats, vec![1, 2, 3]).unwrap();
        assert_eq!(decode_tenant(b"acme", &buf).unwrap(), stats);
        let err = decode_tenant(b"acme", &[0xFF]).unwrap_err().to_string();
        assert!(err.contains("tenants") && err.contains("acme"), "{err}");
    }

    #[test]
    fn corrupt_values_name_cf_and_key() {
        let err = decode_session(b"t/s", &[NO_TIMER, 0xFF, 0xFF]).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("sessions") && text.contains("t/s"), "{text}");
    }
}
