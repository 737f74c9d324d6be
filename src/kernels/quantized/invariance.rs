//! Batch invariance of every quantized matmul: a server runs several
//! sequences' tokens in one step, so one activation row's output must be
//! the same bits whatever the number of rows `S` in the step and wherever
//! the row sits in it. The small-S (decode) kernels and the tiled (prefill)
//! kernels therefore use the same per-row arithmetic and the same order of
//! reduction at each instruction-set level (results may differ between
//! levels).
//!
//! Checked here for every block type on the fast path and the exact path,
//! at every level this CPU supports, with every epilogue: random weights,
//! `S` in {1, 2, 3, 7, 16, 37, 64}, and each row's output compared bit for
//! bit with that row computed alone (`S = 1`); the fast path over x8
//! weights also with the draft models' activations (no remainder).

use super::exact::qmatmul_with;
use super::fast::{self, qmatmul_fast_with, scratch_len_for, x8, ActQuant, Layout, Q8Act};
use crate::ir::DType;
use crate::kernels::matmul::Epilogue;
use crate::kernels::testutil::{random_blocks, Rng};
use crate::kernels::{Isa, WeightRef};
use crate::pool::ThreadPool;

/// (weight type, blocks per row, weight rows): every quantized type, rows
/// over several blocks, row counts that leave partial groups of 8 and 16
/// rows, and a longer row for the most common K formats.
const CASES: [(DType, usize, usize); 14] = [
    (DType::Q8_0, 6, 42),
    (DType::Q4_0, 6, 42),
    (DType::Q4_1, 6, 42),
    (DType::Q5_0, 6, 42),
    (DType::Q5_1, 6, 42),
    (DType::IQ4_NL, 6, 42),
    (DType::Q2_K, 2, 38),
    (DType::Q3_K, 2, 38),
    (DType::Q4_K, 2, 38),
    (DType::Q5_K, 2, 38),
    (DType::Q6_K, 2, 38),
    (DType::IQ4_XS, 2, 38),
    (DType::Q4_K, 4, 36),
    (DType::Q6_K, 4, 36),
];

const STEPS: [usize; 7] = [1, 2, 3, 7, 16, 37, 64];

#[derive(Clone, Copy, Debug, PartialEq)]
enum Path {
    Fast,
    /// The fast path over weights stored as [`x8`].
    FastX8,
    /// As `FastX8`, with activations without the remainder ([`ActQuant::Plain`]).
    DraftX8,
    Exact,
}

#[derive(Clone, Copy, Debug)]
enum Ep {
    None,
    Accumulate,
    AddResidual,
    SwiGlu,
}

/// `y` (`[s, n_out]`) for the rows `x` (`[s, k]`) at `isa` on `path`;
/// `init` is the starting content of `y` (for Accumulate) and `res` the
/// residual (for AddResidual), both `[s, n_out]`.
#[allow(clippy::too_many_arguments)]
fn run(
    path: Path,
    isa: Isa,
    pool: &ThreadPool,
    x: &[f32],
    s: usize,
    k: usize,
    w: WeightRef<'_>,
    n: usize,
    ep: Ep,
    init: &[f32],
    res: &[f32],
) -> Vec<f32> {
    let mut y = init.to_vec();
    let e = match ep {
        Ep::None => Epilogue::None,
        Ep::Accumulate => Epilogue::Accumulate,
        Ep::AddResidual => Epilogue::AddResidual(res),
        Ep::SwiGlu => Epilogue::SwiGlu,
    };
    match path {
        Path::Fast | Path::FastX8 | Path::DraftX8 => {
            let layout = if path == Path::Fast {
                Layout::Rows
            } else {
                Layout::X8
            };
            let quant = if path == Path::DraftX8 {
                ActQuant::Plain
            } else {
                ActQuant::Remainder
            };
            let mut scratch =
                vec![Q8Act::default(); scratch_len_for(isa, w.dtype, s, k).expect("whole blocks")];
            let w = w.with_layout(layout);
            qmatmul_fast_with(
                isa,
                quant,
                pool,
                crate::kernels::LinearArgs::new(x, s, k, w, n, e),
                &mut y,
                &mut scratch,
            )
            .unwrap();
        }
        Path::Exact => qmatmul_with(
            isa,
            pool,
            crate::kernels::LinearArgs::new(x, s, k, w, n, e),
            &mut y,
        )
        .unwrap(),
    }
    y
}

