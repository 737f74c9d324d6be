//! Causal grouped-query attention over a KV cache.
//!
//! Shapes: `q` `[S, H, D]`; caches `[C, Hkv, D]` with valid rows
//! `0..P+S`; query `s` (absolute position `P+s`) attends keys `0..=P+s`;
//! head `h` reads kv head `h / (H / Hkv)`; scores are scaled by `1/sqrt(D)`.
//!
//! Two forms: the unfused pieces here, [`attn_scores`] → [`softmax_rows`] →
//! [`attn_values`] (materialising `[H, S, T]`), and
//! [`attention_fused`](fused::attention_fused), a
//! streaming-softmax kernel that never materialises the score matrix.

pub mod fused;
pub(crate) mod ops;
pub mod tiled;

use crate::kernels::matmul::dot8;
use crate::kernels::{check_len, mul_dims, KernelError};
use crate::pool::{SyncPtr, ThreadPool};

/// Geometry of one attention call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnShape {
    /// New query tokens S.
    pub s: usize,
    /// Position P of the first new token (tokens already in the cache).
    pub pos: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

impl AttnShape {
    /// Keys attended by the last query: T = P + S.
    pub fn n_keys(&self) -> usize {
        self.pos + self.s
    }
    pub(super) fn check(
        &self,
        op: &'static str,
        q: &[f32],
        k_cache: &[f32],
        v_cache: &[f32],
        out_len: usize,
    ) -> Result<(), KernelError> {
        if self.n_kv_heads == 0
            || self.head_dim == 0
            || !self.n_heads.is_multiple_of(self.n_kv_heads)
        {
            return Err(KernelError::Invalid {
                op,
                what: "need n_kv_heads > 0, head_dim > 0 and n_heads a multiple of n_kv_heads",
            });
        }
        let hd = mul_dims(
            op,
            "n_heads*head_dim overflows",
            self.n_heads,
            self.head_dim,
        )?;
        check_len(
            op,
            "q elements (s*n_heads*head_dim)",
            mul_dims(op, "q size overflows", self.s, hd)?,
            q.len(),
        )?;
        check_len(
            op,
            "out elements (s*n_heads*head_dim)",
            self.s * hd,
            out_len,
        )?;
        let t = self.pos.checked_add(self.s).ok_or(KernelError::Invalid {
            op,
            what: "pos + s overflows",
        })?;
        let need = mul_dims(
            op,
            "cache size overflows",
            t,
            self.n_kv_heads * self.head_dim,
        )?;
        for (what, c) in [("k cache elements", k_cache), ("v cache elements", v_cache)] {
            if c.len() < need || c.len() % (self.n_kv_heads * self.head_dim) != 0 {
                return Err(KernelError::Shape {
                    op,
                    what,
                    expected: need,
                    actual: c.len(),
                });
            }
        }
        Ok(())
    }
    pub(super) fn scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }
}

/// Elements of the `[H, S, T]` score matrix of the unfused form.
pub fn attn_scores_len(shape: &AttnShape) -> usize {
    shape.n_heads * shape.s * shape.n_keys()
}

