//! The JSON Schemas in `config/schema/` and the codec agree: every sample upload gets the
//! same verdict from `upload.schema.json` and from `decode_upload`, except the documented
//! rules JSON Schema cannot express (checked here to stay exactly those), and every
//! `encode_ready` output validates against `ready.schema.json`.

use serde_json::{json, Value};
use settle::codec::{decode_upload, encode_ready, ATTRIBUTES_MAX_BYTES, ATTRIBUTES_MAX_DEPTH};
use settle::engine::{Emission, EventIds, PolicyName, SessionKey, Trigger};
use std::path::Path;

fn validator(name: &str) -> jsonschema::Validator {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("config/schema")
        .join(name);
    let schema: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert!(
        jsonschema::draft202012::meta::is_valid(&schema),
        "{name} is not a valid draft 2020-12 schema"
    );
    jsonschema::draft202012::options()
        .should_validate_formats(true)
        .build(&schema)
        .unwrap()
}

/// Objects nested `levels` deep, `{"a":{"a":…{"a":1}…}}`.
fn nested(levels: usize) -> String {
    format!("{}1{}", r#"{"a":"#.repeat(levels), "}".repeat(levels))
}

/// Decodes `payload` as a record keyed `tenant/session` of its own fields (the record key
/// rules are not what the schema is about; a key is always given).
fn decode(payload: &str) -> Result<settle::engine::Upload, settle::codec::DecodeError> {
    let v: Value = serde_json::from_str(payload).unwrap_or_default();
    let key = match (v["tenant"].as_str(), v["session"].as_str()) {
        (Some(t), Some(s)) => format!("{t}/{s}"),
        _ => "x/y".into(),
    };
    decode_upload(Some(key.as_bytes()), payload.as_bytes(), 0, 0)
}

/// `None` = the decoder accepts it; `Some(reason)` = it rejects it with that reason.
fn samples() -> Vec<(&'static str, String, Option<&'static str>)> {
    let s = |t: &str| t.to_owned();
    let mut v = vec![
        ("minimal", s(r#"{"tenant":"acme","session":"s1"}"#), None),
        (
            "every field",
            s(
                r#"{"tenant":"acme.eu:1_-","session":"run/42 x","event_id":"e1",
                 "part":{"index":2,"count":2},"final":true,"attributes":{"a":[1,{"b":null}]}}"#,
            ),
            None,
        ),
        (
            "nulls",
            s(
                r#"{"tenant":"a","session":"s","event_id":null,"part":null,"final":null,"attributes":null}"#,
            ),
            None,
        ),
        (
            "trace line",
            s(r#"{"ts":"2026-01-01T00:00:00.000Z","partition":7,"tenant":"a","session":"s"}"#),
            None,
        ),
        (
            "attributes nested 64 levels",
            format!(
                r#"{{"tenant":"a","session":"s","attributes":{}}}"#,
                nested(ATTRIBUTES_MAX_DEPTH)
            ),
            None,
        ),
        (
            "unicode session",
            s(r#"{"tenant":"a","session":"日本語 🚀/é"}"#),
            None,
        ),
        (
            "part max",
            s(r#"{"tenant":"a","session":"s","part":{"index":4294967295,"count":4294967295}}"#),
            None,
        ),
        (
            "final false",
            s(r#"{"tenant":"a","session":"s","final":false}"#),
            None,
        ),
        (
            "empty event id",
            s(r#"{"tenant":"a","session":"s","event_id":""}"#),
            None,
        ),
        (
            "missing tenant",
            s(r#"{"session":"s"}"#),
            Some("missing_tenant"),
        ),
        (
            "missing session",
            s(r#"{"tenant":"a"}"#),
            Some("missing_session"),
        ),
        (
            "tenant number",
            s(r#"{"tenant":1,"session":"s"}"#),
            Some("tenant_not_string"),
        ),
        (
            "tenant null",
            s(r#"{"tenant":null,"session":"s"}"#),
            Some("tenant_not_string"),
        ),
        (
            "tenant empty",
            s(r#"{"tenant":"","session":"s"}"#),
            Some("empty_tenant"),
        ),
        (
            "tenant space",
            s(r#"{"tenant":"a b","session":"s"}"#),
            Some("bad_tenant"),
        ),
        (
            "tenant slash",
            s(r#"{"tenant":"a/b","session":"s"}"#),
            Some("bad_tenant"),
        ),
        (
            "tenant non-ascii",
            s(r#"{"tenant":"é","session":"s"}"#),
            Some("bad_tenant"),
        ),
        (
            "session empty",
            s(r#"{"tenant":"a","session":""}"#),
            Some("empty_session"),
        ),
        (
            "session array",
            s(r#"{"tenant":"a","session":["s"]}"#),
            Some("session_not_string"),
        ),
        (
            "session newline",
            s(r#"{"tenant":"a","session":"a\nb"}"#),
            Some("session_control_char"),
        ),
        (
            "session NUL",
            s(r#"{"tenant":"a","session":"\u0000"}"#),
            Some("session_control_char"),
        ),
        (
            "session DEL",
            s("{\"tenant\":\"a\",\"session\":\"a\u{7f}\"}"),
            Some("session_control_char"),
        ),
        (
            "session C1",
            s(r#"{"tenant":"a","session":"x\u0085"}"#),
            Some("session_control_char"),
        ),
        (
            "event id number",
            s(r#"{"tenant":"a","session":"s","event_id":7}"#),
            Some("event_id_not_string"),
        ),
        (
            "part index 0",
            s(r#"{"tenant":"a","session":"s","part":{"index":0,"count":1}}"#),
            Some("part_index_out_of_range"),
        ),
        (
            "part count 0",
            s(r#"{"tenant":"a","session":"s","part":{"index":1,"count":0}}"#),
            Some("part_count_zero"),
        ),
        (
            "part no count",
            s(r#"{"tenant":"a","session":"s","part":{"index":1}}"#),
            Some("bad_part"),
        ),
        (
            "part negative",
            s(r#"{"tenant":"a","session":"s","part":{"index":-1,"count":1}}"#),
            Some("bad_part"),
        ),
        (
            "part over u32",
            s(r#"{"tenant":"a","session":"s","part":{"index":1,"count":4294967296}}"#),
            Some("bad_part"),
        ),
        (
            "part string",
            s(r#"{"tenant":"a","session":"s","part":{"index":"1","count":1}}"#),
            Some("bad_part"),
        ),
        (
            "part array",
            s(r#"{"tenant":"a","session":"s","part":[1,1]}"#),
            Some("bad_part"),
        ),
        (
            "final string",
            s(r#"{"tenant":"a","session":"s","final":"yes"}"#),
            Some("final_not_bool"),
        ),
        (
            "final number",
            s(r#"{"tenant":"a","session":"s","final":1}"#),
            Some("final_not_bool"),
        ),
        (
            "attributes array",
            s(r#"{"tenant":"a","session":"s","attributes":[]}"#),
            Some("attributes_not_object"),
        ),
        (
            "attributes string",
            s(r#"{"tenant":"a","session":"s","attributes":"{}"}"#),
            Some("attributes_not_object"),
        ),
        ("array", s("[]"), Some("not_an_object")),
        ("string", s(r#""acme/s""#), Some("not_an_object")),
        ("null", s("null"), Some("not_an_object")),
    ];
    // Byte limits with ASCII text, where bytes = characters.
    let ascii = |n: usize| "x".repeat(n);
    v.push((
        "tenant 128",
        format!(r#"{{"tenant":"{}","session":"s"}}"#, ascii(128)),
        None,
    ));
    v.push((
        "tenant 129",
        format!(r#"{{"tenant":"{}","session":"s"}}"#, ascii(129)),
        Some("tenant_too_long"),
    ));
    v.push((
        "session 256",
        format!(r#"{{"tenant":"a","session":"{}"}}"#, ascii(256)),
        None,
    ));
    v.push((
        "session 257",
        format!(r#"{{"tenant":"a","session":"{}"}}"#, ascii(257)),
        Some("session_too_long"),
    ));
    v.push((
        "event id 128",
        format!(
            r#"{{"tenant":"a","session":"s","event_id":"{}"}}"#,
            ascii(128)
        ),
        None,
    ));
    v.push((
        "event id 129",
        format!(
            r#"{{"tenant":"a","session":"s","event_id":"{}"}}"#,
            ascii(129)
        ),
        Some("event_id_too_long"),
    ));
    v
}

/// Records the decoder rejects and the schema cannot: the documented differences.
fn decoder_only() -> Vec<(&'static str, String, &'static str)> {
    let big = format!(r#"{{"k":"{}"}}"#, "x".repeat(ATTRIBUTES_MAX_BYTES));
    vec![
        (
            "attributes nested 65 levels",
            format!(
                r#"{{"tenant":"a","session":"s","attributes":{}}}"#,
                nested(ATTRIBUTES_MAX_DEPTH + 1)
            ),
            "attributes_too_deep",
        ),
        (
            "index > count",
            r#"{"tenant":"a","session":"s","part":{"index":3,"count":2}}"#.into(),
            "part_index_out_of_range",
        ),
        (
            "attributes > 16 KiB",
            format!(r#"{{"tenant":"a","session":"s","attributes":{big}}}"#),
            "attributes_too_large",
        ),
        (
            "session 129 × é = 258 bytes",
            format!(r#"{{"tenant":"a","session":"{}"}}"#, "é".repeat(129)),
            "session_too_long",
        ),
        (
            "event id 43 × € = 129 bytes",
            format!(
                r#"{{"tenant":"a","session":"s","event_id":"{}"}}"#,
                "€".repeat(43)
            ),
            "event_id_too_long",
        ),
        (
            "duplicate tenant",
            r#"{"tenant":"a","tenant":"b","session":"s"}"#.into(),
            "duplicate_field",
        ),
        (
            "integral float",
            r#"{"tenant":"a","session":"s","part":{"index":1.0,"count":1}}"#.into(),
            "bad_part",
        ),
    ]
}

#[test]
fn upload_schema_and_decoder_agree() {
    let schema = validator("upload.schema.json");
    let mut accepted = 0;
    for (name, payload, expected) in samples() {
        let value: Value = serde_json::from_str(&payload).unwrap();
        let decoded = decode(&payload);
        assert_eq!(
            decoded.as_ref().err().map(|e| e.reason()),
            expected,
            "decoder on {name}: {decoded:?}"
        );
        let errors: Vec<String> = schema.iter_errors(&value).map(|e| e.to_string()).collect();
        assert_eq!(
            errors.is_empty(),
            expected.is_none(),
            "schema on {name}: {errors:?}"
        );
        accepted += usize::from(expected.is_none());
    }
    assert!(accepted >= 10, "too few good samples: {accepted}");
}

#[test]
fn schema_limits_are_exactly_the_documented_differences() {
    let schema = validator("upload.schema.json");
    for (name, payload, reason) in decoder_only() {
        let value: Value = serde_json::from_str(&payload).unwrap();
        assert!(
            schema.is_valid(&value),
            "{name}: the schema now rejects it; move it to samples()"
        );
        let e = decode(&payload).unwrap_err();
        assert_eq!(e.reason(), reason, "{name}");
    }
}

fn emission(trigger: Trigger, attributes: Option<&str>, event_id: Option<&str>) -> Emission {
    Emission {
        key: SessionKey::new("acme.eu", "run/42 日本"),
        state_created_at: 1_796_000_000_000,
        generation: 12,
        trigger,
        uploads: 700,
        first_upload_at: 1_796_009_000_000,
        last_upload_at: 1_796_009_687_123,
        due_at: 1_796_009_697_123,
        delay_ms: 10_000,
        policy: PolicyName::Adaptive,
        last_event_id: event_id.map(str::to_owned),
        attributes: attributes.map(str::to_owned),
        event_ids: None,
    }
}

#[test]
fn encoded_ready_records_validate() {
    let schema = validator("ready.schema.json");
    for trigger in Trigger::ALL {
        for (attributes, event_id) in [(None, None), (Some(r#"{"a":{"b":[1]}}"#), Some("e-1"))] {
            let bytes = encode_ready(
                &emission(trigger, attributes, event_id),
                1_796_009_697_150,
                "normal",
            );
            let value: Value = serde_json::from_slice(&bytes).unwrap();
            let errors: Vec<String> = schema.iter_errors(&value).map(|e| e.to_string()).collect();
            assert!(errors.is_empty(), "{value}: {errors:?}");
        }
    }
    // With the round's event ids (`event-ids = N`): listed, counted, or an empty list.
    for (listed, dropped) in [(&["e-1", "e-\"2\"", "日本"][..], 5), (&[][..], 0)] {
        let mut ids = EventIds::default();
        for id in listed {
            ids.push(id, 64);
        }
        ids.add_dropped(dropped);
        let em = Emission {
            event_ids: Some(Box::new(ids)),
            ..emission(Trigger::Trailing, None, Some("e-1"))
        };
        let value: Value = serde_json::from_slice(&encode_ready(&em, 0, "normal")).unwrap();
        let errors: Vec<String> = schema.iter_errors(&value).map(|e| e.to_string()).collect();
        assert!(errors.is_empty(), "{value}: {errors:?}");
        assert_eq!(value["event_ids"].as_array().unwrap().len(), listed.len());
        assert_eq!(value["event_ids_dropped"], dropped);
    }
}

#[test]
fn ready_schema_rejects_what_the_codec_never_writes() {
    let schema = validator("ready.schema.json");
    let bytes = encode_ready(
        &emission(Trigger::Final, Some("{}"), Some("e")),
        0,
        "limited",
    );
    let good: Value = serde_json::from_slice(&bytes).unwrap();
    assert!(schema.is_valid(&good));
    let mut cases: Vec<(&str, Value)> = Vec::new();
    let mut with = |name, f: &dyn Fn(&mut serde_json::Map<String, Value>)| {
        let mut v = good.clone();
        f(v.as_object_mut().unwrap());
        cases.push((name, v));
    };
    with("extra field", &|o| {
        o.insert("extra".into(), json!(1));
    });
    with("missing tier", &|o| {
        o.remove("tier");
    });
    with("epoch instant", &|o| {
        o.insert("due_at".into(), json!(1_796_009_697_123_i64));
    });
    with("seconds instant", &|o| {
        o.insert("due_at".into(), json!("2026-11-30T03:34:57Z"));
    });
    with("unknown trigger", &|o| {
        o.insert("trigger".into(), json!("soon"));
    });
    with("generation 0", &|o| {
        o.insert("generation".into(), json!(0));
    });
    with("emission id without the state's creation time", &|o| {
        o.insert("emission_id".into(), json!("acme.eu/run/42 日本/12"));
    });
    with("attributes array", &|o| {
        o.insert("attributes".into(), json!([]));
    });
    with("event ids without the dropped count", &|o| {
        o.insert("event_ids".into(), json!(["e"]));
    });
    with("a dropped count without event ids", &|o| {
        o.insert("event_ids_dropped".into(), json!(0));
    });
    with("an event id that is not a string", &|o| {
        o.insert("event_ids".into(), json!([7]));
        o.insert("event_ids_dropped".into(), json!(0));
    });
    with("a negative dropped count", &|o| {
        o.insert("event_ids".into(), json!([]));
        o.insert("event_ids_dropped".into(), json!(-1));
    });
    for (name, v) in cases {
        assert!(!schema.is_valid(&v), "{name} should be rejected");
    }
}

#[test]
fn a_record_without_a_key_is_dead_lettered_whatever_its_payload() {
    let payload = br#"{"tenant":"acme","session":"s1"}"#;
    let e = decode_upload(None, payload, 0, 0).unwrap_err();
    assert_eq!(e.reason(), "missing_key");
    assert!(decode_upload(Some(b"acme/s1"), payload, 0, 0).is_ok());
}