#[test]
fn every_quantized_matmul_is_batch_invariant() {
    let pool = ThreadPool::new(2);
    let mut rng = Rng::new(77);
    let mut checked = 0usize;
    for (dtype, blocks, n) in CASES {
        let be = dtype.block_elems();
        let k = blocks * be;
        let w = random_blocks(dtype, n * k / be, &mut rng);
        // The first whole groups of 16 rows stored as x8.
        let n8 = n - n % 16;
        let rb = dtype.bytes_for(k).unwrap();
        let mut w8 = vec![0u8; n8 * rb];
        if x8::supports(dtype, n8, k) {
            x8::repack(dtype, &w[..n8 * rb], rb, &mut w8);
        }
        let smax = *STEPS.iter().max().unwrap();
        // Activations with a wide spread of magnitudes between blocks.
        let x: Vec<f32> = (0..smax * k)
            .map(|i| rng.uniform() * [1.0, 0.01, 30.0][(i / 32) % 3])
            .collect();
        let paths: &[Path] = if x8::supports(dtype, n8, k) {
            &[Path::Fast, Path::FastX8, Path::DraftX8, Path::Exact]
        } else if fast::supports(dtype) {
            &[Path::Fast, Path::Exact]
        } else {
            &[Path::Exact]
        };
        for &path in paths {
            let (wr, n) = if matches!(path, Path::FastX8 | Path::DraftX8) {
                (WeightRef::new(dtype, &w8), n8)
            } else {
                (WeightRef::new(dtype, &w), n)
            };
            for isa in Isa::supported_levels() {
                for ep in [Ep::None, Ep::Accumulate, Ep::AddResidual, Ep::SwiGlu] {
                    let n_out = if matches!(ep, Ep::SwiGlu) { n / 2 } else { n };
                    let init = rng.vec(smax * n_out);
                    let res = rng.vec(smax * n_out);
                    // Every row computed alone.
                    let alone: Vec<Vec<f32>> = (0..smax)
                        .map(|t| {
                            let r = t * n_out..(t + 1) * n_out;
                            run(
                                path,
                                isa,
                                &pool,
                                &x[t * k..(t + 1) * k],
                                1,
                                k,
                                wr,
                                n,
                                ep,
                                &init[r.clone()],
                                &res[r],
                            )
                        })
                        .collect();
                    for &s in &STEPS {
                        // The step's rows are a window of the rows, so a row
                        // sits at different positions in different steps.
                        let t0 = (smax - s) / 2;
                        let rows = t0 * n_out..(t0 + s) * n_out;
                        let y = run(
                            path,
                            isa,
                            &pool,
                            &x[t0 * k..(t0 + s) * k],
                            s,
                            k,
                            wr,
                            n,
                            ep,
                            &init[rows.clone()],
                            &res[rows],
                        );
                        for i in 0..s {
                            let got = &y[i * n_out..(i + 1) * n_out];
                            let want = &alone[t0 + i];
                            for j in 0..n_out {
                                assert!(
                                    got[j].to_bits() == want[j].to_bits(),
                                    "{dtype} {path:?} {isa} {ep:?}: S={s}, row {} (position {i}), \
                                     column {j}: {} in the step vs {} alone",
                                    t0 + i,
                                    got[j],
                                    want[j]
                                );
                            }
                            checked += n_out;
                        }
                    }
                }
            }
        }
    }
    assert!(checked > 0);
}
