//! Operator actions on the wire (SEMANTICS §7): the **action record** an instance produces to
//! the input topic so that the partition's single writer applies it in order with the
//! uploads, the **outcome** that writer reports, and the **audit record** every action and
//! override leaves on the audit topic.
//!
//! An action record is a JSON object whose only member is `settle_action`; its payload starts
//! with [`ACTION_PREFIX`] (the encoder writes it first), so the partition task tells it from
//! an upload with one comparison of the first 17 bytes ([`is_action`]) and uploads pay
//! nothing more. Its record key is `settle-action/<request id>` (never a session key).
//!
//! ```json
//! {"settle_action":{"request_id":"r-7f3a","kind":"flush","session":"acme/build-4711",
//!   "reason":"results never arrived","who":"alice","instance":"settle-0",
//!   "requested_at":1767225600000}}
//! {"settle_action":{"request_id":"r-7f3b","kind":"cancel","dry_run":true,
//!   "filter":{"tenant":"acme","due_before":1767229200000},"limit":10000, ...}}
//! ```

use crate::engine::{Millis, PolicyName, SessionKey};
use serde::{Deserialize, Serialize};

/// First bytes of every action record's payload.
pub const ACTION_PREFIX: &[u8] = b"{\"settle_action\":";

/// Most bytes of a request id (like an `event_id`, SEMANTICS §2).
pub const REQUEST_ID_MAX_BYTES: usize = 128;

/// Most bytes of an action's or override's reason.
pub const REASON_MAX_BYTES: usize = 1024;

/// Most sessions one bulk action touches per partition (its `limit` is capped here); a bulk
/// action that selects more reports `more: true` and can be sent again.
pub const BULK_LIMIT_MAX: u32 = 100_000;

/// Default `limit` of a bulk action, per partition.
pub const BULK_LIMIT_DEFAULT: u32 = 10_000;

/// What an action does to a session's open round (SEMANTICS §7).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ActionKind {
    /// Emit the open round now (`trigger = manual`, `due_at` = when it was applied).
    Flush,
    /// Close the open round without an emission (its uploads are dropped; the CallTrack
    /// stays).
    Cancel,
}

impl ActionKind {
    /// `flush` or `cancel`.
    pub fn as_str(self) -> &'static str {
        match self {
            ActionKind::Flush => "flush",
            ActionKind::Cancel => "cancel",
        }
    }
}

/// The selection of a bulk action (SEMANTICS §7): every open round of the partition that
/// matches all the fields that are set. Times are ms since the epoch.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SessionFilter {
    /// Only this tenant's sessions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// Only these input partitions (the accepting instance sends the record to these only;
    /// a partition not listed that receives it anyway selects nothing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partitions: Option<Vec<i32>>,
    /// Only rounds timed by this policy (`engine::Round::policy`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<PolicyName>,
    /// Only tenants in this tier, as the partition's owner routes them when it applies the
    /// action (SEMANTICS §5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tier: Option<String>,
    /// Only rounds due before this time (exclusive).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub due_before: Option<Millis>,
    /// Only rounds due at or after this time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub due_after: Option<Millis>,
    /// Only rounds with at least this many uploads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_uploads: Option<u32>,
}

impl SessionFilter {
    /// Whether a round passes the fields that need no state: tenant, partition and due time.
    /// `tier` and the state's fields are the caller's to check.
    pub fn admits(&self, partition: i32, key: &SessionKey, due: Millis) -> bool {
        self.tenant.as_deref().is_none_or(|t| t == key.tenant())
            && self
                .partitions
                .as_ref()
                .is_none_or(|ps| ps.contains(&partition))
            && self.due_before.is_none_or(|b| due < b)
            && self.due_after.is_none_or(|a| due >= a)
    }

    /// Checks the fields: a valid tenant name, `due_after < due_before` when both are set.
    ///
    /// Errors: the text names the field (`filter.tenant`, ...).
    pub fn validate(&self) -> Result<(), String> {
        if let Some(t) = &self.tenant {
            super::validate_tenant(t).map_err(|e| format!("filter.tenant {t:?}: {e}"))?;
        }
        if let (Some(a), Some(b)) = (self.due_after, self.due_before) {
            if a >= b {
                return Err(format!(
                    "filter.due_after ({a}) must be before filter.due_before ({b})"
                ));
            }
        }
        if self
            .partitions
            .as_ref()
            .is_some_and(|p| p.iter().any(|&p| p < 0))
        {
            return Err("filter.partitions: a partition is a number ≥ 0".into());
        }
        Ok(())
    }
}

