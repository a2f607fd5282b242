//! Byte layout of the partition store's keys and values (the table is in the `store` module
//! header). Everything here is pure: no RocksDB handle, no I/O.

use super::error::Error;
use crate::engine::{Emission, Millis, SessionKey, SessionState, TenantStats};
use serde::{de::DeserializeOwned, Serialize};

/// Column family of per-key state.
pub(crate) const CF_SESSIONS: &str = "sessions";
/// Column family of timers in firing order.
pub(crate) const CF_TIMERS: &str = "timers";
/// Column family of owed emissions in FIFO order.
pub(crate) const CF_OUTBOX: &str = "outbox";
/// Column family of per-partition bookkeeping.
pub(crate) const CF_META: &str = "meta";
/// Column family of per-tenant learned-delay statistics (`engine::learn`).
pub(crate) const CF_TENANTS: &str = "tenants";
/// Every column family the store opens (RocksDB's `default` is opened too and left empty).
pub(crate) const COLUMN_FAMILIES: [&str; 5] =
    [CF_SESSIONS, CF_TIMERS, CF_OUTBOX, CF_META, CF_TENANTS];

/// Version of this layout, stored in `meta` under `format_version`. Bump it on any change to a
/// key or value encoding; `PartitionStore::open` refuses a store of another version.
pub const FORMAT_VERSION: u64 = 1;

/// `meta` keys. Values are 8-byte big-endian integers except `timer_floor` (a timer key).
pub(crate) const META_FORMAT_VERSION: &[u8] = b"format_version";
pub(crate) const META_OFFSET: &[u8] = b"offset";
pub(crate) const META_PARTITION_TIME: &[u8] = b"partition_time";
pub(crate) const META_OUTBOX_NEXT_SEQ: &[u8] = b"outbox_next_seq";
pub(crate) const META_OUTBOX_HEAD: &[u8] = b"outbox_head";
pub(crate) const META_OUTBOX_LEN: &[u8] = b"outbox_len";
pub(crate) const META_SESSIONS: &[u8] = b"sessions";
pub(crate) const META_OPEN_ROUNDS: &[u8] = b"open_rounds";
pub(crate) const META_TIMER_FLOOR: &[u8] = b"timer_floor";

/// A timer floor above every timer key: a timer key is 8 due bytes then UTF-8 session key
/// bytes, and UTF-8 never contains the byte `0xFF`, so no timer key is `≥ [0xFF; 9]`.
/// Used as "the store has no live timer".
pub(crate) const TIMER_FLOOR_END: [u8; 9] = [0xFF; 9];

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

/// Timer key: `encode_due(due) ‖ session key bytes`. Byte order = `(due, key)` order, the
/// order `engine::MemTable` fires in (a `str` compares by its bytes).
pub fn timer_key(due: Millis, key: &SessionKey) -> Vec<u8> {
    let mut k = Vec::with_capacity(8 + key.as_str().len());
    k.extend_from_slice(&encode_due(due));
    k.extend_from_slice(key.as_str().as_bytes());
    k
}

/// Splits a timer key into `(due, session key)`. The error text says what is wrong.
pub fn decode_timer_key(bytes: &[u8]) -> Result<(Millis, SessionKey), String> {
    let (due, key) = bytes
        .split_first_chunk::<8>()
        .ok_or_else(|| format!("timer key of {} bytes, need at least 9", bytes.len()))?;
    Ok((decode_due(*due), decode_session_key(key)?))
}

/// A session key from its stored bytes (`tenant/session`, UTF-8).
pub(crate) fn decode_session_key(bytes: &[u8]) -> Result<SessionKey, String> {
    let s = std::str::from_utf8(bytes).map_err(|e| format!("session key is not UTF-8: {e}"))?;
    SessionKey::parse(s).ok_or_else(|| "session key is not tenant/session".to_string())
}

/// Due time of an encoded timer key (its first 8 bytes); `None` if the key is too short.
pub(crate) fn timer_key_due(bytes: &[u8]) -> Option<Millis> {
    bytes.first_chunk::<8>().map(|d| decode_due(*d))
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

/// Encodes a `sessions` value (postcard) into `buf`, cleared first, so one buffer serves
/// every state of a commit. Returns the buffer.
pub(crate) fn encode_state_into(state: &SessionState, mut buf: Vec<u8>) -> Result<Vec<u8>, Error> {
    buf.clear();
    postcard::to_extend(state, buf).map_err(|e| Error::Encode {
        cf: CF_SESSIONS,
        reason: e.to_string(),
    })
}

/// Decodes a `sessions` value stored under `key`.
pub(crate) fn decode_state(key: &[u8], bytes: &[u8]) -> Result<SessionState, Error> {
    decode(CF_SESSIONS, key, bytes)
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

/// Encodes an `outbox` value.
pub(crate) fn encode_emission(emission: &Emission) -> Result<Vec<u8>, Error> {
    encode(CF_OUTBOX, emission)
}

/// Decodes an `outbox` value stored under `key`.
pub(crate) fn decode_emission(key: &[u8], bytes: &[u8]) -> Result<Emission, Error> {
    decode(CF_OUTBOX, key, bytes)
}

fn encode<T: Serialize>(cf: &'static str, value: &T) -> Result<Vec<u8>, Error> {
    postcard::to_allocvec(value).map_err(|e| Error::Encode {
        cf,
        reason: e.to_string(),
    })
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
    fn timer_keys_order_like_due_then_key() {
        let a = SessionKey::new("t", "a");
        let ab = SessionKey::new("t", "ab");
        let b = SessionKey::new("t", "b");
        let mut pairs = vec![
            (5, b.clone()),
            (5, ab.clone()),
            (-5, b.clone()),
            (5, a.clone()),
        ];
        let mut by_bytes = pairs.clone();
        pairs.sort();
        by_bytes.sort_by_key(|(d, k)| timer_key(*d, k));
        assert_eq!(pairs, by_bytes);
        for (d, k) in pairs {
            assert_eq!(decode_timer_key(&timer_key(d, &k)), Ok((d, k)));
        }
    }

    #[test]
    fn floor_end_is_above_every_timer_key() {
        let k = SessionKey::new("zzz", "\u{10FFFF}");
        assert!(timer_key(i64::MAX, &k).as_slice() < TIMER_FLOOR_END.as_slice());
    }

    #[test]
    fn bad_keys_are_reported() {
        assert!(decode_timer_key(b"short").is_err());
        assert!(decode_timer_key(&[0x80, 0, 0, 0, 0, 0, 0, 0, b'x']).is_err());
        assert!(decode_timer_key(&[0x80, 0, 0, 0, 0, 0, 0, 0, 0xC3]).is_err());
        assert!(decode_outbox_key(b"1234567").is_err());
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
        let buf = encode_state_into(&state, dirty).unwrap();
        assert_eq!(buf, postcard::to_allocvec(&state).unwrap());
        assert_eq!(decode_state(b"t/s", &buf).unwrap(), state);
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
        let err = decode_state(b"t/s", &[0xFF, 0xFF, 0xFF]).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("sessions") && text.contains("t/s"), "{text}");
    }
}
