//! The views of the operator page (issue 35, in the order): Overview, Pending,
//! Session, Tenants (list and one tenant), Partitions, What-if, Audit. Each one asks the
//! `/v1` handler of the same data in process ([`super::answer_json`]) and renders its
//! answer, so a bad parameter gets the API's 400 message, in the page, with status 400.
//! What-if also draws the sweep form and a sweep's result (run by [`super::forms::whatif`]
//! through the server's [`WhatIf`]).

use super::super::whatif::{
    WhatIf, WhatIfResult, WhatIfRow, MAX_MINUTES, MAX_SPEC_BYTES, MAX_UPLOADS,
};
use super::super::{actions, pending, views, AdminState};
use super::stats::{self, Stats};
use super::{answer_json, layout, layout_with, page_error, script_json, time, Frame, POLL_MS};
use crate::codec::action::SessionFilter;
use crate::runtime::tier_events::{self, RECENT_CHANGES};
use crate::tiers::TierChange;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use maud::{html, Markup, PreEscaped};
use serde_json::{json, Value};
use std::collections::BTreeMap;

/// Percent-encodes `text` for a URL (everything but unreserved characters; `/` kept when
/// `keep_slash`, for a session in a path).
pub(super) fn encode(text: &str, keep_slash: bool) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) || (keep_slash && b == b'/') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The page of one session.
pub(super) fn session_href(tenant: &str, session: &str) -> String {
    format!(
        "/ui/sessions/{}/{}",
        encode(tenant, false),
        encode(session, true)
    )
}

/// The page of one tenant.
pub(super) fn tenant_href(tenant: &str) -> String {
    format!("/ui/tenants/{}", encode(tenant, false))
}

fn text(v: &Value) -> String {
    match v {
        Value::Null => "—".to_owned(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn seconds(s: Option<f64>) -> String {
    match s {
        None => "—".to_owned(),
        Some(s) if s < 1.0 => format!("{:.0} ms", s * 1000.0),
        Some(s) if s < 120.0 => format!("{s:.1} s"),
        Some(s) => format!("{:.1} min", s / 60.0),
    }
}

fn ms(v: &Value) -> String {
    v.as_i64()
        .map_or_else(|| "—".to_owned(), |ms| seconds(Some(ms as f64 / 1000.0)))
}

/// A due time with a live countdown (`ui.js`).
fn countdown(rfc3339: Option<&str>) -> Markup {
    match rfc3339 {
        Some(t) => html! { (time(Some(t))) " " span.countdown data-due=(t) {} },
        None => html! { "—" },
    }
}

/// What a `waiting` value means, for an operator.
fn waiting_text(w: &str) -> &'static str {
    match w {
        "debounce" => {
            "uploads keep arriving: each one moves the due time by the delay (max-wait bounds it)"
        }
        "max_wait" => "the max-wait bound comes before the debounce due time",
        "overdue" => "due already: released at runtime.catch-up-rate after a restart or backlog",
        _ => "",
    }
}

/// The pending summary's table of due buckets.
fn buckets(by_due: &Value) -> Markup {
    const NAMES: [(&str, &str); 5] = [
        ("overdue", "overdue"),
        ("lt_10s", "< 10 s"),
        ("lt_1m", "< 1 min"),
        ("lt_10m", "< 10 min"),
        ("later", "later"),
    ];
    html! {
        table.compact {
            caption { "Timer backlog: open rounds by due time" }
            thead { tr { @for (_, label) in NAMES { th scope="col" { (label) } } } }
            tbody { tr { @for (key, _) in NAMES { td.num { (text(&by_due[key])) } } } }
        }
    }
}

fn live_tables(st: &Stats, summary: &Value) -> Markup {
    html! {
        section #live hx-get="/ui/overview/live" hx-trigger="every 5s" hx-swap="outerHTML" {
            div.cards {
                div.card { span.label { "Uploads applied" } span.value { (st.uploads) } }
                div.card { span.label { "Ready records" } span.value { (st.emissions) } }
                div.card { span.label { "Coalescing" } span.value { (st.coalescing().map_or("—".into(), |c| format!("{c:.2}"))) } span.label { "uploads per ready record" } }
                div.card { span.label { "Open rounds" } span.value { (text(&summary["rounds"])) } span.label { (text(&summary["tenants"])) " tenants, " (text(&summary["owed"])) " owed" } }
            }
            (buckets(&summary["by_due"]))
            div.grid {
                table #time-to-ready {
                    caption { "Time to ready by tier (since start)" }
                    thead { tr { th scope="col" { "tier" } th scope="col" { "ready records" } th scope="col" { "p50" } th scope="col" { "p99" } } }
                    tbody {
                        @for (tier, l) in &st.time_to_ready {
                            tr { td { (tier) } td.num { (l.count) } td.num { (seconds(l.p50_s)) } td.num { (seconds(l.p99_s)) } }
                        }
                        @if st.time_to_ready.is_empty() { tr { td colspan="4" { "no ready record yet" } } }
                    }
                }
                table {
                    caption { "Lag by partition" }
                    thead { tr { th scope="col" { "partition" } th scope="col" { "state" } th scope="col" { "lag" } th scope="col" { "open rounds" } th scope="col" { "owed" } } }
                    tbody {
                        @for p in &st.partitions {
                            tr { td.num { (p.partition) } td { (p.state) } td.num { (p.lag.map_or("—".into(), |l| l.to_string())) } td.num { (p.pending) } td.num { (p.outbox) } }
                        }
                        @if st.partitions.is_empty() { tr { td colspan="5" { "no partition owned here" } } }
                    }
                }
                table #dead-letters {
                    caption { "Dead letters by reason" }
                    thead { tr { th scope="col" { "reason" } th scope="col" { "records" } } }
                    tbody {
                        @for (reason, n) in &st.dead_letters { tr { td { (reason) } td.num { (n) } } }
                        @if st.dead_letters.is_empty() { tr { td colspan="2" { "none" } } }
                    }
                }
                table #tier-changes {
                    caption { "Tier changes" }
                    thead { tr { th scope="col" { "reason" } th scope="col" { "changes" } } }
                    tbody {
                        @for (reason, n) in &st.tier_changes { tr { td { (reason) } td.num { (n) } } }
                        @if st.tier_changes.is_empty() { tr { td colspan="2" { "none" } } }
                    }
                }
            }
        }
    }
}