/// `scores[h, s, t] = q[s, h]·K[t, h/n_rep] / sqrt(D)` for `t <= P+s`, and
/// `-inf` for masked (future) keys. `scores` has [`attn_scores_len`] elements.
pub fn attn_scores(
    pool: &ThreadPool,
    q: &[f32],
    k_cache: &[f32],
    shape: AttnShape,
    scores: &mut [f32],
) -> Result<(), KernelError> {
    const OP: &str = "attn_scores";
    shape.check(OP, q, k_cache, k_cache, q.len())?;
    let (s_n, t_n, d) = (shape.s, shape.n_keys(), shape.head_dim);
    check_len(
        OP,
        "scores elements (H*S*T)",
        attn_scores_len(&shape),
        scores.len(),
    )?;
    let n_rep = shape.n_heads / shape.n_kv_heads;
    let kv_row = shape.n_kv_heads * d;
    let scale = shape.scale();
    let sp = SyncPtr::new(scores);
    pool.run(shape.n_heads, &|h| {
        // SAFETY: chunk h writes only its own [S, T] block of scores.
        let out = unsafe { sp.slice(h * s_n * t_n, s_n * t_n) };
        let g = h / n_rep;
        for s in 0..s_n {
            let qv = &q[(s * shape.n_heads + h) * d..][..d];
            let limit = shape.pos + s;
            for (t, o) in out[s * t_n..(s + 1) * t_n].iter_mut().enumerate() {
                *o = if t <= limit {
                    dot8(qv, &k_cache[t * kv_row + g * d..][..d]) * scale
                } else {
                    f32::NEG_INFINITY
                };
            }
        }
    });
    Ok(())
}

/// In-place softmax of each row (length `row_len`) in f32. A row that is
/// entirely `-inf` becomes zeros.
pub fn softmax_rows(pool: &ThreadPool, x: &mut [f32], row_len: usize) -> Result<(), KernelError> {
    const OP: &str = "softmax_rows";
    if row_len == 0 {
        return check_len(OP, "elements (row_len is 0)", 0, x.len());
    }
    if !x.len().is_multiple_of(row_len) {
        return Err(KernelError::Shape {
            op: OP,
            what: "elements (multiple of row_len)",
            expected: x.len() / row_len * row_len,
            actual: x.len(),
        });
    }
    let rows = x.len() / row_len;
    let per = (4096 / row_len).max(1);
    let xp = SyncPtr::new(x);
    pool.run(rows.div_ceil(per), &|c| {
        let r0 = c * per;
        let r1 = (r0 + per).min(rows);
        // SAFETY: chunk c owns rows r0..r1.
        let block = unsafe { xp.slice(r0 * row_len, (r1 - r0) * row_len) };
        block.chunks_exact_mut(row_len).for_each(softmax_row);
    });
    Ok(())
}

fn softmax_row(row: &mut [f32]) {
    let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if m == f32::NEG_INFINITY {
        row.fill(0.0);
        return;
    }
    let mut sum = 0f32;
    for v in row.iter_mut() {
        *v = (*v - m).exp();
        sum += *v;
    }
    for v in row.iter_mut() {
        *v /= sum;
    }
}

/// `out[s, h, :] = sum_t probs[h, s, t] * V[t, h/n_rep, :]`.
pub fn attn_values(
    pool: &ThreadPool,
    probs: &[f32],
    v_cache: &[f32],
    shape: AttnShape,
    out: &mut [f32],
) -> Result<(), KernelError> {
    const OP: &str = "attn_values";
    let q_len = shape.s * shape.n_heads * shape.head_dim;
    // `check` wants a q-shaped slice; out has that shape.
    shape.check(
        OP,
        &out[..out.len().min(q_len)],
        v_cache,
        v_cache,
        out.len(),
    )?;
    check_len(
        OP,
        "probs elements (H*S*T)",
        attn_scores_len(&shape),
        probs.len(),
    )?;
    let (s_n, t_n, d, h_n) = (shape.s, shape.n_keys(), shape.head_dim, shape.n_heads);
    let n_rep = h_n / shape.n_kv_heads;
    let kv_row = shape.n_kv_heads * d;
    let op = SyncPtr::new(out);
    pool.run(h_n, &|h| {
        let g = h / n_rep;
        for s in 0..s_n {
            // SAFETY: chunk h writes only out[s, h, :] for each s.
            let o = unsafe { op.slice((s * h_n + h) * d, d) };
            o.fill(0.0);
            let p = &probs[(h * s_n + s) * t_n..][..t_n];
            for (t, &pt) in p.iter().enumerate().take(shape.pos + s + 1) {
                axpy(o, pt, &v_cache[t * kv_row + g * d..][..d]);
            }
        }
    });
    Ok(())
}

