//! `settle inspect`: reads partition stores offline (read-only; safe next to a running
//! processor, which it does not lock) and prints, per partition, the stored next offset,
//! partition time, sessions, pending rounds, outbox size and the next due times; with
//! `--session`, only that session: the store it lives in, its state (generation, CallTrack,
//! open round) and its next due time, or an error when no store read holds it; the
//! tenants' learned initial delays (`engine::learn`: the statistic, what it is made of, the
//! delay the policy in force takes from it). Then the
//! processor's tier state (SEMANTICS §5) from `<data-dir>/tiers.json`, which the running
//! processor rewrites on every tier change (`runtime::tier_events`): the rule in force,
//! emissions routed per tier, the tenants demoted now and the latest tier changes.
//!
//! Stores are found under `<data-dir>/<topic>/<partition>` (see `store::partition_path`).

use crate::codec::format_rfc3339_ms;
use crate::config::Config;
use crate::engine::{Engine, Millis, PolicySpec, SessionKey, SessionState, TenantStats};
use crate::runtime::{read_snapshot, TierSnapshot, TIERS_FILE};
use crate::store::{PartitionStore, StoreOptions};
use anyhow::Context;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Arguments of `settle inspect`.
#[derive(Clone, Debug)]
pub struct InspectArgs {
    /// `--data-dir`: the `store.data-dir` of the processor.
    pub data_dir: PathBuf,
    /// `--topic`: only stores of this input topic (default: every topic directory).
    pub topic: Option<String>,
    /// `--partition`: only this partition.
    pub partition: Option<i32>,
    /// `--session tenant/session`: print only this session's state and where it lives (every
    /// store that has it), nothing else; not found in any store read is an error.
    pub session: Option<String>,
    /// `--timers N`: how many next due times to list per partition (default 5).
    pub timers: usize,
    /// `--tenant NAME`: print this tenant's learned-delay statistics (from every store that
    /// has them).
    pub tenant: Option<String>,
    /// `--tenants N`: how many tenants' learned delays to list per partition, most recently
    /// seen first (default 5).
    pub tenants: usize,
    /// `--config`: the processor's config, for the session's state expiry (`state-ttl`) and
    /// the learned delays' range (`min-delay`, `max-delay`); defaults apply without it.
    pub config: Option<PathBuf>,
}

impl InspectArgs {
    /// Every partition of every topic under `data_dir`, 5 timers, no session.
    pub fn new(data_dir: PathBuf) -> Self {
        InspectArgs {
            data_dir,
            topic: None,
            partition: None,
            session: None,
            timers: 5,
            tenant: None,
            tenants: 5,
            config: None,
        }
    }
}

/// What one partition store holds (its `meta` counters and first timers).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PartitionInfo {
    /// Store directory.
    pub path: PathBuf,
    /// Input topic (directory name).
    pub topic: String,
    /// Partition number.
    pub partition: i32,
    /// Next input offset to consume (`None`: nothing applied yet).
    pub next_offset: Option<i64>,
    /// Partition time (ms), SEMANTICS §3.
    pub partition_time: Option<Millis>,
    /// Keys with state.
    pub sessions: u64,
    /// Keys with an open round.
    pub pending_rounds: u64,
    /// Owed emissions.
    pub outbox_len: u64,
    /// Changelog checkpoint: the changelog offset a restore continues from (`None`: never
    /// synced with a changelog).
    pub changelog_checkpoint: Option<i64>,
    /// The store holds writes not known to be in the changelog.
    pub changelog_dirty: bool,
    /// First timers `(due ms, key)` in firing order.
    pub next_due: Vec<(Millis, SessionKey)>,
    /// For each of `next_due`: true when it is an open round's due time, false when it is
    /// the session's state expiry (`state-ttl` after its last upload; nothing is emitted).
    pub next_due_is_round: Vec<bool>,
    /// Tenants with learned-delay statistics (`engine::learn`).
    pub learned_tenants: usize,
    /// The most recently seen of them (at most the `tenants` asked for), newest first.
    pub recent_tenants: Vec<(String, TenantStats)>,
}

/// One session found in a store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionInfo {
    /// Partition whose store holds it.
    pub partition: i32,
    /// Its state.
    pub state: SessionState,
    /// Its timer: the open round's due time, or the state's expiry.
    pub next_due: Millis,
}

