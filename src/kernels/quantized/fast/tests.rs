use super::*;
use crate::kernels::testutil::{
    dequantized_rows, quantized_rows, random_blocks, Rng, FAST_FORMATS as ALL_FAST,
};
use half::f16;

const LEVELS: [Isa; 4] = Isa::ALL;

fn quantized_weights(dtype: DType, wf: &[f32], n: usize, k: usize) -> (Vec<u8>, Vec<f32>) {
    let wq = quantized_rows(dtype, wf, n, k);
    let wd = dequantized_rows(dtype, &wq, n, k);
    (wq, wd)
}

fn deq_act(a: &[Q8Act]) -> Vec<f32> {
    a.iter()
        .flat_map(|b| {
            b.qs.iter()
                .zip(&b.qr)
                .map(move |(&q, &r)| b.d * (RES * q as i32 + r as i32) as f32)
        })
        .collect()
}

#[test]
fn quantize_act_simd_matches_scalar_and_bound() {
    let mut rng = Rng::new(3);
    let mut x = rng.vec(32 * 9);
    // Ties, zeros, a zero block, a block with one non-zero value.
    x[5] = 0.0;
    x[32..64].iter_mut().for_each(|v| *v = 0.0);
    x[64] = 1.0;
    x[65] = 0.5 / 127.0 * 1.0; // exactly half a step below the first level
    x[96..128].iter_mut().for_each(|v| *v = 0.0);
    x[100] = -3.0;
    let mut a = vec![Q8Act::default(); 9];
    quantize_act_scalar(ActQuant::Remainder, &x, &mut a);
    let mut plain = vec![Q8Act::default(); 9];
    quantize_act_scalar(ActQuant::Plain, &x, &mut plain);
    assert_eq!(plain, plain_8bit(&x));
    for level in [Isa::Avx2, Isa::Avx512Vnni] {
        if !level.supported() {
            continue;
        }
        let mut b = vec![Q8Act::default(); 9];
        quantize_act_with(Level::of(level), ActQuant::Remainder, &x, &mut b);
        assert_eq!(a, b, "{level:?}");
        quantize_act_with(Level::of(level), ActQuant::Plain, &x, &mut b);
        assert_eq!(plain, b, "{level:?} plain");
    }
    // Without the remainder: the same quants, every element within half
    // an 8-bit step.
    for (p, r) in plain.iter().zip(&a) {
        assert_eq!((p.d, p.qs), (r.d, r.qs));
    }
    for (i, (&u, &v)) in x.iter().zip(&deq_act(&plain)).enumerate() {
        let step = RES as f32 * plain[i / 32].d;
        assert!(
            (u - v).abs() <= step * 0.5 * (1.0 + 1.0 / 64.0),
            "{i}: {u} vs {v}"
        );
    }
    assert_eq!(a[1].d, 0.0);
    assert!(a[1].qs.iter().all(|&q| q == 0));
    assert_eq!(a[3].d, 3.0 / 127.0 / 256.0);
    assert_eq!(a[3].qs[4], -127);
    let xd = deq_act(&a);
    let mut clamped = 0;
    for (i, (&u, &v)) in x.iter().zip(&xd).enumerate() {
        let d = a[i / 32].d;
        // Within one remainder step (half a step unless the clamp bit),
        // i.e. within 1/256 of an 8-bit step.
        assert!((u - v).abs() <= d * (1.0 + 1.0 / 64.0), "{i}: {u} vs {v}");
        if (u - v).abs() > d * 0.5 * (1.0 + 1.0 / 64.0) {
            clamped += 1;
        }
    }
    assert!(clamped <= 2, "{clamped} remainders clamped");
    for blk in &a {
        assert!(blk.qr.iter().all(|&r| r != i8::MIN));
        let half = |h: usize| -> i32 {
            (16 * h..16 * h + 16)
                .map(|i| RES * blk.qs[i] as i32 + blk.qr[i] as i32)
                .sum()
        };
        assert_eq!(blk.isum, [half(0), half(1)]);
        assert_eq!(blk.s, blk.d * (half(0) + half(1)) as f32);
        assert!(blk.qs.iter().any(|&q| q.unsigned_abs() == 127) || blk.d == 0.0);
    }
}

