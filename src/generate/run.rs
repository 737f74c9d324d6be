//! The prefill/decode loop: feed the prompt, then sample, stream and stop.

use super::constraint::{Constraint, ConstraintError};
use super::sampler::{Sampler, SamplerConfig, SamplerError};
use super::spec::{Adapt, Drafter, SpecConfig, SpecStats};
use super::stop::{StopMatcher, StopStatus};
use crate::exec::Logits;
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
    /// Record the top-10 logits of every step and their log-sum-exp (for
    /// `--logits-out`).
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
    /// The output constraint failed (see [`super::constraint`]).
    #[error(transparent)]
    Constraint(#[from] ConstraintError),
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
    /// Per step, `log(sum(exp(logits)))`: a logit minus it is the token's
    /// log-probability (what the server's `logprobs` report).
    pub logsumexp: Vec<f32>,
    /// What speculation did, when it was on.
    pub spec: Option<SpecStats>,
    /// Time spent choosing tokens under an output constraint (the mask,
    /// the sampling among the allowed tokens, advancing the grammar), part
    /// of `decode`.
    pub constrained_sampling: Duration,
    /// Context shifts done ([`generate_shifting`]).
    pub shifts: usize,
    /// Tokens the context shifts dropped.
    pub dropped_tokens: usize,
}

impl GenStats {
    /// Prompt tokens per second of prefill.
    pub fn prefill_tokens_per_s(&self) -> f64 {
        self.prompt_tokens.len() as f64 / self.prefill.as_secs_f64().max(1e-9)
    }
    /// Decode speed: every generated token after the first costs one
    /// decode step (of a plain run; speculation makes fewer, longer ones).
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
    generate_with(session, None, tokenizer, prompt, opts, emit)
}

/// A drafter and how to use it, for [`generate_with`].
pub struct Speculation<'a> {
    /// What guesses the next tokens.
    pub drafter: &'a mut Drafter,
    /// How many guesses, and whether their number adapts.
    pub config: SpecConfig,
    /// The tokens already in the session before the prompt (a chat's
    /// earlier turns), which the drafter reads too.
    pub before: &'a [u32],
}

/// [`generate`], speculatively when `spec` is given: each step feeds the
/// token sampled last and the drafter's guesses after it, and the tokens
/// are sampled from the step's rows exactly as a plain run samples them
/// (see [`super::spec`]): the output is the plain run's, token for token.
/// The session must be compiled with `LogitRows::Tail { max }` (up to
/// `max - 1` guesses per step) for any guess to be verified.
pub fn generate_with(
    session: &mut Session,
    spec: Option<Speculation<'_>>,
    tokenizer: Option<&Tokenizer>,
    prompt: &[u32],
    opts: &GenOptions,
    emit: &mut dyn FnMut(&str),
) -> Result<GenStats, GenError> {
    generate_constrained(session, spec, None, tokenizer, prompt, opts, emit)
}

