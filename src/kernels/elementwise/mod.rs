//! Elementwise kernels and argmax. These are memory-bound and cheap next to
//! the matmuls, so they run on the calling thread.

pub mod gelu;
pub mod norm;
pub mod rope;
pub mod silu;

use crate::kernels::{check_len, KernelError};

/// `v * sigmoid(v)`.
#[inline]
pub fn silu_f32(v: f32) -> f32 {
    v / (1.0 + (-v).exp())
}

/// GELU, tanh approximation (PyTorch's `gelu(x, approximate="tanh")`,
/// Gemma's `gelu_pytorch_tanh`): `0.5·v·(1 + tanh(sqrt(2/π)·(v + 0.044715·v³)))`
/// in f32, element by element (so batch-invariant).
#[inline]
pub fn gelu_tanh_f32(v: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    let inner = SQRT_2_OVER_PI * (v + 0.044715 * v * v * v);
    0.5 * v * (1.0 + inner.tanh())
}

/// `x = gelu_tanh(x)`.
pub fn gelu_tanh_inplace(x: &mut [f32]) {
    for v in x {
        *v = gelu_tanh_f32(*v);
    }
}

/// `x = x * factor`.
pub fn scale_inplace(x: &mut [f32], factor: f32) {
    for v in x {
        *v *= factor;
    }
}

/// `out = silu(x)`.
pub fn silu(x: &[f32], out: &mut [f32]) -> Result<(), KernelError> {
    check_len("silu", "out elements", x.len(), out.len())?;
    for (o, &v) in out.iter_mut().zip(x) {
        *o = silu_f32(v);
    }
    Ok(())
}

/// `out = silu(gate) * up`.
pub fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) -> Result<(), KernelError> {
    check_len("swiglu", "up elements", gate.len(), up.len())?;
    check_len("swiglu", "out elements", gate.len(), out.len())?;
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = silu_f32(g) * u;
    }
    Ok(())
}

/// `out = a + b` (same shapes).
pub fn add(a: &[f32], b: &[f32], out: &mut [f32]) -> Result<(), KernelError> {
    check_len("add", "b elements", a.len(), b.len())?;
    check_len("add", "out elements", a.len(), out.len())?;
    for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
        *o = x + y;
    }
    Ok(())
}

/// `a += b` (same shapes).
pub fn add_inplace(a: &mut [f32], b: &[f32]) -> Result<(), KernelError> {
    check_len("add_inplace", "b elements", a.len(), b.len())?;
    for (x, &y) in a.iter_mut().zip(b) {
        *x += y;
    }
    Ok(())
}

/// `out = a * b` (same shapes).
pub fn mul(a: &[f32], b: &[f32], out: &mut [f32]) -> Result<(), KernelError> {
    check_len("mul", "b elements", a.len(), b.len())?;
    check_len("mul", "out elements", a.len(), out.len())?;
    for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
        *o = x * y;
    }
    Ok(())
}

/// `out[r, d] = x[r, d] * v[d]`: `x` and `out` are `[R, D]` with `D = v.len()`.
pub fn mul_broadcast_rows(x: &[f32], v: &[f32], out: &mut [f32]) -> Result<(), KernelError> {
    check_len("mul_broadcast_rows", "out elements", x.len(), out.len())?;
    if v.is_empty() {
        return check_len(
            "mul_broadcast_rows",
            "x elements (empty vector)",
            0,
            x.len(),
        );
    }
    if !x.len().is_multiple_of(v.len()) {
        return Err(KernelError::Shape {
            op: "mul_broadcast_rows",
            what: "x elements (multiple of vector length)",
            expected: x.len() / v.len() * v.len(),
            actual: x.len(),
        });
    }
    for (orow, xrow) in out.chunks_exact_mut(v.len()).zip(x.chunks_exact(v.len())) {
        for ((o, &a), &b) in orow.iter_mut().zip(xrow).zip(v) {
            *o = a * b;
        }
    }
    Ok(())
}

