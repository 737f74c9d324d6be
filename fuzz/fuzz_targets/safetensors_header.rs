//! Arbitrary bytes through our safetensors header checks, differentially
//! against Hugging Face's `safetensors` crate: whatever we accept it must
//! accept (we call it last), and whatever it accepts we may refuse only for
//! the checks we add on top (duplicate names, our dtype allow-list). An
//! accepted file's tensors must lie inside it.
#![no_main]
use libfuzzer_sys::fuzz_target;
use llama_graph::weights::safetensors::{parse_header, read_safetensors_bytes, SafetensorsError};

fuzz_target!(|data: &[u8]| {
    let ours = parse_header(data);
    let lib = safetensors::SafeTensors::read_metadata(data);
    match (&ours, &lib) {
        (Ok(h), Ok(_)) => {
            for t in &h.tensors {
                assert!(t.begin <= t.end && h.data_start + t.end <= data.len());
            }
            let store = read_safetensors_bytes(data).expect("accepted once, accepted twice");
            assert_eq!(store.tensors.len(), h.tensors.len());
        }
        (Ok(_), Err(e)) => panic!("we accept what the library refuses: {e}"),
        (Err(SafetensorsError::DuplicateTensor(_) | SafetensorsError::UnsupportedDtype { .. }), Ok(_)) => {}
        (Err(e), Ok(_)) => panic!("we refuse what the library accepts: {e}"),
        (Err(e), Err(_)) => {
            let msg = e.to_string();
            assert!(!msg.is_empty() && !msg.contains('\n'));
        }
    }
});
