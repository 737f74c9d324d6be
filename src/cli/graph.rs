//! `llama-graph graph`: build the graph from model arguments and show it.

use clap::Args;
use llama_graph::ir::dot::{to_dot, DotOptions};
use llama_graph::ir::{print, Bindings, Graph, RopeScaling};
use llama_graph::model::{build_llama, BuildOptions, ModelArgs};
use llama_graph::passes::{partition, run_pipeline, PassList, PipelineReport, StagePlan};
use llama_graph::plan::{compile, PlanLimits};
use std::path::PathBuf;

#[derive(Debug, Args)]
pub struct GraphArgs {
    /// Meta-style params.json describing the model.
    #[arg(long, value_name = "PATH")]
    pub params: PathBuf,
    /// Context length to plan the KV cache for (default 2048, capped by the
    /// model's own limit).
    #[arg(short = 'c', long = "ctx-size", value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub ctx_size: Option<u64>,
    /// Prefill chunk (tokens per step) used to evaluate the peak shapes.
    #[arg(short = 'b', long = "batch-size", value_name = "N", default_value_t = 512, value_parser = clap::value_parser!(u64).range(1..))]
    pub batch_size: u64,
    /// Vocabulary size, when params.json says -1 (take it from the tokenizer).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub vocab_size: Option<u64>,
    /// Print Graphviz DOT (one cluster per layer).
    #[arg(long, conflicts_with_all = ["json", "text"])]
    pub dot: bool,
    /// With --dot: draw only the first N layers.
    #[arg(long, value_name = "N", requires = "dot")]
    pub layers: Option<usize>,
    /// Print the graph as JSON (the serde form, which round-trips).
    #[arg(long, conflicts_with = "text")]
    pub json: bool,
    /// Print the canonical text dump, one line per node (the snapshot format).
    #[arg(long)]
    pub text: bool,
    /// Optimisation passes to run before showing the graph: `all`, `none` or
    /// a comma-separated list (they always run in declared order). Default:
    /// none (the builder's graph), or all when --after is given. Passes:
    /// fold_rope_table, fold_norm_weight, fuse_qkv, fuse_gate_up,
    /// fuse_residual, fuse_attention, fuse_rope_cache, last_logits,
    /// pack_weights, compress_weights, interleave_weights, dead_code.
    #[arg(long = "passes", value_name = "LIST", value_parser = super::flags::parse_passes)]
    pub passes: Option<String>,
    /// Show the graph as it is right after this pass (one of the selected
    /// passes), e.g. `--dot --after fuse_qkv`.
    #[arg(long = "after", value_name = "PASS")]
    pub after: Option<String>,
    /// Write statistics as JSON: node counts before/after each pass, op
    /// counts and the buffer plan's figures for -b/-c (keys nodes_before,
    /// nodes_after, nodes_per_layer_before, nodes_per_layer_after,
    /// naive_activation_bytes, arena_bytes, passes, ...).
    #[arg(long = "stats-json", value_name = "FILE")]
    pub stats_json: Option<PathBuf>,
    /// Partition the graph (after the passes) into N pipeline stages
    /// balanced by weight bytes, as `--pipeline` does over N MPI ranks, and
    /// show the stages (DOT: one cluster per stage; text: one section per
    /// stage; summary: each stage's layers and weight bytes).
    #[arg(long = "stages", value_name = "N", conflicts_with = "json", value_parser = clap::value_parser!(u64).range(1..))]
    pub stages: Option<u64>,
    /// Partition into stages of these many layers (comma-separated), as
    /// `--pipeline --layers-per-stage` does.
    #[arg(long = "layers-per-stage", value_name = "N,N,..", value_delimiter = ',', conflicts_with_all = ["json", "stages"])]
    pub layers_per_stage: Option<Vec<usize>>,
}

pub fn load_params(path: &PathBuf) -> Result<ModelArgs, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    ModelArgs::from_params_json(&text).map_err(|e| format!("{}: {e}", path.display()))
}

