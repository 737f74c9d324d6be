//! The HTTP side: routes, the OpenAI endpoints, authentication, limits and
//! the connection loop.
//!
//! Every request is bounded: the connection count, the time to send the
//! headers (hyper's header read timeout, which also closes idle keep-alive
//! connections) and the body (size and time), the engine's queue. A
//! streaming response owns its [`GenStream`]; when the client goes away
//! hyper drops the response body, which drops the stream and cancels the
//! sequence.

use super::api::{parse_body, ApiError, ChatRequest, Checked, CompletionRequest, Prompt};
use super::engine::{EngineHandle, Finish, GenEvent, GenRequest, GenStream, SubmitError};
use super::text::TextStream;
use crate::generate::chat::{ChatFormat, ContextPolicy};
use crate::generate::sampler::Rng;
use crate::tokenizer::{EncodeOptions, Tokenizer};
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// What the HTTP layer is configured with.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// When set, every route but `/health` wants `Authorization: Bearer KEY`.
    pub api_key: Option<String>,
    /// Largest request body, in bytes (413 beyond).
    pub max_body_bytes: usize,
    /// Time a client has to send a request's headers, and then its body.
    pub read_timeout: Duration,
    /// Connections served at once; further ones wait to be accepted.
    pub max_connections: usize,
    /// A chat whose messages leave too little of the context for the
    /// reply: `Shift` drops its oldest turns after the system messages
    /// (see [`ChatFormat::fit`]), `Refuse` answers 400 with the numbers.
    pub context_full: ContextPolicy,
}

/// The model, once loaded: the engine plus what turns text into ids and back.
pub struct Loaded {
    pub engine: EngineHandle,
    /// Lives as long as the process (a server serves one model).
    pub tokenizer: &'static Tokenizer,
    pub chat: ChatFormat,
    /// The model's name in responses and `/v1/models`.
    pub model_id: String,
}

/// Shared by every request.
pub struct AppState {
    opts: ServerOptions,
    loaded: OnceLock<Loaded>,
    created: u64,
    counter: AtomicU64,
    responses: Mutex<BTreeMap<u16, u64>>,
}

impl AppState {
    pub fn new(opts: ServerOptions) -> Arc<AppState> {
        Arc::new(AppState {
            opts,
            loaded: OnceLock::new(),
            created: unix_now(),
            counter: AtomicU64::new(0),
            responses: Mutex::new(BTreeMap::new()),
        })
    }

    /// Marks the model loaded: `/health` turns 200 and the endpoints serve.
    pub fn set_loaded(&self, l: Loaded) {
        let _ = self.loaded.set(l);
    }

    fn loaded(&self) -> Result<&Loaded, ApiError> {
        self.loaded.get().ok_or_else(loading)
    }

    /// A value no other request of this process gets.
    fn unique(&self) -> u64 {
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        let t = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        Rng::new(t ^ n.rotate_left(32)).next_u64()
    }

