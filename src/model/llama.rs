//! The Llama builder: the whole forward pass as a graph, from the model
//! arguments alone (no weights needed). It reads like Meta's `model.py`:
//!
//! ```text
//! h = tok_embeddings(tokens)
//! for each layer:
//!     xn = attention_norm(h)
//!     q, k, v = wq(xn), wk(xn), wv(xn)            -> heads
//!     q, k = rope(q), rope(k)                      each token's own position
//!     K, V = cache_k.write(k), cache_v.write(v)    each token's KV-pool slot
//!     a = softmax(q·Kᵀ·scale + causal mask) · V    its own sequence's positions 0..=pos;
//!                                                  GQA: n_rep q heads per kv head
//!     h = h + wo(a)
//!     h = h + w2(silu(w1(ffn_norm(h))) * w3(ffn_norm(h)))
//! logits = output(norm(h))                        (last token of each sequence)
//! ```
//!
//! A step carries the tokens of one or more sequences; the step inputs
//! (`tokens`, `positions`, `kv.slots`, `kv.seqs`, `kv.blocks`) say which
//! token belongs where, and the KV caches are one pool of blocks shared by
//! every sequence.
//!
//! Weight nodes carry Meta's checkpoint names (`layers.3.attention.wq.weight`);
//! compute nodes are named after the module that computes them
//! (`layers.3.attention.wq`).

use super::{GateAct, ModelArgs};
use crate::ir::{
    CacheKind, DType, Dim, Graph, GraphError, LogitRows, NodeId, Op, Pooling, RopeParams, Shape,
    TensorMeta, SEQ_TABLE_COLS,
};
use std::collections::BTreeMap;
use thiserror::Error;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum BuildError {
    #[error("vocab_size is not known yet (params.json says -1): it must come from the tokenizer or the embedding before the graph can be built")]
    VocabUnknown,
    #[error("the planned context must be at least 1")]
    ZeroContext,
    #[error("the KV block size must be at least 1")]
    ZeroBlock,
    #[error("the KV cache stores f32, f16, bf16, q8_0 or q4_0, not {0}")]
    KvDType(DType),
    #[error("a {dtype} KV cache groups each head's values by 32, but this model's head dim is {head_dim}: use f32, f16 or bf16")]
    KvGroups { dtype: DType, head_dim: usize },
    #[error(transparent)]
    Graph(#[from] GraphError),
}

/// Positions per block of the KV pool unless the options say otherwise
/// (vLLM's default block size: small enough that a sequence wastes at most
/// 15 positions, large enough that a block's keys at one dim fill a
/// 16-lane vector).
pub const DEFAULT_KV_BLOCK: usize = 16;

impl BuildOptions {
    /// Blocks in the KV pool: enough for `context` positions.
    pub fn kv_blocks(&self) -> usize {
        self.context.div_ceil(self.kv_block.max(1))
    }
}

/// What the graph is built for, beyond the model arguments.
#[derive(Debug, Clone)]
pub struct BuildOptions {
    /// The planned context `C`: the KV pool holds at least this many
    /// positions (all sequences together), in blocks of `kv_block`.
    pub context: usize,
    /// Positions per KV block (the pool's allocation unit).
    pub kv_block: usize,
    /// How the KV pool stores keys (f32, f16, bf16, q8_0 or q4_0).
    pub kv_dtype: DType,
    /// How the KV pool stores values (the same choice as for keys).
    pub kv_v_dtype: DType,
    /// The dtype weights are declared with unless `weight_dtypes` says
    /// otherwise (Meta's checkpoints: bf16).
    pub default_weight_dtype: DType,
    /// Per-tensor dtypes (GGUF files mix them).
    pub weight_dtypes: BTreeMap<String, DType>,
    /// Which positions get logits.
    pub logit_rows: LogitRows,
    /// When set, the graph's output is one pooled embedding per sequence
    /// (`PoolRows` of the final norm, `[N, E]`) instead of logits; every
    /// sequence must then be fed whole in one step.
    pub pooling: Option<Pooling>,
    /// When set, the sliding-window layers keep their keys and values in a
    /// pool of their own of this many blocks, where each sequence owns a
    /// ring of blocks holding only the positions its queries can still
    /// read ([`Op::WindowBlockTable`]); otherwise they use the shared pool
    /// as every other layer (llama.cpp's `--swa-full`).
    pub window_blocks: Option<usize>,
}

impl BuildOptions {
    pub fn new(context: usize) -> Self {
        BuildOptions {
            context,
            kv_block: DEFAULT_KV_BLOCK,
            kv_dtype: DType::F32,
            kv_v_dtype: DType::F32,
            default_weight_dtype: DType::BF16,
            weight_dtypes: BTreeMap::new(),
            logit_rows: LogitRows::All,
            pooling: None,
            window_blocks: None,
        }
    }
}

struct Builder<'a> {
    g: Graph,
    opts: &'a BuildOptions,
}

