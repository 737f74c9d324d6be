//! The `fuse_qkv` pass: wq/wk/wv MatMuls on one input -> one MatMul over a packed wqkv weight + column slices.

use super::rewrite::{commit, nodes_where, op, packed_weight, tmp_name, weight_name};
use super::PassStats;
use crate::ir::{Graph, GraphError, NodeId, Op};

/// `fuse_qkv`: the `wq`, `wk`, `wv` MatMuls reading one input become one
/// MatMul over the packed `wqkv` weight followed by column slices (which
/// keep the old node names).
pub fn fuse_qkv(g: &mut Graph) -> Result<PassStats, GraphError> {
    let mut n = 0;
    for mq in nodes_where(g, |o| matches!(o, Op::MatMul)) {
        if !g.contains(mq) || !matches!(op(g, mq), Op::MatMul) {
            continue;
        }
        let ins = g.inputs(mq);
        let Some(wq) = weight_name(g, ins[1]) else {
            continue;
        };
        let Some(prefix) = wq.strip_suffix(".wq.weight") else {
            continue;
        };
        let prefix = prefix.to_string();
        let x = ins[0];
        let find = |suffix: &str| {
            g.users(x).into_iter().find(|&u| {
                matches!(op(g, u), Op::MatMul)
                    && g.inputs(u)[0] == x
                    && weight_name(g, g.inputs(u)[1]) == Some(&format!("{prefix}.{suffix}.weight"))
            })
        };
        let (Some(mk), Some(mv)) = (find("wk"), find("wv")) else {
            continue;
        };
        let mms = [mq, mk, mv];
        let ws: Vec<NodeId> = mms.iter().map(|&m| g.inputs(m)[1]).collect();
        let layer = g.node(mq).layer;
        let Some(w) = packed_weight(g, &format!("{prefix}.wqkv.weight"), &ws, layer)? else {
            continue;
        };
        let qkv = g.add_op(format!("{prefix}.wqkv"), Op::MatMul, &[x, w], layer)?;
        let mut start = 0;
        for m in mms {
            let len = g.node(m).meta.shape.dims()[1]
                .as_const()
                .ok_or_else(|| GraphError::node(&g.node(m).name, "columns must be constant"))?;
            let sl = g.add_op(
                tmp_name(g, &g.node(m).name),
                Op::SliceCols { start, len },
                &[qkv],
                layer,
            )?;
            start += len;
            commit(g, m, sl, &[])?;
        }
        n += 1;
    }
    Ok(PassStats { rewrites: n })
}
