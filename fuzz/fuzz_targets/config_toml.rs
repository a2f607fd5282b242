//! Fuzz target: arbitrary text as settle.toml (`harness::check_config`): refused with a
//! message, or accepted and able to drive the engine.
#![no_main]

use libfuzzer_sys::fuzz_target;
use settle_fuzz::harness;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        harness::check_config(text);
    }
});
