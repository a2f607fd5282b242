//! Value types shared by the engine and the shell: session keys, uploads, per-key state and
//! emissions. All times are event-time milliseconds since the Unix epoch (SEMANTICS §3); all
//! durations are milliseconds.

use lean_string::LeanStr;
use serde::{Deserialize, Serialize};
use std::fmt;

/// Milliseconds since the Unix epoch (an instant) or a length of time in milliseconds.
pub type Millis = i64;

/// `tenant/session` (SEMANTICS §2). The first `/` separates tenant and session.
///
/// Cheap to clone, 16 bytes: a key of at most 16 bytes is held inline (no heap, no pointer
/// to follow when two keys are compared or a hash bucket is checked); a longer one is a
/// shared, reference-counted string (`lean_string::LeanStr`: an 8-byte header before the
/// bytes, the length in the handle; a 26-byte key is one 48-byte malloc chunk). Ordered,
/// hashed and serialized as its text. Construction does not validate the tenant/session
/// alphabets; `codec::decode_upload` does that for records from the outside.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct SessionKey(LeanStr);

impl SessionKey {
    /// Builds `tenant/session`.
    pub fn new(tenant: &str, session: &str) -> Self {
        let (t, len) = (tenant.len(), tenant.len() + 1 + session.len());
        // Joined on the stack: a short key is copied inline (no allocation), a longer one
        // into its one shared allocation.
        let mut buf = [0u8; 96];
        if let Some(joined) = buf.get_mut(..len) {
            joined[..t].copy_from_slice(tenant.as_bytes());
            joined[t] = b'/';
            joined[t + 1..].copy_from_slice(session.as_bytes());
            // Two `str`s joined by `/` are UTF-8: this check never fails.
            if let Ok(key) = std::str::from_utf8(joined) {
                return SessionKey(LeanStr::from(key));
            }
        }
        let mut s = String::with_capacity(len);
        s.push_str(tenant);
        s.push('/');
        s.push_str(session);
        SessionKey(LeanStr::from(s))
    }

    /// An empty key, never a real one (no `/`): a placeholder where a slot's key was taken
    /// out (`store::mem`). No allocation.
    pub(crate) fn placeholder() -> Self {
        SessionKey(LeanStr::new())
    }

    /// Wraps an already joined key. Returns `None` when it has no `/` or an empty tenant.
    pub fn parse(key: &str) -> Option<Self> {
        match first_slash(key) {
            Some(i) if i > 0 && i + 1 < key.len() => Some(SessionKey(LeanStr::from(key))),
            _ => None,
        }
    }

    /// The whole key, `tenant/session`.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The tenant part (before the first `/`).
    pub fn tenant(&self) -> &str {
        let i = first_slash(&self.0).unwrap_or(self.0.len());
        &self.0[..i]
    }

    /// The session part (after the first `/`).
    pub fn session(&self) -> &str {
        match first_slash(&self.0) {
            Some(i) => &self.0[i + 1..],
            None => "",
        }
    }
}

/// Byte index of the first `/` in `key`. A plain byte loop: keys are short, and `str::find`
/// with a `char` pattern costs about a hundred instructions to set up its searcher (callgrind,
/// BENCHMARKS "2026-12-07 (ninth session): what the 1 µs goal is up against"). `/` is
/// ASCII, so the index is a char boundary.
fn first_slash(key: &str) -> Option<usize> {
    key.bytes().position(|b| b == b'/')
}

impl fmt::Debug for SessionKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.0.as_str())
    }
}

impl fmt::Display for SessionKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Split-upload marker: part `index` (1-based) of `count` (SEMANTICS §4 `part`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Part {
    /// 1-based index of this part, `1..=count`.
    pub index: u32,
    /// Number of parts of the upload, ≥ 1.
    pub count: u32,
}

/// One decoded, validated upload (SEMANTICS §2 input record) with its event time.
#[derive(Clone, Debug, PartialEq)]
pub struct Upload {
    /// `tenant/session`.
    pub key: SessionKey,
    /// Event time (ms): the record timestamp capped at the processor's wall clock (SEMANTICS §3).
    pub event_time: Millis,
    /// Id of this upload, ≤ 128 bytes; an exact redelivery of the key's last applied id is ignored.
    pub event_id: Option<String>,
    /// Split-upload marker.
    pub part: Option<Part>,
    /// `final: true`: the client closed the session; flush now.
    pub final_flag: bool,
    /// Opaque JSON object text (≤ 16 KiB), carried on the emission if this is the round's last upload.
    pub attributes: Option<String>,
}

impl Upload {
    /// A plain upload with no id, part, final flag or attributes (handy in tests and load generators).
    pub fn plain(key: SessionKey, event_time: Millis) -> Self {
        Upload {
            key,
            event_time,
            event_id: None,
            part: None,
            final_flag: false,
            attributes: None,
        }
    }
}

/// Why an emission happened (SEMANTICS §4).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Trigger {
    /// First upload of a round under `leading-trailing`: emitted at once.
    Leading,
    /// The debounce deadline passed with no further upload.
    Trailing,
    /// The round reached `start + max_wait`.
    MaxWait,
    /// Every part `1..=count` of a split upload arrived.
    Complete,
    /// An upload carried `final: true`.
    Final,
    /// An operator flushed the round (SEMANTICS §7): `due_at` is when the action was applied.
    Manual,
}

