//! Tier routing (SEMANTICS §5) driven by a manual clock: every call gets its time in ms.

use settle::engine::{Millis, SessionKey};
use settle::tiers::{ChangeReason, Router, SharedRouter, TierChange, TierSpec, TiersConfig};
use std::time::Duration;

/// 2023-11-14T22:13:20.000Z
const T0: Millis = 1_700_000_000_000;

fn config(limit: u64, period_ms: u64, ratio: f64, cooldown_ms: u64) -> TiersConfig {
    TiersConfig {
        limit,
        period: Duration::from_millis(period_ms),
        recover_ratio: ratio,
        cooldown: Duration::from_millis(cooldown_ms),
        ..TiersConfig::default()
    }
}

/// limit 10 per 1 s, recovery below 5 (10 × 0.5), cooldown 5 s.
fn small() -> Router {
    Router::new(&config(10, 1000, 0.5, 5000)).expect("valid config")
}

/// Routes one emission and returns (tier, change).
fn route(r: &mut Router, tenant: &str, at: Millis) -> (String, Option<TierChange>) {
    let route = r.route(tenant, at);
    (route.tier.to_owned(), route.change)
}

/// Routes `n` emissions at `at`, asserting none of them changes the tier; returns the tier.
fn burst(r: &mut Router, tenant: &str, at: Millis, n: usize) -> String {
    let mut tier = String::new();
    for _ in 0..n {
        let (t, change) = route(r, tenant, at);
        assert_eq!(change, None, "unexpected change at {at}");
        tier = t;
    }
    tier
}

/// Demotes `tenant` of a [`small`] router with 11 emissions at `at`.
fn demote_small(r: &mut Router, tenant: &str, at: Millis) {
    assert_eq!(burst(r, tenant, at, 10), "normal");
    let (tier, change) = route(r, tenant, at);
    assert_eq!(tier, "limited");
    assert_eq!(
        change.expect("11th emission demotes").reason,
        ChangeReason::RateExceeded
    );
}

#[test]
fn exactly_limit_per_period_stays_normal_and_limit_plus_one_demotes() {
    let mut r = Router::new(&TiersConfig::default()).expect("defaults are valid");
    // 600 emissions within 59.4 s: exactly the limit.
    for i in 0..600 {
        let route = r.route("acme", T0 + i * 99);
        assert_eq!((route.tier, route.topic), ("normal", "settle.ready.normal"));
        assert_eq!(route.change, None, "emission {i} must not demote");
    }
    assert_eq!(r.rate_of("acme", T0 + 59_999), 600);
    // The 601st inside the same minute crosses the limit and is itself routed to `limited`.
    let route = r.route("acme", T0 + 59_999);
    assert_eq!(
        (route.tier, route.topic),
        ("limited", "settle.ready.limited")
    );
    assert_eq!(
        route.change,
        Some(TierChange {
            tenant: "acme".into(),
            from: "normal".into(),
            to: "limited".into(),
            rate: 601,
            limit: 600,
            at: T0 + 59_999,
            reason: ChangeReason::RateExceeded,
        })
    );
    let next = r.route("acme", T0 + 60_000);
    assert_eq!((next.tier, next.change), ("limited", None));
    assert_eq!(r.tier_of("acme"), "limited");
    assert_eq!(r.tier_of("other"), "normal");
    let c = r.counters();
    assert_eq!((c.demotions, c.recoveries), (1, 0));
    assert_eq!(
        c.routed,
        vec![("normal".to_owned(), 600), ("limited".to_owned(), 2)]
    );
    assert_eq!((c.tenants_tracked, c.tenants_demoted), (1, 1));
}

