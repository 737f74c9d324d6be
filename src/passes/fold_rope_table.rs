//! The `fold_rope_table` pass: RoPE cos/sin for every position the KV pool holds, computed once (constant folding); each step gathers its tokens' rows.

use super::rewrite::{commit, const_dims, nodes_where, op, tmp_name};
use super::PassStats;
use crate::ir::{CacheKind, DType, Graph, GraphError, Op, Shape, TensorMeta};

/// `fold_rope_table`: replaces the per-step `RopeFreqs(positions)` by a
/// `RopeTable` constant over every position the KV pool can hold (Llama 3.1
/// scaling included) and a `GatherRows` of each token's row of it.
pub fn fold_rope_table(g: &mut Graph) -> Result<PassStats, GraphError> {
    // (blocks, block size) of each layer's keys.
    let pools: Vec<(usize, usize)> = g
        .node_ids()
        .filter(|&i| {
            matches!(
                op(g, i),
                Op::KvCache {
                    kind: CacheKind::K,
                    ..
                }
            )
        })
        .filter_map(|i| {
            let d = const_dims(&g.node(i).meta)?;
            (d.len() == 4).then(|| (d[0], d[3]))
        })
        .collect();
    // A position may be as far as the block table reaches: window layers
    // keep a smaller pool, but their positions run as far as the others'.
    let table = g
        .node_ids()
        .filter(|&i| matches!(op(g, i), Op::BlockTable | Op::WindowBlockTable))
        .filter_map(|i| g.node(i).meta.shape.const_numel())
        .max()
        .unwrap_or(0);
    let capacity = pools.iter().map(|&(nb, bs)| nb.max(table) * bs).max();
    let Some(capacity) = capacity else {
        return Ok(PassStats::default());
    };
    let mut n = 0;
    for id in nodes_where(g, |o| matches!(o, Op::RopeFreqs(_))) {
        if !g.contains(id) {
            continue;
        }
        let Op::RopeFreqs(params) = *op(g, id) else {
            continue;
        };
        let positions = g.inputs(id)[0];
        let t = Op::RopeTable {
            params,
            max_pos: capacity,
        };
        let meta = TensorMeta::new(
            Shape::constant(&[capacity, params.head_dim / 2, 2]),
            DType::F32,
        );
        let layer = g.node(id).layer;
        let base = g.node(id).name.replace("freqs", "table");
        let name = if g.find(&base).is_none() {
            base
        } else {
            tmp_name(g, &base)
        };
        let table = g.add_source(name, t, meta, layer)?;
        let rows = g.add_op(
            tmp_name(g, &g.node(id).name),
            Op::GatherRows,
            &[table, positions],
            layer,
        )?;
        commit(g, id, rows, &[])?;
        n += 1;
    }
    Ok(PassStats { rewrites: n })
}
