//! The passes themselves. Each finds its pattern by walking the graph,
//! builds the fused node with the ordinary checked constructors (so shape
//! inference re-checks it), points the users of the old result at it and
//! removes the compute nodes it replaces. Sources left without users
//! (weights of fused matmuls) are dropped by `dead_code`.

use super::{is_root, PassStats};
use crate::ir::{
    CacheKind, DType, Dim, Graph, GraphError, NodeId, Op, PackedWeight, Shape, TensorMeta,
};
use std::collections::BTreeSet;

fn op(g: &Graph, id: NodeId) -> &Op {
    &g.node(id).op
}

/// The only reader of `id`, if it has exactly one (through one edge) and
/// is not a graph output.
fn sole_user(g: &Graph, id: NodeId) -> Option<NodeId> {
    let u = g.users(id);
    if u.len() == 1
        && !g.outputs().contains(&id)
        && g.inputs(u[0]).iter().filter(|&&i| i == id).count() == 1
    {
        Some(u[0])
    } else {
        None
    }
}

/// The weight tensor name of a weight node.
fn weight_name(g: &Graph, id: NodeId) -> Option<&str> {
    match op(g, id) {
        Op::Weight { tensor } => Some(tensor),
        _ => None,
    }
}

fn tmp_name(g: &Graph, base: &str) -> String {
    let mut i = 0;
    loop {
        let n = format!("{base}#new{i}");
        if g.find(&n).is_none() {
            return n;
        }
        i += 1;
    }
}

/// Nodes of one op kind, in id order (a snapshot: rewriting is safe).
fn nodes_where(g: &Graph, f: impl Fn(&Op) -> bool) -> Vec<NodeId> {
    g.node_ids().filter(|&i| f(op(g, i))).collect()
}

fn const_dims(m: &TensorMeta) -> Option<Vec<usize>> {
    m.shape.dims().iter().map(|d| d.as_const()).collect()
}

/// Replaces `old` (all uses and its name) by `new`, then removes `old` and
/// the other `dead` compute nodes.
fn commit(g: &mut Graph, old: NodeId, new: NodeId, dead: &[NodeId]) -> Result<(), GraphError> {
    let name = g.node(old).name.clone();
    g.replace_uses(old, new);
    g.remove(old);
    for &d in dead {
        if d != old && g.contains(d) {
            g.remove(d);
        }
    }
    g.rename(new, name)
}

/// Adds (or finds) the weight node of a packed weight made of `parts`
/// concatenated along axis 0 and records it in the graph.
fn packed_weight(
    g: &mut Graph,
    name: &str,
    parts: &[NodeId],
    layer: Option<usize>,
) -> Result<Option<NodeId>, GraphError> {
    let mut rows = 0usize;
    let mut cols = None;
    let mut dtype: Option<DType> = None;
    let mut names = Vec::new();
    for &p in parts {
        let Some(n) = weight_name(g, p) else {
            return Ok(None);
        };
        let meta = &g.node(p).meta;
        let Some(d) = const_dims(meta) else {
            return Ok(None);
        };
        if d.len() != 2 || cols.is_some_and(|c| c != d[1]) || dtype.is_some_and(|t| t != meta.dtype)
        {
            return Ok(None);
        }
        cols = Some(d[1]);
        dtype = Some(meta.dtype);
        rows += d[0];
        names.push(n.to_string());
    }
    let (Some(cols), Some(dtype)) = (cols, dtype) else {
        return Ok(None);
    };
    if let Some(id) = g.find(name) {
        return Ok(Some(id));
    }
    let id = g.add_source(
        name,
        Op::Weight {
            tensor: name.to_string(),
        },
        TensorMeta::new(Shape::constant(&[rows, cols]), dtype),
        layer,
    )?;
    g.add_packed(PackedWeight {
        name: name.to_string(),
        parts: names,
        axis: 0,
        stored_as: None,
        layout: Default::default(),
    });
    Ok(Some(id))
}

