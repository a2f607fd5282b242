//! Deployment-wide tiers (SEMANTICS §5: the rate is the deployment's, a tier outlives
//! restarts) on routers exchanging [`CountsSnapshot`]s by hand, on a manual clock: what the
//! tier-share task of each instance does through the broker.

use settle::engine::Millis;
use settle::tiers::{ChangeReason, CountsSnapshot, Router, TiersConfig};
use std::time::Duration;

/// 2023-11-14T22:13:20.000Z
const T0: Millis = 1_700_000_000_000;

/// limit 120 per 20 s, recovery below 60, cooldown 10 s, counts shared every second (the
/// issue's three-instance setup).
fn config() -> TiersConfig {
    TiersConfig {
        limit: 120,
        period: Duration::from_secs(20),
        recover_ratio: 0.5,
        cooldown: Duration::from_secs(10),
        share_interval: Duration::from_secs(1),
        ..TiersConfig::default()
    }
}

fn instances(n: usize) -> Vec<Router> {
    (0..n)
        .map(|i| {
            let mut r = Router::new(&config()).expect("valid config");
            r.set_instance(&format!("settle-{i}"));
            r
        })
        .collect()
}

/// Every router publishes its snapshot at `now` and every other one takes it.
fn exchange(routers: &mut [Router], now: Millis) -> usize {
    let snaps: Vec<CountsSnapshot> = routers.iter_mut().map(|r| r.share_snapshot(now)).collect();
    let mut changes = 0;
    for r in routers.iter_mut() {
        for s in &snaps {
            changes += r.apply_remote(s, now).len();
        }
    }
    changes
}

/// A tenant sending `per_sec` emissions per second spread round-robin over `routers` for
/// `secs` seconds, counts exchanged every second. Returns the deployment-wide count of the
/// tenant's emissions in the window at its first demotion (by any instance), if any, and the
/// number of demotions.
fn spread(routers: &mut [Router], tenant: &str, per_sec: u64, secs: u64) -> (Option<u64>, u64) {
    let step = 1000 / per_sec;
    let mut times: Vec<Millis> = Vec::new();
    let mut first = None;
    let mut demotions = 0;
    let mut next_exchange = T0 + 1000;
    for i in 0..per_sec * secs {
        let now = T0 + (i * step) as Millis;
        while now >= next_exchange {
            let decided = exchange(routers, next_exchange) as u64;
            if decided > 0 && first.is_none() {
                let horizon = next_exchange - 20_000;
                first = Some(times.iter().filter(|&&t| t > horizon).count() as u64);
            }
            demotions += decided;
            next_exchange += 1000;
        }
        let r = &mut routers[i as usize % routers.len()];
        times.push(now);
        if let Some(c) = r.route(tenant, now).change {
            assert_eq!(c.reason, ChangeReason::RateExceeded);
            demotions += 1;
            if first.is_none() {
                let in_window = times.iter().filter(|&&t| t > now - 20_000).count() as u64;
                first = Some(in_window);
            }
        }
    }
    (first, demotions)
}

#[test]
fn a_tenant_spread_over_three_instances_is_demoted_near_the_limit_not_at_three_times_it() {
    let mut routers = instances(3);
    // 12 per second = twice the limit of 120 per 20 s, over all three instances for 60 s.
    let (first, demotions) = spread(&mut routers, "noisy", 12, 60);
    let at = first.expect("the deployment-wide rate crosses the limit: demoted");
    println!("demoted with {at} emissions in the window (limit 120), {demotions} demotion(s)");
    assert!(
        (121..=144).contains(&at),
        "demoted with {at} emissions in the window, want within 20 % above the limit of 120"
    );
    assert!(
        demotions <= 3,
        "each instance demotes at most once: {demotions}"
    );
    for r in &routers {
        assert_eq!(r.tier_of("noisy"), "limited", "{}", r.instance());
    }
    // Without sharing, each instance sees a third: 80 per 20 s, never demoted.
    let mut alone = (0..3)
        .map(|_| Router::new(&config()).expect("valid"))
        .collect::<Vec<_>>();
    let mut t = T0;
    for i in 0..720 {
        t = T0 + i * 83;
        assert_eq!(alone[i as usize % 3].route("noisy", t).change, None);
    }
    assert!(t > T0 + 59_000);
}

#[test]
fn a_tenant_under_the_limit_deployment_wide_is_never_demoted() {
    let mut routers = instances(3);
    // 5 per second: 100 per 20 s, under the limit of 120.
    let (first, demotions) = spread(&mut routers, "steady", 5, 120);
    assert_eq!((first, demotions), (None, 0));
    for r in &routers {
        assert_eq!(r.tier_of("steady"), "normal");
        assert!(
            r.rate_of("steady", T0 + 120_000) <= 110,
            "{}",
            r.rate_of("steady", T0 + 120_000)
        );
    }
}