#[test]
fn a_steady_stream_at_exactly_the_limit_never_demotes() {
    let mut r = small();
    // 10 per second, one every 100 ms, for 100 s: every window (t - 1 s, t] holds 10.
    for i in 0..1000 {
        let (tier, change) = route(&mut r, "steady", T0 + i * 100);
        assert_eq!((tier.as_str(), change), ("normal", None), "emission {i}");
        assert_eq!(r.rate_of("steady", T0 + i * 100), 10.min(i as u64 + 1));
    }
    // One extra emission in the last window is the 11th: demoted.
    let (tier, change) = route(&mut r, "steady", T0 + 99_950);
    assert_eq!(tier, "limited");
    assert_eq!(change.expect("demoted").rate, 11);
}

#[test]
fn the_window_slides_an_emission_counts_for_exactly_one_period() {
    // 10 at T0; the 11th 999 ms later is still in the same window.
    let mut r = small();
    burst(&mut r, "a", T0, 10);
    assert_eq!(route(&mut r, "a", T0 + 999).0, "limited");

    // 1000 ms later the first 10 have left the window: 10 more are fine.
    let mut r = small();
    burst(&mut r, "a", T0, 10);
    assert_eq!(burst(&mut r, "a", T0 + 1000, 10), "normal");
    assert_eq!(route(&mut r, "a", T0 + 1000).0, "limited");
}

#[test]
fn no_promotion_before_the_cooldown_promotion_after() {
    let mut r = small();
    demote_small(&mut r, "noisy", T0);
    // The rate falls below 5 at T0 + 1000 (the burst leaves the window); cooldown 5 s.
    let recovers_at = T0 + 6000;
    assert_eq!(r.demoted(T0)[0].recovers_at, recovers_at);
    for at in [T0 + 1000, T0 + 3000, recovers_at - 1] {
        assert!(
            r.sweep(at, usize::MAX).changes.is_empty(),
            "no promotion at {at}"
        );
        assert_eq!(r.tier_of("noisy"), "limited");
    }
    // An emission just before the end of the cooldown (rate 1 < 5) is still limited.
    assert_eq!(
        route(&mut r, "noisy", recovers_at - 1),
        ("limited".into(), None)
    );
    // The first emission at the end of the cooldown is promoted and routed to normal.
    let route = r.route("noisy", recovers_at);
    assert_eq!((route.tier, route.topic), ("normal", "settle.ready.normal"));
    assert_eq!(
        route.change,
        Some(TierChange {
            tenant: "noisy".into(),
            from: "limited".into(),
            to: "normal".into(),
            rate: 1,
            limit: 10,
            at: recovers_at,
            reason: ChangeReason::Recovered,
        })
    );
    assert!(r.demoted(recovers_at).is_empty());
    let c = r.counters();
    assert_eq!((c.demotions, c.recoveries, c.tenants_demoted), (1, 1, 0));
}

#[test]
fn sweep_promotes_an_idle_demoted_tenant_then_forgets_it() {
    let mut r = small();
    demote_small(&mut r, "noisy", T0);
    assert!(r.sweep(T0 + 5999, usize::MAX).changes.is_empty());
    let sweep = r.sweep(T0 + 6000, usize::MAX);
    assert_eq!(sweep.changes.len(), 1);
    let change = &sweep.changes[0];
    assert_eq!(
        (change.reason, change.rate, change.at),
        (ChangeReason::Recovered, 0, T0 + 6000)
    );
    assert_eq!(
        (change.from.as_str(), change.to.as_str()),
        ("limited", "normal")
    );
    assert_eq!(r.tier_of("noisy"), "normal");
    // Idle and back in its starting tier: forgotten in the same sweep (its window is empty).
    assert_eq!(sweep.forgotten, 1);
    assert_eq!(r.counters().tenants_tracked, 0);
    assert_eq!(r.rate_of("noisy", T0 + 6000), 0);
}

