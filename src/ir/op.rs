//! The closed set of operations of the graph.
//!
//! One enum, one exhaustive `match` per concern (shape inference in
//! [`super::infer`], printing, execution). Ops are at the granularity of the
//! Llama forward pass as the seed walkthrough describes it; the optimisation
//! passes add fused variants.

use serde::{Deserialize, Serialize};

/// RoPE frequency scaling: how the frequencies `1 / theta^(2i/D)` are
/// rescaled to stretch a model's context.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum RopeScaling {
    /// Llama 3.1 scaling ("llama3" rope type), as in Meta's `apply_scaling`:
    /// wavelengths longer than `original_context / low_freq_factor` are
    /// divided by `factor`, shorter than `original_context / high_freq_factor`
    /// are kept, and those in between are interpolated smoothly.
    Llama3 {
        /// How much long wavelengths are stretched.
        factor: f64,
        /// Wavelengths above `original_context / low_freq_factor` are
        /// divided by `factor`.
        low_freq_factor: f64,
        /// Wavelengths below `original_context / high_freq_factor` are kept.
        high_freq_factor: f64,
        /// The context the model was trained with.
        original_context: usize,
    },
    /// Linear position interpolation (Hugging Face's "linear" rope type,
    /// GGUF `rope.scaling.type = linear`): every frequency is divided by
    /// `factor`, i.e. positions are compressed by it.
    Linear {
        /// How much positions are compressed.
        factor: f64,
    },
}

impl RopeScaling {
    /// The constants Meta's reference uses when `use_scaled_rope` is true.
    pub const LLAMA3_1: RopeScaling = RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_context: 8192,
    };
}

/// Parameters of rotary position embeddings.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RopeParams {
    /// The attention head's dimension `D` (pairs rotate in `D / 2` planes).
    pub head_dim: usize,
    /// The base of the frequencies `1 / theta^(2i/D)`.
    pub theta: f64,
    /// How the frequencies are rescaled, if at all.
    pub scaling: Option<RopeScaling>,
}

/// Which rows of the final hidden state the output head turns into logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum LogitRows {
    /// Every token of the step: `[S, vocab]`.
    All,
    /// The last token of each sequence in the step, which is all plain
    /// generation needs: `[R, vocab]` (a `LastRows` before the output head)
    /// with one row per sequence, `R = N`.
    Last,
    /// The last tokens of each sequence, as many as its row of the step's
    /// sequence table asks (at least one), at most `max` rows in a step:
    /// `[R, vocab]`. The graph is `Last`'s; only the planned `R` differs.
    /// A sequence verifying `k` drafted tokens feeds `k + 1` tokens and asks
    /// for `k + 1` rows, while the step's other sequences ask for one.
    Tail {
        /// The most rows one step returns.
        max: usize,
    },
}

impl LogitRows {
    /// The most logit rows (`R`) a step of at most `max_tokens` tokens of
    /// at most `max_seqs` sequences returns.
    pub fn max_rows(self, max_tokens: usize, max_seqs: usize) -> usize {
        match self {
            LogitRows::All => max_tokens,
            LogitRows::Last => max_seqs,
            LogitRows::Tail { max } => max.max(max_seqs).min(max_tokens.max(1)),
        }
    }
}

/// How a sequence's rows of the final hidden state become one embedding
/// (llama-server's `--pooling`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Pooling {
    /// The mean of every token's row.
    Mean,
    /// The first token's row (the `[CLS]` position of BERT-style models).
    Cls,
    /// The last token's row.
    Last,
}

impl Pooling {
    /// The name `--pooling` takes.
    pub fn name(self) -> &'static str {
        match self {
            Pooling::Mean => "mean",
            Pooling::Cls => "cls",
            Pooling::Last => "last",
        }
    }
}

/// Which half of a layer's KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum CacheKind {
    /// The keys.
    K,
    /// The values.
    V,
}

/// The step inputs: per-step data the executor is given (tokens, the
/// sequence table, the block table) or derives from it (positions, KV slots).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum StepInput {
    /// [`Op::Tokens`].
    Tokens,
    /// [`Op::Positions`].
    Positions,
    /// [`Op::KvSlots`].
    KvSlots,
    /// [`Op::SeqTable`].
    SeqTable,
    /// [`Op::BlockTable`].
    BlockTable,
    /// [`Op::WindowSlots`].
    WindowSlots,
    /// [`Op::WindowBlockTable`].
    WindowBlockTable,
}

/// Columns of a [`Op::SeqTable`] row.
pub const SEQ_TABLE_COLS: usize = 5;