impl Trigger {
    /// All triggers, in the order used by reports.
    pub const ALL: [Trigger; 6] = [
        Trigger::Leading,
        Trigger::Trailing,
        Trigger::MaxWait,
        Trigger::Complete,
        Trigger::Final,
        Trigger::Manual,
    ];

    /// The wire name (`leading`, `trailing`, `max_wait`, `complete`, `final`, `manual`).
    pub fn as_str(self) -> &'static str {
        match self {
            Trigger::Leading => "leading",
            Trigger::Trailing => "trailing",
            Trigger::MaxWait => "max_wait",
            Trigger::Complete => "complete",
            Trigger::Final => "final",
            Trigger::Manual => "manual",
        }
    }
}

/// Name of a debounce policy (SEMANTICS §4).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PolicyName {
    /// Seed v1: every upload moves the deadline to `t + delay`.
    Fixed,
    /// Seed v2: leading emission at once, trailing emission after `delay` of quiet.
    LeadingTrailing,
    /// Seed v3: CallTrack, `delay = min(max(prev.delay, interval), max_delay)`.
    Adaptive,
}

impl PolicyName {
    /// The config / wire name (`fixed`, `leading-trailing`, `adaptive`).
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyName::Fixed => "fixed",
            PolicyName::LeadingTrailing => "leading-trailing",
            PolicyName::Adaptive => "adaptive",
        }
    }
}

impl std::str::FromStr for PolicyName {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "fixed" => Ok(PolicyName::Fixed),
            "leading-trailing" => Ok(PolicyName::LeadingTrailing),
            "adaptive" => Ok(PolicyName::Adaptive),
            other => Err(format!(
                "unknown policy {other:?}: expected fixed, leading-trailing or adaptive"
            )),
        }
    }
}

/// The seed's CallTrack: time of the key's last upload and the delay computed for it (ms).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CallTrack {
    /// Event time of the last (non-late) upload.
    pub time: Millis,
    /// Delay in force after it (ms).
    pub delay: Millis,
}

/// The open round of a key (SEMANTICS §4): the uploads since the previous emission.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Round {
    /// Round start: its first upload, or the due time of the emission that opened a
    /// continuation round (after `leading` or `max_wait`).
    pub start: Millis,
    /// Debounce deadline: last upload + delay.
    pub deadline: Millis,
    /// `start + max_wait` when the policy has a max-wait.
    pub max_wait_at: Option<Millis>,
    /// Delay in force (ms) — `delay_ms` of the emission.
    pub delay: Millis,
    /// Uploads counted in this round (late ones included).
    pub uploads: u32,
    /// Event time of the round's first non-late upload.
    pub first_upload_at: Option<Millis>,
    /// Event time of the round's last non-late upload.
    pub last_upload_at: Option<Millis>,
    /// `event_id` of the round's last non-late upload.
    pub last_event_id: Option<String>,
    /// `attributes` of the round's last non-late upload.
    pub attributes: Option<String>,
    /// Distinct split-upload part indexes seen in this round, sorted.
    pub parts: Vec<u32>,
    /// The round's event ids (SEMANTICS §2 `event_ids`): `Some` when the round opened under
    /// a rule with `event-ids = N > 0`, `None` otherwise (then the emission has no
    /// `event_ids`). Boxed: 8 bytes in a round that keeps none. Not in the serde (postcard)
    /// form: the store writes it in the value's trailer (`store::keys`); a round stored
    /// before it existed reads as `None`.
    #[serde(skip)]
    pub event_ids: Option<Box<EventIds>>,
    /// The policy of the rule that timed this round: the one in force when its last
    /// on-time upload was applied (or when it opened). It names the emission's `policy`
    /// (SEMANTICS §2), whatever rule is in force when the round fires: a rule that changed
    /// since (a restart with another `[debounce]`, an override, SEMANTICS §7) applies from the
    /// round's next upload on. `None` only for a round stored by a settle that did not
    /// record it (before 0.1 stores, layout 2 without its trailer); the policy in force at
    /// fire time names such a round. Not in the serde (postcard) form: the store writes it in
    /// the value's trailer (`store::keys`).
    #[serde(skip)]
    pub policy: Option<PolicyName>,
}

