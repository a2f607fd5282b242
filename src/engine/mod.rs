//! The debounce engine: a pure state machine (SEMANTICS §2–§4).
//!
//! It owns no storage, no clock and no I/O. The shell hands it the partition time `now`, the
//! key's current [`SessionState`] and an input (an [`Upload`], or "time advanced" for a key
//! whose timer is due) and gets back the new state, the key's timer before and after, and the
//! [`Emission`]s that became due. [`partition::Driver`] runs it over a whole partition through
//! the [`partition::SessionTable`] trait, which the RocksDB store and the in-memory table
//! implement.
//!
//! Invariants kept here:
//! * every key has at most one timer: the due time of its open round, or, with no round open,
//!   the expiry of its state (`last upload + state_ttl`), see [`Engine::next_due`];
//! * a round that is due fires before any upload at or after its `due_at` is applied;
//! * generations increase by exactly one per emission of a key's state, and a state keeps the
//!   event time it was created at ([`SessionState::created_at`]): together they make emission
//!   ids that never repeat (SEMANTICS §2);
//! * no emission has `due_at > now`.
//!
//! Shadow policies (SEMANTICS §8, [`shadow`]) run this same engine over an in-memory table
//! beside the live one and only count what they would emit ([`figures`]).
//!
//! One extension of SEMANTICS §4, off by default: under `adaptive` with
//! `learn-initial-delay`, a key's first upload (no CallTrack) starts from its tenant's learned
//! delay instead of `min_delay` ([`learn`]; [`Engine::on_upload_from`]), everything else
//! unchanged.
//!
//! This module must not import tokio, rocksdb, rdkafka, async-nats or read a clock; a test in
//! `tests/engine_purity.rs` keeps that true.

pub mod figures;
pub mod learn;
pub mod partition;
pub mod policy;
pub mod shadow;
pub mod timers;
pub mod types;

pub use figures::{Percentiles, Spread};
pub use learn::{LearnSummary, TenantAges, TenantStats, MAX_LEARNED_TENANTS};
pub use partition::{Driver, DriverStats, MemTable, SessionTable};
pub use policy::{PolicySpec, PolicyTable, DEFAULT_STATE_TTL_MS, EVENT_IDS_MAX};
pub use shadow::{Figures, ShadowSet, ShadowSpec, TenantClass, TierFigures, LIVE};
pub use timers::{Hint as TimerHint, TimerQueue};
pub use types::{
    CallTrack, Emission, EventIds, Millis, Part, PolicyName, Round, SessionKey, SessionState,
    Trigger, Upload,
};

/// An operator action on one session's open round ([`Engine::act`], SEMANTICS §7).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Action {
    /// `true`: flush (emit the round now); `false`: cancel (close it without an emission).
    pub flush: bool,
    /// Only say what would be done.
    pub dry_run: bool,
}

/// What happened to an upload handed to [`Engine::on_upload`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Applied {
    /// Applied to a round (on time).
    OnTime,
    /// Event time earlier than the key's last upload (SEMANTICS §3): counted only.
    Late,
    /// Exact redelivery of the key's last applied `event_id`: ignored.
    Redelivered,
}

/// The key's timer before and after a step: the shell cancels `before` and sets `after` when
/// they differ (timers are keyed `due_at ‖ session key`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Step {
    /// How the upload was taken (`OnTime` for timer steps).
    pub applied: Applied,
    /// Due time of the key's timer before the step (`None`: the key had no state).
    pub due_before: Option<Millis>,
    /// Due time of the key's timer after the step (`None`: the key's state is gone).
    pub due_after: Option<Millis>,
    /// The interval (ms) this upload observed under `adaptive`: its event time minus the
    /// key's CallTrack time, for an on-time upload of a key that had a track (`None`
    /// otherwise, and for timer steps). What a tenant's learned delay is made of.
    pub interval: Option<Millis>,
}

/// The debounce engine for one set of policies. Cheap to share; holds no per-key data.
#[derive(Clone, Debug)]
pub struct Engine {
    policies: PolicyTable,
}

impl Engine {
    /// An engine applying `policies` (already validated).
    pub fn new(policies: PolicyTable) -> Self {
        Engine { policies }
    }

    /// The policies in force.
    pub fn policies(&self) -> &PolicyTable {
        &self.policies
    }