/// The reference of the draft models' activations, written out on its
/// own: per block of 32, `c = max|x| / 127`, `qs = round(x · (1/c))`
/// (ties to even), no remainder, and the scale `d = c / RES` and sums of
/// the blocks with one.
fn plain_8bit(x: &[f32]) -> Vec<Q8Act> {
    x.chunks_exact(QK)
        .map(|xb| {
            let c = xb.iter().fold(0f32, |a, v| a.max(v.abs())) / 127.0;
            let inv = if c == 0.0 { 0.0 } else { 1.0 / c };
            let mut a = Q8Act {
                d: c / RES as f32,
                ..Q8Act::default()
            };
            for (q, &v) in a.qs.iter_mut().zip(xb) {
                *q = (v * inv).round_ties_even() as i8;
            }
            let half = |h: usize| {
                a.qs[16 * h..16 * h + 16]
                    .iter()
                    .map(|&q| RES * q as i32)
                    .sum()
            };
            a.isum = [half(0), half(1)];
            a.s = a.d * (a.isum[0] + a.isum[1]) as f32;
            a
        })
        .collect()
}

#[allow(clippy::too_many_arguments)]
fn run_level(
    level: Isa,
    quant: ActQuant,
    x: &[f32],
    s: usize,
    k: usize,
    wr: WeightRef<'_>,
    n: usize,
    e: Epilogue<'_>,
    y: &mut [f32],
) {
    let pool = ThreadPool::new(2);
    let mut scratch = vec![Q8Act::default(); scratch_len_for(level, wr.dtype, s, k).unwrap()];
    qmatmul_fast_with(
        level,
        quant,
        &pool,
        LinearArgs::new(x, s, k, wr, n, e),
        y,
        &mut scratch,
    )
    .unwrap();
}

/// Weights of `dtype` for an `[n, k]` matrix: `wf` quantized where the
/// crate has a quantizer for it, else random block bytes with small
/// finite scales; and their dequantized values.
fn weights_for(dtype: DType, wf: &[f32], n: usize, k: usize, rng: &mut Rng) -> (Vec<u8>, Vec<f32>) {
    if matches!(dtype, DType::Q8_0 | DType::Q4_0 | DType::Q4_1) {
        return quantized_weights(dtype, wf, n, k);
    }
    let wq = random_blocks(dtype, n * k / dtype.block_elems(), rng);
    let wd = dequantized_rows(dtype, &wq, n, k);
    (wq, wd)
}

/// Every level's kernels (small-S and packed) against the scalar
/// reference ([`dot_q8_scalar`]), bit for bit, on odd shapes with all
/// epilogues; and the reference against the f32 product within
/// [`act_error_bound`]. With the remainder, and without it (the draft
/// models' mode, against [`plain_8bit`] activations).
#[test]
fn kernels_match_scalar_reference() {
    for quant in [ActQuant::Remainder, ActQuant::Plain] {
        kernels_match_scalar_reference_with(quant);
    }
}

