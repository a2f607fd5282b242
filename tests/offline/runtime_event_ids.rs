//! A round's event ids (SEMANTICS §2 `event_ids`, `event-ids = N`) through the runtime on real
//! RocksDB and the memory transport, in paused tokio time: they are part of the round's
//! stored state, so they survive a restart, a crash between "durable" and "acked" (every
//! copy of an emission lists the same ids) and a handoff through the changelog; with
//! `event-ids = 0` the published record is today's, byte for byte.

use crate::runtime_support;

use runtime_support::*;
use settle::codec::format_rfc3339_ms;
use settle::engine::{Emission, PolicySpec, SessionKey, Upload};
use std::collections::BTreeMap;

const DELAY: i64 = 1_000;

/// Produces an upload of `acme/session` at `ts` with `event_id`; returns it as the engine
/// sees it (for the reference replay).
fn produce_id(f: &Fixture, session: &str, event_id: &str, ts: i64) -> Upload {
    let json = format!(r#"{{"tenant":"acme","session":"{session}","event_id":"{event_id}"}}"#);
    f.broker
        .produce_upload(&format!("acme/{session}"), &json, ts);
    Upload {
        event_id: Some(event_id.to_owned()),
        ..Upload::plain(SessionKey::new("acme", session), ts)
    }
}

/// Five uploads per session of `sessions` (ids `s-1` … `s-5`, the third one redelivered
/// right after itself), all at `T0`.
fn produce_rounds(f: &Fixture, sessions: &[&str]) -> Vec<Upload> {
    let mut uploads = Vec::new();
    for s in sessions {
        for i in 1..=5 {
            let id = format!("{s}-{i}");
            uploads.push(produce_id(f, s, &id, T0));
            if i == 3 {
                uploads.push(produce_id(f, s, &id, T0));
            }
        }
    }
    uploads
}

/// The event ids an emission lists and how many it dropped; `None` without a list.
type ListedIds = Option<(Vec<String>, u32)>;

/// `(emission id, listed ids, dropped)` of an emission.
fn listed(e: &Emission) -> (String, ListedIds) {
    let ids = e
        .event_ids
        .as_ref()
        .map(|ids| (ids.iter().map(str::to_owned).collect(), ids.dropped()));
    (e.emission_id(), ids)
}

#[tokio::test(start_paused = true)]
async fn event_ids_survive_a_restart_and_every_copy_lists_the_same_ids() {
    let f = fixture(2, PolicySpec::fixed(DELAY).with_event_ids(3));
    let uploads = produce_rounds(&f, &["a", "b", "c", "d"]);

    // Run 1: every upload applied, nothing due yet; the ids are in the stored rounds.
    f.run_until(|m| {
        (0..2).all(|p| {
            m.get(&p)
                .is_some_and(|s| s.next_offset == Some(f.broker.end_offset(p)))
        })
    })
    .await;
    assert!(f.broker.output().is_empty());
    let mut stored = 0;
    for p in 0..2 {
        let store = f.store(p);
        for s in ["a", "b", "c", "d"] {
            let Some(state) = store.session(&SessionKey::new("acme", s)).unwrap() else {
                continue;
            };
            let round = state.round.expect("an open round");
            let ids = round.event_ids.expect("the round keeps its ids");
            assert_eq!(
                ids.iter().collect::<Vec<_>>(),
                [format!("{s}-1"), format!("{s}-2"), format!("{s}-3")],
                "the redelivered {s}-3 is listed once"
            );
            assert_eq!((round.uploads, ids.dropped()), (5, 2));
            stored += 1;
        }
    }
    assert_eq!(stored, 4);

    // Run 2: the rounds fire; the broker stores each record but its acks are lost.
    f.broker.lose_acks();
    let run = f.start();
    run.until(|m| {
        all(m, 2, |s| s.pending_rounds == 0 && s.caught_up)
            && m.values().map(|s| s.emissions).sum::<u64>() == 4
    })
    .await;
    while f.broker.output_len() < 4 {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    run.stop().await;

    // Run 3: the outbox is published again, each emission with the ids it had.
    f.broker.set_sink_available(true);
    for _ in 0..2 {
        f.run_until(|m| all(m, 2, |s| s.is_idle())).await;
    }
    let mut copies: BTreeMap<String, Vec<ListedIds>> = BTreeMap::new();
    for (e, _) in emitted(&f.broker) {
        let (id, ids) = listed(&e);
        copies.entry(id).or_default().push(ids);
    }
    let want: BTreeMap<String, Vec<ListedIds>> = reference(&f.engine, &uploads)
        .iter()
        .map(|e| {
            let (id, ids) = listed(e);
            (id, vec![ids.clone(), ids])
        })
        .collect();
    assert_eq!(want.len(), 4);
    assert_eq!(copies, want, "two copies of each emission, the same ids");
}

#[tokio::test(start_paused = true)]
async fn a_new_owner_restores_the_event_ids_from_the_changelog() {
    let f = fixture(2, PolicySpec::fixed(10_000).with_event_ids(8));
    f.broker.enable_changelog();
    let (dir_a, dir_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let uploads = produce_rounds(&f, &["a", "b", "c", "d", "e", "f"]);
    let a = f.start_member("a", dir_a.path(), &[0, 1]);
    a.until(|m| {
        (0..2).all(|p| {
            m.get(&p)
                .is_some_and(|s| s.next_offset == Some(f.broker.end_offset(p)))
        })
    })
    .await;
    assert!(f.broker.output().is_empty(), "nothing is due yet");
    f.broker.revoke("a", &[0, 1]).await.unwrap();

    let b = f.start_member("b", dir_b.path(), &[]);
    f.broker.assign("b", &[0, 1]);
    b.until(|m| all(m, 2, |s| s.is_idle() && s.published > 0))
        .await;
    let mut got: Vec<_> = emitted(&f.broker).iter().map(|(e, _)| listed(e)).collect();
    let mut want: Vec<_> = reference(&f.engine, &uploads).iter().map(listed).collect();
    got.sort();
    want.sort();
    assert_eq!(want.len(), 6);
    assert_eq!(got, want);
    assert_eq!(
        want[0].1,
        Some((
            vec![
                "a-1".into(),
                "a-2".into(),
                "a-3".into(),
                "a-4".into(),
                "a-5".into()
            ],
            0
        ))
    );
    b.stop().await;
    a.stop().await;
}

#[tokio::test(start_paused = true)]
async fn without_event_ids_the_published_record_is_todays_bytes() {
    let f = fixture(1, PolicySpec::fixed(DELAY));
    produce_id(&f, "s", "e-1", T0);
    produce_id(&f, "s", "e-2", T0);
    f.run_until(|m| all(m, 1, |s| s.published == 1 && s.is_idle()))
        .await;
    let out = f.broker.output();
    assert_eq!(out.len(), 1);
    let emitted_at = settle::codec::decode_ready(&out[0].payload)
        .unwrap()
        .emitted_at;
    let (first, due) = (format_rfc3339_ms(T0), format_rfc3339_ms(T0 + DELAY));
    assert_eq!(
        String::from_utf8(out[0].payload.clone()).unwrap(),
        format!(
            concat!(
                r#"{{"tenant":"acme","session":"s","emission_id":"acme/s/{t0}/1","generation":1,"#,
                r#""trigger":"trailing","uploads":2,"first_upload_at":"{first}","last_upload_at":"{first}","#,
                r#""due_at":"{due}","emitted_at":"{emitted}","delay_ms":1000,"policy":"fixed","#,
                r#""tier":"normal","last_event_id":"e-2"}}"#
            ),
            t0 = T0,
            first = first,
            due = due,
            emitted = format_rfc3339_ms(emitted_at),
        )
    );
}
