//! Perplexity and KL divergence, computed as llama.cpp's `llama-perplexity`
//! computes them (`tools/perplexity/perplexity.cpp`), so that the numbers of
//! the two tools can be set side by side.
//!
//! * **Chunks.** The text's tokens (with a BOS when the model adds one) are
//!   cut into `n_ctx`-token chunks; a tail shorter than `n_ctx` is left out.
//!   Each chunk is evaluated from an empty cache, its first token replaced
//!   by the BOS when the model adds one.
//! * **Scoring.** Only the second half of a chunk is scored: the logits at
//!   positions `n_ctx/2 .. n_ctx-2` predict the tokens after them
//!   (`n_ctx - 1 - n_ctx/2` tokens per chunk), so every scored token has
//!   at least half a context before it. PPL = exp(mean negative
//!   log-likelihood); its uncertainty is PPL times the standard error of
//!   the mean NLL.
//! * **KL divergence.** A reference run saves, for every scored position,
//!   its log-probabilities in llama.cpp's `--kl-divergence-base` file
//!   format ([`LogProbWriter`]): the header `_logits_`, `n_ctx`, `n_vocab`,
//!   `n_chunk` (32-bit) and the chunks' tokens, then per position a scale,
//!   the lowest log-probability kept (at most 16 below the best) and the
//!   vocabulary's log-probabilities as 16-bit steps above it. A later run
//!   over the same tokens compares its own distribution with that one
//!   ([`KldStats`]): mean KL(base ‖ this run), its percentiles, how often
//!   both put the same token first ("Same top p"), and the perplexities
//!   of both. Files are interchangeable with llama-perplexity's.

use std::io::{Read, Write};
use thiserror::Error;

/// Why a perplexity or KL-divergence run could not go on.
#[derive(Debug, Error)]
pub enum PerplexityError {
    /// A KL-divergence file could not be read or written, or is malformed.
    #[error("{path}: {message}")]
    File {
        /// The file.
        path: String,
        /// What is wrong with it.
        message: String,
    },
    /// The text is shorter than two chunks.
    #[error("the text tokenizes to {tokens} tokens; a context of {n_ctx} needs at least {need} (two chunks): use a longer text or a smaller -c")]
    TooShort {
        /// The text's tokens.
        tokens: usize,
        /// The chunk size (`-c`).
        n_ctx: usize,
        /// The tokens two chunks need.
        need: usize,
    },
    /// A parameter or input that cannot be used, said in words.
    #[error("{0}")]
    Invalid(String),
}

/// The first scored position of a chunk of `n_ctx` tokens.
pub fn first_scored(n_ctx: usize) -> usize {
    n_ctx / 2
}

/// Tokens scored per chunk of `n_ctx`.
pub fn scored_per_chunk(n_ctx: usize) -> usize {
    n_ctx - 1 - first_scored(n_ctx)
}

/// How many chunks of `n_ctx` the `n_tokens` give, at most `max_chunks`.
/// llama-perplexity wants at least `2 * n_ctx` tokens.
pub fn n_chunks(
    n_tokens: usize,
    n_ctx: usize,
    max_chunks: Option<usize>,
) -> Result<usize, PerplexityError> {
    if n_ctx < 4 {
        return Err(PerplexityError::Invalid(format!(
            "a context of {n_ctx} tokens scores nothing; use -c 4 or more"
        )));
    }
    if n_tokens < 2 * n_ctx {
        return Err(PerplexityError::TooShort {
            tokens: n_tokens,
            n_ctx,
            need: 2 * n_ctx,
        });
    }
    let all = n_tokens / n_ctx;
    Ok(max_chunks.map_or(all, |m| m.min(all)))
}

/// One row's numbers.
struct RowSoftmax {
    max: f32,
    argmax: usize,
    /// ln Σ exp(logit - max)
    log_sum_exp: f64,
}

fn row_softmax(logits: &[f32]) -> RowSoftmax {
    let mut max = logits[0];
    let mut argmax = 0;
    for (i, &l) in logits.iter().enumerate().skip(1) {
        if l > max {
            max = l;
            argmax = i;
        }
    }
    let sum: f64 = logits.iter().map(|&l| f64::from((l - max).exp())).sum();
    RowSoftmax {
        max,
        argmax,
        log_sum_exp: sum.ln(),
    }
}