/// An operation. Inputs are the node's incoming edges, in slot order; the
/// comment on each variant lists them with their shapes (`S` tokens in the
/// step across its sequences, `N` sequences in the step, `T` the longest key
/// span; `NB` blocks of `BS` positions in the KV pool).
///
/// A step carries tokens of `N` sequences, each sequence's tokens
/// contiguous and in position order. The KV pool is shared: every layer's
/// cache is `NB` blocks, and each sequence owns a list of blocks (its block
/// table) holding its positions `0, 1, ...` in order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Op {
    // ---- step inputs: no inputs, bound per step ----
    /// Token ids of this step: `i32[S]`.
    Tokens,
    /// Each token's position in its own sequence: `i32[S]`.
    Positions,
    /// The KV-pool row each token's keys and values go to
    /// (`block · BS + position % BS`): `i32[S]`.
    KvSlots,
    /// One row per sequence of the step: (first token of the step, token
    /// count, start position, offset of its block list in the block table,
    /// logit rows): `i32[N, 5]`. Its queries attend positions
    /// `0..=start + i`; its last `logit rows` tokens (1 to count) get
    /// logits where the graph reads [`Op::LastRows`].
    SeqTable,
    /// The sequences' KV blocks, each sequence's list contiguous and in
    /// position order (block `i` of a list holds positions `i·BS..`):
    /// `i32[NB]` (at most every block of the pool).
    BlockTable,
    /// The KV slot of each token in the sliding-window layers' own, smaller
    /// pool (`block · BS + position % BS`, the block taken from
    /// [`Op::WindowBlockTable`]): `i32[S]`. Only graphs whose window layers
    /// keep a ring of blocks have it (see [`Op::WindowBlockTable`]).
    WindowSlots,
    /// The sequences' blocks in the sliding-window layers' pool, laid out as
    /// [`Op::BlockTable`] (each list at the same offset, as long): a window
    /// layer keeps only the positions its queries can still read, so a
    /// sequence owns a ring of `R` blocks there and entry `i` of its list
    /// is ring block `i mod R`: `i32[NBW]`.
    WindowBlockTable,

    // ---- other sources ----
    /// A weight tensor, bound by its checkpoint name to the loaded model.
    Weight {
        /// The checkpoint tensor's name (Meta's names), or a packed
        /// weight's (see [`crate::ir::PackedWeight`]).
        tensor: String,
    },
    /// Persistent KV state of one layer, shared by all sequences: `NB`
    /// blocks of `BS` positions, f32 or f16. Keys are stored dims-major
    /// within a block, `[NB, Hkv, D, BS]` (a head's keys at one dim are
    /// contiguous), values `[NB, Hkv, BS, D]`. It outlives the step; the
    /// executor keeps it across calls.
    KvCache {
        /// The transformer layer.
        layer: usize,
        /// Keys or values.
        kind: CacheKind,
    },
    /// Constant-folded RoPE angles for every position `0..max_pos`:
    /// `f32[max_pos, head_dim/2, 2]` (cos, sin), computed once when the
    /// executor is prepared (pass `fold_rope_table`).
    RopeTable {
        /// The rotation's parameters.
        params: RopeParams,
        /// Positions in the table (the KV pool's positions).
        max_pos: usize,
    },

    // ---- compute ----
    /// Rotation angles of each token's position: (`positions i32[S]`) ->
    /// `f32[S, head_dim/2, 2]` (cos, sin) of `pos * freq_i`, as Meta's
    /// `freqs_cis` complex numbers.
    RopeFreqs(RopeParams),
    /// Rows of a table at the given indices: (`table[R, ..]`, `idx i32[S]`)
    /// -> `f32[S, ..]` (the RoPE table at each token's position).
    GatherRows,
    /// Row gather: (`table[V, E]`, `tokens i32[S]`) -> `f32[S, E]`.
    Embedding,
    /// Root-mean-square normalisation over the last axis, without weight:
    /// `x * rsqrt(mean(x²) + eps)`. (`x[.., E]`) -> same.
    RmsNorm {
        /// Added to the mean square before the root.
        eps: f64,
    },
    /// Linear layer: (`x[S, K]`, `w[N, K]`) -> `f32[S, N]`, i.e. `x · wᵀ`.
    MatMul,
    /// Reinterpret the shape; the element count must not change.
    Reshape,
    /// Rotary embedding of pairs (`x[S, H, D]`, `freqs[S, D/2, 2]`) -> same as x.
    Rope,
    /// Write this step's keys or values into the pool at each token's slot:
    /// (`cache`, `x[S, Hkv, D]`, `slots i32[S]`) -> the cache after the
    /// write (same type), which attention reads.
    KvWrite,
    /// Causal GQA attention scores: (`q[S, H, D]`, `k` cache, `seqs i32[N,
    /// 4]`, `blocks i32[NB]`) -> `[H, S, T]`, scaled by `scale`; query head
    /// `h` reads KV head `h / n_rep`; entry `t` is the query's own
    /// sequence's position `t`; positions after the query's own are `-inf`,
    /// and with a sliding `window` so are positions `t <= p - window` (a
    /// query at `p` sees `window` positions, its own included).
    AttnScores {
        /// Query heads per KV head.
        n_rep: usize,
        /// Factor on every score (`1/sqrt(D)`).
        scale: f64,
        /// The sliding attention window, if any.
        #[serde(default)]
        window: Option<usize>,
    },
    /// Softmax over the last axis, in f32.
    Softmax,
    /// Attention-weighted values: (`probs[H, S, T]`, `v` cache, `seqs`,
    /// `blocks`) -> `[S, H, D]`.
    AttnValues {
        /// Query heads per KV head.
        n_rep: usize,
    },
    /// `x * sigmoid(x)`, elementwise.
    Silu,
    /// GELU with the tanh approximation (PyTorch's `gelu(x,
    /// approximate="tanh")`): `0.5·x·(1 + tanh(sqrt(2/π)·(x + 0.044715·x³)))`,
    /// elementwise.
    GeluTanh,
    /// `x * factor`, elementwise (Gemma 3's embedding scale `sqrt(dim)`,
    /// rounded to f32).
    Scale {
        /// The factor.
        factor: f64,
    },
    /// Elementwise product; the second input may also be a vector matching
    /// the last axis of the first (broadcast over rows).
    Mul,
    /// Elementwise sum of two tensors of one shape; the second input may
    /// also be a vector matching the last axis of the first (a bias,
    /// broadcast over rows).
    Add,
    /// The output head: (`x[R, E]`, `w[V, E]`) -> `f32[R, V]`.
    OutputHead,
    /// The rows of each sequence's last tokens, as many as its sequence
    /// table row's `logit rows` (one when it decodes plainly; `k + 1` when
    /// it verifies `k` drafted tokens), in step order: (`x[S, E]`,
    /// `seqs i32[N, 5]`) -> `f32[R, E]`.
    LastRows,
    /// One embedding per sequence, pooled from its rows of the step:
    /// (`x[S, E]`, `seqs i32[N, 4]`) -> `f32[N, E]`. A sequence's rows are
    /// pooled in position order, so its embedding does not depend on the
    /// other sequences of the step; the whole sequence must be in the step.
    PoolRows {
        /// How the rows become one.
        pooling: Pooling,
    },

    // ---- fused ops (created by `crate::passes`) ----
    /// RMSNorm with its weight multiply folded in:
    /// (`x[.., E]`, `w[E]`) -> same as x.
    RmsNormScaled {
        /// Added to the mean square before the root.
        eps: f64,
    },
    /// Columns `start..start+len` of a matrix: (`x[S, N]`) -> `f32[S, len]`.
    SliceCols {
        /// The first column.
        start: usize,
        /// How many columns.
        len: usize,
    },
    /// Linear layer with the residual add in its epilogue:
    /// (`r[S, N]`, `x[S, K]`, `w[N, K]`) -> `f32[S, N]` = `r + x · wᵀ`.
    /// The residual is input 0 so its buffer can be accumulated in place.
    MatMulAdd,
    /// Linear layer over a packed gate/up weight with the SwiGLU epilogue:
    /// (`x[S, K]`, `w[2F, K]`, gate rows first) -> `f32[S, F]` =
    /// `silu(x·gateᵀ) * (x·upᵀ)`, computed in the output loop.
    MatMulSwiGlu,
    /// The fused QKV projection with RoPE and the KV-cache write in its
    /// epilogue: (`x[S, K]`, `wqkv[(H+2Hkv)·D, K]`, `freqs[S, D/2, 2]`,
    /// `cache_k`, `cache_v`, `slots i32[S]`) -> rotated `q[S, H, D]`. As a
    /// side effect the rotated keys and the values are written to the
    /// caches at each token's slot before the output is available, so
    /// readers of q may read the caches. With `bias`, three more inputs
    /// (`bq[H·D]`, `bk[Hkv·D]`, `bv[Hkv·D]`) are added to the product; with
    /// `qk_norm` (its eps), two more (`q_norm[D]`, `k_norm[D]`) RMS-normalise
    /// each q and k head before RoPE.
    QkvRopeCache {
        /// Query heads `H`.
        n_heads: usize,
        /// Key/value heads `Hkv`.
        n_kv_heads: usize,
        /// Head dimension `D`.
        head_dim: usize,
        /// Whether the three bias inputs follow.
        #[serde(default)]
        bias: bool,
        /// The eps of the per-head Q/K RMSNorm, when the two norm weights follow.
        #[serde(default)]
        qk_norm: Option<f64>,
    },
    /// Fused causal GQA attention with a streaming softmax (never
    /// materialises `[H, S, T]`): (`q[S, H, D]`, `k` cache, `v` cache,
    /// `seqs i32[N, 5]`, `blocks i32[NB]`) -> `[S, H, D]`; each query reads
    /// its own sequence's positions up to its own, and with a sliding
    /// `window` only those `t > p - window` (as [`Op::AttnScores`]).
    Attention {
        /// Query heads per KV head.
        n_rep: usize,
        /// Factor on every score (`1/sqrt(D)`).
        scale: f64,
        /// The sliding attention window, if any.
        #[serde(default)]
        window: Option<usize>,
    },

    // ---- pipeline stage boundary (created by `crate::passes::partition`) ----
    /// The value a pipeline stage receives from stage `from`: a source of
    /// its declared type, `f32[S, E]` (the hidden state after the previous
    /// stage's last layer). The caller of the stage's executor fills it with
    /// what stage `from` sent, which arrives with the step's description
    /// (its tokens' sequences and positions) so that this stage binds the
    /// same step.
    Recv {
        /// The stage that sends it.
        from: usize,
    },
    /// The value a pipeline stage hands to stage `to`: (`x[S, E]`) -> the
    /// same tensor, a view of `x`. It is the stage graph's output; its
    /// caller sends it.
    Send {
        /// The stage it goes to.
        to: usize,
    },
}

