//! Shape and dtype inference: one exhaustive match over [`Op`].
//!
//! `infer` returns the output type of an op applied to inputs of the given
//! types, or a message saying which input disagrees, what was expected and
//! what was found. The graph prefixes the node name.

use super::{CacheKind, DType, Dim, Op, Shape, TensorMeta, SEQ_TABLE_COLS};

fn expect_rank(what: &str, m: &TensorMeta, rank: usize) -> Result<(), String> {
    if m.shape.rank() != rank {
        return Err(format!(
            "{what}: expected rank {rank}, got shape {}",
            m.shape
        ));
    }
    Ok(())
}

fn expect_f32(what: &str, m: &TensorMeta) -> Result<(), String> {
    if m.dtype != DType::F32 {
        return Err(format!("{what}: expected dtype f32, got {}", m.dtype));
    }
    Ok(())
}

fn expect_dim(what: &str, actual: Dim, expected: Dim, shape: &Shape) -> Result<(), String> {
    if actual != expected {
        return Err(format!(
            "{what}: expected dimension {expected}, got {actual} (shape {shape})"
        ));
    }
    Ok(())
}

fn mismatch(what: &str, expected: &Shape, actual: &Shape) -> String {
    format!("{what}: expected shape {expected}, got {actual}")
}

/// Per-token RoPE angles `[rows, D/2, 2]`.
fn check_freqs(what: &str, f: &TensorMeta, rows: Dim, head_dim: usize) -> Result<(), String> {
    expect_f32(what, f)?;
    let want = Shape::new([rows, Dim::Const(head_dim / 2), Dim::Const(2)]);
    if !head_dim.is_multiple_of(2) || f.shape != want {
        return Err(mismatch(what, &want, &f.shape));
    }
    Ok(())
}

/// A per-token step input `i32[S]` (positions, slots).
fn check_per_token(what: &str, m: &TensorMeta) -> Result<(), String> {
    if m.dtype != DType::I32 || m.shape != Shape(vec![Dim::S]) {
        return Err(format!("{what}: expected i32[S], got {m}"));
    }
    Ok(())
}

/// The sequence table `i32[N, 5]`.
fn check_seqs(what: &str, m: &TensorMeta) -> Result<(), String> {
    let want = Shape(vec![Dim::N, Dim::Const(SEQ_TABLE_COLS)]);
    if m.dtype != DType::I32 || m.shape != want {
        return Err(format!("{what}: expected i32{want}, got {m}"));
    }
    Ok(())
}

/// The geometry of a KV cache operand: (blocks, kv heads, head dim, block
/// size), for keys `[NB, Hkv, D, BS]` or values `[NB, Hkv, BS, D]`.
fn cache_geometry(
    what: &str,
    m: &TensorMeta,
    kind: CacheKind,
) -> Result<(usize, usize, usize, usize), String> {
    let dims: Option<Vec<usize>> = m.shape.dims().iter().map(|d| d.as_const()).collect();
    let layout = match kind {
        CacheKind::K => "[NB, Hkv, D, BS]",
        CacheKind::V => "[NB, Hkv, BS, D]",
    };
    let cache_type = matches!(
        m.dtype,
        DType::F32 | DType::F16 | DType::BF16 | DType::Q8_0 | DType::Q4_0
    );
    match dims.as_deref() {
        Some(&[nb, hkv, a, b]) if cache_type && nb > 0 && hkv > 0 && a > 0 && b > 0 => {
            Ok(match kind {
                CacheKind::K => (nb, hkv, a, b),
                CacheKind::V => (nb, hkv, b, a),
            })
        }
        _ => Err(format!(
            "{what}: expected an f32, f16, bf16, q8_0 or q4_0 cache {layout} of constants, got {m}"
        )),
    }
}

/// The quantized cache types group each key's (value's) `d` dims by 32.
fn check_groups(what: &str, m: &TensorMeta, d: usize) -> Result<(), String> {
    if matches!(m.dtype, DType::Q8_0 | DType::Q4_0) && !d.is_multiple_of(32) {
        return Err(format!(
            "{what}: a {} cache needs a head dim that is a multiple of 32, got {d}",
            m.dtype
        ));
    }
    Ok(())
}

/// The block table over a pool of `nb` blocks: `i32[NB]`, or longer for
/// the window layers' own smaller pool, whose table is laid out as the
/// shared pool's ([`Op::WindowBlockTable`]).
fn check_blocks(what: &str, m: &TensorMeta, nb: usize) -> Result<(), String> {
    let n = match m.shape.dims() {
        [d] => d.as_const(),
        _ => None,
    };
    if m.dtype != DType::I32 || n.is_none_or(|n| n < nb) {
        return Err(format!("{what}: expected i32[{nb}] or longer, got {m}"));
    }
    Ok(())
}