/// Index of the largest element (the first one on ties; NaNs are ignored
/// unless every element is NaN, then 0). Error on an empty slice.
pub fn argmax(x: &[f32]) -> Result<usize, KernelError> {
    if x.is_empty() {
        return Err(KernelError::Invalid {
            op: "argmax",
            what: "empty input",
        });
    }
    let mut best = 0;
    let mut best_v = f32::NEG_INFINITY;
    let mut found = false;
    for (i, &v) in x.iter().enumerate() {
        if !v.is_nan() && (!found || v > best_v) {
            best = i;
            best_v = v;
            found = true;
        }
    }
    Ok(best)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testutil::{assert_close, Rng};

    #[test]
    fn silu_swiglu_against_f64() {
        let mut rng = Rng::new(1);
        let g: Vec<f32> = rng.vec(1537).iter().map(|v| v * 8.0).collect();
        let u = rng.vec(1537);
        let mut out = vec![0.0; 1537];
        silu(&g, &mut out).unwrap();
        let want: Vec<f64> = g
            .iter()
            .map(|&v| v as f64 / (1.0 + (-(v as f64)).exp()))
            .collect();
        assert_close(&out, &want, 1e-6, 1e-5, "silu");
        swiglu(&g, &u, &mut out).unwrap();
        let want2: Vec<f64> = want.iter().zip(&u).map(|(s, &u)| s * u as f64).collect();
        assert_close(&out, &want2, 1e-6, 1e-5, "swiglu");
        assert!(swiglu(&g, &u[1..], &mut out).is_err());
    }

    #[test]
    fn gelu_tanh_against_f64() {
        let mut rng = Rng::new(4);
        let x: Vec<f32> = rng.vec(2049).iter().map(|v| v * 12.0).collect();
        let mut got = x.clone();
        gelu_tanh_inplace(&mut got);
        let want: Vec<f64> = x
            .iter()
            .map(|&v| {
                let v = v as f64;
                let c = (2.0 / std::f64::consts::PI).sqrt();
                0.5 * v * (1.0 + (c * (v + 0.044715 * v * v * v)).tanh())
            })
            .collect();
        assert_close(&got, &want, 1e-6, 1e-5, "gelu_tanh");
        // Known points: gelu(0) = 0, gelu(x) ~ x for large x, ~ 0 for very negative.
        assert_eq!(gelu_tanh_f32(0.0), 0.0);
        assert_eq!(gelu_tanh_f32(20.0), 20.0);
        assert!(gelu_tanh_f32(-20.0).abs() < 1e-6);
    }

    #[test]
    fn add_mul_broadcast() {
        let mut rng = Rng::new(2);
        let a = rng.vec(576 * 3);
        let b = rng.vec(576 * 3);
        let v = rng.vec(576);
        let mut out = vec![0.0; a.len()];
        add(&a, &b, &mut out).unwrap();
        for i in 0..a.len() {
            assert_eq!(out[i], a[i] + b[i]);
        }
        mul(&a, &b, &mut out).unwrap();
        for i in 0..a.len() {
            assert_eq!(out[i], a[i] * b[i]);
        }
        mul_broadcast_rows(&a, &v, &mut out).unwrap();
        for i in 0..a.len() {
            assert_eq!(out[i], a[i] * v[i % 576]);
        }
        let mut c = a.clone();
        add_inplace(&mut c, &b).unwrap();
        for i in 0..a.len() {
            assert_eq!(c[i], a[i] + b[i]);
        }
        assert!(mul_broadcast_rows(&a[1..], &v, &mut out[1..]).is_err());
        assert!(add(&a, &b[1..], &mut out).is_err());
    }

    #[test]
    fn argmax_first_on_ties() {
        assert_eq!(argmax(&[1.0, 3.0, 2.0, 3.0]).unwrap(), 1);
        assert_eq!(argmax(&[f32::NAN, -5.0, -1.0, -1.0]).unwrap(), 2);
        assert_eq!(argmax(&[f32::NEG_INFINITY]).unwrap(), 0);
        assert!(argmax(&[]).is_err());
        let mut rng = Rng::new(3);
        let x = rng.vec(49152);
        let want = (0..x.len()).fold(0, |b, i| if x[i] > x[b] { i } else { b });
        assert_eq!(argmax(&x).unwrap(), want);
    }
}
