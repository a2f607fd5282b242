//! The traffic shapes of `settle demo`, `settle loadgen` and the noisy-neighbour experiment
//! (SEMANTICS §1), one session at a time ([`Scenario::session`]), from a seeded random
//! source (the table is in `crate::cli::loadgen`'s docs). Below every tool that uses them.

use rand::Rng;

/// A traffic shape (module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum Scenario {
    /// 700 machines upload into one session within 1.5 s.
    Burst,
    /// One upload in 2 requests (`part` 1/2, 2/2) 300 ms apart.
    Split,
    /// A slow sender: 5 uploads 2–3 s apart.
    Trickle,
    /// Small bursts (10 uploads within 600 ms) spread over many tenants.
    Tenants,
    /// Each session one of the above (uploads split 40/20/10/30 %).
    Mix,
    /// The noisy-neighbour experiment: 100 sessions of `normal-co` and 1 000 of `noisy-co`
    /// within `--duration` (SEMANTICS §5; the tiers benchmark's traffic).
    Noisy,
}

/// The four pure scenarios, in the order of the module table.
pub const SCENARIOS: [Scenario; 4] = [
    Scenario::Burst,
    Scenario::Split,
    Scenario::Trickle,
    Scenario::Tenants,
];

/// Share of uploads of each pure scenario in [`Scenario::Mix`], in [`SCENARIOS`] order.
const MIX_UPLOAD_SHARE: [f64; 4] = [0.4, 0.2, 0.1, 0.3];

/// Sizes of the scenarios (defaults: the demo's, in real time).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shape {
    /// Uploads of a `burst` session (one per CI machine).
    pub burst_machines: u32,
    /// Time a `burst` session's uploads spread over (ms).
    pub burst_spread_ms: u64,
    /// Time between the 2 parts of a `split` upload (ms).
    pub split_gap_ms: u64,
    /// Uploads of a `trickle` session.
    pub trickle_uploads: u32,
    /// Gap between two `trickle` uploads: drawn from this range (ms).
    pub trickle_gap_ms: std::ops::Range<u64>,
    /// Uploads of a `tenants` session.
    pub tenant_uploads: u32,
    /// Time a `tenants` session's uploads spread over (ms).
    pub tenant_spread_ms: u64,
}

impl Default for Shape {
    fn default() -> Self {
        Shape {
            burst_machines: 700,
            burst_spread_ms: 1_500,
            split_gap_ms: 300,
            trickle_uploads: 5,
            trickle_gap_ms: 2_000..3_000,
            tenant_uploads: 10,
            tenant_spread_ms: 600,
        }
    }
}

/// One upload of a session: `at_ms` after the session's start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlannedUpload {
    /// Time after the session's start (ms).
    pub at_ms: u64,
    /// Record key, `tenant/session`.
    pub key: String,
    /// The upload record (SEMANTICS §2).
    pub json: String,
}

