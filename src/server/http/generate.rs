//! The generation endpoints (`/v1/chat/completions`, `/v1/completions`):
//! a request's choices submitted to the engine together, answered whole or
//! streamed as server-sent events.

use super::{encode_prompt, read_body, unix_now, AppState, Loaded};
use crate::generate::chat::ContextPolicy;
use crate::generate::constraint::Constraint;
use crate::generate::sampler::TokenLogprobs;
use crate::server::api::{
    output_spec, parse_body, ApiError, ChatRequest, Checked, CompletionRequest, Prompt,
};
use crate::server::engine::{Finish, GenEvent, GenExtras, GenRequest, GenStream, SubmitError};
use crate::server::text::TextStream;
use crate::server::tools::{self, CallDetector, ToolCall, ToolChoice, ToolFormat};
use crate::tokenizer::Tokenizer;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Chat,
    Completion,
}

pub(super) async fn chat_completions(
    State(s): State<Arc<AppState>>,
    req: Request,
) -> Result<Response, ApiError> {
    let bytes = read_body(&s, req).await?;
    let l = s.loaded()?;
    let r: ChatRequest = parse_body(&bytes)?;
    let messages = r.messages()?;
    let tool_list = tools::parse_tools(r.tools.as_deref().unwrap_or(&[]))?;
    let choice = tools::parse_tool_choice(r.tool_choice.as_ref(), &tool_list)?;
    let spec = output_spec(
        r.response_format.as_ref(),
        r.json_schema.as_ref(),
        r.grammar.as_deref(),
    )?;
    let checked = r.common().check(r.max_tokens(), || s.unique())?;
    if !l.chat.available() {
        return Err(ApiError::invalid(
            "messages",
            "this model has no chat template; use /v1/completions",
        ));
    }
    let offered = if choice == ToolChoice::None {
        &[][..]
    } else {
        &tool_list[..]
    };
    let uses_tools = !tool_list.is_empty()
        || r.messages
            .iter()
            .any(|m| m.role == "tool" || m.tool_calls.as_ref().is_some_and(|c| !c.is_empty()));
    let mut output = Output::default();
    let prompt = if uses_tools {
        let Some(source) = l.chat.template_source() else {
            return Err(ApiError::invalid(
                "tools",
                "tool calling needs the model's Jinja chat template; this model has none",
            ));
        };
        let format = ToolFormat::of(Some(source));
        let (msgs, listed) = format.template_inputs(
            &r.messages_json()?,
            r.tools.as_deref().unwrap_or(&[]),
            offered,
        );
        let prompt = l
            .chat
            .tokens_json(l.tokenizer, &msgs, listed.as_ref())
            .map_err(|e| ApiError::invalid("messages", e.to_string()))?;
        if !offered.is_empty() {
            output.tools = Some(format);
            let parallel = r.parallel_tool_calls.unwrap_or(true);
            if let Some(g) = format.grammar(&tool_list, &choice, parallel) {
                if let Some((_, field)) = &spec {
                    return Err(ApiError::invalid(
                        field,
                        format!("`{field}` cannot be combined with `tools` (give `tool_choice: \"none\"` to answer in the given format)"),
                    ));
                }
                output.constraint = Some(s.constraint(&g, "tools")?);
            }
        }
        prompt
    } else {
        let prompt = l
            .chat
            .tokens(l.tokenizer, &messages)
            .map_err(|e| ApiError::invalid("messages", e.to_string()))?;
        match s.opts.context_full {
            ContextPolicy::Refuse => prompt,
            ContextPolicy::Shift => shift_messages(l, &messages, checked.max_tokens, prompt),
        }
    };
    if let Some((g, field)) = &spec {
        output.constraint = Some(s.constraint(g, field)?);
    }
    let field = r.max_tokens().map(|(_, f)| f).unwrap_or("max_tokens");
    start(&s, l, Endpoint::Chat, prompt, checked, field, output).await
}