/// The negative log-likelihood of `token` under `logits`.
pub fn nll(logits: &[f32], token: u32) -> f64 {
    let r = row_softmax(logits);
    r.log_sum_exp - f64::from(logits[token as usize] - r.max)
}

/// Running sums of a perplexity.
#[derive(Debug, Clone, Default)]
pub struct PplStats {
    /// Σ NLL.
    pub sum_nll: f64,
    /// Σ NLL².
    pub sum_nll2: f64,
    /// Tokens scored.
    pub count: usize,
}

impl PplStats {
    /// Adds one scored token's NLL.
    pub fn add(&mut self, nll: f64) {
        self.sum_nll += nll;
        self.sum_nll2 += nll * nll;
        self.count += 1;
    }

    /// exp(mean NLL).
    pub fn ppl(&self) -> f64 {
        (self.sum_nll / self.count.max(1) as f64).exp()
    }

    /// The mean NLL and its standard error, as llama-perplexity computes
    /// them.
    pub fn mean_and_error(&self) -> (f64, f64) {
        mean_and_uncertainty(self.sum_nll, self.sum_nll2, self.count)
    }

    /// PPL's uncertainty: PPL times the standard error of the mean NLL.
    pub fn ppl_error(&self) -> f64 {
        self.ppl() * self.mean_and_error().1
    }
}

/// Mean and standard error of the mean, from a sum and a sum of squares
/// (llama-perplexity's `mean_and_uncertainty`: no error below 11 values).
pub fn mean_and_uncertainty(sum: f64, sum2: f64, count: usize) -> (f64, f64) {
    if count < 1 {
        return (0.0, 0.0);
    }
    let n = count as f64;
    let f = sum / n;
    let df = sum2 / n - f * f;
    let df = if df > 0.0 && count > 10 {
        (df / (n - 1.0)).sqrt()
    } else {
        0.0
    };
    (f, df)
}

/// A linear-interpolated percentile of sorted values (llama-perplexity's).
pub fn percentile(sorted: &[f32], fraction: f64) -> f32 {
    if sorted.is_empty() {
        return 0.0;
    }
    if fraction <= 0.0 {
        return sorted[0];
    }
    if fraction >= 1.0 {
        return sorted[sorted.len() - 1];
    }
    let p = fraction * (sorted.len() - 1) as f64;
    let ip = p as usize;
    let p = (p - ip as f64) as f32;
    (1.0 - p) * sorted[ip] + p * sorted[(ip + 1).min(sorted.len() - 1)]
}

/// u16 words per saved row: the vocabulary rounded up to even, plus the
/// two f32 (scale, lowest log-probability).
pub fn row_words(n_vocab: usize) -> usize {
    2 * n_vocab.div_ceil(2) + 4
}

/// A row's log-probabilities in the base file's 16-bit form (as
/// llama-perplexity's `log_softmax` with `log_prob`): log-probabilities
/// more than 16 below the best are clamped there. Returns the row's NLL of
/// `token`.
pub fn encode_log_probs(logits: &[f32], token: u32, out: &mut [u16]) -> f64 {
    let r = row_softmax(logits);
    let min_logit = logits.iter().copied().fold(logits[0], f32::min);
    let min_logit = min_logit.max(r.max - 16.0);
    let lse = r.log_sum_exp as f32;
    let min_log_prob = min_logit - r.max - lse;
    let scale = (r.max - min_logit) / 65535.0;
    out[..2].copy_from_slice(&words(scale));
    out[2..4].copy_from_slice(&words(min_log_prob));
    let q = &mut out[4..4 + logits.len()];
    if scale > 0.0 {
        let inv = 1.0 / scale;
        for (w, &l) in q.iter_mut().zip(logits) {
            *w = if l > min_logit {
                (inv * (l - min_logit))
                    .round_ties_even()
                    .clamp(0.0, 65535.0) as u16
            } else {
                0
            };
        }
    } else {
        q.fill(0);
    }
    out[4 + logits.len()..].fill(0);
    r.log_sum_exp - f64::from(logits[token as usize] - r.max)
}

fn words(x: f32) -> [u16; 2] {
    let b = x.to_le_bytes();
    [
        u16::from_le_bytes([b[0], b[1]]),
        u16::from_le_bytes([b[2], b[3]]),
    ]
}

