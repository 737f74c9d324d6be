//! Linear layers over block-quantized weights (the exact path): each output
//! is one weight row dotted with one activation row by
//! [`super::dot_row_at`], which dequantizes in registers.
//! The weights stay quantized in memory. Work is split over output columns.

use super::dot_row_at;
use crate::kernels::matmul::Epilogue;
use crate::kernels::{check_linear, Isa, KernelError, LinearArgs};
use crate::pool::{SyncPtr, ThreadPool};

/// Output columns per work chunk.
const COLS_PER_CHUNK: usize = 16;

/// `y = x·Wᵀ` with `epilogue`, for a quantized `W` `[n, k]`. Same contract
/// as [`matmul_with`](crate::kernels::matmul_with), with the kernels of
/// `isa` (lowered to what the CPU supports). Every output is one row's dot
/// product computed alone, so a row's result does not depend on the other
/// rows of `x` (batch invariance).
pub fn qmatmul_with(
    isa: Isa,
    pool: &ThreadPool,
    a: LinearArgs<'_>,
    y: &mut [f32],
) -> Result<(), KernelError> {
    const OP: &str = "qmatmul";
    let (row_bytes, n_out) = check_linear(OP, &a, y)?;
    let (x, s, k, w, epilogue) = (a.x, a.s, a.k, a.w, a.epilogue);
    let yp = SyncPtr::new(y);
    let row = |j: usize| &w.bytes[j * row_bytes..(j + 1) * row_bytes];
    pool.run(n_out.div_ceil(COLS_PER_CHUNK), &|c| {
        let (j0, j1) = (c * COLS_PER_CHUNK, ((c + 1) * COLS_PER_CHUNK).min(n_out));
        for t in 0..s {
            let xr = &x[t * k..(t + 1) * k];
            // SAFETY: chunk `c` owns columns j0..j1 of every row of y.
            let yr = unsafe { yp.slice(t * n_out + j0, j1 - j0) };
            for (o, j) in yr.iter_mut().zip(j0..j1) {
                let v = dot_row_at(isa, w.dtype, row(j), xr);
                *o = match epilogue {
                    Epilogue::None => v,
                    Epilogue::Accumulate => *o + v,
                    Epilogue::AddResidual(r) => v + r[t * n_out + j],
                    Epilogue::SwiGlu => {
                        let up = dot_row_at(isa, w.dtype, row(j + n_out), xr);
                        crate::kernels::elementwise::silu_f32(v) * up
                    }
                };
            }
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::DType;
    use crate::kernels::testutil::{dequantized_rows, quantized_rows};
    use crate::kernels::Kernels;
    use crate::kernels::WeightRef;

    #[test]
    fn matches_dequantize_then_multiply() {
        let (s, k, n) = (3, 64, 10);
        let mut seed = 1u64;
        let mut rnd = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 33) as f32 / (1u64 << 31) as f32) - 0.5
        };
        let x: Vec<f32> = (0..s * k).map(|_| rnd()).collect();
        let wf: Vec<f32> = (0..n * k).map(|_| rnd()).collect();
        let r: Vec<f32> = (0..s * n).map(|_| rnd()).collect();
        let pool = ThreadPool::new(2);
        for dtype in [DType::Q8_0, DType::Q4_0, DType::Q4_1] {
            let wq = quantized_rows(dtype, &wf, n, k);
            let wd = dequantized_rows(dtype, &wq, n, k);
            let naive =
                |t: usize, j: usize| (0..k).map(|i| x[t * k + i] * wd[j * k + i]).sum::<f32>();
            let wr = WeightRef::new(dtype, &wq);
            let mut y = vec![0f32; s * n];
            qmatmul_with(
                Kernels::current().isa(),
                &pool,
                LinearArgs::new(&x, s, k, wr, n, Epilogue::AddResidual(&r)),
                &mut y,
            )
            .unwrap();
            for t in 0..s {
                for j in 0..n {
                    assert!(
                        (y[t * n + j] - naive(t, j) - r[t * n + j]).abs() < 1e-4,
                        "{dtype}"
                    );
                }
            }
            let mut g = vec![0f32; s * n / 2];
            qmatmul_with(
                Kernels::current().isa(),
                &pool,
                LinearArgs::new(&x, s, k, wr, n, Epilogue::SwiGlu),
                &mut g,
            )
            .unwrap();
            for t in 0..s {
                for j in 0..n / 2 {
                    let want =
                        crate::kernels::elementwise::silu_f32(naive(t, j)) * naive(t, j + n / 2);
                    assert!((g[t * n / 2 + j] - want).abs() < 1e-4, "{dtype}");
                }
            }
        }
    }
}