/// Checks the K and V caches of one attention and returns (Hkv, D).
fn check_kv_pair(
    k: (&str, &TensorMeta),
    v: (&str, &TensorMeta),
) -> Result<(usize, usize, usize), String> {
    let gk = cache_geometry(k.0, k.1, CacheKind::K)?;
    let gv = cache_geometry(v.0, v.1, CacheKind::V)?;
    check_groups(k.0, k.1, gk.2)?;
    check_groups(v.0, v.1, gv.2)?;
    // Keys and values may have different types (`-ctk`, `-ctv`).
    if gk != gv {
        return Err(format!(
            "{}: expected the values of {} (layout [NB, Hkv, BS, D]), got {}",
            v.0, k.1, v.1
        ));
    }
    Ok((gk.0, gk.1, gk.2))
}

/// Checks `q[S, Hkv·n_rep, D]` and returns H.
fn check_q(
    what: &str,
    q: &TensorMeta,
    hkv: usize,
    d: usize,
    n_rep: usize,
) -> Result<usize, String> {
    expect_f32(what, q)?;
    let h = hkv
        .checked_mul(n_rep)
        .filter(|&h| h > 0)
        .ok_or("n_rep must be positive")?;
    let want = Shape::new([Dim::S, Dim::Const(h), Dim::Const(d)]);
    if q.shape != want {
        return Err(mismatch(what, &want, &q.shape));
    }
    Ok(h)
}

