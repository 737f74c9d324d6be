//! `pack_weights`: every matrix a linear layer reads becomes a packed
//! weight, so that binding copies it into the session's weight arena.
//!
//! The builder's graph reads each weight straight from the checkpoint: a
//! range of a memory-mapped file, in 4 KiB page-cache pages. Decode streams
//! every weight byte once per token, and a stream over 4 KiB pages is slow:
//! the hardware prefetcher stops at every page boundary and every page costs
//! a TLB entry. The weight arena (see [`crate::exec::materialize_packed`])
//! is one anonymous mapping backed by 2 MiB transparent huge pages where the
//! kernel grants them; the fused weights (`wqkv`, `w13`) already live there,
//! and this pass moves the rest of the linear layers' weights (`wo`, `w2`,
//! the output head) there too. The copy is made once per session; the
//! file's pages are released as they are copied, so the resident size does
//! not grow.
//!
//! The rewrite is a one-part [`PackedWeight`] named `<tensor>.packed` that
//! replaces every use of the checkpoint tensor's weight node (a tied
//! embedding table is then also gathered from the arena copy). Weights that
//! only feed other ops (norm vectors) and weights that are already packed
//! are left alone.

use super::PassStats;
use crate::ir::{DType, Graph, GraphError, NodeId, Op, PackedWeight, TensorMeta, WeightLayout};

/// Suffix of the packed copy of a checkpoint tensor.
pub const PACKED_SUFFIX: &str = ".packed";

/// The input slot holding the weight matrix of a linear-layer op, if `op` is one.
fn weight_slot(op: &Op) -> Option<usize> {
    match op {
        Op::MatMul | Op::MatMulSwiGlu | Op::QkvRopeCache { .. } | Op::OutputHead => Some(1),
        Op::MatMulAdd => Some(2),
        _ => None,
    }
}

/// True if `w` is a checkpoint weight read as the matrix of a linear layer.
fn feeds_linear(g: &Graph, w: NodeId) -> bool {
    g.users(w)
        .into_iter()
        .any(|u| weight_slot(&g.node(u).op).is_some_and(|slot| g.inputs(u).get(slot) == Some(&w)))
}

/// `pack_weights`: see the module documentation.
pub fn pack_weights(g: &mut Graph) -> Result<PassStats, GraphError> {
    let weights: Vec<(NodeId, String)> = g
        .node_ids()
        .filter_map(|id| match &g.node(id).op {
            Op::Weight { tensor } if g.packed_weight(tensor).is_none() => {
                Some((id, tensor.clone()))
            }
            _ => None,
        })
        .collect();
    let mut n = 0;
    for (w, tensor) in weights {
        if !feeds_linear(g, w) {
            continue;
        }
        let name = format!("{tensor}{PACKED_SUFFIX}");
        if g.find(&name).is_some() {
            return Err(GraphError::node(
                &name,
                "a node of this name exists already; cannot pack the weight under it",
            ));
        }
        let node = g.node(w);
        let meta: TensorMeta = node.meta.clone();
        let layer = node.layer;
        let packed = g.add_source(
            name.clone(),
            Op::Weight {
                tensor: name.clone(),
            },
            meta,
            layer,
        )?;
        g.add_packed(PackedWeight {
            name,
            parts: vec![tensor],
            axis: 0,
            stored_as: None,
            layout: Default::default(),
        });
        g.replace_uses(w, packed);
        g.remove(w);
        n += 1;
    }
    Ok(PassStats { rewrites: n })
}

/// `compress_weights`: every packed weight stored as bf16 is stored as
/// [`DType::BF16Z`] instead: the same values, losslessly, in 49 bytes per 32
/// weights plus a small table of exceptions (see [`crate::kernels::matmul::bf16z`]).
///
/// Decode reads every weight byte once per token at the memory bandwidth,
/// so a quarter fewer bytes is a quarter less to wait for; the weight arena
/// shrinks by as much. Products over the compressed weights are exact, as
/// over bf16 (single tokens decode in registers; prefill decodes each group
/// of rows once per chunk). Runs after `pack_weights`, which puts every
/// linear layer's weight in the arena; weights whose rows are not a
/// multiple of 32 values stay bf16.
pub fn compress_weights(g: &mut Graph) -> Result<PassStats, GraphError> {
    let names: Vec<String> = g.packed().map(|p| p.name.clone()).collect();
    let mut n = 0;
    for name in names {
        let Some(id) = g.find(&name) else { continue };
        let meta = &g.node(id).meta;
        let cols = match meta.shape.dims() {
            [rows, cols] => rows.as_const().and(cols.as_const()),
            _ => None,
        };
        let stored = g.packed_weight(&name).and_then(|p| p.stored_as);
        if meta.dtype != DType::BF16 || stored.is_some() {
            continue;
        }
        if !cols.is_some_and(|c| c > 0 && c % crate::kernels::matmul::bf16z::BLOCK == 0) {
            continue;
        }
        g.node_mut(id).meta.dtype = DType::BF16Z;
        if let Some(p) = g.packed_weight_mut(&name) {
            p.stored_as = Some(DType::BF16Z);
        }
        n += 1;
    }
    Ok(PassStats { rewrites: n })
}

/// `interleave_weights`: every packed block-quantized weight the fast path
/// reads in the x8 layout is stored that way (rows interleaved in groups of
/// 8; see [`crate::kernels::quantized::fast::x8`]).
///
/// A decode step multiplies every weight row with one token. Stored row by
/// row, each row's block products end in a sum across the vector's lanes and
/// each row's scales are gathered one by one; in the x8 layout a vector
/// holds the same word of 8 rows, so lane `r` accumulates row `r` and the
/// scales of 8 rows are one vector. The arithmetic is the same integer sums
/// and the same f32 steps, so every output is bit for bit what the row-major
/// kernels give. Binding repacks the weights once, as it copies them into the
/// arena. Weights whose row count (or, for a SwiGLU matmul's `w13`, half of
/// it) is not a multiple of 8 stay as they are, as do dtypes without an x8
/// layout. Sessions in exact mode skip this pass (their kernels read rows).
pub fn interleave_weights(g: &mut Graph) -> Result<PassStats, GraphError> {
    use crate::kernels::quantized::fast::x8;
    let names: Vec<String> = g.packed().map(|p| p.name.clone()).collect();
    let mut n = 0;
    for name in names {
        let Some(id) = g.find(&name) else { continue };
        let meta = &g.node(id).meta;
        let Some((rows, cols)) = (match meta.shape.dims() {
            [r, c] => r.as_const().zip(c.as_const()),
            _ => None,
        }) else {
            continue;
        };
        let Some(p) = g.packed_weight(&name) else {
            continue;
        };
        if p.stored_as.is_some()
            || p.layout != WeightLayout::Rows
            || !x8::supports(meta.dtype, rows, cols)
        {
            continue;
        }
        // The SwiGLU epilogue reads the gate and up halves as two matrices.
        let halves = g
            .users(id)
            .into_iter()
            .any(|u| matches!(g.node(u).op, Op::MatMulSwiGlu));
        if halves && !(rows / 2).is_multiple_of(x8::G) {
            continue;
        }
        if let Some(p) = g.packed_weight_mut(&name) {
            p.layout = WeightLayout::X8;
        }
        n += 1;
    }
    Ok(PassStats { rewrites: n })
}
