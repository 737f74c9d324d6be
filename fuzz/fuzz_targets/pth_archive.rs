//! The whole .pth opening path (zip central directory, local headers,
//! inflate, data.pkl, tensor layout checks, strided copies) on arbitrary
//! bytes. Seed with tests/fixtures/pth/*.pth.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(store) = llama_graph::weights::pth::read_pth_bytes(data) {
        // Every returned tensor's bytes must match its shape.
        for t in store.tensors.values() {
            let n: usize = t.shape.iter().product();
            assert_eq!(t.dtype.bytes_for(n), Some(t.data.len()));
        }
    }
});
