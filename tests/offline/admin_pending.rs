//! `GET /v1/pending` and `/v1/pending/summary` (issue "operate it by hand", SEMANTICS §7) on
//! the real runtime: RocksDB stores, the memory transport, HTTP over loopback. Enough open
//! rounds that each partition answers in several slices; every round is listed once across
//! the pages, with what its store holds; filters, the summary's counts and bad parameters.

use crate::admin_support::get_json;
use crate::runtime_support::*;
use serde_json::Value;
use settle::admin::{AdminServer, AdminState};
use settle::codec::format_rfc3339_ms;
use settle::engine::{Engine, Millis, PolicySpec, PolicyTable};
use settle::runtime::pending::SLICE_TIMERS;
use settle::runtime::{Clock, Runtime};
use settle::transport::memory::{partition_for_key, MemoryBroker};
use std::collections::BTreeMap;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

const HOUR: Millis = 3_600_000;
/// Bound on waiting for the runtime (a hang guard, not a speed assertion).
const PATIENCE: Duration = Duration::from_secs(120);

/// Tenant `ada`'s adaptive floor (ms): its rounds are due this long after their uploads, on
/// the wall clock. Five minutes: the evicted variant took 60–70 s alone in a debug build on
/// a slow machine and over two minutes beside the other tests, and with a 2-minute floor
/// its rounds were overdue by the summary (`lt_10m` 1 of 3).
const ADA_DELAY: Millis = 300_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_rounds_are_listed_page_by_page_and_counted() {
    listed_page_by_page(false).await;
}

/// The same listing after a restart with a session cache too small to hold any state: each
/// round's state is read from RocksDB by the slices (each bounded by its time budget,
/// `pending::SLICE_BUDGET`), and every round is still listed once, in order, as stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_rounds_of_evicted_sessions_are_listed_from_rocksdb() {
    listed_page_by_page(true).await;
}