fn from_words(w: &[u16]) -> f32 {
    let (a, b) = (w[0].to_le_bytes(), w[1].to_le_bytes());
    f32::from_le_bytes([a[0], a[1], b[0], b[1]])
}

/// Running sums of a KL-divergence run (llama-perplexity's
/// `kl_divergence_result`), with every position's KLD and Δp kept for the
/// percentiles.
#[derive(Debug, Clone, Default)]
pub struct KldStats {
    /// This run's perplexity.
    pub ppl: PplStats,
    /// The base run's perplexity (from its saved log-probabilities).
    pub ppl_base: PplStats,
    /// Σ NLL × NLL(base), for the correlation of the two.
    pub sum_nll_nll_base: f64,
    /// Σ KLD.
    pub sum_kld: f64,
    /// Σ KLD².
    pub sum_kld2: f64,
    /// Σ Δp (this run's probability of the next token minus the base's).
    pub sum_p_diff: f64,
    /// Σ Δp².
    pub sum_p_diff2: f64,
    /// Σ Δp⁴.
    pub sum_p_diff4: f64,
    /// Positions where both runs put the same token first.
    pub n_same_top: usize,
    /// Every position's KLD.
    pub klds: Vec<f32>,
    /// Every position's Δp.
    pub p_diffs: Vec<f32>,
}

impl KldStats {
    /// Adds one position: this run's `logits`, the base's saved row, the
    /// token that followed.
    pub fn add(&mut self, logits: &[f32], base_row: &[u16], token: u32) {
        let r = row_softmax(logits);
        let lse = r.log_sum_exp as f32;
        let scale = from_words(&base_row[0..2]);
        let min_log_prob = from_words(&base_row[2..4]);
        let base = &base_row[4..4 + logits.len()];
        let nll = r.max + lse - logits[token as usize];
        let nll_base = -(scale * f32::from(base[token as usize]) + min_log_prob);
        self.ppl.add(f64::from(nll));
        self.ppl_base.add(f64::from(nll_base));
        self.sum_nll_nll_base += f64::from(nll) * f64::from(nll_base);
        let log_norm = r.max + lse;
        let mut sum = 0.0f64;
        let mut imax_base = 0;
        let mut best = f32::NEG_INFINITY;
        for (i, (&q, &l)) in base.iter().zip(logits).enumerate() {
            let lb = scale * f32::from(q) + min_log_prob;
            if i == 0 || lb > best {
                best = lb;
                imax_base = i;
            }
            if lb > -16.0 {
                sum += f64::from(lb.exp() * (lb - l + log_norm));
            }
        }
        self.sum_kld += sum;
        self.sum_kld2 += sum * sum;
        self.n_same_top += usize::from(r.argmax == imax_base);
        let p_diff = (-nll).exp() - (-nll_base).exp();
        self.sum_p_diff += f64::from(p_diff);
        let d2 = f64::from(p_diff) * f64::from(p_diff);
        self.sum_p_diff2 += d2;
        self.sum_p_diff4 += d2 * d2;
        self.klds.push(sum as f32);
        self.p_diffs.push(p_diff);
    }

    /// Positions compared.
    pub fn count(&self) -> usize {
        self.ppl.count
    }

    /// Mean KLD and its standard error.
    pub fn kld(&self) -> (f64, f64) {
        mean_and_uncertainty(self.sum_kld, self.sum_kld2, self.count())
    }

    /// The fraction of positions where both put the same token first, and
    /// its standard error.
    pub fn same_top(&self) -> (f64, f64) {
        let n = self.count() as f64;
        let p = self.n_same_top as f64 / n.max(1.0);
        (p, (p * (1.0 - p) / (n - 1.0).max(1.0)).sqrt())
    }

    /// The `fraction` percentile of the positions' KLD.
    pub fn kld_percentile(&self, fraction: f64) -> f32 {
        let mut v = self.klds.clone();
        v.sort_by(f32::total_cmp);
        percentile(&v, fraction)
    }

    /// RMS of Δp (this run's probability of the next token minus the
    /// base's) and its uncertainty.
    pub fn rms_p_diff(&self) -> (f64, f64) {
        let (mse, mse_err) = mean_and_uncertainty(self.sum_p_diff2, self.sum_p_diff4, self.count());
        let rms = mse.sqrt();
        (rms, if rms > 0.0 { 0.5 / rms * mse_err } else { 0.0 })
    }

