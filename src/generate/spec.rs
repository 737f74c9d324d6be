//! Speculative decoding that gives exactly the tokens plain decoding gives.
//!
//! A [`Drafter`] guesses the next `k` tokens: a smaller model with the same
//! vocabulary ([`Drafter::model`], greedy), or the continuation of the
//! latest earlier occurrence of the last few tokens in the prompt and the
//! output so far ([`Drafter::ngram`], prompt lookup). The target then feeds
//! the token it sampled last together with the `k` guesses as one ordinary
//! step of `k + 1` tokens that asks for the logits of all `k + 1` positions
//! (the step's `LastRows` returns this sequence's last `k + 1` rows, see
//! [`crate::ir::LogitRows::Tail`]). Its kernels are batch- and
//! chunk-invariant, so row `i` holds, bit for bit, the logits a plain run
//! gets from a one-token step at that position.
//!
//! The tokens are then sampled from those rows exactly as a plain run
//! samples them, one row at a time, with the same sampler and its random
//! stream, one draw per emitted token: a row's token is emitted; if it
//! equals the next guess, the next row (computed on that guess) is the
//! plain run's next row too and sampling goes on; otherwise the rows after
//! it were computed on a wrong guess and are dropped, and the KV cache is
//! rolled back to the tokens kept (its blocks past them go back to the
//! pool). The output is therefore the plain run's token for token, greedy
//! or sampled with a seed. See `docs/design/speculative.md` for why this
//! acceptance rule (and not the usual rejection sampling) is used.
//!
//! The number of guesses adapts ([`Adapt`]): from the measured acceptance
//! and the measured time of a step of `k + 1` tokens against a one-token
//! step (and of drafting), it picks the `k` with the best expected tokens
//! per second, or no guess at all when plain decoding is faster.

use crate::session::{Model, Session, SessionError};
use std::time::Duration;

use super::sampler::argmax;

/// How many tokens to draft.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpecConfig {
    /// The most tokens drafted per step (llama.cpp's `--draft-max`).
    pub draft_max: usize,
    /// The fewest: a draft shorter than this is not verified, the step is a
    /// plain one (llama.cpp's `--draft-min`).
    pub draft_min: usize,
    /// Choose the draft length from the measured acceptance and step costs
    /// (otherwise always up to `draft_max`).
    pub adaptive: bool,
}

impl Default for SpecConfig {
    fn default() -> Self {
        SpecConfig {
            draft_max: 8,
            draft_min: 1,
            adaptive: true,
        }
    }
}

impl SpecConfig {
    /// Checks the values; the message names the flag.
    pub fn validate(&self) -> Result<(), String> {
        if self.draft_max == 0 {
            return Err("--draft-max must be at least 1".into());
        }
        if self.draft_min > self.draft_max {
            return Err(format!(
                "--draft-min ({}) must not exceed --draft-max ({})",
                self.draft_min, self.draft_max
            ));
        }
        Ok(())
    }
}

/// What speculation did in one generation.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SpecStats {
    /// Tokens drafted and verified.
    pub drafted: usize,
    /// Drafted tokens the target's own sampling confirmed.
    pub accepted: usize,
    /// Steps that verified a draft.
    pub verify_steps: usize,
    /// One-token steps (no draft, or a draft not worth verifying).
    pub plain_steps: usize,
    /// Every verifying step: (first position, tokens fed, tokens kept).
    pub steps: Vec<(usize, usize, usize)>,
    /// Time spent drafting.
    pub draft_time: Duration,
}

impl SpecStats {
    /// Accepted over drafted (0 when nothing was drafted).
    pub fn acceptance(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }
}

