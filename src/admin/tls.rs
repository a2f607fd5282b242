//! Optional TLS of the admin listener (`admin.tls-cert-file`, `admin.tls-key-file`): the
//! rustls server config read from PEM files, and [`TlsListener`], an `axum::serve` listener
//! that hands over connections once their TLS handshake is done. Handshakes run in tasks
//! of their own, each bounded by [`HANDSHAKE_TIMEOUT`], so a client that connects and says
//! nothing delays no one else. TLS 1.3 with the `ring` provider (the one the NATS client
//! already links); HTTP/1.1 (ALPN `http/1.1`).

use anyhow::Context as _;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

/// Longest TLS handshake of one connection; a slower one is dropped.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Connections whose handshake is done but that the server has not taken yet.
const READY_QUEUE: usize = 64;

/// The rustls server config of `cert` (PEM chain, leaf first) and `key` (PEM private key:
/// PKCS#8, PKCS#1 or SEC1).
///
/// Errors: a file that cannot be read or holds no certificate / key, or a key that does
/// not match the certificate; the message names the key (`admin.tls-cert-file`,
/// `admin.tls-key-file`) and the path.
pub fn server_config(cert: &Path, key: &Path) -> anyhow::Result<Arc<rustls::ServerConfig>> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .and_then(|certs| certs.collect::<Result<_, _>>())
        .map_err(|e| anyhow::anyhow!("admin.tls-cert-file: cannot read {}: {e}", cert.display()))?;
    if chain.is_empty() {
        anyhow::bail!(
            "admin.tls-cert-file: {} holds no PEM certificate",
            cert.display()
        );
    }
    let private = PrivateKeyDer::from_pem_file(key).map_err(|e| {
        anyhow::anyhow!(
            "admin.tls-key-file: cannot read a PEM private key from {}: {e}",
            key.display()
        )
    })?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .context("admin TLS: no protocol version available")?
        .with_no_client_auth()
        .with_single_cert(chain, private)
        .with_context(|| {
            format!(
                "admin.tls-key-file: {} does not fit the certificate of admin.tls-cert-file {}",
                key.display(),
                cert.display()
            )
        })?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// An `axum::serve` listener of TLS connections (module docs). Dropping it stops accepting.
#[derive(Debug)]
pub struct TlsListener {
    ready: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    addr: SocketAddr,
    acceptor: JoinHandle<()>,
}

impl TlsListener {
    /// Accepts on `tcp` and runs each connection's handshake with `config`.
    pub fn new(tcp: TcpListener, config: Arc<rustls::ServerConfig>) -> std::io::Result<Self> {
        let addr = tcp.local_addr()?;
        let (tx, ready) = mpsc::channel(READY_QUEUE);
        let acceptor = TlsAcceptor::from(config);
        let acceptor = tokio::spawn(async move {
            loop {
                let (stream, peer) = match tcp.accept().await {
                    Ok(c) => c,
                    Err(e) => {
                        // Out of file descriptors and the like: wait, as axum's own does.
                        tracing::debug!(error = %e, "admin: accept failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                let acceptor = acceptor.clone();
                let tx = tx.clone();
                tokio::spawn(async move {
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                        Ok(Ok(tls)) => {
                            let _ = tx.send((tls, peer)).await;
                        }
                        Ok(Err(e)) => {
                            tracing::debug!(%peer, error = %e, "admin: TLS handshake failed")
                        }
                        Err(_) => tracing::debug!(%peer, "admin: TLS handshake timed out"),
                    }
                });
            }
        });
        Ok(TlsListener {
            ready,
            addr,
            acceptor,
        })
    }
}

impl Drop for TlsListener {
    fn drop(&mut self) {
        self.acceptor.abort();
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(c) => c,
            // The accepting task ended (only when aborted): no connection will come.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.addr)
    }
}