async fn listed_page_by_page(evicted: bool) {
    let dir = tempfile::tempdir().unwrap();
    let broker = MemoryBroker::new(TOPIC, 2);
    // Default fixed 1 h; tenant `ada` adaptive 5 min .. 1 h (due in 5 min: bucket < 10 min,
    // and not overdue however slowly a loaded machine runs the test up to its summary).
    let mut table = PolicyTable::uniform(PolicySpec::fixed(HOUR));
    table
        .tenants
        .insert("ada".into(), PolicySpec::adaptive(ADA_DELAY, HOUR));
    let clock = settle::runtime::TokioClock::starting_at(T0);
    let mut opts = options(dir.path());
    if evicted {
        opts.store.session_cache_bytes = 1;
    }

    // More sessions than one slice walks per partition: `bulk` has 1 upload each; `ada` 3
    // sessions of 3 uploads.
    let bulk = 2 * SLICE_TIMERS + 300;
    let base = clock.now_ms() - 5_000;
    for i in 0..bulk {
        produce(
            &broker,
            "bulk",
            &format!("s{i}"),
            base + (i % 1000) as Millis,
        );
    }
    for s in 0..3 {
        for i in 0..3 {
            produce(&broker, "ada", &format!("a{s}"), base + i * 100);
        }
    }
    let total = (0..broker.partitions())
        .map(|p| broker.end_offset(p))
        .sum::<i64>();
    let applied = |m: &settle::runtime::StatusMap| {
        all(m, 2, |s| {
            s.caught_up && s.next_offset == Some(broker.end_offset(s.partition))
        }) && m.values().map(|s| s.pending_rounds).sum::<u64>() == bulk as u64 + 3
    };
    if evicted {
        // A first run applies every upload and stops: the states are in RocksDB, and the
        // run below (same stores, a cache that holds none) reads them from there.
        let runtime = Runtime::new(
            Engine::new(table.clone()),
            broker.sink(),
            clock,
            opts.clone(),
        )
        .unwrap();
        let status = runtime.status();
        let shutdown = CancellationToken::new();
        let run = tokio::spawn(runtime.run(broker.source(GROUP), shutdown.clone()));
        tokio::time::timeout(PATIENCE, status.wait_for(applied))
            .await
            .expect("first run applies every upload");
        shutdown.cancel();
        run.await.unwrap().unwrap();
    }
    let runtime = Runtime::new(Engine::new(table), broker.sink(), clock, opts).unwrap();
    let status = runtime.status();
    let server = AdminServer::start("127.0.0.1:0".parse().unwrap(), AdminState::new(&runtime))
        .await
        .unwrap();
    let addr = server.local_addr();
    let shutdown = CancellationToken::new();
    let run = tokio::spawn(runtime.run(broker.source(GROUP), shutdown.clone()));
    tokio::time::timeout(PATIENCE, status.wait_for(applied))
        .await
        .expect("runtime applies every upload");
    assert!(total > 0);

    // Every round once, across pages of 1000, in partition then due order.
    let mut seen: BTreeMap<String, Value> = BTreeMap::new();
    let mut cursor: Option<String> = None;
    let mut pages = 0;
    let mut last: Option<(i64, String)> = None;
    loop {
        let path = match &cursor {
            Some(c) => format!("/v1/pending?limit=1000&cursor={c}"),
            None => "/v1/pending?limit=1000".to_owned(),
        };
        let (code, page) = get_json(addr, &path).await;
        assert_eq!(code, 200, "{page}");
        assert_eq!(page["partitions"], serde_json::json!([0, 1]));
        assert_eq!(page["unavailable"], serde_json::json!([]));
        pages += 1;
        for r in page["rounds"].as_array().unwrap() {
            let key = r["key"].as_str().unwrap().to_owned();
            let p = r["partition"].as_i64().unwrap();
            assert_eq!(p, i64::from(partition_for_key(key.as_bytes(), 2)), "{r}");
            let order = (p, format!("{}|{key}", r["due_at"].as_str().unwrap()));
            if let Some(prev) = &last {
                assert!(*prev < order, "listed in order: {prev:?} then {order:?}");
            }
            last = Some(order);
            assert!(seen.insert(key, r.clone()).is_none(), "listed twice: {r}");
        }
        cursor = page["next_cursor"].as_str().map(str::to_owned);
        if cursor.is_none() {
            break;
        }
        assert!(pages < 100, "the listing ends");
    }
    assert_eq!(seen.len(), bulk + 3);
    assert!(pages >= (bulk + 3).div_ceil(1000), "{pages} pages");
    // A bulk round as its store holds it.
    let r = &seen["bulk/s7"];
    let at = base + 7;
    assert_eq!(r["tenant"], "bulk");
    assert_eq!(r["session"], "s7");
    assert_eq!(r["uploads"], 1);
    assert_eq!(r["policy"], "fixed");
    assert_eq!(r["tier"], "normal");
    assert_eq!(r["first_upload_at"], format_rfc3339_ms(at));
    assert_eq!(r["due_at"], format_rfc3339_ms(at + HOUR));
    assert_eq!(r["delay_ms"], HOUR);
    assert_eq!(r["max_wait_at"], Value::Null);
    assert_eq!(r["waiting"], "debounce");
    // ada: 3 uploads, adaptive, the delay its CallTrack learned (its 5 min floor).
    let a = &seen["ada/a1"];
    assert_eq!(
        (a["uploads"].as_u64(), a["policy"].as_str()),
        (Some(3), Some("adaptive"))
    );
    assert_eq!(a["last_upload_at"], format_rfc3339_ms(base + 200));
    assert_eq!(a["due_at"], format_rfc3339_ms(base + 200 + ADA_DELAY));

    // Filters. A selective filter's page can end short with a cursor (a page asks for at
    // most `PAGE_SLICES` slices, and a slice over evicted keys ends after 2 ms of reads: on
    // a loaded machine, after 32 timers), so the whole listing is the pages chained.
    let rows = all_pages(addr, "/v1/pending?tenant=ada&min_uploads=3").await;
    let keys: Vec<&str> = rows.iter().map(|r| r["key"].as_str().unwrap()).collect();
    assert_eq!(keys.len(), 3, "{rows:?}");
    assert!(keys.iter().all(|k| k.starts_with("ada/")));
    let (_, page) = get_json(addr, "/v1/pending?policy=adaptive&partition=0,1&limit=1").await;
    assert_eq!(page["rounds"].as_array().unwrap().len(), 1);
    assert!(
        page["next_cursor"].is_string(),
        "a page of 1 of 3 has a next one"
    );
    let cut = format_rfc3339_ms(base + 500 + HOUR);
    let rows = all_pages(
        addr,
        &format!("/v1/pending?tenant=bulk&due_before={cut}&limit=1000"),
    )
    .await;
    let early = seen
        .values()
        .filter(|r| r["tenant"] == "bulk" && r["due_at"].as_str().unwrap() < cut.as_str())
        .count();
    assert!(early > 0);
    assert_eq!(rows.len(), early);
    let (_, page) = get_json(addr, "/v1/pending?partition=1&limit=1000").await;
    assert!(page["rounds"]
        .as_array()
        .unwrap()
        .iter()
        .all(|r| r["partition"] == 1));
    assert_eq!(page["partitions"], serde_json::json!([1]));

    // Summary: all of them, by tier and by due bucket (bulk due in ~1 h: later; ada < 10 min).
    let (code, sum) = get_json(addr, "/v1/pending/summary").await;
    assert_eq!(code, 200, "{sum}");
    assert_eq!(sum["rounds"], bulk as u64 + 3);
    assert_eq!(sum["uploads"], bulk as u64 + 9);
    assert_eq!(sum["by_due"]["later"], bulk as u64);
    assert_eq!(sum["by_due"]["lt_10m"], 3);
    assert_eq!(sum["by_due"]["overdue"], 0);
    assert_eq!(sum["by_tier"]["normal"]["rounds"], bulk as u64 + 3);
    assert_eq!(sum["tenants"], 2);
    assert_eq!(sum["owed"], 0);
    assert_eq!(sum["truncated"], false);
    assert_eq!(sum["partitions"].as_array().unwrap().len(), 2);
    let (_, sum) = get_json(addr, "/v1/pending/summary?tenant=ada").await;
    assert_eq!(
        (sum["rounds"].as_u64(), sum["uploads"].as_u64()),
        (Some(3), Some(9))
    );

    // Bad parameters: 400 naming what is wrong.
    for (path, says) in [
        ("/v1/pending?color=red", "unknown parameter \"color\""),
        ("/v1/pending?limit=0", "limit"),
        ("/v1/pending?cursor=zz", "cursor"),
        ("/v1/pending?tier=gold", "tier \"gold\""),
        ("/v1/pending?tenant=a%20b", "tenant"),
        ("/v1/pending?policy=lazy", "policy"),
        ("/v1/pending?due_before=yesterday", "due_before"),
        ("/v1/pending?partition=-1", "partition"),
        ("/v1/pending/summary?limit=5", "unknown parameter \"limit\""),
    ] {
        let (code, body) = get_json(addr, path).await;
        assert_eq!(code, 400, "{path}: {body}");
        assert!(
            body["error"].as_str().unwrap().contains(says),
            "{path}: {body}"
        );
    }

    shutdown.cancel();
    run.await.unwrap().unwrap();
    server.stop().await;
}

/// Every row of the listing `path` (a `/v1/pending?...` query), its pages chained by their
/// cursors until one has none. Fails if a page is not 200 or the chain does not end.
async fn all_pages(addr: std::net::SocketAddr, path: &str) -> Vec<Value> {
    let mut rows = Vec::new();
    let mut cursor: Option<String> = None;
    for _ in 0..1000 {
        let url = match &cursor {
            Some(c) => format!("{path}&cursor={c}"),
            None => path.to_owned(),
        };
        let (code, page) = get_json(addr, &url).await;
        assert_eq!(code, 200, "{url}: {page}");
        rows.extend(page["rounds"].as_array().unwrap().iter().cloned());
        cursor = page["next_cursor"].as_str().map(str::to_owned);
        if cursor.is_none() {
            return rows;
        }
    }
    panic!("{path}: the listing did not end within 1 000 pages");
}
