//! `settle demo` end to end: the real runtime on RocksDB and the memory transport, in real
//! time (about 20 s). Checks the figures the demo table shows.

use settle::cli::demo::{self, DemoArgs};
use settle::engine::Trigger;

#[test]
fn the_demo_coalesces_each_scenario_as_the_seed_intends() {
    let report = demo::run(DemoArgs {
        progress: false,
        ..DemoArgs::default()
    })
    .expect("demo runs");
    eprintln!("{report}");

    let burst = report.scenario("burst").unwrap();
    assert_eq!(burst.stats.uploads, 4 * 700);
    assert_eq!(burst.sessions, 4);
    assert_eq!(
        burst.stats.emissions, 4,
        "a 700-way burst is one emission per session"
    );
    assert_eq!(burst.sessions_with_one_emission, 4);

    let split = report.scenario("split").unwrap();
    assert_eq!(split.stats.uploads, 200);
    assert_eq!(
        split.stats.emissions, 100,
        "two requests of one upload: one emission"
    );
    assert_eq!(split.stats.by_trigger.get(&Trigger::Complete), Some(&100));

    let trickle = report.scenario("trickle").unwrap();
    assert_eq!(trickle.stats.uploads, 100);
    assert!(
        trickle.stats.emissions >= 20,
        "every trickling session is emitted"
    );

    let tenants = report.scenario("tenants").unwrap();
    assert_eq!(tenants.sessions, 300);
    assert_eq!(tenants.stats.uploads, 3_000);
    assert!(tenants.stats.emissions >= 300);
    assert!(tenants.stats.coalescing_ratio() > 5.0);

    // Live traffic fires on time: lateness stays small (poll wake-ups, not batch ticks).
    for s in &report.scenarios {
        assert!(
            s.stats.lateness().p99 < 1_000,
            "{}: {:?}",
            s.name,
            s.stats.lateness()
        );
    }
    assert!(report.elapsed_ms < 60_000, "the demo takes under a minute");
}