#[test]
fn staying_above_the_recovery_threshold_keeps_restarting_the_cooldown() {
    let mut r = small();
    demote_small(&mut r, "hover", T0);
    // 5 per second (one every 200 ms): at the recovery threshold (not below 5), under the
    // limit. It stays limited for all 20 s, far beyond the 5 s cooldown.
    let mut last = T0;
    for i in 1..=100 {
        last = T0 + i * 200;
        assert_eq!(
            route(&mut r, "hover", last),
            ("limited".into(), None),
            "at +{}",
            i * 200
        );
        assert!(r.sweep(last, usize::MAX).changes.is_empty());
    }
    // It stops: the five latest (last-800 ..= last) leave the window at last-800+1000;
    // promotion 5 s after that, not before.
    let recovers_at = last - 800 + 1000 + 5000;
    assert!(r.sweep(recovers_at - 1, usize::MAX).changes.is_empty());
    let changes = r.sweep(recovers_at, usize::MAX).changes;
    assert_eq!(changes.len(), 1);
    assert_eq!(changes[0].reason, ChangeReason::Recovered);
    assert_eq!(
        r.counters().demotions,
        1,
        "no flapping: one demotion, one recovery"
    );
}

#[test]
fn a_return_above_the_threshold_during_the_cooldown_restarts_it() {
    let mut r = small();
    demote_small(&mut r, "dip", T0);
    // Below the threshold from T0 + 1000; without disturbance it would recover at T0 + 6000.
    assert!(r.sweep(T0 + 3000, usize::MAX).changes.is_empty());
    // At T0 + 3000 it is back at the threshold (5 in one window): the cooldown restarts from
    // when these 5 leave the window, T0 + 4000.
    assert_eq!(burst(&mut r, "dip", T0 + 3000, 5), "limited");
    for at in [T0 + 6000, T0 + 8999] {
        assert!(
            r.sweep(at, usize::MAX).changes.is_empty(),
            "still cooling down at {at}"
        );
        assert_eq!(r.tier_of("dip"), "limited");
    }
    assert_eq!(r.sweep(T0 + 9000, usize::MAX).changes.len(), 1);
    assert_eq!(r.tier_of("dip"), "normal");
}

#[test]
fn a_rate_oscillating_around_the_limit_does_not_flap() {
    let mut r = small();
    let mut changes = Vec::new();
    // Alternate seconds of 12 and 8 emissions (mean 10/s = the limit) for 60 s, sweeping
    // every second.
    for s in 0..60 {
        let n = if s % 2 == 0 { 12 } else { 8 };
        for j in 0..n {
            let at = T0 + s * 1000 + j * (1000 / n);
            changes.extend(r.route("osc", at).change);
        }
        changes.extend(r.sweep(T0 + s * 1000 + 999, usize::MAX).changes);
    }
    assert_eq!(
        changes.len(),
        1,
        "one demotion and no flapping: {changes:?}"
    );
    assert_eq!(changes[0].reason, ChangeReason::RateExceeded);
}

#[test]
fn pinned_tenants_never_move() {
    let mut cfg = config(10, 1000, 0.5, 5000);
    cfg.pinned.insert("bigco".into(), "limited".into());
    cfg.pinned.insert("vip".into(), "normal".into());
    let mut r = Router::new(&cfg).expect("valid config");
    for i in 0..10_000 {
        let at = T0 + i / 10;
        let big = r.route("bigco", at);
        assert_eq!(
            (big.tier, big.topic, big.change),
            ("limited", "settle.ready.limited", None)
        );
        let vip = r.route("vip", at);
        assert_eq!(
            (vip.tier, vip.topic, vip.change),
            ("normal", "settle.ready.normal", None)
        );
    }
    // Then silence, long past any cooldown.
    assert!(r.sweep(T0 + 60_000, usize::MAX).changes.is_empty());
    assert_eq!(r.tier_of("bigco"), "limited");
    assert_eq!(r.tier_of("vip"), "normal");
    assert!(r.demoted(T0).is_empty());
    let c = r.counters();
    assert_eq!((c.demotions, c.recoveries, c.tenants_demoted), (0, 0, 0));
    assert_eq!(r.route("bigco", T0 + 60_000).tier, "limited");
}