/// One operator action, as the record its partition's owner applies (SEMANTICS §7).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActionRecord {
    /// Idempotency key: a partition applies a request id once; a retried request (same id)
    /// gets the first outcome again. ≤ [`REQUEST_ID_MAX_BYTES`] bytes.
    pub request_id: String,
    /// What to do to each selected open round.
    pub kind: ActionKind,
    /// Only count what would be done; change nothing.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub dry_run: bool,
    /// The one session to act on (`tenant/session`); exactly one of `session` and `filter`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
    /// The bulk selection; exactly one of `session` and `filter`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub filter: Option<SessionFilter>,
    /// Bulk: most sessions to act on in one partition (default [`BULK_LIMIT_DEFAULT`], at
    /// most [`BULK_LIMIT_MAX`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
    /// Why (free text, ≤ [`REASON_MAX_BYTES`] bytes), as given by the operator.
    pub reason: String,
    /// The name of the credential that asked (`anonymous` without one).
    pub who: String,
    /// The instance that accepted the request.
    pub instance: String,
    /// When it was accepted (wall clock, ms).
    pub requested_at: Millis,
}

/// Why an action record cannot be applied (it is dead-lettered with [`ActionError::reason`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ActionError {
    /// Not the JSON this module writes.
    #[error("action record is not valid: {0}")]
    Invalid(String),
    /// A field breaks its rule (the text names it).
    #[error("action record: {0}")]
    Field(String),
}

impl ActionError {
    /// The dead-letter reason and metrics label: `bad_action`.
    pub fn reason(&self) -> &'static str {
        "bad_action"
    }
}

#[derive(Serialize, Deserialize)]
struct Wrapper<T> {
    settle_action: T,
}

impl ActionRecord {
    /// The session key of a session action (`None` for a bulk one, or a key that is not
    /// `tenant/session`).
    pub fn session_key(&self) -> Option<SessionKey> {
        self.session.as_deref().and_then(SessionKey::parse)
    }

    /// The record key to produce it with: `settle-action/<request id>`.
    pub fn record_key(&self) -> String {
        format!("settle-action/{}", self.request_id)
    }

    /// The bulk limit in force: `limit` capped at [`BULK_LIMIT_MAX`], default
    /// [`BULK_LIMIT_DEFAULT`].
    pub fn bulk_limit(&self) -> u32 {
        self.limit
            .unwrap_or(BULK_LIMIT_DEFAULT)
            .clamp(1, BULK_LIMIT_MAX)
    }

    /// Checks every field: request id and reason lengths, exactly one of session and filter,
    /// a valid session key, a valid filter.
    ///
    /// Errors: [`ActionError::Field`] naming the field.
    pub fn validate(&self) -> Result<(), ActionError> {
        let field = |m: String| Err(ActionError::Field(m));
        if self.request_id.is_empty() || self.request_id.len() > REQUEST_ID_MAX_BYTES {
            return field(format!(
                "request_id must be 1-{REQUEST_ID_MAX_BYTES} bytes, got {}",
                self.request_id.len()
            ));
        }
        if self.reason.len() > REASON_MAX_BYTES {
            return field(format!(
                "reason must be at most {REASON_MAX_BYTES} bytes, got {}",
                self.reason.len()
            ));
        }
        match (&self.session, &self.filter) {
            (Some(s), None) => {
                let Some(key) = SessionKey::parse(s) else {
                    return field(format!("session {s:?} is not tenant/session"));
                };
                super::validate_tenant(key.tenant())
                    .map_err(|e| ActionError::Field(format!("session {s:?}: tenant: {e}")))?;
                super::validate_session(key.session())
                    .map_err(|e| ActionError::Field(format!("session {s:?}: session: {e}")))?;
            }
            (None, Some(f)) => f.validate().map_err(ActionError::Field)?,
            _ => return field("exactly one of session and filter must be set".into()),
        }
        Ok(())
    }