/// Guesses the next tokens of a sequence.
pub enum Drafter {
    /// Prompt lookup: the tokens that followed the latest earlier
    /// occurrence of the sequence's last `n` tokens, `n` from `max` down to
    /// `min`.
    Ngram {
        /// The shortest n-gram looked up.
        min: usize,
        /// The longest n-gram looked up.
        max: usize,
    },
    /// A smaller model with the target's vocabulary, decoded greedily on
    /// its own session. `fed` are the sequence's tokens it has read; its
    /// KV cache holds those from `offset` on (see [`MAX_CATCH_UP`]).
    Model {
        /// The draft model's own session.
        session: Box<Session>,
        /// The sequence's tokens the draft model has read.
        fed: Vec<u32>,
        /// The first of them in the draft session's KV cache.
        offset: usize,
    },
}

/// The most tokens a draft model is fed to catch up with a sequence before
/// a guess. A draft model reads only the tokens of steps it drafted for, so
/// after a run of plain steps (the controller found guessing did not pay)
/// it is behind by that many tokens; feeding them all would cost about as
/// much per token as a plain step of a model that size, whether or not the
/// next guess is kept. Further behind than this, its cache restarts from
/// the sequence's last `MAX_CATCH_UP` tokens: its guesses then see less of
/// the text (they are guesses; the output does not depend on them), and a
/// probe costs a bounded amount.
pub const MAX_CATCH_UP: usize = 32;

impl Drafter {
    /// Prompt lookup over n-grams of 3 down to 2 tokens.
    pub fn ngram() -> Drafter {
        Drafter::Ngram { min: 2, max: 3 }
    }

    /// A draft model on its own session (compiled for one sequence).
    pub fn model(session: Session) -> Drafter {
        Drafter::Model {
            session: Box::new(session),
            fed: Vec::new(),
            offset: 0,
        }
    }

    /// Whether drafting costs a model step per token.
    pub fn is_model(&self) -> bool {
        matches!(self, Drafter::Model { .. })
    }

    /// Feeds a draft model the sequence so far (all but its last token,
    /// which the first draft feeds) ahead of the first draft, keeping what
    /// its cache already holds of it; nothing for prompt lookup. More than
    /// [`MAX_CATCH_UP`] tokens behind a sequence it has read before, the
    /// cache restarts from the sequence's last `MAX_CATCH_UP` tokens.
    /// Returns how many tokens it fed.
    pub fn prefill(&mut self, tokens: &[u32]) -> Result<usize, SessionError> {
        let mut n = 0;
        if let Drafter::Model {
            session,
            fed,
            offset,
        } = self
        {
            let head = &tokens[..tokens.len().saturating_sub(1)];
            keep_common(session, fed, offset, head, head.len());
            // A sequence it has not read yet (nothing kept) is read whole.
            if !fed.is_empty() && head.len() - fed.len() > MAX_CATCH_UP {
                session.rewind(0);
                *offset = head.len() - MAX_CATCH_UP;
                fed.clear();
                fed.extend_from_slice(&head[..*offset]);
            }
            if fed.len() < head.len() {
                let from = fed.len();
                session.feed(&head[from..])?;
                fed.extend_from_slice(&head[from..]);
                n = head.len() - from;
            }
        }
        Ok(n)
    }

    /// Up to `k` guesses of the tokens after `history` (which ends with
    /// the token the target feeds next), into `out` (cleared first).
    pub fn draft(
        &mut self,
        history: &[u32],
        k: usize,
        out: &mut Vec<u32>,
    ) -> Result<(), SessionError> {
        out.clear();
        if k == 0 || history.is_empty() {
            return Ok(());
        }
        match self {
            Drafter::Ngram { min, max } => {
                ngram_lookup(history, *min, *max, k, out);
                Ok(())
            }
            Drafter::Model {
                session,
                fed,
                offset,
            } => {
                // Keep the cached tokens the history still holds, and
                // re-feed at least its last token for its logits.
                keep_common(session, fed, offset, history, history.len() - 1);
                let from = fed.len();
                let room = session.context() - session.position();
                let k = k.min(room.saturating_sub(history.len() - from));
                if k == 0 {
                    return Ok(());
                }
                let mut next = argmax(session.feed(&history[from..])?) as u32;
                fed.extend_from_slice(&history[from..]);
                out.push(next);
                while out.len() < k {
                    next = argmax(session.feed(&[next])?) as u32;
                    fed.push(out[out.len() - 1]);
                    out.push(next);
                }
                Ok(())
            }
        }
    }
}