/// Stores under `args.data_dir` matching `args.topic` / `args.partition`, as `(topic,
/// partition, path)` sorted.
///
/// Errors: `data_dir` cannot be read.
pub fn find_stores(args: &InspectArgs) -> anyhow::Result<Vec<(String, i32, PathBuf)>> {
    let mut out = Vec::new();
    let topics = std::fs::read_dir(&args.data_dir)
        .with_context(|| format!("cannot read data dir {}", args.data_dir.display()))?;
    for topic in topics.flatten() {
        let name = topic.file_name().to_string_lossy().into_owned();
        if !topic.path().is_dir() || args.topic.as_ref().is_some_and(|t| *t != name) {
            continue;
        }
        let Ok(parts) = std::fs::read_dir(topic.path()) else {
            continue;
        };
        for part in parts.flatten() {
            let Ok(p) = part.file_name().to_string_lossy().parse::<i32>() else {
                continue;
            };
            if part.path().is_dir() && args.partition.is_none_or(|want| want == p) {
                out.push((name.clone(), p, part.path()));
            }
        }
    }
    out.sort();
    Ok(out)
}

fn open(path: &Path) -> anyhow::Result<PartitionStore> {
    PartitionStore::open_read_only(path, &StoreOptions::default())
        .with_context(|| format!("cannot read the store at {}", path.display()))
}

/// Reads one store's figures, its first `timers` timers and its `tenants` most recently
/// seen tenants' learned-delay statistics.
///
/// Errors: the store cannot be opened or read.
pub fn partition_info(
    topic: &str,
    partition: i32,
    path: &Path,
    timers: usize,
    tenants: usize,
) -> anyhow::Result<PartitionInfo> {
    let store = open(path)?;
    let next_due = store.timers(timers)?;
    let mut recent_tenants = if tenants > 0 {
        store.tenants()?
    } else {
        Vec::new()
    };
    recent_tenants.sort_by(|a, b| b.1.last_seen.cmp(&a.1.last_seen).then(a.0.cmp(&b.0)));
    recent_tenants.truncate(tenants);
    Ok(PartitionInfo {
        path: path.to_path_buf(),
        topic: topic.to_owned(),
        partition,
        next_offset: store.stored_offset(),
        partition_time: store.partition_time(),
        sessions: store.session_count(),
        pending_rounds: store.pending_rounds(),
        outbox_len: store.outbox_len(),
        changelog_checkpoint: store.changelog_checkpoint(),
        changelog_dirty: store.changelog_dirty(),
        next_due_is_round: next_due
            .iter()
            .map(|(_, key)| Ok(store.session(key)?.is_some_and(|st| st.round.is_some())))
            .collect::<Result<_, crate::store::Error>>()?,
        next_due,
        learned_tenants: store.tenant_count(),
        recent_tenants,
    })
}

/// One line about a tenant's learned initial delay under `spec` (the policy in force for it):
/// the delay its sessions start from, and what the statistic is made of.
pub fn describe_learned(stats: &TenantStats, spec: &PolicySpec) -> String {
    let human =
        |ms: Millis| humantime::format_duration(std::time::Duration::from_millis(ms.max(0) as u64));
    let seen = format!("last seen {}", format_rfc3339_ms(stats.last_seen));
    let Some(s) = stats.summary() else {
        return format!(
            "not learned yet ({} of {} intervals) · min-delay {} applies · {seen}",
            stats.intervals.len(),
            crate::engine::learn::LEARN_MIN_SAMPLES,
            human(spec.min_delay)
        );
    };
    let used = match stats.learned_delay(spec) {
        Some(d) => format!("starts sessions at {}", human(d)),
        None => format!(
            "not used: the policy in force ({}) does not learn",
            spec.name.as_str()
        ),
    };
    format!(
        "{used} · p90 {} + 25 % = {} · {} intervals ({} outliers) · median {} · MAD {} · {seen}",
        human(s.p90),
        human(s.raw_delay),
        s.samples,
        s.samples - s.inliers,
        human(s.median),
        human(s.mad),
    )
}

