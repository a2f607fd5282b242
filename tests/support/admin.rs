//! Helpers of the admin endpoint tests: a minimal HTTP/1.1 client over loopback TCP (plain
//! text, so a test sees exactly what went over the wire) and a parser of the Prometheus
//! text format.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// `GET path` over a new connection: (status, body); `Err` when the server cannot be reached.
pub async fn try_get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    try_request(addr, "GET", path, &[], None).await
}

/// `method path` with `headers` and a JSON `body` over a new connection: (status, body).
pub async fn try_request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> std::io::Result<(u16, String)> {
    let (status, _, body) = try_exchange(addr, method, path, headers, body).await?;
    Ok((status, body))
}

/// [`try_request`], also returning the response's head (status line and headers, lower
/// case) as text.
pub async fn try_exchange(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> std::io::Result<(u16, String, String)> {
    try_exchange_typed(
        addr,
        method,
        path,
        headers,
        body.map(|b| ("application/json", b)),
    )
    .await
}

/// [`try_exchange`] with a body of any content type (`(content type, body)`), e.g. an HTML
/// form's `application/x-www-form-urlencoded`.
pub async fn try_exchange_typed(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<(&str, &str)>,
) -> std::io::Result<(u16, String, String)> {
    let bad = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_owned());
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    let mut request =
        format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n");
    for (k, v) in headers {
        request.push_str(&format!("{k}: {v}\r\n"));
    }
    if let Some((content_type, b)) = body {
        request.push_str(&format!(
            "Content-Type: {content_type}\r\nContent-Length: {}\r\n\r\n{b}",
            b.len()
        ));
    } else {
        request.push_str("\r\n");
    }
    s.write_all(request.as_bytes()).await?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).await?;
    let text = String::from_utf8(raw).map_err(|_| bad("response not UTF-8"))?;
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| bad("not an HTTP response"))?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad("no status code"))?;
    let head = head.to_ascii_lowercase();
    let chunked = head.contains("transfer-encoding: chunked");
    let body = if chunked {
        dechunk(body)
    } else {
        body.to_owned()
    };
    Ok((status, head, body))
}

/// [`try_get`]; panics when the server cannot be reached.
pub async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    try_get(addr, path)
        .await
        .unwrap_or_else(|e| panic!("GET {path}: {e}"))
}

/// [`get`], the body parsed as JSON (every admin answer but `/metrics` is JSON).
pub async fn get_json(addr: SocketAddr, path: &str) -> (u16, serde_json::Value) {
    let (status, body) = get(addr, path).await;
    let v = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{path}: {e}: {body}"));
    (status, v)
}

/// `POST path` with JSON `body`; the answer parsed as JSON. Panics when unreachable.
pub async fn post_json(addr: SocketAddr, path: &str, body: &str) -> (u16, serde_json::Value) {
    let (status, text) = try_request(addr, "POST", path, &[], Some(body))
        .await
        .unwrap_or_else(|e| panic!("POST {path}: {e}"));
    let v = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}: {text}"));
    (status, v)
}

fn dechunk(mut rest: &str) -> String {
    let mut out = String::new();
    while let Some((size, after)) = rest.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).expect("chunk size");
        if n == 0 {
            break;
        }
        out.push_str(&after[..n]);
        rest = &after[n + 2..];
    }
    out
}

/// One scrape, parsed: `(name, labels, value)` per sample.
pub struct Scrape(pub Vec<(String, BTreeMap<String, String>, f64)>);

impl Scrape {
    /// Parses the Prometheus text format (label values without `,` or escapes, as settle's).
    pub fn parse(text: &str) -> Self {
        let mut samples = Vec::new();
        for line in text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
        {
            let (series, value) = line.rsplit_once(' ').expect("sample line");
            let (name, labels) = match series.split_once('{') {
                Some((n, l)) => (n, l.trim_end_matches('}')),
                None => (series, ""),
            };
            let labels = labels
                .split(',')
                .filter(|kv| !kv.is_empty())
                .map(|kv| {
                    let (k, v) = kv.split_once('=').expect("label");
                    (k.to_owned(), v.trim_matches('"').to_owned())
                })
                .collect();
            samples.push((name.to_owned(), labels, value.parse().expect("value")));
        }
        Scrape(samples)
    }

    /// Sum of the samples of `name` whose labels include `with`.
    pub fn sum(&self, name: &str, with: &[(&str, &str)]) -> f64 {
        self.0
            .iter()
            .filter(|(n, l, _)| {
                n == name && with.iter().all(|(k, v)| l.get(*k).is_some_and(|x| x == v))
            })
            .map(|(_, _, v)| v)
            .sum()
    }

    /// Whether a sample of `name` with labels `with` exists.
    pub fn has(&self, name: &str, with: &[(&str, &str)]) -> bool {
        self.0.iter().any(|(n, l, _)| {
            n == name && with.iter().all(|(k, v)| l.get(*k).is_some_and(|x| x == v))
        })
    }
}
