//! RMSNorm as in Meta's reference: `x * rsqrt(mean(x²) + eps) * weight`,
//! computed in f32 per row.

use crate::kernels::{check_len, KernelError, WeightRef};

/// Normalises each row of `x` (`[R, dim]`) into `out`, optionally scaling by
/// `weight` (`[dim]`, F32/F16/BF16). No scratch needed.
pub fn rmsnorm(
    x: &[f32],
    dim: usize,
    weight: Option<WeightRef<'_>>,
    eps: f32,
    out: &mut [f32],
) -> Result<(), KernelError> {
    const OP: &str = "rmsnorm";
    if dim == 0 {
        return Err(KernelError::Invalid {
            op: OP,
            what: "dim is 0",
        });
    }
    check_len(OP, "out elements", x.len(), out.len())?;
    if !x.len().is_multiple_of(dim) {
        return Err(KernelError::Shape {
            op: OP,
            what: "x elements (multiple of dim)",
            expected: x.len() / dim * dim,
            actual: x.len(),
        });
    }
    if let Some(w) = weight {
        w.check_elems(OP, dim)?;
    }
    const WB: usize = 256;
    let mut wbuf = [0f32; WB];
    for (xr, or) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
        let ss = crate::kernels::matmul::dot8(xr, xr);
        let r = 1.0 / (ss / dim as f32 + eps).sqrt();
        match weight {
            None => {
                for (o, &v) in or.iter_mut().zip(xr) {
                    *o = v * r;
                }
            }
            Some(w) => {
                let mut d0 = 0;
                while d0 < dim {
                    let dl = (dim - d0).min(WB);
                    w.read_into(d0, &mut wbuf[..dl]);
                    for ((o, &v), &g) in or[d0..d0 + dl]
                        .iter_mut()
                        .zip(&xr[d0..d0 + dl])
                        .zip(&wbuf[..dl])
                    {
                        *o = (v * r) * g;
                    }
                    d0 += dl;
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::DType;
    use crate::kernels::testutil::{assert_close, decoded, encode, Rng};

    #[test]
    fn against_f64() {
        let mut rng = Rng::new(10);
        for (dim, rows) in [(576, 1), (576, 5), (2048, 3), (7, 4)] {
            let x: Vec<f32> = rng.vec(dim * rows).iter().map(|v| v * 3.0).collect();
            let wf = rng.vec(dim);
            for dtype in [DType::F32, DType::F16, DType::BF16] {
                let wb = encode(&wf, dtype);
                let wd = decoded(&wf, dtype);
                let mut out = vec![0.0; x.len()];
                rmsnorm(&x, dim, Some(WeightRef::new(dtype, &wb)), 1e-5, &mut out).unwrap();
                let mut want = vec![0f64; x.len()];
                for r in 0..rows {
                    let xr = &x[r * dim..(r + 1) * dim];
                    let ms = xr.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / dim as f64;
                    let inv = 1.0 / (ms + 1e-5).sqrt();
                    for d in 0..dim {
                        want[r * dim + d] = xr[d] as f64 * inv * wd[d] as f64;
                    }
                }
                assert_close(&out, &want, 1e-5, 1e-5, "rmsnorm");
            }
            let mut out = vec![0.0; x.len()];
            rmsnorm(&x, dim, None, 1e-6, &mut out).unwrap();
            let ms = x[..dim].iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / dim as f64;
            assert!((out[0] as f64 - x[0] as f64 / (ms + 1e-6).sqrt()).abs() < 1e-5);
        }
    }

    #[test]
    fn bad_shapes() {
        let x = vec![1.0; 10];
        let mut out = vec![0.0; 10];
        assert!(rmsnorm(&x, 3, None, 1e-5, &mut out).is_err());
        assert!(rmsnorm(&x, 0, None, 1e-5, &mut out).is_err());
        let w = vec![0u8; 9];
        assert!(rmsnorm(
            &x,
            5,
            Some(WeightRef::new(crate::ir::DType::BF16, &w)),
            1e-5,
            &mut out
        )
        .is_err());
    }
}
