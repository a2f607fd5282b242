//! The operator page (issue 35) in a real browser: headless Chromium driven through
//! chromedriver (WebDriver, `fantoccini`) against a `settle run` child process on NATS with
//! an admin token, fed a scaled-down mix of the demo's scenarios (a CI burst, split uploads
//! with a missing part, a trickle that emits within seconds, many small tenants, two bad
//! records).
//!
//! * A wrong token is refused: the login page says so.
//! * Logged in, Pending filtered by tenant lists the tenant's sessions only; the session
//!   page says why it waits; flush asks for a reason, then for a confirmation, answers
//!   `flushed`; the ready record appears on the output subject with `trigger = manual`; the
//!   Audit page lists the flush with the credential's name and the reason.
//! * An override set on the tenant page is listed there and on the Tenants page.
//! * A split session names its missing part; trickle-co, demoted by its fourth ready record
//!   (`tiers.limit` 3), shows the tier change on its page and the Overview counts it.
//! * Every view is drawn, the Overview's charts while live traffic flows; with
//!   `SETTLE_UI_SCREENSHOTS=1` each one is written, whole, to `docs/ui/<view>.png` (laptop
//!   width, and Overview, Pending and Session at a phone's width).
//!
//! `ui_pending_page_with_10k_rounds` (ignored: run it by name) measures the page weight and
//! the time to first render of Pending with 10 000 open rounds (BENCHMARKS.md).
//!
//! Needs the NATS server of `SETTLE_TEST_NATS` (else 127.0.0.1:4222) and `chromium` with
//! `chromium-driver` (`SETTLE_TEST_CHROMIUM`, `SETTLE_TEST_CHROMEDRIVER`, else
//! /usr/bin/chromium and /usr/bin/chromedriver; scripts/setup.sh installs them); under CI a
//! missing one is a failure, elsewhere the test says loudly that it did not run.

use crate::admin_support::try_get;
use crate::nats_support::{server, Setup};
use crate::process_support::{free_port, start_run_logged};
use anyhow::{bail, ensure, Context as _, Result};
use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::{json, Value};
use settle::engine::Trigger;
use settle::transport::nats::Storage;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const TOKEN: &str = "alice-ui-0123456789abcdef0123";
/// Bound on one browser step (a hang guard, not a speed assertion).
const PATIENCE: Duration = Duration::from_secs(60);

/// chromium and chromedriver, or `None` (said loudly) when absent outside CI.
fn browser_bins(test: &str) -> Option<(PathBuf, PathBuf)> {
    let pick = |var: &str, default: &str| {
        std::env::var_os(var)
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(default))
    };
    let chromium = pick("SETTLE_TEST_CHROMIUM", "/usr/bin/chromium");
    let driver = pick("SETTLE_TEST_CHROMEDRIVER", "/usr/bin/chromedriver");
    if chromium.exists() && driver.exists() {
        return Some((chromium, driver));
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "CI is set but {} or {} is missing: {test} needs chromium and chromium-driver (scripts/setup.sh)",
        chromium.display(),
        driver.display()
    );
    println!(
        "no chromium/chromedriver: {test} did NOT run (apt-get install chromium chromium-driver)"
    );
    None
}

/// A chromedriver process and a headless Chromium session on it; both end on drop.
struct Browser {
    driver: Child,
    client: Client,
}

