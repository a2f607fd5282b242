//! `settle tune --from-nats` against a real NATS JetStream server: the uploads of a time
//! range read straight from the input stream (`trace_source::read_nats`) are exactly the
//! messages stored in that range (JetStream timestamps), with the `settle-key` header
//! checked; bad messages are counted by reason; and the CLI does the same end to end.
//!
//! The server is `SETTLE_TEST_NATS` (scripts/test.sh sets it) or 127.0.0.1:4222; with no
//! server there the test fails under CI (`CI` set) and says it did not run elsewhere.

use crate::nats_support;

use anyhow::{ensure, Result};
use nats_support::{server, Setup, STEP};
use settle::cli::trace_source::{read_nats, TimeRange};
use settle::codec;
use settle::engine::Millis;
use settle::transport::nats::{self, Storage};
use tokio::process::Command;

const PARTITIONS: u32 = 4;

fn upload(session: &str, n: u32) -> String {
    format!(r#"{{"tenant":"acme","session":"{session}","event_id":"{session}-{n}"}}"#)
}

#[tokio::test(flavor = "multi_thread")]
async fn tune_reads_a_time_range_from_the_nats_input_stream() -> Result<()> {
    let Some(addr) = server("tune_reads_a_time_range_from_the_nats_input_stream") else {
        return Ok(());
    };
    let setup = Setup::new(&addr, "tune", Storage::Memory, PARTITIONS).await?;
    let result = check(&setup, &addr).await;
    setup.cleanup().await;
    result
}

async fn check(setup: &Setup, addr: &str) -> Result<()> {
    // Batch A (to be left out by --since), then batch B with two bad messages.
    for s in 0..5 {
        setup
            .publish(
                &format!("acme/a{s}"),
                upload(&format!("a{s}"), 1).as_bytes(),
                None,
            )
            .await?;
    }
    let mut b_keys = Vec::new();
    for s in 0..10 {
        for n in 1..=2 {
            let key = format!("acme/b{s}");
            setup
                .publish(&key, upload(&format!("b{s}"), n).as_bytes(), None)
                .await?;
            b_keys.push(key);
        }
    }
    setup.publish("acme/bad", b"not json", None).await?;
    setup
        .publish("acme/other", upload("b0", 3).as_bytes(), None)
        .await?;

    // The stored timestamps decide the range: from B's first message to the last one.
    let stored = setup.input(5 + 20 + 2).await?;
    ensure!(stored.len() == 27, "{} stored", stored.len());
    let mut by_seq = stored.clone();
    by_seq.sort_by_key(|r| r.sequence);
    let since = by_seq[5].timestamp_ms;
    let until = by_seq.last().map_or(0, |r| r.timestamp_ms);
    // Messages of A stamped in the same millisecond as B's first are in the range too.
    let a_in_range = by_seq[..5]
        .iter()
        .filter(|r| r.timestamp_ms >= since)
        .count();

    let range = TimeRange {
        since: Some(since),
        until,
    };
    let read = read_nats(&setup.nats, &setup.nats.input_stream, range, false, None).await?;
    let s = &read.summary;
    ensure!(s.uploads == (20 + a_in_range) as u64, "{s}");
    ensure!(s.rejected.get("invalid_json") == Some(&1), "{s}");
    // The `settle-key` header says acme/other, the body acme/b0.
    ensure!(s.rejected.get("key_mismatch") == Some(&1), "{s}");
    ensure!(s.outside_range == 0, "{s}");
    let mut got: Vec<String> = read
        .trace
        .uploads
        .iter()
        .filter(|u| u.key.session().starts_with('b'))
        .map(|u| u.key.to_string())
        .collect();
    got.sort();
    b_keys.sort();
    ensure!(got == b_keys, "uploads {got:?}");
    // Event time = JetStream timestamp, partitions from the subjects.
    for u in &read.trace.uploads {
        let r = stored
            .iter()
            .find(|r| {
                // Decodes with `u`'s key only if the payload is `u`'s session.
                codec::decode_upload(Some(u.key.as_str().as_bytes()), &r.payload, 0, Millis::MAX)
                    .is_ok_and(|d| d.event_id == u.event_id)
            })
            .expect("a stored message");
        ensure!(u.event_time == r.timestamp_ms, "{:?}", u.key);
        ensure!(
            r.partition()
                == Some(nats::partition_for_key(
                    u.key.as_str().as_bytes(),
                    PARTITIONS
                )),
            "partition of {:?}",
            u.key
        );
    }

    // The CLI, with the server and names from the environment.
    let rfc = codec::format_rfc3339_ms;
    let settle = || {
        let mut c = Command::new(env!("CARGO_BIN_EXE_settle"));
        c.env("SETTLE_NATS__SERVERS", format!("nats://{addr}"))
            .env_remove("SETTLE_CONFIG");
        c
    };
    let out = tokio::time::timeout(
        STEP,
        settle()
            .args([
                "tune",
                "--from-nats",
                "--since",
                &rfc(since),
                "--until",
                &rfc(until),
                "--no-progress",
                "--sweep",
                "fixed:5s;adaptive:5s/10m;learn:off,on",
            ])
            .env("SETTLE_NATS__INPUT_STREAM", &setup.nats.input_stream)
            .env(
                "SETTLE_NATS__INPUT_SUBJECT_PREFIX",
                &setup.nats.input_subject_prefix,
            )
            // The partition count keys hash over: an upload on another partition is unusable,
            // as `settle run` dead-letters it (`wrong_partition`).
            .env("SETTLE_NATS__PARTITIONS", PARTITIONS.to_string())
            .output(),
    )
    .await??;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(out.status.success(), "tune failed:\n{stdout}\n{stderr}");
    ensure!(
        stderr.contains(&format!("nats stream {}", setup.nats.input_stream))
            && stderr.contains("invalid_json 1"),
        "{stderr}"
    );
    ensure!(
        stdout.contains(&format!(
            "{} uploads (2 unusable skipped), 3 settings",
            20 + a_in_range
        )),
        "{stdout}"
    );

    // A stream that does not exist is named in the error.
    let missing = format!("{}_NOPE", setup.nats.input_stream);
    let out = tokio::time::timeout(
        STEP,
        settle()
            .args(["tune", "--from-nats", "--topic", &missing, "--no-progress"])
            .output(),
    )
    .await??;
    ensure!(!out.status.success());
    ensure!(String::from_utf8_lossy(&out.stderr).contains(&missing));
    Ok(())
}
