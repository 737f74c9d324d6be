//! The `fuse_attention` pass: AttnScores -> Softmax -> AttnValues -> Attention (online softmax, no S×T matrix).

use super::rewrite::{nodes_where, op, sole_user, tmp_name};
use super::PassStats;
use crate::ir::{Graph, GraphError, Op};

/// `fuse_attention`: `AttnValues(Softmax(AttnScores(q, k)), v)` ->
/// `Attention(q, k, v)` (the streaming-softmax kernel), keeping the
/// scores' sliding window if any. Only for the standard `1/sqrt(head_dim)`
/// scale, which the fused kernel applies.
pub fn fuse_attention(g: &mut Graph) -> Result<PassStats, GraphError> {
    let mut n = 0;
    for values in nodes_where(g, |o| matches!(o, Op::AttnValues { .. })) {
        if !g.contains(values) || !matches!(op(g, values), Op::AttnValues { .. }) {
            continue;
        }
        let Op::AttnValues { n_rep } = *op(g, values) else {
            continue;
        };
        let vi = g.inputs(values);
        let probs = vi[0];
        if !matches!(op(g, probs), Op::Softmax) || sole_user(g, probs) != Some(values) {
            continue;
        }
        let scores = g.inputs(probs)[0];
        let Op::AttnScores {
            n_rep: r2,
            scale,
            window,
        } = *op(g, scores)
        else {
            continue;
        };
        if r2 != n_rep || sole_user(g, scores) != Some(probs) {
            continue;
        }
        let si = g.inputs(scores);
        // Both read the same step's sequence and block tables.
        if si[2..] != vi[2..] {
            continue;
        }
        let d = g.node(si[0]).meta.shape.dims()[2].as_const().unwrap_or(0);
        if d == 0 || (scale - 1.0 / (d as f64).sqrt()).abs() > 1e-12 {
            continue;
        }
        let layer = g.node(values).layer;
        let base = g.node(scores).name.replace(".scores", ".attend");
        let name = if g.find(&base).is_some() {
            tmp_name(g, &base)
        } else {
            base
        };
        let new = g.add_op(
            name,
            Op::Attention {
                n_rep,
                scale,
                window,
            },
            &[si[0], si[1], vi[1], si[2], si[3]],
            layer,
        )?;
        g.replace_uses(values, new);
        for x in [values, probs, scores] {
            g.remove(x);
        }
        n += 1;
    }
    Ok(PassStats { rewrites: n })
}