impl Op {
    /// A short name for printing and statistics.
    pub fn kind(&self) -> &'static str {
        match self {
            Op::Tokens => "Tokens",
            Op::Positions => "Positions",
            Op::KvSlots => "KvSlots",
            Op::SeqTable => "SeqTable",
            Op::BlockTable => "BlockTable",
            Op::WindowSlots => "WindowSlots",
            Op::WindowBlockTable => "WindowBlockTable",
            Op::Weight { .. } => "Weight",
            Op::KvCache { .. } => "KvCache",
            Op::RopeFreqs(_) => "RopeFreqs",
            Op::GatherRows => "GatherRows",
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
            Op::GeluTanh => "GeluTanh",
            Op::Scale { .. } => "Scale",
            Op::Mul => "Mul",
            Op::Add => "Add",
            Op::OutputHead => "OutputHead",
            Op::LastRows => "LastRows",
            Op::PoolRows { .. } => "PoolRows",
            Op::RopeTable { .. } => "RopeTable",
            Op::RmsNormScaled { .. } => "RmsNormScaled",
            Op::SliceCols { .. } => "SliceCols",
            Op::MatMulAdd => "MatMulAdd",
            Op::MatMulSwiGlu => "MatMulSwiGlu",
            Op::QkvRopeCache { .. } => "QkvRopeCache",
            Op::Attention { .. } => "Attention",
            Op::Recv { .. } => "Recv",
            Op::Send { .. } => "Send",
        }
    }

    /// Number of inputs the op takes.
    pub fn arity(&self) -> usize {
        match self {
            Op::Tokens
            | Op::Positions
            | Op::KvSlots
            | Op::SeqTable
            | Op::BlockTable
            | Op::WindowSlots
            | Op::WindowBlockTable
            | Op::Weight { .. }
            | Op::KvCache { .. }
            | Op::RopeTable { .. }
            | Op::Recv { .. } => 0,
            Op::RmsNorm { .. } | Op::Reshape | Op::Softmax | Op::Silu | Op::RopeFreqs(_) => 1,
            Op::GeluTanh | Op::Scale { .. } => 1,
            Op::SliceCols { .. } | Op::Send { .. } => 1,
            Op::RmsNormScaled { .. } | Op::MatMulSwiGlu => 2,
            Op::MatMulAdd | Op::KvWrite => 3,
            Op::AttnScores { .. } | Op::AttnValues { .. } => 4,
            Op::Attention { .. } => 5,
            Op::QkvRopeCache { bias, qk_norm, .. } => {
                6 + if *bias { 3 } else { 0 } + if qk_norm.is_some() { 2 } else { 0 }
            }
            Op::Embedding
            | Op::GatherRows
            | Op::MatMul
            | Op::Rope
            | Op::Mul
            | Op::Add
            | Op::OutputHead
            | Op::LastRows
            | Op::PoolRows { .. } => 2,
        }
    }

    /// The step input this source stands for, if it is one.
    pub fn step_input(&self) -> Option<StepInput> {
        Some(match self {
            Op::Tokens => StepInput::Tokens,
            Op::Positions => StepInput::Positions,
            Op::KvSlots => StepInput::KvSlots,
            Op::SeqTable => StepInput::SeqTable,
            Op::BlockTable => StepInput::BlockTable,
            Op::WindowSlots => StepInput::WindowSlots,
            Op::WindowBlockTable => StepInput::WindowBlockTable,
            _ => return None,
        })
    }

    /// Sources take their output shape from the node declaration rather than
    /// from inputs.
    pub fn is_source(&self) -> bool {
        self.arity() == 0
    }

    /// Whether running the op changes state outside its output (the KV
    /// caches). Such nodes are roots for dead-code elimination.
    pub fn has_side_effects(&self) -> bool {
        matches!(self, Op::KvWrite | Op::QkvRopeCache { .. })
    }

    /// Parameters worth showing next to the op name in dumps.
    pub fn params(&self) -> String {
        fn rope(p: &RopeParams) -> String {
            match p.scaling {
                None => format!("head_dim={}, theta={}", p.head_dim, p.theta),
                Some(RopeScaling::Llama3 {
                    factor,
                    low_freq_factor,
                    high_freq_factor,
                    original_context,
                }) => format!(
                    "head_dim={}, theta={}, scaled(factor={}, low={}, high={}, orig_ctx={})",
                    p.head_dim,
                    p.theta,
                    factor,
                    low_freq_factor,
                    high_freq_factor,
                    original_context
                ),
                Some(RopeScaling::Linear { factor }) => format!(
                    "head_dim={}, theta={}, linear(factor={})",
                    p.head_dim, p.theta, factor
                ),
            }
        }
        match self {
            Op::Weight { tensor } => format!("tensor={tensor}"),
            Op::KvCache { layer, kind } => format!("layer={layer}, {kind:?}"),
            Op::RopeFreqs(p) => rope(p),
            Op::RopeTable { params, max_pos } => format!("{}, positions={max_pos}", rope(params)),
            Op::RmsNormScaled { eps } => format!("eps={eps:e}"),
            Op::SliceCols { start, len } => format!("cols={start}..{}", start + len),
            Op::MatMulAdd => "epilogue=residual".into(),
            Op::MatMulSwiGlu => "epilogue=silu(gate)*up".into(),
            Op::QkvRopeCache {
                n_heads,
                n_kv_heads,
                head_dim,
                bias,
                qk_norm,
            } => {
                let mut e = String::new();
                if *bias {
                    e.push_str("bias+");
                }
                if let Some(eps) = qk_norm {
                    e.push_str(&format!("qk_norm(eps={eps:e})+"));
                }
                format!(
                    "heads={n_heads}, kv_heads={n_kv_heads}, head_dim={head_dim}, epilogue={e}rope+cache_write"
                )
            }
            Op::Attention {
                n_rep,
                scale,
                window: None,
            } => format!("n_rep={n_rep}, scale={scale:.6}, causal, online_softmax"),
            Op::Attention {
                n_rep,
                scale,
                window: Some(w),
            } => format!("n_rep={n_rep}, scale={scale:.6}, causal, window={w}, online_softmax"),
            Op::RmsNorm { eps } => format!("eps={eps:e}"),
            Op::AttnScores {
                n_rep,
                scale,
                window: None,
            } => format!("n_rep={n_rep}, scale={scale:.6}, causal"),
            Op::AttnScores {
                n_rep,
                scale,
                window: Some(w),
            } => format!("n_rep={n_rep}, scale={scale:.6}, causal, window={w}"),
            Op::Scale { factor } => format!("factor={factor}"),
            Op::AttnValues { n_rep } => format!("n_rep={n_rep}"),
            Op::PoolRows { pooling } => format!("pooling={}", pooling.name()),
            Op::Recv { from } => format!("from=stage {from}"),
            Op::Send { to } => format!("to=stage {to}"),
            _ => String::new(),
        }
    }
}