#[test]
fn pinned_tenants_rate_is_still_measured() {
    let mut cfg = config(10, 1000, 0.5, 5000);
    cfg.pinned.insert("vip".into(), "normal".into());
    let mut r = Router::new(&cfg).expect("valid config");
    for _ in 0..10_000 {
        r.route("vip", T0);
    }
    // 10 000 emissions in one ms: beyond limit + 1 the rate is estimated by coarse buckets,
    // which are exact when everything happened at once.
    assert_eq!(r.rate_of("vip", T0), 10_000);
    assert_eq!(r.rate_of("vip", T0 + 1000), 0);
}

#[test]
fn an_override_pin_holds_the_automatic_state_and_tiering_resumes_without_it() {
    let mut r = small();
    // Pinned to normal: 20 emissions (twice the limit) stay normal, no change.
    assert!(r.set_override_pins([("acme", "normal")]).is_empty());
    assert_eq!(burst(&mut r, "acme", T0, 20), "normal");
    assert_eq!(r.tier_of("acme"), "normal");
    assert_eq!(r.pinned("acme"), Some(("normal", "override")));
    assert_eq!(r.rate_of("acme", T0), 20, "the rate is still measured");
    // The pin goes: acme's next emission is tiered by its measured rate.
    assert_eq!(
        r.set_override_pins([("gamma", "gold")]),
        vec!["gamma".to_owned()],
        "an unknown tier pins nothing"
    );
    assert_eq!(r.pinned("acme"), None);
    let (tier, change) = route(&mut r, "acme", T0 + 2);
    assert_eq!(tier, "limited");
    assert_eq!(change.expect("demoted").reason, ChangeReason::RateExceeded);
    // Demoted first, then pinned to normal: routed normal, no promotion while pinned, even
    // long past the cooldown (and the sweep does not spin on it).
    demote_small(&mut r, "beta", T0 + 3);
    r.set_override_pins([("beta", "normal")]);
    assert_eq!(route(&mut r, "beta", T0 + 4).0, "normal");
    assert!(r
        .sweep(T0 + 60_000, usize::MAX)
        .changes
        .iter()
        .all(|c| c.tenant != "beta"));
    assert!(r.demoted(T0 + 60_000).iter().any(|d| d.tenant == "beta"));
    // Unpinned: promoted by the rule once a sweep looks at it again.
    r.set_override_pins(std::iter::empty());
    let promoted = r.sweep(T0 + 61_000, usize::MAX).changes;
    assert!(
        promoted
            .iter()
            .any(|c| c.tenant == "beta" && c.reason == ChangeReason::Recovered),
        "{promoted:?}"
    );
}

/// Times of a deterministic, bursty emission stream: ~1200/min for 3000 emissions, 10 min
/// quiet, then 17 000 emissions with jittered gaps around 600/min.
fn bursty_times() -> Vec<Millis> {
    let mut seed: u64 = 0x5eed;
    let mut next = move |bound: u64| {
        seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (seed >> 33) % bound
    };
    let mut t = T0;
    let mut times = Vec::new();
    for _ in 0..3000 {
        t += next(100) as Millis;
        times.push(t);
    }
    t += 10 * 60_000;
    for _ in 0..17_000 {
        t += next(200) as Millis;
        times.push(t);
    }
    times
}