impl Browser {
    /// Starts chromedriver on a free port and a headless Chromium `width`×`height`.
    async fn start(chromium: &Path, driver: &Path, width: u32, height: u32) -> Result<Browser> {
        let port = free_port()?;
        let mut child = Command::new(driver)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("spawn {}", driver.display()))?;
        let caps: serde_json::Map<String, Value> = serde_json::from_value(json!({
            "goog:chromeOptions": {
                "binary": chromium,
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                         format!("--window-size={width},{height}"), "--lang=en-US"],
            }
        }))?;
        let url = format!("http://127.0.0.1:{port}");
        let started = Instant::now();
        let client = loop {
            let connector = hyper_util::client::legacy::connect::HttpConnector::new();
            match ClientBuilder::new(connector)
                .capabilities(caps.clone())
                .connect(&url)
                .await
            {
                Ok(c) => break c,
                Err(e) if started.elapsed() < PATIENCE => {
                    if let Ok(Some(status)) = child.try_wait() {
                        bail!("chromedriver exited ({status}): {e}");
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => {
                    let _ = child.kill();
                    bail!("no WebDriver session on {url} within {PATIENCE:?}: {e}");
                }
            }
        };
        Ok(Browser {
            driver: child,
            client,
        })
    }

    async fn close(mut self) {
        let _ = self.client.clone().close().await;
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

/// Waits until the text of the first element `css` matches contains `needle`: that text.
async fn wait_text(c: &Client, css: &str, needle: &str) -> Result<String> {
    wait_text_where(c, css, &format!("contained {needle:?}"), |t| {
        t.contains(needle)
    })
    .await
}

/// Waits until the text of the element `css` satisfies `ok` (`what` says what was awaited,
/// for the error); returns the text. For a page that replaces one that already matched a
/// plain needle (a filtered table: wait for what the old one had and the new one has not).
async fn wait_text_where(
    c: &Client,
    css: &str,
    what: &str,
    ok: impl Fn(&str) -> bool,
) -> Result<String> {
    let started = Instant::now();
    loop {
        let text = match c.find(Locator::Css(css)).await {
            Ok(e) => e.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        };
        if ok(&text) {
            return Ok(text);
        }
        if started.elapsed() > PATIENCE {
            let url = c
                .current_url()
                .await
                .map(|u| u.to_string())
                .unwrap_or_default();
            bail!("{css} of {url} never {what}; it says: {text}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until the Overview's charts have drawn `n` readings (one per poll).
async fn wait_points(c: &Client, n: u64) -> Result<()> {
    let started = Instant::now();
    loop {
        let points = c
            .execute("return Number(document.body.dataset.points || 0)", vec![])
            .await?;
        if points.as_u64().unwrap_or(0) >= n {
            return Ok(());
        }
        ensure!(
            started.elapsed() < PATIENCE,
            "the charts drew {points} readings"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Writes a screenshot of the page to `docs/ui/<view>.png` when `SETTLE_UI_SCREENSHOTS=1`.
async fn shot(c: &Client, view: &str) -> Result<()> {
    if std::env::var("SETTLE_UI_SCREENSHOTS").as_deref() != Ok("1") {
        return Ok(());
    }
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/ui");
    std::fs::create_dir_all(&dir)?;
    // The whole page: the window as tall as the document plus the window's own frame (at
    // most 3000 px), then back.
    let (width, height) = c.get_window_size().await?;
    let tall = c
        .execute(
            "return document.documentElement.scrollHeight + window.outerHeight - window.innerHeight",
            vec![],
        )
        .await?
        .as_u64()
        .unwrap_or(0)
        .min(3000)
        .max(height);
    c.set_window_size(width as u32, tall as u32).await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let png = c.screenshot().await;
    c.set_window_size(width as u32, height as u32).await?;
    let png = png?;
    std::fs::write(dir.join(format!("{view}.png")), png)?;
    Ok(())
}

/// The uploads of the test: (key, JSON), a scaled-down mix of the demo's scenarios.
fn uploads() -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut push = |tenant: &str, session: &str, id: String, extra: &str| {
        out.push((
            format!("{tenant}/{session}"),
            format!(r#"{{"tenant":"{tenant}","session":"{session}","event_id":"{id}"{extra}}}"#),
        ));
    };
    // burst: CI machines of one build.
    for (build, machines) in [("build-4711", 40), ("build-4712", 25), ("build-4713", 12)] {
        for m in 0..machines {
            push("acme", build, format!("m{m}"), "");
        }
    }
    // split: two requests per upload; run-3 misses its first part, run-5 its second.
    for s in 1..=6 {
        for i in 1..=2 {
            if (s == 3 && i == 1) || (s == 5 && i == 2) {
                continue;
            }
            let extra = format!(r#","part":{{"index":{i},"count":2}}"#);
            push("split-co", &format!("run-{s}"), format!("p{i}"), &extra);
        }
    }
    // trickle: a short delay (3 s) for this tenant: ready records within seconds.
    for s in 1..=4 {
        for i in 0..3 {
            push("trickle-co", &format!("nightly-{s}"), format!("u{i}"), "");
        }
    }
    // tenants: small bursts over many tenants.
    for t in 1..=12 {
        for s in 0..2 {
            for i in 0..(3 + t % 5) {
                push(
                    &format!("tenant-{t:03}"),
                    &format!("s{s}"),
                    format!("u{i}"),
                    "",
                );
            }
        }
    }
    out
}

fn config(setup: &Setup, dir: &Path, port: u16, delay: &str) -> Result<PathBuf> {
    let text = format!(
        r#"transport = "nats"
[debounce]
policy = "fixed"
delay = "{delay}"
[debounce.tenants.trickle-co]
policy = "fixed"
delay = "3s"
[debounce.tenants.live-co]
policy = "fixed"
delay = "1s"
[store]
data-dir = "{data}"
[runtime]
shutdown-deadline = "10s"
idle-tick = "50ms"
[admin]
listen = "127.0.0.1:{port}"
{sections}"#,
        data = dir.join("data").display(),
        sections = setup.run_config_sections(0, 1)
    );
    let path = dir.join("settle.toml");
    std::fs::write(&path, text)?;
    Ok(path)
}

/// Waits until the ready records before the flush are out: split-co's four complete
/// uploads (at once) and trickle-co's four sessions (3 s delay), each tenant's fourth within
/// the period crossing `tiers.limit` (3) and demoting it, so they are on `normal` and
/// `limited`; nothing else. Answers how many are on `normal`.
async fn early_emitted(setup: &Setup) -> Result<usize> {
    let started = Instant::now();
    loop {
        let normal = setup.emitted("normal", 0).await?;
        let limited = setup.emitted("limited", 0).await?;
        let of = |tenant: &str| {
            normal
                .iter()
                .chain(&limited)
                .filter(|e| e.key.tenant() == tenant)
                .count()
        };
        let (split, trickle) = (of("split-co"), of("trickle-co"));
        ensure!(
            normal.len() + limited.len() == split + trickle,
            "only split-co and trickle-co emit before the flush: {normal:?} {limited:?}"
        );
        if split == 4 && trickle == 4 {
            return Ok(normal.len());
        }
        ensure!(
            started.elapsed() < Duration::from_secs(120),
            "split-co emitted {split} of 4, trickle-co {trickle} of 4"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// A `settle run` child with the admin token `TOKEN`; killed on drop.
struct Run {
    child: Child,
    addr: SocketAddr,
    log: PathBuf,
}

impl Run {
    fn start(setup: &Setup, dir: &Path, delay: &str) -> Result<Run> {
        let port = free_port()?;
        let config = config(setup, dir, port, delay)?;
        let log = dir.join("run.log");
        let listen = format!("127.0.0.1:{port}");
        let child = start_run_logged(
            &config,
            &[
                ("SETTLE_ADMIN__LISTEN", listen.as_str()),
                ("SETTLE_ADMIN_TOKENS", &format!("alice:{TOKEN}")),
                // More than 3 ready records in 10 min: demoted (trickle-co's 4 sessions,
                // the Overview's live traffic), so the pages show tier changes.
                ("SETTLE_TIERS__LIMIT", "3"),
                ("SETTLE_TIERS__PERIOD", "10m"),
            ],
            &log,
        )?;
        Ok(Run {
            child,
            addr: listen.parse()?,
            log,
        })
    }

    fn tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(8)..].join("\n")
    }

    /// Waits until the partitions have applied `records` input records.
    async fn wait_records(&self, records: u64) -> Result<()> {
        let started = Instant::now();
        loop {
            let applied = match try_get(self.addr, "/v1/partitions").await {
                Ok((200, body)) => serde_json::from_str::<Value>(&body).ok().and_then(|v| {
                    v["partitions"]
                        .as_array()
                        .map(|a| a.iter().filter_map(|p| p["records"].as_u64()).sum::<u64>())
                }),
                _ => None,
            };
            if applied == Some(records) {
                return Ok(());
            }
            ensure!(
                started.elapsed() < Duration::from_secs(120),
                "records applied {applied:?}, want {records}; log:\n{}",
                self.tail()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ui_browser_login_find_flush_audit_override() -> Result<()> {
    const TEST: &str = "ui_browser_login_find_flush_audit_override";
    let Some(nats) = server(TEST) else {
        return Ok(());
    };
    let Some((chromium, driver)) = browser_bins(TEST) else {
        return Ok(());
    };
    let setup = Setup::new(&nats, "ui", Storage::Memory, 2).await?;
    let dir = tempfile::tempdir()?;
    let list = uploads();
    for (key, json) in &list {
        setup.publish(key, json.as_bytes(), None).await?;
    }
    // Two bad records: dead letters by reason on the Overview.
    setup.publish_to(0, "acme/bad", b"{not json").await?;
    setup
        .publish_to(1, "acme/bad2", br#"{"tenant":"acme"}"#)
        .await?;
    let run = Run::start(&setup, dir.path(), "1h")?;
    run.wait_records(list.len() as u64 + 2).await?;
    // Complete split uploads and the trickle's sessions emit before the flush; the fourth
    // ready record of a tenant within the period crosses tiers.limit (3): it is demoted.
    let normal_before = early_emitted(&setup).await?;

    let browser = Browser::start(&chromium, &driver, 1280, 1000).await?;
    let c = &browser.client;
    let base = format!("http://{}", run.addr);
    let result = async {
        // A wrong token is refused, in the page.
        c.goto(&format!("{base}/ui/login")).await?;
        shot(c, "login").await?;
        c.find(Locator::Css("#token"))
            .await?
            .send_keys("wrong-token-0123456789abcdef")
            .await?;
        c.find(Locator::Css("form.login button"))
            .await?
            .click()
            .await?;
        wait_text(c, "main", "The token matches no configured credential").await?;
        // Log in.
        c.find(Locator::Css("#token"))
            .await?
            .send_keys(TOKEN)
            .await?;
        c.find(Locator::Css("form.login button"))
            .await?
            .click()
            .await?;
        wait_text(c, "header .who", "alice (operator)").await?;
        ensure!(
            !c.source().await?.contains(TOKEN),
            "the page shows the token"
        );
        // Pending, filtered by tenant.
        c.goto(&format!("{base}/ui/pending")).await?;
        wait_text(c, "#pending", "tenant-001/s0").await?;
        shot(c, "pending").await?;
        c.find(Locator::Css("input[name=tenant]"))
            .await?
            .send_keys("acme")
            .await?;
        c.find(Locator::Css("form.filters button[type=submit]"))
            .await?
            .click()
            .await?;
        // The unfiltered table had acme's rounds too: wait for the filtered page.
        let table = wait_text_where(c, "#pending", "showed acme alone", |t| {
            t.contains("acme/build-4711") && !t.contains("tenant-001")
        })
        .await?;
        ensure!(
            !table.contains("tenant-001") && table.contains("acme/build-4712"),
            "filtered by tenant acme: {table}"
        );
        // The session: why it waits, then flush with a reason and a confirmation.
        c.find(Locator::LinkText("acme/build-4711"))
            .await?
            .click()
            .await?;
        wait_text(c, "#why", "debounce").await?;
        wait_text(c, "main", "40").await?;
        shot(c, "session").await?;
        c.find(Locator::Css("#reason-flush"))
            .await?
            .send_keys("INC-42: results never arrived")
            .await?;
        c.find(Locator::Css(
            "form.action:has(#reason-flush) button[type=submit]",
        ))
        .await?
        .click()
        .await?;
        wait_text(c, "main", "You are about to flush").await?;
        shot(c, "confirm").await?;
        c.find(Locator::Css("#confirm")).await?.click().await?;
        wait_text(c, "#result", "flushed").await?;
        // The ready record: trigger manual, on the output subject.
        let out = setup.emitted("normal", normal_before + 1).await?;
        let flushed: Vec<_> = out
            .iter()
            .filter(|e| e.key.as_str() == "acme/build-4711")
            .collect();
        ensure!(
            flushed.len() == 1 && flushed[0].trigger == Trigger::Manual && flushed[0].uploads == 40,
            "one manual ready record of acme/build-4711 with its 40 uploads: {flushed:?}"
        );
        // The audit entry.
        c.goto(&format!("{base}/ui/audit")).await?;
        let audit = wait_text(c, "#audit", "INC-42: results never arrived").await?;
        ensure!(
            audit.contains("alice") && audit.contains("flush"),
            "{audit}"
        );
        // A split upload: part 2 of run-3 came, part 1 did not.
        c.goto(&format!("{base}/ui/sessions/split-co/run-3"))
            .await?;
        let parts = wait_text(c, "#parts", "missing").await?;
        ensure!(
            parts.contains("received [2]") && parts.contains("missing [1]"),
            "{parts}"
        );
        shot(c, "session-split").await?;
        // The demoted tenant: its tier change on its page.
        c.goto(&format!("{base}/ui/tenants/trickle-co")).await?;
        let history = wait_text(c, "#tier-history", "rate_exceeded").await?;
        ensure!(
            history.contains("normal") && history.contains("limited"),
            "{history}"
        );
        wait_text(c, "#tier", "limited").await?;
        shot(c, "tenant-demoted").await?;
        // An override on the tenant page, listed there and on Tenants.
        c.goto(&format!("{base}/ui/tenants/acme")).await?;
        wait_text(c, "#override", "No override").await?;
        c.find(Locator::Css("#policy"))
            .await?
            .select_by_value("fixed")
            .await?;
        c.find(Locator::Css("#delay"))
            .await?
            .send_keys("2m")
            .await?;
        c.find(Locator::Css("#expires_in"))
            .await?
            .send_keys("2h")
            .await?;
        c.find(Locator::Css("#reason-set"))
            .await?
            .send_keys("INC-43: calm acme until the fix")
            .await?;
        c.find(Locator::Css("form.action button[type=submit]"))
            .await?
            .click()
            .await?;
        wait_text(c, "main", "override set: version 1").await?;
        let o = wait_text(c, "#override", "fixed").await?;
        ensure!(o.contains("INC-43") && o.contains("alice"), "{o}");
        wait_text(c, "#rule", "override").await?;
        shot(c, "tenant").await?;
        c.goto(&format!("{base}/ui/tenants")).await?;
        let tenants = wait_text(c, "main table", "acme").await?;
        ensure!(
            tenants.contains("v1") && tenants.contains("trickle-co"),
            "the override and the demoted tenant listed: {tenants}"
        );
        shot(c, "tenants").await?;
        // The other views draw with their data.
        c.goto(&format!("{base}/ui/partitions")).await?;
        wait_text(c, "main table", "live").await?;
        shot(c, "partitions").await?;
        c.goto(&format!("{base}/ui/whatif")).await?;
        wait_text(c, "main", "measured point").await?;
        shot(c, "whatif").await?;
        c.goto(&format!("{base}/ui")).await?;
        wait_text(c, "#dead-letters", "invalid_json").await?;
        wait_text(c, "#time-to-ready", "normal").await?;
        // Live traffic while the charts draw (one reading every 2 s): live-co's jobs, 8
        // uploads each over a second, ready 1 s after their last upload.
        let started = Instant::now();
        let mut sent = 0u32;
        loop {
            for _ in 0..2 {
                let job = sent / 8;
                let body =
                    format!(r#"{{"tenant":"live-co","session":"job-{job}","event_id":"u{sent}"}}"#);
                setup
                    .publish(&format!("live-co/job-{job}"), body.as_bytes(), None)
                    .await?;
                sent += 1;
            }
            let points = c
                .execute("return Number(document.body.dataset.points || 0)", vec![])
                .await?;
            if points.as_u64().unwrap_or(0) >= 10 {
                break;
            }
            ensure!(
                started.elapsed() < PATIENCE,
                "the charts drew {points} readings"
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        wait_text(c, "#tier-changes", "rate_exceeded").await?;
        shot(c, "overview").await?;
        // The audit again: the flush and the override.
        c.goto(&format!("{base}/ui/audit")).await?;
        wait_text(c, "#audit", "INC-43").await?;
        shot(c, "audit").await?;
        // A phone's width.
        c.set_window_size(390, 844).await?;
        c.goto(&format!("{base}/ui/pending?tenant=split-co"))
            .await?;
        wait_text(c, "#pending", "split-co/run-3").await?;
        shot(c, "pending-phone").await?;
        c.goto(&format!("{base}/ui/sessions/split-co/run-3"))
            .await?;
        wait_text(c, "#parts", "missing").await?;
        shot(c, "session-phone").await?;
        c.goto(&format!("{base}/ui")).await?;
        wait_text(c, "#dead-letters", "invalid_json").await?;
        wait_points(c, 2).await?;
        shot(c, "overview-phone").await?;
        Ok::<_, anyhow::Error>(())
    }
    .await;
    browser.close().await;
    setup.cleanup().await;
    result.with_context(|| format!("settle run log:\n{}", run.tail()))
}

/// Page weight and time to first render of Pending with 10 000 open rounds (BENCHMARKS.md):
/// `cargo test --test e2e ui_pending_page_with_10k_rounds -- --ignored --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: run it by name"]
async fn ui_pending_page_with_10k_rounds() -> Result<()> {
    const TEST: &str = "ui_pending_page_with_10k_rounds";
    const ROUNDS: usize = 10_000;
    let Some(nats) = server(TEST) else {
        return Ok(());
    };
    let Some((chromium, driver)) = browser_bins(TEST) else {
        return Ok(());
    };
    let setup = Setup::new(&nats, "uibench", Storage::Memory, 4).await?;
    let dir = tempfile::tempdir()?;
    let publish = Instant::now();
    for s in 0..ROUNDS {
        let tenant = format!("tenant-{:03}", s % 200);
        let key = format!("{tenant}/s{s}");
        let body = format!(r#"{{"tenant":"{tenant}","session":"s{s}","event_id":"u0"}}"#);
        setup.publish(&key, body.as_bytes(), None).await?;
    }
    println!("published {ROUNDS} uploads in {:?}", publish.elapsed());
    let run = Run::start(&setup, dir.path(), "1h")?;
    run.wait_records(ROUNDS as u64).await?;
    let base = format!("http://{}", run.addr);
    let browser = Browser::start(&chromium, &driver, 1280, 1000).await?;
    let c = &browser.client;
    let timing = r#"
        const n = performance.getEntriesByType('navigation')[0];
        const fcp = performance.getEntriesByName('first-contentful-paint')[0];
        const res = performance.getEntriesByType('resource');
        return {
            ttfb_ms: n.responseStart - n.startTime,
            response_end_ms: n.responseEnd - n.startTime,
            dom_content_loaded_ms: n.domContentLoadedEventEnd - n.startTime,
            load_ms: n.loadEventEnd - n.startTime,
            first_contentful_paint_ms: fcp ? fcp.startTime : null,
            html_bytes: n.decodedBodySize,
            html_transfer_bytes: n.transferSize,
            assets_bytes: res.reduce((a, r) => a + r.decodedBodySize, 0),
            assets_transfer_bytes: res.reduce((a, r) => a + r.transferSize, 0),
            rows: document.querySelectorAll('#pending tbody tr').length,
        };"#;
    for (label, path) in [
        ("first visit, 100 rows", "/ui/pending"),
        ("cached assets, 100 rows", "/ui/pending"),
        ("cached assets, 1000 rows", "/ui/pending?limit=1000"),
        (
            "cached assets, tenant filter",
            "/ui/pending?tenant=tenant-007",
        ),
        ("overview", "/ui"),
    ] {
        c.goto(&format!("{base}{path}")).await?;
        // loadEventEnd is set once the load event handler returned.
        let started = Instant::now();
        let v = loop {
            let v = c.execute(timing, vec![]).await?;
            if v["load_ms"].as_f64().unwrap_or(0.0) > 0.0 {
                break v;
            }
            ensure!(started.elapsed() < PATIENCE, "{path} never loaded");
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        println!("{label} ({path}): {v}");
    }
    let (_, summary) = crate::admin_support::get_json(run.addr, "/v1/pending/summary").await;
    println!("pending summary: rounds {}", summary["rounds"]);
    ensure!(
        summary["rounds"].as_u64() == Some(ROUNDS as u64),
        "{summary}"
    );
    browser.close().await;
    setup.cleanup().await;
    Ok(())
}
