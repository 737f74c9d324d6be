//! Optimisation passes over the graph IR.
//!
//! Each pass is a plain named function `fn(&mut Graph) -> Result<PassStats,
//! GraphError>` that rewrites what the builder emits. [`PASSES`] lists them
//! in their declared order; [`run_pipeline`] runs a selection of them in
//! that order, verifies the graph after each one and records node counts,
//! so every rewrite can be seen (`llama-graph graph --passes .. --after ..`),
//! diffed (snapshots) and trusted (fused-vs-unfused tests).
//!
//! Fused ops are variants of the closed [`Op`](crate::ir::Op) enum; the unfused graph
//! (no passes) remains a complete reference path.
//!
//! One file per pass, named after it (`fuse_qkv.rs` holds `fuse_qkv`);
//! `rewrite.rs` holds the helpers the rewriting passes share, and
//! `partition.rs` the cut into pipeline stages (not a pass of the list).

mod compress_weights;
mod dead_code;
mod fold_norm_weight;
mod fold_rope_table;
mod fuse_attention;
mod fuse_gate_up;
mod fuse_qkv;
mod fuse_residual;
mod fuse_rope_cache;
mod interleave_weights;
mod last_logits;
mod pack_weights;
pub mod partition;
mod rewrite;

use crate::ir::{Graph, GraphError};
use serde::Serialize;
use std::collections::BTreeMap;
use thiserror::Error;

pub use compress_weights::compress_weights;
pub use dead_code::dead_code;
pub use fold_norm_weight::fold_norm_weight;
pub use fold_rope_table::fold_rope_table;
pub use fuse_attention::fuse_attention;
pub use fuse_gate_up::fuse_gate_up;
pub use fuse_qkv::fuse_qkv;
pub use fuse_residual::fuse_residual;
pub use fuse_rope_cache::fuse_rope_cache;
pub use interleave_weights::interleave_weights;
pub use last_logits::last_logits;
pub use pack_weights::{pack_weights, PACKED_SUFFIX};
pub use partition::{partition, Partition, Stage, StagePlan};

/// What one pass did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PassStats {
    /// Pattern instances rewritten (for `dead_code`: nodes removed).
    pub rewrites: usize,
}

/// A named pass.
#[derive(Debug, Clone, Copy)]
pub struct Pass {
    /// The CLI name.
    pub name: &'static str,
    /// One line on what it does.
    pub summary: &'static str,
    pub run: fn(&mut Graph) -> Result<PassStats, GraphError>,
}

/// Every pass, in the order the pipeline runs them.
pub const PASSES: &[Pass] = &[
    Pass {
        name: "fold_rope_table",
        summary: "RoPE cos/sin for every position the KV pool holds, computed once (constant folding); each step gathers its tokens' rows",
        run: fold_rope_table,
    },
    Pass {
        name: "fold_norm_weight",
        summary: "RmsNorm followed by a Mul by its weight -> RmsNormScaled",
        run: fold_norm_weight,
    },
    Pass {
        name: "fuse_qkv",
        summary: "wq/wk/wv MatMuls on one input -> one MatMul over a packed wqkv weight + column slices",
        run: fuse_qkv,
    },
    Pass {
        name: "fuse_gate_up",
        summary: "silu(x·w1ᵀ) * (x·w3ᵀ) -> MatMulSwiGlu over a packed w13 weight (SwiGLU epilogue)",
        run: fuse_gate_up,
    },
    Pass {
        name: "fuse_residual",
        summary: "Add(h, MatMul(..)) -> MatMulAdd (residual add in the matmul epilogue)",
        run: fuse_residual,
    },
    Pass {
        name: "fuse_attention",
        summary: "AttnScores -> Softmax -> AttnValues -> Attention (online softmax, no S×T matrix)",
        run: fuse_attention,
    },
    Pass {
        name: "fuse_rope_cache",
        summary: "packed QKV MatMul + slices + RoPE + KV writes -> QkvRopeCache (RoPE and cache write in the epilogue)",
        run: fuse_rope_cache,
    },
    Pass {
        name: "last_logits",
        summary: "final norm and output head on the last token of each sequence only",
        run: last_logits,
    },
    Pass {
        name: "pack_weights",
        summary: "every linear layer's weight matrix -> a packed copy in the session's huge-page weight arena",
        run: pack_weights,
    },
    Pass {
        name: "compress_weights",
        summary: "every packed bf16 weight -> bf16z (lossless, 49 bytes per 32 weights plus exceptions): a quarter fewer bytes per decode step",
        run: compress_weights,
    },
    Pass {
        name: "interleave_weights",
        summary: "every packed quantized weight -> rows interleaved in groups of 8 (x8), so decode kernels need no per-row lane sums (same arithmetic, bit for bit)",
        run: interleave_weights,
    },
    Pass {
        name: "dead_code",
        summary: "drop nodes whose results are unused (cache writes are roots)",
        run: dead_code,
    },
];