    /// The policy in force for `key`'s tenant.
    pub fn spec_for(&self, key: &SessionKey) -> &PolicySpec {
        if self.policies.tenants.is_empty() {
            // No overrides: no need to find the tenant in the key (once per step).
            return &self.policies.default;
        }
        self.policies.for_tenant(key.tenant())
    }

    /// The one timer of a key with `state`: the open round's due time (the earlier of its
    /// debounce deadline and its max-wait), or the state's expiry when no round is open.
    pub fn next_due(&self, key: &SessionKey, state: &SessionState) -> Millis {
        match &state.round {
            Some(r) => r.due(),
            None => state
                .last_upload_at
                .saturating_add(self.spec_for(key).state_ttl),
        }
    }

    /// Applies one upload at partition time `now` (ms). Rounds of this key due at or before
    /// `max(now, upload.event_time)` fire first. Emissions are appended to `out` in order.
    /// `state` is updated in place (`None` = the key has no state).
    pub fn on_upload(
        &self,
        now: Millis,
        state: &mut Option<SessionState>,
        upload: &Upload,
        out: &mut Vec<Emission>,
    ) -> Step {
        self.on_upload_from(now, state, upload, None, out)
    }

    /// [`Engine::on_upload`] where a key without a CallTrack starts from `initial_delay`
    /// (ms, the tenant's learned delay, `engine::learn`) instead of `min-delay` under
    /// `adaptive`. `None` behaves exactly like [`Engine::on_upload`]; other policies ignore it.
    pub fn on_upload_from(
        &self,
        now: Millis,
        state: &mut Option<SessionState>,
        upload: &Upload,
        initial_delay: Option<Millis>,
        out: &mut Vec<Emission>,
    ) -> Step {
        let key = &upload.key;
        let spec = self.spec_for(key);
        let due_before = state.as_ref().map(|s| self.next_due(key, s));
        let now = now.max(upload.event_time);
        self.fire_due(now, key, state, out);

        let mut interval = None;
        let applied = match state {
            Some(s)
                if upload.event_id.is_some()
                    && s.last_applied_event_id.as_deref() == upload.event_id.as_deref() =>
            {
                Applied::Redelivered
            }
            Some(s) if upload.event_time < s.last_upload_at => {
                s.last_applied_event_id.clone_from(&upload.event_id);
                match &mut s.round {
                    Some(r) => {
                        // Counted in the round, so listed among its ids too (SEMANTICS §2:
                        // the ids of the round's uploads in the order applied).
                        r.uploads += 1;
                        list_event_id(spec, r, upload);
                    }
                    None => {
                        let at = s.last_upload_at;
                        apply_on_time(spec, key, s, upload, at, initial_delay, out);
                    }
                }
                Applied::Late
            }
            Some(s) => {
                let at = upload.event_time;
                interval = apply_on_time(spec, key, s, upload, at, initial_delay, out);
                Applied::OnTime
            }
            None => {
                let s = state.insert(SessionState {
                    created_at: upload.event_time,
                    last_upload_at: upload.event_time,
                    ..SessionState::default()
                });
                apply_on_time(spec, key, s, upload, upload.event_time, initial_delay, out);
                Applied::OnTime
            }
        };
        Step {
            applied,
            due_before,
            due_after: state.as_ref().map(|s| self.next_due(key, s)),
            interval,
        }
    }

    /// "Time advanced" for one key: fires everything of `key` due at or before `now` (ms),
    /// appending emissions to `out`; expired state becomes `None`.
    pub fn on_time(
        &self,
        now: Millis,
        key: &SessionKey,
        state: &mut Option<SessionState>,
        out: &mut Vec<Emission>,
    ) -> Step {
        let due_before = state.as_ref().map(|s| self.next_due(key, s));
        self.fire_due(now, key, state, out);
        Step {
            applied: Applied::OnTime,
            due_before,
            due_after: state.as_ref().map(|s| self.next_due(key, s)),
            interval: None,
        }
    }