    fn response_id(&self, prefix: &str) -> String {
        format!("{prefix}-{:016x}", self.unique())
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn loading() -> ApiError {
    ApiError::new(503, "unavailable_error", "the model is still loading").with_code("loading")
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut r = (status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        r
    }
}

/// The router with every route.
pub fn router(state: Arc<AppState>) -> Router {
    let protected = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/models", get(models))
        .route("/metrics", get(metrics))
        .route_layer(middleware::from_fn_with_state(state.clone(), authenticate));
    Router::new()
        .route("/health", get(health))
        .route("/v1/health", get(health))
        .merge(protected)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(
            state.clone(),
            count_responses,
        ))
        .with_state(state)
}

/// Accepts connections on `listener` until `shutdown` completes.
pub async fn serve(
    listener: TcpListener,
    state: Arc<AppState>,
    shutdown: impl std::future::Future<Output = ()>,
) -> std::io::Result<()> {
    let app = router(state.clone());
    let slots = Arc::new(Semaphore::new(state.opts.max_connections.max(1)));
    let read_timeout = state.opts.read_timeout;
    tokio::pin!(shutdown);
    loop {
        let permit = tokio::select! {
            _ = &mut shutdown => return Ok(()),
            p = slots.clone().acquire_owned() => p.map_err(std::io::Error::other)?,
        };
        let (stream, _) = tokio::select! {
            _ = &mut shutdown => return Ok(()),
            a = listener.accept() => match a {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors and the like: wait, go on.
                    eprintln!("serve: accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let svc = TowerToHyperService::new(app.clone());
        tokio::spawn(async move {
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(read_timeout)
                .max_buf_size(64 * 1024)
                .serve_connection(TokioIo::new(stream), svc);
            // Errors (garbage, timeouts, resets) concern this connection only.
            let _ = conn.await;
            drop(permit);
        });
    }
}

async fn count_responses(State(s): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let r = next.run(req).await;
    let mut m = s.responses.lock().unwrap_or_else(|e| e.into_inner());
    *m.entry(r.status().as_u16()).or_default() += 1;
    r
}

/// Compares without stopping at the first difference.
fn same_key(given: &[u8], key: &[u8]) -> bool {
    given.len() == key.len() && given.iter().zip(key).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
}

async fn authenticate(State(s): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if let Some(key) = &s.opts.api_key {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .map(|v| v.strip_prefix("Bearer ").unwrap_or(v).trim());
        let err = |m: &str| {
            ApiError::new(401, "authentication_error", m)
                .with_code("invalid_api_key")
                .into_response()
        };
        match given {
            None => return err("missing API key: send the header `Authorization: Bearer KEY`"),
            Some(g) if !same_key(g.as_bytes(), key.as_bytes()) => return err("invalid API key"),
            Some(_) => {}
        }
    }
    next.run(req).await
}

async fn not_found(req: Request) -> ApiError {
    ApiError::new(
        404,
        "not_found_error",
        format!("no route for {}", req.uri().path()),
    )
}

async fn method_not_allowed(req: Request) -> ApiError {
    ApiError::new(
        405,
        "invalid_request_error",
        format!("{} is not allowed on {}", req.method(), req.uri().path()),
    )
}

async fn health(State(s): State<Arc<AppState>>) -> Response {
    match s.loaded.get() {
        Some(_) => axum::Json(json!({"status": "ok"})).into_response(),
        None => loading().into_response(),
    }
}

async fn models(State(s): State<Arc<AppState>>) -> Result<Response, ApiError> {
    let l = s.loaded()?;
    let lim = l.engine.limits();
    Ok(axum::Json(json!({
        "object": "list",
        "data": [{
            "id": l.model_id,
            "object": "model",
            "created": s.created,
            "owned_by": "llama-graph",
            "meta": {"n_ctx": lim.context, "n_vocab": lim.vocab, "parallel": lim.parallel},
        }],
    }))
    .into_response())
}

async fn metrics(State(s): State<Arc<AppState>>) -> Result<Response, ApiError> {
    let l = s.loaded()?;
    let st = l.engine.stats();
    let mut out = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, value: String| {
        let _ = writeln!(out, "# HELP llama_graph_{name} {help}");
        let _ = writeln!(out, "# TYPE llama_graph_{name} {kind}");
        let _ = writeln!(out, "llama_graph_{name} {value}");
    };
    metric(
        "requests_total",
        "counter",
        "Generation requests accepted.",
        st.requests_total.to_string(),
    );
    metric(
        "prompt_tokens_total",
        "counter",
        "Prompt tokens processed.",
        st.tokens_prompt_total.to_string(),
    );
    metric(
        "generated_tokens_total",
        "counter",
        "Tokens generated (stop tokens included).",
        st.tokens_generated_total.to_string(),
    );
    metric(
        "queue_depth",
        "gauge",
        "Requests waiting to start.",
        st.queue_depth.to_string(),
    );
    metric(
        "requests_in_flight",
        "gauge",
        "Sequences being generated.",
        st.in_flight.to_string(),
    );
    metric(
        "kv_cells_used",
        "gauge",
        "KV-cache cells (token positions) in use.",
        st.kv_used.to_string(),
    );
    metric(
        "kv_cells_total",
        "gauge",
        "KV-cache cells in all.",
        st.kv_total.to_string(),
    );
    metric(
        "kv_cells_cached",
        "gauge",
        "KV-cache cells holding finished sequences' tokens for prompts with the same prefix (freed when needed).",
        st.kv_cached.to_string(),
    );
    metric(
        "prompt_tokens_cached_total",
        "counter",
        "Prompt tokens whose KV came from the prefix cache or from a sequence in flight with the same prefix.",
        st.tokens_prompt_cached_total.to_string(),
    );
    metric(
        "preemptions_total",
        "counter",
        "Sequences preempted because the KV pool ran short (fed again later).",
        st.preemptions_total.to_string(),
    );
    metric(
        "kv_usage_ratio",
        "gauge",
        "KV-cache cells in use over cells in all.",
        format!("{}", st.kv_used as f64 / st.kv_total.max(1) as f64),
    );
    metric(
        "generated_tokens_per_second",
        "gauge",
        "Generated tokens per second while busy, over the last second or more of busy time.",
        format!("{}", st.tokens_per_s),
    );
    out.push_str(
        "# HELP llama_graph_http_responses_total HTTP responses by status.\n# TYPE llama_graph_http_responses_total counter\n",
    );
    for (code, n) in s.responses.lock().unwrap_or_else(|e| e.into_inner()).iter() {
        let _ = writeln!(
            out,
            "llama_graph_http_responses_total{{status=\"{code}\"}} {n}"
        );
    }
    Ok((
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
        )],
        out,
    )
        .into_response())
}

/// Reads the whole body: 413 past the limit (at once when Content-Length
/// says so), 408 when it takes longer than the read timeout.
async fn read_body(s: &AppState, req: Request) -> Result<Bytes, ApiError> {
    let limit = s.opts.max_body_bytes;
    let too_large = |n: Option<u64>| {
        let got = n.map(|n| format!(" ({n} bytes)")).unwrap_or_default();
        ApiError::new(
            413,
            "invalid_request_error",
            format!("the request body{got} is larger than the limit of {limit} bytes"),
        )
    };
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(too_large(declared));
    }
    let body = Limited::new(req.into_body(), limit);
    match tokio::time::timeout(s.opts.read_timeout, body.collect()).await {
        Err(_) => Err(ApiError::new(
            408,
            "invalid_request_error",
            format!(
                "the request body was not received within {} s",
                s.opts.read_timeout.as_secs()
            ),
        )),
        Ok(Err(e)) if e.downcast_ref::<LengthLimitError>().is_some() => Err(too_large(None)),
        Ok(Err(e)) => Err(ApiError::new(
            400,
            "invalid_request_error",
            format!("could not read the request body: {e}"),
        )),
        Ok(Ok(c)) => Ok(c.to_bytes()),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Chat,
    Completion,
}

async fn chat_completions(
    State(s): State<Arc<AppState>>,
    req: Request,
) -> Result<Response, ApiError> {
    let bytes = read_body(&s, req).await?;
    let l = s.loaded()?;
    let r: ChatRequest = parse_body(&bytes)?;
    let messages = r.messages()?;
    let checked = r.common().check(r.max_tokens(), || s.unique())?;
    if !l.chat.available() {
        return Err(ApiError::invalid(
            "messages",
            "this model has no chat template; use /v1/completions",
        ));
    }
    let prompt = l
        .chat
        .tokens(l.tokenizer, &messages)
        .map_err(|e| ApiError::invalid("messages", e.to_string()))?;
    let prompt = match s.opts.context_full {
        ContextPolicy::Refuse => prompt,
        ContextPolicy::Shift => shift_messages(l, &messages, checked.max_tokens, prompt),
    };
    let field = r.max_tokens().map(|(_, f)| f).unwrap_or("max_tokens");
    start(&s, l, Endpoint::Chat, prompt, checked, field).await
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

async fn completions(State(s): State<Arc<AppState>>, req: Request) -> Result<Response, ApiError> {
    let bytes = read_body(&s, req).await?;
    let l = s.loaded()?;
    let r: CompletionRequest = parse_body(&bytes)?;
    r.check_extras()?;
    let checked = r
        .common()
        .check(r.max_tokens.map(|n| (n, "max_tokens")), || s.unique())?;
    let encode = |text: &str| {
        l.tokenizer.encode(
            text,
            EncodeOptions {
                add_bos: l.tokenizer.add_bos_default(),
                parse_special: true,
            },
        )
    };
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
    start(&s, l, Endpoint::Completion, prompt, checked, "max_tokens").await
}

/// Submits the request and answers, streamed or whole.
async fn start(
    s: &AppState,
    l: &Loaded,
    endpoint: Endpoint,
    prompt: Vec<u32>,
    c: Checked,
    max_field: &str,
) -> Result<Response, ApiError> {
    let context = l.engine.limits().context;
    let prompt_tokens = prompt.len();
    let max_tokens = match c.max_tokens {
        Some(n) => n,
        None if prompt_tokens < context => context - prompt_tokens,
        None => {
            return Err(ApiError::invalid(
                "messages",
                format!(
                    "the prompt ({prompt_tokens} tokens) fills the context of {context} tokens"
                ),
            )
            .with_code("context_length_exceeded"))
        }
    };
    let req = GenRequest {
        prompt,
        max_tokens,
        sampling: c.sampling,
        stop_tokens: if c.ignore_eos {
            Vec::new()
        } else {
            l.tokenizer.stop_ids().to_vec()
        },
    };
    let gen = l.engine.submit(req).map_err(|e| match e {
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
    };
    let text = TextStream::new(l.tokenizer, c.stop);
    if c.stream {
        Ok(stream_response(reply, gen, text, c.include_usage))
    } else {
        whole_response(reply, gen, text).await
    }
}

/// What every chunk or response of one request repeats.
struct Reply {
    endpoint: Endpoint,
    id: String,
    created: u64,
    model: String,
    prompt_tokens: usize,
}

fn finish_name(f: Finish) -> &'static str {
    match f {
        Finish::Stop => "stop",
        Finish::Length => "length",
        Finish::Cancelled => "cancelled",
    }
}

impl Reply {
    fn usage(&self, completion: usize) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        })
    }