fn kernels_match_scalar_reference_with(quant: ActQuant) {
    let mut rng = Rng::new(11);
    let mut shapes = vec![];
    for s in [1, 2, 3, 5, 64, 65] {
        for k in [32, 576, 1536] {
            shapes.push((s, k, 38));
        }
    }
    // Several token chunks of both tilings, a partial 8-row group.
    shapes.push((300, 64, 22));
    shapes.push((17, 96, 6));
    // Rows of one and two 256-element super-blocks (the K formats).
    for s in [1, 4, 9, 65] {
        shapes.push((s, 256, 38));
    }
    shapes.push((200, 512, 22));
    for (s, k, n) in shapes {
        // Activations with a wide spread of magnitudes between blocks.
        let x: Vec<f32> = (0..s * k)
            .map(|i| rng.uniform() * [1.0, 0.01, 30.0][(i / 32) % 3])
            .collect();
        let wf = rng.vec(n * k);
        let r = rng.vec(s * n);
        let nb = k / QK;
        let mut acts = vec![Q8Act::default(); s * nb];
        quantize_act_scalar(quant, &x, &mut acts);
        if quant == ActQuant::Plain {
            assert_eq!(acts, plain_8bit(&x));
        }
        for dtype in ALL_FAST {
            if !k.is_multiple_of(dtype.block_elems()) {
                continue;
            }
            let (wq, wd) = weights_for(dtype, &wf, n, k, &mut rng);
            let rb = dtype.bytes_for(k).unwrap();
            let wr = WeightRef::new(dtype, &wq);
            let at = |t: usize| &acts[t * nb..(t + 1) * nb];
            let row = |j: usize| &wq[j * rb..(j + 1) * rb];
            let want: Vec<f32> = (0..s * n)
                .map(|i| dot_q8_scalar(dtype, row(i % n), at(i / n)))
                .collect();
            // The reference against the f32 product.
            for t in (0..s).step_by(7) {
                for j in 0..n {
                    let wj = &wd[j * k..(j + 1) * k];
                    let on_f: f32 = (0..k).map(|i| x[t * k + i] * wj[i]).sum();
                    let bound = act_error_bound(quant, wj, at(t));
                    let scale: f32 = (0..k).map(|i| (x[t * k + i] * wj[i]).abs()).sum();
                    let got = want[t * n + j];
                    assert!(
                        (got - on_f).abs() <= bound * 1.001 + 1e-5 * scale + 1e-6,
                        "{dtype} s={s} k={k}: {got} vs f32 {on_f}, bound {bound}"
                    );
                }
            }
            for level in LEVELS {
                if !level.supported() {
                    continue;
                }
                let ctx = format!("{dtype} {level:?} {quant:?} s={s} k={k} n={n}");
                let same = |got: f32, want: f32, what: &str, t: usize, j: usize| {
                    assert!(
                        got.to_bits() == want.to_bits(),
                        "{ctx} {what} t={t} j={j}: {got} vs {want}"
                    );
                };
                let mut y0 = vec![f32::NAN; s * n];
                run_level(level, quant, &x, s, k, wr, n, Epilogue::None, &mut y0);
                let mut y = vec![0f32; s * n];
                let res = Epilogue::AddResidual(&r);
                run_level(level, quant, &x, s, k, wr, n, res, &mut y);
                let mut acc = r.clone();
                run_level(
                    level,
                    quant,
                    &x,
                    s,
                    k,
                    wr,
                    n,
                    Epilogue::Accumulate,
                    &mut acc,
                );
                let mut g = vec![0f32; s * n / 2];
                run_level(level, quant, &x, s, k, wr, n, Epilogue::SwiGlu, &mut g);
                for t in 0..s {
                    for j in 0..n {
                        let (i, w) = (t * n + j, want[t * n + j]);
                        same(y0[i], w, "none", t, j);
                        same(y[i], w + r[i], "residual", t, j);
                        same(acc[i], r[i] + w, "accumulate", t, j);
                    }
                    for j in 0..n / 2 {
                        let (gv, uv) = (want[t * n + j], want[t * n + j + n / 2]);
                        let w = crate::kernels::elementwise::silu_f32(gv) * uv;
                        let got = g[t * n / 2 + j];
                        if Level::of(level) != Level::Scalar {
                            // The vector SwiGLU: within a few ulp of libm's expf (and
                            // tiny where libm's saturates to zero).
                            assert!(
                                (got - w).abs() <= 1e-6 * w.abs() + 1e-25,
                                "{ctx} swiglu {got} vs {w}"
                            );
                        } else {
                            same(got, w, "swiglu", t, j);
                        }
                    }
                }
                // The first whole groups of 16 rows stored as x8.
                let n8 = n - n % 16;
                if n8 == 0 || !x8::supports(dtype, n8, k) {
                    continue;
                }
                let mut w8 = vec![0u8; n8 * rb];
                x8::repack(dtype, &wq[..n8 * rb], rb, &mut w8);
                let w8 = WeightRef::new(dtype, &w8).with_layout(Layout::X8);
                let run8 = |e: Epilogue<'_>, y: &mut [f32]| {
                    let pool = ThreadPool::new(2);
                    let need = scratch_len_for(level, dtype, s, k).unwrap();
                    let mut scratch = vec![Q8Act::default(); need];
                    qmatmul_fast_with(
                        level,
                        quant,
                        &pool,
                        LinearArgs::new(&x, s, k, w8, n8, e),
                        y,
                        &mut scratch,
                    )
                    .unwrap();
                };
                let r8: Vec<f32> = (0..s * n8).map(|i| r[i % n8 + (i / n8) * n]).collect();
                let mut y0 = vec![f32::NAN; s * n8];
                run8(Epilogue::None, &mut y0);
                let mut y = vec![0f32; s * n8];
                run8(Epilogue::AddResidual(&r8), &mut y);
                let mut g = vec![0f32; s * n8 / 2];
                run8(Epilogue::SwiGlu, &mut g);
                for t in 0..s {
                    for j in 0..n8 {
                        let (i, w) = (t * n8 + j, want[t * n + j]);
                        same(y0[i], w, "x8 none", t, j);
                        same(y[i], w + r8[i], "x8 residual", t, j);
                    }
                    for j in 0..n8 / 2 {
                        let (gv, uv) = (want[t * n + j], want[t * n + j + n8 / 2]);
                        let w = crate::kernels::elementwise::silu_f32(gv) * uv;
                        let got = g[t * n8 / 2 + j];
                        if Level::of(level) != Level::Scalar {
                            assert!(
                                (got - w).abs() <= 1e-6 * w.abs() + 1e-25,
                                "{ctx} x8 swiglu {got} vs {w}"
                            );
                        } else {
                            same(got, w, "x8 swiglu", t, j);
                        }
                    }
                }
            }
        }
    }
}