async fn summary(s: &AdminState) -> Value {
    answer_json(pending::summary(State(s.clone()), Ok(Query(BTreeMap::new()))).await)
        .await
        .1
}

/// `GET /ui`: the Overview.
pub(super) async fn overview(State(s): State<AdminState>, headers: HeaderMap) -> Response {
    let st = stats::read(&s);
    let sum = summary(&s).await;
    let frame = Frame::of(&s, &headers);
    let body = html! {
        p.hint { "Instance " code { (s.actions.instance) } ". Counters since the process started; the charts keep what this page has seen (polled every " (POLL_MS / 1000) " s)." }
        div.grid.charts {
            figure { figcaption { "Uploads in and ready records out, per second" } div #chart-rates data-poll-ms=(POLL_MS) {} }
            figure { figcaption { "Open rounds and coalescing (uploads per ready record)" } div #chart-pending {} }
        }
        script #stats-init type="application/json" { (script_json(&serde_json::to_value(&st).unwrap_or_default())) }
        (live_tables(&st, &sum))
    };
    layout_with("Overview", "Overview", &frame, true, body).into_response()
}

/// `GET /ui/overview/live`: the Overview's tables alone (htmx refresh).
pub(super) async fn overview_live(State(s): State<AdminState>) -> Response {
    let st = stats::read(&s);
    let sum = summary(&s).await;
    live_tables(&st, &sum).into_response()
}

fn option(value: &str, label: &str, selected: &str) -> Markup {
    html! { option value=(value) selected[value == selected] { (label) } }
}

/// `GET /ui/pending`: `/v1/pending` with its filters.
pub(super) async fn pending(
    State(s): State<AdminState>,
    headers: HeaderMap,
    Query(q): Query<BTreeMap<String, String>>,
) -> Response {
    // Empty form fields mean "no filter".
    let q: BTreeMap<String, String> = q
        .into_iter()
        .filter(|(_, v)| !v.trim().is_empty())
        .map(|(k, v)| (k, v.trim().to_owned()))
        .collect();
    let (code, page) =
        answer_json(pending::list(State(s.clone()), Ok(Query(q.clone()))).await).await;
    let frame = Frame::of(&s, &headers);
    let get = |k: &str| q.get(k).map_or("", String::as_str);
    let tiers: Vec<String> = s
        .router
        .tiers()
        .tiers()
        .map(|(n, _)| n.to_owned())
        .collect();
    let next = page["next_cursor"].as_str().map(|c| {
        let mut q2 = q.clone();
        q2.insert("cursor".into(), c.to_owned());
        let query: Vec<String> = q2
            .iter()
            .map(|(k, v)| format!("{}={}", encode(k, false), encode(v, false)))
            .collect();
        format!("/ui/pending?{}", query.join("&"))
    });
    let rounds = page["rounds"].as_array().cloned().unwrap_or_default();
    let body = html! {
        form.filters method="get" action="/ui/pending" role="search" {
            label { "Tenant" input name="tenant" value=(get("tenant")) placeholder="acme"; }
            label { "Partitions" input name="partition" value=(get("partition")) placeholder="0,3" inputmode="numeric"; }
            label { "Policy" select name="policy" {
                (option("", "any", get("policy")))
                @for p in ["fixed", "leading-trailing", "adaptive"] { (option(p, p, get("policy"))) }
            } }
            label { "Tier" select name="tier" {
                (option("", "any", get("tier")))
                @for t in &tiers { (option(t, t, get("tier"))) }
            } }
            label { "Due after" input name="due_after" value=(get("due_after")) placeholder="RFC 3339 or epoch ms"; }
            label { "Due before" input name="due_before" value=(get("due_before")) placeholder="RFC 3339 or epoch ms"; }
            label { "Min uploads" input name="min_uploads" value=(get("min_uploads")) inputmode="numeric"; }
            label { "Per page" input name="limit" value=(get("limit")) placeholder="100" inputmode="numeric"; }
            div.buttons { button type="submit" { "Filter" } a href="/ui/pending" { "Clear" } }
        }
        @if code != StatusCode::OK {
            p.error role="alert" { (text(&page["error"])) }
        } @else {
            p.hint {
                "Partitions answering here: " (text(&page["partitions"]))
                @if page["restoring"].as_array().is_some_and(|a| !a.is_empty()) { "; restoring (not listed yet): " (text(&page["restoring"])) }
                @if page["unavailable"].as_array().is_some_and(|a| !a.is_empty()) { "; could not answer: " (text(&page["unavailable"])) }
                ". Rounds in due-time order per partition; a column heading sorts this page."
            }
            div.scroll {
                table.sortable.stack #pending {
                    thead { tr {
                        th scope="col" { button type="button" data-sort="text" { "session" } }
                        th scope="col" { button type="button" data-sort="num" { "partition" } }
                        th scope="col" { button type="button" data-sort="text" { "policy" } }
                        th scope="col" { button type="button" data-sort="text" { "tier" } }
                        th scope="col" { button type="button" data-sort="num" { "uploads" } }
                        th scope="col" { button type="button" data-sort="text" { "last upload" } }
                        th scope="col" { button type="button" data-sort="text" { "due" } }
                        th scope="col" { button type="button" data-sort="text" { "waiting" } }
                    } }
                    tbody {
                        @for r in &rounds {
                            @let (t, sess) = (r["tenant"].as_str().unwrap_or(""), r["session"].as_str().unwrap_or(""));
                            tr {
                                td.key data-label="session" { a href=(session_href(t, sess)) { (t) "/" (sess) } }
                                td.num data-label="partition" { (text(&r["partition"])) }
                                td data-label="policy" { (text(&r["policy"])) }
                                td data-label="tier" { (text(&r["tier"])) }
                                td.num data-label="uploads" { (text(&r["uploads"])) }
                                td data-label="last upload" data-value=(text(&r["last_upload_at"])) { (time(r["last_upload_at"].as_str())) }
                                td data-label="due" data-value=(text(&r["due_at"])) { (countdown(r["due_at"].as_str())) }
                                td data-label="waiting" title=(waiting_text(r["waiting"].as_str().unwrap_or(""))) { (text(&r["waiting"])) }
                            }
                        }
                        @if rounds.is_empty() { tr { td colspan="8" { "no open round matches" } } }
                    }
                }
            }
            nav.pager aria-label="Pages" {
                @if q.contains_key("cursor") { a href="/ui/pending" { "First page" } }
                @if let Some(n) = &next { a rel="next" href=(n) { "Next page" } }
            }
        }
    };
    (code, layout("Pending sessions", "Pending", &frame, body)).into_response()
}

/// Part indexes (1-based, SEMANTICS §2 `part.index`) below the largest one seen that are
/// missing from `parts`. The round does not keep `part.count`, so parts after the largest
/// seen cannot be named.
fn missing_parts(parts: &[u64]) -> Vec<u64> {
    let Some(max) = parts.iter().max() else {
        return Vec::new();
    };
    (1..*max).filter(|p| !parts.contains(p)).collect()
}

/// `GET /ui/sessions/{tenant}/{session}`: one session, with flush and cancel.
pub(super) async fn session(
    State(s): State<AdminState>,
    headers: HeaderMap,
    path: Result<Path<(String, String)>, axum::extract::rejection::PathRejection>,
) -> Response {
    let Ok(Path((tenant, session))) = path else {
        return page_error(
            StatusCode::BAD_REQUEST,
            "not a session path: /ui/sessions/TENANT/SESSION",
        );
    };
    let (code, v) = answer_json(
        views::session(
            State(s.clone()),
            Ok(Path((tenant.clone(), session.clone()))),
        )
        .await,
    )
    .await;
    let frame = Frame::of(&s, &headers);
    let title = format!("Session {tenant}/{session}");
    if code != StatusCode::OK {
        let body = html! {
            p.error role="alert" { (text(&v["error"])) }
            p { a href=(format!("/ui/pending?tenant={}", encode(&tenant, false))) { "Pending rounds of " (tenant) } }
        };
        return (code, layout(&title, "Pending", &frame, body)).into_response();
    }
    let round = &v["round"];
    let now = crate::codec::format_rfc3339_ms((s.wall)());
    let due = v["next_due"].as_str().unwrap_or("");
    let why = if round.is_null() {
        "no open round: the next due time is when its state expires (state-ttl)".to_owned()
    } else if due < now.as_str() {
        format!("overdue: {}", waiting_text("overdue"))
    } else if !round["max_wait_at"].is_null() && round["max_wait_at"] == round["deadline"] {
        format!("max_wait: {}", waiting_text("max_wait"))
    } else {
        format!("debounce: {}", waiting_text("debounce"))
    };
    let parts: Vec<u64> = round["parts"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_u64).collect())
        .unwrap_or_default();
    let key = format!("{tenant}/{session}");
    let body = html! {
        dl.facts {
            dt { "Tenant" } dd { a href=(super::pages::tenant_href(&tenant)) { (tenant) } }
            dt { "Lives on" } dd { "partition " (text(&v["partition"])) " of " code { (text(&v["topic"])) } ", instance " code { (s.actions.instance) } }
            dt { "Policy" } dd { (text(&v["policy"])) }
            dt { "Next due" } dd #due { (countdown(v["next_due"].as_str())) " (" (text(&v["next_due_is"])) ")" }
            dt { "Why it waits" } dd #why { (why) }
            dt { "CallTrack" } dd {
                @if v["call_track"].is_null() { "none yet" } @else {
                    (time(v["call_track"]["time"].as_str())) ", delay " (ms(&v["call_track"]["delay_ms"]))
                }
            }
            dt { "Last upload" } dd { (time(v["last_upload_at"].as_str())) " (event id " (text(&v["last_event_id"])) ")" }
        }
        h2 { "Open round" }
        @if round.is_null() { p { "No open round." } } @else {
            dl.facts {
                dt { "Opened" } dd { (time(round["start"].as_str())) }
                dt { "Uploads" } dd { (text(&round["uploads"])) }
                dt { "First / last upload" } dd { (time(round["first_upload_at"].as_str())) " / " (time(round["last_upload_at"].as_str())) }
                dt { "Delay" } dd { (ms(&round["delay_ms"])) }
                dt { "Due" } dd { (countdown(round["deadline"].as_str())) }
                dt { "Max-wait bound" } dd { (time(round["max_wait_at"].as_str())) }
                dt { "Parts" } dd #parts {
                    @if parts.is_empty() { "not a split upload" } @else {
                        "received " (format!("{parts:?}")) "; missing " (format!("{:?}", missing_parts(&parts)))
                        span.hint { " (below the largest index seen: the round does not keep the part count)" }
                    }
                }
            }
            h2 { "Act on it" }
            div.grid {
                @for (kind, label, what) in [("flush", "Flush", "emit the open round now (trigger manual)"), ("cancel", "Cancel", "close the open round without a ready record; its uploads are dropped")] {
                    form.action method="post" action="/ui/actions" {
                        h3 { (label) }
                        p.hint { (what) }
                        input type="hidden" name="kind" value=(kind);
                        input type="hidden" name="session" value=(key);
                        input type="hidden" name="csrf" value=(frame.csrf);
                        label for=(format!("reason-{kind}")) { "Reason (for the audit topic)" }
                        textarea id=(format!("reason-{kind}")) name="reason" rows="2" maxlength="1024" required {}
                        button type="submit" { (label) "…" }
                    }
                }
            }
        }
    };
    layout(&title, "Pending", &frame, body).into_response()
}