    fn whole(&self, text: String, finish: &str, completion: usize) -> Value {
        match self.endpoint {
            Endpoint::Chat => json!({
                "id": self.id,
                "object": "chat.completion",
                "created": self.created,
                "model": self.model,
                "choices": [{
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": finish,
                    "logprobs": null,
                }],
                "usage": self.usage(completion),
            }),
            Endpoint::Completion => json!({
                "id": self.id,
                "object": "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [{
                    "index": 0,
                    "text": text,
                    "finish_reason": finish,
                    "logprobs": null,
                }],
                "usage": self.usage(completion),
            }),
        }
    }

    /// One SSE event with a choice: a role (chat's first chunk), text, or
    /// the finish reason.
    fn chunk(
        &self,
        role: bool,
        text: Option<&str>,
        finish: Option<&str>,
        usage_null: bool,
    ) -> String {
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
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": null}],
                })
            }
            Endpoint::Completion => json!({
                "id": self.id,
                "object": "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [{"index": 0, "text": text.unwrap_or(""), "finish_reason": finish, "logprobs": null}],
            }),
        };
        if usage_null {
            v["usage"] = Value::Null;
        }
        format!("data: {v}\n\n")
    }

    fn usage_chunk(&self, completion: usize) -> String {
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
            "usage": self.usage(completion),
        });
        format!("data: {v}\n\n")
    }
}

