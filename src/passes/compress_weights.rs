//! The `compress_weights` pass: every packed bf16 weight -> bf16z (lossless, 49 bytes per 32 weights plus exceptions): a quarter fewer bytes per decode step.

use super::PassStats;
use crate::ir::{DType, Graph, GraphError};

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