/// `GET /ui/tenants`: the tenants with open rounds here, demoted, or with an override.
pub(super) async fn tenants(
    State(s): State<AdminState>,
    headers: HeaderMap,
    Query(q): Query<BTreeMap<String, String>>,
) -> Response {
    if let Some(t) = q.get("t").map(|t| t.trim()).filter(|t| !t.is_empty()) {
        return axum::response::Redirect::to(&tenant_href(t)).into_response();
    }
    let now = (s.wall)();
    let sum = s.sessions.pending_summary(SessionFilter::default()).await;
    let set = s.overrides.snapshot();
    let demoted: Vec<String> = s
        .router
        .lock()
        .demoted(now)
        .into_iter()
        .map(|d| d.tenant)
        .collect();
    let mut names: Vec<&String> = sum
        .tenants
        .keys()
        .chain(set.entries.keys())
        .chain(&demoted)
        .collect();
    names.sort();
    names.dedup();
    let frame = Frame::of(&s, &headers);
    let limit = s.tiers.limit;
    let rows: Vec<Markup> = {
        let router = s.router.lock();
        names
            .iter()
            .map(|t| {
                let p = sum.tenants.get(*t);
                let o = set.active_of(t, now);
                html! { tr {
                    td { a href=(tenant_href(t)) { (t) } }
                    td { (router.tier_of(t)) @if router.pinned(t).is_some() { " (pinned)" } }
                    td.num { (router.rate_of(t, now)) " / " (limit) }
                    td.num { (p.map_or(0, |p| p.rounds.iter().sum::<u64>())) }
                    td.num { (p.map_or(0, |p| p.uploads)) }
                    td { @match o { Some(o) => { "v" (o.version) @if let Some(e) = o.expires_at { ", until " (time(Some(&crate::codec::format_rfc3339_ms(e)))) } }, None => { "—" } } }
                } }
            })
            .collect()
    };
    let body = html! {
        p.hint { "Tenants with open rounds on the partitions owned here, demoted, or with an override. Rate: ready records in the last tiers.period against tiers.limit." }
        @if sum.truncated { p.error { "The summary was cut short: some tenants may be missing." } }
        div.scroll { table.sortable {
            thead { tr {
                th scope="col" { button type="button" data-sort="text" { "tenant" } }
                th scope="col" { button type="button" data-sort="text" { "tier" } }
                th scope="col" { button type="button" data-sort="num" { "rate / limit" } }
                th scope="col" { button type="button" data-sort="num" { "open rounds" } }
                th scope="col" { button type="button" data-sort="num" { "uploads" } }
                th scope="col" { "override" }
            } }
            tbody {
                @for r in &rows { (r) }
                @if rows.is_empty() { tr { td colspan="6" { "no tenant with open rounds, demoted or with an override" } } }
            }
        } }
        form.inline method="get" action="/ui/tenants" {
            label for="t" { "Open a tenant" } input #t name="t" required; button type="submit" { "Open" }
        }
    };
    layout("Tenants", "Tenants", &frame, body).into_response()
}