#[inline(always)]
pub(super) fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (yi, &xi) in y.iter_mut().zip(x) {
        *yi += a * xi;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::attention::fused::{
        attention_fused, attention_fused_scratch_len, attention_fused_with,
    };
    use crate::kernels::testutil::{assert_close, Rng};
    use crate::kernels::Isa;

    fn naive(q: &[f32], kc: &[f32], vc: &[f32], sh: &AttnShape) -> Vec<f64> {
        let (d, h_n) = (sh.head_dim, sh.n_heads);
        let n_rep = h_n / sh.n_kv_heads;
        let kv_row = sh.n_kv_heads * d;
        let mut out = vec![0f64; sh.s * h_n * d];
        for s in 0..sh.s {
            for h in 0..h_n {
                let g = h / n_rep;
                let qv = &q[(s * h_n + h) * d..][..d];
                let n_t = sh.pos + s + 1;
                let sc: Vec<f64> = (0..n_t)
                    .map(|t| {
                        let k = &kc[t * kv_row + g * d..][..d];
                        qv.iter()
                            .zip(k)
                            .map(|(&a, &b)| a as f64 * b as f64)
                            .sum::<f64>()
                            / (d as f64).sqrt()
                    })
                    .collect();
                let mx = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = sc.iter().map(|v| (v - mx).exp()).collect();
                let z: f64 = e.iter().sum();
                for t in 0..n_t {
                    let v = &vc[t * kv_row + g * d..][..d];
                    for i in 0..d {
                        out[(s * h_n + h) * d + i] += e[t] / z * v[i] as f64;
                    }
                }
            }
        }
        out
    }

    fn case(threads: usize, sh: AttnShape, cap: usize, seed: u64) {
        let pool = ThreadPool::new(threads);
        let mut rng = Rng::new(seed);
        let q: Vec<f32> = rng
            .vec(sh.s * sh.n_heads * sh.head_dim)
            .iter()
            .map(|v| v * 3.0)
            .collect();
        let kc = rng.vec(cap * sh.n_kv_heads * sh.head_dim);
        let vc = rng.vec(cap * sh.n_kv_heads * sh.head_dim);
        let want = naive(&q, &kc, &vc, &sh);
        // Unfused.
        let mut scores = vec![0f32; attn_scores_len(&sh)];
        attn_scores(&pool, &q, &kc, sh, &mut scores).unwrap();
        softmax_rows(&pool, &mut scores, sh.n_keys()).unwrap();
        let mut out_a = vec![0f32; q.len()];
        attn_values(&pool, &scores, &vc, sh, &mut out_a).unwrap();
        assert_close(&out_a, &want, 1e-5, 1e-4, "unfused vs naive");
        // Fused.
        let mut scratch = vec![f32::NAN; attention_fused_scratch_len(&sh, pool.n_threads())];
        for isa in Isa::supported_levels() {
            let mut out_b = vec![f32::NAN; q.len()];
            attention_fused_with(&pool, isa, &q, &kc, &vc, sh, &mut out_b, &mut scratch).unwrap();
            assert_close(&out_b, &want, 1e-5, 1e-4, "fused vs naive");
            let a64: Vec<f64> = out_a.iter().map(|&v| v as f64).collect();
            assert_close(&out_b, &a64, 1e-5, 1e-4, "fused vs unfused");
        }
    }

    #[test]
    fn prefill_gqa() {
        let sh = AttnShape {
            s: 37,
            pos: 0,
            n_heads: 6,
            n_kv_heads: 2,
            head_dim: 16,
        };
        case(2, sh, 40, 1);
        case(1, sh, 37, 2);
    }

    #[test]
    fn decode_and_chunked_with_history() {
        // One new token after 150 cached ones (several key tiles).
        case(
            2,
            AttnShape {
                s: 1,
                pos: 150,
                n_heads: 9,
                n_kv_heads: 3,
                head_dim: 64,
            },
            200,
            3,
        );
        // A chunk of 20 tokens at position 70, no GQA.
        case(
            2,
            AttnShape {
                s: 20,
                pos: 70,
                n_heads: 4,
                n_kv_heads: 4,
                head_dim: 8,
            },
            90,
            4,
        );
        // MQA, odd head_dim.
        case(
            1,
            AttnShape {
                s: 5,
                pos: 3,
                n_heads: 4,
                n_kv_heads: 1,
                head_dim: 7,
            },
            8,
            5,
        );
    }

    /// Decode steps with long histories, where the streaming kernel splits
    /// the keys into ranges and merges their partial results.
    #[test]
    fn decode_with_split_keys() {
        use crate::kernels::attention::fused::decode_key_splits;
        for (threads, sh, cap) in [
            (
                2,
                AttnShape {
                    s: 1,
                    pos: 1000,
                    n_heads: 9,
                    n_kv_heads: 3,
                    head_dim: 64,
                },
                1001,
            ),
            (
                2,
                AttnShape {
                    s: 3,
                    pos: 700,
                    n_heads: 4,
                    n_kv_heads: 2,
                    head_dim: 8,
                },
                710,
            ),
            (
                4,
                AttnShape {
                    s: 2,
                    pos: 1100,
                    n_heads: 4,
                    n_kv_heads: 1,
                    head_dim: 7,
                },
                1102,
            ),
        ] {
            let splits = decode_key_splits(&sh, threads);
            assert!(splits > 1, "{sh:?} on {threads} threads: {splits} splits");
            case(threads, sh, cap, 7);
        }
        let sh = AttnShape {
            s: 1,
            pos: 1000,
            n_heads: 9,
            n_kv_heads: 3,
            head_dim: 64,
        };
        assert_eq!(decode_key_splits(&sh, 1), 1);
        assert_eq!(decode_key_splits(&AttnShape { pos: 100, ..sh }, 2), 1);
        assert_eq!(decode_key_splits(&AttnShape { s: 4, ..sh }, 2), 1);
    }

    #[test]
    fn causal_mask_in_scores() {
        let pool = ThreadPool::new(1);
        let sh = AttnShape {
            s: 3,
            pos: 2,
            n_heads: 1,
            n_kv_heads: 1,
            head_dim: 4,
        };
        let q = vec![1.0; 12];
        let kc = vec![1.0; 5 * 4];
        let mut sc = vec![0.0; attn_scores_len(&sh)];
        attn_scores(&pool, &q, &kc, sh, &mut sc).unwrap();
        for s in 0..3 {
            for t in 0..5 {
                let v = sc[s * 5 + t];
                if t <= 2 + s {
                    assert_eq!(v, 2.0); // 4 / sqrt(4)
                } else {
                    assert_eq!(v, f32::NEG_INFINITY);
                }
            }
        }
    }

    #[test]
    fn shape_errors() {
        let pool = ThreadPool::new(1);
        let sh = AttnShape {
            s: 2,
            pos: 3,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 4,
        };
        let q = vec![0.0; 2 * 4 * 4];
        let short = vec![0.0; 4 * 2 * 4]; // 4 rows < P+S = 5
        let ok = vec![0.0; 5 * 2 * 4];
        let mut out = vec![0.0; q.len()];
        let mut scr = vec![0.0; attention_fused_scratch_len(&sh, 1)];
        assert!(attention_fused(&pool, &q, &short, &ok, sh, &mut out, &mut scr).is_err());
        assert!(attention_fused(&pool, &q, &ok, &ok, sh, &mut out, &mut scr[1..]).is_err());
        assert!(attention_fused(&pool, &q, &ok, &ok, sh, &mut out, &mut scr).is_ok());
        let bad = AttnShape {
            n_kv_heads: 3,
            ..sh
        };
        assert!(attention_fused(&pool, &q, &ok, &ok, bad, &mut out, &mut scr).is_err());
    }
}