/// Integer-valued activations (|x| <= 127 with a ±127 in every half
/// block, so scale 1 and quants = x) and weights with scale 1 (extreme
/// quants, including Q8_0's -128): every product is an exact small
/// integer, so all levels must agree exactly with the integer dot product.
#[test]
fn integer_products_are_exact() {
    let mut rng = Rng::new(5);
    let (n, k) = (21, 576);
    for s in [1, 3, 5, 16, 33] {
        let mut x: Vec<f32> = (0..s * k)
            .map(|_| (rng.vec(1)[0] * 254.0).round().clamp(-127.0, 127.0))
            .collect();
        for (i, b) in x.chunks_exact_mut(QK).enumerate() {
            b[i % QK] = if i % 2 == 0 { 127.0 } else { -127.0 };
        }
        for dtype in [DType::Q8_0, DType::Q4_0, DType::Q4_1] {
            let bb = dtype.block_bytes();
            let nb = k / QK;
            let mut wq = vec![0u8; n * nb * bb];
            let mut wint = vec![0i64; n * k];
            let mut mins = vec![0i64; n * nb];
            for (bi, b) in wq.chunks_exact_mut(bb).enumerate() {
                b[..2].copy_from_slice(&f16::from_f32(1.0).to_le_bytes());
                let base = (bi / nb) * k + (bi % nb) * QK;
                let pick = |i: usize| (bi * 37 + i * 11) % 256;
                match dtype {
                    DType::Q8_0 => {
                        for i in 0..32 {
                            let q = if i < 4 {
                                [-128, 127, -127, 0][i]
                            } else {
                                pick(i) as i32 - 128
                            };
                            b[2 + i] = q as i8 as u8;
                            wint[base + i] = q as i8 as i64;
                        }
                    }
                    DType::Q4_0 | DType::Q4_1 => {
                        let off = if dtype == DType::Q4_0 { 2 } else { 4 };
                        if dtype == DType::Q4_1 {
                            let m = (bi % 7) as f32 - 3.0;
                            b[2..4].copy_from_slice(&f16::from_f32(m).to_le_bytes());
                            mins[bi] = m as i64;
                        }
                        for i in 0..16 {
                            let v = if i < 2 {
                                [0x0f, 0xf0][i]
                            } else {
                                pick(i) as u8
                            };
                            b[off + i] = v;
                            let sub = if dtype == DType::Q4_0 { 8 } else { 0 };
                            wint[base + i] = (v & 15) as i64 - sub + mins[bi];
                            wint[base + i + 16] = (v >> 4) as i64 - sub + mins[bi];
                        }
                    }
                    _ => unreachable!(),
                }
            }
            let wr = WeightRef::new(dtype, &wq);
            for (level, quant) in LEVELS
                .into_iter()
                .flat_map(|l| [(l, ActQuant::Remainder), (l, ActQuant::Plain)])
            {
                if !level.supported() {
                    continue;
                }
                let mut y = vec![0f32; s * n];
                run_level(level, quant, &x, s, k, wr, n, Epilogue::None, &mut y);
                for t in 0..s {
                    for j in 0..n {
                        let want: i64 = (0..k).map(|i| x[t * k + i] as i64 * wint[j * k + i]).sum();
                        assert_eq!(
                            y[t * n + j],
                            want as f32,
                            "{dtype} {level:?} {quant:?} s={s} t={t} j={j}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn scalar_dot_by_hand() {
    // Q4_1 block: d = 0.5, m = -1, nibbles lo = 1, hi = 2 everywhere.
    let mut b = vec![0u8; 20];
    b[..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
    b[2..4].copy_from_slice(&f16::from_f32(-1.0).to_le_bytes());
    b[4..].iter_mut().for_each(|q| *q = 0x21);
    // x = 0.25/256 * (256*1 + 64) = 0.3125 (elements 0..16), 0.25/256 * (256*2 - 127) = 0.3760...
    let (mut qs, mut qr) = ([1; 32], [64; 32]);
    qs[16..].iter_mut().for_each(|q| *q = 2);
    qr[16..].iter_mut().for_each(|r| *r = -127);
    let isum = [(256 + 64) * 16, (512 - 127) * 16];
    let d = 0.25 / 256.0;
    let a = Q8Act {
        d,
        s: d * (isum[0] + isum[1]) as f32,
        isum,
        qs,
        qr,
    };
    // w = 0.5*1-1 = -0.5 (elements 0..16) and 0.5*2-1 = 0 (16..32); the
    // reference computes it as fma(I, d_a*d_w, 0) then fma(m, s, .) with
    // I = Σ q (256 qs + qr) over the block.
    let i = 16 * (256 + 64) + 2 * 16 * (512 - 127);
    let want = (-1f32).mul_add(a.s, (i as f32) * (d * 0.5));
    assert_eq!(dot_q8_scalar(DType::Q4_1, &b, &[a]), want);
    assert!((want - (-0.5 * 0.3125 * 16.0)).abs() < 1e-6);
}

#[test]
fn rejects_bad_arguments() {
    let pool = ThreadPool::new(1);
    let w = vec![0u8; 34];
    let wr = WeightRef::new(DType::Q8_0, &w);
    let mut y = vec![0f32; 1];
    let mut small: Vec<Q8Act> = vec![];
    assert!(matches!(
        qmatmul_fast_with(
            Isa::detect(),
            ActQuant::Remainder,
            &pool,
            LinearArgs::new(&[0.0; 32], 1, 32, wr, 1, Epilogue::None),
            &mut y,
            &mut small
        ),
        Err(KernelError::Shape { .. })
    ));
    let w2 = vec![0u8; 84];
    let wk = WeightRef::new(DType::Q2_K, &w2);
    let mut sc = vec![Q8Act::default(); 8];
    assert!(!supports(DType::Q2_K) && !supports(DType::F16));
    assert!(matches!(
        qmatmul_fast_with(
            Isa::detect(),
            ActQuant::Remainder,
            &pool,
            LinearArgs::new(&[0.0; 256], 1, 256, wk, 1, Epilogue::None),
            &mut y,
            &mut sc
        ),
        Err(KernelError::DType { .. })
    ));
}
