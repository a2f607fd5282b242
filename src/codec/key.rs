//! The session key on the wire (SEMANTICS §2): what a `tenant` may be (1–128 bytes of
//! `[A-Za-z0-9._:-]`, [`validate_tenant`]) and a `session` (1–256 bytes of UTF-8 without
//! control characters, [`validate_session`]), and the rule that a record key equals
//! `tenant/session` byte for byte. The validators are public: the config checks its tenant
//! names and the tools their trace lines with them.

use super::DecodeError;

/// Most bytes in a `tenant` (SEMANTICS §2).
pub const TENANT_MAX_BYTES: usize = 128;
/// Most bytes in a `session` (SEMANTICS §2).
pub const SESSION_MAX_BYTES: usize = 256;

/// Checks a tenant name (SEMANTICS §2): 1–128 bytes of `[A-Za-z0-9._:-]`. Also used for the
/// tenant names of the config.
///
/// Errors: [`DecodeError::EmptyTenant`], [`DecodeError::TenantTooLong`],
/// [`DecodeError::BadTenant`].
pub fn validate_tenant(tenant: &str) -> Result<(), DecodeError> {
    if tenant.is_empty() {
        return Err(DecodeError::EmptyTenant);
    }
    if tenant.len() > TENANT_MAX_BYTES {
        return Err(DecodeError::TenantTooLong(tenant.len()));
    }
    match tenant.bytes().position(|b| !TENANT_BYTES[usize::from(b)]) {
        // `i` is a char boundary: every byte before it is ASCII.
        Some(i) => Err(DecodeError::BadTenant(
            tenant[i..].chars().next().unwrap_or_default(),
        )),
        None => Ok(()),
    }
}

/// `TENANT_BYTES[b]`: byte `b` may appear in a tenant (`[A-Za-z0-9._:-]`).
const TENANT_BYTES: [bool; 256] = {
    let mut table = [false; 256];
    let mut b = 0;
    while b < 256 {
        let c = b as u8;
        table[b] = c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b':' | b'-');
        b += 1;
    }
    table
};

/// Checks a session id (SEMANTICS §2): 1–256 bytes of UTF-8 without control characters
/// (Unicode category Cc). `/` is allowed: the first `/` of a session key ends the tenant.
///
/// Errors: [`DecodeError::EmptySession`], [`DecodeError::SessionTooLong`],
/// [`DecodeError::SessionControlChar`].
pub fn validate_session(session: &str) -> Result<(), DecodeError> {
    if session.is_empty() {
        return Err(DecodeError::EmptySession);
    }
    if session.len() > SESSION_MAX_BYTES {
        return Err(DecodeError::SessionTooLong(session.len()));
    }
    // Cc is U+0000–U+001F and U+007F (one byte each) and U+0080–U+009F (`C2 80`–`C2 9F`);
    // scanning bytes finds them without decoding chars.
    let bytes = session.as_bytes();
    let hit = bytes.iter().enumerate().position(|(i, &b)| {
        b < 0x20 || b == 0x7f || (b == 0xc2 && matches!(bytes.get(i + 1), Some(0x80..=0x9f)))
    });
    match hit {
        Some(i) => Err(DecodeError::SessionControlChar(
            session[i..].chars().next().unwrap_or_default(),
        )),
        None => Ok(()),
    }
}

/// The record key must be exactly `tenant/session`.
pub(super) fn check_record_key(key: &[u8], tenant: &str, session: &str) -> Result<(), DecodeError> {
    let (t, s) = (tenant.as_bytes(), session.as_bytes());
    if key.len() == t.len() + 1 + s.len()
        && key.starts_with(t)
        && key[t.len()] == b'/'
        && key.ends_with(s)
    {
        return Ok(());
    }
    let key = std::str::from_utf8(key).map_err(|_| DecodeError::KeyNotUtf8)?;
    let mut cut = key.len().min(300);
    while !key.is_char_boundary(cut) {
        cut -= 1;
    }
    Err(DecodeError::KeyMismatch {
        key: key[..cut].to_owned(),
        expected: format!("{tenant}/{session}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validators_are_public_for_config_and_tools() {
        assert!(validate_tenant("acme").is_ok());
        assert_eq!(validate_tenant("a!"), Err(DecodeError::BadTenant('!')));
        assert!(validate_session("x/y z").is_ok());
        assert_eq!(validate_session(""), Err(DecodeError::EmptySession));
    }
}
