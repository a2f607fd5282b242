//! Property test: the engine (through `Driver` + `MemTable`) against a small reference model
//! written straight from SEMANTICS §4, on random traces of several keys.
//!
//! The model handles one key at a time, with a plain list of uploads and no timers, tables or
//! ordering machinery. Properties checked on every trace:
//! * per key, the engine's emissions equal the model's (trigger, due_at, uploads, first/last);
//! * every applied upload is counted in exactly one emission (every round is emitted once);
//! * generations of a key are 1, 2, 3, ... (strictly increasing);
//! * nothing is emitted before its due time, and output is in due-time order.

use proptest::prelude::*;
use settle::engine::{
    Driver, Emission, Engine, MemTable, Millis, Part, PolicyName, PolicySpec, PolicyTable,
    SessionKey, Trigger, Upload,
};
use std::collections::BTreeMap;

/// What the model emits: (trigger, due_at, uploads, first_upload_at, last_upload_at).
type Em = (Trigger, Millis, u32, Millis, Millis);

struct Open {
    start: Millis,
    deadline: Millis,
    max_wait_at: Option<Millis>,
    uploads: u32,
    first: Option<Millis>,
    last: Option<Millis>,
    parts: Vec<u32>,
}

/// The reference model for one key: uploads sorted by time (no late uploads, no ids).
fn model(spec: &PolicySpec, uploads: &[(Millis, Option<Part>, bool)]) -> Vec<Em> {
    let mut out = Vec::new();
    let mut round: Option<Open> = None;
    let mut track: Option<(Millis, Millis)> = None;
    let mut last_upload = 0;
    // Fires what is due at or before `t`: returns false when nothing was due.
    let fire = |round: &mut Option<Open>, out: &mut Vec<Em>, t: Millis, last_upload: Millis| {
        let Some(r) = round.as_mut() else {
            return false;
        };
        let due = r.max_wait_at.map_or(r.deadline, |m| m.min(r.deadline));
        if due > t {
            return false;
        }
        let first = r.first.unwrap_or(last_upload);
        let last = r.last.unwrap_or(last_upload);
        match r.max_wait_at {
            Some(m) if m < r.deadline => {
                if r.uploads > 0 {
                    out.push((Trigger::MaxWait, m, r.uploads, first, last));
                    r.parts.clear();
                }
                r.start = m;
                r.max_wait_at = Some(m + spec.max_wait.unwrap());
                r.uploads = 0;
                r.first = None;
                r.last = None;
            }
            _ => {
                if r.uploads > 0 {
                    out.push((Trigger::Trailing, r.deadline, r.uploads, first, last));
                }
                *round = None;
            }
        }
        true
    };
    for &(t, part, fin) in uploads {
        while fire(&mut round, &mut out, t, last_upload) {}
        let delay = match spec.name {
            PolicyName::Adaptive => {
                let d = match track {
                    None => spec.min_delay,
                    Some((pt, pd)) => std::cmp::min(std::cmp::max(pd, t - pt), spec.max_delay),
                };
                track = Some((t, d));
                d
            }
            _ => spec.delay,
        };
        last_upload = t;
        let opening = round.is_none();
        let r = round.get_or_insert(Open {
            start: t,
            deadline: t + delay,
            max_wait_at: spec.max_wait.map(|w| t + w),
            uploads: 0,
            first: None,
            last: None,
            parts: vec![],
        });
        let _ = r.start;
        r.uploads += 1;
        r.first.get_or_insert(t);
        r.last = Some(t);
        r.deadline = t + delay;
        let mut complete = false;
        if let Some(p) = part {
            if !r.parts.contains(&p.index) {
                r.parts.push(p.index);
            }
            complete = (1..=p.count).all(|i| r.parts.contains(&i));
        }
        let first = r.first.unwrap();
        let now = (r.uploads, first, t);
        if fin {
            out.push((Trigger::Final, t, now.0, now.1, now.2));
            round = None;
        } else if complete {
            out.push((Trigger::Complete, t, now.0, now.1, now.2));
            round = None;
        } else if opening && spec.name == PolicyName::LeadingTrailing {
            out.push((Trigger::Leading, t, now.0, now.1, now.2));
            r.uploads = 0;
            r.first = None;
            r.last = None;
        }
    }
    while fire(&mut round, &mut out, Millis::MAX / 4, last_upload) {}
    out
}

