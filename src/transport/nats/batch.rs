//! The body of a batched changelog message (ARCHITECTURE "changelog", NATS): many store
//! changes in one JetStream message, so the server stores one message per flush instead of
//! one per changed key (a JetStream message costs nats-server about 10 µs of CPU whatever
//! its size; one change inside a batch about 0.2 µs: BENCHMARKS "NATS changelog batches").
//!
//! # Layout
//!
//! `SCB1` (4 bytes), then per change: key length (u32 LE), key bytes, tag (u8: `0` put,
//! `1` delete), and for a put the value length (u32 LE) and value bytes. Changes are in
//! store write order; a restore applies them in that order.
//!
//! [`split`] cuts one append's changes into bodies of at most [`BATCH_MAX_BYTES`] (a change
//! larger than that goes alone in its own body); [`decode`] reads a body back.

use crate::store::Change;

/// The first four bytes of a batch body (format version 1).
pub const MAGIC: &[u8; 4] = b"SCB1";

/// Most bytes one batch body holds, unless a single change is larger (then it goes alone).
/// Below nats-server's default `max_payload` (1 MiB) with room for headers.
pub const BATCH_MAX_BYTES: usize = 256 * 1024;

/// Encoded size of `change` inside a body (bytes).
pub fn encoded_len(change: &Change) -> usize {
    4 + change.key.len() + 1 + change.value.as_ref().map_or(0, |v| 4 + v.len())
}

/// Appends `change` to `body`.
fn put(body: &mut Vec<u8>, change: &Change) {
    body.extend_from_slice(&(change.key.len() as u32).to_le_bytes());
    body.extend_from_slice(&change.key);
    match &change.value {
        Some(v) => {
            body.push(0);
            body.extend_from_slice(&(v.len() as u32).to_le_bytes());
            body.extend_from_slice(v);
        }
        None => body.push(1),
    }
}

/// Cuts `changes` (in order) into bodies of at most `max` bytes each (a change larger than
/// `max` alone in its own body); returns each body with the index range of the changes it
/// holds. Empty `changes`: no body.
pub fn split(changes: &[Change], max: usize) -> Vec<(Vec<u8>, std::ops::Range<usize>)> {
    let mut out = Vec::new();
    let mut start = 0;
    while start < changes.len() {
        let mut size = MAGIC.len();
        let mut end = start;
        while end < changes.len() {
            let n = encoded_len(&changes[end]);
            if end > start && size + n > max {
                break;
            }
            size += n;
            end += 1;
        }
        let mut body = Vec::with_capacity(size);
        body.extend_from_slice(MAGIC);
        for c in &changes[start..end] {
            put(&mut body, c);
        }
        out.push((body, start..end));
        start = end;
    }
    out
}

/// The changes of batch body `body`, in order.
///
/// Errors: a text saying what is wrong (no magic, a length past the end, an unknown tag);
/// the caller reports the message as not a settle record.
pub fn decode(body: &[u8]) -> Result<Vec<Change>, String> {
    let rest = body
        .strip_prefix(MAGIC.as_slice())
        .ok_or("no SCB1 batch header")?;
    let mut at = 0usize;
    let mut out = Vec::new();
    let take = |at: &mut usize, n: usize| -> Result<&[u8], String> {
        let end = at
            .checked_add(n)
            .filter(|e| *e <= rest.len())
            .ok_or_else(|| format!("batch cut short at byte {}", *at + MAGIC.len()))?;
        let s = &rest[*at..end];
        *at = end;
        Ok(s)
    };
    let len = |at: &mut usize| -> Result<usize, String> {
        let b = take(at, 4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
    };
    while at < rest.len() {
        let n = len(&mut at)?;
        let key = take(&mut at, n)?.to_vec();
        let tag = take(&mut at, 1)?[0];
        let value = match tag {
            0 => {
                let n = len(&mut at)?;
                Some(take(&mut at, n)?.to_vec())
            }
            1 => None,
            t => return Err(format!("unknown change tag {t} in batch")),
        };
        out.push(Change { key, value });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn change() -> impl Strategy<Value = Change> {
        (
            proptest::collection::vec(any::<u8>(), 0..40),
            proptest::option::of(proptest::collection::vec(any::<u8>(), 0..300)),
        )
            .prop_map(|(key, value)| Change { key, value })
    }

    proptest! {
        #[test]
        fn split_bodies_decode_to_the_changes_in_order(
            changes in proptest::collection::vec(change(), 0..60),
            max in 1usize..2_000,
        ) {
            let bodies = split(&changes, max);
            let mut back = Vec::new();
            let mut next = 0;
            for (body, range) in &bodies {
                prop_assert_eq!(range.start, next);
                prop_assert!(range.end > range.start, "no empty body");
                // Within the bound, unless the body holds one change that alone exceeds it.
                prop_assert!(body.len() <= max || range.len() == 1, "{} > {max}", body.len());
                let got = decode(body).map_err(TestCaseError::fail)?;
                prop_assert_eq!(&got[..], &changes[range.clone()]);
                back.extend(got);
                next = range.end;
            }
            prop_assert_eq!(next, changes.len());
            prop_assert_eq!(back, changes);
        }
    }

    #[test]
    fn a_damaged_body_is_an_error_not_a_panic() {
        let c = Change {
            key: b"sessions\0a/b".to_vec(),
            value: Some(vec![7; 10]),
        };
        let (body, _) = split(std::slice::from_ref(&c), BATCH_MAX_BYTES).remove(0);
        assert_eq!(decode(&body).unwrap(), vec![c.clone()]);
        for cut in 0..body.len() {
            let r = decode(&body[..cut]);
            if cut < MAGIC.len() {
                assert!(r.unwrap_err().contains("SCB1"));
            } else if cut > MAGIC.len() {
                assert!(r.unwrap_err().contains("cut short"), "cut at {cut}");
            } else {
                assert_eq!(r.unwrap(), vec![], "the header alone is an empty batch");
            }
        }
        let mut bad = body.clone();
        bad[4 + 4 + c.key.len()] = 9;
        assert!(decode(&bad).unwrap_err().contains("unknown change tag 9"));
    }
}