/// The tier changes of `tenant` among the latest [`RECENT_CHANGES`] of this process (the
/// tier-events task's `<data-dir>/tiers.json`, rewritten after each change), newest first.
///
/// Errors: the file cannot be read or parsed (the message names it).
async fn tier_history(s: &AdminState, tenant: &str) -> Result<Vec<TierChange>, String> {
    let dir = s.data_dir.clone();
    let snapshot = tokio::task::spawn_blocking(move || tier_events::read_snapshot(&dir))
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())?;
    Ok(snapshot.map_or_else(Vec::new, |snap| {
        snap.recent_changes
            .into_iter()
            .rev()
            .filter(|c| c.tenant == tenant)
            .collect()
    }))
}

/// `GET /ui/tenants/{tenant}`: one tenant, its override and the forms that change it.
pub(super) async fn tenant(
    State(s): State<AdminState>,
    headers: HeaderMap,
    path: Result<Path<String>, axum::extract::rejection::PathRejection>,
    Query(q): Query<BTreeMap<String, String>>,
) -> Response {
    let Ok(Path(name)) = path else {
        return page_error(
            StatusCode::BAD_REQUEST,
            "not a tenant path: /ui/tenants/TENANT",
        );
    };
    let (code, v) =
        answer_json(views::tenant(State(s.clone()), Ok(Path(name.clone()))).await).await;
    let frame = Frame::of(&s, &headers);
    let title = format!("Tenant {name}");
    if code != StatusCode::OK {
        let body = html! { p.error role="alert" { (text(&v["error"])) } };
        return (code, layout(&title, "Tenants", &frame, body)).into_response();
    }
    let done = q.get("done");
    let rules = &v["rules"];
    let o = &rules["override"];
    let in_force = o["in_force"].as_bool().unwrap_or(false);
    let version = if o.is_null() {
        0
    } else {
        o["version"].as_u64().unwrap_or(0)
    };
    let tiers: Vec<String> = s
        .router
        .tiers()
        .tiers()
        .map(|(n, _)| n.to_owned())
        .collect();
    let href = tenant_href(&name);
    let history = tier_history(&s, &name).await;
    let body = html! {
        @if let Some(m) = done { p.ok role="status" { (m) } }
        dl.facts {
            dt { "Tier" } dd #tier { (text(&v["tier"])) " → " code { (text(&v["topic"])) } @if v["pinned"].as_bool() == Some(true) { " (pinned by " (text(&rules["pinned_by"])) ")" } }
            dt { "Rate" } dd { (text(&v["rate"])) " ready records in the last " (ms(&v["period_ms"])) ", limit " (text(&v["limit"])) }
            dt { "Demoted" } dd { @if v["demoted"].is_null() { "no" } @else { "since " (time(v["demoted"]["since"].as_str())) ", recovers at " (time(v["demoted"]["recovers_at"].as_str())) } }
            dt { "Rule in force" } dd #rule { code { (text(&rules["rule"])) } " (from the " (text(&rules["rule_from"])) ")" }
            dt { "Configured rule" } dd { code { (text(&rules["configured"]["rule"])) } " (" (text(&rules["configured"]["from"])) ")" }
            dt { "Learned initial delay" } dd { "per session: the CallTrack on each session's page" }
        }
        h2 { "Tier changes" }
        p.hint { "Among the latest " (RECENT_CHANGES) " tier changes of all tenants this process decided (its " code { "tiers.json" } "), newest first; each one is also a record of the tier-events topic " code { (s.tiers.events_topic) } "." }
        @match &history {
            Err(e) => { p.error #tier-history { "The tier changes cannot be read: " (e) } }
            Ok(h) if h.is_empty() => { p #tier-history { "No tier change of " (name) " among them." } }
            Ok(h) => {
                div.scroll { table #tier-history {
                    thead { tr { th scope="col" { "at" } th scope="col" { "from" } th scope="col" { "to" } th scope="col" { "rate / limit" } th scope="col" { "reason" } } }
                    tbody { @for c in h { tr {
                        td { (time(Some(&crate::codec::format_rfc3339_ms(c.at)))) }
                        td { (c.from) } td { (c.to) }
                        td.num { (c.rate) " / " (c.limit) }
                        td { (c.reason.as_str()) }
                    } } }
                } }
            }
        }
        h2 { "Override" }
        @if o.is_null() { p #override { "No override: the configured rule applies." } } @else {
            dl.facts #override {
                dt { "Version" } dd { (version) @if o["deleted"].as_bool() == Some(true) { " (removed)" } }
                dt { "In force" } dd { @if in_force { "yes" } @else { "no" } }
                dt { "Debounce" } dd { code { (text(&o["debounce"])) } }
                dt { "Pinned tier" } dd { (text(&o["tier"])) }
                dt { "Expires" } dd { (time(o["expires_at"].as_str())) }
                dt { "Set" } dd { (time(o["set_at"].as_str())) " by " (text(&o["who"])) ": " (text(&o["reason"])) }
            }
        }
        div.grid {
            form.action method="post" action=(format!("{href}/override")) {
                h3 { @if in_force { "Replace the override" } @else { "Set an override" } }
                input type="hidden" name="csrf" value=(frame.csrf);
                input type="hidden" name="version" value=(if in_force { version } else { 0 });
                label for="policy" { "Policy" }
                select #policy name="policy" {
                    option value="" { "inherit" }
                    @for p in ["fixed", "leading-trailing", "adaptive"] { option value=(p) { (p) } }
                }
                label for="delay" { "Delay (fixed, leading-trailing), e.g. 2m" } input #delay name="delay";
                label for="min_delay" { "Min delay (adaptive)" } input #min_delay name="min_delay";
                label for="max_delay" { "Max delay (adaptive)" } input #max_delay name="max_delay";
                label for="max_wait" { "Max-wait (\"off\": none)" } input #max_wait name="max_wait";
                label for="pin" { "Pin the tier" }
                select #pin name="tier" {
                    option value="" { "don't pin" }
                    @for t in &tiers { option value=(t) { (t) } }
                }
                label for="expires_in" { "Expires in (empty: until removed), e.g. 2h" } input #expires_in name="expires_in";
                label for="reason-set" { "Reason" } textarea #reason-set name="reason" rows="2" maxlength="1024" required {}
                button type="submit" { "Set override" }
            }
            @if in_force {
                form.action method="post" action=(format!("{href}/override/remove")) {
                    h3 { "Remove the override" }
                    p.hint { "The configured rule applies again." }
                    input type="hidden" name="csrf" value=(frame.csrf);
                    input type="hidden" name="version" value=(version);
                    label for="reason-remove" { "Reason" } textarea #reason-remove name="reason" rows="2" maxlength="1024" required {}
                    button type="submit" { "Remove override" }
                }
            }
        }
        p { a href=(format!("/ui/pending?tenant={}", encode(&name, false))) { "Open rounds of " (name) } }
    };
    layout(&title, "Tenants", &frame, body).into_response()
}

