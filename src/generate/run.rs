//! The prefill/decode loop: feed the prompt, then sample, stream and stop.

use super::sampler::{Sampler, SamplerConfig, SamplerError};
use super::stop::{StopMatcher, StopStatus};
use crate::session::{Session, SessionError};
use crate::tokenizer::{StreamDecoder, Tokenizer};
use serde::Serialize;
use std::time::{Duration, Instant};
use thiserror::Error;

#[derive(Debug, Clone)]
pub struct GenOptions {
    /// Tokens to generate at most; `None` = until the context is full.
    pub n_predict: Option<usize>,
    pub sampler: SamplerConfig,
    pub stop_strings: Vec<String>,
    /// Record the top-10 logits of every step (for `--logits-out`).
    pub record_top: bool,
    /// Keep generating past end-of-sequence / end-of-turn tokens: they are
    /// sampled and decoded like any other, as the server's `ignore_eos`
    /// does (llama.cpp's `--ignore-eos` instead never samples them).
    pub ignore_eos: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// The model produced an end-of-sequence / end-of-turn token.
    Eos,
    /// `-n` tokens were generated.
    Length,
    /// A `--stop` string appeared.
    StopString,
    /// The planned context is full.
    ContextFull,
}

#[derive(Debug, Error)]
pub enum GenError {
    #[error(transparent)]
    Session(#[from] SessionError),
    #[error(transparent)]
    Sampler(#[from] SamplerError),
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("the prompt ({prompt} tokens) plus {requested} tokens to generate exceed the planned context of {context} tokens; use a larger --ctx-size or a smaller -n")]
    ContextOverflow {
        prompt: usize,
        requested: usize,
        context: usize,
    },
}

/// What a generation did, with timings.
#[derive(Debug, Clone, Default)]
pub struct GenStats {
    pub prompt_tokens: Vec<u32>,
    pub generated_tokens: Vec<u32>,
    pub prefill: Duration,
    pub decode: Duration,
    pub stop_reason: Option<StopReason>,
    /// Per step (step 0 = last prompt position), the ten best (id, logit).
    pub top: Vec<Vec<(u32, f32)>>,
    /// Context shifts done ([`generate_shifting`]) and the tokens they
    /// dropped.
    pub shifts: usize,
    pub dropped_tokens: usize,
}

impl GenStats {
    pub fn prefill_tokens_per_s(&self) -> f64 {
        self.prompt_tokens.len() as f64 / self.prefill.as_secs_f64().max(1e-9)
    }
    /// Decode speed: every generated token after the first costs one decode step.
    pub fn decode_tokens_per_s(&self) -> f64 {
        let steps = self.generated_tokens.len().saturating_sub(1);
        if steps == 0 {
            return 0.0;
        }
        steps as f64 / self.decode.as_secs_f64().max(1e-9)
    }
}

fn top10(logits: &[f32]) -> Vec<(u32, f32)> {
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    let k = 10.min(idx.len());
    let cmp = |a: &u32, b: &u32| {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then(a.cmp(b))
    };
    if k < idx.len() {
        idx.select_nth_unstable_by(k - 1, cmp);
        idx.truncate(k);
    }
    idx.sort_by(cmp);
    idx.into_iter().map(|i| (i, logits[i as usize])).collect()
}

/// Checks that `prompt_len + n_predict` fits before any work is done.
pub fn check_fits(
    prompt_len: usize,
    n_predict: Option<usize>,
    context: usize,
) -> Result<(), GenError> {
    let requested = n_predict.unwrap_or(0);
    if prompt_len == 0 {
        return Err(GenError::EmptyPrompt);
    }
    if prompt_len + requested > context || prompt_len >= context {
        return Err(GenError::ContextOverflow {
            prompt: prompt_len,
            requested,
            context,
        });
    }
    Ok(())
}

/// What a generation does when its tokens fill the context (llama.cpp's
/// context shift, re-feeding instead of re-rotating the cache).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContextShift {
    /// Tokens at the start of the sequence that always stay (a BOS, a
    /// system prompt).
    pub keep: usize,
}

impl ContextShift {
    /// The tokens that stay when `history` (every token in the cache, the
    /// first `keep` of them kept) is shifted: the first `keep`, then the
    /// newer half of the rest. As llama.cpp's `n_discard = (n_past -
    /// n_keep) / 2`.
    pub fn shifted(&self, history: &[u32]) -> Vec<u32> {
        let keep = self.keep.min(history.len());
        let discard = (history.len() - keep) / 2;
        let mut out = history[..keep].to_vec();
        out.extend_from_slice(&history[keep + discard..]);
        out
    }
}

