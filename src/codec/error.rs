//! Why an input record is not applied (SEMANTICS §2): [`DecodeError`], one variant per rule
//! of the upload record and its record key, in the order the rules are checked, and its
//! stable snake_case [`DecodeError::reason`] code: the dead-letter reason header and the
//! metrics label ([`DecodeError::ALL_REASONS`] lists them all).

/// Why an input record is not applied (SEMANTICS §2): one variant per rule. The record goes to
/// the dead-letter topic with [`DecodeError::reason`] and the partition's offset advances.
///
/// When a record breaks several rules the first one found is reported: the payload's bytes and
/// JSON syntax first, then field types in the order the fields appear, then `tenant`,
/// `session`, `event_id`, `part`, `attributes` and last the record key.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The payload is not UTF-8.
    #[error("payload is not valid UTF-8")]
    InvalidUtf8,
    /// The payload is not JSON (message from the JSON parser, with line and column).
    #[error("payload is not valid JSON: {0}")]
    InvalidJson(String),
    /// The payload is JSON but not an object.
    #[error("payload must be a JSON object")]
    NotAnObject,
    /// A field this decoder reads appears twice in the object (ambiguous record).
    #[error("field `{0}` appears more than once")]
    DuplicateField(&'static str),
    /// No `tenant` field.
    #[error("required field `tenant` is missing")]
    MissingTenant,
    /// `tenant` is not a string.
    #[error("field `tenant` must be a string")]
    TenantNotString,
    /// `tenant` is the empty string.
    #[error("field `tenant` must be 1-128 bytes, got 0")]
    EmptyTenant,
    /// `tenant` is longer than [`TENANT_MAX_BYTES`](super::TENANT_MAX_BYTES).
    #[error("field `tenant` must be 1-128 bytes, got {0}")]
    TenantTooLong(usize),
    /// `tenant` has a character outside `[A-Za-z0-9._:-]`.
    #[error("field `tenant` may only contain [A-Za-z0-9._:-], found {0:?}")]
    BadTenant(char),
    /// No `session` field.
    #[error("required field `session` is missing")]
    MissingSession,
    /// `session` is not a string.
    #[error("field `session` must be a string")]
    SessionNotString,
    /// `session` is the empty string.
    #[error("field `session` must be 1-256 bytes, got 0")]
    EmptySession,
    /// `session` is longer than [`SESSION_MAX_BYTES`](super::SESSION_MAX_BYTES).
    #[error("field `session` must be 1-256 bytes, got {0}")]
    SessionTooLong(usize),
    /// `session` has a control character (Unicode category Cc: U+0000–U+001F, U+007F–U+009F).
    #[error("field `session` must not contain control characters, found {0:?}")]
    SessionControlChar(char),
    /// `event_id` is present but not a string (or null).
    #[error("field `event_id` must be a string")]
    EventIdNotString,
    /// `event_id` is longer than [`EVENT_ID_MAX_BYTES`](super::EVENT_ID_MAX_BYTES).
    #[error("field `event_id` must be at most 128 bytes, got {0}")]
    EventIdTooLong(usize),
    /// `part` is not an object `{"index": u32, "count": u32}` (or null).
    #[error("field `part` must be an object {{\"index\": u32, \"count\": u32}}: {0}")]
    BadPart(String),
    /// `part.count` is 0.
    #[error("field `part.count` must be at least 1")]
    PartCountZero,
    /// `part.index` is not in `1..=part.count`.
    #[error("field `part.index` must be in 1..={count}, got {index}")]
    PartIndexOutOfRange {
        /// The record's `part.index`.
        index: u32,
        /// The record's `part.count`.
        count: u32,
    },
    /// `final` is present but not a boolean (or null).
    #[error("field `final` must be a boolean")]
    FinalNotBool,
    /// `attributes` is present but not a JSON object (or null).
    #[error("field `attributes` must be a JSON object")]
    AttributesNotObject,
    /// `attributes` is longer than [`ATTRIBUTES_MAX_BYTES`](super::ATTRIBUTES_MAX_BYTES) as
    /// written in the record.
    #[error("field `attributes` must be at most 16384 bytes, got {0}")]
    AttributesTooLarge(usize),
    /// `attributes` nests objects and arrays deeper than
    /// [`ATTRIBUTES_MAX_DEPTH`](super::ATTRIBUTES_MAX_DEPTH) levels.
    #[error("field `attributes` must nest at most 64 levels")]
    AttributesTooDeep,
    /// The record has no key: its session's uploads could be spread over partitions.
    #[error("record key is missing (it must be `tenant/session`)")]
    MissingKey,
    /// The record key is not UTF-8.
    #[error("record key is not valid UTF-8")]
    KeyNotUtf8,
    /// The record key differs from `tenant/session`.
    #[error("record key {key:?} must equal `tenant/session` {expected:?}")]
    KeyMismatch {
        /// The record key (cut to 300 bytes).
        key: String,
        /// `tenant/session` from the payload.
        expected: String,
    },
    /// The record arrived on a partition other than the one its key hashes to, on a
    /// transport where settle's partitioner decides (NATS: 32-bit FNV-1a of the key modulo
    /// `nats.partitions`). Its session's other uploads live on that other partition, so
    /// applying it here would split the session (SEMANTICS §2).
    #[error("record arrived on partition {partition}, but its key hashes to partition {expected}")]
    WrongPartition {
        /// The partition the record was read from.
        partition: i32,
        /// The partition its key hashes to.
        expected: i32,
    },
}