/// Rolls a draft model back to the longest prefix (at most `max` tokens)
/// that `fed` shares with `tokens`; if that prefix ends before the cache's
/// first token (`offset`: the sequence changed there), the cache starts
/// over from the sequence's first token.
fn keep_common(
    session: &mut Session,
    fed: &mut Vec<u32>,
    offset: &mut usize,
    tokens: &[u32],
    max: usize,
) {
    let common = fed
        .iter()
        .zip(tokens)
        .take_while(|(a, b)| a == b)
        .count()
        .min(max);
    if common < *offset {
        session.rewind(0);
        *offset = 0;
        fed.clear();
        return;
    }
    // `rewind` may keep less than asked (a window layer's ring): keep what
    // it kept.
    let kept = session.rewind(common - *offset);
    fed.truncate(*offset + kept);
}

/// Checks that `draft` guesses in `target`'s vocabulary: the same number
/// of token ids and, where both files carry a tokenizer, the same bytes for
/// every id. The message says which id differs.
pub fn check_vocab(target: &Model, draft: &Model) -> Result<(), String> {
    let (tv, dv) = (target.args.vocab_size, draft.args.vocab_size);
    if tv != dv {
        return Err(format!(
            "the draft model {} has a vocabulary of {} tokens, the model {} has {}: a draft model must share the model's tokenizer",
            draft.path.display(),
            dv.map_or("unknown".into(), |v| v.to_string()),
            target.path.display(),
            tv.map_or("unknown".into(), |v| v.to_string()),
        ));
    }
    if let (Some(t), Some(d)) = (&target.tokenizer, &draft.tokenizer) {
        let n = t.n_vocab().max(d.n_vocab());
        if let Some(id) = (0..n as u32).find(|&i| t.token_bytes(i) != d.token_bytes(i)) {
            return Err(format!(
                "the draft model {} spells token {id} {:?}, the model {} spells it {:?}: a draft model must share the model's tokenizer",
                draft.path.display(),
                d.token_bytes(id).map(String::from_utf8_lossy),
                target.path.display(),
                t.token_bytes(id).map(String::from_utf8_lossy),
            ));
        }
    }
    Ok(())
}

/// Prompt lookup: for `n` from `max` down to `min`, the latest earlier
/// occurrence of the last `n` tokens of `history` that has a continuation;
/// up to `k` tokens of that continuation go to `out`.
pub fn ngram_lookup(history: &[u32], min: usize, max: usize, k: usize, out: &mut Vec<u32>) {
    let next = ngram_continuation(history, min, max);
    out.extend_from_slice(&next[..k.min(next.len())]);
}

/// The tokens after the latest earlier occurrence of the longest of the
/// last `max` down to `min` tokens of `history` (up to its end), or none.
fn ngram_continuation(history: &[u32], min: usize, max: usize) -> &[u32] {
    let len = history.len();
    for n in (min.max(1)..=max).rev() {
        if n >= len {
            continue;
        }
        let tail = &history[len - n..];
        // Candidate starts, latest first, that end before the tail.
        if let Some(start) = (0..len - n).rev().find(|&s| &history[s..s + n] == tail) {
            return &history[start + n..];
        }
    }
    &[]
}

/// Exponential moving average, `None` until its first sample.
#[derive(Debug, Clone, Copy, Default)]
struct Ema(Option<f64>);

impl Ema {
    fn push(&mut self, x: f64, alpha: f64) {
        self.0 = Some(match self.0 {
            None => x,
            Some(v) => v + alpha * (x - v),
        });
    }
}