    /// The record's payload: `{"settle_action":{...}}`, starting with [`ACTION_PREFIX`].
    pub fn encode(&self) -> Vec<u8> {
        // Serializing a struct of strings, numbers and enums cannot fail.
        serde_json::to_vec(&Wrapper {
            settle_action: self,
        })
        .unwrap_or_default()
    }

    /// Reads an action record's payload and checks it ([`ActionRecord::validate`]).
    ///
    /// Errors: [`ActionError`] (the record is dead-lettered as `bad_action`).
    pub fn decode(payload: &[u8]) -> Result<Self, ActionError> {
        let w: Wrapper<ActionRecord> =
            serde_json::from_slice(payload).map_err(|e| ActionError::Invalid(e.to_string()))?;
        w.settle_action.validate()?;
        Ok(w.settle_action)
    }
}

/// Whether `payload` is an action record (starts with [`ACTION_PREFIX`]).
pub fn is_action(payload: &[u8]) -> bool {
    payload.starts_with(ACTION_PREFIX)
}

/// What one partition did with an action record: the `applied` stage of the audit trail
/// (SEMANTICS §7 "what it did"), and what the accepting instance answers per partition.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActionOutcome {
    /// The action's request id.
    pub request_id: String,
    /// Input partition that applied it.
    pub partition: i32,
    /// Offset of the action record in that partition.
    pub offset: i64,
    /// Partition time (ms) when it was applied: `due_at` of a flush's emissions.
    pub applied_at: Millis,
    /// Only counted, nothing changed.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub dry_run: bool,
    /// The request id was applied before in this partition: this is that first outcome
    /// again, nothing was done now.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub duplicate: bool,
    /// Open rounds acted on (dry run: that would be).
    pub sessions: u64,
    /// Uploads in those rounds.
    pub uploads: u64,
    /// A bulk action found more matching rounds than its limit (send it again for the rest).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub more: bool,
    /// Emission ids of the rounds a flush emitted (at most 100 listed).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub emission_ids: Vec<String>,
    /// For a session action: what it found. `flushed`, `cancelled`, `would_flush`,
    /// `would_cancel`, `no_open_round` (the session has state but no round with uploads),
    /// `no_state` (this partition holds nothing of the session); for a bulk one `done` or
    /// `would_do`.
    pub result: String,
}

/// The stage of an audit record.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AuditStage {
    /// An instance accepted a request (it produced the action records, or stored the
    /// override).
    Accepted,
    /// A request was refused (no or a wrong credential, bad input, a stale override version):
    /// nothing was done.
    Refused,
    /// A partition's owner applied an action (its [`ActionOutcome`] is the result), or an
    /// override took effect or expired.
    Applied,
}

/// One record of the audit topic (SEMANTICS §7): who asked what, why, and what was done.
/// JSON, record key = the request id.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AuditRecord {
    /// When this record was written (wall clock, ms); RFC 3339 on the wire is not used here
    /// so that tools sort it as a number.
    pub at: Millis,
    /// The instance that wrote it.
    pub instance: String,
    /// The credential's name (`anonymous` when the request carried no accepted token).
    pub who: String,
    /// The request id (generated when the request had none).
    pub request_id: String,
    /// `flush`, `cancel`, `override.set`, `override.delete`, `override.expired`, or the
    /// endpoint of a refused request.
    pub action: String,
    /// Accepted, refused or applied.
    pub stage: AuditStage,
    /// The operator's reason (refused: why it was refused).
    pub reason: String,
    /// What it selected: the session, the filter, the tenant.
    #[serde(default)]
    pub selection: serde_json::Value,
    /// What it did: an [`ActionOutcome`], an override's versions, an HTTP status.
    #[serde(default)]
    pub result: serde_json::Value,
}

