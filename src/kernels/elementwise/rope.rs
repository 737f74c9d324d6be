//! Rotary position embeddings, Meta layout: pairs `(x[2i], x[2i+1])` of each
//! head are complex numbers multiplied by `polar(1, pos * freq_i)` with
//! `freq_i = 1 / theta^(2i/D)`, optionally rescaled as in Llama 3.1.
//!
//! [`rope_reference`] follows `llama_models/llama3/model.py`
//! (`precompute_freqs_cis`, `apply_scaling`, `apply_rotary_emb`) with
//! num-complex, all in f32 like the reference; [`RopeTable`] precomputes the
//! same cos/sin values per position and is the fast path.

use crate::kernels::{check_len, mul_dims, KernelError};
use num_complex::Complex32;

/// Frequency scaling: Llama 3.1's (`apply_scaling` in Meta's model.py) or
/// linear position interpolation (Hugging Face's "linear" rope type).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RopeScaling {
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position: f32,
    },
    /// Every frequency divided by `factor` (as `inv_freq /= factor` in
    /// transformers' `_compute_linear_scaling_rope_parameters`).
    Linear { factor: f32 },
}

impl RopeScaling {
    /// The constants hard-coded in Meta's Llama 3.1 `apply_scaling`.
    pub const LLAMA3_1: RopeScaling = RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position: 8192.0,
    };

    /// Rescales one frequency (f32 arithmetic, same formula as Meta's).
    pub fn apply(&self, freq: f32) -> f32 {
        let (factor, low_freq_factor, high_freq_factor, original_max_position) = match *self {
            RopeScaling::Linear { factor } => return freq / factor,
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position,
            } => (
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position,
            ),
        };
        let low_freq_wavelen = original_max_position / low_freq_factor;
        let high_freq_wavelen = original_max_position / high_freq_factor;
        let wavelen = 2.0 * std::f32::consts::PI / freq;
        let new_freq = if wavelen > low_freq_wavelen {
            freq / factor
        } else {
            freq
        };
        let smooth = (original_max_position / wavelen - low_freq_factor)
            / (high_freq_factor - low_freq_factor);
        if wavelen >= high_freq_wavelen && wavelen <= low_freq_wavelen {
            (1.0 - smooth) * new_freq / factor + smooth * new_freq
        } else {
            new_freq
        }
    }
}

/// `freq_i = 1 / theta^(2i / head_dim)` for `i < head_dim / 2`, scaled.
pub fn rope_freq(i: usize, head_dim: usize, theta: f32, scaling: Option<RopeScaling>) -> f32 {
    let f = 1.0 / theta.powf((2 * i) as f32 / head_dim as f32);
    match scaling {
        Some(sc) => sc.apply(f),
        None => f,
    }
}

fn check_x(
    op: &'static str,
    x: &[f32],
    s: usize,
    n_heads: usize,
    head_dim: usize,
) -> Result<(), KernelError> {
    if head_dim == 0 || !head_dim.is_multiple_of(2) {
        return Err(KernelError::Invalid {
            op,
            what: "head_dim must be even and non-zero",
        });
    }
    let n = mul_dims(
        op,
        "s*heads*head_dim overflows",
        mul_dims(op, "s*heads overflows", s, n_heads)?,
        head_dim,
    )?;
    check_len(op, "x elements (s*heads*head_dim)", n, x.len())
}

/// Reference RoPE, in place on `x` `[s, n_heads, head_dim]` at positions
/// `pos..pos+s`, exactly as Meta's complex-number formulation.
pub fn rope_reference(
    x: &mut [f32],
    s: usize,
    n_heads: usize,
    head_dim: usize,
    pos: usize,
    theta: f32,
    scaling: Option<RopeScaling>,
) -> Result<(), KernelError> {
    check_x("rope_reference", x, s, n_heads, head_dim)?;
    for (t, tok) in x.chunks_exact_mut(n_heads * head_dim).enumerate() {
        let p = (pos + t) as f32;
        for head in tok.chunks_exact_mut(head_dim) {
            for (i, pair) in head.chunks_exact_mut(2).enumerate() {
                let angle = p * rope_freq(i, head_dim, theta, scaling);
                let fc = Complex32::from_polar(1.0, angle);
                let v = Complex32::new(pair[0], pair[1]) * fc;
                pair[0] = v.re;
                pair[1] = v.im;
            }
        }
    }
    Ok(())
}

