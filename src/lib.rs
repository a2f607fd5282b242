//! settle: a server-side debounce stream processor.
//!
//! Reads "test result uploaded" records keyed by `tenant/session` from Kafka or NATS
//! JetStream, waits per session until the uploads settle, and emits one coalesced
//! "session ready" record per round (the contract is `SEMANTICS.md`, sections cited as §N).
//! See `ARCHITECTURE.md` for the module map.

pub mod admin;
pub mod codec;
pub mod config;
pub mod consume;
pub mod demo;
pub mod engine;
pub mod inspect;
pub mod loadgen;
pub mod metrics;
pub mod noisy;
pub mod report;
pub mod runtime;
pub mod simulate;
pub mod store;
pub mod tiers;
pub mod trace_source;
pub mod transport;
pub mod tune;
