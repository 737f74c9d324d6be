//! The `fuse_residual` pass: Add(h, MatMul(..)) -> MatMulAdd (residual add in the matmul epilogue).

use super::rewrite::{commit, nodes_where, op, sole_user, tmp_name};
use super::PassStats;
use crate::ir::{Graph, GraphError, Op};

/// `fuse_residual`: `Add(h, x·wᵀ)` -> `MatMulAdd(h, x, w)` when the matmul
/// has no other reader.
pub fn fuse_residual(g: &mut Graph) -> Result<PassStats, GraphError> {
    let mut n = 0;
    for add in nodes_where(g, |o| matches!(o, Op::Add)) {
        if !g.contains(add) || !matches!(op(g, add), Op::Add) {
            continue;
        }
        let ai = g.inputs(add);
        let pick = [(ai[1], ai[0]), (ai[0], ai[1])]
            .into_iter()
            .find(|&(m, _)| matches!(op(g, m), Op::MatMul) && sole_user(g, m) == Some(add));
        let Some((mm, resid)) = pick else {
            continue;
        };
        // A bias (a vector broadcast over the rows, as Qwen2's Q/K/V biases
        // stay when their projections are not fused) is not a residual.
        if g.node(resid).meta.shape != g.node(add).meta.shape {
            continue;
        }
        let mi = g.inputs(mm);
        let layer = g.node(add).layer;
        let new = g.add_op(
            tmp_name(g, &g.node(add).name),
            Op::MatMulAdd,
            &[resid, mi[0], mi[1]],
            layer,
        )?;
        commit(g, add, new, &[mm])?;
        n += 1;
    }
    Ok(PassStats { rewrites: n })
}
