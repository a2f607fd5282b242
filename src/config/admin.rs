//! `[admin]`: the section of the admin HTTP server of `settle run` (`crate::admin`).

use serde::{Deserialize, Serialize};
use std::net::{Ipv4Addr, SocketAddr};

/// Default `admin.listen`: loopback only, port 9464.
pub const DEFAULT_LISTEN: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(Ipv4Addr::LOCALHOST), 9464);

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
}

impl Default for AdminConfig {
    fn default() -> Self {
        AdminConfig {
            enabled: true,
            listen: DEFAULT_LISTEN,
        }
    }
}
