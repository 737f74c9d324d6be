//! The `fold_norm_weight` pass: RmsNorm followed by a Mul by its weight -> RmsNormScaled.

use super::rewrite::{nodes_where, op, sole_user, tmp_name, weight_name};
use super::PassStats;
use crate::ir::{Graph, GraphError, Op};

/// `fold_norm_weight`: `Mul(RmsNorm(x), w[E])` -> `RmsNormScaled(x, w)`.
pub fn fold_norm_weight(g: &mut Graph) -> Result<PassStats, GraphError> {
    let mut n = 0;
    for norm in nodes_where(g, |o| matches!(o, Op::RmsNorm { .. })) {
        if !g.contains(norm) || !matches!(op(g, norm), Op::RmsNorm { .. }) {
            continue;
        }
        let Op::RmsNorm { eps } = *op(g, norm) else {
            continue;
        };
        let Some(mul) = sole_user(g, norm) else {
            continue;
        };
        let mi = g.inputs(mul);
        if !matches!(op(g, mul), Op::Mul) || mi[0] != norm || weight_name(g, mi[1]).is_none() {
            continue;
        }
        if g.node(mi[1]).meta.shape.rank() != 1 {
            continue;
        }
        let x = g.inputs(norm)[0];
        let layer = g.node(norm).layer;
        let norm_name = g.node(norm).name.clone();
        let new = g.add_op(
            tmp_name(g, &norm_name),
            Op::RmsNormScaled { eps },
            &[x, mi[1]],
            layer,
        )?;
        g.replace_uses(mul, new);
        g.remove(mul);
        g.remove(norm);
        g.rename(new, norm_name)?;
        n += 1;
    }
    Ok(PassStats { rewrites: n })
}