/// With the `shift` policy: the chat's tokens with its oldest turns
/// dropped until `max_tokens` (a quarter of the context when not given)
/// fit after them. Where no dropping makes them fit, the whole prompt is
/// kept and refused later with the numbers.
fn shift_messages(
    l: &Loaded,
    messages: &[crate::generate::chat::Message],
    max_tokens: Option<usize>,
    prompt: Vec<u32>,
) -> Vec<u32> {
    let context = l.engine.limits().context;
    let reserve = max_tokens.unwrap_or(context / 4).max(1);
    if prompt.len().saturating_add(reserve) <= context {
        return prompt;
    }
    let target = context.saturating_sub(reserve);
    match l.chat.fit(
        l.tokenizer,
        messages,
        context,
        reserve,
        target,
        ContextPolicy::Shift,
    ) {
        Ok(f) => f.tokens,
        Err(_) => prompt,
    }
}

pub(super) async fn completions(
    State(s): State<Arc<AppState>>,
    req: Request,
) -> Result<Response, ApiError> {
    let bytes = read_body(&s, req).await?;
    let l = s.loaded()?;
    let r: CompletionRequest = parse_body(&bytes)?;
    r.check_extras()?;
    let spec = output_spec(
        r.response_format.as_ref(),
        r.json_schema.as_ref(),
        r.grammar.as_deref(),
    )?;
    let checked = r
        .common()
        .check(r.max_tokens.map(|n| (n, "max_tokens")), || s.unique())?;
    let encode = |text: &str| encode_prompt(l, text);
    let prompt = match &r.prompt {
        Prompt::Text(t) => encode(t),
        Prompt::Texts(v) if v.len() == 1 => encode(&v[0]),
        Prompt::Texts(v) => {
            return Err(ApiError::invalid(
                "prompt",
                format!("one prompt per request is supported, got {}", v.len()),
            ))
        }
        Prompt::Tokens(ids) => ids.clone(),
    };
    if prompt.is_empty() {
        return Err(ApiError::invalid("prompt", "the prompt is empty"));
    }
    let mut output = Output::default();
    if let Some((g, field)) = &spec {
        output.constraint = Some(s.constraint(g, field)?);
    }
    start(
        &s,
        l,
        Endpoint::Completion,
        prompt,
        checked,
        "max_tokens",
        output,
    )
    .await
}

/// What a request asks of its output beyond text: a constraint on the
/// tokens, and tool calls to parse out of the answer.
#[derive(Debug, Default)]
struct Output {
    constraint: Option<Constraint>,
    tools: Option<ToolFormat>,
}