/// A partition's restore or catch-up progress (`/v1/partitions` `progress`, 0.0–1.0): a
/// `<progress>` bar with what it measures (records replayed of the changelog, input lag closed).
fn progress(p: &Value) -> Markup {
    let Some(f) = p["progress"].as_f64() else {
        return html! { "—" };
    };
    let pct = (f * 100.0).clamp(0.0, 100.0);
    let what = match p["state"].as_str() {
        Some("restoring") => format!(
            "restore: {} of {} changelog records",
            text(&p["restored"]),
            p["restored"].as_u64().unwrap_or(0) + p["restore_remaining"].as_u64().unwrap_or(0)
        ),
        Some("catching_up") => format!(
            "catch-up: lag {} of {} at the start",
            text(&p["lag"]),
            text(&p["catch_up_from"])
        ),
        _ => "live".to_owned(),
    };
    html! { progress max="100" value=(format!("{pct:.0}")) title=(what) aria-label=(what) {} " " (format!("{pct:.0} %")) }
}

/// `GET /ui/partitions`.
pub(super) async fn partitions(State(s): State<AdminState>, headers: HeaderMap) -> Response {
    let (_, v) = answer_json(views::partitions(State(s.clone())).await).await;
    let frame = Frame::of(&s, &headers);
    let list = v["partitions"].as_array().cloned().unwrap_or_default();
    let body = html! {
        p.hint { "Partitions owned by instance " code { (s.actions.instance) } ". Another instance answers for the others." }
        div.scroll { table {
            thead { tr {
                th scope="col" { "partition" } th scope="col" { "state" } th scope="col" { "progress" } th scope="col" { "next offset" } th scope="col" { "lag" }
                th scope="col" { "partition time" } th scope="col" { "behind" } th scope="col" { "open rounds" } th scope="col" { "owed" }
                th scope="col" { "next due" } th scope="col" { "restore left" } th scope="col" { "records" } th scope="col" { "dead letters" } th scope="col" { "ready records" }
            } }
            tbody {
                @for p in &list { tr {
                    td.num { (text(&p["partition"])) }
                    td { (text(&p["state"])) @if !p["error"].is_null() { ": " (text(&p["error"])) } }
                    td { (progress(p)) }
                    td.num { (text(&p["next_offset"])) }
                    td.num { (text(&p["lag"])) }
                    td { (time(p["partition_time"].as_str())) }
                    td.num { (ms(&p["clock_behind_ms"])) }
                    td.num { (text(&p["pending_rounds"])) }
                    td.num { (text(&p["outbox"])) }
                    td { (time(p["next_due"].as_str())) }
                    td.num { (text(&p["restore_remaining"])) }
                    td.num { (text(&p["records"])) }
                    td.num { (text(&p["dead_letters"])) }
                    td.num { (text(&p["published"])) }
                } }
                @if list.is_empty() { tr { td colspan="14" { "no partition owned here" } } }
            }
        } }
    };
    layout("Partitions", "Partitions", &frame, body).into_response()
}

