//! Every kind of malformed record the codec knows, and valid records at the edges of the
//! upload format, through a real `settle run` process on Kafka (issue 16): each malformed
//! record is dead-lettered with its own reason, each valid one is applied, and every ready
//! record settle publishes parses with `settle consume` (serde_json) and with a second JSON
//! parser (Python's `json`, which raised RecursionError on the 5 000-level attributes that
//! were once passed through).
//!
//! `SETTLE_TEST_KAFKA=host:port` runs it (scripts/test.sh sets it); under CI a missing
//! broker is a failure.

use crate::kafka_support;
use crate::process_support;

use anyhow::{ensure, Context as _, Result};
use kafka_support::{broker, by_id, emitted, fresh_topics, now_ms, reference, trace_of};
use process_support::{sigterm, start_run, wait_for_rounds};
use settle::cli::loadgen::{self, OutRecord};
use settle::codec::{self, DecodeError};
use settle::engine::Emission;
use settle::transport::kafka::DLQ_REASON_HEADER;
use std::collections::{BTreeMap, BTreeSet};
use std::io::Write as _;
use std::process::Stdio;
use std::time::Duration;

/// Bound on any one wait on the broker or a process.
const STEP: Duration = Duration::from_secs(180);

/// `[runtime] shutdown-deadline` of the settle process.
const SHUTDOWN_DEADLINE: Duration = Duration::from_secs(10);

/// `attributes` nested `levels` deep: `{"a":{"a":...{}}}`.
fn nested(levels: usize) -> String {
    format!(
        "{}{{}}{}",
        r#"{"a":"#.repeat(levels - 1),
        "}".repeat(levels - 1)
    )
}

/// An upload of `h/<session>` with the raw JSON `extra` fields after `session`.
fn upload(session: &str, extra: &str) -> Vec<u8> {
    format!(
        r#"{{"tenant":"h","session":{},"event_id":"e1"{extra}}}"#,
        json(session)
    )
    .into_bytes()
}

fn json(s: &str) -> String {
    serde_json::to_string(s).expect("a string")
}