#[test]
fn exactly_one_live_instance_reports_each_tenant() {
    let mut routers = instances(3);
    exchange(&mut routers, T0);
    for tenant in (0..200).map(|i| format!("tenant-{i}")) {
        let reporters = routers.iter().filter(|r| r.reports(&tenant)).count();
        assert_eq!(reporters, 1, "{tenant}");
    }
    // The tenants spread over the instances.
    let by_first = (0..200)
        .filter(|i| routers[0].reports(&format!("tenant-{i}")))
        .count();
    assert!((30..=110).contains(&by_first), "{by_first} of 200");
    // Alone, an instance reports everything.
    let alone = Router::new(&config()).expect("valid");
    assert!(alone.reports("tenant-1") && alone.reports("tenant-2"));
}

#[test]
fn an_instance_with_none_of_the_emissions_demotes_on_the_others_counts() {
    let mut routers = instances(2);
    for i in 0..121 {
        routers[0].route("noisy", T0 + i * 10);
    }
    assert_eq!(routers[0].tier_of("noisy"), "limited");
    let snap = routers[0].share_snapshot(T0 + 1300);
    assert_eq!(snap.counts.get("noisy"), Some(&121));
    assert_eq!(snap.demoted.len(), 1);
    let changes = routers[1].apply_remote(&snap, T0 + 1310);
    assert_eq!(changes.len(), 1, "{changes:?}");
    assert_eq!(changes[0].rate, 121);
    assert_eq!(routers[1].tier_of("noisy"), "limited");
    // Its own snapshot read back changes nothing.
    let own = routers[1].share_snapshot(T0 + 1320);
    assert!(routers[1].apply_remote(&own, T0 + 1320).is_empty());
    assert_eq!(routers[1].remote_count("noisy"), 121);
}

#[test]
fn counts_of_an_instance_that_stopped_publishing_fade_out_over_one_period() {
    let mut routers = instances(2);
    for i in 0..50 {
        routers[0].route("acme", T0 + i);
    }
    let snap = routers[0].share_snapshot(T0 + 100);
    routers[1].apply_remote(&snap, T0 + 100);
    assert_eq!(routers[1].rate_of("acme", T0 + 200), 50);
    assert_eq!(routers[1].live_instances(), vec!["settle-0"]);
    // Live for 3 intervals of 1 s (at least 3 s): the whole count.
    routers[1].sweep(T0 + 3_099, 100);
    assert_eq!(routers[1].remote_count("acme"), 50);
    assert_eq!(routers[1].live_instances(), vec!["settle-0"]);
    // Then taken as stopped: no longer live (not a reporter), its count fading out as its
    // emissions leave the window, taken as spread over it: 50 × (20 100 − t) / 20 000.
    routers[1].sweep(T0 + 3_100, 100);
    assert!(routers[1].live_instances().is_empty());
    assert!(routers[1].reports("acme"), "alone again");
    assert_eq!(routers[1].remote_count("acme"), 43);
    routers[1].sweep(T0 + 10_100, 100);
    assert_eq!(routers[1].remote_count("acme"), 25);
    routers[1].sweep(T0 + 20_100, 100);
    assert_eq!(routers[1].remote_count("acme"), 0);
}

#[test]
fn a_stopping_snapshot_fades_at_once_and_a_rolling_restart_keeps_the_limit() {
    // Two instances, limit 120 per 20 s, a tenant at 8/s (1.33 × the limit) spread over
    // both; 8 s in, instance 1 stops (last snapshot marked stopping) and a new instance
    // (another name) takes its share of the traffic.
    let mut routers = instances(2);
    let mut times = Vec::new();
    let mut first: Option<u64> = None;
    let mut next_exchange = T0 + 1000;
    let mut restarted = false;
    for i in 0..8 * 40 {
        let now = T0 + i * 125;
        while now >= next_exchange {
            if exchange(&mut routers, next_exchange) > 0 && first.is_none() {
                let horizon = next_exchange - 20_000;
                first = Some(times.iter().filter(|&&t| t > horizon).count() as u64);
            }
            next_exchange += 1000;
        }
        if !restarted && now >= T0 + 8_000 {
            restarted = true;
            let last = routers[1].final_snapshot(now);
            assert!(last.stopping);
            assert!(routers[0].apply_remote(&last, now).is_empty());
            assert!(routers[0].live_instances().is_empty(), "stopped at once");
            let mut fresh = Router::new(&config()).expect("valid");
            fresh.set_instance("settle-1-new");
            fresh.restore(&[last, routers[0].share_snapshot(now)], now);
            routers[1] = fresh;
        }
        times.push(now);
        let r = &mut routers[(i % 2) as usize];
        if r.route("noisy", now).change.is_some() && first.is_none() {
            first = Some(times.iter().filter(|&&t| t > now - 20_000).count() as u64);
        }
    }
    let at = first.expect("demoted");
    println!("rolling restart: demoted with {at} in the window (limit 120)");
    assert!(
        (121..=144).contains(&at),
        "demoted with {at} in the window across the restart (limit 120)"
    );
}

