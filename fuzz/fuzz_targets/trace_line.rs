//! Fuzz target: arbitrary text as a JSONL trace line of `settle simulate` / `settle tune`
//! (`harness::check_trace_line`).
#![no_main]

use libfuzzer_sys::fuzz_target;
use settle_fuzz::harness;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        harness::check_trace_line(text);
    }
});