/// What the What-if form asks, as typed (the page draws the form again with it).
pub(super) struct SweepAsked {
    /// Look-back (minutes, text).
    pub minutes: String,
    /// Sweep text (`settle tune --sweep` grammar).
    pub sweep: String,
    /// Goal text (`settle tune --goal` grammar).
    pub goal: String,
}

/// Look-back the What-if form starts with (minutes).
pub const DEFAULT_SWEEP_MINUTES: u32 = 15;

/// What the What-if page shows above the live point: a sweep's result, or why there is none.
pub(super) enum SweepOutcome {
    /// The sweep ran.
    Done(WhatIfResult),
    /// It did not (bad form, a sweep already running, a refused or failed sweep).
    Error(String),
}

/// `GET /ui/whatif`: the sweep form, the live policy's measured point, the shadows.
pub(super) async fn whatif(State(s): State<AdminState>, headers: HeaderMap) -> Response {
    whatif_page(&s, &headers, None, None).await.into_response()
}

/// The sweep form: `asked` when given, else the defaults of `whatif`.
fn sweep_form(whatif: &dyn WhatIf, asked: Option<&SweepAsked>, csrf: &str) -> Markup {
    let minutes = asked.map_or_else(|| DEFAULT_SWEEP_MINUTES.to_string(), |a| a.minutes.clone());
    let sweep = asked.map_or(whatif.default_sweep(), |a| a.sweep.as_str());
    let goal = asked.map_or(whatif.default_goal(), |a| a.goal.as_str());
    html! {
        form.action #sweep-form method="post" action="/ui/whatif" {
            input type="hidden" name="csrf" value=(csrf);
            label for="minutes" { "Last minutes of the input (1 to " (MAX_MINUTES) ")" }
            input #minutes type="number" name="minutes" min="1" max=(MAX_MINUTES) value=(minutes) required;
            label for="sweep" { "Settings to replay (" code { "settle tune --sweep" } ")" }
            textarea #sweep name="sweep" rows="4" maxlength=(MAX_SPEC_BYTES) { (sweep) }
            label for="goal" { "Goal (" code { "pNN<=DURATION" } ")" }
            input #goal type="text" name="goal" value=(goal) maxlength=(MAX_SPEC_BYTES);
            button type="submit" { "Run the sweep" }
            p.hint { "Reads the uploads of the last minutes from the input this instance consumes (at most " (MAX_UPLOADS) "), replays them under every setting as " code { "settle tune" } " does, one sweep at a time. Blank fields take the defaults." }
        }
    }
}