/// Precomputed `cos`/`sin` of `pos * freq_i`, `[max_pos, head_dim/2]`.
#[derive(Clone, Debug)]
pub struct RopeTable {
    head_dim: usize,
    max_pos: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeTable {
    /// Tables for positions `0..max_pos`.
    pub fn new(
        head_dim: usize,
        theta: f32,
        scaling: Option<RopeScaling>,
        max_pos: usize,
    ) -> Result<Self, KernelError> {
        const OP: &str = "RopeTable::new";
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(KernelError::Invalid {
                op: OP,
                what: "head_dim must be even and non-zero",
            });
        }
        let half = head_dim / 2;
        let n = mul_dims(OP, "max_pos*head_dim/2 overflows", max_pos, half)?;
        let freqs: Vec<f32> = (0..half)
            .map(|i| rope_freq(i, head_dim, theta, scaling))
            .collect();
        let mut cos = Vec::with_capacity(n);
        let mut sin = Vec::with_capacity(n);
        for p in 0..max_pos {
            for &f in &freqs {
                // Same f32 product and polar form as the reference.
                let c = Complex32::from_polar(1.0, p as f32 * f);
                cos.push(c.re);
                sin.push(c.im);
            }
        }
        Ok(RopeTable {
            head_dim,
            max_pos,
            cos,
            sin,
        })
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
    }
    pub fn max_pos(&self) -> usize {
        self.max_pos
    }

    /// The angles of each token's position, `[positions.len(), head_dim/2,
    /// 2]` (cos, sin): rows of the table, the same values
    /// [`crate::kernels::dispatch::rope_fill_freqs`] computes.
    pub fn gather(&self, positions: &[i32], out: &mut [f32]) -> Result<(), KernelError> {
        const OP: &str = "rope_gather";
        let half = self.head_dim / 2;
        check_len(
            OP,
            "out elements (tokens*head_dim)",
            positions.len() * 2 * half,
            out.len(),
        )?;
        for (&p, o) in positions.iter().zip(out.chunks_exact_mut(2 * half)) {
            let p = usize::try_from(p)
                .ok()
                .filter(|&p| p < self.max_pos)
                .ok_or(KernelError::IdOutOfRange {
                    op: OP,
                    id: p.into(),
                    index: 0,
                    rows: self.max_pos,
                })?;
            let (cos, sin) = (&self.cos[p * half..][..half], &self.sin[p * half..][..half]);
            for ((cs, &c), &s) in o.chunks_exact_mut(2).zip(cos).zip(sin) {
                cs[0] = c;
                cs[1] = s;
            }
        }
        Ok(())
    }

