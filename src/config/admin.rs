//! `[admin]`: the section of the admin HTTP server of `settle run` (`crate::admin`): where it
//! listens, whether it accepts operator actions, who may call it (bearer tokens, SEMANTICS
//! §7) and its optional TLS. Token files and certificates are read when the server starts
//! (`crate::admin::auth`, `crate::admin::tls`), not here; this section only names them.

use super::KeyError;
use serde::{Deserialize, Serialize};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;

/// Default `admin.listen`: loopback only, port 9464.
pub const DEFAULT_LISTEN: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(Ipv4Addr::LOCALHOST), 9464);

/// Environment variable with named tokens, `NAME:TOKEN` or `NAME:read:TOKEN` entries
/// separated by commas; added to those of `admin.tokens-file`. Not a config key (it has no
/// `__`): a secret, never part of the config tree that `check-config` prints.
pub const TOKENS_ENV: &str = "SETTLE_ADMIN_TOKENS";

/// `[admin]`: the admin HTTP server of `settle run`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct AdminConfig {
    /// `enabled`: serve the admin endpoints (default true).
    pub enabled: bool,
    /// `listen`: IP address and port to listen on (default `127.0.0.1:9464`, loopback only;
    /// `0.0.0.0:9464` in a container so Prometheus and the kubelet can reach it; port 0 picks
    /// a free port).
    pub listen: SocketAddr,
    /// `actions`: accept operator actions (`POST /v1/actions` and every other request that
    /// is not a read, SEMANTICS §7). Default true. With actions on a non-loopback `listen`,
    /// at least one token must be configured (`tokens-file` or [`TOKENS_ENV`]) or settle
    /// refuses to start.
    pub actions: bool,
    /// `protect-reads`: reads (`/metrics`, `/healthz`, `/readyz`, the `/v1` views) need a
    /// token too, of either role. Default false: Prometheus and the kubelet need nothing.
    pub protect_reads: bool,
    /// `tokens-file`: named bearer tokens, one per line: `NAME:TOKEN` (role operator: every
    /// request) or `NAME:read:TOKEN` (reads only); `#` starts a comment. Default: none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens_file: Option<PathBuf>,
    /// `tls-cert-file`: PEM certificate chain the admin server presents (with
    /// `tls-key-file`): it then serves HTTPS only. Default: none (plain HTTP).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_cert_file: Option<PathBuf>,
    /// `tls-key-file`: PEM private key of `tls-cert-file`. Default: none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_key_file: Option<PathBuf>,
}

impl Default for AdminConfig {
    fn default() -> Self {
        AdminConfig {
            enabled: true,
            listen: DEFAULT_LISTEN,
            actions: true,
            protect_reads: false,
            tokens_file: None,
            tls_cert_file: None,
            tls_key_file: None,
        }
    }
}

impl AdminConfig {
    /// Checks the keys that go together.
    ///
    /// Errors: `admin.tls-cert-file` without `admin.tls-key-file` or the other way round.
    pub fn validate(&self) -> Result<(), KeyError> {
        match (&self.tls_cert_file, &self.tls_key_file) {
            (Some(_), None) => Err(KeyError::new(
                "admin.tls-key-file",
                "admin.tls-cert-file and admin.tls-key-file go together: set both or neither",
            )),
            (None, Some(_)) => Err(KeyError::new(
                "admin.tls-cert-file",
                "admin.tls-cert-file and admin.tls-key-file go together: set both or neither",
            )),
            _ => Ok(()),
        }
    }

    /// `https` with TLS configured, else `http`.
    pub fn scheme(&self) -> &'static str {
        if self.tls_cert_file.is_some() {
            "https"
        } else {
            "http"
        }
    }
}