/// A sweep's chart, verdict and table.
fn sweep_result(r: &WhatIfResult) -> Markup {
    let fmt_ms = |ms: u64| seconds(Some(ms as f64 / 1000.0));
    html! {
        section #sweep-result {
            h2 { "Sweep result" }
            p.hint { (r.source) ": " (r.uploads) " uploads replayed (" (r.rejected) " unusable skipped), " (r.rows.len()) " settings. Goal: " (r.goal) " at least cost." }
            @for line in &r.verdict { p { (line) } }
            @if let Some(svg) = &r.svg { figure.sweep-chart { figcaption { "Cost (emissions) against p99 time-to-ready; Pareto-optimal settings joined" } (PreEscaped(svg.as_str())) } }
            div.scroll { table #sweep {
                thead { tr {
                    th scope="col" { "mark" } th scope="col" { "setting" } th scope="col" { "emissions" } th scope="col" { "uploads / emission" }
                    th scope="col" { "p50" } th scope="col" { "p99" } th scope="col" { "meets goal" }
                } }
                tbody { @for row in &r.rows {
                    tr class=[row_class(row)] {
                        td { @if row.recommended { strong { "recommended" } } @else if row.pareto { "Pareto" } }
                        td { (row.setting) }
                        td.num { (row.emissions) }
                        td.num { (format!("{:.2}", row.uploads_per_emission)) }
                        td.num { (fmt_ms(row.time_to_ready_p50_ms)) }
                        td.num { (fmt_ms(row.time_to_ready_p99_ms)) }
                        td { @if row.meets_goal { "yes" } @else { "no" } }
                    }
                } }
            } }
            p.hint { "Pareto: no other setting has both fewer-or-equal emissions and lower-or-equal p99, one strictly. Recommended: the cheapest setting that meets the goal. Every setting applies to every tenant; time-to-ready is last upload to ready record." }
        }
    }
}

fn row_class(row: &WhatIfRow) -> Option<&'static str> {
    if row.recommended {
        Some("recommended")
    } else if row.pareto {
        Some("pareto")
    } else {
        None
    }
}

