//! Shape and dtype inference: one exhaustive match over [`Op`].
//!
//! `infer` returns the output type of an op applied to inputs of the given
//! types, or a message saying which input disagrees, what was expected and
//! what was found. The graph prefixes the node name.

use super::{DType, Dim, Op, Shape, TensorMeta};

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

/// RoPE angles for `rows` positions of `head_dim`: a per-step `[S, D/2, 2]`
/// or a table over constant positions `[C, D/2, 2]`.
fn check_freqs(what: &str, f: &TensorMeta, rows: Dim, head_dim: usize) -> Result<(), String> {
    expect_f32(what, f)?;
    let want = Shape::new([rows, Dim::Const(head_dim / 2), Dim::Const(2)]);
    let table =
        f.shape.rank() == 3 && f.shape.0[0].as_const().is_some() && f.shape.0[1..] == want.0[1..];
    if !head_dim.is_multiple_of(2) || (f.shape != want && !table) {
        return Err(mismatch(what, &want, &f.shape));
    }
    Ok(())
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
        Op::Tokens => {
            let d = declared.ok_or("Tokens needs a declared type")?;
            if d.dtype != DType::I32 || d.shape != Shape(vec![Dim::S]) {
                return Err(format!("Tokens must be i32[S], declared {d}"));
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
        Op::KvCache { .. } => {
            let d = declared.ok_or("KvCache needs a declared type")?;
            if d.shape.rank() != 3 || d.shape.const_numel().is_none() || d.dtype != DType::F32 {
                return Err(format!(
                    "a KV cache must be f32[C, Hkv, D] with constants, got {d}"
                ));
            }
            Ok(d.clone())
        }
        Op::RopeFreqs(p) => {
            if p.head_dim == 0 || p.head_dim % 2 != 0 {
                return Err(format!("RoPE needs an even head_dim, got {}", p.head_dim));
            }
            f32m(Shape::new([
                Dim::S,
                Dim::Const(p.head_dim / 2),
                Dim::Const(2),
            ]))
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
        Op::MatMul | Op::OutputHead { .. } => {
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
            let rows = match op {
                Op::OutputHead {
                    rows: super::LogitRows::Last,
                } => Dim::Const(1),
                _ => x.shape.0[0],
            };
            f32m(Shape::new([rows, w.shape.0[0]]))
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
            let (cache, x) = (inputs[0], inputs[1]);
            expect_rank("cache (input 0)", cache, 3)?;
            expect_f32("cache (input 0)", cache)?;
            expect_f32("x (input 1)", x)?;
            let want = Shape::new([Dim::S, cache.shape.0[1], cache.shape.0[2]]);
            if x.shape != want {
                return Err(mismatch("x (input 1)", &want, &x.shape));
            }
            f32m(Shape::new([Dim::T, cache.shape.0[1], cache.shape.0[2]]))
        }
        Op::AttnScores { n_rep, scale } => {
            let (q, k) = (inputs[0], inputs[1]);
            expect_f32("q (input 0)", q)?;
            expect_f32("k (input 1)", k)?;
            expect_rank("q (input 0)", q, 3)?;
            expect_rank("k (input 1)", k, 3)?;
            if !(*scale > 0.0 && scale.is_finite()) {
                return Err(format!("scale must be positive, got {scale}"));
            }
            let hkv = k.shape.0[1]
                .as_const()
                .ok_or("k (input 1): heads must be constant")?;
            let h = hkv
                .checked_mul(*n_rep)
                .filter(|&h| h > 0)
                .ok_or("n_rep must be positive")?;
            let want_q = Shape::new([Dim::S, Dim::Const(h), k.shape.0[2]]);
            if q.shape != want_q {
                return Err(mismatch("q (input 0)", &want_q, &q.shape));
            }
            expect_dim("k (input 1) axis 0", k.shape.0[0], Dim::T, &k.shape)?;
            f32m(Shape::new([Dim::Const(h), Dim::S, Dim::T]))
        }
        Op::Softmax | Op::Silu => {
            expect_f32("x (input 0)", inputs[0])?;
            f32m(inputs[0].shape.clone())
        }
        Op::AttnValues { n_rep } => {
            let (p, v) = (inputs[0], inputs[1]);
            expect_f32("probs (input 0)", p)?;
            expect_f32("v (input 1)", v)?;
            expect_rank("v (input 1)", v, 3)?;
            let hkv = v.shape.0[1]
                .as_const()
                .ok_or("v (input 1): heads must be constant")?;
            let h = hkv
                .checked_mul(*n_rep)
                .filter(|&h| h > 0)
                .ok_or("n_rep must be positive")?;
            let want_p = Shape::new([Dim::Const(h), Dim::S, v.shape.0[0]]);
            if p.shape != want_p {
                return Err(mismatch("probs (input 0)", &want_p, &p.shape));
            }
            expect_dim("v (input 1) axis 0", v.shape.0[0], Dim::T, &v.shape)?;
            f32m(Shape::new([Dim::S, Dim::Const(h), v.shape.0[2]]))
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
        } => {
            let (x, w, f, ck, cv) = (inputs[0], inputs[1], inputs[2], inputs[3], inputs[4]);
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
            for (what, c) in [("cache_k (input 3)", ck), ("cache_v (input 4)", cv)] {
                expect_f32(what, c)?;
                expect_rank(what, c, 3)?;
                if c.shape.0[0].as_const().is_none()
                    || c.shape.0[1] != Dim::Const(*n_kv_heads)
                    || c.shape.0[2] != Dim::Const(*head_dim)
                {
                    return Err(format!(
                        "{what}: expected [C, {n_kv_heads}, {head_dim}], got {}",
                        c.shape
                    ));
                }
            }
            f32m(Shape::new([
                x.shape.0[0],
                Dim::Const(*n_heads),
                Dim::Const(*head_dim),
            ]))
        }
        Op::Attention { n_rep, scale } => {
            let (q, k, v) = (inputs[0], inputs[1], inputs[2]);
            // The same checks as the unfused pair, with the cache either as
            // its valid prefix [T, ..] or whole [C, ..].
            let as_t = |m: &TensorMeta| {
                let mut m = m.clone();
                if m.shape.rank() == 3 && m.shape.0[0].as_const().is_some() {
                    m.shape.0[0] = Dim::T;
                }
                m
            };
            let (kt, vt) = (as_t(k), as_t(v));
            if k.shape.0.first() != v.shape.0.first() {
                return Err(mismatch("v (input 2)", &k.shape, &v.shape));
            }
            let scores = infer(
                &Op::AttnScores {
                    n_rep: *n_rep,
                    scale: *scale,
                },
                &[q, &kt],
                None,
            )?;
            infer(&Op::AttnValues { n_rep: *n_rep }, &[&scores, &vt], None)
                .map_err(|e| e.replace("v (input 1)", "v (input 2)"))
        }
        Op::LastRow => {
            let x = inputs[0];
            expect_f32("x (input 0)", x)?;
            expect_rank("x (input 0)", x, 2)?;
            f32m(Shape::new([Dim::Const(1), x.shape.0[1]]))
        }
        Op::Add => {
            let (a, b) = (inputs[0], inputs[1]);
            expect_f32("a (input 0)", a)?;
            expect_f32("b (input 1)", b)?;
            if a.shape != b.shape {
                return Err(mismatch("b (input 1)", &a.shape, &b.shape));
            }
            f32m(a.shape.clone())
        }
    }
}