/// Infers the output type of `op` over `inputs`. Sources and `Reshape` take
/// the `declared` type, which is validated.
pub fn infer(
    op: &Op,
    inputs: &[&TensorMeta],
    declared: Option<&TensorMeta>,
) -> Result<TensorMeta, String> {
    if inputs.len() != op.arity() {
        return Err(format!(
            "{} takes {} inputs, got {}",
            op.kind(),
            op.arity(),
            inputs.len()
        ));
    }
    let f32m = |shape: Shape| Ok(TensorMeta::new(shape, DType::F32));
    match op {
        Op::Tokens
        | Op::Positions
        | Op::KvSlots
        | Op::SeqTable
        | Op::BlockTable
        | Op::WindowSlots
        | Op::WindowBlockTable => {
            let d = declared.ok_or("a step input needs a declared type")?;
            let ok = d.dtype == DType::I32
                && match op {
                    Op::SeqTable => d.shape == Shape(vec![Dim::N, Dim::Const(SEQ_TABLE_COLS)]),
                    Op::BlockTable | Op::WindowBlockTable => {
                        d.shape.rank() == 1 && d.shape.const_numel().is_some()
                    }
                    _ => d.shape == Shape(vec![Dim::S]),
                };
            if !ok {
                let want = match op {
                    Op::SeqTable => "i32[N, 5]",
                    Op::BlockTable | Op::WindowBlockTable => "i32[NB] (a constant)",
                    _ => "i32[S]",
                };
                return Err(format!("{} must be {want}, declared {d}", op.kind()));
            }
            Ok(d.clone())
        }
        Op::Weight { .. } => {
            let d = declared.ok_or("Weight needs a declared type")?;
            if d.shape.const_numel().is_none() {
                return Err(format!(
                    "a weight's shape must be constant, got {}",
                    d.shape
                ));
            }
            Ok(d.clone())
        }
        Op::KvCache { kind, .. } => {
            let d = declared.ok_or("KvCache needs a declared type")?;
            cache_geometry("KvCache", d, *kind)?;
            Ok(d.clone())
        }
        Op::RopeFreqs(p) => {
            if p.head_dim == 0 || p.head_dim % 2 != 0 {
                return Err(format!("RoPE needs an even head_dim, got {}", p.head_dim));
            }
            check_per_token("positions (input 0)", inputs[0])?;
            f32m(Shape::new([
                Dim::S,
                Dim::Const(p.head_dim / 2),
                Dim::Const(2),
            ]))
        }
        Op::GatherRows => {
            let (table, idx) = (inputs[0], inputs[1]);
            expect_f32("table (input 0)", table)?;
            if table.shape.rank() == 0 || table.shape.const_numel().is_none() {
                return Err(format!(
                    "table (input 0): expected a constant shape of rank >= 1, got {}",
                    table.shape
                ));
            }
            check_per_token("idx (input 1)", idx)?;
            let mut dims = table.shape.0.clone();
            dims[0] = Dim::S;
            f32m(Shape(dims))
        }
        Op::Embedding => {
            let (table, tokens) = (inputs[0], inputs[1]);
            expect_rank("table (input 0)", table, 2)?;
            if tokens.dtype != DType::I32 {
                return Err(format!(
                    "tokens (input 1): expected dtype i32, got {}",
                    tokens.dtype
                ));
            }
            expect_rank("tokens (input 1)", tokens, 1)?;
            f32m(Shape::new([tokens.shape.0[0], table.shape.0[1]]))
        }
        Op::RmsNorm { eps } => {
            if !(*eps > 0.0 && eps.is_finite()) {
                return Err(format!("eps must be positive, got {eps}"));
            }
            expect_f32("x (input 0)", inputs[0])?;
            if inputs[0].shape.rank() == 0 {
                return Err("x (input 0): RMSNorm needs at least one axis".into());
            }
            f32m(inputs[0].shape.clone())
        }
        Op::MatMul | Op::OutputHead => {
            let (x, w) = (inputs[0], inputs[1]);
            expect_f32("x (input 0)", x)?;
            expect_rank("x (input 0)", x, 2)?;
            expect_rank("weight (input 1)", w, 2)?;
            expect_dim(
                "weight (input 1) axis 1",
                w.shape.0[1],
                x.shape.0[1],
                &w.shape,
            )?;
            f32m(Shape::new([x.shape.0[0], w.shape.0[0]]))
        }
        Op::Reshape => {
            let d = declared.ok_or("Reshape needs a declared shape")?;
            let x = inputs[0];
            if d.dtype != x.dtype {
                return Err(format!(
                    "reshape cannot change dtype {} to {}",
                    x.dtype, d.dtype
                ));
            }
            if d.shape.factorised_numel() != x.shape.factorised_numel() {
                return Err(format!(
                    "reshape from {} to {} changes the element count",
                    x.shape, d.shape
                ));
            }
            Ok(d.clone())
        }
        Op::Rope => {
            let (x, f) = (inputs[0], inputs[1]);
            expect_f32("x (input 0)", x)?;
            expect_rank("x (input 0)", x, 3)?;
            let d = x.shape.0[2]
                .as_const()
                .ok_or("x (input 0): head_dim must be constant")?;
            check_freqs("freqs (input 1)", f, x.shape.0[0], d)?;
            f32m(x.shape.clone())
        }
        Op::KvWrite => {
            let (cache, x, slots) = (inputs[0], inputs[1], inputs[2]);
            // Keys `[NB, Hkv, D, BS]` and values `[NB, Hkv, BS, D]` differ
            // only in the order of the last two axes, and the cache's
            // kind is not part of its type: x must match one of them.
            let (_, hkv, d, bs) = cache_geometry("cache (input 0)", cache, CacheKind::K)?;
            expect_f32("x (input 1)", x)?;
            let as_k = Shape::new([Dim::S, Dim::Const(hkv), Dim::Const(d)]);
            let as_v = Shape::new([Dim::S, Dim::Const(hkv), Dim::Const(bs)]);
            if x.shape != as_k && x.shape != as_v {
                return Err(mismatch("x (input 1)", &as_k, &x.shape));
            }
            check_per_token("slots (input 2)", slots)?;
            Ok(cache.clone())
        }
        Op::AttnScores {
            n_rep,
            scale,
            window,
        } => {
            let (q, k, seqs, blocks) = (inputs[0], inputs[1], inputs[2], inputs[3]);
            if !(*scale > 0.0 && scale.is_finite()) {
                return Err(format!("scale must be positive, got {scale}"));
            }
            if *window == Some(0) {
                return Err("a sliding window must hold at least one position".into());
            }
            let (nb, hkv, d, _) = cache_geometry("k (input 1)", k, CacheKind::K)?;
            check_groups("k (input 1)", k, d)?;
            let h = check_q("q (input 0)", q, hkv, d, *n_rep)?;
            check_seqs("seqs (input 2)", seqs)?;
            check_blocks("blocks (input 3)", blocks, nb)?;
            f32m(Shape::new([Dim::Const(h), Dim::S, Dim::T]))
        }
        Op::Scale { factor } => {
            if !factor.is_finite() {
                return Err(format!("scale factor must be finite, got {factor}"));
            }
            expect_f32("x (input 0)", inputs[0])?;
            f32m(inputs[0].shape.clone())
        }
        Op::Softmax | Op::Silu | Op::GeluTanh => {
            expect_f32("x (input 0)", inputs[0])?;
            f32m(inputs[0].shape.clone())
        }
        Op::AttnValues { n_rep } => {
            let (p, v, seqs, blocks) = (inputs[0], inputs[1], inputs[2], inputs[3]);
            expect_f32("probs (input 0)", p)?;
            let (nb, hkv, d, _) = cache_geometry("v (input 1)", v, CacheKind::V)?;
            check_groups("v (input 1)", v, d)?;
            let h = hkv
                .checked_mul(*n_rep)
                .filter(|&h| h > 0)
                .ok_or("n_rep must be positive")?;
            let want_p = Shape::new([Dim::Const(h), Dim::S, Dim::T]);
            if p.shape != want_p {
                return Err(mismatch("probs (input 0)", &want_p, &p.shape));
            }
            check_seqs("seqs (input 2)", seqs)?;
            check_blocks("blocks (input 3)", blocks, nb)?;
            f32m(Shape::new([Dim::S, Dim::Const(h), Dim::Const(d)]))
        }
        Op::Mul => {
            let (a, b) = (inputs[0], inputs[1]);
            expect_f32("a (input 0)", a)?;
            let vector_of_last = b.shape.rank() == 1 && Some(b.shape.0[0]) == a.shape.last();
            if b.shape != a.shape && !vector_of_last {
                return Err(format!(
                    "b (input 1): expected shape {} or [{}], got {}",
                    a.shape,
                    a.shape.last().map(|d| d.to_string()).unwrap_or_default(),
                    b.shape
                ));
            }
            if !vector_of_last {
                expect_f32("b (input 1)", b)?;
            }
            f32m(a.shape.clone())
        }
        Op::RopeTable { params, max_pos } => {
            if params.head_dim == 0 || params.head_dim % 2 != 0 {
                return Err(format!(
                    "RoPE needs an even head_dim, got {}",
                    params.head_dim
                ));
            }
            if *max_pos == 0 {
                return Err("a RoPE table needs at least one position".into());
            }
            f32m(Shape::constant(&[*max_pos, params.head_dim / 2, 2]))
        }
        Op::RmsNormScaled { eps } => {
            let x = inputs[0];
            let out = infer(&Op::RmsNorm { eps: *eps }, &[x], None)?;
            let w = inputs[1];
            let last = x.shape.last().ok_or("x (input 0): needs an axis")?;
            if w.shape != Shape::new([last]) {
                return Err(mismatch("weight (input 1)", &Shape::new([last]), &w.shape));
            }
            Ok(out)
        }
        Op::SliceCols { start, len } => {
            let x = inputs[0];
            expect_f32("x (input 0)", x)?;
            expect_rank("x (input 0)", x, 2)?;
            let n = x.shape.0[1]
                .as_const()
                .ok_or("x (input 0): columns must be constant")?;
            if *len == 0 || start.checked_add(*len).is_none_or(|e| e > n) {
                return Err(format!(
                    "columns {start}..{} are not inside the {n} columns of x",
                    start.saturating_add(*len)
                ));
            }
            f32m(Shape::new([x.shape.0[0], Dim::Const(*len)]))
        }
        Op::MatMulAdd => {
            let r = inputs[0];
            let out = infer(&Op::MatMul, &inputs[1..], None)?;
            expect_f32("residual (input 0)", r)?;
            if r.shape != out.shape {
                return Err(mismatch("residual (input 0)", &out.shape, &r.shape));
            }
            Ok(out)
        }
        Op::MatMulSwiGlu => {
            let out = infer(&Op::MatMul, inputs, None)?;
            let n = out.shape.0[1]
                .as_const()
                .ok_or("weight (input 1): rows must be constant")?;
            if n % 2 != 0 {
                return Err(format!(
                    "weight (input 1): a packed gate/up weight needs an even row count, got {n}"
                ));
            }
            f32m(Shape::new([out.shape.0[0], Dim::Const(n / 2)]))
        }
        Op::QkvRopeCache {
            n_heads,
            n_kv_heads,
            head_dim,
            bias,
            qk_norm,
        } => {
            let vec_of = |what: String, t: &TensorMeta, n: usize| -> Result<(), String> {
                if t.shape != Shape::constant(&[n]) {
                    return Err(format!("{what}: expected shape [{n}], got {}", t.shape));
                }
                Ok(())
            };
            let mut extra = 6;
            if *bias {
                for (i, (name, heads)) in [("bq", n_heads), ("bk", n_kv_heads), ("bv", n_kv_heads)]
                    .into_iter()
                    .enumerate()
                {
                    vec_of(
                        format!("{name} (input {})", extra + i),
                        inputs[extra + i],
                        heads.saturating_mul(*head_dim),
                    )?;
                }
                extra += 3;
            }
            if let Some(eps) = qk_norm {
                if !(eps.is_finite() && *eps >= 0.0) {
                    return Err(format!(
                        "qk_norm eps must be a non-negative number, got {eps}"
                    ));
                }
                vec_of(format!("q_norm (input {extra})"), inputs[extra], *head_dim)?;
                vec_of(
                    format!("k_norm (input {})", extra + 1),
                    inputs[extra + 1],
                    *head_dim,
                )?;
            }
            let (x, w, f, ck, cv, slots) = (
                inputs[0], inputs[1], inputs[2], inputs[3], inputs[4], inputs[5],
            );
            let qkv = infer(&Op::MatMul, &[x, w], None)?;
            let rows = n_heads
                .checked_add(n_kv_heads.saturating_mul(2))
                .and_then(|h| h.checked_mul(*head_dim))
                .ok_or("head counts overflow")?;
            expect_dim(
                "weight (input 1) axis 0",
                qkv.shape.0[1],
                Dim::Const(rows),
                &w.shape,
            )?;
            if *n_kv_heads == 0 || n_heads % n_kv_heads != 0 {
                return Err(format!(
                    "n_heads {n_heads} must be a positive multiple of n_kv_heads {n_kv_heads}"
                ));
            }
            check_freqs("freqs (input 2)", f, x.shape.0[0], *head_dim)?;
            let (_, hkv, d) = check_kv_pair(("cache_k (input 3)", ck), ("cache_v (input 4)", cv))?;
            if (hkv, d) != (*n_kv_heads, *head_dim) {
                return Err(format!(
                    "cache_k (input 3): expected {n_kv_heads} kv heads of {head_dim}, got {}",
                    ck.shape
                ));
            }
            check_per_token("slots (input 5)", slots)?;
            f32m(Shape::new([
                x.shape.0[0],
                Dim::Const(*n_heads),
                Dim::Const(*head_dim),
            ]))
        }
        Op::Attention {
            n_rep,
            scale,
            window,
        } => {
            let (q, k, v, seqs, blocks) = (inputs[0], inputs[1], inputs[2], inputs[3], inputs[4]);
            if !(*scale > 0.0 && scale.is_finite()) {
                return Err(format!("scale must be positive, got {scale}"));
            }
            if *window == Some(0) {
                return Err("a sliding window must hold at least one position".into());
            }
            let (nb, hkv, d) = check_kv_pair(("k (input 1)", k), ("v (input 2)", v))?;
            let h = check_q("q (input 0)", q, hkv, d, *n_rep)?;
            check_seqs("seqs (input 3)", seqs)?;
            check_blocks("blocks (input 4)", blocks, nb)?;
            f32m(Shape::new([Dim::S, Dim::Const(h), Dim::Const(d)]))
        }
        Op::Recv { .. } => {
            let d = declared.ok_or("Recv needs a declared type")?;
            let rows_then_const = d.shape.rank() == 2
                && d.shape.0[0] == Dim::S
                && d.shape.0[1].as_const().is_some_and(|c| c > 0);
            if d.dtype != DType::F32 || !rows_then_const {
                return Err(format!(
                    "a stage boundary carries f32[S, E] (one row per token), declared {d}"
                ));
            }
            Ok(d.clone())
        }
        Op::Send { .. } => {
            let x = inputs[0];
            infer(&Op::Recv { from: 0 }, &[], Some(x)).map_err(|e| format!("x (input 0): {e}"))
        }
        Op::LastRows | Op::PoolRows { .. } => {
            let (x, seqs) = (inputs[0], inputs[1]);
            expect_f32("x (input 0)", x)?;
            expect_rank("x (input 0)", x, 2)?;
            expect_dim("x (input 0) axis 0", x.shape.0[0], Dim::S, &x.shape)?;
            check_seqs("seqs (input 1)", seqs)?;
            f32m(Shape::new([Dim::R, x.shape.0[1]]))
        }
        Op::Add => {
            let (a, b) = (inputs[0], inputs[1]);
            expect_f32("a (input 0)", a)?;
            // A bias: a vector of the last axis (a weight of any float dtype).
            let vector_of_last =
                b.shape.rank() == 1 && a.shape.rank() > 1 && Some(b.shape.0[0]) == a.shape.last();
            if !vector_of_last {
                expect_f32("b (input 1)", b)?;
                if a.shape != b.shape {
                    return Err(mismatch("b (input 1)", &a.shape, &b.shape));
                }
            }
            f32m(a.shape.clone())
        }
    }
}