/// [`generate_with`], every token chosen among those `constraint` allows
/// (structured output; see [`super::constraint`]). Each sampled token
/// advances the grammar; with speculation, only sampled tokens do (a
/// guess is verified against the token sampled under the mask).
pub fn generate_constrained(
    session: &mut Session,
    mut spec: Option<Speculation<'_>>,
    mut constraint: Option<&mut Constraint>,
    tokenizer: Option<&Tokenizer>,
    prompt: &[u32],
    opts: &GenOptions,
    emit: &mut dyn FnMut(&str),
) -> Result<GenStats, GenError> {
    let context = session.context();
    let room = context - session.position();
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
    let limit = opts.n_predict.unwrap_or(usize::MAX);
    // The tokens of the sequence so far (what a drafter reads).
    let mut history: Vec<u32> = Vec::new();
    let mut spec_stats = SpecStats::default();
    let mut adapt = Adapt::default();
    let mut drafts: Vec<u32> = Vec::new();
    // Guesses verified per step: what the session's logit rows allow.
    let max_drafts = session
        .exec()
        .max_logit_rows()
        .min(session.exec().max_chunk())
        .saturating_sub(1);
    if let Some(sp) = spec.as_mut() {
        history.extend_from_slice(sp.before);
        history.extend_from_slice(prompt);
        sp.drafter.prefill(&history)?;
    }
    // What the next step feeds: the prompt, then the token sampled last
    // followed by the guesses in `drafts`.
    let mut fed: Vec<u32> = prompt.to_vec();
    let mut first = true;
    let trace = spec.is_some() && std::env::var_os("LLAMA_GRAPH_SPEC_TRACE").is_some();
    loop {
        let pos = session.position();
        let ts = Instant::now();
        let rows = if drafts.is_empty() {
            let l = session.feed(&fed)?;
            Logits {
                rows: 1,
                vocab: l.len(),
                data: l,
            }
        } else {
            session.feed_rows(&fed, drafts.len() + 1)?
        };
        let step_secs = ts.elapsed().as_secs_f64();
        if first {
            stats.prefill = t0.elapsed();
        }
        // Row `i` follows `fed[fed.len() - rows + i]`; a plain run has fed
        // the tokens up to that one when it samples from the row.
        let base = pos + fed.len() - rows.rows;
        let mut kept = rows.rows;
        let mut next = None;
        for i in 0..rows.rows {
            let logits = rows.row(i);
            if opts.record_top {
                stats.top.push(top10(logits));
                stats.logsumexp.push(super::sampler::log_sum_exp(logits));
            }
            let tok = match constraint.as_deref_mut() {
                Some(c) => {
                    let t = Instant::now();
                    let tok = c.sample(&mut sampler, logits)?;
                    stats.constrained_sampling += t.elapsed();
                    tok
                }
                None => sampler.sample(logits),
            };
            stats.generated_tokens.push(tok);
            if !opts.ignore_eos && tokenizer.is_some_and(|t| t.is_stop(tok)) {
                stats.stop_reason = Some(StopReason::Eos);
            } else {
                let text = match decoder.as_mut() {
                    Some(d) => d.push(tok),
                    None => format!(" {tok}"),
                };
                match stops.push(&text) {
                    StopStatus::Continue(s) => emit(&s),
                    StopStatus::Stopped(s) => {
                        emit(&s);
                        stats.stop_reason = Some(StopReason::StopString);
                    }
                }
            }
            if stats.stop_reason.is_none() && stats.generated_tokens.len() >= limit {
                stats.stop_reason = Some(StopReason::Length);
            }
            if stats.stop_reason.is_none() && base + i + 1 >= context {
                stats.stop_reason = Some(StopReason::ContextFull);
            }
            if stats.stop_reason.is_some() {
                kept = i + 1;
                break;
            }
            sampler.accept(tok);
            if spec.is_some() {
                history.push(tok);
            }
            // The next row was computed on guess `i`: it is the plain
            // run's next row only if the guess is the token drawn.
            if i + 1 < rows.rows && fed[fed.len() - rows.rows + i + 1] == tok {
                continue;
            }
            kept = i + 1;
            next = Some(tok);
            break;
        }
        let n_drafts = rows.rows - 1;
        if !first {
            adapt.step_time(fed.len(), step_secs);
            if n_drafts == 0 {
                spec_stats.plain_steps += 1;
            } else {
                spec_stats.verify_steps += 1;
                spec_stats.drafted += n_drafts;
                spec_stats.accepted += kept - 1;
                spec_stats.steps.push((pos, fed.len(), kept));
                adapt.verified(n_drafts, kept - 1);
            }
            if trace {
                eprintln!(
                    "spec: pos {pos} fed {} kept {kept} step {:.3} ms | {}",
                    fed.len(),
                    step_secs * 1e3,
                    adapt.summary()
                );
            }
        }
        // Roll back the positions computed on rejected guesses.
        if kept < rows.rows && session.rewind(base + kept) != base + kept {
            // A window layer's ring spans a step's guesses (see
            // `exec::batch::WindowRing`), so this cannot happen.
            return Err(SessionError::Invalid(format!(
                "rolling back rejected guesses to position {} lost the window layers' positions",
                base + kept
            ))
            .into());
        }
        first = false;
        let Some(tok) = next else {
            break;
        };
        fed.clear();
        fed.push(tok);
        drafts.clear();
        if let Some(sp) = spec.as_mut() {
            // Guesses beyond what may still be emitted or what fits the
            // context are never made.
            let left = limit.saturating_sub(stats.generated_tokens.len());
            let fits = context.saturating_sub(session.position() + 1);
            let k = adapt.choose_for(
                &sp.config,
                max_drafts.min(left.saturating_sub(1)).min(fits),
                sp.drafter,
                &history,
            );
            if k > 0 {
                // A draft model first catches up with the tokens sampled
                // since its last guess (bounded, see `spec::MAX_CATCH_UP`);
                // see `Adapt::draft_times` for how that time is weighed.
                let tc = Instant::now();
                let fed_tokens = sp.drafter.prefill(&history)?;
                let caught_up = tc.elapsed();
                let td = Instant::now();
                sp.drafter.draft(&history, k, &mut drafts)?;
                let secs = td.elapsed();
                spec_stats.draft_time += caught_up + secs;
                if sp.drafter.is_model() {
                    adapt.draft_times(
                        drafts.len(),
                        fed_tokens,
                        caught_up.as_secs_f64(),
                        secs.as_secs_f64(),
                    );
                }
                if trace {
                    eprintln!(
                        "spec: draft k {k} got {} caught up {fed_tokens} in {:.3} ms, drafted in {:.3} ms",
                        drafts.len(),
                        caught_up.as_secs_f64() * 1e3,
                        secs.as_secs_f64() * 1e3
                    );
                }
                if drafts.len() < sp.config.draft_min.max(1) {
                    drafts.clear();
                }
                fed.extend_from_slice(&drafts);
            }
        }
    }
    if stats.stop_reason != Some(StopReason::StopString) {
        let mut rest = decoder.as_mut().map(|d| d.flush()).unwrap_or_default();
        rest.insert_str(0, &stops.finish());
        emit(&rest);
    }
    stats.decode = t0.elapsed() - stats.prefill;
    if spec.is_some() {
        stats.spec = Some(spec_stats);
    }
    Ok(stats)
}