impl Round {
    /// When the round is due (ms): the earlier of its debounce deadline and its max-wait.
    pub fn due(&self) -> Millis {
        match self.max_wait_at {
            Some(m) => m.min(self.deadline),
            None => self.deadline,
        }
    }
}

/// The event ids a round keeps under `event-ids = N` (SEMANTICS §2 `event_ids`,
/// `event_ids_dropped`): the `event_id`s of its uploads in the order applied (late uploads
/// counted in the round included, redeliveries and uploads without an id not), the first
/// `N` of them listed, and how many more the round had.
///
/// Held compactly, in one allocation: each listed id as its length (1 byte) then its UTF-8
/// bytes, so a round pays its ids' bytes + 1 per id listed (plus the buffer's spare
/// capacity, at most as much again), and 48 bytes once (this struct, boxed, with its
/// allocation header). Ids are at most 128 bytes (`codec::EVENT_ID_MAX_BYTES`); an id over
/// [`EventIds::MAX_ID_BYTES`], which `codec::decode_upload` never lets through, is counted
/// as dropped.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EventIds {
    /// The listed ids: `len ‖ bytes` each, in order. Every `bytes` is UTF-8.
    buf: Vec<u8>,
    /// Ids in `buf`.
    listed: u32,
    /// Ids the round had beyond the listed ones.
    dropped: u32,
}

impl EventIds {
    /// Longest id that can be listed (bytes).
    pub const MAX_ID_BYTES: usize = u8::MAX as usize;

    /// Takes the id of an upload applied to the round: listed when fewer than `cap` are and
    /// none was dropped yet (so the list is always the round's first ids), counted as
    /// dropped otherwise.
    pub fn push(&mut self, id: &str, cap: u32) {
        match u8::try_from(id.len()) {
            Ok(len) if self.dropped == 0 && self.listed < cap => {
                self.buf.push(len);
                self.buf.extend_from_slice(id.as_bytes());
                self.listed += 1;
            }
            _ => self.dropped = self.dropped.saturating_add(1),
        }
    }

    /// Adds `n` to the dropped count (a stored value being read back).
    pub fn add_dropped(&mut self, n: u32) {
        self.dropped = self.dropped.saturating_add(n);
    }

    /// The listed ids, in the order applied.
    pub fn iter(&self) -> impl Iterator<Item = &str> + '_ {
        let mut rest = self.buf.as_slice();
        std::iter::from_fn(move || {
            let (&len, tail) = rest.split_first()?;
            let (id, tail) = tail.split_at_checked(usize::from(len))?;
            rest = tail;
            // Invariant: `push` stores whole `str`s only.
            std::str::from_utf8(id).ok()
        })
    }

    /// How many ids are listed.
    pub fn listed(&self) -> u32 {
        self.listed
    }

    /// How many more ids the round had than it lists (`event_ids_dropped`).
    pub fn dropped(&self) -> u32 {
        self.dropped
    }

    /// Bytes of heap the listed ids take (the buffer's capacity), for memory accounting.
    pub fn heap_bytes(&self) -> usize {
        self.buf.capacity()
    }
}

/// Everything the engine keeps for one session key (stored per key by the shell).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct SessionState {
    /// Event time (ms) of the upload that created this state: the key's first upload, or its
    /// first after the previous state expired (`state-ttl`). Part of every emission id of the
    /// state (SEMANTICS §2), so the ids of two lives of one key never meet.
    pub created_at: Millis,
    /// Generation of the key's latest emission in this state; 0 before the first.
    pub generation: u64,
    /// Event time of the key's last non-late upload.
    pub last_upload_at: Millis,
    /// `event_id` of the key's last applied upload (redelivery detection).
    pub last_applied_event_id: Option<String>,
    /// CallTrack (adaptive policy only).
    pub track: Option<CallTrack>,
    /// The open round, if any. Boxed: a session without an open round (most cached
    /// sessions of a long tail, between their rounds) then takes ~100 bytes less in the
    /// store's session cache; the stored bytes are the same (serde encodes a box as its
    /// contents).
    pub round: Option<Box<Round>>,
}

