//! The `fuse_rope_cache` pass: packed QKV MatMul + slices + RoPE + KV writes -> QkvRopeCache (RoPE and cache write in the epilogue).

use super::rewrite::{nodes_where, op, sole_user, tmp_name, weight_name};
use super::PassStats;
use crate::ir::{Dim, Graph, GraphError, NodeId, Op, Shape};
use std::collections::BTreeSet;

/// `fuse_rope_cache`: a packed QKV MatMul whose slices are reshaped into
/// heads, q and k rotated, k and v written to the caches and the caches
/// read only by fused `Attention` -> one `QkvRopeCache` that rotates q/k
/// and writes k/v in the matmul's epilogue; attention reads the caches.
/// Bias adds on the three slices (Qwen2) and a per-head norm of q and k
/// before RoPE (Qwen3, Gemma 3; after `fold_norm_weight`) join the
/// epilogue. Runs after `fuse_qkv` and `fuse_attention`.
pub fn fuse_rope_cache(g: &mut Graph) -> Result<PassStats, GraphError> {
    let mut n = 0;
    for mm in nodes_where(g, |o| matches!(o, Op::MatMul)) {
        if !g.contains(mm) || !matches!(op(g, mm), Op::MatMul) {
            continue;
        }
        let Some(m) = match_qkv_rope(g, mm) else {
            continue;
        };
        let layer = g.node(mm).layer;
        let mut ins = vec![m.x, m.w, m.freqs, m.cache_k, m.cache_v, m.slots];
        ins.extend(&m.biases);
        if let Some((qw, kw, _)) = m.qk_norm {
            ins.extend([qw, kw]);
        }
        let new = g.add_op(
            tmp_name(g, &g.node(mm).name),
            Op::QkvRopeCache {
                n_heads: m.heads.0,
                n_kv_heads: m.heads.1,
                head_dim: m.heads.2,
                bias: !m.biases.is_empty(),
                qk_norm: m.qk_norm.map(|(_, _, eps)| eps),
            },
            &ins,
            layer,
        )?;
        g.replace_uses(m.q_rope, new);
        g.replace_uses(m.k_write, m.cache_k);
        g.replace_uses(m.v_write, m.cache_v);
        let name = g.node(mm).name.clone();
        for d in m.dead {
            g.remove(d);
        }
        g.rename(new, name)?;
        n += 1;
    }
    Ok(PassStats { rewrites: n })
}

struct QkvMatch {
    x: NodeId,
    w: NodeId,
    freqs: NodeId,
    cache_k: NodeId,
    cache_v: NodeId,
    slots: NodeId,
    q_rope: NodeId,
    k_write: NodeId,
    v_write: NodeId,
    heads: (usize, usize, usize),
    /// The q, k, v bias vectors, or none.
    biases: Vec<NodeId>,
    /// The q and k norm weights and their eps.
    qk_norm: Option<(NodeId, NodeId, f64)>,
    dead: Vec<NodeId>,
}