/// [`generate_constrained`] with a context that fills up not ending the
/// generation (`run --context-full shift`): when the context is full, the
/// oldest half of the tokens after `shift.keep` are dropped, the session
/// is reset and the rest is fed again as the next prompt (llama.cpp's
/// context shift, re-feeding instead of re-rotating the cache), as many
/// times as it takes. `opts.n_predict` may then exceed the context (`None`:
/// until an end-of-sequence token or a stop string); the prompt itself
/// must still fit. The session must start empty, so that the prompt and
/// the generated tokens are all it holds.
///
/// Each stretch between shifts is one [`generate_constrained`] call: a
/// stop string that straddles a shift is not seen, the repetition
/// penalties restart from the kept tokens, and the sampler's seed is moved
/// on by the number of shifts (so a random stream does not repeat).
#[allow(clippy::too_many_arguments)]
pub fn generate_shifting(
    session: &mut Session,
    mut spec: Option<Speculation<'_>>,
    mut constraint: Option<&mut Constraint>,
    tokenizer: Option<&Tokenizer>,
    prompt: &[u32],
    opts: &GenOptions,
    shift: ContextShift,
    emit: &mut dyn FnMut(&str),
) -> Result<GenStats, GenError> {
    if session.position() != 0 || spec.as_ref().is_some_and(|s| !s.before.is_empty()) {
        return Err(GenError::Session(SessionError::Invalid(
            "a context shift needs a generation from an empty session".into(),
        )));
    }
    let context = session.context();
    check_fits(prompt.len(), None, context)?;
    let mut total = GenStats {
        prompt_tokens: prompt.to_vec(),
        ..Default::default()
    };
    // Every token the cache holds, then the next stretch's prompt.
    let mut history = prompt.to_vec();
    loop {
        let left = opts
            .n_predict
            .map_or(usize::MAX, |n| n - total.generated_tokens.len());
        let room = context - history.len();
        let mut o = opts.clone();
        // Until the context is full (that generation samples `room + 1`
        // tokens: the last from the last position), or the rest.
        o.n_predict = (left <= room).then_some(left);
        o.sampler.seed = opts
            .sampler
            .seed
            .wrapping_add((total.shifts as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let sp = spec.as_mut().map(|s| Speculation {
            drafter: &mut *s.drafter,
            config: s.config,
            before: &[],
        });
        let g = generate_constrained(
            session,
            sp,
            constraint.as_deref_mut(),
            tokenizer,
            &history,
            &o,
            emit,
        )?;
        if total.shifts == 0 {
            total.prefill = g.prefill;
            total.decode = g.decode;
        } else {
            // Re-feeding the kept tokens is part of decoding.
            total.decode += g.prefill + g.decode;
        }
        total
            .generated_tokens
            .extend_from_slice(&g.generated_tokens);
        history.extend_from_slice(&g.generated_tokens);
        total.top.extend(g.top);
        total.logsumexp.extend(g.logsumexp);
        total.constrained_sampling += g.constrained_sampling;
        if let Some(s) = g.spec {
            let t = total.spec.get_or_insert_with(SpecStats::default);
            t.drafted += s.drafted;
            t.accepted += s.accepted;
            t.verify_steps += s.verify_steps;
            t.plain_steps += s.plain_steps;
            t.steps.extend(s.steps);
            t.draft_time += s.draft_time;
        }
        total.stop_reason = g.stop_reason;
        if g.stop_reason != Some(StopReason::ContextFull)
            || opts.n_predict == Some(total.generated_tokens.len())
        {
            if total.stop_reason == Some(StopReason::ContextFull) {
                total.stop_reason = Some(StopReason::Length);
            }
            return Ok(total);
        }
        // The last sampled token was not fed: it stays as the newest.
        let kept = shift.shifted(&history);
        if kept.len() >= context {
            // Nothing left to drop: the kept start fills the context.
            return Ok(total);
        }
        total.shifts += 1;
        total.dropped_tokens += history.len() - kept.len();
        history = kept;
        session.reset();
    }
}
