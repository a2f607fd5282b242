//! settle: a server-side debounce stream processor.
//!
//! Reads "test result uploaded" records keyed by `tenant/session` from Kafka or NATS
//! JetStream, waits per session until the uploads settle, and emits one coalesced
//! "session ready" record per round (the contract is `SEMANTICS.md`, sections cited as §N).
//! See `ARCHITECTURE.md` for the module map and the layers (imports run one way, from
//! `cli` and `service` at the top down to `engine`; `tests/offline/layering.rs` keeps it so).

pub mod admin;
pub mod cli;
pub mod codec;
pub mod config;
pub mod engine;
pub mod metrics;
pub mod runtime;
pub mod service;
pub mod store;
pub mod tiers;
pub mod transport;