/// Submits the request (its `n` choices together) and answers, streamed or
/// whole.
async fn start(
    s: &AppState,
    l: &Loaded,
    endpoint: Endpoint,
    prompt: Vec<u32>,
    c: Checked,
    max_field: &str,
    output: Output,
) -> Result<Response, ApiError> {
    let lim = l.engine.limits();
    let context = lim.context;
    let prompt_tokens = prompt.len();
    // The prompt alone too long: the prompt is at fault; with room left
    // for it but not for max_tokens, max_tokens is.
    let prompt_field = match endpoint {
        Endpoint::Chat => "messages",
        Endpoint::Completion => "prompt",
    };
    if prompt_tokens >= context {
        return Err(ApiError::invalid(
            prompt_field,
            format!("the prompt ({prompt_tokens} tokens) fills the context of {context} tokens"),
        )
        .with_code("context_length_exceeded"));
    }
    if let Some(&(t, _)) = c
        .penalties
        .logit_bias
        .iter()
        .find(|&&(t, _)| t as usize >= lim.vocab)
    {
        return Err(ApiError::invalid(
            "logit_bias",
            format!("token id {t} is outside the vocabulary of {}", lim.vocab),
        ));
    }
    let max_tokens = c.max_tokens.unwrap_or(context - prompt_tokens);
    let reqs: Vec<(GenRequest, GenExtras)> = (0..c.n)
        .map(|i| {
            let mut sampling = c.sampling;
            sampling.seed = sampling.seed.wrapping_add(i as u64);
            let req = GenRequest {
                prompt: prompt.clone(),
                max_tokens,
                sampling,
                stop_tokens: if c.ignore_eos {
                    Vec::new()
                } else {
                    l.tokenizer.stop_ids().to_vec()
                },
            };
            let extras = GenExtras {
                penalties: c.penalties.clone(),
                logprobs: c.logprobs,
                constraint: output.constraint.clone(),
                speculative: c.speculative,
            };
            (req, extras)
        })
        .collect();
    let gens = l.engine.submit_many(reqs).map_err(|e| match e {
        SubmitError::QueueFull { .. } => ApiError {
            retry_after: Some(1),
            ..ApiError::new(503, "unavailable_error", e.to_string()).with_code("queue_full")
        },
        SubmitError::TooLong { .. } => {
            ApiError::invalid(max_field, e.to_string()).with_code("context_length_exceeded")
        }
        SubmitError::Invalid(m) => ApiError::new(400, "invalid_request_error", m),
    })?;
    let reply = Reply {
        endpoint,
        id: s.response_id(match endpoint {
            Endpoint::Chat => "chatcmpl",
            Endpoint::Completion => "cmpl",
        }),
        created: unix_now(),
        model: l.model_id.clone(),
        prompt_tokens,
        tokenizer: l.tokenizer,
        tools: output.tools,
        call_ids: s.unique(),
    };
    let choices: Vec<Choice> = gens
        .into_iter()
        .enumerate()
        .map(|(index, gen)| Choice {
            index,
            gen: Some(gen),
            text: TextStream::new(l.tokenizer, c.stop.clone()),
            logprobs: c.logprobs.is_some(),
            received: 0,
            cached: None,
            pending: Vec::new(),
            offset: 0,
            completion_tokens: 0,
            finish: None,
            sent_role: false,
            calls: output.tools.map(CallDetector::new),
        })
        .collect();
    if c.stream {
        Ok(stream_response(
            reply,
            choices,
            c.include_usage,
            s.opts.sse_keepalive,
        ))
    } else {
        whole_response(reply, choices).await
    }
}

/// What every chunk or response of one request repeats.
struct Reply {
    endpoint: Endpoint,
    id: String,
    created: u64,
    model: String,
    prompt_tokens: usize,
    tokenizer: &'static Tokenizer,
    /// Tool calls are parsed out of the answer in this format.
    tools: Option<ToolFormat>,
    /// Makes the calls' ids unique.
    call_ids: u64,
}

fn finish_name(f: Finish) -> &'static str {
    match f {
        Finish::Stop => "stop",
        Finish::Length => "length",
        Finish::Cancelled => "cancelled",
    }
}

/// One choice of a request: its sequence, its text so far and the
/// logprobs not yet sent.
struct Choice {
    index: usize,
    /// `None` once the sequence has ended (or was finished early).
    gen: Option<GenStream>,
    text: TextStream<'static>,
    logprobs: bool,
    received: usize,
    /// Prompt positions the sequence took from the prefix cache or another
    /// sequence, read at its first event (its first token, or its end when
    /// that token was a stop token).
    cached: Option<usize>,
    /// Logprobs of tokens received but not yet sent.
    pending: Vec<TokenLogprobs>,
    /// Characters of the choice's text begun before the pending tokens
    /// (completions' `text_offset`).
    offset: usize,
    completion_tokens: usize,
    finish: Option<&'static str>,
    sent_role: bool,
    /// With tools offered: holds back an answer that may be a call.
    calls: Option<CallDetector>,
}

/// What one event of a choice's stream gave.
enum Step {
    /// Text to send (possibly empty).
    Text(String),
    /// The choice ended: the rest of its text.
    End(String),
    Failed(String),
}