/// The What-if page: the sweep form (or how to run `settle tune` without a
/// [`WhatIf`]), `outcome` when a sweep was asked, the live policy's measured point, the
/// shadows.
pub(super) async fn whatif_page(
    s: &AdminState,
    headers: &HeaderMap,
    asked: Option<&SweepAsked>,
    outcome: Option<&SweepOutcome>,
) -> Markup {
    let st = stats::read(s);
    let frame = Frame::of(s, headers);
    let rule = s.overrides.rules_in_force().default.to_string();
    let nats_hint = "settle tune --config settle.toml --from-nats --since 30m --report tune.html";
    let (_, shadow) = answer_json(views::shadow(State(s.clone())).await).await;
    let policies = shadow["policies"].as_array().cloned().unwrap_or_default();
    let tiers: Vec<String> = shadow["tiers"]
        .as_array()
        .map(|t| t.iter().map(text).collect())
        .unwrap_or_default();
    let running = s.sweeps.running();
    let body = html! {
        @match &s.whatif {
            Some(w) => {
                p.hint { "Replay the input's last minutes under many debounce settings, as " code { "settle tune" } " does, and compare cost (ready records) with time-to-ready; the live policy's measured point is below." }
                @if let Some(r) = &running { p #sweep-running role="status" { "A sweep is running, started at " (time(Some(crate::codec::format_rfc3339_ms(r.started_at).as_str()))) " by " (r.who) " (last " (r.minutes) " min)." } }
                (sweep_form(w.as_ref(), asked, &frame.csrf))
            }
            None => {
                section.note {
                    h2 { "No sweep runner here" }
                    p { "This admin server was started without a sweep runner (" code { "settle run" } " gives it one). Run the replay beside settle on the same input:" }
                    pre { code { (nats_hint) } }
                    p { "(" code { "--from-kafka" } " for Kafka; " code { "settle tune --help" } " lists the sweep and goal options.)" }
                }
            }
        }
        @match outcome {
            Some(SweepOutcome::Done(r)) => (sweep_result(r)),
            Some(SweepOutcome::Error(e)) => p.error #sweep-error role="alert" { (e) },
            None => {}
        }
        h2 { "The live policy, measured" }
        p.hint { "The live policy's measured point since this process started (all its rules, every tenant): what to put beside a sweep's settings." }
        dl.facts #live-point {
            dt { "Default rule in force" } dd { code { (rule) } }
            dt { "Ready records" } dd #measured-emissions { (st.emissions) }
            dt { "Uploads coalesced" } dd { (st.emission_uploads) }
            dt { "Uploads per ready record" } dd { (st.coalescing().map_or("—".into(), |c| format!("{c:.2}"))) }
        }
        table {
            caption { "Time to ready by tier" }
            thead { tr { th scope="col" { "tier" } th scope="col" { "ready records" } th scope="col" { "p50" } th scope="col" { "p99" } } }
            tbody { @for (tier, l) in &st.time_to_ready { tr { td { (tier) } td.num { (l.count) } td.num { (seconds(l.p50_s)) } td.num { (seconds(l.p99_s)) } } } }
        }
        h2 { "Shadow policies on live traffic" }
        @if policies.is_empty() {
            p.hint { "No " code { "[[shadow]]" } " policy is configured. Each one runs beside the live policy on the same uploads, in memory, emitting nothing (README \"Try a policy on live traffic\")." }
        } @else {
            p.hint { "Since " (time(shadow["since"].as_str())) ", on the partitions owned here. Time-to-ready is " code { "due_at − last_upload_at" } ", as " code { "settle tune" } " computes it. Class " code { "own" } ": tenants with a rule of their own (config or override); " code { "default" } ": the others." }
            div.scroll { table #shadows {
                thead { tr {
                    th scope="col" { "policy" } th scope="col" { "rule" } th scope="col" { "emissions" } th scope="col" { "uploads / emission" }
                    th scope="col" { "p50" } th scope="col" { "p99" } th scope="col" { "sessions held" } th scope="col" { "refused" }
                } }
                tbody { @for p in &policies {
                    @let t = &p["figures"]["total"];
                    tr {
                        td { b { (text(&p["name"])) } }
                        td { code.wrap { (text(&p["rule"])) } }
                        td.num { (text(&t["emissions"])) }
                        td.num { (t["uploads_per_emission"].as_f64().map_or("—".into(), |c| format!("{c:.2}"))) }
                        td.num { (ms(&t["time_to_ready_ms"]["p50"])) }
                        td.num { (ms(&t["time_to_ready_ms"]["p99"])) }
                        td.num { (text(&p["sessions"])) }
                        td.num { (text(&p["refused_sessions"])) }
                    }
                } }
            } }
            div.scroll { table #shadow-cells {
                caption { "By tier and tenant class" }
                thead { tr {
                    th scope="col" { "policy" } th scope="col" { "tier" } th scope="col" { "class" } th scope="col" { "emissions" }
                    th scope="col" { "uploads / emission" } th scope="col" { "p50" } th scope="col" { "p99" }
                } }
                tbody { @for p in &policies { @for tier in &tiers { @for class in ["default", "own"] {
                    @let c = &p["figures"]["tiers"][tier.as_str()]["classes"][class];
                    @if c["emissions"].as_u64().unwrap_or(0) > 0 { tr {
                        td { (text(&p["name"])) } td { (tier) } td { (class) }
                        td.num { (text(&c["emissions"])) }
                        td.num { (c["uploads_per_emission"].as_f64().map_or("—".into(), |v| format!("{v:.2}"))) }
                        td.num { (ms(&c["time_to_ready_ms"]["p50"])) }
                        td.num { (ms(&c["time_to_ready_ms"]["p99"])) }
                    } }
                } } } }
            } }
        }
    };
    layout("What-if", "What-if", &frame, body)
}

/// Audit records the Audit page lists.
pub const AUDIT_ROWS: usize = 100;

/// `GET /ui/audit`: the latest audit records known here.
pub(super) async fn audit(State(s): State<AdminState>, headers: HeaderMap) -> Response {
    let q: actions::AuditQuery = match serde_json::from_value(json!({ "limit": AUDIT_ROWS })) {
        Ok(q) => q,
        Err(e) => return page_error(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()),
    };
    let (_, v) = answer_json(actions::audit_tail(State(s.clone()), Ok(Query(q))).await).await;
    let frame = Frame::of(&s, &headers);
    let records = v["records"].as_array().cloned().unwrap_or_default();
    let body = html! {
        p.hint { "The latest " (AUDIT_ROWS) " audit records this instance knows (its own and those read back from the audit topic " code { (text(&v["topic"])) } "), newest first." }
        div.scroll { table #audit {
            thead { tr {
                th scope="col" { "at" } th scope="col" { "who" } th scope="col" { "action" } th scope="col" { "stage" }
                th scope="col" { "reason" } th scope="col" { "selection" } th scope="col" { "result" } th scope="col" { "request" }
            } }
            tbody {
                @for r in &records { tr {
                    td { (time(r["at"].as_i64().map(crate::codec::format_rfc3339_ms).as_deref())) }
                    td { (text(&r["who"])) }
                    td { (text(&r["action"])) }
                    td { (text(&r["stage"])) }
                    td { (text(&r["reason"])) }
                    td { code { (text(&r["selection"])) } }
                    td { code.wrap { (text(&r["result"])) } }
                    td { code { (text(&r["request_id"])) } }
                } }
                @if records.is_empty() { tr { td colspan="8" { "no audit record yet" } } }
            }
        } }
    };
    layout("Audit", "Audit", &frame, body).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_encoded() {
        assert_eq!(
            session_href("acme", "build/47 11"),
            "/ui/sessions/acme/build/47%2011"
        );
        assert_eq!(encode("a&b=c", false), "a%26b%3Dc");
    }

    #[test]
    fn missing_parts_are_the_gaps_below_the_largest() {
        assert_eq!(missing_parts(&[1, 3, 5]), vec![2, 4]);
        assert!(missing_parts(&[]).is_empty());
    }
}