impl DecodeError {
    /// Every [`DecodeError::reason`] code, in declaration order.
    pub const ALL_REASONS: [&'static str; 27] = [
        "invalid_utf8",
        "invalid_json",
        "not_an_object",
        "duplicate_field",
        "missing_tenant",
        "tenant_not_string",
        "empty_tenant",
        "tenant_too_long",
        "bad_tenant",
        "missing_session",
        "session_not_string",
        "empty_session",
        "session_too_long",
        "session_control_char",
        "event_id_not_string",
        "event_id_too_long",
        "bad_part",
        "part_count_zero",
        "part_index_out_of_range",
        "final_not_bool",
        "attributes_not_object",
        "attributes_too_large",
        "attributes_too_deep",
        "missing_key",
        "key_not_utf8",
        "key_mismatch",
        "wrong_partition",
    ];

    /// Short stable snake_case code of the rule that failed: the dead-letter reason header and
    /// the metrics label. One of [`DecodeError::ALL_REASONS`].
    pub fn reason(&self) -> &'static str {
        match self {
            DecodeError::InvalidUtf8 => "invalid_utf8",
            DecodeError::InvalidJson(_) => "invalid_json",
            DecodeError::NotAnObject => "not_an_object",
            DecodeError::DuplicateField(_) => "duplicate_field",
            DecodeError::MissingTenant => "missing_tenant",
            DecodeError::TenantNotString => "tenant_not_string",
            DecodeError::EmptyTenant => "empty_tenant",
            DecodeError::TenantTooLong(_) => "tenant_too_long",
            DecodeError::BadTenant(_) => "bad_tenant",
            DecodeError::MissingSession => "missing_session",
            DecodeError::SessionNotString => "session_not_string",
            DecodeError::EmptySession => "empty_session",
            DecodeError::SessionTooLong(_) => "session_too_long",
            DecodeError::SessionControlChar(_) => "session_control_char",
            DecodeError::EventIdNotString => "event_id_not_string",
            DecodeError::EventIdTooLong(_) => "event_id_too_long",
            DecodeError::BadPart(_) => "bad_part",
            DecodeError::PartCountZero => "part_count_zero",
            DecodeError::PartIndexOutOfRange { .. } => "part_index_out_of_range",
            DecodeError::FinalNotBool => "final_not_bool",
            DecodeError::AttributesNotObject => "attributes_not_object",
            DecodeError::AttributesTooLarge(_) => "attributes_too_large",
            DecodeError::AttributesTooDeep => "attributes_too_deep",
            DecodeError::MissingKey => "missing_key",
            DecodeError::KeyNotUtf8 => "key_not_utf8",
            DecodeError::KeyMismatch { .. } => "key_mismatch",
            DecodeError::WrongPartition { .. } => "wrong_partition",
        }
    }
}