/// The passes to run, in declared order.
#[derive(Debug, Clone)]
pub struct PassList(Vec<Pass>);

impl PassList {
    pub fn all() -> Self {
        PassList(PASSES.to_vec())
    }
    pub fn none() -> Self {
        PassList(Vec::new())
    }
    /// Parses `all`, `none` or a comma-separated list of pass names. The
    /// passes always run in their declared order, whatever the list order.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s.trim() {
            "all" => return Ok(Self::all()),
            "none" | "" => return Ok(Self::none()),
            _ => {}
        }
        let mut want = Vec::new();
        for name in s.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            if !PASSES.iter().any(|p| p.name == name) {
                return Err(format!(
                    "unknown pass `{name}`; the passes are: {} (or all, none)",
                    names().join(", ")
                ));
            }
            want.push(name);
        }
        Ok(PassList(
            PASSES
                .iter()
                .filter(|p| want.contains(&p.name))
                .copied()
                .collect(),
        ))
    }
    /// The same list without the named pass.
    pub fn without(mut self, name: &str) -> Self {
        self.0.retain(|p| p.name != name);
        self
    }
    pub fn passes(&self) -> &[Pass] {
        &self.0
    }
    pub fn contains(&self, name: &str) -> bool {
        self.0.iter().any(|p| p.name == name)
    }
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    pub fn names(&self) -> Vec<&'static str> {
        self.0.iter().map(|p| p.name).collect()
    }
}

impl Default for PassList {
    fn default() -> Self {
        Self::all()
    }
}

/// All pass names in declared order.
pub fn names() -> Vec<&'static str> {
    PASSES.iter().map(|p| p.name).collect()
}

/// The record of one pass in a pipeline run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PassRecord {
    pub name: &'static str,
    pub rewrites: usize,
    pub nodes_before: usize,
    pub nodes_after: usize,
    /// Nodes of the largest layer after the pass.
    pub nodes_per_layer_after: usize,
    pub op_counts_after: BTreeMap<&'static str, usize>,
}

/// What a pipeline run did.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PipelineReport {
    pub nodes_before: usize,
    pub nodes_after: usize,
    pub nodes_per_layer_before: usize,
    pub nodes_per_layer_after: usize,
    pub op_counts_before: BTreeMap<&'static str, usize>,
    pub op_counts_after: BTreeMap<&'static str, usize>,
    pub passes: Vec<PassRecord>,
}

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum PassError {
    #[error("pass `{pass}`: {source}")]
    Pass {
        pass: &'static str,
        #[source]
        source: GraphError,
    },
    #[error("the graph before the passes: {0}")]
    Input(GraphError),
}

/// Nodes of the largest layer (layers are uniform in Llama graphs).
fn largest_layer(g: &Graph) -> usize {
    g.nodes_per_layer().into_iter().max().unwrap_or(0)
}

/// Runs `passes` over `graph` in declared order, verifying the graph after
/// each, and calls `after(pass_name, graph)` after each pass.
pub fn run_pipeline(
    graph: &mut Graph,
    passes: &PassList,
    mut after: impl FnMut(&str, &Graph),
) -> Result<PipelineReport, PassError> {
    graph.verify().map_err(PassError::Input)?;
    let nodes_before = graph.node_count();
    let per_layer_before = largest_layer(graph);
    let op_counts_before = graph.op_counts();
    let mut records = Vec::new();
    for p in passes.passes() {
        let before = graph.node_count();
        let wrap = |source| PassError::Pass {
            pass: p.name,
            source,
        };
        let stats = (p.run)(graph).map_err(wrap)?;
        *graph = graph.renumbered().map_err(wrap)?;
        graph.verify().map_err(wrap)?;
        records.push(PassRecord {
            name: p.name,
            rewrites: stats.rewrites,
            nodes_before: before,
            nodes_after: graph.node_count(),
            nodes_per_layer_after: largest_layer(graph),
            op_counts_after: graph.op_counts(),
        });
        after(p.name, graph);
    }
    Ok(PipelineReport {
        nodes_before,
        nodes_after: graph.node_count(),
        nodes_per_layer_before: per_layer_before,
        nodes_per_layer_after: largest_layer(graph),
        op_counts_before,
        op_counts_after: graph.op_counts(),
        passes: records,
    })
}

/// How many nodes of the graph have op kind `kind`.
pub fn count_kind(g: &Graph, kind: &str) -> usize {
    g.node_ids()
        .filter(|&i| g.node(i).op.kind() == kind)
        .count()
}

/// Side-effecting ops are roots for dead-code elimination.
pub(crate) fn is_root(g: &Graph, id: crate::ir::NodeId) -> bool {
    g.outputs().contains(&id) || g.node(id).op.has_side_effects()
}