impl Choice {
    /// Applies one event of the choice's stream.
    fn apply(&mut self, ev: Option<GenEvent>) -> Step {
        if self.cached.is_none() {
            // The engine stores it when it samples the first token, before
            // that token's event or the end it causes is sent.
            self.cached = self.gen.as_ref().map(GenStream::cached_tokens);
        }
        match ev {
            Some(GenEvent::Token(t)) => {
                self.received += 1;
                if self.logprobs {
                    if let Some(lp) = self.gen.as_mut().and_then(|g| g.take_logprobs()) {
                        self.pending.push(lp);
                    }
                }
                let (piece, stopped) = self.text.push(t);
                if stopped {
                    // The client has its answer: the sequence ends as a
                    // normal finish and its KV stays in the prefix cache.
                    if let Some(g) = self.gen.take() {
                        g.finish();
                    }
                    self.completion_tokens = self.received;
                    self.finish = Some("stop");
                    return Step::End(piece);
                }
                Step::Text(piece)
            }
            Some(GenEvent::Done {
                finish: finish @ (Finish::Stop | Finish::Length),
                completion_tokens,
                ..
            }) => {
                let (rest, stopped) = self.text.finish();
                self.completion_tokens = completion_tokens;
                self.finish = Some(if stopped { "stop" } else { finish_name(finish) });
                Step::End(rest)
            }
            Some(GenEvent::Done { .. }) => Step::Failed("the sequence was cancelled".into()),
            Some(GenEvent::Error(m)) => Step::Failed(m),
            None => Step::Failed("the engine stopped".into()),
        }
    }

    /// The prompt's cached tokens for `usage`: the first choice's (the
    /// later ones take the prompt from it, which is not the cache's doing).
    fn usage_cached(choices: &[Choice]) -> usize {
        choices.first().and_then(|c| c.cached).unwrap_or(0)
    }
}

/// A token's text for logprobs: its bytes, as text where they are UTF-8.
fn token_text(tok: &Tokenizer, id: u32) -> (String, Vec<u8>) {
    let b = tok.token_bytes(id).unwrap_or(&[]).to_vec();
    (String::from_utf8_lossy(&b).into_owned(), b)
}

/// A logprob as JSON (a banned token's minus infinity as a finite floor,
/// which JSON can carry).
fn lp_value(x: f32) -> Value {
    json!(if x.is_finite() { x } else { -9999.0 })
}

