//! Fuzz the sentencepiece ModelProto parser; when a model loads, also
//! encode/decode a few strings with it.
#![no_main]
use libfuzzer_sys::fuzz_target;
use llama_graph::tokenizer::{EncodeOptions, Tokenizer};

fuzz_target!(|data: &[u8]| {
    if let Ok(t) = Tokenizer::from_sentencepiece_bytes(data) {
        for s in ["", " ", "hello world", "a  b\n\tc 😀 日本 <s></s>"] {
            for parse_special in [false, true] {
                let ids = t.encode(
                    s,
                    EncodeOptions {
                        add_bos: true,
                        parse_special,
                    },
                );
                let _ = t.decode(&ids);
            }
        }
        let n = t.n_vocab() as u32;
        let _ = t.decode(&[0, n.saturating_sub(1), n, u32::MAX]);
    }
});
