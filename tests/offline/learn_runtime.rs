//! Learned initial delays through the real runtime (RocksDB store, memory transport, paused
//! time): the runtime emits exactly what the in-memory reference emits, the learned delay
//! is in the partition store, and `settle inspect` shows it.

use crate::runtime_support;

use runtime_support::*;
use settle::cli::inspect::{self, InspectArgs};
use settle::engine::{Millis, PolicySpec, SessionKey, Upload};

fn spec() -> PolicySpec {
    PolicySpec::adaptive(5_000, 600_000).with_learned_initial_delay(true)
}

/// Produces `sessions` sessions of tenant `twostep`, one a minute, each uploading twice
/// 20 s apart, stamped from an hour before [`T0`]. Returns the uploads.
fn produce_two_requests(f: &Fixture, sessions: usize) -> Vec<Upload> {
    let mut uploads = Vec::new();
    for s in 0..sessions {
        let session = format!("job-{s}");
        let t = T0 - 3_600_000 + s as Millis * 60_000;
        for at in [t, t + 20_000] {
            produce(&f.broker, "twostep", &session, at);
            uploads.push(Upload::plain(SessionKey::new("twostep", &session), at));
        }
    }
    uploads
}

#[tokio::test(start_paused = true)]
async fn runtime_learns_like_the_reference_and_inspect_shows_it() {
    let f = fixture(1, spec());
    let uploads = produce_two_requests(&f, 20);
    f.run_until(|m| {
        all(m, 1, |s| {
            s.next_offset == Some(40) && s.pending_rounds == 0 && s.outbox_len == 0
        })
    })
    .await;
    let got = by_id(emitted(&f.broker).into_iter().map(|(e, _)| e).collect());
    assert_eq!(got, by_id(reference(&f.engine, &uploads)));
    // 8 sessions teach the 20 s gap (two emissions each), the other 12 emit once.
    assert_eq!(got.len(), 8 * 2 + 12);

    {
        let store = f.store(0);
        assert_eq!(store.tenant_count(), 1);
        let stats = store.tenant("twostep").unwrap().expect("twostep learned");
        assert_eq!(stats.intervals.len(), 20);
        assert_eq!(stats.learned_delay(&spec()), Some(25_000));
    }

    // settle inspect: the count per partition, and the tenant's statistic.
    let dir = f.dir.path().to_path_buf();
    let mut args = InspectArgs::new(dir.clone());
    args.tenant = Some("twostep".into());
    args.config = None;
    let mut out = Vec::new();
    inspect::run(args, &mut out).unwrap();
    let text = String::from_utf8(out).unwrap();
    assert!(
        text.contains("tenants         1 with learned delays"),
        "{text}"
    );
    // The default config does not learn: the statistic is shown, marked as not used.
    assert!(text.contains("twostep: not used"), "{text}");
    assert!(text.contains("p90 20s + 25 % = 25s"), "{text}");
    assert!(text.contains("tenant twostep (partition 0)"), "{text}");
    assert!(text.contains("intervals (ms)  20000 20000"), "{text}");

    // With a config that learns, inspect says what sessions start from.
    let config = dir.join("learn.toml");
    std::fs::write(&config, "[debounce]\nlearn-initial-delay = true\n").unwrap();
    let mut args = InspectArgs::new(dir.clone());
    args.config = Some(config);
    let mut out = Vec::new();
    inspect::run(args, &mut out).unwrap();
    let text = String::from_utf8(out).unwrap();
    assert!(
        text.contains("learned delays  twostep: starts sessions at 25s"),
        "{text}"
    );
    let mut args = InspectArgs::new(dir);
    args.tenant = Some("nobody".into());
    let mut out = Vec::new();
    inspect::run(args, &mut out).unwrap();
    assert!(String::from_utf8(out)
        .unwrap()
        .contains("tenant nobody: no learned-delay statistics"));
}
