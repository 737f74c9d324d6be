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
//! Before step 1, when set (see [`Penalties`], the server's OpenAI fields):
//! **logit bias** added to the model's logits (a bias of -100 or less bans
//! the token), then the **presence** and **frequency** penalties on the
//! tokens sampled so far (`logit -= presence·[count > 0] + frequency·count`).
//!
//! Log-probabilities ([`Sampler::logprobs`]) are the log-softmax of the
//! model's logits plus the logit bias: before the penalties, the filters
//! and the temperature (what OpenAI reports; with no bias they are the
//! log-softmax of the logits `run --logits-out` writes).
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

/// OpenAI's `logit_bias`, `presence_penalty` and `frequency_penalty` (all
/// off by default).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Penalties {
    /// Added to a token's logit; -100 or less bans it.
    pub logit_bias: Vec<(u32, f32)>,
    /// Subtracted once from the logit of every token sampled so far.
    pub presence: f32,
    /// Subtracted from a token's logit per time it was sampled so far.
    pub frequency: f32,
}

impl Penalties {
    /// A bias at or below this bans the token (OpenAI: "-100 should result
    /// in a ban").
    pub const BAN: f32 = -100.0;

    fn is_off(&self) -> bool {
        self.logit_bias.is_empty() && self.presence == 0.0 && self.frequency == 0.0
    }

    /// The biased logit of `token`.
    fn bias(&self, token: u32, logit: f32) -> f32 {
        self.logit_bias
            .iter()
            .filter(|&&(t, _)| t == token)
            .fold(logit, |l, &(_, b)| {
                if b <= Self::BAN {
                    f32::NEG_INFINITY
                } else {
                    l + b
                }
            })
    }
}

/// One sampled token's log-probability and the most likely alternatives
/// (best first, ties by id).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    /// The sampled token.
    pub token: u32,
    /// Its log-probability.
    pub logprob: f32,
    /// The most likely tokens and their log-probabilities, best first.
    pub top: Vec<(u32, f32)>,
}