    /// An operator's action on `key`'s open round at partition time `now` (ms), SEMANTICS
    /// §7. Rounds of the key due at or before `now` fire first (as before an upload), then:
    /// `flush` emits the open round (`trigger = manual`, `due_at = now`) and closes it;
    /// `cancel` closes it without an emission (its uploads are dropped, the CallTrack and
    /// the generation stay). A round without uploads (a max-wait continuation or the rest
    /// of a leading round that nothing joined yet) is not touched: there is nothing to
    /// release. `dry_run`: nothing changes (the due rounds do not fire either); the answer
    /// says what the action would do. Returns the uploads of the round acted on (`None`:
    /// no open round with uploads).
    pub fn act(
        &self,
        now: Millis,
        key: &SessionKey,
        state: &mut Option<SessionState>,
        action: Action,
        out: &mut Vec<Emission>,
    ) -> (Option<u32>, Step) {
        let due_before = state.as_ref().map(|s| self.next_due(key, s));
        if !action.dry_run {
            self.fire_due(now, key, state, out);
        }
        let uploads = state
            .as_ref()
            .and_then(|s| s.round.as_ref())
            .map(|r| r.uploads)
            .filter(|&n| n > 0);
        if let (Some(_), false, Some(s)) = (uploads, action.dry_run, state.as_mut()) {
            if let Some(mut round) = s.round.take() {
                if action.flush {
                    let spec = self.spec_for(key);
                    out.push(emission(spec, key, s, &mut round, Trigger::Manual, now));
                }
            }
        }
        let step = Step {
            applied: Applied::OnTime,
            due_before,
            due_after: state.as_ref().map(|s| self.next_due(key, s)),
            interval: None,
        };
        (uploads, step)
    }

    fn fire_due(
        &self,
        now: Millis,
        key: &SessionKey,
        state: &mut Option<SessionState>,
        out: &mut Vec<Emission>,
    ) {
        let spec = self.spec_for(key);
        while let Some(s) = state.as_mut() {
            let due = self.next_due(key, s);
            if due > now {
                return;
            }
            let Some(mut round) = s.round.take() else {
                // No round open: the state expired (state-ttl after the last upload).
                *state = None;
                return;
            };
            match round.max_wait_at {
                Some(m) if m < round.deadline => {
                    // max-wait reached first. A round with no upload yet only moves its start.
                    if round.uploads > 0 {
                        out.push(emission(spec, key, s, &mut round, Trigger::MaxWait, m));
                        round.parts.clear();
                    }
                    // The continuation opens now, under the rule in force now (SEMANTICS §7):
                    // without a max-wait it has none and ends at its debounce deadline. It
                    // keeps the debounce deadline and delay (and the box).
                    round.start = m;
                    round.max_wait_at = spec.max_wait.map(|w| m + w.max(1));
                    round.policy = Some(spec.name);
                    empty_round(spec, &mut round);
                    s.round = Some(round);
                }
                _ => {
                    // Debounce deadline: trailing if the round has uploads, else it ends silently.
                    if round.uploads > 0 {
                        let due_at = round.deadline;
                        out.push(emission(
                            spec,
                            key,
                            s,
                            &mut round,
                            Trigger::Trailing,
                            due_at,
                        ));
                    }
                }
            }
        }
    }
}