impl Builder<'_> {
    fn weight(
        &mut self,
        name: &str,
        shape: &[usize],
        layer: Option<usize>,
    ) -> Result<NodeId, GraphError> {
        if let Some(id) = self.g.find(name) {
            return Ok(id);
        }
        let dtype = self
            .opts
            .weight_dtypes
            .get(name)
            .copied()
            .unwrap_or(self.opts.default_weight_dtype);
        self.g.add_source(
            name,
            Op::Weight {
                tensor: name.to_string(),
            },
            TensorMeta::new(Shape::constant(shape), dtype),
            layer,
        )
    }

    fn op(
        &mut self,
        name: String,
        op: Op,
        inputs: &[NodeId],
        layer: Option<usize>,
    ) -> Result<NodeId, GraphError> {
        self.g.add_op(name, op, inputs, layer)
    }

    fn reshape(
        &mut self,
        name: String,
        x: NodeId,
        dims: Vec<Dim>,
        layer: Option<usize>,
    ) -> Result<NodeId, GraphError> {
        let meta = TensorMeta::new(Shape(dims), self.g.node(x).meta.dtype);
        self.g.add_op_as(name, Op::Reshape, &[x], meta, layer)
    }

    /// `x * rsqrt(mean(x²) + eps) * weight`, as RMSNorm then a broadcast Mul.
    fn rms_norm(
        &mut self,
        prefix: &str,
        x: NodeId,
        dim: usize,
        eps: f64,
        layer: Option<usize>,
    ) -> Result<NodeId, GraphError> {
        let w = self.weight(&format!("{prefix}.weight"), &[dim], layer)?;
        let n = self.op(prefix.to_string(), Op::RmsNorm { eps }, &[x], layer)?;
        self.op(format!("{prefix}.mul"), Op::Mul, &[n, w], layer)
    }

    /// `x + bias`, the bias `{name}.bias` broadcast over rows.
    fn bias(
        &mut self,
        name: &str,
        x: NodeId,
        out: usize,
        layer: Option<usize>,
    ) -> Result<NodeId, GraphError> {
        let w = self.weight(&format!("{name}.bias"), &[out], layer)?;
        self.op(format!("{name}.bias_add"), Op::Add, &[x, w], layer)
    }

    fn linear(
        &mut self,
        name: &str,
        x: NodeId,
        out: usize,
        inp: usize,
        layer: Option<usize>,
    ) -> Result<NodeId, GraphError> {
        let w = self.weight(&format!("{name}.weight"), &[out, inp], layer)?;
        self.op(name.to_string(), Op::MatMul, &[x, w], layer)
    }
}