/// Runs one generation from the session's current position: feeds
/// `prompt`, then samples until a stop condition, calling `emit` with each
/// piece of text as soon as it is complete (never a broken UTF-8 character,
/// never part of a stop string).
pub fn generate(
    session: &mut Session,
    tokenizer: Option<&Tokenizer>,
    prompt: &[u32],
    opts: &GenOptions,
    emit: &mut dyn FnMut(&str),
) -> Result<GenStats, GenError> {
    generate_shifting(session, tokenizer, prompt, opts, None, emit)
}

/// [`generate`], and with `shift` a context that fills up does not end it:
/// the oldest half of the tokens after `shift.keep` are dropped and the
/// rest fed again from position 0 (the session must start empty, so that
/// the prompt and the generated tokens are all it holds). `-n` may then
/// exceed the context; the prompt itself must still fit.
pub fn generate_shifting(
    session: &mut Session,
    tokenizer: Option<&Tokenizer>,
    prompt: &[u32],
    opts: &GenOptions,
    shift: Option<ContextShift>,
    emit: &mut dyn FnMut(&str),
) -> Result<GenStats, GenError> {
    let room = session.context() - session.position();
    match shift {
        None => check_fits(prompt.len(), opts.n_predict, room)?,
        Some(_) => {
            if session.position() != 0 {
                return Err(GenError::Session(SessionError::Invalid(
                    "a context shift needs a generation from an empty session".into(),
                )));
            }
            check_fits(prompt.len(), None, room)?;
        }
    }
    let mut sampler = Sampler::new(opts.sampler, session.vocab())?;
    for &t in prompt {
        sampler.accept(t);
    }
    let mut stats = GenStats {
        prompt_tokens: prompt.to_vec(),
        ..Default::default()
    };
    let mut decoder = tokenizer.map(StreamDecoder::new);
    let mut stops = StopMatcher::new(opts.stop_strings.clone());
    // With a context shift: every token the cache holds.
    let mut history: Vec<u32> = match shift {
        Some(_) => prompt.to_vec(),
        None => Vec::new(),
    };
    let t0 = Instant::now();
    let mut logits = session.feed(prompt)?;
    stats.prefill = t0.elapsed();
    let t1 = Instant::now();
    let limit = opts.n_predict.unwrap_or(usize::MAX);
    loop {
        if opts.record_top {
            stats.top.push(top10(logits));
        }
        let tok = sampler.sample(logits);
        stats.generated_tokens.push(tok);
        if !opts.ignore_eos && tokenizer.is_some_and(|t| t.is_stop(tok)) {
            stats.stop_reason = Some(StopReason::Eos);
            break;
        }
        let text = match decoder.as_mut() {
            Some(d) => d.push(tok),
            None => format!(" {tok}"),
        };
        match stops.push(&text) {
            StopStatus::Continue(s) => emit(&s),
            StopStatus::Stopped(s) => {
                emit(&s);
                stats.stop_reason = Some(StopReason::StopString);
                break;
            }
        }
        if stats.generated_tokens.len() >= limit {
            stats.stop_reason = Some(StopReason::Length);
            break;
        }
        sampler.accept(tok);
        if session.position() >= session.context() {
            let Some(shift) = shift else {
                stats.stop_reason = Some(StopReason::ContextFull);
                break;
            };
            history.push(tok);
            let kept = shift.shifted(&history);
            if kept.len() >= session.context() {
                // Nothing left to drop: the kept start fills the context.
                stats.stop_reason = Some(StopReason::ContextFull);
                break;
            }
            session.reset();
            stats.shifts += 1;
            stats.dropped_tokens += history.len() - kept.len();
            history = kept;
            logits = session.feed(&history)?;
            continue;
        }
        if shift.is_some() {
            history.push(tok);
        }
        logits = session.feed(&[tok])?;
    }
    if stats.stop_reason != Some(StopReason::StopString) {
        let mut rest = decoder.as_mut().map(|d| d.flush()).unwrap_or_default();
        rest.insert_str(0, &stops.finish());
        emit(&rest);
    }
    stats.decode = t1.elapsed();
    Ok(stats)
}
