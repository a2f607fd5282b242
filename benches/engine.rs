//! Engine throughput on a mixed trace (issue: engine goal ≥ 2 M uploads/s on one core).
//!
//! The trace mixes the seed's shapes: 700-way parallel bursts into one session, slow
//! trickles, split uploads in two requests and sparse senders, over 200 tenants, all three
//! policies (per-tenant overrides); once as configured, once with learned initial delays for
//! the adaptive tenants. Run: `cargo bench --bench engine`.

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use settle::engine::{
    Driver, Engine, MemTable, Millis, Part, PolicySpec, PolicyTable, SessionKey, Upload,
};

/// A deterministic mixed trace of about `n` uploads, sorted by event time.
fn mixed_trace(n: usize) -> Vec<Upload> {
    let mut out = Vec::with_capacity(n + 1000);
    let mut t: Millis = 1_700_000_000_000;
    let mut i = 0u64;
    while out.len() < n {
        i += 1;
        let tenant = format!("tenant-{}", i % 200);
        match i % 4 {
            // 700-way burst: 700 uploads in ~2 s into one session.
            0 => {
                let key = SessionKey::new(&tenant, &format!("burst-{i}"));
                for j in 0..700 {
                    let mut u = Upload::plain(key.clone(), t + j * 3);
                    u.event_id = Some(format!("m{j}"));
                    out.push(u);
                }
            }
            // Slow trickle: 20 uploads 40 s apart, interleaved later by the sort.
            1 => {
                let key = SessionKey::new(&tenant, &format!("trickle-{i}"));
                for j in 0..20 {
                    out.push(Upload::plain(key.clone(), t + j * 40_000));
                }
            }
            // Split upload: two requests 2 s apart.
            2 => {
                let key = SessionKey::new(&tenant, &format!("split-{i}"));
                for j in 1..=2u32 {
                    let mut u = Upload::plain(key.clone(), t + (j as i64) * 2_000);
                    u.part = Some(Part { index: j, count: 2 });
                    out.push(u);
                }
            }
            // Sparse sender: one upload.
            _ => out.push(Upload::plain(
                SessionKey::new(&tenant, &format!("sparse-{i}")),
                t,
            )),
        }
        t += 250;
    }
    out.sort_by_key(|u| u.event_time);
    out
}

fn policies() -> PolicyTable {
    let mut table = PolicyTable::uniform(PolicySpec::adaptive(5_000, 600_000));
    for i in (0..200).step_by(3) {
        table.tenants.insert(
            format!("tenant-{i}"),
            PolicySpec::fixed(10_000).with_max_wait(60_000),
        );
    }
    for i in (1..200).step_by(3) {
        table
            .tenants
            .insert(format!("tenant-{i}"), PolicySpec::leading_trailing(10_000));
    }
    table
}

/// [`policies`] with learned initial delays for the `adaptive` tenants (the default).
fn policies_learning() -> PolicyTable {
    let mut table = policies();
    table.default = table.default.with_learned_initial_delay(true);
    table
}

fn bench_engine(c: &mut Criterion) {
    let trace = mixed_trace(200_000);
    let mut group = c.benchmark_group("engine");
    group.throughput(Throughput::Elements(trace.len() as u64));
    group.sample_size(20);
    for (name, table) in [
        ("mixed_trace_driver_memtable", policies()),
        ("mixed_trace_driver_memtable_learning", policies_learning()),
    ] {
        bench_trace(&mut group, name, &trace, table);
    }
    group.finish();
}

fn bench_trace(
    group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    name: &str,
    trace: &[Upload],
    table: PolicyTable,
) {
    group.bench_function(name, |b| {
        b.iter_batched(
            || {
                (
                    Driver::new(Engine::new(table.clone())),
                    MemTable::new(),
                    Vec::with_capacity(1 << 16),
                )
            },
            |(mut driver, mut table, mut out)| {
                for u in trace {
                    driver
                        .apply(&mut table, u.event_time, u, &mut out)
                        .expect("in-memory table cannot fail");
                    if out.len() > 60_000 {
                        out.clear();
                    }
                }
                driver.stats
            },
            BatchSize::LargeInput,
        )
    });
}

criterion_group!(benches, bench_engine);
criterion_main!(benches);