#[test]
fn a_tenant_over_10_000_sessions_is_demoted_exactly_like_one_over_10() {
    let wide: Vec<SessionKey> = (0..10_000)
        .map(|i| SessionKey::new("wide", &format!("session-{i}")))
        .collect();
    let narrow: Vec<SessionKey> = (0..10)
        .map(|i| SessionKey::new("narrow", &format!("session-{i}")))
        .collect();
    let mut r = Router::new(&TiersConfig::default()).expect("defaults are valid");
    let as_narrow = |c: TierChange| TierChange {
        tenant: "narrow".into(),
        ..c
    };
    let (mut changes, mut next_sweep) = (0, T0);
    for (i, &at) in bursty_times().iter().enumerate() {
        while next_sweep <= at {
            let mut swept = r.sweep(next_sweep, usize::MAX).changes;
            swept.sort_by(|a, b| a.tenant.cmp(&b.tenant));
            match swept.as_slice() {
                [] => {}
                [n, w] => {
                    assert_eq!((n.tenant.as_str(), w.tenant.as_str()), ("narrow", "wide"));
                    assert_eq!(as_narrow(w.clone()), *n);
                    changes += 1;
                }
                other => panic!("sweep at {next_sweep} moved only one tenant: {other:?}"),
            }
            next_sweep += 1000;
        }
        let w = r.route(wide[i % wide.len()].tenant(), at);
        let (w_tier, w_change) = (w.tier.to_owned(), w.change);
        let n = r.route(narrow[i % narrow.len()].tenant(), at);
        assert_eq!(w_tier, n.tier, "emission {i} at {at}");
        assert_eq!(w_change.map(as_narrow), n.change, "emission {i} at {at}");
        changes += usize::from(n.change.is_some());
    }
    let c = r.counters();
    assert!(
        c.demotions >= 2 && c.recoveries >= 2,
        "both tenants moved: {c:?}"
    );
    assert_eq!(c.demotions + c.recoveries, 2 * changes as u64);
    // State is per tenant, not per session: two entries for 10 010 sessions.
    assert_eq!(c.tenants_tracked, 2);
}

#[test]
fn forgetting_idle_tenants_does_not_change_any_decision() {
    // 40 tenants with bursts of different sizes; one router sweeps every 250 ms, the other
    // never does (it applies promotions lazily in `route`).
    let mut swept = small();
    let mut lazy = small();
    let mut forgotten_on_the_way = 0;
    for step in 0..2000 {
        let at = T0 + step * 250;
        forgotten_on_the_way += swept.sweep(at, 7).forgotten;
        for k in 0..40u64 {
            // Tenant k emits (k % 13) emissions every (k + 1) × 250 ms, plus a burst of 20
            // every 30 s for k < 8.
            let mut n = if step as u64 % (k + 1) == 0 {
                k % 13
            } else {
                0
            };
            if k < 8 && step % 120 == k as i64 {
                n += 20;
            }
            let tenant = format!("t{k}");
            for _ in 0..n {
                assert_eq!(
                    swept.route(&tenant, at).tier,
                    lazy.route(&tenant, at).tier,
                    "tenant {tenant} at step {step}"
                );
            }
        }
    }
    assert!(
        lazy.counters().demotions > 0,
        "the scenario must demote someone"
    );
    assert_eq!(swept.counters().demotions, lazy.counters().demotions);
    // Long after the last emission everything is promoted and forgotten.
    let end = T0 + 2000 * 250 + 1000 + 5000;
    let mut sweep = swept.sweep(end, usize::MAX);
    assert!(!sweep.more);
    sweep
        .changes
        .retain(|c| c.reason != ChangeReason::Recovered);
    assert!(sweep.changes.is_empty());
    assert_eq!(swept.counters().tenants_tracked, 0);
    assert_eq!(swept.counters().tenants_demoted, 0);
    assert!(
        forgotten_on_the_way > 0,
        "sparse tenants are forgotten between emissions"
    );
}

#[test]
fn sweep_respects_its_budget_and_shared_sweep_finishes_the_job() {
    let mut r = small();
    for k in 0..1000 {
        r.route(&format!("t{k}"), T0);
    }
    let first = r.sweep(T0 + 1000, 100);
    assert_eq!((first.forgotten, first.more), (100, true));
    assert_eq!(r.counters().tenants_tracked, 900);

    // 900 left: several chunks of SWEEP_CHUNK, the lock released between them.
    let shared = SharedRouter::new(r);
    assert!(shared.sweep(T0 + 1000).is_empty());
    assert_eq!(shared.lock().counters().tenants_tracked, 0);
}

#[test]
fn router_time_never_goes_backwards() {
    let mut r = Router::new(&config(1, 1000, 1.0, 0)).expect("valid config");
    assert_eq!(route(&mut r, "a", T0 + 1000).0, "normal");
    // A lagging caller passes an older time: counted at T0 + 1000, the 2nd in the window.
    let (tier, change) = route(&mut r, "a", T0);
    assert_eq!(tier, "limited");
    assert_eq!(change.expect("demoted").at, T0 + 1000);
}

