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

    /// How many of `history`'s tokens before its last a draft model has
    /// not read (at most [`MAX_CATCH_UP`], what a catch-up feeds); 0 for
    /// prompt lookup.
    pub fn unread(&self, history: &[u32]) -> usize {
        match self {
            Drafter::Ngram { .. } => 0,
            Drafter::Model { fed, .. } => {
                let head = history.len().saturating_sub(1);
                let common = fed.iter().zip(history).take_while(|(a, b)| a == b).count();
                head.saturating_sub(common).min(MAX_CATCH_UP)
            }
        }
    }

    /// Feeds a draft model the sequence so far (all but its last token,
    /// which the first draft feeds) ahead of the first draft, keeping what
    /// its cache already holds of it; nothing for prompt lookup. One
    /// unread token before the last is left to the draft, which feeds it
    /// with the last in one step: that is where a draft model stands after
    /// a step that kept every guess (it never read the last guess), and
    /// one step of two tokens costs less than two of one. More than
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
            if fed.len() + 1 < head.len() {
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
/// last `max` down to `min` tokens of `history`, or none: up to its end,
/// or, where up to [`AGREE_WITH`] earlier occurrences of that n-gram went
/// on differently, up to the first token they disagree on (at least one
/// token). Text that repeats an n-gram in several contexts (`count = 0`,
/// `count = count + 1`) is guessed only as far as those contexts agree:
/// replayed over the benchmark prompts' greedy outputs with 8 guesses a
/// step, this gave 1.05-1.17x the tokens per unit of step time of the
/// whole continuation (`docs/design/speculative.md`).
fn ngram_continuation(history: &[u32], min: usize, max: usize) -> &[u32] {
    let len = history.len();
    for n in (min.max(1)..=max).rev() {
        if n >= len {
            continue;
        }
        let tail = &history[len - n..];
        // Candidate starts, latest first, that end before the tail.
        let mut starts = (0..len - n)
            .rev()
            .filter(|&s| &history[s..s + n] == tail)
            .map(|s| s + n);
        if let Some(first) = starts.next() {
            let next = &history[first..];
            let agree = starts
                .take(AGREE_WITH)
                .map(|s| {
                    next.iter()
                        .zip(&history[s..])
                        .take_while(|(a, b)| a == b)
                        .count()
                })
                .fold(next.len(), usize::min);
            return &next[..agree.max(1)];
        }
    }
    &[]
}

/// How many earlier occurrences of the n-gram prompt lookup's guess must
/// agree with (see [`ngram_continuation`]).
const AGREE_WITH: usize = 8;

/// How many recent samples an estimate holds.
const RECENT: usize = 5;

/// The median of the last [`RECENT`] samples, `None` until the first.
/// The first sample stands only until the second replaces it: the first
/// step of a kind may pay one-time costs (cold caches, buffers touched for
/// the first time). A median, not an average: on a shared CPU a step now
/// and then takes far longer (another process ran), and one such step
/// must not flip the decision to guess or not, since a paused draft model
/// is not measured again until it resumes.
#[derive(Debug, Clone, Copy, Default)]
struct Recent {
    samples: [f64; RECENT],
    /// Samples held (the first `len` of `samples`, until it is full).
    len: usize,
    /// Where the next sample goes.
    next: usize,
    /// Samples seen.
    seen: usize,
}

impl Recent {
    fn push(&mut self, x: f64) {
        if self.seen == 1 {
            self.len = 0;
            self.next = 0;
        }
        self.seen += 1;
        self.samples[self.next] = x;
        self.next = (self.next + 1) % RECENT;
        self.len = (self.len + 1).min(RECENT);
    }

    fn get(&self) -> Option<f64> {
        let mut v = self.samples;
        let s = &mut v[..self.len];
        s.sort_by(f64::total_cmp);
        let n = s.len();
        match n {
            0 => None,
            _ if n % 2 == 1 => Some(s[n / 2]),
            _ => Some((s[n / 2 - 1] + s[n / 2]) / 2.0),
        }
    }
}

/// Costs of steps with `k` guesses (k >= 1), as a line `a + b k`: by
/// least squares through the recent cost of each `k` seen (a [`Recent`]
/// median per `k`), once two lengths were seen; through the origin
/// before. A step of several tokens costs more than the sum of its
/// tokens' shares (on SmolLM2-135M F32, one thread: verifying `k` guesses
/// 11.5 + 8.8 k ms beyond a plain step, drafting them 7.5 + 15.9 k ms), so
/// a cost per guess measured at one guess would make eight look dearer
/// than they are, and the draft length would fall step by step down to
/// no guess at all.
#[derive(Debug, Clone, Default)]
struct Costs(Vec<(usize, Recent)>);

impl Costs {
    fn push(&mut self, k: usize, secs: f64) {
        if k == 0 {
            return;
        }
        let secs = secs.max(0.0);
        match self.0.iter_mut().find(|(n, _)| *n == k) {
            Some((_, r)) => r.push(secs),
            None => {
                let mut r = Recent::default();
                r.push(secs);
                self.0.push((k, r));
            }
        }
    }

    /// The line's intercept and slope.
    fn line(&self) -> Option<(f64, f64)> {
        // The (k, median) points, walked once per sum (no allocation: this
        // runs for every candidate length of every step).
        let points = || {
            self.0
                .iter()
                .filter_map(|(k, r)| r.get().map(|m| (*k as f64, m)))
        };
        let count = points().count();
        if count == 0 {
            return None;
        }
        let through_origin = || {
            let kk: f64 = points().map(|p| p.0 * p.0).sum();
            let km: f64 = points().map(|p| p.0 * p.1).sum();
            (0.0, km / kk)
        };
        if count == 1 {
            return Some(through_origin());
        }
        let n = count as f64;
        let mk = points().map(|p| p.0).sum::<f64>() / n;
        let mm = points().map(|p| p.1).sum::<f64>() / n;
        let sxx: f64 = points().map(|p| (p.0 - mk) * (p.0 - mk)).sum();
        let sxy: f64 = points().map(|p| (p.0 - mk) * (p.1 - mm)).sum();
        let b = sxy / sxx;
        let a = mm - b * mk;
        Some(if b < 0.0 {
            (mm, 0.0)
        } else if a < 0.0 {
            through_origin()
        } else {
            (a, b)
        })
    }

    /// The expected cost of `k` guesses.
    fn at(&self, k: usize) -> Option<f64> {
        self.line().map(|(a, b)| a + b * k as f64)
    }
}

/// Guesses confirmed out of guesses tested, decayed by [`DECAY`] per
/// guess tested, so that the rate follows the text.
#[derive(Debug, Clone, Copy, Default)]
struct Rate {
    confirmed: f64,
    tested: f64,
}

impl Rate {
    fn push(&mut self, tested: usize, confirmed: usize) {
        let keep = (1.0 - DECAY).powi(tested as i32);
        self.confirmed = self.confirmed * keep + confirmed as f64;
        self.tested = self.tested * keep + tested as f64;
    }

    /// Confirmed over tested, with `prior` standing for one tested guess.
    fn with_prior(&self, prior: f64) -> f64 {
        (self.confirmed + prior) / (self.tested + 1.0)
    }
}

/// The draft-length controller: measured acceptance and step costs.
#[derive(Debug, Clone, Default)]
pub struct Adapt {
    /// Seconds of a one-token step.
    step1: Recent,
    /// Extra seconds of a step verifying `k` guesses over a plain step.
    verify: Costs,
    /// Seconds drafting `k` guesses (a draft model's catching up
    /// excluded: see [`Drafter::prefill`]).
    draft: Costs,
    /// Seconds per token a draft model fed to catch up after plain steps.
    catch_up: Recent,
    /// First guesses of a step confirmed and tested, both decayed as new
    /// ones come, so the estimate follows the text; see
    /// [`Adapt::acceptance`].
    first: Rate,
    /// The same for the later guesses of a step (a guess is tested when
    /// the ones before it were confirmed): see [`Adapt::acceptance_later`].
    later: Rate,
    /// Plain steps since the last verifying one.
    since_verify: usize,
    /// Seconds of every step and draft so far.
    spent: f64,
    /// Seconds spent on guesses made to measure rather than because they
    /// paid (the first draft and the probes, drafting and catching up
    /// included), beyond the plain steps they replaced.
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
/// A paused draft model resumes when the expected saving of this many
/// steps of guessing pays for its catch-up (see [`Adapt::choose_for`]).
const RESUME_STEPS: f64 = 4.0;
/// Guesses in the first draft, before any acceptance is known.
const FIRST_DRAFT: usize = 4;
/// How much each tested guess discounts the earlier ones in the acceptance
/// estimate (a memory of about 20 guesses).
const DECAY: f64 = 0.05;

impl Adapt {
    /// The controller's state in one line (for `LLAMA_GRAPH_SPEC_TRACE`).
    pub fn summary(&self) -> String {
        let ms = |e: Recent| e.get().map_or("-".into(), |v| format!("{:.3}", v * 1e3));
        let line = |c: &Costs| {
            c.line().map_or("-".into(), |(a, b)| {
                format!("{:.3} + {:.3} k", a * 1e3, b * 1e3)
            })
        };
        format!(
            "t1 {} ms, verify {} ms, draft {} ms, catch-up {} ms/token, acceptance {} then {}, explored {:.1}/{:.1} ms",
            ms(self.step1),
            line(&self.verify),
            line(&self.draft),
            ms(self.catch_up),
            self.acceptance()
                .map_or("-".into(), |a| format!("{a:.2}")),
            self.acceptance_later()
                .map_or("-".into(), |a| format!("{a:.2}")),
            self.explored * 1e3,
            self.spent * 1e3
        )
    }

    /// Records a step of `tokens` tokens that took `secs`.
    pub fn step_time(&mut self, tokens: usize, secs: f64) {
        self.spent += secs;
        if tokens <= 1 {
            self.step1.push(secs);
            self.since_verify += 1;
        } else {
            self.since_verify = 0;
            if let Some(t1) = self.step1.get() {
                if self.probing {
                    self.explored += (secs - t1).max(0.0);
                }
                self.verify.push(tokens - 1, secs - t1);
            }
        }
    }

    /// Records a draft of `n` tokens: `catch_up` seconds feeding the draft
    /// model the `fed` tokens sampled since its last draft
    /// ([`Drafter::prefill`]), then `secs` drafting. While guessing goes
    /// on, the draft itself reads the one token a catch-up leaves (the
    /// last kept guess) with the token after it, so what a draft costs is
    /// `secs`; a catch-up (`fed > 0`) follows plain steps: it is a cost of
    /// resuming, spent and measured per token (see [`Adapt::choose_for`])
    /// but not weighed against future guesses.
    pub fn draft_times(&mut self, n: usize, fed: usize, catch_up: f64, secs: f64) {
        self.catch_up_time(catch_up);
        if fed > 0 {
            self.catch_up.push(catch_up / fed as f64);
        }
        self.draft_time(n, secs);
    }

    /// Records `secs` spent drafting `n` tokens.
    pub fn draft_time(&mut self, n: usize, secs: f64) {
        self.catch_up_time(secs);
        if n > 0 {
            self.draft.push(n, secs);
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

    /// Records a verification (after its [`Adapt::step_time`]): of
    /// `drafted` guesses the first `accepted` were confirmed (so
    /// `accepted + 1` were tested unless all passed). A measuring step's
    /// kept guesses spared as many plain steps: what it cost beyond them
    /// is what the measurement cost (an accepted first draft or probe costs
    /// nothing of the budget, and may pay back what earlier ones cost).
    pub fn verified(&mut self, drafted: usize, accepted: usize) {
        if self.probing {
            let t1 = self.step1.get().unwrap_or(0.0);
            self.explored = (self.explored - accepted as f64 * t1).max(0.0);
        }
        if drafted == 0 {
            return;
        }
        self.first.push(1, usize::from(accepted > 0));
        // Guesses 2..=drafted: guess i is tested when the i - 1 before it
        // were confirmed.
        if accepted > 0 && drafted > 1 {
            self.later.push(accepted.min(drafted - 1), accepted - 1);
        }
    }

    /// The rate of every guess tested, first or later, with half a
    /// confirmed guess of one as the prior so that a first failure does not
    /// read as "never" (nor one success as "always"): the prior of each of
    /// the two rates below, which stands in for the one with few tests.
    fn pooled(&self) -> f64 {
        (self.first.confirmed + self.later.confirmed + 0.5)
            / (self.first.tested + self.later.tested + 1.0)
    }

    /// The probability that a step's first guess is confirmed: confirmed
    /// over tested, with [`Adapt::pooled`] as the prior of one tested
    /// guess; `None` before any verification.
    pub fn acceptance(&self) -> Option<f64> {
        (self.first.tested > 0.0).then(|| self.first.with_prior(self.pooled()))
    }

    /// The probability that a later guess of a step is confirmed given the
    /// ones before it were. It is not the first guess's: where the output
    /// copies its input, a step's first guess often fails at the end of a
    /// copied stretch while the guesses after a confirmed one are nearly
    /// always kept, and a draft model's guesses after a kept one are
    /// likelier kept too. [`Adapt::pooled`] is the prior of one tested
    /// guess.
    pub fn acceptance_later(&self) -> Option<f64> {
        (self.first.tested > 0.0).then(|| self.later.with_prior(self.pooled()))
    }

    /// Expected tokens emitted by a step with `k` guesses: the one the
    /// target samples after the last kept guess, plus guess `i` with the
    /// probability that it and every guess before it are confirmed,
    /// `p1 pl^(i-1)`.
    fn tokens(&self, k: usize) -> f64 {
        if k == 0 {
            return 1.0;
        }
        let p1 = self.acceptance().unwrap_or(0.5).clamp(0.0, 0.999);
        let pl = self.acceptance_later().unwrap_or(p1).clamp(0.0, 0.999);
        1.0 + p1 * (1.0 - pl.powi(k as i32)) / (1.0 - pl)
    }

    /// Expected seconds of a step with `k` guesses, drafting included.
    fn cost(&self, k: usize, t1: f64) -> f64 {
        let verify = self.verify.at(k).unwrap_or(0.3 * t1 * k as f64);
        t1 + verify + self.draft.at(k).unwrap_or(0.0)
    }

    /// Expected tokens per second with `k` guesses (0: a plain step).
    fn rate(&self, k: usize, t1: f64) -> f64 {
        if k == 0 {
            return 1.0 / t1;
        }
        self.tokens(k) / self.cost(k, t1)
    }

    /// [`Adapt::choose`] for `drafter` guessing after `history` (which
    /// ends with the token sampled last). Prompt lookup costs nothing to
    /// ask, so while guessing does not pay, its first guess before each
    /// plain step is still made and scored against the token the step
    /// samples: acceptance keeps being measured without verifying a guess,
    /// and guessing resumes as soon as the output starts to follow its
    /// input. A draft model's guess costs a step of its own, and after
    /// plain steps it must first catch up with the tokens it did not read:
    /// once quiet, it resumes when the expected saving over plain steps of
    /// [`RESUME_STEPS`] steps of guessing pays for that catch-up (after a
    /// short pause, such as one a slower stretch of plain steps ended),
    /// and otherwise only through the probes (nothing measures its guesses
    /// meanwhile).
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
        let unread = drafter.is_model().then(|| drafter.unread(history));
        let k = self.choose_model(cfg, max, unread);
        if let (0, Drafter::Ngram { min, max }) = (k, drafter) {
            let next = ngram_continuation(history, *min, *max);
            self.shadow = next.first().map(|&g| (history.len(), g));
        }
        k
    }

    /// [`Adapt::choose`] for a draft model `unread` tokens behind the
    /// sequence (`None`: a drafter that needs no catch-up): see
    /// [`Adapt::choose_for`].
    fn choose_model(&mut self, cfg: &SpecConfig, max: usize, unread: Option<usize>) -> usize {
        let resuming = self.since_verify > 0 && self.acceptance().is_some();
        let k = self.choose(cfg, max);
        let Some(unread) = unread else {
            return k;
        };
        if k == 0 {
            return 0;
        }
        let t1 = self.step1.get().unwrap_or(0.0);
        // Before a catch-up was measured, as dear as drafting.
        let per = self.catch_up.get().or(self.draft.at(1)).unwrap_or(t1);
        let catch_up = per * unread as f64;
        if self.probing && self.acceptance().is_some() {
            // A probe of a paused draft model first catches it up: up to
            // `MAX_CATCH_UP` tokens, more than the probe's own step. It
            // fits the budget with that cost, or waits.
            let probe = catch_up + self.cost(k, t1) - t1;
            if self.explored + probe > EXPLORE_SHARE * self.spent {
                self.probing = false;
                return 0;
            }
        }
        if resuming && !self.probing {
            let saving = self.tokens(k) * t1 - self.cost(k, t1);
            if saving * RESUME_STEPS < catch_up {
                return 0;
            }
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
        let Some(t1) = self.step1.get() else {
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
        let h = [1, 2, 3, 7, 8, 1, 2, 3, 7, 8, 5, 2, 3];
        let mut out = Vec::new();
        // "2 3" last occurs at 6..8, followed by 7 8 5 2 3; at 1..3 it
        // was followed by 7 8 1: the guess stops where they part.
        ngram_lookup(&h, 2, 3, 3, &mut out);
        assert_eq!(out, [7, 8]);
        out.clear();
        ngram_lookup(&h, 2, 3, 8, &mut out);
        assert_eq!(out, [7, 8]);
        // Occurrences that part at once still give the latest's next token.
        out.clear();
        ngram_lookup(&[1, 2, 9, 1, 2, 7, 1, 2], 2, 2, 4, &mut out);
        assert_eq!(out, [7]);
        // A single occurrence: its whole continuation.
        out.clear();
        ngram_lookup(&[1, 2, 9, 8, 7, 1, 2], 2, 2, 4, &mut out);
        assert_eq!(out, [9, 8, 7, 1]);
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
    fn a_first_sample_gives_way_to_the_second_and_outliers_pass() {
        let mut e = Recent::default();
        assert_eq!(e.get(), None);
        // A cold first step, then warm ones.
        e.push(0.046);
        assert_eq!(e.get(), Some(0.046));
        e.push(0.036);
        assert_eq!(e.get(), Some(0.036), "the second sample replaces the first");
        e.push(0.038);
        assert!((e.get().unwrap() - 0.037).abs() < 1e-12);
        // A step disturbed by another process does not move it.
        e.push(0.400);
        e.push(0.037);
        assert_eq!(e.get(), Some(0.0375), "the middle of 36, 37, 38, 400 ms");
        // Lasting changes do, within a few steps.
        for _ in 0..3 {
            e.push(0.050);
        }
        assert_eq!(e.get(), Some(0.050));
    }

    #[test]
    fn an_accepted_first_draft_leaves_the_probe_budget() {
        let cfg = SpecConfig::default();
        let mut a = Adapt::default();
        a.step_time(1, 0.036);
        assert_eq!(a.choose(&cfg, 8), FIRST_DRAFT);
        // Drafting and verifying cost less than the 5 plain steps it
        // replaced.
        a.draft_time(4, 0.060);
        a.step_time(5, 0.094);
        a.verified(4, 4);
        assert_eq!(a.explored, 0.0);
        // The text turns: guesses fail and guessing stops.
        for _ in 0..4 {
            a.choose(&cfg, 8);
            a.draft_time(8, 0.120);
            a.step_time(9, 0.152);
            a.verified(8, 0);
        }
        for _ in 0..PROBE_EVERY {
            assert_eq!(a.choose(&cfg, 8), 0);
            a.step_time(1, 0.036);
        }
        assert_eq!(a.choose(&cfg, 8), 1, "a probe: the budget is whole");
        // A failed probe costs its extra time.
        a.draft_time(1, 0.015);
        a.step_time(2, 0.050);
        a.verified(1, 0);
        assert!((a.explored - 0.029).abs() < 1e-9, "{}", a.explored);
    }

    /// Runs the controller for `steps` steps of a draft model whose every
    /// guess is kept, with the costs measured on SmolLM2-135M F16 with its
    /// Q4_1 as the draft, one thread (`LLAMA_GRAPH_SPEC_TRACE`): a plain
    /// step 36 ms, 14.5 ms per extra token of a step, 15 ms per drafted
    /// token, 11 ms per token caught up. `slow` steps are disturbed by
    /// 300 ms. Returns the guesses of every step and the tokens per second
    /// over plain decoding's.
    fn drive_f16_draft(steps: usize, slow: &[usize]) -> (Vec<usize>, f64) {
        let cfg = SpecConfig::default();
        let mut a = Adapt::default();
        let (mut ks, mut tokens, mut secs) = (Vec::new(), 0usize, 0.0);
        // Tokens before the last the draft model has not read.
        let mut unread = 1;
        for step in 0..steps {
            let k = a.choose_model(&cfg, 8, Some(unread));
            let extra = if slow.contains(&step) { 0.300 } else { 0.0 };
            let t = if k == 0 {
                let t1 = 0.036;
                a.step_time(1, t1 + extra);
                unread += 1;
                tokens += 1;
                t1 + extra
            } else {
                let fed = if unread > 1 { unread } else { 0 };
                let catch_up = 0.011 * fed as f64;
                a.draft_times(k, fed, catch_up, 0.015 * k as f64);
                let step = 0.036 + 0.0145 * k as f64 + extra;
                a.step_time(k + 1, step);
                a.verified(k, k);
                unread = 1;
                tokens += k + 1;
                catch_up + 0.015 * k as f64 + step
            };
            ks.push(k);
            secs += t;
        }
        (ks, tokens as f64 * 0.036 / secs)
    }

    #[test]
    fn a_draft_model_whose_guesses_pay_keeps_guessing() {
        let (ks, speedup) = drive_f16_draft(60, &[]);
        assert_eq!(ks[0], 0, "a plain step is measured first");
        assert!(ks[1..].iter().all(|&k| k > 0), "{ks:?}");
        assert!(speedup > 1.05, "{speedup:.3}x plain: {ks:?}");
        // Two verifying steps disturbed by another process do not make
        // it stop.
        let (ks, speedup) = drive_f16_draft(60, &[10, 11]);
        assert!(ks[1..].iter().all(|&k| k > 0), "{ks:?}");
        assert!(speedup > 1.0, "{speedup:.3}x plain: {ks:?}");
    }

    #[test]
    fn the_fixed_cost_of_a_longer_step_does_not_shrink_the_draft_to_nothing() {
        // SmolLM2-135M F32 with its Q4_1 as the draft, one thread
        // (`LLAMA_GRAPH_SPEC_TRACE`): a plain step 37.2 ms, verifying k
        // guesses 11.5 + 8.8 k ms more, drafting them 7.5 + 15.9 k ms;
        // every guess kept.
        let cfg = SpecConfig::default();
        let mut a = Adapt::default();
        let (mut ks, mut tokens, mut secs) = (Vec::new(), 0usize, 0.0);
        for _ in 0..60 {
            let k = a.choose_model(&cfg, 8, Some(1));
            if k == 0 {
                a.step_time(1, 0.0372);
                tokens += 1;
                secs += 0.0372;
            } else {
                let (draft, step) = (0.0075 + 0.0159 * k as f64, 0.0487 + 0.0088 * k as f64);
                a.draft_times(k, 0, 0.0, draft);
                a.step_time(k + 1, step);
                a.verified(k, k);
                tokens += k + 1;
                secs += draft + step;
            }
            ks.push(k);
        }
        assert!(ks[1..].iter().all(|&k| k > 0), "{ks:?}");
        assert!(ks[ks.len() - 10..].iter().all(|&k| k >= 5), "{ks:?}");
        let speedup = tokens as f64 * 0.0372 / secs;
        assert!(speedup > 1.15, "{speedup:.3}x plain: {ks:?}");
        assert!((a.verify.at(8).unwrap() - 0.0819).abs() < 1e-9);
    }

    /// A controller after a plain step of `t1` and a first draft of a
    /// draft model 2 tokens behind: catching up in `catch_up`, drafting
    /// in `draft`, verifying in `step`, `kept` of its guesses kept.
    fn first_draft(t1: f64, catch_up: f64, draft: f64, step: f64, kept: usize) -> Adapt {
        let mut a = Adapt::default();
        a.step_time(1, t1);
        assert_eq!(
            a.choose_model(&SpecConfig::default(), 8, Some(2)),
            FIRST_DRAFT
        );
        a.draft_times(FIRST_DRAFT, 2, catch_up, draft);
        a.step_time(FIRST_DRAFT + 1, step);
        a.verified(FIRST_DRAFT, kept);
        a
    }

    #[test]
    fn a_paused_draft_model_resumes_when_its_catch_up_pays() {
        // The F16 costs of `drive_f16_draft`, every guess kept.
        let cfg = SpecConfig::default();
        // Catching up 2 tokens took 22 ms.
        let mut a = first_draft(0.036, 0.022, 0.060, 0.094, 4);
        for _ in 0..4 {
            let k = a.choose_model(&cfg, 8, Some(1));
            assert!(k > 0, "guessing pays");
            a.draft_times(k, 0, 0.0, 0.015 * k as f64);
            a.step_time(k + 1, 0.036 + 0.0145 * k as f64);
            a.verified(k, k);
        }
        // A plain step (say the token budget allowed no guess): the draft
        // model is behind. Two tokens are worth catching up...
        a.step_time(1, 0.036);
        assert!(a.choose_model(&cfg, 8, Some(2)) > 0, "resumes 2 behind");
        // ...32 are not: a probe will measure whether it pays again.
        let k = a.choose_model(&cfg, 8, Some(MAX_CATCH_UP));
        assert_eq!(k, 0, "no resume 32 tokens behind");
        // What a catch-up measures is what is weighed: 24 tokens at 11 ms
        // are too dear (4 steps of 8 guesses, all kept, save about
        // 4 x 52 ms), 16 are not.
        assert_eq!(a.choose_model(&cfg, 8, Some(24)), 0);
        assert!(a.choose_model(&cfg, 8, Some(16)) > 0);
        a.draft_times(1, 30, 0.015, 0.015);
        a.draft_times(1, 30, 0.015, 0.015);
        assert!(a.choose_model(&cfg, 8, Some(MAX_CATCH_UP)) > 0);
    }

    #[test]
    fn a_probe_of_a_paused_draft_model_counts_its_catch_up() {
        // SmolLM2-135M F16 with a Q4_0 draft whose guesses fail, one
        // thread: a plain step 33 ms; a catch-up 7.5 ms per token.
        let cfg = SpecConfig::default();
        let mut a = first_draft(0.033, 0.015, 0.040, 0.063, 0);
        let plain = |a: &mut Adapt, n: usize| {
            for _ in 0..n {
                a.step_time(1, 0.033);
            }
        };
        // 200 plain steps (6.6 s): 2% is 132 ms, the first draft took
        // 85 ms. A probe 32 tokens behind (240 ms of catch-up) waits...
        plain(&mut a, 200);
        assert_eq!(a.choose_model(&cfg, 8, Some(MAX_CATCH_UP)), 0);
        assert!(!a.probing);
        // ...one 2 tokens behind does not.
        assert_eq!(a.choose_model(&cfg, 8, Some(2)), 1);
        assert!(a.probing);
        // With time enough, the far one is made too.
        let mut b = a.clone();
        plain(&mut b, 400);
        assert_eq!(b.choose_model(&cfg, 8, Some(MAX_CATCH_UP)), 1);
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
    fn guesses_after_a_kept_one_are_weighed_at_their_own_rate() {
        // Prompt lookup on a rewrite of given code (SmolLM2-135M F32, one
        // thread, `LLAMA_GRAPH_SPEC_TRACE`): a plain step 70 ms, each
        // verified guess 24 ms more. A step's first guess is kept about
        // half the time (the copy breaks at the renamed identifier), the
        // guesses after a kept one nine times in ten.
        let cfg = SpecConfig::default();
        let steps = |later: f64| {
            let mut a = Adapt::default();
            a.step_time(1, 0.070);
            for k in [1, 2, 4] {
                a.step_time(k + 1, 0.070 + 0.024 * k as f64);
            }
            for _ in 0..200 {
                a.first.push(20, 11);
                a.later.push(20, (20.0 * later) as usize);
            }
            (
                a.acceptance().unwrap(),
                a.acceptance_later().unwrap(),
                a.choose(&cfg, 8),
            )
        };
        let (p1, pl, k) = steps(0.9);
        assert!(
            (p1 - 0.55).abs() < 0.05 && (pl - 0.9).abs() < 0.02,
            "{p1} {pl}"
        );
        assert!(k >= 3, "long drafts pay: {k}");
        // One rate for every guess (0.55) makes a second guess not pay.
        let (_, pl, k) = steps(0.55);
        assert!((pl - 0.55).abs() < 0.05, "{pl}");
        assert!(k <= 1, "{k}");
    }

    #[test]
    fn later_guesses_start_from_the_pooled_rate() {
        let mut a = Adapt::default();
        assert_eq!(a.acceptance_later(), None);
        // Only first guesses tested (prompt lookup's scoring during plain
        // steps, or one-guess drafts): the later rate is the pooled one.
        for _ in 0..10 {
            a.verified(1, 1);
        }
        assert_eq!(a.acceptance_later(), Some(a.pooled()));
        assert!(a.pooled() > 0.9);
        // A draft of 4 whose first two guesses were kept tested guesses
        // 2 and 3: one confirmed of two.
        let mut b = Adapt::default();
        b.verified(4, 2);
        assert_eq!((b.later.confirmed, b.later.tested), (1.0, 2.0));
        assert_eq!((b.first.confirmed, b.first.tested), (1.0, 1.0));
        // All kept: guesses 2..=4 tested and confirmed.
        b.verified(4, 4);
        assert!((b.later.tested - (2.0 * 0.95f64.powi(3) + 3.0)).abs() < 1e-12);
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