fn match_qkv_rope(g: &Graph, mm: NodeId) -> Option<QkvMatch> {
    let mi = g.inputs(mm);
    let w = mi[1];
    let wn = weight_name(g, w)?;
    if g.packed_weight(wn)?.parts.len() != 3 || g.outputs().contains(&mm) {
        return None;
    }
    // Three slices in column order.
    let mut slices: Vec<(usize, usize, NodeId)> = Vec::new();
    for u in g.users(mm) {
        match *op(g, u) {
            Op::SliceCols { start, len } => slices.push((start, len, u)),
            _ => return None,
        }
    }
    slices.sort_unstable();
    if slices.len() != 3 {
        return None;
    }
    let total = g.node(mm).meta.shape.dims()[1].as_const()?;
    if slices[0].0 != 0
        || slices[1].0 != slices[0].1
        || slices[2].0 != slices[1].0 + slices[1].1
        || slices[2].0 + slices[2].1 != total
    {
        return None;
    }
    let mut dead = vec![mm];
    // Each slice -> its sole reader, a Reshape to [S, heads, D], or a bias
    // add (of a vector weight) and then the Reshape; all three or none.
    let mut heads = Vec::new();
    let mut biases = Vec::new();
    for &(_, _, s) in &slices {
        let mut r = sole_user(g, s)?;
        dead.push(s);
        if matches!(op(g, r), Op::Add) {
            let ai = g.inputs(r);
            let b = ai[1];
            if ai[0] != s || weight_name(g, b).is_none() || g.node(b).meta.shape.rank() != 1 {
                return None;
            }
            biases.push(b);
            dead.push(r);
            r = sole_user(g, r)?;
        }
        if !matches!(op(g, r), Op::Reshape) {
            return None;
        }
        let d = g.node(r).meta.shape.dims();
        if d.len() != 3 || d[0] != Dim::S {
            return None;
        }
        heads.push((r, d[1].as_const()?, d[2].as_const()?));
        dead.push(r);
    }
    if !(biases.is_empty() || biases.len() == 3) {
        return None;
    }
    let (h, hkv, hd) = (heads[0].1, heads[1].1, heads[0].2);
    if heads[2].1 != hkv || heads[1].2 != hd || heads[2].2 != hd {
        return None;
    }
    // q and k heads -> (a per-head norm with its weight folded in) -> RoPE;
    // both normed with one eps, or neither.
    // (the Rope node, its angles, the norm node with its weight and eps)
    type RopeOf = (NodeId, NodeId, Option<(NodeId, NodeId, f64)>);
    let rope_of = |r: NodeId| -> Option<RopeOf> {
        let mut u = sole_user(g, r)?;
        let mut norm = None;
        if let Op::RmsNormScaled { eps } = *op(g, u) {
            let w = g.inputs(u)[1];
            if weight_name(g, w).is_none() || g.node(w).meta.shape != Shape::constant(&[hd]) {
                return None;
            }
            norm = Some((u, w, eps));
            let n = u;
            u = sole_user(g, n)?;
            let ui = g.inputs(u);
            return (matches!(op(g, u), Op::Rope) && ui[0] == n).then_some((u, ui[1], norm));
        }
        let ui = g.inputs(u);
        (matches!(op(g, u), Op::Rope) && ui[0] == r).then_some((u, ui[1], norm))
    };
    let (q_rope, fq, q_norm) = rope_of(heads[0].0)?;
    let (k_rope, fk, k_norm) = rope_of(heads[1].0)?;
    if fq != fk {
        return None;
    }
    let qk_norm = match (q_norm, k_norm) {
        (None, None) => None,
        (Some((qn, qw, e1)), Some((kn, kw, e2))) if e1 == e2 => {
            dead.extend([qn, kn]);
            Some((qw, kw, e1))
        }
        _ => return None,
    };
    dead.extend([q_rope, k_rope]);
    let write_of = |x: NodeId| -> Option<(NodeId, NodeId, NodeId)> {
        let u = sole_user(g, x)?;
        let ui = g.inputs(u);
        (matches!(op(g, u), Op::KvWrite) && ui[1] == x).then_some((u, ui[0], ui[2]))
    };
    let (k_write, cache_k, slots) = write_of(k_rope)?;
    let (v_write, cache_v, v_slots) = write_of(heads[2].0)?;
    if slots != v_slots {
        return None;
    }
    // The caches after the writes must be read only by fused attention,
    // which then reads the caches themselves (the write happens in the
    // epilogue that produces its q).
    for (wr, slot) in [(k_write, 1), (v_write, 2)] {
        if g.outputs().contains(&wr) {
            return None;
        }
        for u in g.users(wr) {
            let ui = g.inputs(u);
            let ok = matches!(op(g, u), Op::Attention { .. })
                && ui
                    .iter()
                    .enumerate()
                    .all(|(i, &x)| (x == wr) == (i == slot));
            if !ok {
                return None;
            }
        }
    }
    dead.extend([k_write, v_write]);
    let uniq: BTreeSet<NodeId> = dead.iter().copied().collect();
    if uniq.len() != dead.len() {
        return None;
    }
    Some(QkvMatch {
        x: mi[0],
        w,
        freqs: fq,
        cache_k,
        cache_v,
        slots,
        q_rope,
        k_write,
        v_write,
        heads: (h, hkv, hd),
        biases,
        qk_norm,
        dead,
    })
}
