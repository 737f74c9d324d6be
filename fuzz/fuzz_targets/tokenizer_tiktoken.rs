//! Fuzz the tiktoken BPE file parser; when a vocabulary loads, also encode
//! and decode the input as text and stream-decode every id.
#![no_main]
use libfuzzer_sys::fuzz_target;
use llama_graph::tokenizer::{EncodeOptions, StreamDecoder, Tokenizer};

fuzz_target!(|data: &[u8]| {
    if let Ok(t) = Tokenizer::from_tiktoken_bytes(data) {
        let text = String::from_utf8_lossy(data);
        for parse_special in [false, true] {
            let ids = t.encode(
                &text,
                EncodeOptions {
                    add_bos: true,
                    parse_special,
                },
            );
            let _ = t.decode(&ids);
            let mut d = StreamDecoder::new(&t);
            for &i in &ids {
                let _ = d.push(i);
            }
            let _ = d.flush();
        }
    }
});
