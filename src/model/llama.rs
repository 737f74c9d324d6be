//! The Llama builder: the whole forward pass as a graph, from the model
//! arguments alone (no weights needed). It reads like Meta's `model.py`:
//!
//! ```text
//! h = tok_embeddings(tokens)
//! for each layer:
//!     xn = attention_norm(h)
//!     q, k, v = wq(xn), wk(xn), wv(xn)            -> heads
//!     q, k = rope(q), rope(k)                      positions P..P+S
//!     K, V = cache_k.write(k), cache_v.write(v)    all T = P+S positions
//!     a = softmax(q·Kᵀ·scale + causal mask) · V    GQA: n_rep q heads per kv head
//!     h = h + wo(a)
//!     h = h + w2(silu(w1(ffn_norm(h))) * w3(ffn_norm(h)))
//! logits = output(norm(h))
//! ```
//!
//! Weight nodes carry Meta's checkpoint names (`layers.3.attention.wq.weight`);
//! compute nodes are named after the module that computes them
//! (`layers.3.attention.wq`).

use super::ModelArgs;
use crate::ir::{
    CacheKind, DType, Dim, Graph, GraphError, LogitRows, NodeId, Op, RopeParams, Shape, TensorMeta,
};
use std::collections::BTreeMap;
use thiserror::Error;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum BuildError {
    #[error("vocab_size is not known yet (params.json says -1): it must come from the tokenizer or the embedding before the graph can be built")]
    VocabUnknown,
    #[error("the planned context must be at least 1")]
    ZeroContext,
    #[error(transparent)]
    Graph(#[from] GraphError),
}

/// What the graph is built for, beyond the model arguments.
#[derive(Debug, Clone)]
pub struct BuildOptions {
    /// The planned context `C`: the KV cache holds this many positions.
    pub context: usize,
    /// The dtype weights are declared with unless `weight_dtypes` says
    /// otherwise (Meta's checkpoints: bf16).
    pub default_weight_dtype: DType,
    /// Per-tensor dtypes (GGUF files mix them).
    pub weight_dtypes: BTreeMap<String, DType>,
    /// Which positions get logits.
    pub logit_rows: LogitRows,
}

impl BuildOptions {
    pub fn new(context: usize) -> Self {
        BuildOptions {
            context,
            default_weight_dtype: DType::BF16,
            weight_dtypes: BTreeMap::new(),
            logit_rows: LogitRows::All,
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
/// `output` (the logits).
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

    let tokens = b.g.add_source(
        "tokens",
        Op::Tokens,
        TensorMeta::new(Shape(vec![Dim::S]), DType::I32),
        None,
    )?;
    let emb_w = b.weight("tok_embeddings.weight", &[vocab, dim], None)?;
    let mut h = b.op(
        "tok_embeddings".into(),
        Op::Embedding,
        &[emb_w, tokens],
        None,
    )?;
    let rope = RopeParams {
        head_dim: hd,
        theta: args.rope_theta,
        scaling: args.rope_scaling,
    };
    let freqs = b.g.add_source(
        "rope.freqs",
        Op::RopeFreqs(rope),
        TensorMeta::new(
            Shape(vec![Dim::S, Dim::Const(hd / 2), Dim::Const(2)]),
            DType::F32,
        ),
        None,
    )?;
    let scale = 1.0 / (hd as f64).sqrt();

    for i in 0..args.n_layers {
        let l = Some(i);
        let p = format!("layers.{i}");
        let a = format!("{p}.attention");
        // Attention block.
        let xn = b.rms_norm(&format!("{p}.attention_norm"), h, dim, eps, l)?;
        let q = b.linear(&format!("{a}.wq"), xn, nh * hd, dim, l)?;
        let k = b.linear(&format!("{a}.wk"), xn, nkv * hd, dim, l)?;
        let v = b.linear(&format!("{a}.wv"), xn, nkv * hd, dim, l)?;
        let q = b.reshape(
            format!("{a}.q_heads"),
            q,
            vec![Dim::S, Dim::Const(nh), Dim::Const(hd)],
            l,
        )?;
        let k = b.reshape(
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
        let q = b.op(format!("{a}.q_rope"), Op::Rope, &[q, freqs], l)?;
        let k = b.op(format!("{a}.k_rope"), Op::Rope, &[k, freqs], l)?;
        let cache_meta = TensorMeta::new(Shape::constant(&[opts.context, nkv, hd]), DType::F32);
        let ck = b.g.add_source(
            format!("{a}.cache_k"),
            Op::KvCache {
                layer: i,
                kind: CacheKind::K,
            },
            cache_meta.clone(),
            l,
        )?;
        let cv = b.g.add_source(
            format!("{a}.cache_v"),
            Op::KvCache {
                layer: i,
                kind: CacheKind::V,
            },
            cache_meta,
            l,
        )?;
        let keys = b.op(format!("{a}.cache_k.write"), Op::KvWrite, &[ck, k], l)?;
        let vals = b.op(format!("{a}.cache_v.write"), Op::KvWrite, &[cv, v], l)?;
        let scores = b.op(
            format!("{a}.scores"),
            Op::AttnScores { n_rep, scale },
            &[q, keys],
            l,
        )?;
        let probs = b.op(format!("{a}.probs"), Op::Softmax, &[scores], l)?;
        let heads = b.op(
            format!("{a}.values"),
            Op::AttnValues { n_rep },
            &[probs, vals],
            l,
        )?;
        let merged = b.reshape(
            format!("{a}.merge_heads"),
            heads,
            vec![Dim::S, Dim::Const(nh * hd)],
            l,
        )?;
        let o = b.linear(&format!("{a}.wo"), merged, dim, nh * hd, l)?;
        h = b.op(format!("{p}.attention_residual"), Op::Add, &[h, o], l)?;
        // Feed-forward block (SwiGLU).
        let f = format!("{p}.feed_forward");
        let xn = b.rms_norm(&format!("{p}.ffn_norm"), h, dim, eps, l)?;
        let gate = b.linear(&format!("{f}.w1"), xn, ffn, dim, l)?;
        let up = b.linear(&format!("{f}.w3"), xn, ffn, dim, l)?;
        let act = b.op(format!("{f}.silu"), Op::Silu, &[gate], l)?;
        let prod = b.op(format!("{f}.gate_up"), Op::Mul, &[act, up], l)?;
        let down = b.linear(&format!("{f}.w2"), prod, dim, ffn, l)?;
        h = b.op(format!("{p}.ffn_residual"), Op::Add, &[h, down], l)?;
    }

    let hn = b.rms_norm("norm", h, dim, eps, None)?;
    let out_w = if args.tied_embeddings {
        emb_w
    } else {
        b.weight("output.weight", &[vocab, dim], None)?
    };
    let logits = b.op(
        "output".into(),
        Op::OutputHead {
            rows: opts.logit_rows,
        },
        &[hn, out_w],
        None,
    )?;
    b.g.mark_output(logits);
    b.g.verify()?;
    Ok(b.g)
}
