//! Unit tests of the engine: every example of SEMANTICS §4 and the edge cases of §3–§4.

use super::*;

fn key(s: &str) -> SessionKey {
    SessionKey::new("t", s)
}

/// Runs `uploads` (event time = partition time) through a fresh driver over a [`MemTable`]
/// and flushes every pending round at the end. Returns `(due_at, trigger, uploads)` per emission.
fn run(spec: PolicySpec, uploads: &[Upload]) -> Vec<Emission> {
    let mut d = Driver::new(Engine::new(PolicyTable::uniform(spec)));
    let mut t = MemTable::new();
    let mut out = Vec::new();
    for u in uploads {
        d.apply(&mut t, u.event_time, u, &mut out).unwrap();
    }
    d.advance(&mut t, Millis::MAX / 2, &mut out).unwrap();
    out
}

fn at(times: &[Millis]) -> Vec<Upload> {
    times.iter().map(|&t| Upload::plain(key("s"), t)).collect()
}

fn summary(out: &[Emission]) -> Vec<(Millis, Trigger, u32)> {
    out.iter()
        .map(|e| (e.due_at, e.trigger, e.uploads))
        .collect()
}

#[test]
fn fixed_example_from_spec() {
    // SEMANTICS §4 fixed: delay 500, uploads at 0, 100, 200, 300 → one emission due 800.
    let out = run(PolicySpec::fixed(500), &at(&[0, 100, 200, 300]));
    assert_eq!(summary(&out), vec![(800, Trigger::Trailing, 4)]);
    let e = &out[0];
    assert_eq!((e.first_upload_at, e.last_upload_at), (0, 300));
    assert_eq!((e.generation, e.delay_ms), (1, 500));
    assert_eq!(e.emission_id(), "t/s/0/1");
    assert_eq!(e.policy, PolicyName::Fixed);
}

#[test]
fn leading_trailing_example_from_spec() {
    // delay 300 000: uploads at 0 and 5 000 → leading at 0, trailing at 305 000.
    let out = run(PolicySpec::leading_trailing(300_000), &at(&[0, 5_000]));
    assert_eq!(
        summary(&out),
        vec![(0, Trigger::Leading, 1), (305_000, Trigger::Trailing, 1)]
    );
    assert_eq!(out[1].first_upload_at, 5_000);
    assert_eq!(out[1].generation, 2);
}

#[test]
fn leading_trailing_single_upload_emits_exactly_once() {
    let out = run(PolicySpec::leading_trailing(300_000), &at(&[0]));
    assert_eq!(summary(&out), vec![(0, Trigger::Leading, 1)]);
}

#[test]
fn leading_trailing_new_burst_after_closed_round_is_leading_again() {
    // Round 1: 0 (leading), 100 (trailing at 1100). Closed. Burst at 5000 → leading again.
    let out = run(
        PolicySpec::leading_trailing(1_000),
        &at(&[0, 100, 5_000, 5_200]),
    );
    assert_eq!(
        summary(&out),
        vec![
            (0, Trigger::Leading, 1),
            (1_100, Trigger::Trailing, 1),
            (5_000, Trigger::Leading, 1),
            (6_200, Trigger::Trailing, 1),
        ]
    );
    // A single leading upload's round closes silently delay after it; next upload leads.
    let out = run(PolicySpec::leading_trailing(1_000), &at(&[0, 1_000]));
    assert_eq!(
        summary(&out),
        vec![(0, Trigger::Leading, 1), (1_000, Trigger::Leading, 1)]
    );
}

#[test]
fn adaptive_example_from_spec() {
    // min 5 000, max 600 000: upload at 0 → due 5 000.
    let out = run(PolicySpec::adaptive(5_000, 600_000), &at(&[0]));
    assert_eq!(summary(&out), vec![(5_000, Trigger::Trailing, 1)]);
    assert_eq!(out[0].delay_ms, 5_000);
    // Next at 180 000 → delay 180 000, due 360 000; next at 300 000 → delay stays 180 000, due 480 000.
    let out = run(
        PolicySpec::adaptive(5_000, 600_000),
        &at(&[0, 180_000, 300_000]),
    );
    assert_eq!(
        summary(&out),
        vec![
            (5_000, Trigger::Trailing, 1),
            (480_000, Trigger::Trailing, 2)
        ]
    );
    assert_eq!(out[1].delay_ms, 180_000);
}

#[test]
fn adaptive_track_outlives_emissions_and_is_capped() {
    let engine = Engine::new(PolicyTable::uniform(PolicySpec::adaptive(5_000, 60_000)));
    let mut st = None;
    let mut out = Vec::new();
    engine.on_upload(0, &mut st, &Upload::plain(key("s"), 0), &mut out);
    engine.on_time(10_000, &key("s"), &mut st, &mut out);
    assert_eq!(out.len(), 1);
    let s = st.as_ref().unwrap();
    assert!(s.round.is_none());
    assert_eq!(
        s.track,
        Some(CallTrack {
            time: 0,
            delay: 5_000
        })
    );
    // interval 1 000 000 is capped at max 60 000.
    engine.on_upload(
        1_000_000,
        &mut st,
        &Upload::plain(key("s"), 1_000_000),
        &mut out,
    );
    assert_eq!(
        st.as_ref().unwrap().track,
        Some(CallTrack {
            time: 1_000_000,
            delay: 60_000
        })
    );
    assert_eq!(engine.next_due(&key("s"), st.as_ref().unwrap()), 1_060_000);
}

#[test]
fn adaptive_burst_behaves_like_fixed_and_split_upload_is_one_emission() {
    // Two uploads 1 s apart with min 5 s: delay stays 5 s → one emission at 6 s.
    let out = run(PolicySpec::adaptive(5_000, 600_000), &at(&[0, 1_000]));
    assert_eq!(summary(&out), vec![(6_000, Trigger::Trailing, 2)]);
}

#[test]
fn max_wait_example_from_issue() {
    // delay 2 s, max-wait 2 s, uploads at 0 and 0.5 s → one emission at 2.0 s, max_wait.
    let out = run(
        PolicySpec::fixed(2_000).with_max_wait(2_000),
        &at(&[0, 500]),
    );
    assert_eq!(summary(&out), vec![(2_000, Trigger::MaxWait, 2)]);
}