/// The draft-length controller: measured acceptance and step costs.
#[derive(Debug, Clone, Default)]
pub struct Adapt {
    /// Seconds of a one-token step.
    step1: Ema,
    /// Extra seconds per extra token in a step.
    per_token: Ema,
    /// Seconds per drafted token (a draft model's catching up excluded:
    /// see [`Drafter::prefill`]).
    draft: Ema,
    /// Guesses confirmed and guesses tested (a guess is tested when the
    /// ones before it were confirmed), both decayed as new ones come, so
    /// the estimate follows the text; see [`Adapt::acceptance`].
    confirmed: f64,
    tested: f64,
    /// Plain steps since the last verifying one.
    since_verify: usize,
    /// Seconds of every step and draft so far.
    spent: f64,
    /// Seconds spent on guesses made to measure rather than because they
    /// paid (the first draft and the probes), beyond the plain steps they
    /// replaced.
    explored: f64,
    /// Whether the guesses of the coming step are such a measurement.
    probing: bool,
    /// Prompt lookup's first guess before a plain step, and the history
    /// length it follows: scored against the token the step samples (see
    /// [`Adapt::choose_for`]).
    shadow: Option<(usize, u32)>,
}

/// A probe (one guess of the shortest length, to re-measure acceptance
/// while guessing does not pay) comes after at least this many plain steps
/// in a row, and only while probes have cost at most [`EXPLORE_SHARE`] of
/// the time so far.
const PROBE_EVERY: usize = 16;
/// The share of the generation time that measuring guesses may take: what
/// speculation costs at most where no guess is ever kept.
const EXPLORE_SHARE: f64 = 0.02;
/// Guesses in the first draft, before any acceptance is known.
const FIRST_DRAFT: usize = 4;
/// Smoothing of the step and draft times.
const ALPHA: f64 = 0.2;
/// How much each tested guess discounts the earlier ones in the acceptance
/// estimate (a memory of about 20 guesses).
const DECAY: f64 = 0.05;

impl Adapt {
    /// Records a step of `tokens` tokens that took `secs`.
    pub fn step_time(&mut self, tokens: usize, secs: f64) {
        self.spent += secs;
        if tokens <= 1 {
            self.step1.push(secs, ALPHA);
            self.since_verify += 1;
        } else {
            self.since_verify = 0;
            if let Some(t1) = self.step1.0 {
                if self.probing {
                    self.explored += (secs - t1).max(0.0);
                }
                self.per_token
                    .push(((secs - t1) / (tokens - 1) as f64).max(0.0), ALPHA);
            }
        }
    }

    /// Records a draft of `n` tokens: `catch_up` seconds feeding the draft
    /// model the `fed` tokens sampled since its last draft, then `secs`
    /// drafting. While guessing goes on, catching up (with the guesses
    /// kept and the token after them) is part of what each draft costs;
    /// after a run of plain steps it is a cost of resuming, spent but not
    /// weighed against future guesses.
    pub fn draft_times(&mut self, n: usize, fed: usize, catch_up: f64, secs: f64) {
        if fed <= n + 1 {
            self.draft_time(n, catch_up + secs);
        } else {
            self.catch_up_time(catch_up);
            self.draft_time(n, secs);
        }
    }

    /// Records `secs` spent drafting `n` tokens.
    pub fn draft_time(&mut self, n: usize, secs: f64) {
        self.catch_up_time(secs);
        if n > 0 {
            self.draft.push(secs / n as f64, ALPHA);
        }
    }

    /// Records `secs` a draft model spent catching up with the sequence
    /// before a draft: time spent, and measuring if the draft is a probe,
    /// but not part of a guess's cost.
    pub fn catch_up_time(&mut self, secs: f64) {
        self.spent += secs;
        if self.probing {
            self.explored += secs;
        }
    }

    /// Records a verification: of `drafted` guesses the first `accepted`
    /// were confirmed (so `accepted + 1` were tested unless all passed).
    pub fn verified(&mut self, drafted: usize, accepted: usize) {
        let tested = (accepted + 1).min(drafted);
        let keep = (1.0 - DECAY).powi(tested as i32);
        self.confirmed = self.confirmed * keep + accepted as f64;
        self.tested = self.tested * keep + tested as f64;
    }