fn generation_failed(m: &str) -> ApiError {
    ApiError::new(500, "server_error", format!("generation failed: {m}"))
}

async fn whole_response(
    reply: Reply,
    mut gen: GenStream,
    mut text: TextStream<'static>,
) -> Result<Response, ApiError> {
    let mut out = String::new();
    let mut received = 0usize;
    loop {
        match gen.next().await {
            Some(GenEvent::Token(t)) => {
                received += 1;
                let (piece, stopped) = text.push(t);
                out.push_str(&piece);
                if stopped {
                    // Cancels the rest of the sequence.
                    drop(gen);
                    let v = reply.whole(out, "stop", received);
                    return Ok(axum::Json(v).into_response());
                }
            }
            Some(GenEvent::Done {
                finish: finish @ (Finish::Stop | Finish::Length),
                completion_tokens,
                ..
            }) => {
                let (rest, stopped) = text.finish();
                out.push_str(&rest);
                let reason = if stopped { "stop" } else { finish_name(finish) };
                let v = reply.whole(out, reason, completion_tokens);
                return Ok(axum::Json(v).into_response());
            }
            Some(GenEvent::Done { .. }) => {
                return Err(generation_failed("the sequence was cancelled"))
            }
            Some(GenEvent::Error(m)) => return Err(generation_failed(&m)),
            None => return Err(generation_failed("the engine stopped")),
        }
    }
}