impl Reply {
    fn usage(&self, completion: usize, cached: usize) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        })
    }

    /// The `logprobs` object of `lps`: chat's `{content: [...]}`, or
    /// completions' `{tokens, token_logprobs, top_logprobs, text_offset}`.
    /// `text_offset` is OpenAI's: each token's offset in characters (code
    /// points, as Python counts them) into the choice's text, the first
    /// token at 0 (echo, which would count the prompt, is refused), going
    /// on across stream chunks from `offset` (the characters begun so
    /// far). A token that starts inside a character split between tokens
    /// is at that character's offset.
    fn logprobs(&self, lps: &[TokenLogprobs], offset: &mut usize) -> Value {
        let tok = self.tokenizer;
        match self.endpoint {
            Endpoint::Chat => {
                let content: Vec<Value> = lps
                    .iter()
                    .map(|lp| {
                        let (text, bytes) = token_text(tok, lp.token);
                        let top: Vec<Value> = lp
                            .top
                            .iter()
                            .map(|&(id, v)| {
                                let (t, b) = token_text(tok, id);
                                json!({"token": t, "logprob": lp_value(v), "bytes": b})
                            })
                            .collect();
                        json!({"token": text, "logprob": lp_value(lp.logprob), "bytes": bytes, "top_logprobs": top})
                    })
                    .collect();
                json!({"content": content, "refusal": null})
            }
            Endpoint::Completion => {
                let mut tokens = Vec::with_capacity(lps.len());
                let mut values = Vec::with_capacity(lps.len());
                let mut tops = Vec::with_capacity(lps.len());
                let mut offsets = Vec::with_capacity(lps.len());
                for lp in lps {
                    let (text, bytes) = token_text(tok, lp.token);
                    let continues = |b: &u8| (0x80..0xc0).contains(b);
                    let inside = bytes.first().is_some_and(continues);
                    offsets.push(offset.saturating_sub(usize::from(inside)));
                    *offset += bytes.iter().filter(|b| !continues(b)).count();
                    tokens.push(Value::from(text));
                    values.push(lp_value(lp.logprob));
                    let mut top = serde_json::Map::new();
                    for &(id, v) in &lp.top {
                        top.insert(token_text(tok, id).0, lp_value(v));
                    }
                    tops.push(Value::Object(top));
                }
                json!({"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets})
            }
        }
    }

    fn choice_logprobs(&self, c: &mut Choice) -> Value {
        if !c.logprobs {
            return Value::Null;
        }
        let lps = std::mem::take(&mut c.pending);
        self.logprobs(&lps, &mut c.offset)
    }

    fn whole(&self, choices: Vec<Value>, completion: usize, cached: usize) -> Value {
        let object = match self.endpoint {
            Endpoint::Chat => "chat.completion",
            Endpoint::Completion => "text_completion",
        };
        json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(completion, cached),
        })
    }

    fn call_id(&self, choice: usize, i: usize) -> String {
        format!("call_{:016x}{i}", self.call_ids.wrapping_add(choice as u64))
    }

    /// The SSE events of choice `choice`'s streamed tool calls: per call
    /// its id and name, then its arguments in pieces (the client joins
    /// them).
    fn call_chunks(&self, choice: usize, calls: &[ToolCall], usage_null: bool) -> String {
        let mut out = String::new();
        let mut event = |delta: Value| {
            let mut v = json!({
                "id": self.id,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.model,
                "choices": [{"index": choice, "delta": delta, "finish_reason": null, "logprobs": null}],
            });
            if usage_null {
                v["usage"] = Value::Null;
            }
            out.push_str(&format!("data: {v}\n\n"));
        };
        for (i, c) in calls.iter().enumerate() {
            event(json!({"tool_calls": [{
                "index": i,
                "id": self.call_id(choice, i),
                "type": "function",
                "function": {"name": c.name, "arguments": ""},
            }]}));
            let args: Vec<char> = c.arguments.chars().collect();
            for piece in args.chunks(16) {
                let piece: String = piece.iter().collect();
                event(json!({"tool_calls": [{"index": i, "function": {"arguments": piece}}]}));
            }
        }
        out
    }

    /// A whole choice: text, or tool calls when the request offered tools
    /// and the answer is a complete call (even when `max_tokens` ended it).
    fn whole_choice(&self, c: &mut Choice, text: String) -> Value {
        if let (Endpoint::Chat, Some(f)) = (self.endpoint, self.tools) {
            if let Some((content, calls)) = f.parse(&text) {
                let calls: Vec<Value> = calls
                    .iter()
                    .enumerate()
                    .map(|(i, call)| {
                        json!({
                            "id": self.call_id(c.index, i),
                            "type": "function",
                            "function": {"name": call.name, "arguments": call.arguments},
                        })
                    })
                    .collect();
                let content = if content.is_empty() {
                    Value::Null
                } else {
                    Value::String(content)
                };
                let logprobs = self.choice_logprobs(c);
                return json!({
                    "index": c.index,
                    "message": {"role": "assistant", "content": content, "tool_calls": calls},
                    "finish_reason": "tool_calls",
                    "logprobs": logprobs,
                });
            }
        }
        let logprobs = self.choice_logprobs(c);
        match self.endpoint {
            Endpoint::Chat => json!({
                "index": c.index,
                "message": {"role": "assistant", "content": text},
                "finish_reason": c.finish,
                "logprobs": logprobs,
            }),
            Endpoint::Completion => json!({
                "index": c.index,
                "text": text,
                "finish_reason": c.finish,
                "logprobs": logprobs,
            }),
        }
    }

    /// One SSE event with a choice: a role (chat's first chunk), text and
    /// its tokens' logprobs, or the finish reason.
    fn chunk(
        &self,
        c: &mut Choice,
        text: Option<&str>,
        finish: Option<&str>,
        usage_null: bool,
    ) -> String {
        let role = !c.sent_role && self.endpoint == Endpoint::Chat;
        c.sent_role = true;
        let logprobs = if text.is_some() || finish.is_some() {
            self.choice_logprobs(c)
        } else {
            Value::Null
        };
        let mut v = match self.endpoint {
            Endpoint::Chat => {
                let mut delta = serde_json::Map::new();
                if role {
                    delta.insert("role".into(), "assistant".into());
                    delta.insert("content".into(), "".into());
                }
                if let Some(t) = text {
                    delta.insert("content".into(), t.into());
                }
                json!({
                    "id": self.id,
                    "object": "chat.completion.chunk",
                    "created": self.created,
                    "model": self.model,
                    "choices": [{"index": c.index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}],
                })
            }
            Endpoint::Completion => json!({
                "id": self.id,
                "object": "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [{"index": c.index, "text": text.unwrap_or(""), "finish_reason": finish, "logprobs": logprobs}],
            }),
        };
        if usage_null {
            v["usage"] = Value::Null;
        }
        format!("data: {v}\n\n")
    }

    fn usage_chunk(&self, completion: usize, cached: usize) -> String {
        let object = match self.endpoint {
            Endpoint::Chat => "chat.completion.chunk",
            Endpoint::Completion => "text_completion",
        };
        let v = json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": self.usage(completion, cached),
        });
        format!("data: {v}\n\n")
    }
}

