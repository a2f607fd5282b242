//! The "session ready" output record (SEMANTICS §2): [`ReadyRecord`], its fields in wire
//! order; [`encode_ready`] / [`encode_ready_into`], an engine [`Emission`] → the record's JSON
//! bytes, written field by field (integers with `itoa`, instants digit by digit, no `format!`)
//! and held by tests to the bytes `serde_json` writes for [`ReadyRecord`]; [`decode_ready`],
//! the strict reverse for tests and tools; and [`EMISSION_ID_HEADER`], the header carrying
//! the emission id.

use super::scan::{scan_json, PLAIN_STRING_BYTE};
use super::time::rfc3339_ms;
use super::{write_rfc3339_ms, ATTRIBUTES_MAX_DEPTH};
use crate::engine::{Emission, EventIds, Millis, PolicyName, SessionKey, Trigger};
use serde::de;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

/// Header of every output record carrying its `emission_id` (SEMANTICS §2).
pub const EMISSION_ID_HEADER: &str = "settle-emission-id";

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
    /// levels is left out; it cannot happen for uploads that went through
    /// [`decode_upload`](super::decode_upload) (the engine carries the text unchanged).
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
/// [`ATTRIBUTES_MAX_DEPTH`] levels (what [`decode_upload`](super::decode_upload) lets through).
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
    if s.bytes().all(|b| PLAIN_STRING_BYTE[usize::from(b)]) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::{decode_upload, RFC3339_MAX_MS, RFC3339_MIN_MS};
    use proptest::prelude::{any, Strategy};

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
        let payload = br#"{"tenant":"a","session":"s","attributes":{ "k" : "\u00e9" }}"#;
        let u = decode_upload(Some(b"a/s"), payload, 0, 0).unwrap();
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
