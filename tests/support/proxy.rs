//! A TCP proxy with an off switch, for the tests that cut the network between settle and its
//! broker: [`Blackout`] forwards every connection to an upstream address until
//! [`Blackout::down`], which closes every open connection and turns new ones away (accepted
//! and closed at once, as a broker that went away) until [`Blackout::up`].
#![allow(dead_code)]

use anyhow::{Context as _, Result};
use std::io;
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// The proxy: listening on [`Blackout::addr`]; forwarding starts with [`Blackout::forward_to`].
pub struct Blackout {
    /// `127.0.0.1:PORT`, where clients connect.
    pub addr: String,
    listener: Option<TcpListener>,
    shared: Arc<Shared>,
}

struct Shared {
    down: AtomicBool,
    stop: AtomicBool,
    /// Both ends of every forwarded connection (shut down by `down`).
    open: Mutex<Vec<TcpStream>>,
}

impl Blackout {
    /// Binds a free loopback port (so its address can be advertised before the upstream
    /// starts).
    pub fn bind() -> Result<Blackout> {
        let listener = TcpListener::bind("127.0.0.1:0").context("bind the proxy")?;
        Ok(Blackout {
            addr: listener.local_addr()?.to_string(),
            listener: Some(listener),
            shared: Arc::new(Shared {
                down: AtomicBool::new(false),
                stop: AtomicBool::new(false),
                open: Mutex::new(Vec::new()),
            }),
        })
    }

    /// Starts forwarding every connection to `upstream` (`host:port`), on threads of its own.
    pub fn forward_to(&mut self, upstream: &str) -> Result<()> {
        let listener = self.listener.take().context("forwarding already")?;
        let shared = Arc::clone(&self.shared);
        let upstream = upstream.to_owned();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                if shared.stop.load(Ordering::Acquire) {
                    return;
                }
                let Ok(client) = client else { continue };
                if shared.down.load(Ordering::Acquire) {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                }
                let Ok(server) = TcpStream::connect(&upstream) else {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                if let Err(e) = pipe(&shared, client, server) {
                    eprintln!("proxy: {e}");
                }
            }
        });
        Ok(())
    }

    /// Cuts the network: every open connection closed, new ones turned away.
    pub fn down(&self) {
        self.shared.down.store(true, Ordering::Release);
        for s in self.shared.open.lock().unwrap().drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    /// Lets connections through again.
    pub fn up(&self) {
        self.shared.down.store(false, Ordering::Release);
    }
}

/// Copies both directions of one connection on two threads.
fn pipe(shared: &Shared, client: TcpStream, server: TcpStream) -> io::Result<()> {
    let (c2, s2) = (client.try_clone()?, server.try_clone()?);
    {
        let mut open = shared.open.lock().unwrap();
        open.retain(|s| s.peer_addr().is_ok());
        open.push(client.try_clone()?);
        open.push(server.try_clone()?);
    }
    for (mut from, mut to) in [(client, s2), (server, c2)] {
        std::thread::spawn(move || {
            let _ = io::copy(&mut from, &mut to);
            let _ = to.shutdown(Shutdown::Both);
            let _ = from.shutdown(Shutdown::Both);
        });
    }
    Ok(())
}

impl Drop for Blackout {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        self.down();
        let _ = TcpStream::connect(&self.addr); // wakes the accept loop
    }
}