/// Prints the stores, then the tier state of `tiers.json` if there is one, to `out`; with
/// `args.session`, only that session (see [`run_session`]). Returns how many stores were read.
///
/// Errors: neither a matching store nor `tiers.json` exists, a store cannot be read, the
/// session key is not `tenant/session`, the session is in no store read, the config cannot
/// be loaded, or writing to `out` fails. An unreadable `tiers.json` is reported in the
/// output, not as an error.
pub fn run(args: InspectArgs, out: &mut impl Write) -> anyhow::Result<usize> {
    let stores = find_stores(&args)?;
    let tiers = read_snapshot(&args.data_dir);
    if stores.is_empty() && matches!(tiers, Ok(None)) {
        anyhow::bail!(
            "no partition store under {} (expected <data-dir>/<topic>/<partition>)",
            args.data_dir.display()
        );
    }
    let engine = Engine::new(Config::load(args.config.as_deref())?.policy_table());
    if let Some(k) = &args.session {
        let key = SessionKey::parse(k)
            .with_context(|| format!("--session {k:?} is not tenant/session"))?;
        run_session(&args, &key, &stores, &engine, out)?;
        return Ok(stores.len());
    }
    let mut tenant_found = false;
    for (topic, partition, path) in &stores {
        let info = partition_info(topic, *partition, path, args.timers, args.tenants)?;
        print_partition(&info, out)?;
        for (n, (name, stats)) in info.recent_tenants.iter().enumerate() {
            let label = if n == 0 { "learned delays" } else { "" };
            let spec = engine.policies().for_tenant(name);
            writeln!(
                out,
                "  {label:<15} {name}: {}",
                describe_learned(stats, spec)
            )?;
        }
        if let Some(name) = &args.tenant {
            if let Some(stats) = open(path)?.tenant(name)? {
                tenant_found = true;
                let spec = engine.policies().for_tenant(name);
                writeln!(out, "  tenant {name} (partition {partition})")?;
                writeln!(
                    out,
                    "    learned delay   {}",
                    describe_learned(&stats, spec)
                )?;
                let intervals: Vec<String> =
                    stats.intervals.iter().map(|ms| ms.to_string()).collect();
                writeln!(out, "    intervals (ms)  {}", intervals.join(" "))?;
            }
        }
    }
    if let Some(name) = &args.tenant {
        if !tenant_found {
            writeln!(
                out,
                "tenant {name}: no learned-delay statistics in any store read"
            )?;
        }
    }
    match tiers {
        Ok(Some(snapshot)) => print_tiers(&args.data_dir, &snapshot, out)?,
        Ok(None) => writeln!(out, "tiers: no {TIERS_FILE} (no runtime ran here yet)")?,
        Err(e) => writeln!(out, "tiers: {e:#}")?,
    }
    Ok(stores.len())
}

/// `settle inspect --session`: prints `key`'s state from every store of `stores` that holds
/// it, each headed by the store (topic, partition, directory), and nothing else.
///
/// Errors: a store cannot be read, writing to `out` fails, or no store holds the session
/// (the message names the stores read).
fn run_session(
    args: &InspectArgs,
    key: &SessionKey,
    stores: &[(String, i32, PathBuf)],
    engine: &Engine,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let mut found = false;
    for (topic, partition, path) in stores {
        if let Some(state) = open(path)?.session(key)? {
            found = true;
            writeln!(out, "{topic}/{partition}  ({})", path.display())?;
            let session = SessionInfo {
                partition: *partition,
                next_due: engine.next_due(key, &state),
                state,
            };
            print_session(key, &session, out)?;
        }
    }
    if !found {
        let read: Vec<String> = stores.iter().map(|(t, p, _)| format!("{t}/{p}")).collect();
        anyhow::bail!(
            "session {key}: no state in any store read under {} ({}); the session may have \
             expired (state-ttl), live on another instance, or be spelled differently",
            args.data_dir.display(),
            if read.is_empty() {
                "no partition store".to_owned()
            } else {
                read.join(", ")
            }
        );
    }
    Ok(())
}

/// Most recent tier changes printed (the file keeps more).
const PRINTED_CHANGES: usize = 10;

fn print_tiers(dir: &Path, s: &TierSnapshot, out: &mut impl Write) -> std::io::Result<()> {
    writeln!(
        out,
        "tiers  ({}, written {})",
        dir.join(TIERS_FILE).display(),
        format_rfc3339_ms(s.written_at)
    )?;
    let human = |ms: u64| humantime::format_duration(std::time::Duration::from_millis(ms));
    writeln!(
        out,
        "  rule            more than {} emissions per {}: demoted; promoted after {} below {} x {}",
        s.limit,
        human(s.period_ms),
        human(s.cooldown_ms),
        s.limit,
        s.recover_ratio
    )?;
    let topics: Vec<String> = s
        .tiers
        .iter()
        .map(|t| format!("{} -> {}", t.name, t.topic))
        .collect();
    writeln!(
        out,
        "  topics          {} · events -> {}",
        topics.join(" · "),
        s.events_topic
    )?;
    let routed: Vec<String> = s
        .counters
        .routed
        .iter()
        .map(|(tier, n)| format!("{tier} {n}"))
        .collect();
    writeln!(out, "  routed          {}", routed.join(" · "))?;
    if !s.instance.is_empty() {
        let others = if s.live_instances.is_empty() {
            "no other live instance".to_owned()
        } else {
            format!("summed with {}", s.live_instances.join(", "))
        };
        writeln!(
            out,
            "  shared          counts of {} {others} · {} change(s) published by another instance",
            s.instance, s.events_reported_elsewhere
        )?;
    }
    writeln!(
        out,
        "  changes         {} demotion(s) · {} recovery(ies) · {} not yet on the events topic",
        s.counters.demotions, s.counters.recoveries, s.events_unpublished
    )?;
    if s.demoted.is_empty() {
        writeln!(out, "  demoted         -")?;
    }
    for (n, d) in s.demoted.iter().enumerate() {
        let label = if n == 0 { "demoted" } else { "" };
        writeln!(
            out,
            "  {label:<15} {}  {} since {} · rate {}/{} · recovers at {} if quiet",
            d.tenant,
            d.tier,
            format_rfc3339_ms(d.since),
            d.rate,
            d.limit,
            format_rfc3339_ms(d.recovers_at)
        )?;
    }
    let skip = s.recent_changes.len().saturating_sub(PRINTED_CHANGES);
    for (n, c) in s.recent_changes.iter().skip(skip).enumerate() {
        let label = if n == 0 { "recent changes" } else { "" };
        writeln!(
            out,
            "  {label:<15} {}  {} {} -> {} · rate {}/{} · {}",
            format_rfc3339_ms(c.at),
            c.tenant,
            c.from,
            c.to,
            c.rate,
            c.limit,
            c.reason.as_str()
        )?;
    }
    Ok(())
}