/// A streaming response's state; the body stream owns it, so a client
/// that disconnects drops the [`GenStream`] with it.
struct Streamer {
    reply: Reply,
    gen: Option<GenStream>,
    text: TextStream<'static>,
    include_usage: bool,
    received: usize,
    sent_role: bool,
}

impl Streamer {
    /// The closing events: the rest of the text, the finish reason, usage
    /// when asked for, `[DONE]`.
    fn closing(&mut self, rest: &str, finish: &str, completion: usize) -> Bytes {
        self.gen = None;
        let r = &self.reply;
        let mut out = String::new();
        if !rest.is_empty() {
            out.push_str(&r.chunk(false, Some(rest), None, self.include_usage));
        }
        out.push_str(&r.chunk(false, None, Some(finish), self.include_usage));
        if self.include_usage {
            out.push_str(&r.usage_chunk(completion));
        }
        out.push_str("data: [DONE]\n\n");
        Bytes::from(out)
    }

    fn error(&mut self, m: &str) -> Bytes {
        self.gen = None;
        let e = generation_failed(m);
        Bytes::from(format!("data: {}\n\ndata: [DONE]\n\n", e.body()))
    }

    /// The next piece of the body; `None` at the end.
    async fn next(&mut self) -> Option<Bytes> {
        if self.reply.endpoint == Endpoint::Chat && !self.sent_role {
            self.sent_role = true;
            return Some(Bytes::from(self.reply.chunk(
                true,
                None,
                None,
                self.include_usage,
            )));
        }
        let gen = self.gen.as_mut()?;
        loop {
            match gen.next().await {
                Some(GenEvent::Token(t)) => {
                    self.received += 1;
                    let (piece, stopped) = self.text.push(t);
                    if stopped {
                        let n = self.received;
                        return Some(self.closing(&piece, "stop", n));
                    }
                    if !piece.is_empty() {
                        return Some(Bytes::from(self.reply.chunk(
                            false,
                            Some(&piece),
                            None,
                            self.include_usage,
                        )));
                    }
                }
                Some(GenEvent::Done {
                    finish: finish @ (Finish::Stop | Finish::Length),
                    completion_tokens,
                    ..
                }) => {
                    let (rest, stopped) = self.text.finish();
                    let reason = if stopped { "stop" } else { finish_name(finish) };
                    return Some(self.closing(&rest, reason, completion_tokens));
                }
                Some(GenEvent::Done { .. }) => {
                    return Some(self.error("the sequence was cancelled"))
                }
                Some(GenEvent::Error(m)) => return Some(self.error(&m)),
                None => return Some(self.error("the engine stopped")),
            }
        }
    }
}

fn stream_response(
    reply: Reply,
    gen: GenStream,
    text: TextStream<'static>,
    include_usage: bool,
) -> Response {
    let st = Streamer {
        reply,
        gen: Some(gen),
        text,
        include_usage,
        received: 0,
        sent_role: false,
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
