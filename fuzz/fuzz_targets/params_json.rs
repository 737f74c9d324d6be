//! Fuzz params.json parsing: any bytes give model arguments that pass
//! validation, or an error; never a panic. Valid arguments must also
//! build a graph (with a small context) or give a build error.
#![no_main]

use libfuzzer_sys::fuzz_target;
use llama_graph::model::{build_llama, BuildOptions, ModelArgs};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok(mut args) = ModelArgs::from_params_json(text) else { return };
    assert!(args.validate().is_ok());
    assert_eq!(args.dim % args.n_heads, 0);
    assert_eq!(args.n_heads % args.n_kv_heads, 0);
    // Keep graphs small enough to build quickly.
    if args.n_layers <= 4 && args.dim <= 4096 {
        args.vocab_size = Some(args.vocab_size.unwrap_or(32).min(1 << 16));
        let _ = build_llama(&args, &BuildOptions::new(8));
    }
});