/// One owed "session ready" record, as decided by the engine (SEMANTICS §2 output record).
/// The shell adds `emitted_at` and `tier` when it publishes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Emission {
    /// `tenant/session`.
    pub key: SessionKey,
    /// [`SessionState::created_at`] of the state that emitted it (ms, event time).
    pub state_created_at: Millis,
    /// 1 for the first emission of a key's state, +1 for each next one.
    pub generation: u64,
    /// Why it was emitted.
    pub trigger: Trigger,
    /// Uploads coalesced into it.
    pub uploads: u32,
    /// Event time of the first coalesced upload (ms).
    pub first_upload_at: Millis,
    /// Event time of the last coalesced upload (ms).
    pub last_upload_at: Millis,
    /// When the policy made it due (ms).
    pub due_at: Millis,
    /// Debounce delay in force when it was due (ms).
    pub delay_ms: Millis,
    /// Policy that decided it.
    pub policy: PolicyName,
    /// `event_id` of the last coalesced upload.
    pub last_event_id: Option<String>,
    /// `attributes` (JSON object text) of the last coalesced upload.
    pub attributes: Option<String>,
    /// The round's event ids when its rule keeps them (SEMANTICS §2 `event_ids`,
    /// `event_ids_dropped`), `None` otherwise. Not in the serde (postcard) form: the store
    /// writes it in the outbox value's trailer (`store::keys`).
    #[serde(skip)]
    pub event_ids: Option<Box<EventIds>>,
}

impl Emission {
    /// `tenant/session/state_created_at/generation` (SEMANTICS §2), e.g.
    /// `acme/build-42/1767225600000/3`: the same for every copy of a round's emission (it is
    /// made of event times and the stored state only) and different for every other round of
    /// the key, also after its state expired and started again at generation 1 (the new state
    /// has a later `created_at`). The key is the part before the last two `/`.
    pub fn emission_id(&self) -> String {
        let (mut created, mut generation) = (itoa::Buffer::new(), itoa::Buffer::new());
        let (created, generation) = (
            created.format(self.state_created_at),
            generation.format(self.generation),
        );
        let key = self.key.as_str();
        let mut id = String::with_capacity(key.len() + created.len() + generation.len() + 2);
        for part in [key, "/", created, "/", generation] {
            id.push_str(part);
        }
        id
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_and_long_keys_split_order_and_serialize_alike() {
        // 16 bytes are held inline, 17 and more in a shared string: nothing else may differ.
        let short = SessionKey::new("acme", "build-42012"); // 4 + 1 + 11 = 16 bytes
        let long = SessionKey::new("acme", "build-420123"); // 17 bytes
        let huge = SessionKey::new("t", &"s".repeat(200)); // past the 96-byte stack buffer
        assert_eq!(short.as_str().len(), 16);
        assert_eq!(long.as_str().len(), 17);
        assert_eq!(std::mem::size_of::<SessionKey>(), 16);
        for (key, tenant, session) in [
            (&short, "acme", "build-42012"),
            (&long, "acme", "build-420123"),
            (&huge, "t", &"s".repeat(200)[..]),
        ] {
            assert_eq!(key.tenant(), tenant);
            assert_eq!(key.session(), session);
            assert_eq!(key.as_str(), format!("{tenant}/{session}"));
            assert_eq!(SessionKey::parse(key.as_str()).as_ref(), Some(key));
            let json = serde_json::to_string(key).unwrap();
            assert_eq!(json, format!("\"{tenant}/{session}\""));
            assert_eq!(&serde_json::from_str::<SessionKey>(&json).unwrap(), key);
            assert_eq!(format!("{key}"), key.as_str());
            assert_eq!(format!("{key:?}"), format!("{:?}", key.as_str()));
        }
        // Ordered and hashed as their text, whichever way each is held.
        assert!(short < long && long.clone() == long);
        let mut keys = [long.clone(), huge.clone(), short.clone()];
        keys.sort();
        let mut texts = [long.as_str(), huge.as_str(), short.as_str()];
        texts.sort();
        assert_eq!(
            keys.iter().map(SessionKey::as_str).collect::<Vec<_>>(),
            texts
        );
        use std::hash::BuildHasher;
        let h = std::collections::hash_map::RandomState::new();
        assert_eq!(
            h.hash_one(&short),
            h.hash_one(SessionKey::new("acme", "build-42012"))
        );
        assert_eq!(
            h.hash_one(&huge),
            h.hash_one(SessionKey::parse(huge.as_str()).unwrap())
        );
        assert_eq!(SessionKey::parse("no-slash"), None);
        assert_eq!(SessionKey::parse("/s"), None);
    }
}
