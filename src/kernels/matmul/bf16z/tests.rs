use super::*;
use crate::ir::DType;
use crate::kernels::testutil::{encode as encode_dtype, Rng};

fn bf16s(b: &[u8]) -> Vec<u16> {
    b.chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect()
}

#[test]
fn round_trips_exactly_with_exceptions() {
    let mut rng = Rng::new(11);
    let (n, k) = (7, 96);
    let mut wf = rng.vec(n * k);
    // Exceptions: zeros, a tiny value next to a large one, negatives.
    wf[3] = 0.0;
    wf[5] = -0.0;
    wf[40] = 1e-30;
    wf[41] = 3.0;
    wf[100] = -1e-12;
    let wb = encode_dtype(&wf, DType::BF16);
    let z = encode(&wb, n, k).unwrap();
    let v = Bf16z::parse(&z, n, k).unwrap();
    assert!(v.n_exceptions() >= 4, "{}", v.n_exceptions());
    let want = bf16s(&wb);
    let mut row = vec![0u16; k];
    for r in 0..n {
        v.decode_row(r, &mut row);
        assert_eq!(row, want[r * k..(r + 1) * k], "row {r}");
        v.decode_row_scalar(r, &mut row);
        assert_eq!(row, want[r * k..(r + 1) * k], "row {r}, portable");
        let mut rf = vec![0f32; k];
        v.decode_row_f32(r, &mut rf);
        let wf: Vec<f32> = want[r * k..(r + 1) * k]
            .iter()
            .map(|&b| crate::kernels::bf16_to_f32(b))
            .collect();
        assert_eq!(rf, wf, "row {r}, as f32");
    }
    assert_eq!(z.len(), encoded_len(n, k, v.n_exceptions()).unwrap());
}

#[test]
fn gemv_matches_bf16_gemv_on_every_kernel() {
    let pool = ThreadPool::new(2);
    let mut rng = Rng::new(12);
    for (n, k) in [(6, 32), (38, 160), (22, 4128)] {
        let x = rng.vec(k);
        let mut wf = rng.vec(n * k);
        wf[k + 1] = 0.0;
        wf[2 * k + 7] = 1e-20;
        let r = rng.vec(n);
        let wb = encode_dtype(&wf, DType::BF16);
        let z = encode(&wb, n, k).unwrap();
        let v = Bf16z::parse(&z, n, k).unwrap();
        let w = crate::kernels::WeightRef::new(DType::BF16, &wb);
        let mut want = vec![0f32; n];
        let cur = crate::kernels::Kernels::current().isa();
        crate::kernels::gemv::gemv_at(
            cur,
            &pool,
            crate::kernels::LinearArgs::new(&x, 1, k, w, n, Epilogue::AddResidual(&r)),
            &mut want,
        )
        .unwrap();
        let mut want_g = vec![0f32; n / 2];
        crate::kernels::gemv::gemv_at(
            cur,
            &pool,
            crate::kernels::LinearArgs::new(&x, 1, k, w, n, Epilogue::SwiGlu),
            &mut want_g,
        )
        .unwrap();
        for isa in Isa::supported_levels() {
            let mut y = vec![0f32; n];
            gemv_at(isa, &pool, &x, v, Epilogue::AddResidual(&r), &mut y).unwrap();
            for j in 0..n {
                assert!(
                    (y[j] - want[j]).abs() < 1e-4 * (1.0 + want[j].abs()),
                    "{isa} n={n} k={k} j={j}: {} vs {}",
                    y[j],
                    want[j]
                );
            }
            let mut g = vec![0f32; n / 2];
            gemv_at(isa, &pool, &x, v, Epilogue::SwiGlu, &mut g).unwrap();
            for j in 0..n / 2 {
                assert!((g[j] - want_g[j]).abs() < 1e-4 * (1.0 + want_g[j].abs()));
            }
        }
    }
}

#[test]
fn matmul_matches_bf16_matmul_for_every_epilogue() {
    let pool = ThreadPool::new(2);
    let mut rng = Rng::new(14);
    // One partial group, and several groups with a partial last one
    // (600 rows; 300 for SwiGLU); s = 1 and s > 1.
    for (s, n, k) in [(1, 150, 64), (3, 150, 64), (5, 140, 96), (3, 600, 64)] {
        let x = rng.vec(s * k);
        let mut wf = rng.vec(n * k);
        wf[7] = 0.0;
        wf[k + 3] = 1e-25;
        let wb = encode_dtype(&wf, DType::BF16);
        let z = encode(&wb, n, k).unwrap();
        let w = crate::kernels::WeightRef::new(DType::BF16, &wb);
        let r = rng.vec(s * n);
        let eps = [
            Epilogue::None,
            Epilogue::Accumulate,
            Epilogue::AddResidual(&r),
            Epilogue::SwiGlu,
        ];
        for ep in eps {
            let n_out = if matches!(ep, Epilogue::SwiGlu) {
                n / 2
            } else {
                n
            };
            let init = rng.vec(s * n_out);
            let mut want = init.clone();
            let a = crate::kernels::LinearArgs::new(&x, s, k, w, n, ep);
            crate::kernels::matmul::tests::matmul(&pool, a, &mut want).unwrap();
            let mut got = init.clone();
            let cur = crate::kernels::Kernels::current().isa();
            matmul_at(cur, &pool, &x, s, k, &z, n, ep, &mut got).unwrap();
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (a - b).abs() < 1e-4 * (1.0 + b.abs()),
                    "s={s} n={n} {ep:?} [{i}]: {a} vs {b}"
                );
            }
        }
    }
}