    /// The probability that a guess is confirmed given the ones before it
    /// were: confirmed over tested, with half a confirmed guess of one as
    /// the prior so that a first failure does not read as "never" (nor one
    /// success as "always"); `None` before any verification.
    pub fn acceptance(&self) -> Option<f64> {
        (self.tested > 0.0).then(|| (self.confirmed + 0.5) / (self.tested + 1.0))
    }

    /// Expected tokens per second with `k` guesses (0: a plain step).
    fn rate(&self, k: usize, t1: f64) -> f64 {
        if k == 0 {
            return 1.0 / t1;
        }
        let p = self.acceptance().unwrap_or(0.5).clamp(0.0, 0.999);
        let tokens = (1.0 - p.powi(k as i32 + 1)) / (1.0 - p);
        let per = self.per_token.0.unwrap_or(0.3 * t1);
        let draft = self.draft.0.unwrap_or(0.0);
        tokens / (t1 + k as f64 * (per + draft))
    }

    /// [`Adapt::choose`] for `drafter` guessing after `history` (which
    /// ends with the token sampled last). Prompt lookup costs nothing to
    /// ask, so while guessing does not pay, its first guess before each
    /// plain step is still made and scored against the token the step
    /// samples: acceptance keeps being measured without verifying a guess,
    /// and guessing resumes as soon as the output starts to follow its
    /// input. A draft model's guess costs a step of its own: once quiet,
    /// it is measured, and resumes, only through the probes.
    pub fn choose_for(
        &mut self,
        cfg: &SpecConfig,
        max: usize,
        drafter: &Drafter,
        history: &[u32],
    ) -> usize {
        if let Some((at, guess)) = self.shadow.take() {
            if history.len() == at + 1 {
                self.verified(1, usize::from(history[at] == guess));
            }
        }
        let resuming = self.since_verify > 0 && self.acceptance().is_some();
        let mut k = self.choose(cfg, max);
        if k > 0 && resuming && !self.probing && drafter.is_model() {
            // What a draft model's guesses are worth has not changed since
            // it went quiet (nothing measured it), only the step times
            // have, by noise; and resuming costs a catch-up. It resumes
            // through a probe.
            k = 0;
        }
        if let (0, Drafter::Ngram { min, max }) = (k, drafter) {
            let next = ngram_continuation(history, *min, *max);
            self.shadow = next.first().map(|&g| (history.len(), g));
        }
        k
    }

    /// How many tokens to draft now: 0 (a plain step) or `min..=max`.
    pub fn choose(&mut self, cfg: &SpecConfig, max: usize) -> usize {
        self.probing = false;
        let max = max.min(cfg.draft_max);
        let min = cfg.draft_min.max(1);
        if max < min {
            return 0;
        }
        if !cfg.adaptive {
            return max;
        }
        let Some(t1) = self.step1.0 else {
            // Measure a plain step first.
            return 0;
        };
        if self.acceptance().is_none() {
            self.probing = true;
            return FIRST_DRAFT.clamp(min, max);
        }
        let best = (min..=max)
            .map(|k| (k, self.rate(k, t1)))
            .fold((0, self.rate(0, t1)), |a, b| if b.1 > a.1 { b } else { a });
        if best.0 == 0
            && self.since_verify >= PROBE_EVERY
            && self.explored <= EXPLORE_SHARE * self.spent
        {
            self.probing = true;
            return min;
        }
        best.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ngram_lookup_takes_the_latest_longest_match() {
        let h = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3];
        let mut out = Vec::new();
        // "2 3" last occurs at 5..7, followed by 7 8 5 2 3.
        ngram_lookup(&h, 2, 3, 3, &mut out);
        assert_eq!(out, [7, 8, 5]);
        // "5 2 3" never occurred before: the 2-gram answers.
        out.clear();
        ngram_lookup(&h, 3, 3, 3, &mut out);
        assert!(out.is_empty());
        out.clear();
        ngram_lookup(&[4, 4, 4], 1, 2, 5, &mut out);
        assert_eq!(out, [4], "the continuation runs up to the end");
    }