#[test]
fn a_demoted_tenant_recovers_only_once_the_deployment_rate_stayed_low_for_the_cooldown() {
    let mut routers = instances(2);
    for i in 0..121 {
        routers[0].route("noisy", T0 + i * 10);
    }
    // Instance 1 keeps seeing 70 (≥ 60, the recovery threshold) from instance 0 while
    // instance 0's own window empties: instance 1 stays demoted as long as that lasts.
    let snap = routers[0].share_snapshot(T0 + 2_000);
    routers[1].apply_remote(&snap, T0 + 2_000);
    assert_eq!(routers[1].tier_of("noisy"), "limited");
    let mut keep = snap.clone();
    keep.counts.insert("noisy".into(), 70);
    for s in 3..=40 {
        keep.at = T0 + s * 1000;
        routers[1].apply_remote(&keep, T0 + s * 1000);
        let swept = routers[1].sweep(T0 + s * 1000, 100);
        assert!(swept.changes.is_empty(), "no promotion at {s} s");
    }
    // Then the counts stop: they expire 3 s later, and the cooldown of 10 s runs from the
    // last snapshot at or above the threshold (held until the next one, 1 s).
    let mut promoted_at = None;
    for ms in (40_000..60_000).step_by(100) {
        let sweep = routers[1].sweep(T0 + ms, 100);
        if let Some(c) = sweep.changes.first() {
            assert_eq!(c.reason, ChangeReason::Recovered);
            promoted_at = Some(ms);
            break;
        }
    }
    // The stopped instance's 70 fade out (≥ 60 until about 43.1 s); the cooldown of 10 s runs
    // from the last look at or above the threshold, held one interval (1 s).
    let at = promoted_at.expect("promoted");
    assert!(
        (52_000..=54_200).contains(&at),
        "promoted at {at} ms: 10 s after the fading count went below 60 (+ the 1 s hold)"
    );
}

#[test]
fn a_restarted_instance_keeps_a_demoted_tenant_limited() {
    let mut old = instances(1).remove(0);
    for i in 0..121 {
        old.route("noisy", T0 + i * 10);
    }
    for i in 0..10 {
        old.route("quiet", T0 + i * 10);
    }
    let last = old.share_snapshot(T0 + 5_000);
    assert_eq!(last.demoted.len(), 1);
    // Every instance restarted (new names): the old snapshot is no longer live, but its
    // demotion is, until its cooldown has run out.
    let mut fresh = Router::new(&config()).expect("valid");
    fresh.set_instance("settle-0-restarted");
    let restored = fresh.restore(std::slice::from_ref(&last), T0 + 12_000);
    assert_eq!(
        (restored.snapshots, restored.live, restored.demoted),
        (1, 0, 1)
    );
    assert_eq!(fresh.tier_of("noisy"), "limited");
    assert_eq!(fresh.tier_of("quiet"), "normal");
    // Traffic resumes: the very first emission goes to the limited tier, with no change.
    let route = fresh.route("noisy", T0 + 12_001);
    assert_eq!((route.tier, route.change), ("limited", None));
    assert_eq!(fresh.demoted(T0 + 12_001).len(), 1);
    // A restart after the cooldown ran out restores nothing.
    let mut late = Router::new(&config()).expect("valid");
    let restored = late.restore(std::slice::from_ref(&last), T0 + 40_000);
    assert_eq!(restored.demoted, 0);
    assert_eq!(late.tier_of("noisy"), "normal");
    // A live instance's snapshot (younger than 3 s) is summed at once.
    let mut next = Router::new(&config()).expect("valid");
    next.set_instance("settle-1");
    let restored = next.restore(std::slice::from_ref(&last), T0 + 6_000);
    assert_eq!((restored.live, restored.demoted), (1, 1));
    assert_eq!(next.remote_count("noisy"), 121);
    assert_eq!(next.remote_count("quiet"), 10);
}