/// An upload record (SEMANTICS §2) with `event_id` and `extra` (`,"field":value...` or empty)
/// appended inside the object.
pub fn upload_json(tenant: &str, session: &str, event_id: &str, extra: &str) -> String {
    format!(r#"{{"tenant":"{tenant}","session":"{session}","event_id":"{event_id}"{extra}}}"#)
}

impl Scenario {
    /// Mean uploads of one session.
    pub fn uploads_per_session(self, shape: &Shape) -> f64 {
        match self {
            Scenario::Burst => f64::from(shape.burst_machines),
            Scenario::Split => 2.0,
            Scenario::Trickle => f64::from(shape.trickle_uploads),
            Scenario::Tenants | Scenario::Noisy => f64::from(shape.tenant_uploads),
            Scenario::Mix => 1.0 / mix_weights(shape).iter().map(|(_, w)| w).sum::<f64>(),
        }
    }

    /// The pure scenario of one session: `self`, or for [`Scenario::Mix`] one drawn from
    /// `rng` (sessions weighted so uploads split as documented).
    pub fn pick(self, rng: &mut impl Rng, shape: &Shape) -> Scenario {
        if self != Scenario::Mix {
            return self;
        }
        let weights = mix_weights(shape);
        let total: f64 = weights.iter().map(|(_, w)| w).sum();
        let mut x = rng.random_range(0.0..total);
        for (scenario, w) in weights {
            if x < w {
                return scenario;
            }
            x -= w;
        }
        Scenario::Tenants
    }

    /// The uploads of one session of `tenant/session`, sorted by time, times relative to the
    /// session's start. Draws from `rng` exactly as `settle demo`'s schedule does for one
    /// session (its start time is the caller's draw). [`Scenario::Mix`] picks first.
    pub fn session(
        self,
        rng: &mut impl Rng,
        tenant: &str,
        session: &str,
        shape: &Shape,
    ) -> Vec<PlannedUpload> {
        let key = format!("{tenant}/{session}");
        let upload = |at_ms: u64, id: String, extra: &str| PlannedUpload {
            at_ms,
            key: key.clone(),
            json: upload_json(tenant, session, &id, extra),
        };
        let mut plan: Vec<PlannedUpload> = match self.pick(rng, shape) {
            Scenario::Burst => (0..shape.burst_machines)
                .map(|m| {
                    let at = rng.random_range(0..shape.burst_spread_ms.max(1));
                    upload(at, format!("m{m}"), "")
                })
                .collect(),
            Scenario::Split => [(1, 0), (2, shape.split_gap_ms)]
                .into_iter()
                .map(|(i, at)| {
                    let extra = format!(r#","part":{{"index":{i},"count":2}}"#);
                    upload(at, format!("p{i}"), &extra)
                })
                .collect(),
            Scenario::Trickle => {
                let mut at = 0;
                (0..shape.trickle_uploads)
                    .map(|i| {
                        let u = upload(at, format!("u{i}"), "");
                        at += rng.random_range(shape.trickle_gap_ms.clone());
                        u
                    })
                    .collect()
            }
            Scenario::Tenants | Scenario::Mix | Scenario::Noisy => (0..shape.tenant_uploads)
                .map(|i| {
                    let at = rng.random_range(0..shape.tenant_spread_ms.max(1));
                    upload(at, format!("u{i}"), "")
                })
                .collect(),
        };
        plan.sort_by_key(|u| u.at_ms);
        plan
    }
}

/// `(scenario, sessions weight)` of [`Scenario::Mix`]: upload share / uploads per session.
fn mix_weights(shape: &Shape) -> [(Scenario, f64); 4] {
    let mut w = [(Scenario::Burst, 0.0); 4];
    for (i, s) in SCENARIOS.into_iter().enumerate() {
        w[i] = (
            s,
            MIX_UPLOAD_SHARE[i] / s.uploads_per_session(shape).max(1.0),
        );
    }
    w
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::SeedableRng;

    #[test]
    fn sessions_have_the_demo_shapes() {
        let shape = Shape::default();
        let mut rng = StdRng::seed_from_u64(1);
        let burst = Scenario::Burst.session(&mut rng, "ci", "b1", &shape);
        assert_eq!(burst.len(), 700);
        assert!(burst.iter().all(|u| u.at_ms < 1_500 && u.key == "ci/b1"));
        assert!(burst.windows(2).all(|w| w[0].at_ms <= w[1].at_ms));
        let split = Scenario::Split.session(&mut rng, "co", "s1", &shape);
        assert_eq!(
            split.iter().map(|u| u.at_ms).collect::<Vec<_>>(),
            vec![0, 300]
        );
        assert!(split[1].json.contains(r#""part":{"index":2,"count":2}"#));
        let trickle = Scenario::Trickle.session(&mut rng, "co", "t1", &shape);
        assert_eq!(trickle.len(), 5);
        assert!(trickle
            .windows(2)
            .all(|w| (2_000..3_000).contains(&(w[1].at_ms - w[0].at_ms))));
        let tenants = Scenario::Tenants.session(&mut rng, "t-1", "s", &shape);
        assert_eq!(tenants.len(), 10);
        assert!(tenants.iter().all(|u| u.at_ms < 600));
        // Every upload is a valid record for its key.
        for u in burst.iter().chain(&split).chain(&trickle).chain(&tenants) {
            assert!(
                crate::codec::decode_upload(Some(u.key.as_bytes()), u.json.as_bytes(), 0, 0)
                    .is_ok(),
                "{u:?}"
            );
        }
    }

    #[test]
    fn same_seed_same_schedule() {
        let shape = Shape::default();
        let plan = |seed| {
            let mut rng = StdRng::seed_from_u64(seed);
            (0..20)
                .map(|i| Scenario::Mix.session(&mut rng, "t", &format!("s{i}"), &shape))
                .collect::<Vec<_>>()
        };
        assert_eq!(plan(3), plan(3));
        assert_ne!(plan(3), plan(4));
    }

    #[test]
    fn mix_splits_uploads_as_documented() {
        let shape = Shape::default();
        let mut rng = StdRng::seed_from_u64(9);
        let mut uploads = [0.0_f64; 4];
        for _ in 0..20_000 {
            let s = Scenario::Mix.pick(&mut rng, &shape);
            let i = SCENARIOS.iter().position(|x| *x == s).unwrap();
            uploads[i] += s.uploads_per_session(&shape);
        }
        let total: f64 = uploads.iter().sum();
        for (i, share) in MIX_UPLOAD_SHARE.iter().enumerate() {
            let got = uploads[i] / total;
            assert!((got - share).abs() < 0.05, "{:?}: {got}", SCENARIOS[i]);
        }
        let mean = Scenario::Mix.uploads_per_session(&shape);
        assert!((total / 20_000.0 - mean).abs() / mean < 0.1, "{mean}");
    }
}
