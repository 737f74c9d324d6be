//! The `last_logits` pass: final norm and output head on the last token of each sequence only.

use super::rewrite::{commit, nodes_where, op, sole_user, tmp_name};
use super::PassStats;
use crate::ir::{Dim, Graph, GraphError, NodeId, Op};

/// `last_logits`: logits for the last token of each sequence only. The
/// output head reads `LastRows(x)` (`[N, E]`) instead of every token's row,
/// and when `x` is a final norm that nothing else reads, the norm runs on
/// those rows only: `LastRows(norm(h))` -> `norm(LastRows(h))`.
pub fn last_logits(g: &mut Graph) -> Result<PassStats, GraphError> {
    let mut n = 0;
    let seqs = g.node_ids().find(|&i| matches!(op(g, i), Op::SeqTable));
    // The head reads every token's row: read the last rows instead.
    if let Some(seqs) = seqs {
        for head in nodes_where(g, |o| matches!(o, Op::OutputHead)) {
            let x = g.inputs(head)[0];
            if matches!(op(g, x), Op::LastRows) || g.node(x).meta.shape.dims()[0] != Dim::S {
                continue;
            }
            let layer = g.node(head).layer;
            let base = format!("{}.last_rows", g.node(x).name);
            let name = if g.find(&base).is_none() {
                base
            } else {
                tmp_name(g, &base)
            };
            let rows = g.add_op(name, Op::LastRows, &[x, seqs], layer)?;
            let w = g.inputs(head)[1];
            let new = g.add_op(
                tmp_name(g, &g.node(head).name),
                Op::OutputHead,
                &[rows, w],
                layer,
            )?;
            commit(g, head, new, &[])?;
            n += 1;
        }
    }
    // Rows taken after a row-wise op (the final norm, its weight): take
    // them before it, until the head reads rows of the residual stream.
    let row_wise = |g: &Graph, x: NodeId| match op(g, x) {
        Op::RmsNorm { .. } | Op::RmsNormScaled { .. } => true,
        Op::Mul => g.node(g.inputs(x)[1]).meta.shape.rank() == 1,
        _ => false,
    };
    loop {
        let found = nodes_where(g, |o| matches!(o, Op::LastRows))
            .into_iter()
            .find(|&last| {
                let x = g.inputs(last)[0];
                row_wise(g, x) && sole_user(g, x) == Some(last) && g.node(x).meta.shape.rank() == 2
            });
        let Some(last) = found else {
            break;
        };
        let li = g.inputs(last);
        let (x, seqs) = (li[0], li[1]);
        let xi = g.inputs(x);
        let (x_layer, last_layer) = (g.node(x).layer, g.node(last).layer);
        let rows = g.add_op(
            tmp_name(g, &g.node(last).name),
            Op::LastRows,
            &[xi[0], seqs],
            last_layer,
        )?;
        let mut ins = xi.clone();
        ins[0] = rows;
        let nx = g.add_op(
            tmp_name(g, &g.node(x).name),
            op(g, x).clone(),
            &ins,
            x_layer,
        )?;
        let (x_name, last_name) = (g.node(x).name.clone(), g.node(last).name.clone());
        g.replace_uses(last, nx);
        g.remove(last);
        g.remove(x);
        g.rename(nx, x_name)?;
        g.rename(rows, last_name)?;
        n += 1;
    }
    Ok(PassStats { rewrites: n })
}