#[test]
fn max_wait_continuation_keeps_deadline_and_moves_with_uploads() {
    // delay 1 000, max-wait 3 000; uploads every 500 ms from 0 to 4 000.
    let times: Vec<Millis> = (0..=8).map(|i| i * 500).collect();
    let out = run(PolicySpec::fixed(1_000).with_max_wait(3_000), &at(&times));
    // Round 1 starts 0 → max_wait due 3 000 fires before the upload at 3 000 (uploads 0..=2500:
    // 6). The continuation starts 3 000, gets 3 000, 3 500, 4 000 → deadline 5 000 < 6 000 →
    // trailing at 5 000 with 3 uploads.
    assert_eq!(
        summary(&out),
        vec![(3_000, Trigger::MaxWait, 6), (5_000, Trigger::Trailing, 3)]
    );
    assert_eq!(out[1].generation, 2);
}

#[test]
fn max_wait_continuation_with_no_upload_ends_silently() {
    let out = run(
        PolicySpec::fixed(1_000).with_max_wait(1_000),
        &at(&[0, 600]),
    );
    // max_wait at 1 000 (2 uploads); continuation keeps deadline 1 600, no upload → silent.
    assert_eq!(summary(&out), vec![(1_000, Trigger::MaxWait, 2)]);
}

#[test]
fn max_wait_continuation_is_never_leading() {
    let spec = PolicySpec::leading_trailing(1_000).with_max_wait(2_000);
    let out = run(spec, &at(&[0, 500, 1_000, 1_500, 2_100]));
    assert_eq!(
        summary(&out),
        vec![
            (0, Trigger::Leading, 1),
            (2_000, Trigger::MaxWait, 3),
            (3_100, Trigger::Trailing, 1),
        ]
    );
}

#[test]
fn upload_exactly_delay_after_previous_starts_new_round() {
    let out = run(PolicySpec::fixed(500), &at(&[0, 500]));
    assert_eq!(
        summary(&out),
        vec![(500, Trigger::Trailing, 1), (1_000, Trigger::Trailing, 1)]
    );
}

fn part(t: Millis, index: u32, count: u32) -> Upload {
    Upload {
        part: Some(Part { index, count }),
        ..Upload::plain(key("s"), t)
    }
}

#[test]
fn split_upload_completes_at_once() {
    let out = run(
        PolicySpec::adaptive(5_000, 600_000),
        &[part(0, 1, 2), part(2_000, 2, 2)],
    );
    assert_eq!(summary(&out), vec![(2_000, Trigger::Complete, 2)]);
    // Out of order parts complete too; a duplicate part doesn't.
    let out = run(
        PolicySpec::fixed(10_000),
        &[part(0, 2, 2), part(1, 2, 2), part(5, 1, 2)],
    );
    assert_eq!(summary(&out), vec![(5, Trigger::Complete, 3)]);
}

#[test]
fn single_part_upload_opening_round_emits_once_as_complete_not_leading() {
    let out = run(PolicySpec::leading_trailing(1_000), &[part(0, 1, 1)]);
    assert_eq!(summary(&out), vec![(0, Trigger::Complete, 1)]);
}

#[test]
fn leading_round_keeps_its_parts_until_complete() {
    // v2: part 1/2 leads; part 2/2 in the same round completes it at once.
    let out = run(
        PolicySpec::leading_trailing(10_000),
        &[part(0, 1, 2), part(300, 2, 2)],
    );
    assert_eq!(
        summary(&out),
        vec![(0, Trigger::Leading, 1), (300, Trigger::Complete, 1)]
    );
}

#[test]
fn final_flushes_now() {
    let fin = Upload {
        final_flag: true,
        ..Upload::plain(key("s"), 700)
    };
    let mut ups = at(&[0, 300]);
    ups.push(fin);
    let out = run(PolicySpec::fixed(10_000), &ups);
    assert_eq!(summary(&out), vec![(700, Trigger::Final, 3)]);
    // With v2, a final upload that opens a round emits once, as final.
    let fin = Upload {
        final_flag: true,
        ..Upload::plain(key("s"), 0)
    };
    let out = run(PolicySpec::leading_trailing(10_000), &[fin]);
    assert_eq!(summary(&out), vec![(0, Trigger::Final, 1)]);
}

