//! The prefill/decode loop: feed the prompt, then sample, stream and stop.

use super::sampler::{Sampler, SamplerConfig, SamplerError};
use super::stop::{StopMatcher, StopStatus};
use crate::session::{Session, SessionError};
use crate::tokenizer::{StreamDecoder, Tokenizer};
use serde::Serialize;
use std::time::{Duration, Instant};
use thiserror::Error;

/// What [`generate`] does.
#[derive(Debug, Clone)]
pub struct GenOptions {
    /// Tokens to generate at most; `None` = until the context is full.
    pub n_predict: Option<usize>,
    /// How to pick each token.
    pub sampler: SamplerConfig,
    /// Strings that end the generation when they appear in the text (the
    /// text before them is emitted, they are not).
    pub stop_strings: Vec<String>,
    /// Record the top-10 logits of every step (for `--logits-out`).
    pub record_top: bool,
    /// Keep generating past end-of-sequence / end-of-turn tokens: they are
    /// sampled and decoded like any other, as the server's `ignore_eos`
    /// does (llama.cpp's `--ignore-eos` instead never samples them).
    pub ignore_eos: bool,
}

/// Why a generation ended.
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

/// Why a generation could not run.
#[derive(Debug, Error)]
pub enum GenError {
    /// The session failed a step.
    #[error(transparent)]
    Session(#[from] SessionError),
    /// A sampling parameter is out of range.
    #[error(transparent)]
    Sampler(#[from] SamplerError),
    /// There is nothing to feed.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// The prompt and the tokens asked for do not fit what is left of the
    /// context; refused before any work.
    #[error("the prompt ({prompt} tokens) plus {requested} tokens to generate exceed the planned context of {context} tokens; use a larger --ctx-size or a smaller -n")]
    ContextOverflow {
        /// Prompt tokens.
        prompt: usize,
        /// Tokens to generate.
        requested: usize,
        /// Positions left in the session's context.
        context: usize,
    },
}

/// What a generation did, with timings.
#[derive(Debug, Clone, Default)]
pub struct GenStats {
    /// The prompt as fed.
    pub prompt_tokens: Vec<u32>,
    /// Every sampled token, a final end-of-sequence token included.
    pub generated_tokens: Vec<u32>,
    /// Time to feed the prompt (up to the first logits).
    pub prefill: Duration,
    /// Time from the first sampled token to the end.
    pub decode: Duration,
    /// Why it ended (`None` only while it runs).
    pub stop_reason: Option<StopReason>,
    /// Per step (step 0 = last prompt position), the ten best (id, logit).
    pub top: Vec<Vec<(u32, f32)>>,
}

impl GenStats {
    /// Prompt tokens per second of prefill.
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

/// Runs one generation from the session's current position: feeds
/// `prompt`, then samples until a stop condition, calling `emit` with each
/// piece of text as soon as it is complete (never a broken UTF-8 character,
/// never part of a stop string). Without a tokenizer, `emit` gets the ids
/// as text (" 42").
///
/// ```no_run
/// use llama_graph::generate::{generate, GenOptions, SamplerConfig};
/// use llama_graph::session::{Model, Session, SessionOptions};
/// use llama_graph::tokenizer::EncodeOptions;
///
/// let model = Model::open("model.gguf".as_ref())?;
/// let tok = model.tokenizer.as_ref().expect("a GGUF file has one");
/// let mut session = Session::new(&model, &SessionOptions::default())?;
/// let prompt = tok.encode("Once upon a time", EncodeOptions { add_bos: true, parse_special: false });
/// let opts = GenOptions {
///     n_predict: Some(32),
///     sampler: SamplerConfig { temperature: 0.0, ..Default::default() },
///     stop_strings: vec!["\n\n".into()],
///     record_top: false,
///     ignore_eos: false,
/// };
/// let stats = generate(&mut session, Some(tok), &prompt, &opts, &mut |piece| print!("{piece}"))?;
/// eprintln!("{:.1} tokens/s, {:?}", stats.decode_tokens_per_s(), stats.stop_reason);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn generate(
    session: &mut Session,
    tokenizer: Option<&Tokenizer>,
    prompt: &[u32],
    opts: &GenOptions,
    emit: &mut dyn FnMut(&str),
) -> Result<GenStats, GenError> {
    let room = session.context() - session.position();
    check_fits(prompt.len(), opts.n_predict, room)?;
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
        if session.position() >= session.context() {
            stats.stop_reason = Some(StopReason::ContextFull);
            break;
        }
        sampler.accept(tok);
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
