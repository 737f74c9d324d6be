//! The closed set of operations of the graph.
//!
//! One enum, one exhaustive `match` per concern (shape inference in
//! [`super::infer`], printing, execution). Ops are at the granularity of the
//! Llama forward pass as the seed walkthrough describes it; the optimisation
//! passes add fused variants.

use serde::{Deserialize, Serialize};

/// Llama 3.1 RoPE frequency scaling ("llama3" rope type), as in Meta's
/// `apply_scaling`: wavelengths longer than `original_context / low_freq_factor`
/// are divided by `factor`, shorter than `original_context / high_freq_factor`
/// are kept, and those in between are interpolated smoothly.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RopeScaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_context: usize,
}

impl RopeScaling {
    /// The constants Meta's reference uses when `use_scaled_rope` is true.
    pub const LLAMA3_1: RopeScaling = RopeScaling {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_context: 8192,
    };
}

/// Parameters of rotary position embeddings.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RopeParams {
    pub head_dim: usize,
    pub theta: f64,
    pub scaling: Option<RopeScaling>,
}

/// Which rows of the final hidden state the output head turns into logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum LogitRows {
    /// Every position of the step: `[S, vocab]`.
    All,
    /// Only the last position, which is all generation needs: `[1, vocab]`.
    Last,
}

/// Which half of a layer's KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum CacheKind {
    K,
    V,
}

/// An operation. Inputs are the node's incoming edges, in slot order; the
/// comment on each variant lists them with their shapes (`S` tokens in the
/// step, `T = P + S` cached positions after this step, `C` planned context).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Op {
    // ---- sources: no inputs ----
    /// Token ids of this step: `i32[S]`.
    Tokens,
    /// A weight tensor, bound by its checkpoint name to the loaded model.
    Weight { tensor: String },
    /// Persistent KV-cache state of one layer: `f32[C, n_kv_heads, head_dim]`.
    /// It outlives the step; the executor keeps it across calls.
    KvCache { layer: usize, kind: CacheKind },
    /// Rotation angles for positions `P..P+S`: `f32[S, head_dim/2, 2]`
    /// (cos, sin) of `pos * freq_i`, as Meta's `freqs_cis` complex numbers.
    RopeFreqs(RopeParams),

    // ---- compute ----
    /// Row gather: (`table[V, E]`, `tokens i32[S]`) -> `f32[S, E]`.
    Embedding,
    /// Root-mean-square normalisation over the last axis, without weight:
    /// `x * rsqrt(mean(x²) + eps)`. (`x[.., E]`) -> same.
    RmsNorm { eps: f64 },
    /// Linear layer: (`x[S, K]`, `w[N, K]`) -> `f32[S, N]`, i.e. `x · wᵀ`.
    MatMul,
    /// Reinterpret the shape; the element count must not change.
    Reshape,
    /// Rotary embedding of pairs (`x[S, H, D]`, `freqs[S, D/2, 2]`) -> same as x.
    Rope,
    /// Write this step's keys or values into the cache at positions `P..P+S`:
    /// (`cache[C, Hkv, D]`, `x[S, Hkv, D]`) -> `[T, Hkv, D]`, the valid
    /// prefix of the cache, which attention reads.
    KvWrite,
    /// Causal GQA attention scores: (`q[S, H, D]`, `k[T, Hkv, D]`) ->
    /// `[H, S, T]`, scaled by `scale`; query head `h` reads KV head
    /// `h / n_rep`; key positions after the query's own are `-inf`.
    AttnScores { n_rep: usize, scale: f64 },
    /// Softmax over the last axis, in f32.
    Softmax,
    /// Attention-weighted values: (`probs[H, S, T]`, `v[T, Hkv, D]`) -> `[S, H, D]`.
    AttnValues { n_rep: usize },
    /// `x * sigmoid(x)`, elementwise.
    Silu,
    /// Elementwise product; the second input may also be a vector matching
    /// the last axis of the first (broadcast over rows).
    Mul,
    /// Elementwise sum of two tensors of one shape.
    Add,
    /// The output head: (`x[S, E]`, `w[V, E]`) -> `f32[S, V]` or `f32[1, V]`.
    OutputHead { rows: LogitRows },
}

impl Op {
    /// A short name for printing and statistics.
    pub fn kind(&self) -> &'static str {
        match self {
            Op::Tokens => "Tokens",
            Op::Weight { .. } => "Weight",
            Op::KvCache { .. } => "KvCache",
            Op::RopeFreqs(_) => "RopeFreqs",
            Op::Embedding => "Embedding",
            Op::RmsNorm { .. } => "RmsNorm",
            Op::MatMul => "MatMul",
            Op::Reshape => "Reshape",
            Op::Rope => "Rope",
            Op::KvWrite => "KvWrite",
            Op::AttnScores { .. } => "AttnScores",
            Op::Softmax => "Softmax",
            Op::AttnValues { .. } => "AttnValues",
            Op::Silu => "Silu",
            Op::Mul => "Mul",
            Op::Add => "Add",
            Op::OutputHead { .. } => "OutputHead",
        }
    }

    /// Number of inputs the op takes.
    pub fn arity(&self) -> usize {
        match self {
            Op::Tokens | Op::Weight { .. } | Op::KvCache { .. } | Op::RopeFreqs(_) => 0,
            Op::RmsNorm { .. } | Op::Reshape | Op::Softmax | Op::Silu => 1,
            Op::Embedding
            | Op::MatMul
            | Op::Rope
            | Op::KvWrite
            | Op::AttnScores { .. }
            | Op::AttnValues { .. }
            | Op::Mul
            | Op::Add
            | Op::OutputHead { .. } => 2,
        }
    }

    /// Sources take their output shape from the node declaration rather than
    /// from inputs.
    pub fn is_source(&self) -> bool {
        self.arity() == 0
    }

    /// Parameters worth showing next to the op name in dumps.
    pub fn params(&self) -> String {
        match self {
            Op::Weight { tensor } => format!("tensor={tensor}"),
            Op::KvCache { layer, kind } => format!("layer={layer}, {kind:?}"),
            Op::RopeFreqs(p) => match p.scaling {
                None => format!("head_dim={}, theta={}", p.head_dim, p.theta),
                Some(s) => format!(
                    "head_dim={}, theta={}, scaled(factor={}, low={}, high={}, orig_ctx={})",
                    p.head_dim,
                    p.theta,
                    s.factor,
                    s.low_freq_factor,
                    s.high_freq_factor,
                    s.original_context
                ),
            },
            Op::RmsNorm { eps } => format!("eps={eps:e}"),
            Op::AttnScores { n_rep, scale } => format!("n_rep={n_rep}, scale={scale:.6}, causal"),
            Op::AttnValues { n_rep } => format!("n_rep={n_rep}"),
            Op::OutputHead { rows } => format!("rows={rows:?}"),
            _ => String::new(),
        }
    }
}