#[test]
fn late_upload_is_counted_and_changes_nothing_else() {
    let late = Upload {
        event_id: Some("late".into()),
        attributes: Some(r#"{"late":true}"#.into()),
        ..Upload::plain(key("s"), 100)
    };
    let on_time = Upload {
        event_id: Some("b".into()),
        attributes: Some(r#"{"b":1}"#.into()),
        ..Upload::plain(key("s"), 1_000)
    };
    let out = run(
        PolicySpec::fixed(5_000),
        &[Upload::plain(key("s"), 0), on_time, late],
    );
    assert_eq!(summary(&out), vec![(6_000, Trigger::Trailing, 3)]);
    assert_eq!(out[0].last_upload_at, 1_000);
    assert_eq!(out[0].last_event_id.as_deref(), Some("b"));
    assert_eq!(out[0].attributes.as_deref(), Some(r#"{"b":1}"#));
}

#[test]
fn late_upload_with_no_open_round_opens_one_at_last_upload_time() {
    let engine = Engine::new(PolicyTable::uniform(PolicySpec::fixed(1_000)));
    let mut st = None;
    let mut out = Vec::new();
    engine.on_upload(5_000, &mut st, &Upload::plain(key("s"), 5_000), &mut out);
    engine.on_time(6_000, &key("s"), &mut st, &mut out);
    assert_eq!(out.len(), 1);
    let step = engine.on_upload(6_500, &mut st, &Upload::plain(key("s"), 4_000), &mut out);
    assert_eq!(step.applied, Applied::Late);
    let r = st.as_ref().unwrap().round.as_ref().unwrap();
    assert_eq!((r.start, r.deadline, r.uploads), (5_000, 6_000, 1));
    // Already due: fires at the next time step, as generation 2.
    engine.on_time(6_500, &key("s"), &mut st, &mut out);
    assert_eq!(summary(&out[1..]), vec![(6_000, Trigger::Trailing, 1)]);
    assert_eq!(out[1].generation, 2);
}

#[test]
fn redelivered_event_id_is_ignored() {
    let u = |t, id: &str| Upload {
        event_id: Some(id.into()),
        ..Upload::plain(key("s"), t)
    };
    let engine = Engine::new(PolicyTable::uniform(PolicySpec::fixed(1_000)));
    let mut st = None;
    let mut out = Vec::new();
    engine.on_upload(0, &mut st, &u(0, "a"), &mut out);
    let before = st.clone();
    let step = engine.on_upload(200, &mut st, &u(200, "a"), &mut out);
    assert_eq!(step.applied, Applied::Redelivered);
    assert_eq!(st, before, "a redelivery changes nothing");
    assert_eq!(step.due_before, step.due_after);
    // A different id is applied, and then the first id is no longer "the last applied".
    engine.on_upload(300, &mut st, &u(300, "b"), &mut out);
    engine.on_upload(400, &mut st, &u(400, "a"), &mut out);
    engine.on_time(10_000, &key("s"), &mut st, &mut out);
    assert_eq!(summary(&out), vec![(1_400, Trigger::Trailing, 3)]);
}

#[test]
fn state_expires_after_ttl_and_generation_restarts() {
    let spec = PolicySpec::adaptive(1_000, 10_000).with_state_ttl(60_000);
    let engine = Engine::new(PolicyTable::uniform(spec));
    let mut st = None;
    let mut out = Vec::new();
    engine.on_upload(0, &mut st, &Upload::plain(key("s"), 0), &mut out);
    let step = engine.on_time(1_000, &key("s"), &mut st, &mut out);
    assert_eq!(step.due_after, Some(60_000), "expiry timer after the round");
    engine.on_time(59_999, &key("s"), &mut st, &mut out);
    assert!(st.is_some());
    let step = engine.on_time(60_000, &key("s"), &mut st, &mut out);
    assert!(st.is_none());
    assert_eq!(step.due_after, None);
    // A new upload starts from scratch: min-delay again.
    engine.on_upload(
        100_000,
        &mut st,
        &Upload::plain(key("s"), 100_000),
        &mut out,
    );
    assert_eq!(
        st.as_ref().unwrap().track,
        Some(CallTrack {
            time: 100_000,
            delay: 1_000
        })
    );
}

#[test]
fn per_tenant_override_applies_only_to_that_tenant() {
    let mut table = PolicyTable::uniform(PolicySpec::adaptive(5_000, 600_000));
    table.tenants.insert("acme".into(), PolicySpec::fixed(500));
    let mut d = Driver::new(Engine::new(table));
    let mut t = MemTable::new();
    let mut out = Vec::new();
    for k in [
        SessionKey::new("acme", "s1"),
        SessionKey::new("other", "s1"),
    ] {
        d.apply(&mut t, 0, &Upload::plain(k, 0), &mut out).unwrap();
    }
    d.advance(&mut t, 100_000, &mut out).unwrap();
    let got: Vec<_> = out
        .iter()
        .map(|e| (e.key.tenant().to_string(), e.due_at, e.policy))
        .collect();
    assert_eq!(
        got,
        vec![
            ("acme".into(), 500, PolicyName::Fixed),
            ("other".into(), 5_000, PolicyName::Adaptive)
        ]
    );
}

#[test]
fn driver_fires_in_due_then_key_order_and_before_later_uploads() {
    let mut d = Driver::new(Engine::new(PolicyTable::uniform(PolicySpec::fixed(100))));
    let mut t = MemTable::new();
    let mut out = Vec::new();
    for s in ["b", "a", "c"] {
        d.apply(&mut t, 0, &Upload::plain(key(s), 0), &mut out)
            .unwrap();
    }
    // An upload of "a" at 100 (== due) must not extend round 1: it fires first.
    d.apply(&mut t, 100, &Upload::plain(key("a"), 100), &mut out)
        .unwrap();
    let order: Vec<_> = out.iter().map(|e| (e.key.session(), e.due_at)).collect();
    assert_eq!(order, vec![("a", 100), ("b", 100), ("c", 100)]);
    assert!(out.iter().all(|e| e.uploads == 1));
}

#[test]
fn fire_timer_fires_the_named_timer_only_and_reports_a_gone_one() {
    let mut d = Driver::new(Engine::new(PolicyTable::uniform(PolicySpec::fixed(100))));
    let mut t = MemTable::new();
    let mut out = Vec::new();
    d.apply(&mut t, 0, &Upload::plain(key("a"), 0), &mut out)
        .unwrap();
    d.apply(&mut t, 50, &Upload::plain(key("b"), 50), &mut out)
        .unwrap();
    assert!(t.has_timer(100, &key("a")).unwrap());
    assert!(!t.has_timer(101, &key("a")).unwrap());
    // b's timer (due 150) fires though a's (due 100) is earlier; a's stays.
    assert!(d.fire_timer(&mut t, 150, &key("b"), &mut out).unwrap());
    let order: Vec<_> = out.iter().map(|e| (e.key.session(), e.due_at)).collect();
    assert_eq!(order, vec![("b", 150)]);
    assert!(t.has_timer(100, &key("a")).unwrap());
    assert!(!t.has_timer(150, &key("b")).unwrap());
    // Gone now (fired), and a timer that never existed: nothing happens.
    assert!(!d.fire_timer(&mut t, 150, &key("b"), &mut out).unwrap());
    assert!(!d.fire_timer(&mut t, 100, &key("c"), &mut out).unwrap());
    assert_eq!(out.len(), 1);
    assert_eq!(d.stats.emissions, 1);
    // The rest still fires in due order.
    d.advance(&mut t, 1_000, &mut out).unwrap();
    assert_eq!(out.len(), 2);
    assert_eq!((out[1].key.session(), out[1].due_at), ("a", 100));
}

#[test]
fn nothing_is_emitted_before_its_due_time() {
    let mut d = Driver::new(Engine::new(PolicyTable::uniform(PolicySpec::fixed(1_000))));
    let mut t = MemTable::new();
    let mut out = Vec::new();
    d.apply(&mut t, 0, &Upload::plain(key("s"), 0), &mut out)
        .unwrap();
    d.advance(&mut t, 999, &mut out).unwrap();
    assert!(out.is_empty());
    d.advance(&mut t, 1_000, &mut out).unwrap();
    assert_eq!(out.len(), 1);
}

#[test]
fn session_key_splits_at_first_slash() {
    let k = SessionKey::parse("acme/run/42").unwrap();
    assert_eq!((k.tenant(), k.session()), ("acme", "run/42"));
    assert!(SessionKey::parse("nokey").is_none());
    assert!(SessionKey::parse("/x").is_none());
    assert!(SessionKey::parse("x/").is_none());
}

#[test]
fn policy_validation_names_the_key() {
    assert!(PolicySpec::fixed(0)
        .validate()
        .unwrap_err()
        .contains("delay"));
    let e = PolicySpec::adaptive(10, 5).validate().unwrap_err();
    assert!(e.contains("max-delay") && e.contains("min-delay"), "{e}");
    let e = PolicySpec::fixed(5)
        .with_max_wait(0)
        .validate()
        .unwrap_err();
    assert!(e.contains("max-wait"), "{e}");
}

#[test]
fn a_stale_timer_from_an_older_policy_fires_once_and_is_replaced() {
    // A timer stored under state-ttl 30 s, read back under state-ttl 60 s (config changed
    // across a restart): firing it must cancel it and arm the real one, not loop on it.
    let old = Engine::new(PolicyTable::uniform(
        PolicySpec::fixed(1_000).with_state_ttl(30_000),
    ));
    let mut table = MemTable::new();
    let mut out = Vec::new();
    let mut d = Driver::new(old);
    d.apply(&mut table, 0, &Upload::plain(key("s"), 0), &mut out)
        .unwrap();
    d.advance(&mut table, 1_000, &mut out).unwrap();
    assert_eq!(table.next_due(), Some(30_000));
    let new = Engine::new(PolicyTable::uniform(
        PolicySpec::fixed(1_000).with_state_ttl(60_000),
    ));
    let mut d = Driver::new(new);
    let fired = d.advance_at_most(&mut table, 40_000, 5, &mut out).unwrap();
    assert_eq!(fired, 1, "the stale timer fires once");
    let timers: Vec<_> = table.timers().cloned().collect();
    assert_eq!(timers, vec![(60_000, key("s"))]);
    assert!(table.state(&key("s")).is_some());
}

#[test]
fn mem_table_timers_keep_due_then_key_order_within_one_millisecond() {
    // One timer per key, as in the store: a key's second timer replaces its first.
    let mut t = MemTable::new();
    for (due, k) in [(5, "c"), (5, "a"), (3, "z"), (5, "b"), (5, "a"), (9, "a")] {
        t.set_timer(due, &key(k)).unwrap();
    }
    let all = |t: &MemTable| -> Vec<(Millis, String)> {
        t.timers()
            .map(|(d, k)| (*d, k.session().to_owned()))
            .collect()
    };
    let expect = |v: &[(Millis, &str)]| -> Vec<(Millis, String)> {
        v.iter().map(|(d, k)| (*d, (*k).to_owned())).collect()
    };
    assert_eq!(all(&t), expect(&[(3, "z"), (5, "b"), (5, "c"), (9, "a")]));
    assert_eq!(t.first_due(4).unwrap(), Some((3, key("z"))));
    assert_eq!(t.first_due(2).unwrap(), None);
    // Removing the first timer makes the next one first.
    t.cancel_timer(3, &key("z")).unwrap();
    assert_eq!(t.first_due(4).unwrap(), None);
    assert_eq!(t.first_due(5).unwrap(), Some((5, key("b"))));
    assert!(t.has_timer(9, &key("a")).unwrap());
    assert!(!t.has_timer(5, &key("a")).unwrap(), "replaced by 9");
    t.cancel_timer(5, &key("b")).unwrap();
    t.cancel_timer(5, &key("x")).unwrap(); // not there: nothing changes
    t.cancel_timer(6, &key("a")).unwrap(); // not a's timer: nothing changes
    t.cancel_timer(5, &key("a")).unwrap(); // nor this one
    assert_eq!(all(&t), expect(&[(5, "c"), (9, "a")]));
    assert_eq!(t.first_due(Millis::MAX).unwrap(), Some((5, key("c"))));
    t.cancel_timer(5, &key("c")).unwrap();
    t.set_timer(1, &key("q")).unwrap();
    assert_eq!(all(&t), expect(&[(1, "q"), (9, "a")]));
    assert_eq!(t.first_due(1).unwrap(), Some((1, key("q"))));
    assert_eq!(t.next_due(), Some(1));
}

#[test]
fn last_round_due_is_the_latest_open_round() {
    let spec = PolicySpec::fixed(1_000).with_max_wait(1_500);
    let mut d = Driver::new(Engine::new(PolicyTable::uniform(spec)));
    let mut t = MemTable::new();
    let mut out = Vec::new();
    assert_eq!(t.last_round_due(), None);
    for (s, at) in [("a", 0), ("b", 200), ("b", 900)] {
        d.apply(&mut t, at, &Upload::plain(key(s), at), &mut out)
            .unwrap();
    }
    // a: deadline 1 000; b: max-wait 1 700 before its deadline 1 900.
    assert_eq!(t.last_round_due(), Some(1_700));
    d.advance(&mut t, 1_700, &mut out).unwrap();
    // b's max_wait emission opened an empty continuation round, due at its old deadline.
    assert_eq!(
        summary(&out),
        vec![(1_000, Trigger::Trailing, 1), (1_700, Trigger::MaxWait, 2)]
    );
    assert_eq!(t.last_round_due(), Some(1_900));
    d.advance(&mut t, 1_900, &mut out).unwrap();
    assert_eq!(t.last_round_due(), None);
    assert_eq!(out.len(), 2);
    assert_eq!(t.len(), 2, "state expiries are still pending");
}

#[test]
fn a_key_that_comes_back_after_its_state_expired_gets_new_ids() {
    // SEMANTICS §2, the issue's example: uploads of acme/f two hours apart, state-ttl 1 h.
    let spec = PolicySpec::adaptive(5_000, 600_000).with_state_ttl(3_600_000);
    let t0: Millis = 1_767_225_600_000;
    let f = SessionKey::new("acme", "f");
    let uploads = [
        Upload::plain(f.clone(), t0),
        Upload::plain(f.clone(), t0 + 7_200_000),
    ];
    let out = run(spec, &uploads);
    assert_eq!(out.len(), 2);
    assert_eq!(
        (out[0].generation, out[1].generation),
        (1, 1),
        "the state restarted"
    );
    assert_eq!(out[0].emission_id(), format!("acme/f/{t0}/1"));
    assert_eq!(out[1].emission_id(), format!("acme/f/{}/1", t0 + 7_200_000));
}

#[test]
fn ids_of_one_state_keep_its_creation_time_and_survive_a_store_round_trip() {
    let spec = PolicySpec::fixed(1_000);
    let engine = Engine::new(PolicyTable::uniform(spec));
    let (mut st, mut out) = (None, Vec::new());
    engine.on_upload(500, &mut st, &Upload::plain(key("s"), 500), &mut out);
    engine.on_time(1_500, &key("s"), &mut st, &mut out);
    // What the store keeps and reads back (postcard, as the store writes it).
    let bytes = postcard::to_allocvec(&st).unwrap();
    let mut st: Option<SessionState> = postcard::from_bytes(&bytes).unwrap();
    assert_eq!(st.as_ref().map(|s| s.created_at), Some(500));
    engine.on_upload(9_000, &mut st, &Upload::plain(key("s"), 9_000), &mut out);
    engine.on_time(10_000, &key("s"), &mut st, &mut out);
    let ids: Vec<String> = out.iter().map(Emission::emission_id).collect();
    assert_eq!(ids, ["t/s/500/1", "t/s/500/2"]);
}

#[test]
fn an_empty_continuation_round_is_renewed_at_its_max_wait_bound() {
    // SEMANTICS §4: delay 5 000, max-wait 1 000. Uploads at 0 and 500 → max_wait at 1 000;
    // the empty continuation round (deadline 5 500) reaches its own bound at 2 000 first and
    // is renewed there, so the upload at 2 500 is emitted at 3 000 (the max-wait cadence),
    // not at 3 500 (a round opened by it).
    let out = run(
        PolicySpec::fixed(5_000).with_max_wait(1_000),
        &at(&[0, 500, 2_500]),
    );
    assert_eq!(
        summary(&out),
        vec![(1_000, Trigger::MaxWait, 2), (3_000, Trigger::MaxWait, 1)]
    );
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

    /// SEMANTICS §2: with a short state-ttl, keys expire and come back, over random traces and
    /// every policy; no two emissions share an id.
    #[test]
    fn emission_ids_never_repeat_across_state_expiry(
        gaps in proptest::collection::vec((0..4_usize, 0_i64..3_000), 1..200),
        policy in 0..3_usize,
    ) {
        let spec = [
            PolicySpec::fixed(300),
            PolicySpec::leading_trailing(300),
            PolicySpec::adaptive(100, 2_000),
        ][policy]
        .clone()
        .with_max_wait(700)
        .with_state_ttl(1_000);
        let mut t = 0;
        let uploads: Vec<Upload> = gaps
            .iter()
            .map(|&(k, gap)| {
                t += gap;
                Upload::plain(key(&format!("k{k}")), t)
            })
            .collect();
        let out = run(spec, &uploads);
        let mut ids: Vec<String> = out.iter().map(Emission::emission_id).collect();
        let n = ids.len();
        ids.sort();
        ids.dedup();
        proptest::prop_assert_eq!(ids.len(), n);
    }
}

#[test]
fn mem_table_slots_of_forgotten_keys_are_reused_without_mixing_states() {
    let mut t = MemTable::new();
    let state = |generation| SessionState {
        generation,
        ..SessionState::default()
    };
    for i in 0..5_000_u64 {
        t.put(&key(&format!("k{i}")), &state(i)).unwrap();
    }
    for i in (0..5_000_u64).step_by(2) {
        t.delete(&key(&format!("k{i}"))).unwrap();
    }
    for i in 5_000..7_000_u64 {
        t.update(&key(&format!("k{i}")), |s| {
            *s = Some(state(i));
            ((), true)
        })
        .unwrap();
    }
    assert_eq!(t.len(), 2_500 + 2_000);
    for i in 0..7_000_u64 {
        let got = t.state(&key(&format!("k{i}"))).map(|s| s.generation);
        let expected = (i >= 5_000 || i % 2 == 1).then_some(i);
        assert_eq!(got, expected, "k{i}");
    }
    assert_eq!(t.get(&key("k7")).unwrap(), Some(state(7)));
}

#[test]
fn mem_table_remembers_the_last_key_without_answering_for_a_reused_slot() {
    let mut t = MemTable::new();
    let state = |generation| SessionState {
        generation,
        ..SessionState::default()
    };
    t.put(&key("a"), &state(1)).unwrap();
    t.set_timer(10, &key("a")).unwrap();
    // `a` is forgotten (its timer stays, without state) and `b` takes its slot.
    t.delete(&key("a")).unwrap();
    t.put(&key("b"), &state(2)).unwrap();
    t.set_timer(20, &key("b")).unwrap();
    assert!(t.has_timer(10, &key("a")).unwrap());
    assert!(!t.has_timer(20, &key("a")).unwrap());
    assert_eq!(t.state(&key("a")), None);
    assert_eq!(t.get(&key("b")).unwrap(), Some(state(2)));
    // A timer of `a` set while `b` is the key found last lands on `a`, not on b's slot.
    t.set_timer(15, &key("a")).unwrap();
    assert!(t.has_timer(20, &key("b")).unwrap());
    assert_eq!(t.first_due(Millis::MAX).unwrap(), Some((15, key("a"))));
    // A state dropped by `update` frees the slot; the next key there is not `b`.
    t.update(&key("b"), |s| {
        *s = None;
        ((), true)
    })
    .unwrap();
    t.put(&key("c"), &state(3)).unwrap();
    assert_eq!(t.state(&key("b")), None);
    assert_eq!(t.state(&key("c")).map(|s| s.generation), Some(3));
    assert!(
        t.has_timer(20, &key("b")).unwrap(),
        "b's timer stays without state"
    );
    assert!(!t.has_timer(20, &key("c")).unwrap());
}

/// Applies `times` (event time = partition time) to key `s` through `driver` over `table`,
/// firing what falls due in between.
fn feed(driver: &mut Driver, table: &mut MemTable, times: &[Millis], out: &mut Vec<Emission>) {
    for &t in times {
        driver
            .apply(table, t, &Upload::plain(key("s"), t), out)
            .unwrap();
    }
}

#[test]
fn a_removed_max_wait_cuts_no_round_after_the_next_upload() {
    // Issue "hours, not minutes" #2: config A (fixed 30 s, max-wait 20 s) for a while, then
    // config C (adaptive 2 s..10 s, no max-wait) on the same state; the session keeps
    // uploading every 1.5 s. SEMANTICS §7: the new rule applies from each key's next upload.
    let a = PolicySpec::fixed(30_000).with_max_wait(20_000);
    let c = PolicySpec::adaptive(2_000, 10_000);
    let mut table = MemTable::new();
    let mut out = Vec::new();
    let mut d = Driver::new(Engine::new(PolicyTable::uniform(a)));
    let under_a: Vec<Millis> = (0..20).map(|i| i * 1_500).collect(); // 0 ..= 28 500
    feed(&mut d, &mut table, &under_a, &mut out);
    // Under A the round opened at 0 was cut at 20 000 by max-wait.
    assert_eq!(summary(&out), vec![(20_000, Trigger::MaxWait, 14)]);
    assert_eq!(out[0].policy, PolicyName::Fixed);
    out.clear();
    // The "restart" with config C: the same stored state, a new engine.
    let mut d = Driver::new(Engine::new(PolicyTable::uniform(c)));
    let under_c: Vec<Millis> = (20..80).map(|i| i * 1_500).collect(); // 30 000 ..= 118 500
    feed(&mut d, &mut table, &under_c, &mut out);
    d.advance(&mut table, Millis::MAX / 2, &mut out).unwrap();
    assert!(
        out.iter().all(|e| e.trigger != Trigger::MaxWait),
        "no max-wait under a rule without one: {:?}",
        summary(&out)
    );
    // One round from 20 000 (the continuation of A's cut) to the last upload; adaptive's
    // CallTrack starts at min-delay 2 s (interval 1.5 s < 2 s keeps it there).
    assert_eq!(
        summary(&out),
        vec![(118_500 + 2_000, Trigger::Trailing, 66)]
    );
    assert_eq!(
        (out[0].policy, out[0].delay_ms),
        (PolicyName::Adaptive, 2_000)
    );
}

#[test]
fn a_pending_round_keeps_its_due_time_and_rule_until_its_next_upload() {
    // SEMANTICS §7: a round timed under fixed 30 s fires under that rule when no upload
    // comes after the change: due at 30 000 after its upload at 0, `policy fixed`,
    // `delay_ms 30000` (not the adaptive rule in force when it fires).
    let mut table = MemTable::new();
    let mut out = Vec::new();
    let mut d = Driver::new(Engine::new(PolicyTable::uniform(
        PolicySpec::fixed(30_000).with_max_wait(20_000),
    )));
    feed(&mut d, &mut table, &[0, 1_000], &mut out);
    let mut d = Driver::new(Engine::new(PolicyTable::uniform(PolicySpec::adaptive(
        2_000, 10_000,
    ))));
    d.advance(&mut table, 19_999, &mut out).unwrap();
    assert!(
        out.is_empty(),
        "the round keeps its due time (max-wait 20 000)"
    );
    d.advance(&mut table, 40_000, &mut out).unwrap();
    assert_eq!(summary(&out), vec![(20_000, Trigger::MaxWait, 2)]);
    assert_eq!(
        (out[0].policy, out[0].delay_ms),
        (PolicyName::Fixed, 30_000)
    );
    // The continuation opened at 20 000 under the adaptive rule, which has no max-wait:
    // it ends silently at A's old deadline (31 000), and the key keeps no round.
    let state = table.get(&key("s")).unwrap().unwrap();
    assert!(state.round.is_none(), "{state:?}");
    assert_eq!(out.len(), 1);
}

#[test]
fn a_max_wait_added_by_a_new_rule_bounds_the_round_from_its_start() {
    // fixed 30 s without max-wait, uploads at 0 and 1 000; then max-wait 5 s is added: the
    // next upload at 2 000 sets the bound at start + 5 s = 5 000. A bound already behind
    // the upload (max-wait 1 s: 1 000 < 2 000) makes the round due at that upload.
    for (max_wait, due) in [(5_000, 5_000), (1_000, 2_000)] {
        let mut table = MemTable::new();
        let mut out = Vec::new();
        let mut d = Driver::new(Engine::new(PolicyTable::uniform(PolicySpec::fixed(30_000))));
        feed(&mut d, &mut table, &[0, 1_000], &mut out);
        let spec = PolicySpec::fixed(30_000).with_max_wait(max_wait);
        let mut d = Driver::new(Engine::new(PolicyTable::uniform(spec)));
        feed(&mut d, &mut table, &[2_000], &mut out);
        d.advance(&mut table, 100_000, &mut out).unwrap();
        assert_eq!(
            summary(&out)[0],
            (due, Trigger::MaxWait, 3),
            "max-wait {max_wait}"
        );
        assert!(out[0].last_upload_at <= out[0].due_at);
    }
}

#[test]
fn flush_emits_the_open_round_now_and_cancel_drops_it_keeping_the_track() {
    // SEMANTICS §7. adaptive 20 s..60 s: uploads at 0, 10 000 (delay 20 s, due 30 000).
    let spec = PolicySpec::adaptive(20_000, 60_000);
    let flush = Action {
        flush: true,
        dry_run: false,
    };
    let cancel = Action {
        flush: false,
        dry_run: false,
    };
    let mut d = Driver::new(Engine::new(PolicyTable::uniform(spec)));
    let mut t = MemTable::new();
    let mut out = Vec::new();
    feed(&mut d, &mut t, &[0, 10_000], &mut out);
    assert!(out.is_empty(), "{:?}", summary(&out));
    assert_eq!(t.next_due(), Some(30_000));
    // A dry run says what a flush would do and changes nothing.
    let dry = Action {
        dry_run: true,
        ..flush
    };
    assert_eq!(
        d.act(&mut t, 12_000, &key("s"), dry, &mut out).unwrap(),
        Some(2)
    );
    assert!(out.is_empty());
    assert_eq!(t.next_due(), Some(30_000));
    // Flush at 12 000: manual, due_at = when applied, the round's uploads.
    assert_eq!(
        d.act(&mut t, 12_000, &key("s"), flush, &mut out).unwrap(),
        Some(2)
    );
    assert_eq!(summary(&out), vec![(12_000, Trigger::Manual, 2)]);
    assert_eq!(out[0].delay_ms, 20_000);
    assert_eq!(out[0].emission_id(), "t/s/0/1");
    let s = t.state(&key("s")).unwrap();
    assert!(s.round.is_none());
    assert_eq!(
        s.track.map(|tr| tr.delay),
        Some(20_000),
        "the CallTrack stays"
    );
    // Nothing open now: either action says so and changes nothing.
    assert_eq!(
        d.act(&mut t, 13_000, &key("s"), flush, &mut out).unwrap(),
        None
    );
    assert_eq!(
        d.act(&mut t, 13_000, &key("none"), cancel, &mut out)
            .unwrap(),
        None
    );
    assert_eq!(out.len(), 1);
    // A new round (due 34 000); cancel drops it: no emission, ever, for its uploads.
    feed(&mut d, &mut t, &[14_000, 15_000], &mut out);
    assert_eq!(
        d.act(&mut t, 16_000, &key("s"), cancel, &mut out).unwrap(),
        Some(2)
    );
    d.advance(&mut t, 40_000, &mut out).unwrap();
    assert_eq!(out.len(), 1, "{:?}", summary(&out));
    // The next upload opens a new round with only its own upload; its generation follows
    // the last emission (a cancelled round has none).
    feed(&mut d, &mut t, &[41_000], &mut out);
    d.advance(&mut t, 100_000, &mut out).unwrap();
    assert_eq!(out.len(), 2, "{:?}", summary(&out));
    assert_eq!(out[1].emission_id(), "t/s/0/2");
    assert_eq!(out[1].uploads, 1);
}

#[test]
fn an_action_fires_what_is_due_first_and_leaves_an_empty_continuation_alone() {
    // fixed 5 s, max-wait 1 s: uploads 0 and 500 are cut at 1 000 (max_wait); the empty
    // continuation has nothing to flush.
    let spec = PolicySpec::fixed(5_000).with_max_wait(1_000);
    let mut d = Driver::new(Engine::new(PolicyTable::uniform(spec)));
    let mut t = MemTable::new();
    let mut out = Vec::new();
    feed(&mut d, &mut t, &[0, 500], &mut out);
    let flush = Action {
        flush: true,
        dry_run: false,
    };
    assert_eq!(
        d.act(&mut t, 1_200, &key("s"), flush, &mut out).unwrap(),
        None
    );
    assert_eq!(summary(&out), vec![(1_000, Trigger::MaxWait, 2)]);
}

// ------------------------------------------------------------------ event ids (SEMANTICS §2)

/// An upload of `key("s")` at `t` with event id `id` (`None`: without one).
fn with_id(t: Millis, id: Option<&str>) -> Upload {
    Upload {
        event_id: id.map(str::to_owned),
        ..Upload::plain(key("s"), t)
    }
}

/// The listed ids and the dropped count of an emission (`None`: the fields are left out).
fn ids_of(e: &Emission) -> Option<(Vec<&str>, u32)> {
    e.event_ids
        .as_ref()
        .map(|ids| (ids.iter().collect(), ids.dropped()))
}

#[test]
fn event_ids_are_listed_in_the_order_applied_up_to_the_cap_then_counted() {
    let uploads: Vec<Upload> = (1..=5)
        .map(|i| with_id(i * 100, Some(&format!("e-{i}"))))
        .collect();
    let out = run(PolicySpec::fixed(1_000).with_event_ids(3), &uploads);
    assert_eq!(summary(&out), vec![(1_500, Trigger::Trailing, 5)]);
    assert_eq!(ids_of(&out[0]), Some((vec!["e-1", "e-2", "e-3"], 2)));
    // A cap the round does not reach: all listed, none dropped.
    let out = run(PolicySpec::fixed(1_000).with_event_ids(64), &uploads);
    assert_eq!(
        ids_of(&out[0]),
        Some((vec!["e-1", "e-2", "e-3", "e-4", "e-5"], 0))
    );
    // Exactly the cap: nothing dropped.
    let out = run(PolicySpec::fixed(1_000).with_event_ids(5), &uploads);
    assert_eq!(ids_of(&out[0]).map(|(l, d)| (l.len(), d)), Some((5, 0)));
}

#[test]
fn event_ids_off_keeps_no_ids_anywhere() {
    // N = 0 (the default): no list in the round, none on the emission (the record is
    // today's, byte for byte: `tests/offline/event_ids.rs`).
    let uploads = [with_id(0, Some("a")), with_id(100, Some("b"))];
    assert_eq!(PolicySpec::fixed(1_000).event_ids, 0);
    let engine = Engine::new(PolicyTable::uniform(PolicySpec::fixed(1_000)));
    let (mut st, mut out) = (None, Vec::new());
    for u in &uploads {
        engine.on_upload(u.event_time, &mut st, u, &mut out);
    }
    assert!(st
        .as_ref()
        .unwrap()
        .round
        .as_ref()
        .unwrap()
        .event_ids
        .is_none());
    engine.on_time(10_000, &key("s"), &mut st, &mut out);
    assert_eq!(out.len(), 1);
    assert_eq!(ids_of(&out[0]), None);
    assert_eq!(out[0].last_event_id.as_deref(), Some("b"));
}

#[test]
fn a_redelivered_upload_is_not_listed_twice_and_uploads_without_an_id_are_not_listed() {
    let uploads = [
        with_id(0, Some("a")),
        with_id(100, Some("a")), // redelivery of the last applied id: ignored
        with_id(200, None),      // applied, counted in `uploads`, not listed
        with_id(300, Some("b")),
        with_id(400, Some("a")), // not the last applied id: a new upload (SEMANTICS §2)
    ];
    let out = run(PolicySpec::fixed(1_000).with_event_ids(8), &uploads);
    assert_eq!(summary(&out), vec![(1_400, Trigger::Trailing, 4)]);
    assert_eq!(ids_of(&out[0]), Some((vec!["a", "b", "a"], 0)));
    // Ids of uploads without one are not counted as dropped either.
    let out = run(PolicySpec::fixed(1_000).with_event_ids(1), &uploads);
    assert_eq!(ids_of(&out[0]), Some((vec!["a"], 2)));
    // A round whose uploads carry no id still says it keeps ids: an empty list.
    let out = run(
        PolicySpec::fixed(1_000).with_event_ids(1),
        &[with_id(0, None)],
    );
    assert_eq!(ids_of(&out[0]), Some((vec![], 0)));
}

#[test]
fn a_late_upload_counted_in_the_round_is_listed_in_the_order_applied() {
    // SEMANTICS §3: the late upload (50 < 100) counts in the open round's uploads; its id is
    // one of the round's, listed where it was applied.
    let uploads = [
        with_id(100, Some("x")),
        with_id(50, Some("late")),
        with_id(200, Some("y")),
    ];
    let out = run(PolicySpec::fixed(1_000).with_event_ids(8), &uploads);
    assert_eq!(summary(&out), vec![(1_200, Trigger::Trailing, 3)]);
    assert_eq!(ids_of(&out[0]), Some((vec!["x", "late", "y"], 0)));
    assert_eq!(out[0].last_event_id.as_deref(), Some("y"));
}

#[test]
fn each_emission_lists_the_ids_of_its_own_round() {
    // leading-trailing: the leading emission lists its upload; the trailing one the rest.
    let uploads = [
        with_id(0, Some("a")),
        with_id(100, Some("b")),
        with_id(200, Some("c")),
    ];
    let out = run(
        PolicySpec::leading_trailing(1_000).with_event_ids(8),
        &uploads,
    );
    assert_eq!(
        summary(&out),
        vec![(0, Trigger::Leading, 1), (1_200, Trigger::Trailing, 2)]
    );
    assert_eq!(ids_of(&out[0]), Some((vec!["a"], 0)));
    assert_eq!(ids_of(&out[1]), Some((vec!["b", "c"], 0)));
    // max-wait: the continuation round starts a new list.
    let uploads: Vec<Upload> = (0..6)
        .map(|i| with_id(i * 300, Some(&format!("e{i}"))))
        .collect();
    let out = run(
        PolicySpec::fixed(1_000)
            .with_max_wait(1_000)
            .with_event_ids(8),
        &uploads,
    );
    assert_eq!(
        summary(&out),
        vec![(1_000, Trigger::MaxWait, 4), (2_000, Trigger::MaxWait, 2)]
    );
    assert_eq!(ids_of(&out[0]), Some((vec!["e0", "e1", "e2", "e3"], 0)));
    assert_eq!(ids_of(&out[1]), Some((vec!["e4", "e5"], 0)));
    // final and complete end the round with their ids; the next round starts empty.
    let mut fin = with_id(100, Some("f"));
    fin.final_flag = true;
    let out = run(
        PolicySpec::fixed(1_000).with_event_ids(8),
        &[with_id(0, Some("a")), fin, with_id(200, Some("g"))],
    );
    assert_eq!(
        summary(&out),
        vec![(100, Trigger::Final, 2), (1_200, Trigger::Trailing, 1)]
    );
    assert_eq!(ids_of(&out[0]), Some((vec!["a", "f"], 0)));
    assert_eq!(ids_of(&out[1]), Some((vec!["g"], 0)));
}

#[test]
fn a_manual_flush_lists_the_ids_and_a_cancel_drops_them() {
    let engine = Engine::new(PolicyTable::uniform(
        PolicySpec::fixed(10_000).with_event_ids(8),
    ));
    let (mut st, mut out) = (None, Vec::new());
    for u in [with_id(0, Some("a")), with_id(100, Some("b"))] {
        engine.on_upload(u.event_time, &mut st, &u, &mut out);
    }
    let flush = Action {
        flush: true,
        dry_run: false,
    };
    engine.act(500, &key("s"), &mut st, flush, &mut out);
    assert_eq!(summary(&out), vec![(500, Trigger::Manual, 2)]);
    assert_eq!(ids_of(&out[0]), Some((vec!["a", "b"], 0)));
    engine.on_upload(600, &mut st, &with_id(600, Some("c")), &mut out);
    let cancel = Action {
        flush: false,
        ..flush
    };
    engine.act(700, &key("s"), &mut st, cancel, &mut out);
    engine.on_upload(800, &mut st, &with_id(800, Some("d")), &mut out);
    engine.on_time(100_000, &key("s"), &mut st, &mut out);
    assert_eq!(out.len(), 2);
    assert_eq!(
        ids_of(&out[1]),
        Some((vec!["d"], 0)),
        "c went with the cancel"
    );
}

#[test]
fn a_rule_change_keeps_the_list_a_prefix_of_the_round() {
    // The rule in force when a round opens decides whether it keeps ids; the cap in force at
    // each upload whether that id is listed, and once one is dropped all later ones are.
    let mut d = Driver::new(Engine::new(PolicyTable::uniform(
        PolicySpec::fixed(1_000).with_event_ids(2),
    )));
    let (mut t, mut out) = (MemTable::new(), Vec::new());
    let mut step = |d: &mut Driver, u: Upload| d.apply(&mut t, u.event_time, &u, &mut out).unwrap();
    step(&mut d, with_id(0, Some("a")));
    step(&mut d, with_id(100, Some("b")));
    step(&mut d, with_id(200, Some("c"))); // over the cap of 2: dropped
    d.set_engine(Engine::new(PolicyTable::uniform(
        PolicySpec::fixed(1_000).with_event_ids(8),
    )));
    step(&mut d, with_id(300, Some("d"))); // room again, but "c" was dropped: dropped too
    step(&mut d, with_id(5_000, Some("e"))); // a new round: listed from the start
    d.set_engine(Engine::new(PolicyTable::uniform(PolicySpec::fixed(1_000))));
    step(&mut d, with_id(5_100, Some("f"))); // event-ids 0 now: counted, not listed
    step(&mut d, with_id(9_000, Some("g"))); // a round opened under 0 keeps no ids
    d.set_engine(Engine::new(PolicyTable::uniform(
        PolicySpec::fixed(1_000).with_event_ids(8),
    )));
    step(&mut d, with_id(9_100, Some("h"))); // its first upload was not listed: still none
    d.advance(&mut t, 100_000, &mut out).unwrap();
    let ids: Vec<_> = out.iter().map(ids_of).collect();
    assert_eq!(
        ids,
        vec![Some((vec!["a", "b"], 2)), Some((vec!["e"], 1)), None,]
    );
}

#[test]
fn event_ids_are_per_tenant() {
    let mut table = PolicyTable::uniform(PolicySpec::fixed(1_000));
    table
        .tenants
        .insert("acme".into(), PolicySpec::fixed(1_000).with_event_ids(4));
    let mut d = Driver::new(Engine::new(table));
    let (mut t, mut out) = (MemTable::new(), Vec::new());
    for tenant in ["acme", "other"] {
        let u = Upload {
            event_id: Some("e".into()),
            ..Upload::plain(SessionKey::new(tenant, "s"), 0)
        };
        d.apply(&mut t, 0, &u, &mut out).unwrap();
    }
    d.advance(&mut t, 10_000, &mut out).unwrap();
    let by_tenant: Vec<_> = out
        .iter()
        .map(|e| (e.key.tenant().to_owned(), ids_of(e)))
        .collect();
    assert!(by_tenant.contains(&("acme".into(), Some((vec!["e"], 0)))));
    assert!(by_tenant.contains(&("other".into(), None)));
}

#[test]
fn event_ids_hold_ids_compactly() {
    // What a round pays per id held: its bytes + 1 (the buffer may have up to as much again
    // in spare capacity); the ids come back unchanged, any UTF-8, up to 128 bytes.
    let long = "x".repeat(128);
    let mut ids = EventIds::default();
    for id in [
        "",
        "é🚀",
        long.as_str(),
        "0f8fad5b-d9cb-469f-a165-70867728950e",
    ] {
        ids.push(id, 10);
    }
    assert_eq!(
        ids.iter().collect::<Vec<_>>(),
        [
            "",
            "é🚀",
            long.as_str(),
            "0f8fad5b-d9cb-469f-a165-70867728950e"
        ]
    );
    assert_eq!((ids.listed(), ids.dropped()), (4, 0));
    assert!(ids.heap_bytes() >= 4 + 6 + 128 + 36);
    // An id over 255 bytes (never through `codec::decode_upload`) is counted, not listed.
    ids.push(&"y".repeat(256), 10);
    assert_eq!((ids.listed(), ids.dropped()), (4, 1));
    assert_eq!(std::mem::size_of::<EventIds>(), 32);
    assert_eq!(std::mem::size_of::<Option<Box<EventIds>>>(), 8);
}