fn generation_failed(m: &str) -> ApiError {
    ApiError::new(500, "server_error", format!("generation failed: {m}"))
}

async fn whole_response(reply: Reply, mut choices: Vec<Choice>) -> Result<Response, ApiError> {
    // Every choice's sequence runs at once in the engine; their events
    // wait in their channels while an earlier choice is read.
    let mut out = Vec::with_capacity(choices.len());
    for c in &mut choices {
        let mut text = String::new();
        loop {
            let ev = match c.gen.as_mut() {
                Some(g) => g.next().await,
                None => None,
            };
            match c.apply(ev) {
                Step::Text(t) => text.push_str(&t),
                Step::End(t) => {
                    text.push_str(&t);
                    break;
                }
                Step::Failed(m) => return Err(generation_failed(&m)),
            }
        }
        out.push(reply.whole_choice(c, text));
    }
    let completion = choices.iter().map(|c| c.completion_tokens).sum();
    let v = reply.whole(out, completion, Choice::usage_cached(&choices));
    Ok(axum::Json(v).into_response())
}

/// A streaming response's state; the body stream owns it, so a client
/// that disconnects drops the [`GenStream`]s with it.
struct Streamer {
    reply: Reply,
    choices: Vec<Choice>,
    include_usage: bool,
    keepalive: Duration,
    /// Where the next poll starts, so that no choice starves the others.
    turn: usize,
    started: bool,
    done: bool,
}

impl Streamer {
    /// The final events once every choice has ended: usage when asked
    /// for, then `[DONE]`.
    fn closing(&mut self) -> String {
        self.done = true;
        let mut out = String::new();
        if self.include_usage {
            let completion = self.choices.iter().map(|c| c.completion_tokens).sum();
            out.push_str(
                &self
                    .reply
                    .usage_chunk(completion, Choice::usage_cached(&self.choices)),
            );
        }
        out.push_str("data: [DONE]\n\n");
        out
    }

