//! The operator page's What-if sweep against a real `settle run` on NATS (issue 35, view 6;
//! instance 0 of `nats_actions`' two, alone): after `settle loadgen --nats` traffic, the
//! form posted with the page's CSRF token replays the input stream's last minutes in the
//! process and answers the chart and the table, every setting with ready records
//! (emissions > 0), one recommended or why none is.
//!
//! Uses the server of `SETTLE_TEST_NATS`, else 127.0.0.1:4222; under CI a missing server is
//! a failure.

use crate::admin_support::{try_exchange, try_exchange_typed};
use crate::nats_actions::Instance;
use crate::nats_support::{server, Setup, STEP};
use crate::process_support::nats_loadgen;
use anyhow::{ensure, Context as _, Result};
use settle::transport::nats::Storage;
use std::net::SocketAddr;
use std::time::Duration;

/// The settings the test sweeps (few: the replay is not what is tested here).
const SWEEP: &str = "fixed:1s,30s;adaptive:1s/10s";

/// The value of the first `name="csrf"` hidden input of a page.
fn csrf_of(page: &str) -> Option<String> {
    let key = r#"name="csrf" value=""#;
    let rest = &page[page.find(key)? + key.len()..];
    Some(rest[..rest.find('"')?].to_owned())
}

/// The number in the cell after `<td>{setting}</td>` (its emissions).
fn emissions_of(page: &str, setting: &str) -> Option<u64> {
    let key = format!("<td>{setting}</td><td class=\"num\">");
    let rest = &page[page.find(&key)? + key.len()..];
    rest[..rest.find('<')?].parse().ok()
}

/// `GET /ui/whatif` until it answers with the sweep form.
async fn form_page(addr: SocketAddr) -> Result<String> {
    let deadline = tokio::time::Instant::now() + STEP;
    loop {
        if let Ok((200, _, page)) = try_exchange(addr, "GET", "/ui/whatif", &[], None).await {
            if page.contains("sweep-form") {
                return Ok(page);
            }
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "no What-if form at {addr}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whatif_page_sweeps_the_last_minutes_of_a_nats_run() -> Result<()> {
    let Some(server) = server("whatif_page_sweeps_the_last_minutes_of_a_nats_run") else {
        return Ok(());
    };
    let setup = Setup::new(&server, "wif", Storage::Memory, 2).await?;
    let result = check(&setup).await;
    setup.cleanup().await;
    result
}

async fn check(setup: &Setup) -> Result<()> {
    let dir = tempfile::tempdir()?;
    let run = Instance::start(setup, dir.path(), 0)?;
    let addr = run.addr;
    let result = async {
        let page = form_page(addr).await?;
        let mut loadgen = nats_loadgen(&setup.nats, "4s", "5", "11");
        let status = tokio::task::spawn_blocking(move || loadgen.status()).await??;
        ensure!(status.success(), "settle loadgen: {status}");
        let csrf = csrf_of(&page).context("a CSRF token on the page")?;
        let sweep = SWEEP
            .replace(':', "%3A")
            .replace(',', "%2C")
            .replace(';', "%3B")
            .replace('/', "%2F");
        let form = format!("csrf={csrf}&minutes=5&sweep={sweep}&goal=p99%3C%3D30s");
        let (code, _, body) = try_exchange_typed(
            addr,
            "POST",
            "/ui/whatif",
            &[("Origin", "http://localhost")],
            Some(("application/x-www-form-urlencoded", &form)),
        )
        .await?;
        ensure!(code == 200, "POST /ui/whatif: {code}\n{body}");
        ensure!(
            body.contains(r#"id="sweep""#) && body.contains("<svg"),
            "{body}"
        );
        ensure!(body.contains("nats stream"), "the source named: {body}");
        for setting in ["fixed 1s", "fixed 30s", "adaptive 1s/10s"] {
            let emissions = emissions_of(&body, setting)
                .with_context(|| format!("a row for {setting}: {body}"))?;
            ensure!(emissions > 0, "{setting}: {emissions} emissions\n{body}");
        }
        ensure!(
            body.contains(r#"class="recommended""#) || body.contains("NO setting meets the goal"),
            "a recommendation or why none: {body}"
        );
        Ok(())
    }
    .await;
    // `Instance` is killed when dropped.
    result.map_err(|e: anyhow::Error| e.context(run.tail()))
}
