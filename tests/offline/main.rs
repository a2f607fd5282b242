//! The integration tests that need no service and start no process: the engine against its
//! model, RocksDB stores, the runtime on the memory transport (paused tokio time), tiers, the
//! tuner, the codec's schema, the admin endpoints on loopback, and source checks.
//!
//! One test binary (one link of RocksDB and librdkafka) with a module per former
//! `tests/*.rs` file; the tests run as threads of one process, so none may set process-wide
//! state (environment variables, the working directory, a global tracing subscriber it
//! relies on). `tests/e2e/` holds the tests that need brokers or spawn `settle`;
//! `tests/config_load.rs` stays its own binary because it changes the environment.
//!
//! `cargo test --test offline` runs them; `cargo test --test offline -- store_` one group.

#[path = "../support/admin.rs"]
mod admin_support;
#[path = "../support/runtime.rs"]
mod runtime_support;
#[path = "../support/source.rs"]
mod source_support;

mod admin_actions;
mod admin_api;
mod admin_auth;
mod admin_overrides;
mod admin_pending;
mod admin_ui;
mod codec_schema;
mod engine_model;
mod engine_purity;
mod fuzz_corpus;
mod layering;
mod learn_runtime;
mod learn_store;
mod runtime_catch_up;
mod runtime_demo;
mod runtime_event_ids;
mod runtime_handoff;
mod runtime_inspect;
mod runtime_restart;
mod runtime_tiers;
mod runtime_timers;
mod store_batch;
mod store_cache;
mod store_changelog;
mod store_recovery;
mod store_writer;
mod tiers_config;
mod tiers_router;
mod tiers_share;
mod tune_grammar;
mod tune_learn;
mod tune_pareto;
mod tune_report;
mod tune_sweep;