    fn error(&mut self, m: &str) -> Bytes {
        self.done = true;
        for c in &mut self.choices {
            c.gen = None;
        }
        let e = generation_failed(m);
        Bytes::from(format!("data: {}\n\ndata: [DONE]\n\n", e.body()))
    }

    /// The next event of any running choice, or `None` on a keep-alive
    /// timeout.
    async fn next_event(&mut self) -> Option<(usize, Option<GenEvent>)> {
        let n = self.choices.len();
        let turn = self.turn;
        let choices = &mut self.choices;
        let ev = futures_util::future::poll_fn(|cx| {
            for k in 0..n {
                let i = (turn + k) % n;
                if let Some(g) = choices[i].gen.as_mut() {
                    if let std::task::Poll::Ready(ev) = g.poll_next(cx) {
                        return std::task::Poll::Ready((i, ev));
                    }
                }
            }
            std::task::Poll::Pending
        });
        let r = tokio::time::timeout(self.keepalive, ev).await.ok();
        self.turn = (turn + 1) % n.max(1);
        r
    }

    /// The next piece of the body; `None` at the end.
    async fn next(&mut self) -> Option<Bytes> {
        if self.done {
            return None;
        }
        let usage_null = self.include_usage;
        if !self.started {
            self.started = true;
            if self.reply.endpoint == Endpoint::Chat {
                let mut out = String::new();
                for c in &mut self.choices {
                    out.push_str(&self.reply.chunk(c, None, None, usage_null));
                }
                return Some(Bytes::from(out));
            }
        }
        loop {
            if self.choices.iter().all(|c| c.finish.is_some()) {
                return Some(Bytes::from(self.closing()));
            }
            let Some((i, ev)) = self.next_event().await else {
                // Nothing for a while (a long prefill): an SSE comment,
                // which clients skip, keeps the connection alive.
                return Some(Bytes::from_static(b": keep-alive\n\n"));
            };
            let step = self.choices[i].apply(ev);
            let reply = &self.reply;
            let c = &mut self.choices[i];
            match step {
                Step::Text(t) => {
                    let t = match c.calls.as_mut() {
                        Some(d) => d.push(&t),
                        None => t,
                    };
                    if t.is_empty() {
                        continue;
                    }
                    return Some(Bytes::from(reply.chunk(c, Some(&t), None, usage_null)));
                }
                Step::End(rest) => {
                    c.gen = None;
                    let mut out = String::new();
                    let mut rest = rest;
                    let mut calls = String::new();
                    if let Some(mut d) = c.calls.take() {
                        let mut text = d.push(&rest);
                        match d.finish() {
                            Ok((content, found)) => {
                                text.push_str(&content);
                                calls = reply.call_chunks(c.index, &found, usage_null);
                                c.finish = Some("tool_calls");
                            }
                            Err(held) => text.push_str(&held),
                        }
                        rest = text;
                    }
                    if !rest.is_empty() {
                        out.push_str(&reply.chunk(c, Some(&rest), None, usage_null));
                    }
                    out.push_str(&calls);
                    let finish = c.finish;
                    out.push_str(&reply.chunk(c, None, finish, usage_null));
                    if self.choices.iter().all(|c| c.finish.is_some()) {
                        out.push_str(&self.closing());
                    }
                    return Some(Bytes::from(out));
                }
                Step::Failed(m) => return Some(self.error(&m)),
            }
        }
    }
}

fn stream_response(
    reply: Reply,
    choices: Vec<Choice>,
    include_usage: bool,
    keepalive: Duration,
) -> Response {
    let st = Streamer {
        reply,
        choices,
        include_usage,
        keepalive: keepalive.max(Duration::from_millis(1)),
        turn: 0,
        started: false,
        done: false,
    };
    let body = futures_util::stream::unfold(st, |mut st| async move {
        st.next()
            .await
            .map(|b| (Ok::<Bytes, std::convert::Infallible>(b), st))
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(body))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}
