//! Command-line interface: argument definitions and dispatch.
mod bench;
mod graph;
mod model;
mod run;

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
    Run(run::RunArgs),
    /// Measure prompt-processing (ppN) and generation (tgN) throughput with llama-bench's flags and rows.
    Bench(bench::BenchArgs),
}

pub type CliResult = Result<(), Box<dyn std::error::Error>>;

pub fn run(cli: Cli) -> CliResult {
    match cli.command {
        Command::Graph(a) => graph::run(a),
        Command::Run(a) => run::run(a),
        Command::Bench(a) => bench::run(a),
    }
}
