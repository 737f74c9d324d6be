//! Token sampling.
//!
//! The order is fixed and documented (it is llama.cpp's):
//!
//! 1. **repeat penalty** on the last `repeat_last_n` tokens (positive logits
//!    divided by the penalty, negative ones multiplied), 1.0 = off;
//! 2. if `temperature == 0`: **greedy**, the highest logit (first on ties);
//! 3. **top-k**: keep the k highest (0 = off);
//! 4. **top-p**: keep the smallest prefix whose probability reaches p (1.0 = off);
//! 5. **min-p**: drop tokens whose probability is below `min_p` × the best's (0 = off);
//! 6. **temperature**: divide the survivors' logits, softmax, draw one.
//!
//! Buffers are sized for the vocabulary once; sampling allocates nothing.

use std::fmt;

/// The sampling parameters (llama.cpp's names and defaults; see the module
/// docs for the order they apply in).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplerConfig {
    /// 0 = greedy; otherwise the softmax temperature (default 0.8).
    pub temperature: f32,
    /// Keep the k most likely tokens; 0 = off (default 40).
    pub top_k: usize,
    /// Keep the smallest set whose probability reaches p; 1 = off (default 0.95).
    pub top_p: f32,
    /// Drop tokens below `min_p` × the best one's probability; 0 = off
    /// (default 0.05).
    pub min_p: f32,
    /// Penalty on the recent tokens' logits; 1 = off (the default).
    pub repeat_penalty: f32,
    /// How many recent tokens the penalty looks at (default 64).
    pub repeat_last_n: usize,
    /// The random generator's seed.
    pub seed: u64,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            seed: 0,
        }
    }
}

/// A sampling parameter out of range; the message names the flag.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplerError(pub String);

impl fmt::Display for SamplerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}
impl std::error::Error for SamplerError {}