/// `fold_rope_table`: replaces the per-step `RopeFreqs(positions)` by a
/// `RopeTable` constant over every position the KV pool can hold (Llama 3.1
/// scaling included) and a `GatherRows` of each token's row of it.
pub fn fold_rope_table(g: &mut Graph) -> Result<PassStats, GraphError> {
    let capacity = g
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
            (d.len() == 4).then(|| d[0] * d[3])
        })
        .max();
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

/// `fuse_gate_up`: `Mul(Silu(x·w1ᵀ), x·w3ᵀ)` -> `MatMulSwiGlu(x, w13)` over
/// the packed `w13` weight (gate rows, then up rows).
pub fn fuse_gate_up(g: &mut Graph) -> Result<PassStats, GraphError> {
    let mut n = 0;
    for mul in nodes_where(g, |o| matches!(o, Op::Mul)) {
        if !g.contains(mul) || !matches!(op(g, mul), Op::Mul) {
            continue;
        }
        let mi = g.inputs(mul);
        let (silu, up) = (mi[0], mi[1]);
        if !matches!(op(g, silu), Op::Silu) || !matches!(op(g, up), Op::MatMul) {
            continue;
        }
        let gate = g.inputs(silu)[0];
        if !matches!(op(g, gate), Op::MatMul)
            || sole_user(g, gate) != Some(silu)
            || sole_user(g, silu) != Some(mul)
            || sole_user(g, up) != Some(mul)
        {
            continue;
        }
        let (gi, ui) = (g.inputs(gate), g.inputs(up));
        if gi[0] != ui[0] || g.node(gi[1]).meta.shape != g.node(ui[1]).meta.shape {
            continue;
        }
        let Some(w1) = weight_name(g, gi[1]) else {
            continue;
        };
        let packed = match w1.strip_suffix("w1.weight") {
            Some(p) => format!("{p}w13.weight"),
            None => format!("{w1}+up"),
        };
        let layer = g.node(mul).layer;
        let Some(w) = packed_weight(g, &packed, &[gi[1], ui[1]], layer)? else {
            continue;
        };
        let name = packed
            .strip_suffix(".weight")
            .unwrap_or(&packed)
            .to_string();
        let name = if g.find(&name).is_some() {
            tmp_name(g, &name)
        } else {
            name
        };
        let new = g.add_op(name.clone(), Op::MatMulSwiGlu, &[gi[0], w], layer)?;
        g.replace_uses(mul, new);
        for d in [mul, silu, gate, up] {
            g.remove(d);
        }
        n += 1;
    }
    Ok(PassStats { rewrites: n })
}

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

/// `fuse_attention`: `AttnValues(Softmax(AttnScores(q, k)), v)` ->
/// `Attention(q, k, v)` (the streaming-softmax kernel). Only for the
/// standard `1/sqrt(head_dim)` scale, which the fused kernel applies.
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
        // A windowed layer keeps the unfused path: the streaming kernel
        // attends every position up to the query's own.
        let Op::AttnScores {
            n_rep: r2,
            scale,
            window: None,
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
            Op::Attention { n_rep, scale },
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

/// `dead_code`: removes every node from which no output and no
/// side-effecting node (a cache write) can be reached.
pub fn dead_code(g: &mut Graph) -> Result<PassStats, GraphError> {
    let mut live: BTreeSet<NodeId> = BTreeSet::new();
    let mut stack: Vec<NodeId> = g.node_ids().filter(|&i| is_root(g, i)).collect();
    while let Some(id) = stack.pop() {
        if live.insert(id) {
            stack.extend(g.inputs(id));
        }
    }
    let dead: Vec<NodeId> = g.node_ids().filter(|i| !live.contains(i)).collect();
    for &d in &dead {
        g.remove(d);
    }
    Ok(PassStats {
        rewrites: dead.len(),
    })
}
