//! The parts of settle that read untrusted input, compiled for fuzzing: the engine
//! (`../src/engine`), the codecs (`../src/codec/`) and the configuration (`../src/config`),
//! included by path so that the fuzz build needs neither RocksDB nor librdkafka. The same
//! files as the product, not copies. [`harness`] holds what the fuzz targets check, so that
//! `tests/offline/fuzz_corpus.rs` can run the seed corpus through the same checks.
#![allow(dead_code, unused_imports)]

#[path = "../../src/codec/mod.rs"]
pub mod codec;
#[path = "../../src/config/mod.rs"]
pub mod config;
#[path = "../../src/engine/mod.rs"]
pub mod engine;

#[path = "harness.rs"]
pub mod harness;