pub fn run(a: GraphArgs) -> super::CliResult {
    let mut args = load_params(&a.params)?;
    if let Some(v) = a.vocab_size {
        args.vocab_size = Some(v as usize);
    }
    let ctx = args.plan_context(a.ctx_size.map(|c| c as usize));
    let show_summary = !(a.dot || a.json || a.text);
    if show_summary && args.vocab_size.is_none() {
        // Show what can be derived before saying why there is no graph.
        print!("{}", args_summary(&args, ctx));
    }
    let mut graph = build_llama(&args, &BuildOptions::new(ctx))
        .map_err(|e| format!("{e} (pass --vocab-size N)"))?;
    let mut passes = match (&a.passes, &a.after) {
        (Some(p), _) => PassList::parse(p)?,
        (None, Some(_)) => PassList::all(),
        (None, None) => PassList::none(),
    };
    if let Some(after) = &a.after {
        if !passes.contains(after) {
            return Err(format!(
                "--after {after}: not one of the selected passes ({})",
                passes.names().join(", ")
            )
            .into());
        }
        let keep: Vec<&str> = passes
            .names()
            .into_iter()
            .take_while(|n| n != after)
            .chain([after.as_str()])
            .collect();
        passes = PassList::parse(&keep.join(","))?;
    }
    let unoptimised = if a.stats_json.is_some() {
        Some(graph.clone())
    } else {
        None
    };
    let report = run_pipeline(&mut graph, &passes, |_, _| {}).map_err(|e| e.to_string())?;
    if let (Some(path), Some(before)) = (&a.stats_json, &unoptimised) {
        let json = stats_json(&graph, before, &report, &passes, ctx, a.batch_size as usize)?;
        std::fs::write(path, json).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    let plan = match (&a.stages, &a.layers_per_stage) {
        // As every rank computes it: balanced on the builder's graph.
        (Some(n), _) => Some(llama_graph::dist::stage_plan(
            &args,
            &Default::default(),
            *n as usize,
            None,
        )?),
        (None, Some(c)) => Some(StagePlan::from_counts(c, args.n_layers)?),
        (None, None) => None,
    };
    if let Some(plan) = plan {
        let part = partition(&graph, &plan).map_err(|e| e.to_string())?;
        if a.dot {
            print!(
                "{}",
                part.to_dot(DotOptions {
                    max_layers: a.layers
                })?
            );
        } else if a.text {
            print!("{}", part.dump()?);
        } else {
            println!("{} stages, layers {}", plan.n_stages(), plan.describe());
            for s in &part.stages {
                let bytes: usize = s
                    .graph
                    .node_ids()
                    .filter(|&i| matches!(s.graph.node(i).op, llama_graph::ir::Op::Weight { .. }))
                    .map(|i| {
                        let m = &s.graph.node(i).meta;
                        m.shape
                            .const_numel()
                            .and_then(|n| m.dtype.bytes_for(n))
                            .unwrap_or(0)
                    })
                    .sum();
                let kernels = s.graph.node_count();
                println!(
                    "  {}: {:.2} GiB of weights, {kernels} nodes",
                    s.label(plan.n_stages()),
                    bytes as f64 / (1u64 << 30) as f64
                );
            }
        }
        return Ok(());
    }
    if a.dot {
        print!(
            "{}",
            to_dot(
                &graph,
                DotOptions {
                    max_layers: a.layers
                }
            )?
        );
    } else if a.json {
        println!("{}", graph.to_json()?);
    } else if a.text {
        print!("{}", print::dump(&graph)?);
    } else {
        print!("{}", summary(&args, &graph, ctx, a.batch_size as usize)?);
        if !passes.is_empty() {
            println!(
                "passes: {} ({} -> {} nodes, {} -> {} per layer)",
                passes.names().join(", "),
                report.nodes_before,
                report.nodes_after,
                report.nodes_per_layer_before,
                report.nodes_per_layer_after
            );
        }
    }
    Ok(())
}

/// The derived model arguments, one per line.
pub fn args_summary(args: &ModelArgs, ctx: usize) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(s, "model arguments");
    let _ = writeln!(s, "  dim               {}", args.dim);
    let _ = writeln!(s, "  n_layers          {}", args.n_layers);
    let _ = writeln!(s, "  n_heads           {}", args.n_heads);
    let _ = writeln!(s, "  n_kv_heads        {}", args.n_kv_heads);
    let _ = writeln!(s, "  head_dim          {}", args.head_dim());
    let _ = writeln!(s, "  n_rep             {}", args.n_rep());
    let _ = writeln!(s, "  ffn_hidden_dim    {}", args.ffn_hidden_dim);
    let vocab = args
        .vocab_size
        .map(|v| v.to_string())
        .unwrap_or_else(|| "from tokenizer".into());
    let _ = writeln!(s, "  vocab_size        {vocab}");
    let _ = writeln!(s, "  norm_eps          {:e}", args.norm_eps);
    let _ = writeln!(s, "  rope_theta        {}", args.rope_theta);
    match args.rope_scaling {
        Some(RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_context,
        }) => {
            let _ = writeln!(
                s,
                "  rope scaling      llama3 (factor {factor}, low {low_freq_factor}, high {high_freq_factor}, original context {original_context})",
            );
        }
        Some(RopeScaling::Linear { factor }) => {
            let _ = writeln!(s, "  rope scaling      linear (factor {factor})");
        }
        None => {
            let _ = writeln!(s, "  rope scaling      none");
        }
    }
    let _ = writeln!(s, "  tied output head  {}", args.tied_embeddings);
    let _ = writeln!(s, "  planned context   {ctx}");
    s
}