#[test]
fn a_single_tier_never_demotes_and_demote_to_can_name_a_middle_tier() {
    let mut one = config(1, 1000, 0.5, 0);
    one.tiers.truncate(1);
    let mut r = Router::new(&one).expect("valid config");
    assert!(!r.tiers().auto_demotion());
    assert_eq!(burst(&mut r, "a", T0, 100), "normal");

    let mut three = config(1, 1000, 0.5, 0);
    three
        .tiers
        .insert(1, TierSpec::new("slow", "settle.ready.slow"));
    three.demote_to = Some("slow".into());
    let mut r = Router::new(&three).expect("valid config");
    assert_eq!(r.tiers().demote_to(), "slow");
    r.route("a", T0);
    let route = r.route("a", T0);
    assert_eq!((route.tier, route.topic), ("slow", "settle.ready.slow"));
    assert_eq!(route.change.expect("demoted").to, "slow");
}

#[test]
fn shared_router_counts_a_tenant_across_partition_threads() {
    let shared = SharedRouter::new(small());
    // Four "partition tasks" publish 2500 emissions each for the same tenant in the same ms.
    let normal: usize = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let shared = shared.clone();
                s.spawn(move || {
                    (0..2500)
                        .filter(|_| shared.route("acme", T0).tier == "normal")
                        .count()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("no panic"))
            .sum()
    });
    assert_eq!(
        normal, 10,
        "exactly `limit` emissions stay normal, whatever the interleaving"
    );
    let router = shared.lock();
    let c = router.counters();
    assert_eq!(c.demotions, 1);
    assert_eq!(
        c.routed,
        vec![("normal".into(), 10), ("limited".into(), 9990)]
    );
    assert_eq!(router.rate_of("acme", T0), 10_000);
}

#[test]
fn tier_change_json_has_exactly_the_published_fields() {
    let mut r = small();
    burst(&mut r, "acme", T0, 10);
    let change = r.route("acme", T0 + 123).change.expect("demoted");
    let json: serde_json::Value = serde_json::from_slice(&change.to_json()).expect("JSON");
    assert_eq!(
        json,
        serde_json::json!({
            "tenant": "acme",
            "from": "normal",
            "to": "limited",
            "rate": 11,
            "limit": 10,
            "at": "2023-11-14T22:13:20.123Z",
            "reason": "rate_exceeded",
        })
    );
    let back: TierChange = serde_json::from_slice(&change.to_json()).expect("reads back");
    assert_eq!(back, change);

    let recovered = r.sweep(T0 + 6123, usize::MAX).changes;
    let json: serde_json::Value = serde_json::from_slice(&recovered[0].to_json()).expect("JSON");
    assert_eq!(json["reason"], "recovered");
    assert_eq!(json["at"], "2023-11-14T22:13:26.123Z");
    let mut keys: Vec<&str> = json
        .as_object()
        .expect("object")
        .keys()
        .map(String::as_str)
        .collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        ["at", "from", "limit", "rate", "reason", "tenant", "to"]
    );
}

#[test]
fn demoted_listing_for_inspect_and_admin() {
    let mut r = small();
    demote_small(&mut r, "b", T0);
    demote_small(&mut r, "a", T0 + 500);
    let rows = r.demoted(T0 + 600);
    let names: Vec<&str> = rows.iter().map(|d| d.tenant.as_str()).collect();
    assert_eq!(names, ["a", "b"]);
    assert_eq!((rows[1].since, rows[1].rate, rows[1].limit), (T0, 11, 10));
    assert_eq!(rows[1].tier, "limited");
    let json = serde_json::to_value(&rows[1]).expect("JSON");
    assert_eq!(json["since"], "2023-11-14T22:13:20.000Z");
    assert_eq!(json["recovers_at"], "2023-11-14T22:13:26.000Z");
}
