//! The restricted pickle VM on arbitrary bytes: must return Ok or Err, never
//! panic, hang or allocate unboundedly.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = llama_graph::weights::pth::pickle::unpickle(data);
});