impl AuditRecord {
    /// The JSON payload.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Reads an audit record.
    ///
    /// Errors: the JSON parser's.
    pub fn decode(payload: &[u8]) -> Result<Self, serde_json::Error> {
        serde_json::from_slice(payload)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flush(session: &str) -> ActionRecord {
        ActionRecord {
            request_id: "r-1".into(),
            kind: ActionKind::Flush,
            dry_run: false,
            session: Some(session.into()),
            filter: None,
            limit: None,
            reason: "results never arrived".into(),
            who: "alice".into(),
            instance: "settle-0".into(),
            requested_at: 1_767_225_600_000,
        }
    }

    #[test]
    fn an_action_record_starts_with_its_prefix_and_reads_back() {
        let a = flush("acme/build-4711");
        let bytes = a.encode();
        assert!(is_action(&bytes), "{}", String::from_utf8_lossy(&bytes));
        assert_eq!(ActionRecord::decode(&bytes).unwrap(), a);
        assert_eq!(a.session_key().unwrap().tenant(), "acme");
        assert_eq!(a.record_key(), "settle-action/r-1");
        assert!(!is_action(br#"{"tenant":"acme","session":"s"}"#));
        let mut bulk = a.clone();
        bulk.session = None;
        bulk.filter = Some(SessionFilter {
            tenant: Some("acme".into()),
            due_before: Some(10),
            ..SessionFilter::default()
        });
        bulk.dry_run = true;
        bulk.limit = Some(1_000_000);
        let bytes = bulk.encode();
        assert_eq!(ActionRecord::decode(&bytes).unwrap(), bulk);
        assert_eq!(bulk.bulk_limit(), BULK_LIMIT_MAX);
    }

    #[test]
    fn bad_action_records_say_which_field() {
        let mut both = flush("acme/s");
        both.filter = Some(SessionFilter::default());
        let err = ActionRecord::decode(&both.encode())
            .unwrap_err()
            .to_string();
        assert!(err.contains("exactly one of session and filter"), "{err}");
        let err = ActionRecord::decode(&flush("no-slash").encode())
            .unwrap_err()
            .to_string();
        assert!(err.contains("not tenant/session"), "{err}");
        let err = ActionRecord::decode(&flush("bad tenant!/s").encode())
            .unwrap_err()
            .to_string();
        assert!(err.contains("tenant"), "{err}");
        let mut long = flush("a/s");
        long.request_id = "x".repeat(129);
        assert!(ActionRecord::decode(&long.encode())
            .unwrap_err()
            .to_string()
            .contains("request_id"));
        let err = ActionRecord::decode(br#"{"settle_action":{"kind":"explode"}}"#).unwrap_err();
        assert_eq!(err.reason(), "bad_action");
        let f = SessionFilter {
            due_after: Some(5),
            due_before: Some(5),
            ..SessionFilter::default()
        };
        assert!(f.validate().unwrap_err().contains("filter.due_after"));
    }

    #[test]
    fn a_filter_admits_by_tenant_partition_and_due_time() {
        let key = SessionKey::new("acme", "s");
        let all = SessionFilter::default();
        assert!(all.admits(3, &key, 100));
        let f = SessionFilter {
            tenant: Some("acme".into()),
            partitions: Some(vec![1, 3]),
            due_after: Some(100),
            due_before: Some(200),
            ..SessionFilter::default()
        };
        assert!(f.admits(3, &key, 100));
        assert!(!f.admits(2, &key, 100), "partition");
        assert!(!f.admits(3, &key, 200), "due_before is exclusive");
        assert!(!f.admits(3, &key, 99), "due_after is inclusive");
        assert!(!f.admits(3, &SessionKey::new("other", "s"), 150), "tenant");
    }

    #[test]
    fn audit_records_read_back() {
        let r = AuditRecord {
            at: 1,
            instance: "settle-0".into(),
            who: "alice".into(),
            request_id: "r-1".into(),
            action: "flush".into(),
            stage: AuditStage::Applied,
            reason: "why".into(),
            selection: serde_json::json!({"session": "acme/s"}),
            result: serde_json::to_value(ActionOutcome {
                request_id: "r-1".into(),
                sessions: 1,
                uploads: 3,
                result: "flushed".into(),
                ..ActionOutcome::default()
            })
            .unwrap(),
        };
        assert_eq!(AuditRecord::decode(&r.encode()).unwrap(), r);
    }
}