fn spec_strategy() -> impl Strategy<Value = PolicySpec> {
    let max_wait = prop::option::of(1i64..400);
    prop_oneof![
        (1i64..300, max_wait.clone()).prop_map(|(d, w)| {
            let s = PolicySpec::fixed(d);
            match w {
                Some(w) => s.with_max_wait(w),
                None => s,
            }
        }),
        (1i64..300, max_wait.clone()).prop_map(|(d, w)| {
            let s = PolicySpec::leading_trailing(d);
            match w {
                Some(w) => s.with_max_wait(w),
                None => s,
            }
        }),
        (1i64..100, 0i64..400, max_wait).prop_map(|(min, extra, w)| {
            let s = PolicySpec::adaptive(min, min + extra);
            match w {
                Some(w) => s.with_max_wait(w),
                None => s,
            }
        }),
    ]
}

/// A trace: (gap to previous upload ms, key index, part, final).
type Trace = Vec<(Millis, usize, Option<(u32, u32)>, bool)>;

fn trace_strategy() -> impl Strategy<Value = Trace> {
    prop::collection::vec(
        (
            prop_oneof![4 => 0i64..50, 2 => 0i64..400, 1 => 0i64..3000],
            0usize..4,
            prop::option::weighted(0.15, (1u32..4, 1u32..4)),
            prop::bool::weighted(0.05),
        ),
        0..60,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn engine_matches_reference_model(spec in spec_strategy(), trace in trace_strategy()) {
        let keys: Vec<SessionKey> = (0..4).map(|i| SessionKey::new("t", &format!("s{i}"))).collect();
        let mut per_key: BTreeMap<usize, Vec<(Millis, Option<Part>, bool)>> = BTreeMap::new();
        let mut driver = Driver::new(Engine::new(PolicyTable::uniform(spec.clone())));
        let mut table = MemTable::new();
        let mut out: Vec<Emission> = Vec::new();
        let mut t = 1_000;
        let mut applied = 0u64;
        for (gap, k, part, fin) in trace {
            t += gap;
            let part = part.map(|(a, b)| Part { index: a.min(b), count: a.max(b) });
            per_key.entry(k).or_default().push((t, part, fin));
            let u = Upload { part, final_flag: fin, ..Upload::plain(keys[k].clone(), t) };
            let before = out.len();
            driver.apply(&mut table, t, &u, &mut out).unwrap();
            applied += 1;
            for e in &out[before..] {
                prop_assert!(e.due_at <= t, "emitted {:?} before due (now {})", e, t);
            }
        }
        driver.advance(&mut table, Millis::MAX / 4, &mut out).unwrap();
        prop_assert_eq!(table.open_rounds(), 0);

        // Output in due-time order; uploads all accounted for.
        prop_assert!(out.windows(2).all(|w| w[0].due_at <= w[1].due_at));
        prop_assert_eq!(out.iter().map(|e| e.uploads as u64).sum::<u64>(), applied);

        for (k, ups) in &per_key {
            let got: Vec<&Emission> = out.iter().filter(|e| e.key == keys[*k]).collect();
            let gens: Vec<u64> = got.iter().map(|e| e.generation).collect();
            prop_assert_eq!(gens, (1..=got.len() as u64).collect::<Vec<_>>());
            let got: Vec<Em> = got
                .iter()
                .map(|e| (e.trigger, e.due_at, e.uploads, e.first_upload_at, e.last_upload_at))
                .collect();
            prop_assert_eq!(got, model(&spec, ups), "key s{}", k);
        }
    }

    /// With event times going backwards (late uploads) and redelivered ids, every applied
    /// upload is still counted exactly once and generations stay gap-free.
    #[test]
    fn late_and_redelivered_uploads_keep_counts(
        spec in spec_strategy(),
        moves in prop::collection::vec((-200i64..300, 0usize..3, prop::option::of(0u8..3)), 0..80),
    ) {
        let keys: Vec<SessionKey> = (0..3).map(|i| SessionKey::new("t", &format!("s{i}"))).collect();
        let mut driver = Driver::new(Engine::new(PolicyTable::uniform(spec)));
        let mut table = MemTable::new();
        let mut out = Vec::new();
        let mut now = 10_000;
        let mut applied = 0u64;
        for (dt, k, id) in moves {
            let t = (now + dt).max(0);
            now = now.max(t);
            let u = Upload { event_id: id.map(|i| format!("e{i}")), ..Upload::plain(keys[k].clone(), t) };
            if driver.apply(&mut table, now, &u, &mut out).unwrap() != settle::engine::Applied::Redelivered {
                applied += 1;
            }
        }
        driver.advance(&mut table, Millis::MAX / 4, &mut out).unwrap();
        prop_assert_eq!(out.iter().map(|e| e.uploads as u64).sum::<u64>(), applied);
        for k in &keys {
            let gens: Vec<u64> = out.iter().filter(|e| &e.key == k).map(|e| e.generation).collect();
            prop_assert_eq!(gens.clone(), (1..=gens.len() as u64).collect::<Vec<_>>());
        }
    }
}