impl SamplerConfig {
    /// Checks every parameter; the message names the flag.
    pub fn validate(&self) -> Result<(), SamplerError> {
        let e = |m: String| Err(SamplerError(m));
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return e(format!(
                "--temp must be 0 (greedy) or positive, got {}",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return e(format!("--top-p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return e(format!("--min-p must be in [0, 1], got {}", self.min_p));
        }
        if !(self.repeat_penalty > 0.0 && self.repeat_penalty.is_finite()) {
            return e(format!(
                "--repeat-penalty must be positive, got {}",
                self.repeat_penalty
            ));
        }
        Ok(())
    }
}

/// SplitMix64: small, seedable, good enough for sampling.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator starting from `seed`.
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E3779B97F4A7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
}

/// The first index of the largest value (NaN never wins; 0 when nothing
/// beats minus infinity).
pub fn argmax(x: &[f32]) -> usize {
    // The largest value first, 16 lanes at a time (the compiler turns the
    // lane-wise selects into vector max operations), then its first index:
    // two streaming passes instead of one with a branch per logit.
    const L: usize = 16;
    let mut lanes = [f32::NEG_INFINITY; L];
    let mut chunks = x.chunks_exact(L);
    for c in chunks.by_ref() {
        for (m, &v) in lanes.iter_mut().zip(c) {
            *m = if v > *m { v } else { *m };
        }
    }
    let mut max = f32::NEG_INFINITY;
    for &v in lanes.iter().chain(chunks.remainder()) {
        if v > max {
            max = v;
        }
    }
    if max == f32::NEG_INFINITY {
        return 0;
    }
    x.iter().position(|&v| v == max).unwrap_or(0)
}

/// Picks tokens from logits with one [`SamplerConfig`], remembering the
/// recent tokens for the repeat penalty.
///
/// ```
/// use llama_graph::generate::{Sampler, SamplerConfig};
///
/// let greedy = SamplerConfig { temperature: 0.0, ..Default::default() };
/// let mut sampler = Sampler::new(greedy, 4)?;
/// assert_eq!(sampler.sample(&[0.1, 2.5, -1.0, 2.0]), 1);
/// assert!(Sampler::new(SamplerConfig { top_p: 0.0, ..greedy }, 4).is_err());
/// # Ok::<(), llama_graph::generate::sampler::SamplerError>(())
/// ```
pub struct Sampler {
    cfg: SamplerConfig,
    rng: Rng,
    logits: Vec<f32>,
    cand: Vec<(f32, u32)>,
    recent: Vec<u32>,
    recent_head: usize,
}

impl Sampler {
    /// A sampler for logits rows of `vocab` entries; fails when a
    /// parameter is out of range.
    pub fn new(cfg: SamplerConfig, vocab: usize) -> Result<Sampler, SamplerError> {
        cfg.validate()?;
        Ok(Sampler {
            cfg,
            rng: Rng::new(cfg.seed),
            logits: Vec::with_capacity(vocab),
            cand: Vec::with_capacity(vocab),
            recent: Vec::with_capacity(cfg.repeat_last_n),
            recent_head: 0,
        })
    }

    /// The parameters it samples with.
    pub fn config(&self) -> &SamplerConfig {
        &self.cfg
    }

    /// Records a token as part of the context (prompt or generated), for
    /// the repeat penalty.
    pub fn accept(&mut self, token: u32) {
        let n = self.cfg.repeat_last_n;
        if n == 0 {
            return;
        }
        if self.recent.len() < n {
            self.recent.push(token);
        } else {
            self.recent[self.recent_head] = token;
            self.recent_head = (self.recent_head + 1) % n;
        }
    }

    /// Picks the next token from `logits`.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let pen = self.cfg.repeat_penalty;
        if self.cfg.temperature == 0.0 && pen == 1.0 {
            // Greedy without a penalty reads the row as it is (no copy of
            // a vocabulary's worth of logits per token).
            return argmax(logits) as u32;
        }
        self.logits.clear();
        self.logits.extend_from_slice(logits);
        if pen != 1.0 {
            // Each distinct token in the window is penalised once.
            for (i, &t) in self.recent.iter().enumerate() {
                if self.recent[..i].contains(&t) {
                    continue;
                }
                if let Some(l) = self.logits.get_mut(t as usize) {
                    *l = if *l > 0.0 { *l / pen } else { *l * pen };
                }
            }
        }
        if self.cfg.temperature == 0.0 {
            return argmax(&self.logits) as u32;
        }
        self.cand.clear();
        self.cand
            .extend(self.logits.iter().enumerate().map(|(i, &l)| (l, i as u32)));
        // Top-k (0 = keep all), sorted best first.
        let k = if self.cfg.top_k == 0 {
            self.cand.len()
        } else {
            self.cfg.top_k.min(self.cand.len())
        };
        let by_logit = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
        if k < self.cand.len() {
            self.cand.select_nth_unstable_by(k - 1, by_logit);
            self.cand.truncate(k);
        }
        self.cand.sort_unstable_by(by_logit);
        // Probabilities at temperature 1 for the p-filters.
        let max = self.cand[0].0;
        let mut sum = 0.0f32;
        for c in self.cand.iter() {
            sum += (c.0 - max).exp();
        }
        // Top-p.
        if self.cfg.top_p < 1.0 {
            let mut acc = 0.0f32;
            let mut keep = self.cand.len();
            for (i, c) in self.cand.iter().enumerate() {
                acc += (c.0 - max).exp() / sum;
                if acc >= self.cfg.top_p {
                    keep = i + 1;
                    break;
                }
            }
            self.cand.truncate(keep.max(1));
        }
        // Min-p, relative to the best token's probability.
        if self.cfg.min_p > 0.0 {
            let floor = self.cfg.min_p.ln();
            let keep = self.cand.iter().take_while(|c| c.0 - max >= floor).count();
            self.cand.truncate(keep.max(1));
        }
        // Temperature and the draw.
        let t = self.cfg.temperature;
        let mut total = 0.0f32;
        for c in self.cand.iter_mut() {
            c.0 = ((c.0 - max) / t).exp();
            total += c.0;
        }
        let mut r = self.rng.next_f32() * total;
        for c in &self.cand {
            r -= c.0;
            if r < 0.0 {
                return c.1;
            }
        }
        self.cand[self.cand.len() - 1].1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> SamplerConfig {
        SamplerConfig {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            seed: 7,
        }
    }

    #[test]
    fn argmax_is_the_first_index_of_the_largest_value() {
        fn naive(x: &[f32]) -> usize {
            let (mut best, mut bv) = (0, f32::NEG_INFINITY);
            for (i, &v) in x.iter().enumerate() {
                if v > bv {
                    (best, bv) = (i, v);
                }
            }
            best
        }
        let mut rng = Rng::new(3);
        for len in [0, 1, 5, 16, 17, 33, 1000, 49_157] {
            for case in 0..6 {
                let mut x: Vec<f32> = (0..len)
                    .map(|_| (rng.next_f32() * 8.0).round() - 4.0)
                    .collect();
                if len > 0 {
                    let k = (rng.next_u64() % len as u64) as usize;
                    match case {
                        1 => x[k] = f32::NAN,
                        2 => x.iter_mut().for_each(|v| *v = f32::NEG_INFINITY),
                        3 => x.iter_mut().for_each(|v| *v = f32::NAN),
                        4 => x[k] = f32::INFINITY,
                        5 => x[len - 1] = 9.0,
                        _ => {}
                    }
                }
                assert_eq!(argmax(&x), naive(&x), "len {len} case {case}");
            }
        }
    }

    #[test]
    fn greedy_is_argmax_first_on_ties() {
        let mut s = Sampler::new(
            SamplerConfig {
                temperature: 0.0,
                ..cfg()
            },
            4,
        )
        .unwrap();
        assert_eq!(s.sample(&[1.0, 3.0, 3.0, -1.0]), 1);
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_follows_probabilities() {
        let logits = [0.0f32, (3.0f32).ln(), f32::NEG_INFINITY];
        let draw = |seed| {
            let mut s = Sampler::new(SamplerConfig { seed, ..cfg() }, 3).unwrap();
            (0..4000).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(draw(1), draw(1));
        let d = draw(2);
        let ones = d.iter().filter(|&&t| t == 1).count() as f64 / d.len() as f64;
        assert!((ones - 0.75).abs() < 0.03, "P(1) = 0.75, got {ones}");
        assert!(!d.contains(&2));
    }

    #[test]
    fn filters_restrict_the_candidates() {
        let logits = [5.0f32, 4.0, 3.0, 2.0];
        let mut s = Sampler::new(SamplerConfig { top_k: 2, ..cfg() }, 4).unwrap();
        assert!((0..500).all(|_| s.sample(&logits) < 2));
        // softmax ≈ [0.64, 0.24, 0.09, 0.03]: top-p 0.8 keeps the first two.
        let mut s = Sampler::new(
            SamplerConfig {
                top_p: 0.8,
                ..cfg()
            },
            4,
        )
        .unwrap();
        assert!((0..500).all(|_| s.sample(&logits) < 2));
        // min-p 0.3 keeps tokens with p >= 0.3 * 0.64: the first two.
        let mut s = Sampler::new(
            SamplerConfig {
                min_p: 0.3,
                ..cfg()
            },
            4,
        )
        .unwrap();
        assert!((0..500).all(|_| s.sample(&logits) < 2));
    }

    #[test]
    fn repeat_penalty_applies_once_per_token() {
        let mut s = Sampler::new(
            SamplerConfig {
                temperature: 0.0,
                repeat_penalty: 2.0,
                ..cfg()
            },
            3,
        )
        .unwrap();
        s.accept(0);
        s.accept(0);
        s.accept(0);
        // 3.0 / 2 = 1.5 < 2.0: token 1 wins; penalising three times would give 0.375.
        assert_eq!(s.sample(&[3.0, 2.0, 1.6]), 1);
        assert_eq!(s.logits[0], 1.5);
    }

    #[test]
    fn bad_parameters_are_named() {
        let bad = |c: SamplerConfig| Sampler::new(c, 4).err().unwrap().0;
        assert!(bad(SamplerConfig {
            temperature: -1.0,
            ..cfg()
        })
        .contains("--temp"));
        assert!(bad(SamplerConfig {
            top_p: 2.0,
            ..cfg()
        })
        .contains("--top-p"));
        assert!(bad(SamplerConfig {
            min_p: -0.1,
            ..cfg()
        })
        .contains("--min-p"));
        assert!(bad(SamplerConfig {
            repeat_penalty: 0.0,
            ..cfg()
        })
        .contains("--repeat-penalty"));
    }
}
