//! Build a model's graph from its arguments, run the optimisation passes,
//! and print the result as Graphviz DOT (no weights needed).
//!
//! ```sh
//! cargo run --release --example graph_dot -- graphs/tiny/params.json | dot -Tsvg > tiny.svg
//! ```
use llama_graph::ir::dot::{to_dot, DotOptions};
use llama_graph::model::{build_llama, BuildOptions, ModelArgs};
use llama_graph::passes::{run_pipeline, PassList};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "graphs/tiny/params.json".into());
    // Meta's params.json: dim, n_layers, n_heads, ... (vocab_size included).
    let args = ModelArgs::from_params_json(&std::fs::read_to_string(&path)?)?;

    // The builder's graph for a 256-position context: every node has a
    // checked shape and dtype.
    let mut graph = build_llama(&args, &BuildOptions::new(256))?;
    let report = run_pipeline(&mut graph, &PassList::all(), |_, _| {})?;
    eprintln!(
        "{} nodes before the passes, {} after ({} per layer)",
        report.nodes_before, report.nodes_after, report.nodes_per_layer_after
    );
    print!(
        "{}",
        to_dot(
            &graph,
            DotOptions {
                max_layers: Some(1)
            }
        )?
    );
    Ok(())
}