/// A readable summary: derived arguments, node counts by op, peak shapes.
pub fn summary(args: &ModelArgs, g: &Graph, ctx: usize, chunk: usize) -> Result<String, String> {
    use std::fmt::Write;
    let mut s = args_summary(args, ctx);
    let per_layer = g.nodes_per_layer();
    let _ = writeln!(s, "graph");
    let _ = writeln!(
        s,
        "  nodes             {} ({} per layer)",
        g.node_count(),
        per_layer.first().copied().unwrap_or(0)
    );
    let _ = writeln!(s, "  nodes by op");
    for (op, n) in g.op_counts() {
        let _ = writeln!(s, "    {op:<12} {n}");
    }
    // Peak shapes: the largest activations at a full prefill chunk of one
    // sequence as long as the context (S = chunk, N = 1, T = C).
    let b = Bindings::new(chunk.min(ctx), 1, ctx);
    let mut acts: Vec<(usize, String)> = Vec::new();
    for id in g.topo_order().map_err(|e| e.to_string())? {
        let n = g.node(id);
        if n.op.is_source() {
            continue;
        }
        acts.push((n.meta.shape.numel(&b), format!("{} {}", n.name, n.meta)));
    }
    acts.sort_by(|x, y| y.0.cmp(&x.0).then(x.1.cmp(&y.1)));
    let _ = writeln!(s, "peak shapes (S = {}, T = {ctx})", b.s);
    let mut seen = std::collections::BTreeSet::new();
    for (n, desc) in acts {
        // One line per distinct shape kind, by the node's name without its layer.
        let name = desc.split_whitespace().next().unwrap_or_default();
        let key = match name.strip_prefix("layers.") {
            Some(rest) => rest
                .split_once('.')
                .map(|(_, r)| r)
                .unwrap_or(rest)
                .to_string(),
            None => name.to_string(),
        };
        if !seen.insert(key) {
            continue;
        }
        let _ = writeln!(
            s,
            "  {desc:<60} {n} elements ({:.1} MiB)",
            n as f64 * 4.0 / 1048576.0
        );
        if seen.len() == 5 {
            break;
        }
    }
    Ok(s)
}

/// The `--stats-json` document.
pub fn stats_json(
    graph: &Graph,
    before: &Graph,
    report: &PipelineReport,
    passes: &PassList,
    ctx: usize,
    chunk: usize,
) -> Result<String, String> {
    let limits = PlanLimits::one_sequence(chunk, ctx);
    let plan = compile(graph, &limits).map_err(|e| e.to_string())?;
    let base = compile(before, &limits).map_err(|e| e.to_string())?;
    let b = &plan.buffers;
    let check = |p: &llama_graph::plan::BufferPlan| match p.check() {
        Ok(()) => "ok".to_string(),
        Err(e) => e,
    };
    let packed: Vec<_> = graph.packed().collect();
    let v = serde_json::json!({
        "context": ctx,
        "batch": plan.max.s,
        "passes_selected": passes.names(),
        "nodes_before": report.nodes_before,
        "nodes_after": report.nodes_after,
        "nodes_per_layer_before": report.nodes_per_layer_before,
        "nodes_per_layer_after": report.nodes_per_layer_after,
        "op_counts_before": report.op_counts_before,
        "op_counts_after": report.op_counts_after,
        "naive_activation_bytes": b.naive_activation_bytes,
        "arena_bytes": b.arena_bytes,
        "arena_fraction_of_naive": b.arena_bytes as f64 / b.naive_activation_bytes.max(1) as f64,
        "peak_live_bytes": b.peak_live_bytes,
        "in_place": b.in_place,
        "buffers": b.buffers.len(),
        "plan_check": check(b),
        "kernel_calls_per_step": plan.order.iter().filter(|&&id| !graph.node(id).op.is_source()).count(),
        "unoptimised": {
            "naive_activation_bytes": base.buffers.naive_activation_bytes,
            "arena_bytes": base.buffers.arena_bytes,
            "peak_live_bytes": base.buffers.peak_live_bytes,
            "plan_check": check(&base.buffers),
        },
        "packed_weights": packed,
        "passes": report.passes,
    });
    serde_json::to_string_pretty(&v).map_err(|e| e.to_string())
}