    /// Rotates `x` `[s, n_heads, head_dim]` in place for positions
    /// `pos..pos+s`; error if `pos + s > max_pos` or shapes mismatch.
    pub fn apply(
        &self,
        x: &mut [f32],
        s: usize,
        n_heads: usize,
        pos: usize,
    ) -> Result<(), KernelError> {
        const OP: &str = "rope";
        check_x(OP, x, s, n_heads, self.head_dim)?;
        match pos.checked_add(s) {
            Some(end) if end <= self.max_pos => {}
            _ => {
                return Err(KernelError::Shape {
                    op: OP,
                    what: "positions beyond the table (pos + s <= max_pos)",
                    expected: self.max_pos,
                    actual: pos.saturating_add(s),
                })
            }
        }
        let half = self.head_dim / 2;
        for (t, tok) in x.chunks_exact_mut(n_heads * self.head_dim).enumerate() {
            let row = (pos + t) * half;
            let cos = &self.cos[row..row + half];
            let sin = &self.sin[row..row + half];
            for head in tok.chunks_exact_mut(self.head_dim) {
                for ((pair, &c), &s) in head.chunks_exact_mut(2).zip(cos).zip(sin) {
                    let (a, b) = (pair[0], pair[1]);
                    // (a + ib)(c + is), in num-complex's operation order.
                    pair[0] = a * c - b * s;
                    pair[1] = a * s + b * c;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testutil::Rng;

    #[test]
    fn table_matches_reference() {
        let mut rng = Rng::new(20);
        for (scaling, theta, d) in [
            (None, 10000.0, 64),
            (Some(RopeScaling::LLAMA3_1), 500000.0, 128),
            (None, 100000.0, 6),
        ] {
            for (s, pos) in [(1, 0), (1, 37), (7, 100), (3, 8000)] {
                let heads = 3;
                let x = rng.vec(s * heads * d);
                let mut a = x.clone();
                let mut b = x.clone();
                rope_reference(&mut a, s, heads, d, pos, theta, scaling).unwrap();
                let table = RopeTable::new(d, theta, scaling, 8192).unwrap();
                table.apply(&mut b, s, heads, pos).unwrap();
                assert_eq!(a, b, "fast vs reference, d={d} pos={pos}");
            }
        }
    }

    #[test]
    fn reference_against_f64_formula() {
        // Independent check of the rotation itself (unscaled): f64 cos/sin.
        let d = 8;
        let mut x = vec![1.0f32, 0.0, 0.5, -0.5, 0.25, 2.0, -1.0, 1.0];
        let x0 = x.clone();
        rope_reference(&mut x, 1, 1, d, 5, 10000.0, None).unwrap();
        for i in 0..d / 2 {
            let f = 1.0 / 10000f64.powf((2 * i) as f64 / d as f64);
            let (sn, cs) = (5.0 * f).sin_cos();
            let (a, b) = (x0[2 * i] as f64, x0[2 * i + 1] as f64);
            assert!((x[2 * i] as f64 - (a * cs - b * sn)).abs() < 1e-5);
            assert!((x[2 * i + 1] as f64 - (a * sn + b * cs)).abs() < 1e-5);
        }
    }

    /// Against Meta's llama_models code (fixture from
    /// tests/reference/rope_fixture.py).
    #[test]
    fn matches_meta_fixture() {
        let text = include_str!("../../../tests/fixtures/kernels/rope_meta.json");
        let cases: serde_json::Value = serde_json::from_str(text).unwrap();
        for c in cases.as_array().unwrap() {
            let get = |k: &str| c[k].as_u64().unwrap() as usize;
            let (d, h, s, pos) = (get("head_dim"), get("n_heads"), get("s"), get("pos"));
            let theta = c["theta"].as_f64().unwrap() as f32;
            let scaling = c["scaled"]
                .as_bool()
                .unwrap()
                .then_some(RopeScaling::LLAMA3_1);
            let vec = |k: &str| -> Vec<f32> {
                c[k].as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_f64().unwrap() as f32)
                    .collect()
            };
            let (x, y) = (vec("x"), vec("y"));
            let mut a = x.clone();
            rope_reference(&mut a, s, h, d, pos, theta, scaling).unwrap();
            let mut b = x.clone();
            RopeTable::new(d, theta, scaling, pos + s)
                .unwrap()
                .apply(&mut b, s, h, pos)
                .unwrap();
            for i in 0..y.len() {
                assert!(
                    (a[i] - y[i]).abs() <= 2e-5,
                    "{}: ref element {i}: {} vs meta {}",
                    c["name"],
                    a[i],
                    y[i]
                );
                assert!(
                    (b[i] - y[i]).abs() <= 2e-5,
                    "{}: table element {i}: {} vs meta {}",
                    c["name"],
                    b[i],
                    y[i]
                );
            }
        }
    }

    #[test]
    fn llama31_scaling_regions() {
        let sc = RopeScaling::LLAMA3_1;
        // High frequency (short wavelength): unchanged.
        assert_eq!(sc.apply(1.0), 1.0);
        // Very low frequency (wavelength > 8192): divided by 8.
        let f = 2.0 * std::f32::consts::PI / 20000.0;
        assert!((sc.apply(f) - f / 8.0).abs() < 1e-12);
        // In between: a blend strictly between f/8 and f.
        let f = 2.0 * std::f32::consts::PI / 4000.0;
        let g = sc.apply(f);
        assert!(g > f / 8.0 && g < f);
    }

    #[test]
    fn linear_scaling_divides_every_frequency() {
        let sc = RopeScaling::Linear { factor: 4.0 };
        for i in 0..32 {
            let f = rope_freq(i, 64, 10000.0, None);
            assert_eq!(rope_freq(i, 64, 10000.0, Some(sc)), f / 4.0);
        }
    }

    #[test]
    fn errors() {
        let t = RopeTable::new(4, 10000.0, None, 4).unwrap();
        let mut x = vec![0.0; 8];
        assert!(t.apply(&mut x, 2, 1, 3).is_err());
        assert!(t.apply(&mut x, 2, 1, 2).is_ok());
        assert!(t.apply(&mut x, 3, 1, 0).is_err());
        assert!(RopeTable::new(3, 10000.0, None, 4).is_err());
    }
}