/// Builds the forward graph of a Llama model. The graph's single output is
/// `output` (the logits), or `pooled` (one embedding per sequence) when
/// `opts.pooling` is set.
pub fn build_llama(args: &ModelArgs, opts: &BuildOptions) -> Result<Graph, BuildError> {
    let vocab = args.vocab_size.ok_or(BuildError::VocabUnknown)?;
    if opts.context == 0 {
        return Err(BuildError::ZeroContext);
    }
    let (dim, hd) = (args.dim, args.head_dim());
    let (nh, nkv, n_rep) = (args.n_heads, args.n_kv_heads, args.n_rep());
    let ffn = args.ffn_hidden_dim;
    let eps = args.norm_eps;
    let mut b = Builder {
        g: Graph::new(),
        opts,
    };

    if opts.kv_block == 0 {
        return Err(BuildError::ZeroBlock);
    }
    for dtype in [opts.kv_dtype, opts.kv_v_dtype] {
        match dtype {
            DType::F32 | DType::F16 | DType::BF16 => {}
            DType::Q8_0 | DType::Q4_0 if hd.is_multiple_of(32) => {}
            DType::Q8_0 | DType::Q4_0 => {
                return Err(BuildError::KvGroups {
                    dtype,
                    head_dim: hd,
                })
            }
            _ => return Err(BuildError::KvDType(dtype)),
        }
    }
    let (nb, bs) = (opts.kv_blocks(), opts.kv_block);
    let per_token = TensorMeta::new(Shape(vec![Dim::S]), DType::I32);
    let tokens =
        b.g.add_source("tokens", Op::Tokens, per_token.clone(), None)?;
    let positions =
        b.g.add_source("positions", Op::Positions, per_token.clone(), None)?;
    let slots = b.g.add_source("kv.slots", Op::KvSlots, per_token, None)?;
    let seqs = b.g.add_source(
        "kv.seqs",
        Op::SeqTable,
        TensorMeta::new(Shape(vec![Dim::N, Dim::Const(SEQ_TABLE_COLS)]), DType::I32),
        None,
    )?;
    let blocks = b.g.add_source(
        "kv.blocks",
        Op::BlockTable,
        TensorMeta::new(Shape::constant(&[nb]), DType::I32),
        None,
    )?;
    // The window layers' own pool, when they keep only their window.
    let any_window = (0..args.n_layers).any(|i| args.layer_window(i).is_some());
    let window_pool = match opts.window_blocks {
        Some(nbw) if any_window => {
            let wslots = b.g.add_source(
                "kv.window_slots",
                Op::WindowSlots,
                TensorMeta::new(Shape(vec![Dim::S]), DType::I32),
                None,
            )?;
            let wblocks = b.g.add_source(
                "kv.window_blocks",
                Op::WindowBlockTable,
                TensorMeta::new(Shape::constant(&[nb]), DType::I32),
                None,
            )?;
            Some((nbw, wslots, wblocks))
        }
        _ => None,
    };
    let emb_w = b.weight("tok_embeddings.weight", &[vocab, dim], None)?;
    let mut h = b.op(
        "tok_embeddings".into(),
        Op::Embedding,
        &[emb_w, tokens],
        None,
    )?;
    let var = &args.variant;
    if var.embed_scale {
        // Gemma 3: the embedding times sqrt(dim), rounded to f32 first (as
        // transformers' `embed_scale` tensor and llama.cpp's `sqrtf`).
        let factor = f64::from((dim as f32).sqrt());
        h = b.op(
            "tok_embeddings.scale".into(),
            Op::Scale { factor },
            &[h],
            None,
        )?;
    }
    // One RoPE angle table per distinct (base, scaling): Gemma 3's local
    // layers have their own.
    let mut freqs_of: Vec<((f64, Option<crate::ir::RopeScaling>), NodeId)> = Vec::new();
    let scale = 1.0 / (hd as f64).sqrt();

    for i in 0..args.n_layers {
        let l = Some(i);
        let p = format!("layers.{i}");
        let a = format!("{p}.attention");
        let rope_key = args.layer_rope(i);
        let freqs = match freqs_of.iter().find(|(k, _)| *k == rope_key) {
            Some(&(_, id)) => id,
            None => {
                let name = if freqs_of.is_empty() {
                    "rope.freqs".to_string()
                } else {
                    format!("rope{}.freqs", freqs_of.len())
                };
                let rope = RopeParams {
                    head_dim: hd,
                    theta: rope_key.0,
                    scaling: rope_key.1,
                };
                let id = b.op(name, Op::RopeFreqs(rope), &[positions], None)?;
                freqs_of.push((rope_key, id));
                id
            }
        };
        // Attention block.
        let xn = b.rms_norm(&format!("{p}.attention_norm"), h, dim, eps, l)?;
        let mut q = b.linear(&format!("{a}.wq"), xn, nh * hd, dim, l)?;
        let mut k = b.linear(&format!("{a}.wk"), xn, nkv * hd, dim, l)?;
        let mut v = b.linear(&format!("{a}.wv"), xn, nkv * hd, dim, l)?;
        if var.qkv_bias {
            q = b.bias(&format!("{a}.wq"), q, nh * hd, l)?;
            k = b.bias(&format!("{a}.wk"), k, nkv * hd, l)?;
            v = b.bias(&format!("{a}.wv"), v, nkv * hd, l)?;
        }
        let mut q = b.reshape(
            format!("{a}.q_heads"),
            q,
            vec![Dim::S, Dim::Const(nh), Dim::Const(hd)],
            l,
        )?;
        let mut k = b.reshape(
            format!("{a}.k_heads"),
            k,
            vec![Dim::S, Dim::Const(nkv), Dim::Const(hd)],
            l,
        )?;
        let v = b.reshape(
            format!("{a}.v_heads"),
            v,
            vec![Dim::S, Dim::Const(nkv), Dim::Const(hd)],
            l,
        )?;
        if var.qk_norm {
            q = b.rms_norm(&format!("{a}.q_norm"), q, hd, eps, l)?;
            k = b.rms_norm(&format!("{a}.k_norm"), k, hd, eps, l)?;
        }
        let q = b.op(format!("{a}.q_rope"), Op::Rope, &[q, freqs], l)?;
        let k = b.op(format!("{a}.k_rope"), Op::Rope, &[k, freqs], l)?;
        // A window layer with a pool of its own writes and reads there.
        let (nb, slots, blocks) = match (args.layer_window(i), window_pool) {
            (Some(_), Some((nbw, ws, wb))) => (nbw, ws, wb),
            _ => (nb, slots, blocks),
        };
        let ck = b.g.add_source(
            format!("{a}.cache_k"),
            Op::KvCache {
                layer: i,
                kind: CacheKind::K,
            },
            TensorMeta::new(Shape::constant(&[nb, nkv, hd, bs]), opts.kv_dtype),
            l,
        )?;
        let cv = b.g.add_source(
            format!("{a}.cache_v"),
            Op::KvCache {
                layer: i,
                kind: CacheKind::V,
            },
            TensorMeta::new(Shape::constant(&[nb, nkv, bs, hd]), opts.kv_v_dtype),
            l,
        )?;
        let keys = b.op(
            format!("{a}.cache_k.write"),
            Op::KvWrite,
            &[ck, k, slots],
            l,
        )?;
        let vals = b.op(
            format!("{a}.cache_v.write"),
            Op::KvWrite,
            &[cv, v, slots],
            l,
        )?;
        let scores = b.op(
            format!("{a}.scores"),
            Op::AttnScores {
                n_rep,
                scale,
                window: args.layer_window(i),
            },
            &[q, keys, seqs, blocks],
            l,
        )?;
        let probs = b.op(format!("{a}.probs"), Op::Softmax, &[scores], l)?;
        let heads = b.op(
            format!("{a}.values"),
            Op::AttnValues { n_rep },
            &[probs, vals, seqs, blocks],
            l,
        )?;
        let merged = b.reshape(
            format!("{a}.merge_heads"),
            heads,
            vec![Dim::S, Dim::Const(nh * hd)],
            l,
        )?;
        let mut o = b.linear(&format!("{a}.wo"), merged, dim, nh * hd, l)?;
        if var.post_norms {
            o = b.rms_norm(&format!("{p}.post_attention_norm"), o, dim, eps, l)?;
        }
        h = b.op(format!("{p}.attention_residual"), Op::Add, &[h, o], l)?;
        // Feed-forward block (gated: SwiGLU or GeGLU).
        let f = format!("{p}.feed_forward");
        let xn = b.rms_norm(&format!("{p}.ffn_norm"), h, dim, eps, l)?;
        let gate = b.linear(&format!("{f}.w1"), xn, ffn, dim, l)?;
        let up = b.linear(&format!("{f}.w3"), xn, ffn, dim, l)?;
        let act = match var.gate_act {
            GateAct::Silu => b.op(format!("{f}.silu"), Op::Silu, &[gate], l)?,
            GateAct::GeluTanh => b.op(format!("{f}.gelu"), Op::GeluTanh, &[gate], l)?,
        };
        let prod = b.op(format!("{f}.gate_up"), Op::Mul, &[act, up], l)?;
        let mut down = b.linear(&format!("{f}.w2"), prod, dim, ffn, l)?;
        if var.post_norms {
            down = b.rms_norm(&format!("{p}.post_ffn_norm"), down, dim, eps, l)?;
        }
        h = b.op(format!("{p}.ffn_residual"), Op::Add, &[h, down], l)?;
    }

    let mut hn = b.rms_norm("norm", h, dim, eps, None)?;
    if let Some(pooling) = opts.pooling {
        let pooled = b.op("pooled".into(), Op::PoolRows { pooling }, &[hn, seqs], None)?;
        b.g.mark_output(pooled);
        b.g.verify()?;
        return Ok(b.g);
    }
    if opts.logit_rows != LogitRows::All {
        hn = b.op("norm.last_rows".into(), Op::LastRows, &[hn, seqs], None)?;
    }
    let out_w = if args.tied_embeddings {
        emb_w
    } else {
        b.weight("output.weight", &[vocab, dim], None)?
    };
    let logits = b.op("output".into(), Op::OutputHead, &[hn, out_w], None)?;
    b.g.mark_output(logits);
    b.g.verify()?;
    Ok(b.g)
}