#[test]
fn batch_invariant_at_every_level() {
    // Several groups of 256 rows (600; 300 for SwiGLU), K over 4096,
    // exceptions in both.
    for (i, &(k, n)) in [(64, 600), (4128, 10)].iter().enumerate() {
        let mut rng = Rng::new(500 + i as u64);
        let x = rng.vec(64 * k);
        let mut wf = rng.vec(n * k);
        wf[7] = 0.0;
        wf[k + 3] = 1e-25;
        wf[(n - 1) * k + 5] = -1e-30;
        let z = encode(&encode_dtype(&wf, DType::BF16), n, k).unwrap();
        assert!(Bf16z::parse(&z, n, k).unwrap().n_exceptions() >= 3);
        let r = rng.vec(64 * n);
        for isa in Isa::supported_levels() {
            let mm = |pool: &ThreadPool, x: &[f32], s, ep: Epilogue<'_>, y: &mut [f32]| {
                matmul_at(isa, pool, x, s, k, &z, n, ep, y).unwrap()
            };
            crate::kernels::matmul::tests::check_batch_invariance(
                &mm,
                &x,
                k,
                n,
                &r,
                &format!("bf16z {isa} k={k} n={n}"),
            );
        }
    }
}

/// The SIMD encoder writes the portable encoder's bytes and finds the
/// same exceptions, block by block.
#[test]
fn simd_encoder_matches_the_portable_one() {
    if !crate::kernels::Isa::detect().avx2() {
        return;
    }
    let mut rng = Rng::new(15);
    let mut wf = rng.vec(32 * 40);
    for i in (0..wf.len()).step_by(37) {
        wf[i] = [0.0, -0.0, 1e-30, -1e-12, 65504.0, -3.0][i % 6];
    }
    let wb = encode_dtype(&wf, DType::BF16);
    let mut seen = 0;
    for blk in wb.chunks_exact(64) {
        let w: Vec<u16> = bf16s(blk);
        let (mut want, mut exc) = (vec![0u8; BLOCK_BYTES], Vec::new());
        encode_block(&w, &mut want, &mut exc);
        let mut got = vec![0u8; BLOCK_BYTES];
        // SAFETY: avx2 checked; 64 bytes in, 49 out.
        let mask = unsafe { avx2::encode_block(blk.as_ptr(), Some(got.as_mut_ptr())) };
        assert_eq!(mask.count_ones() as usize, exc.len());
        assert_eq!(mask.count_ones(), block_exceptions(blk));
        if exc.is_empty() {
            assert_eq!(got, want);
        } else {
            seen += 1;
        }
    }
    assert!(seen > 0, "no block with exceptions was tried");
}

#[test]
fn parse_rejects_bad_tables() {
    let mut rng = Rng::new(13);
    let (n, k) = (3, 64);
    let mut wf = rng.vec(n * k);
    wf[1] = 0.0;
    let z = encode(&encode_dtype(&wf, DType::BF16), n, k).unwrap();
    assert!(Bf16z::parse(&z, n, k).is_ok());
    assert!(Bf16z::parse(&z[..z.len() - 1], n, k).is_err());
    assert!(Bf16z::parse(&z, n, 48).is_err());
    assert!(Bf16z::parse(&z, n + 1, k).is_err());
    // A column past k.
    let mut bad = z.clone();
    let e0 = n * (k / BLOCK) * BLOCK_BYTES + (n + 1) * 4;
    bad[e0..e0 + 4].copy_from_slice(&(k as u32).to_le_bytes());
    assert!(Bf16z::parse(&bad, n, k).is_err());
    // Row starts out of order.
    let mut bad = z.clone();
    let s1 = n * (k / BLOCK) * BLOCK_BYTES + 4;
    bad[s1..s1 + 4].copy_from_slice(&99u32.to_le_bytes());
    assert!(Bf16z::parse(&bad, n, k).is_err());
}
