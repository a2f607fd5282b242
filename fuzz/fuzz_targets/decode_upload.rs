//! Fuzz target: one input record (key, value, timestamp, wall clock; layout in
//! `harness::Record::parse`) through `codec::decode_upload`, and what it decodes to through an
//! engine partition and the ready-record encoder (`harness::check_record`).
#![no_main]

use libfuzzer_sys::fuzz_target;
use settle_fuzz::harness;
use std::sync::OnceLock;

static POLICIES: OnceLock<[settle_fuzz::engine::PolicyTable; 4]> = OnceLock::new();

fuzz_target!(|data: &[u8]| {
    let policies = POLICIES.get_or_init(harness::policies);
    let record = harness::Record::parse(data);
    harness::check_record(&record, policies);
    // The same value bytes as a ready record read back by `settle consume`.
    harness::check_ready_bytes(record.payload);
});