    /// ln(PPL / PPL(base)) and its uncertainty.
    pub fn log_ppl_ratio(&self) -> (f64, f64) {
        let (a, ea) = self.ppl.mean_and_error();
        let (b, eb) = self.ppl_base.mean_and_error();
        let n = self.count();
        let cov = if n < 10 {
            0.0
        } else {
            let n = n as f64;
            (self.sum_nll_nll_base / n - (self.ppl.sum_nll / n) * (self.ppl_base.sum_nll / n))
                / (n - 1.0)
        };
        (a - b, (ea * ea + eb * eb - 2.0 * cov).max(0.0).sqrt())
    }
}

/// Writes a base file chunk by chunk.
pub struct LogProbWriter<W: Write> {
    out: W,
    n_vocab: usize,
    row: Vec<u16>,
    bytes: Vec<u8>,
}

impl<W: Write> LogProbWriter<W> {
    /// Writes the header: `n_ctx`, `n_vocab`, `n_chunk` and the chunks'
    /// tokens as the text gave them (`tokens.len() == n_chunk * n_ctx`).
    pub fn new(mut out: W, n_ctx: usize, n_vocab: usize, tokens: &[u32]) -> std::io::Result<Self> {
        let n_chunk = tokens.len() / n_ctx;
        out.write_all(b"_logits_")?;
        for v in [n_ctx, n_vocab, n_chunk] {
            out.write_all(&(v as u32).to_le_bytes())?;
        }
        let mut b = Vec::with_capacity(tokens.len() * 4);
        for &t in tokens {
            b.extend_from_slice(&t.to_le_bytes());
        }
        out.write_all(&b)?;
        Ok(LogProbWriter {
            out,
            n_vocab,
            row: vec![0; row_words(n_vocab)],
            bytes: Vec::with_capacity(row_words(n_vocab) * 2),
        })
    }

    /// Writes one scored position; returns its NLL of `token`.
    pub fn row(&mut self, logits: &[f32], token: u32) -> std::io::Result<f64> {
        debug_assert_eq!(logits.len(), self.n_vocab);
        let nll = encode_log_probs(logits, token, &mut self.row);
        self.bytes.clear();
        for w in &self.row {
            self.bytes.extend_from_slice(&w.to_le_bytes());
        }
        self.out.write_all(&self.bytes)?;
        Ok(nll)
    }

    /// Flushes the file and hands back the writer.
    pub fn finish(mut self) -> std::io::Result<W> {
        self.out.flush()?;
        Ok(self.out)
    }
}

/// A base file opened for reading: its header, then rows in order.
pub struct LogProbReader<R: Read> {
    input: R,
    /// The chunk size of the base run.
    pub n_ctx: usize,
    /// The vocabulary size.
    pub n_vocab: usize,
    /// The chunks saved.
    pub n_chunk: usize,
    /// The chunks' tokens (`n_chunk * n_ctx`), as the text gave them.
    pub tokens: Vec<u32>,
    bytes: Vec<u8>,
}

