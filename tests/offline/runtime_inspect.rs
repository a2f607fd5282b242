//! `settle inspect` on stores written by the real runtime: per-partition figures and one
//! session's state, read offline.

use crate::runtime_support;

use runtime_support::*;
use settle::cli::inspect::{self, InspectArgs};
use settle::engine::{PolicySpec, SessionKey};

#[tokio::test(start_paused = true)]
async fn inspect_reports_offsets_rounds_outbox_and_a_session() {
    let f = fixture(1, PolicySpec::adaptive(5_000, 60_000));
    let dir = f.dir.path();
    produce(&f.broker, "acme", "s1", T0 - 1_000);
    produce(&f.broker, "acme", "s1", T0);
    produce(&f.broker, "acme", "s2", T0);
    f.run_until(|m| all(m, 1, |s| s.next_offset == Some(3)))
        .await;

    let infos = inspect::find_stores(&InspectArgs::new(dir.to_path_buf())).unwrap();
    assert_eq!(infos.len(), 1);
    let (topic, p, path) = &infos[0];
    let info = inspect::partition_info(topic, *p, path, 5, 5).unwrap();
    assert_eq!(info.next_offset, Some(3));
    assert_eq!(info.sessions, 2);
    assert_eq!(info.pending_rounds, 2);
    assert_eq!(info.outbox_len, 0);
    assert_eq!(
        info.next_due,
        vec![
            (T0 + 5_000, SessionKey::new("acme", "s1")),
            (T0 + 5_000, SessionKey::new("acme", "s2")),
        ]
    );

    let mut args = InspectArgs::new(dir.to_path_buf());
    args.session = Some("acme/s1".into());
    args.partition = Some(0);
    let mut out = Vec::new();
    assert_eq!(inspect::run(args, &mut out).unwrap(), 1);
    let text = String::from_utf8(out).unwrap();
    // Only the session, headed by the store it lives in: no partition dump, no tiers.
    let header = format!("{topic}/0  ({})", path.display());
    assert!(
        text.starts_with(&format!("{header}\n  session acme/s1 (partition 0)\n")),
        "{text}"
    );
    for other in ["next offset", "pending rounds", "acme/s2", "tiers"] {
        assert!(!text.contains(other), "{other}: {text}");
    }
    assert!(
        text.contains("CallTrack       time 2026-01-01T00:00:00.000Z · delay 5000 ms"),
        "{text}"
    );
    assert!(text.contains("open round      2 upload(s)"), "{text}");
    assert!(
        text.contains("next due        2026-01-01T00:00:05.000Z (round due)"),
        "{text}"
    );

    assert_eq!(info.next_due_is_round, vec![true, true]);

    // Once both rounds are out, the only timers left are the sessions' state expiries.
    f.run_until(|m| all(m, 1, |s| s.pending_rounds == 0 && s.outbox_len == 0))
        .await;
    let info = inspect::partition_info(topic, *p, path, 5, 5).unwrap();
    assert_eq!(info.next_due_is_round, vec![false, false]);
    let mut out = Vec::new();
    inspect::run(InspectArgs::new(dir.to_path_buf()), &mut out).unwrap();
    let text = String::from_utf8(out).unwrap();
    assert!(text.contains("acme/s1  (state expiry)"), "{text}");

    let mut args = InspectArgs::new(dir.to_path_buf());
    args.session = Some("acme/nope".into());
    let mut out = Vec::new();
    let err = format!("{:#}", inspect::run(args, &mut out).unwrap_err());
    assert!(
        err.contains("session acme/nope: no state in any store read"),
        "{err}"
    );
    assert!(err.contains(&format!("({topic}/0)")), "{err}");
    assert!(out.is_empty(), "{}", String::from_utf8_lossy(&out));
}