/// Applies an on-time upload (or a late one opening a round, moved to `at`) to the key's
/// state; emits `final`, `complete` or `leading` at once when the upload calls for it.
/// Under `adaptive`, a key without a CallTrack starts from `initial_delay` (a learned delay)
/// or else `min_delay`. Returns the interval since the CallTrack's time, if it had one.
fn apply_on_time(
    spec: &PolicySpec,
    key: &SessionKey,
    s: &mut SessionState,
    upload: &Upload,
    at: Millis,
    initial_delay: Option<Millis>,
    out: &mut Vec<Emission>,
) -> Option<Millis> {
    let mut interval = None;
    let delay = match spec.name {
        PolicyName::Fixed | PolicyName::LeadingTrailing => spec.delay,
        PolicyName::Adaptive => {
            let d = match s.track {
                None => initial_delay.unwrap_or(spec.min_delay),
                Some(t) => {
                    interval = Some(at - t.time);
                    t.delay.max(at - t.time).min(spec.max_delay)
                }
            };
            s.track = Some(CallTrack { time: at, delay: d });
            d
        }
    };
    s.last_upload_at = s.last_upload_at.max(at);
    s.last_applied_event_id.clone_from(&upload.event_id);
    let opening = s.round.is_none();
    let round = s.round.get_or_insert_with(|| {
        Box::new(Round {
            start: at,
            deadline: at + delay,
            max_wait_at: spec.max_wait.map(|w| at + w),
            delay,
            uploads: 0,
            first_upload_at: None,
            last_upload_at: None,
            last_event_id: None,
            attributes: None,
            parts: Vec::new(),
            policy: Some(spec.name),
            event_ids: kept_event_ids(spec),
        })
    });
    round.uploads += 1;
    list_event_id(spec, round, upload);
    round.first_upload_at.get_or_insert(at);
    round.last_upload_at = Some(at);
    // The rule in force now times the round from this upload on (SEMANTICS §7): its
    // debounce deadline and delay, its max-wait bound (start + max-wait, or none when the
    // rule has none, also for a round opened under a rule that had one) and its policy.
    round.deadline = at + delay;
    round.delay = delay;
    // Only a rule that changed can put the bound before this upload (under one rule a
    // round due at its bound fires before an upload at or after it): due at once then.
    round.max_wait_at = spec.max_wait.map(|w| (round.start + w).max(at));
    round.policy = Some(spec.name);
    round.last_event_id.clone_from(&upload.event_id);
    round.attributes.clone_from(&upload.attributes);
    let mut complete = false;
    if let Some(p) = upload.part {
        if let Err(i) = round.parts.binary_search(&p.index) {
            round.parts.insert(i, p.index);
        }
        let count = p.count as usize;
        complete = round
            .parts
            .iter()
            .take_while(|&&i| i as usize <= count)
            .count()
            == count;
    }
    let trigger = if upload.final_flag {
        Some(Trigger::Final)
    } else if complete {
        Some(Trigger::Complete)
    } else if opening && spec.name == PolicyName::LeadingTrailing {
        Some(Trigger::Leading)
    } else {
        None
    };
    let Some(trigger) = trigger else {
        return interval;
    };
    let Some(mut round) = s.round.take() else {
        return interval;
    };
    out.push(emission(spec, key, s, &mut round, trigger, at));
    if trigger == Trigger::Leading {
        // SEMANTICS §4 v2: the round stays open after its leading emission; it ends with a
        // trailing emission only if another upload arrives before the deadline.
        empty_round(spec, &mut round);
        s.round = Some(round);
    }
    interval
}

/// `round` after an emission that leaves the key's round open (`leading`, `max_wait`):
/// no upload yet, and a new list of event ids if the rule in force keeps them.
fn empty_round(spec: &PolicySpec, round: &mut Round) {
    round.uploads = 0;
    round.first_upload_at = None;
    round.last_upload_at = None;
    round.last_event_id = None;
    round.attributes = None;
    round.event_ids = kept_event_ids(spec);
}

/// The event ids a round opened under `spec` keeps: an empty list when its rule has
/// `event-ids > 0`, none otherwise (SEMANTICS §2 `event_ids`). A rule in force when the
/// round opened decides whether it keeps ids at all, so a list is never missing the round's
/// first uploads; the cap in force at each upload decides whether that id is listed.
fn kept_event_ids(spec: &PolicySpec) -> Option<Box<EventIds>> {
    (spec.event_ids > 0).then(Box::default)
}

/// Lists `upload`'s event id in `round` when the round keeps ids (up to `spec.event_ids`,
/// the rest counted as dropped). An upload without an id is not listed (SEMANTICS §2).
fn list_event_id(spec: &PolicySpec, round: &mut Round, upload: &Upload) {
    if let (Some(ids), Some(id)) = (round.event_ids.as_deref_mut(), upload.event_id.as_deref()) {
        ids.push(id, spec.event_ids);
    }
}

/// Builds the emission closing (part of) `round` and bumps the key's generation. The
/// round's last event id, attributes and event ids move into the emission (the round is
/// closed or emptied right after).
fn emission(
    spec: &PolicySpec,
    key: &SessionKey,
    s: &mut SessionState,
    round: &mut Round,
    trigger: Trigger,
    due_at: Millis,
) -> Emission {
    s.generation += 1;
    Emission {
        key: key.clone(),
        state_created_at: s.created_at,
        generation: s.generation,
        trigger,
        uploads: round.uploads,
        first_upload_at: round.first_upload_at.unwrap_or(s.last_upload_at),
        last_upload_at: round.last_upload_at.unwrap_or(s.last_upload_at),
        due_at,
        delay_ms: round.delay,
        policy: round.policy.unwrap_or(spec.name),
        last_event_id: round.last_event_id.take(),
        attributes: round.attributes.take(),
        event_ids: round.event_ids.take(),
    }
}

#[cfg(test)]
mod tests;
