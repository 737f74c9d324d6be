//! Command-line interface: argument definitions and dispatch.
mod bench;
mod chat;
mod convert;
mod flags;
mod graph;
mod model;
mod perplexity;
mod pipeline;
mod run;
mod serve;
mod tools;

use clap::{Parser, Subcommand};

/// A graph-compiled inference runtime for Llama-architecture models on CPU.
///
/// Text goes to stdout; logs, progress and statistics go to stderr.
#[derive(Debug, Parser)]
#[command(name = "llama-graph", version, about, long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Build the forward graph of a model and print a summary, its text dump,
    /// Graphviz DOT or JSON.
    Graph(graph::GraphArgs),
    /// Generate text from a prompt. Generated text goes to stdout as it
    /// streams; the statistics go to stderr.
    Run(Box<run::RunArgs>),
    /// Measure a model's perplexity over a text, or its KL divergence from
    /// a reference run, with llama-perplexity's method and file format.
    Perplexity(perplexity::PerplexityArgs),
    /// Measure prompt-processing (ppN) and generation (tgN) throughput with llama-bench's flags and rows.
    Bench(bench::BenchArgs),
    /// Serve an OpenAI-compatible HTTP API (chat and text completions,
    /// streaming, /metrics) on 127.0.0.1:8080 by default.
    Serve(serve::ServeArgs),
    /// Chat interactively; the KV cache is kept across turns. Ctrl-D or
    /// /exit ends the conversation.
    Chat(chat::ChatArgs),
    /// Print the token ids of a text.
    Tokenize(tools::TokenizeArgs),
    /// List a model's tensors (dtype, shape, bytes) and derived arguments.
    Inspect(tools::InspectArgs),
    /// Fetch the default model (SmolLM2-135M-Instruct Q4_1) into the cache.
    Pull,
    /// Write a random-weight Meta checkpoint (any params.json, seeded).
    GenCheckpoint(tools::GenCheckpointArgs),
    /// Convert a Meta, Hugging Face or GGUF model (Llama, Mistral, Qwen2,
    /// Qwen3, Gemma 3, Phi-3) into a GGUF file that llama.cpp runs (f32,
    /// f16, bf16, q8_0, q4_0, q4_k_m, q5_k_m, q6_k).
    Convert(convert::ConvertArgs),
}

/// llama.cpp's multi-letter short flags (clap's short flags are one
/// letter) become their long forms: `-np` → `--parallel`, `-ctk` →
/// `--cache-type-k`, `-ctv` → `--cache-type-v`; everything else is left as
/// it is.
pub fn normalize_args(
    args: impl IntoIterator<Item = std::ffi::OsString>,
) -> Vec<std::ffi::OsString> {
    args.into_iter()
        .map(|a| match a.to_str() {
            Some("-np") => "--parallel".into(),
            Some("-ctk") => "--cache-type-k".into(),
            Some("-ctv") => "--cache-type-v".into(),
            _ => a,
        })
        .collect()
}

pub type CliResult = Result<(), Box<dyn std::error::Error>>;

pub fn run(cli: Cli) -> CliResult {
    // A bad LLAMA_GRAPH_ISA is refused before any work.
    llama_graph::kernels::Isa::from_env()?;
    match cli.command {
        Command::Graph(a) => graph::run(a),
        Command::Run(a) => run::run(*a),
        Command::Bench(a) => bench::run(a),
        Command::Perplexity(a) => perplexity::run(a),
        Command::Chat(a) => chat::run(a),
        Command::Serve(a) => serve::run(a),
        Command::Tokenize(a) => tools::tokenize(a),
        Command::Inspect(a) => tools::inspect(a),
        Command::Pull => tools::pull(),
        Command::GenCheckpoint(a) => tools::gen_checkpoint(a),
        Command::Convert(a) => convert::run(a),
    }
}