impl LogProbReader<std::io::BufReader<std::fs::File>> {
    /// Opens `path`, checking its header against its length before
    /// allocating anything it sizes.
    pub fn open(path: &std::path::Path) -> Result<Self, PerplexityError> {
        let perr = |message: String| PerplexityError::File {
            path: path.display().to_string(),
            message,
        };
        let f = std::fs::File::open(path).map_err(|e| perr(format!("cannot open: {e}")))?;
        let len = f
            .metadata()
            .map_err(|e| perr(format!("cannot read: {e}")))?
            .len();
        let mut input = std::io::BufReader::with_capacity(1 << 20, f);
        let mut head = [0u8; 20];
        input
            .read_exact(&mut head)
            .map_err(|_| perr("too short for a log-probability file".into()))?;
        if &head[..8] != b"_logits_" {
            return Err(perr(
                "not a log-probability file (no `_logits_` header); make one with --kl-divergence-base FILE without --kl-divergence".into(),
            ));
        }
        let word = |i: usize| u32::from_le_bytes([head[i], head[i + 1], head[i + 2], head[i + 3]]);
        let (n_ctx, n_vocab, n_chunk) = (word(8) as u64, word(12) as u64, word(16) as u64);
        if n_ctx < 4 || n_vocab == 0 || n_chunk == 0 {
            return Err(perr(format!(
                "header says n_ctx {n_ctx}, n_vocab {n_vocab}, n_chunk {n_chunk}"
            )));
        }
        let scored = n_ctx - 1 - n_ctx / 2;
        let want = n_ctx
            .checked_mul(n_chunk)
            .and_then(|t| t.checked_mul(4))
            .and_then(|t| {
                scored
                    .checked_mul(n_chunk)?
                    .checked_mul(row_words(n_vocab as usize) as u64 * 2)?
                    .checked_add(t)
            })
            .and_then(|t| t.checked_add(20));
        if want != Some(len) {
            return Err(perr(format!(
                "{len} bytes, but its header (n_ctx {n_ctx}, n_vocab {n_vocab}, {n_chunk} chunks) means {} bytes: the file is truncated or not one",
                want.map_or("more than 2^64".to_string(), |w| w.to_string())
            )));
        }
        let mut b = vec![0u8; (n_ctx * n_chunk * 4) as usize];
        input
            .read_exact(&mut b)
            .map_err(|e| perr(format!("reading tokens: {e}")))?;
        let tokens = b
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        Ok(LogProbReader {
            input,
            n_ctx: n_ctx as usize,
            n_vocab: n_vocab as usize,
            n_chunk: n_chunk as usize,
            tokens,
            bytes: vec![0; row_words(n_vocab as usize) * 2],
        })
    }
}

impl<R: Read> LogProbReader<R> {
    /// Reads the next saved row into `row` (`row_words(n_vocab)` words).
    pub fn next_row(&mut self, row: &mut [u16]) -> std::io::Result<()> {
        self.input.read_exact(&mut self.bytes)?;
        for (w, c) in row.iter_mut().zip(self.bytes.chunks_exact(2)) {
            *w = u16::from_le_bytes([c[0], c[1]]);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunking_follows_llama_perplexity() {
        assert_eq!(first_scored(512), 256);
        assert_eq!(scored_per_chunk(512), 255);
        assert_eq!(scored_per_chunk(128), 63);
        assert_eq!(n_chunks(1000, 128, None).unwrap(), 7);
        assert_eq!(n_chunks(1000, 128, Some(3)).unwrap(), 3);
        assert!(matches!(
            n_chunks(255, 128, None),
            Err(PerplexityError::TooShort { need: 256, .. })
        ));
    }

    #[test]
    fn a_saved_row_gives_back_its_log_probabilities() {
        let logits: Vec<f32> = (0..301)
            .map(|i| ((i * 37) % 101) as f32 * 0.3 - 9.0)
            .collect();
        let mut row = vec![0u16; row_words(logits.len())];
        let nll_saved = encode_log_probs(&logits, 7, &mut row);
        assert!((nll_saved - nll(&logits, 7)).abs() < 1e-9);
        // Against itself: KLD ~ 0 (16-bit steps only), same top token.
        let mut k = KldStats::default();
        k.add(&logits, &row, 7);
        assert!(k.sum_kld.abs() < 1e-4, "{}", k.sum_kld);
        assert_eq!(k.n_same_top, 1);
        assert!((k.ppl.sum_nll - k.ppl_base.sum_nll).abs() < 1e-3);
        // A changed distribution diverges: the most likely token made less
        // likely (a change far in the tail would move the KLD by ~e^-25).
        let mut other = logits.clone();
        let top = argmax_of(&logits);
        other[top] -= 2.0;
        let mut k2 = KldStats::default();
        k2.add(&other, &row, 7);
        assert!(k2.sum_kld > 1e-3);
    }

    fn argmax_of(x: &[f32]) -> usize {
        (0..x.len()).fold(0, |b, i| if x[i] > x[b] { i } else { b })
    }

    #[test]
    fn percentiles_interpolate() {
        let v = [0.0, 1.0, 2.0, 3.0, 4.0];
        assert_eq!(percentile(&v, 0.5), 2.0);
        assert!((percentile(&v, 0.99) - 3.96).abs() < 1e-6);
        assert_eq!(percentile(&v, 1.0), 4.0);
    }
}