/// `log(sum(exp(x)))`, in f64 for the sum.
pub fn log_sum_exp(x: &[f32]) -> f32 {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        return max;
    }
    let sum: f64 = x.iter().map(|&v| f64::from(v - max).exp()).sum();
    max + sum.ln() as f32
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
    penalties: Penalties,
    /// Per token, how often it was sampled (only with penalties).
    counts: Vec<u32>,
    /// The logits after the bias and penalties (only with them).
    adjusted: Vec<f32>,
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
            penalties: Penalties::default(),
            counts: Vec::new(),
            adjusted: Vec::new(),
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

    /// Sets the logit bias and the presence/frequency penalties (before the
    /// first token is sampled). Token ids must be below `vocab`.
    pub fn set_penalties(&mut self, p: Penalties, vocab: usize) -> Result<(), SamplerError> {
        if let Some(&(t, _)) = p.logit_bias.iter().find(|&&(t, _)| t as usize >= vocab) {
            return Err(SamplerError(format!(
                "logit_bias: token id {t} is outside the vocabulary of {vocab}"
            )));
        }
        if let Some(&(t, b)) = p.logit_bias.iter().find(|&&(_, b)| !b.is_finite()) {
            return Err(SamplerError(format!(
                "logit_bias: the bias of token {t} is {b}"
            )));
        }
        if !(p.presence.is_finite() && p.frequency.is_finite()) {
            return Err(SamplerError(
                "presence_penalty and frequency_penalty must be finite".into(),
            ));
        }
        self.counts = if p.presence != 0.0 || p.frequency != 0.0 {
            vec![0; vocab]
        } else {
            Vec::new()
        };
        self.penalties = p;
        Ok(())
    }

    /// The log-probability of `token` and of the `top` most likely tokens
    /// under `logits` plus the logit bias (see the module documentation).
    pub fn logprobs(&self, logits: &[f32], token: u32, top: usize) -> TokenLogprobs {
        let biased = |i: usize, l: f32| self.penalties.bias(i as u32, l);
        let lse = if self.penalties.logit_bias.is_empty() {
            log_sum_exp(logits)
        } else {
            let v: Vec<f32> = logits
                .iter()
                .enumerate()
                .map(|(i, &l)| biased(i, l))
                .collect();
            log_sum_exp(&v)
        };
        let lp = |i: usize| biased(i, logits[i]) - lse;
        let mut best: Vec<(u32, f32)> = Vec::with_capacity(top + 1);
        if top > 0 {
            for (i, &l) in logits.iter().enumerate() {
                let v = biased(i, l);
                if v.is_nan() || (best.len() == top && v <= best[top - 1].1) {
                    continue;
                }
                let at = best.partition_point(|&(_, b)| b >= v);
                best.insert(at, (i as u32, v));
                best.truncate(top);
            }
        }
        TokenLogprobs {
            token,
            logprob: lp(token as usize),
            top: best.into_iter().map(|(i, v)| (i, v - lse)).collect(),
        }
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
        if self.penalties.is_off() {
            return self.sample_plain(logits);
        }
        let mut adjusted = std::mem::take(&mut self.adjusted);
        adjusted.clear();
        adjusted.extend_from_slice(logits);
        let p = &self.penalties;
        for &(t, _) in &p.logit_bias {
            adjusted[t as usize] = p.bias(t, logits[t as usize]);
        }
        if !self.counts.is_empty() {
            for (l, &c) in adjusted.iter_mut().zip(&self.counts) {
                if c > 0 {
                    *l -= p.presence + p.frequency * c as f32;
                }
            }
        }
        let tok = self.sample_plain(&adjusted);
        self.adjusted = adjusted;
        if let Some(c) = self.counts.get_mut(tok as usize) {
            *c += 1;
        }
        tok
    }

    /// Steps 1-6 of the module documentation on `logits` as given.
    fn sample_plain(&mut self, logits: &[f32]) -> u32 {
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

    #[test]
    fn a_ban_and_penalties_change_what_is_sampled() {
        let greedy = SamplerConfig {
            temperature: 0.0,
            ..cfg()
        };
        let logits = [1.0f32, 3.0, 2.0, 0.0];
        let mut s = Sampler::new(greedy, 4).unwrap();
        s.set_penalties(
            Penalties {
                logit_bias: vec![(1, -100.0)],
                ..Penalties::default()
            },
            4,
        )
        .unwrap();
        assert!((0..5).all(|_| s.sample(&logits) == 2), "1 is banned");
        // A positive bias wins.
        let mut s = Sampler::new(greedy, 4).unwrap();
        let bias = Penalties {
            logit_bias: vec![(3, 5.0)],
            ..Penalties::default()
        };
        s.set_penalties(bias, 4).unwrap();
        assert_eq!(s.sample(&logits), 3);
        // Presence 1.5: 1 once sampled falls to 1.5 < 2, so 2 is next,
        // then 1 again (2 - 1.5 = 0.5 < 1.5).
        let mut s = Sampler::new(greedy, 4).unwrap();
        let presence = Penalties {
            presence: 1.5,
            ..Penalties::default()
        };
        s.set_penalties(presence, 4).unwrap();
        let got: Vec<u32> = (0..3).map(|_| s.sample(&logits)).collect();
        assert_eq!(got, [1, 2, 1]);
        // Frequency 0.6: 1 is sampled until 3 - 0.6·n < 2, i.e. twice.
        let mut s = Sampler::new(greedy, 4).unwrap();
        let frequency = Penalties {
            frequency: 0.6,
            ..Penalties::default()
        };
        s.set_penalties(frequency, 4).unwrap();
        let got: Vec<u32> = (0..3).map(|_| s.sample(&logits)).collect();
        assert_eq!(got, [1, 1, 2]);
        let bad = Penalties {
            logit_bias: vec![(4, 1.0)],
            ..Penalties::default()
        };
        assert!(s
            .set_penalties(bad, 4)
            .unwrap_err()
            .0
            .contains("token id 4"));
    }

    #[test]
    fn logprobs_are_the_log_softmax_after_the_bias() {
        let logits = [1.0f32, 3.0, 2.0, 0.0];
        let z: f64 = logits.iter().map(|&l| f64::from(l).exp()).sum();
        let lp = |l: f32| (f64::from(l) - z.ln()) as f32;
        let s = Sampler::new(cfg(), 4).unwrap();
        let t = s.logprobs(&logits, 2, 3);
        let close = |a: f32, b: f32| (a - b).abs() < 1e-6;
        assert!(t.token == 2 && close(t.logprob, lp(2.0)), "{t:?}");
        let want = [(1, lp(3.0)), (2, lp(2.0)), (0, lp(1.0))];
        assert_eq!(t.top.len(), 3);
        for (g, w) in t.top.iter().zip(want) {
            assert!(g.0 == w.0 && close(g.1, w.1), "{t:?}");
        }
        assert!(s.logprobs(&logits, 0, 0).top.is_empty());
        let mut s = Sampler::new(cfg(), 4).unwrap();
        s.set_penalties(
            Penalties {
                logit_bias: vec![(1, -100.0)],
                presence: 9.0,
                ..Penalties::default()
            },
            4,
        )
        .unwrap();
        let z: f64 = [1.0f64, 2.0, 0.0].iter().map(|l| l.exp()).sum();
        let t = s.logprobs(&logits, 2, 2);
        assert!((t.logprob - (2.0 - z.ln()) as f32).abs() < 1e-6);
        assert_eq!(t.top.iter().map(|p| p.0).collect::<Vec<_>>(), [2, 0]);
    }
}
