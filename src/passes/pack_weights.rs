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
use crate::ir::{Graph, GraphError, NodeId, Op, PackedWeight, TensorMeta};

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