    #[test]
    fn the_controller_stops_drafting_when_guesses_fail() {
        let cfg = SpecConfig::default();
        let mut a = Adapt::default();
        assert_eq!(a.choose(&cfg, 8), 0, "a plain step is measured first");
        a.step_time(1, 0.010);
        assert_eq!(a.choose(&cfg, 8), FIRST_DRAFT, "then a first draft");
        assert_eq!(a.choose(&cfg, 2), 2, "no longer than allowed");
        // A 5-token step costs 2 one-token steps; nothing is accepted.
        a.step_time(5, 0.020);
        a.verified(4, 0);
        for _ in 0..40 {
            a.verified(8, 0);
        }
        assert_eq!(a.choose(&cfg, 8), 0);
        for _ in 0..PROBE_EVERY {
            a.step_time(1, 0.010);
        }
        // The first draft's extra 10 ms are over 2% of the 190 ms spent.
        assert_eq!(a.choose(&cfg, 8), 0, "no probe beyond the budget");
        for _ in 0..400 {
            a.step_time(1, 0.010);
        }
        assert_eq!(a.choose(&cfg, 8), 1, "a probe once the budget allows");
        // Every guess accepted: the longest draft pays.
        for _ in 0..80 {
            a.verified(8, 8);
        }
        assert_eq!(a.choose(&cfg, 8), 8);
        assert_eq!(a.choose(&cfg, 3), 3);
    }

    #[test]
    fn prompt_lookup_is_scored_during_plain_steps() {
        let cfg = SpecConfig::default();
        let ngram = Drafter::ngram();
        let mut a = Adapt::default();
        a.step_time(1, 0.010);
        // Guessing does not pay: acceptance measured at zero.
        a.step_time(5, 0.020);
        for _ in 0..40 {
            a.verified(4, 0);
        }
        for _ in 0..400 {
            a.step_time(1, 0.010);
        }
        // No probe budget left.
        a.explored = 1.0;
        // The output starts to repeat itself: "1 2 3 4 5 6" over and over.
        let text: Vec<u32> = (0..8).flat_map(|_| 1..=6).collect();
        let mut ks = Vec::new();
        for n in 3..=text.len() {
            ks.push(a.choose_for(&cfg, 8, &ngram, &text[..n]));
            a.step_time(1, 0.010);
        }
        assert_eq!(ks[..4], [0, 0, 0, 0], "no guess before the repetition");
        assert!(ks.iter().any(|&k| k > 0), "guessing resumed: {ks:?}");
        // No free guess is made for a step that verifies guesses.
        let mut b = Adapt::default();
        b.step_time(1, 0.010);
        b.choose_for(&cfg, 8, &ngram, &text);
        assert!(b.shadow.is_none(), "no shadow guess while drafting");
    }

    #[test]
    fn probes_stay_within_their_share_of_the_time() {
        // Guesses never kept, each verifying step of 2 tokens costing 1.5
        // one-token steps: whatever the probes cost stays near 2% of the
        // total.
        let cfg = SpecConfig::default();
        let mut a = Adapt::default();
        let (t1, mut extra, mut total) = (0.010, 0.0, 0.0);
        a.step_time(1, t1);
        for _ in 0..5000 {
            let k = a.choose(&cfg, 8);
            let secs = if k == 0 {
                t1
            } else {
                t1 * (1.0 + 0.5 * k as f64)
            };
            extra += secs - t1;
            total += secs;
            a.step_time(k + 1, secs);
            if k > 0 {
                a.verified(k, 0);
            }
        }
        assert!(
            extra / total < 0.025,
            "probes took {:.3} of the time",
            extra / total
        );
        assert!(extra > 0.0, "and some probes were made");
    }
}
