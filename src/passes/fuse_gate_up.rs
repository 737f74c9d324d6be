//! The `fuse_gate_up` pass: silu(x·w1ᵀ) * (x·w3ᵀ) -> MatMulSwiGlu over a packed w13 weight (SwiGLU epilogue).

use super::rewrite::{nodes_where, op, packed_weight, sole_user, tmp_name, weight_name};
use super::PassStats;
use crate::ir::{Graph, GraphError, Op};

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