fn time(ms: Option<Millis>) -> String {
    ms.map_or_else(
        || "-".to_owned(),
        |t| format!("{} ({t})", format_rfc3339_ms(t)),
    )
}

fn print_partition(i: &PartitionInfo, out: &mut impl Write) -> std::io::Result<()> {
    writeln!(out, "{}/{}  ({})", i.topic, i.partition, i.path.display())?;
    let offset = i.next_offset.map_or("-".to_owned(), |o| o.to_string());
    writeln!(out, "  next offset     {offset}")?;
    writeln!(out, "  partition time  {}", time(i.partition_time))?;
    writeln!(out, "  sessions        {}", i.sessions)?;
    writeln!(out, "  pending rounds  {}", i.pending_rounds)?;
    writeln!(out, "  outbox          {} owed emission(s)", i.outbox_len)?;
    writeln!(
        out,
        "  changelog       {}",
        match (i.changelog_checkpoint, i.changelog_dirty) {
            (None, false) => "- (never synced with a changelog)".to_owned(),
            (None, true) => "writes not yet in the changelog, no checkpoint".to_owned(),
            (Some(c), false) => format!("in sync up to offset {c}"),
            (Some(c), true) => {
                format!("checkpoint {c}, later writes not yet acknowledged by the changelog")
            }
        }
    )?;
    writeln!(
        out,
        "  tenants         {} with learned delays",
        i.learned_tenants
    )?;
    if i.next_due.is_empty() {
        writeln!(out, "  next due        -")?;
    }
    for (n, (due, key)) in i.next_due.iter().enumerate() {
        let label = if n == 0 { "next due" } else { "" };
        let what = match i.next_due_is_round.get(n) {
            Some(false) => "  (state expiry)",
            _ => "",
        };
        writeln!(
            out,
            "  {label:<15} {}  {key}{what}",
            format_rfc3339_ms(*due)
        )?;
    }
    Ok(())
}

fn print_session(key: &SessionKey, s: &SessionInfo, out: &mut impl Write) -> std::io::Result<()> {
    let st = &s.state;
    writeln!(out, "  session {key} (partition {})", s.partition)?;
    writeln!(out, "    generation      {}", st.generation)?;
    writeln!(out, "    last upload     {}", time(Some(st.last_upload_at)))?;
    if let Some(id) = &st.last_applied_event_id {
        writeln!(out, "    last event_id   {id}")?;
    }
    match st.track {
        Some(t) => writeln!(
            out,
            "    CallTrack       time {} · delay {} ms",
            format_rfc3339_ms(t.time),
            t.delay
        )?,
        None => writeln!(out, "    CallTrack       -")?,
    }
    match &st.round {
        Some(r) => {
            writeln!(
                out,
                "    open round      {} upload(s) · start {} · deadline {} · delay {} ms",
                r.uploads,
                format_rfc3339_ms(r.start),
                format_rfc3339_ms(r.deadline),
                r.delay
            )?;
            if let Some(m) = r.max_wait_at {
                writeln!(out, "    max-wait at     {}", format_rfc3339_ms(m))?;
            }
            if !r.parts.is_empty() {
                writeln!(out, "    parts seen      {:?}", r.parts)?;
            }
        }
        None => writeln!(out, "    open round      -")?,
    }
    let what = if st.round.is_some() {
        "round due"
    } else {
        "state expires"
    };
    writeln!(
        out,
        "    next due        {} ({what})",
        format_rfc3339_ms(s.next_due)
    )
}