/// A record that breaks a rule: (key, value, reason).
type Malformed = (Option<Vec<u8>>, Vec<u8>, &'static str);

/// One malformed record per rule of SEMANTICS §2 that Kafka can break (all but
/// `wrong_partition`, which is NATS only): (key, value, reason).
fn malformed() -> Vec<Malformed> {
    let key = |k: &str| Some(k.as_bytes().to_vec());
    let t = |text: &str| text.as_bytes().to_vec();
    vec![
        (key("h/s"), b"\xff\xfe".to_vec(), "invalid_utf8"),
        (key("h/s"), t("{"), "invalid_json"),
        (key("h/s"), t("[]"), "not_an_object"),
        (
            key("h/s"),
            t(r#"{"tenant":"h","session":"s","session":"t"}"#),
            "duplicate_field",
        ),
        (key("h/s"), t(r#"{"session":"s"}"#), "missing_tenant"),
        (
            key("h/s"),
            t(r#"{"tenant":1,"session":"s"}"#),
            "tenant_not_string",
        ),
        (
            key("/s"),
            t(r#"{"tenant":"","session":"s"}"#),
            "empty_tenant",
        ),
        (
            key("h/s"),
            format!(r#"{{"tenant":"{}","session":"s"}}"#, "a".repeat(129)).into_bytes(),
            "tenant_too_long",
        ),
        (
            key("a b/s"),
            t(r#"{"tenant":"a b","session":"s"}"#),
            "bad_tenant",
        ),
        (key("h/s"), t(r#"{"tenant":"h"}"#), "missing_session"),
        (
            key("h/s"),
            t(r#"{"tenant":"h","session":false}"#),
            "session_not_string",
        ),
        (
            key("h/"),
            t(r#"{"tenant":"h","session":""}"#),
            "empty_session",
        ),
        (
            key("h/s"),
            format!(r#"{{"tenant":"h","session":"{}"}}"#, "s".repeat(257)).into_bytes(),
            "session_too_long",
        ),
        (
            key("h/\n"),
            t(r#"{"tenant":"h","session":"\n"}"#),
            "session_control_char",
        ),
        (
            key("h/s"),
            t(r#"{"tenant":"h","session":"s","event_id":{}}"#),
            "event_id_not_string",
        ),
        (
            key("h/s"),
            format!(
                r#"{{"tenant":"h","session":"s","event_id":"{}"}}"#,
                "e".repeat(129)
            )
            .into_bytes(),
            "event_id_too_long",
        ),
        (key("h/s"), upload("s", r#","part":1"#), "bad_part"),
        (
            key("h/s"),
            upload("s", r#","part":{"index":1,"count":0}"#),
            "part_count_zero",
        ),
        (
            key("h/s"),
            upload("s", r#","part":{"index":3,"count":2}"#),
            "part_index_out_of_range",
        ),
        (key("h/s"), upload("s", r#","final":0"#), "final_not_bool"),
        (
            key("h/s"),
            upload("s", r#","attributes":[]"#),
            "attributes_not_object",
        ),
        (
            key("h/s"),
            upload(
                "s",
                &format!(r#","attributes":{{"x":"{}"}}"#, "x".repeat(20_000)),
            ),
            "attributes_too_large",
        ),
        (
            key("h/s"),
            upload("s", &format!(r#","attributes":{}"#, nested(65))),
            "attributes_too_deep",
        ),
        // The poison record of the issue: 5 000 levels in 10 KB, under the size cap.
        (
            key("h/s"),
            upload(
                "s",
                &format!(
                    r#","attributes":{{"a":{}{}}}"#,
                    "[".repeat(5_000),
                    "]".repeat(5_000)
                ),
            ),
            "attributes_too_deep",
        ),
        (None, upload("s", ""), "missing_key"),
        (Some(b"\xff".to_vec()), upload("s", ""), "key_not_utf8"),
        (key("h/t"), upload("s", ""), "key_mismatch"),
    ]
}

/// Valid uploads at the edges of the format, one session each: (session, extra fields).
fn edges() -> Vec<(String, String)> {
    vec![
        ("deep-64".into(), format!(r#","attributes":{}"#, nested(64))),
        ("big".into(), format!(r#","attributes":{{"log":"{}"}}"#, "y".repeat(16_000))),
        ("escapes".into(), r#","attributes":{"s":"\u2028\u2029\u0000\"\\\/\b\f\n\r\t","pair":"\ud83d\ude00","raw":"😀 ünï"}"#.into()),
        ("numbers".into(), r#","attributes":{"a":1e308,"b":-0,"c":123456789012345678901234567890,"d":[1.5e-300,true,null]}"#.into()),
        ("a/b c/😀 ünï".into(), String::new()),
        ("split".into(), r#","part":{"index":1,"count":2},"final":null"#.into()),
        ("lone-surrogate".into(), r#","attributes":{"s":"\ud800"}"#.into()),
        ("final".into(), r#","final":true,"attributes":{}"#.into()),
    ]
}

#[test]
fn every_malformed_record_kind_through_settle_run() -> Result<()> {
    let Some(bootstrap) = broker("every_malformed_record_kind_through_settle_run") else {
        return Ok(());
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let (kafka, output) = fresh_topics(&rt, &bootstrap, "hostile", 2)?;
    let dir = tempfile::tempdir()?;
    let (config_path, config) =
        process_support::write_kafka_config(dir.path(), &kafka, &output, SHUTDOWN_DEADLINE)?;

    // What the codec says of each record decides what settle must do with it.
    let bad = malformed();
    let reasons: BTreeSet<&str> = bad.iter().map(|b| b.2).collect();
    let kafka_reasons: BTreeSet<&str> = DecodeError::ALL_REASONS
        .into_iter()
        .filter(|r| *r != "wrong_partition")
        .collect();
    ensure!(
        reasons == kafka_reasons,
        "the test must break every rule: {reasons:?}"
    );
    let t0 = now_ms() - 60_000;
    let mut records = Vec::new();
    let mut dead: BTreeMap<(Option<Vec<u8>>, Vec<u8>), &str> = BTreeMap::new();
    for (i, (key, payload, reason)) in bad.into_iter().enumerate() {
        let e = codec::decode_upload(key.as_deref(), &payload, 0, 0).expect_err("malformed");
        ensure!(e.reason() == reason, "{reason}: the codec says {e}");
        dead.insert((key.clone(), payload.clone()), reason);
        records.push(OutRecord {
            key,
            payload,
            timestamp_ms: Some(t0 + i as i64),
        });
    }
    for (i, (session, extra)) in edges().into_iter().enumerate() {
        let key = format!("h/{session}").into_bytes();
        let payload = upload(&session, &extra);
        if let Err(e) = codec::decode_upload(Some(&key), &payload, 0, 0) {
            // Only a string the JSON parser rejects may fall out here (a lone surrogate).
            ensure!(e.reason() == "invalid_json", "{session}: {e}");
            dead.insert((Some(key.clone()), payload.clone()), "invalid_json");
        }
        records.push(OutRecord {
            key: Some(key),
            payload,
            timestamp_ms: Some(t0 + 1_000 + i as i64),
        });
    }
    rt.block_on(loadgen::produce_all(&kafka, &kafka.input_topic, &records))?;
    let input = rt.block_on(loadgen::read_topic(
        &kafka,
        &kafka.input_topic,
        records.len(),
        STEP,
    ))?;
    let want = by_id(reference(&config, &trace_of(&input)?)?);

    let mut run = start_run(&config_path, &[])?;
    let got = wait_for_rounds(
        &mut run,
        want.len(),
        STEP,
        || rt.block_on(emitted(&kafka, &output, "normal", 0, STEP)),
        |(e, _)| e.emission_id(),
    )?;
    let dlq = rt.block_on(loadgen::read_topic(
        &kafka,
        &kafka.dead_letter_topic,
        dead.len(),
        STEP,
    ))?;
    sigterm(&mut run, SHUTDOWN_DEADLINE)?;
    // The reference went through serde_json (trace_of), which rewrites the attributes'
    // text; settle keeps the bytes as written. Compare attributes as JSON values.
    let as_value = |mut e: Emission| -> Result<(Emission, Option<serde_json::Value>)> {
        let attrs = e
            .attributes
            .take()
            .map(|a| serde_json::from_str(&a))
            .transpose()?;
        Ok((e, attrs))
    };
    let got: Vec<_> = by_id(got.into_iter().map(|(e, _)| e).collect())
        .into_iter()
        .map(as_value)
        .collect::<Result<_>>()?;
    let want: Vec<_> = want.into_iter().map(as_value).collect::<Result<_>>()?;
    ensure!(
        got == want,
        "emissions differ:\n got {got:?}\nwant {want:?}"
    );

    // Each malformed record once on the dead-letter topic, with its reason.
    ensure!(
        dlq.len() == dead.len(),
        "{} dead letters, want {}",
        dlq.len(),
        dead.len()
    );
    for d in &dlq {
        let reason = dead
            .get(&(d.key.clone(), d.payload.clone()))
            .with_context(|| format!("a dead letter of no malformed record: {:?}", d.key))?;
        let header = d
            .headers
            .iter()
            .find(|(k, _)| k == DLQ_REASON_HEADER)
            .map(|(_, v)| v.as_slice());
        ensure!(
            header == Some(reason.as_bytes()),
            "{reason}: header {header:?}"
        );
    }

    // Every ready record, as `settle consume` prints it, parses with serde_json and Python.
    let printed = process_support::consume_topic(&bootstrap, &output)?;
    let lines = process_support::lines_of(&printed);
    ensure!(
        lines.len() >= want.len(),
        "settle consume printed {} of {} records",
        lines.len(),
        want.len()
    );
    for l in &lines {
        let value: serde_json::Value = serde_json::from_slice(l).with_context(|| {
            format!(
                "settle consume printed a non-JSON line: {}",
                String::from_utf8_lossy(l)
            )
        })?;
        ensure!(
            value.is_object(),
            "settle consume printed a non-object (an escaped record?): {value}"
        );
        codec::decode_ready(l).context("a ready record")?;
    }
    let mut python = std::process::Command::new("python3")
        .args(["-c", "import json,sys\nn=0\nfor line in sys.stdin:\n    v=json.loads(line)\n    assert isinstance(v, dict) and v['emission_id'].startswith('h/'), line\n    n+=1\nprint(n)"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .context("python3")?;
    python.stdin.take().context("stdin")?.write_all(&printed)?;
    let out = python.wait_with_output()?;
    ensure!(
        out.status.success(),
        "Python's json rejected a ready record: {}",
        out.status
    );
    let parsed: usize = String::from_utf8_lossy(&out.stdout).trim().parse()?;
    ensure!(
        parsed == lines.len(),
        "python parsed {parsed} of {} lines",
        lines.len()
    );

    // The dead letters can be read back too (their values are printed as JSON strings).
    let dl = process_support::consume_topic(&bootstrap, &kafka.dead_letter_topic)?;
    let dl_lines = process_support::lines_of(&dl).len();
    ensure!(
        dl_lines == dlq.len(),
        "settle consume printed {dl_lines} of {} dead letters",
        dlq.len()
    );
    println!(
        "{} malformed records dead-lettered ({} reasons), {} rounds of edge uploads out; {} ready records parsed by serde_json and Python",
        dlq.len(),
        reasons.len(),
        want.len(),
        lines.len()
    );
    Ok(())
}
