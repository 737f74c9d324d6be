//! The HTTP side: routes, the OpenAI endpoints, authentication, limits and
//! the connection loop.
//!
//! Every request is bounded: the connection count, the time to send the
//! headers (hyper's header read timeout, which also closes idle keep-alive
//! connections) and the body (size and time), the engine's queue. A
//! streaming response owns its [`GenStream`]; when the client goes away
//! hyper drops the response body, which drops the stream and cancels the
//! sequence.

use super::api::{
    compile_constraint, output_spec, parse_body, ApiError, ChatRequest, Checked, CompletionRequest,
    DetokenizeRequest, EmbeddingInput, EmbeddingRequest, Prompt, TokenizeRequest,
};
use super::engine::{
    EngineHandle, Finish, GenEvent, GenExtras, GenRequest, GenStream, SubmitError,
};
use super::text::TextStream;
use super::tools::{self, CallDetector, ToolCall, ToolChoice, ToolFormat};
use crate::generate::chat::{ChatFormat, ContextPolicy};
use crate::generate::constraint::{Constraint, GrammarSpec, Grammars};
use crate::generate::sampler::Rng;
use crate::generate::sampler::TokenLogprobs;
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
    /// Origins allowed to call the API from a browser (CORS): empty = no
    /// CORS headers (browsers then refuse cross-origin calls), `*` = any.
    pub cors_origins: Vec<String>,
    /// How long a streaming response may stay silent (a long prefill)
    /// before an SSE comment line keeps the connection alive.
    pub sse_keepalive: Duration,
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
    /// The model's vocabulary as grammars read it, built on first use.
    grammars: OnceLock<Result<Grammars, String>>,
}

impl AppState {
    pub fn new(opts: ServerOptions) -> Arc<AppState> {
        Arc::new(AppState {
            opts,
            loaded: OnceLock::new(),
            created: unix_now(),
            counter: AtomicU64::new(0),
            responses: Mutex::new(BTreeMap::new()),
            grammars: OnceLock::new(),
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

    /// Compiles an output constraint (`field` names the request field that
    /// asked for it).
    fn constraint(&self, spec: &GrammarSpec, field: &str) -> Result<Constraint, ApiError> {
        let l = self.loaded()?;
        let g = self
            .grammars
            .get_or_init(|| {
                Grammars::new(l.tokenizer, l.engine.limits().vocab).map_err(|e| e.to_string())
            })
            .as_ref()
            .map_err(|e| {
                ApiError::new(
                    500,
                    "server_error",
                    format!("the vocabulary cannot be read for grammars: {e}"),
                )
            })?;
        compile_constraint(g, spec, field)
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
        .route("/v1/models/{id}", get(model_by_id))
        .route("/models/{id}", get(model_by_id))
        .route("/v1/embeddings", post(embeddings))
        .route("/embeddings", post(embeddings))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/metrics", get(metrics))
        .route_layer(middleware::from_fn_with_state(state.clone(), authenticate));
    let cors = cors_layer(&state.opts.cors_origins);
    let app = Router::new()
        .route("/health", get(health))
        .route("/v1/health", get(health))
        .merge(protected)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(
            state.clone(),
            count_responses,
        ))
        .with_state(state);
    // Outermost: a preflight is answered before authentication (browsers
    // send it without the key).
    match cors {
        Some(c) => app.layer(c),
        None => app,
    }
}

/// The CORS layer `--cors-origin` asks for (none when no origin is given).
fn cors_layer(origins: &[String]) -> Option<tower_http::cors::CorsLayer> {
    use tower_http::cors::{AllowHeaders, AllowOrigin, CorsLayer};
    if origins.is_empty() {
        return None;
    }
    let allow = if origins.iter().any(|o| o == "*") {
        AllowOrigin::any()
    } else {
        AllowOrigin::list(
            origins
                .iter()
                .filter_map(|o| HeaderValue::from_str(o).ok())
                .collect::<Vec<_>>(),
        )
    };
    Some(
        CorsLayer::new()
            .allow_origin(allow)
            .allow_methods([
                axum::http::Method::GET,
                axum::http::Method::POST,
                axum::http::Method::OPTIONS,
            ])
            .allow_headers(AllowHeaders::mirror_request())
            .max_age(Duration::from_secs(600)),
    )
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

/// `GET /v1/models/{id}`: the served model, or 404 for any other id.
async fn model_by_id(
    State(s): State<Arc<AppState>>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Result<Response, ApiError> {
    let l = s.loaded()?;
    if id != l.model_id {
        return Err(ApiError {
            param: Some("model".into()),
            ..ApiError::new(
                404,
                "invalid_request_error",
                format!(
                    "the model `{id}` does not exist; this server serves `{}`",
                    l.model_id
                ),
            )
            .with_code("model_not_found")
        });
    }
    let lim = l.engine.limits();
    Ok(axum::Json(json!({
        "id": l.model_id,
        "object": "model",
        "created": s.created,
        "owned_by": "llama-graph",
        "meta": {"n_ctx": lim.context, "n_vocab": lim.vocab, "parallel": lim.parallel},
    }))
    .into_response())
}

/// Text to token ids as the completion endpoint tokenizes a prompt.
fn encode_prompt(l: &Loaded, text: &str) -> Vec<u32> {
    l.tokenizer.encode(
        text,
        EncodeOptions {
            add_bos: l.tokenizer.add_bos_default(),
            parse_special: true,
        },
    )
}

/// `POST /v1/embeddings`: one normalized (L2) pooled embedding per input.
async fn embeddings(State(s): State<Arc<AppState>>, req: Request) -> Result<Response, ApiError> {
    let bytes = read_body(&s, req).await?;
    let l = s.loaded()?;
    let r: EmbeddingRequest = parse_body(&bytes)?;
    let Some((_, width)) = l.engine.limits().embedding else {
        return Err(ApiError::new(
            501,
            "invalid_request_error",
            "embeddings are off: start the server with --pooling mean (or cls, last); a --pipeline server has none",
        )
        .with_code("not_implemented"));
    };
    let base64 = match r.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(f) => {
            return Err(ApiError::invalid(
                "encoding_format",
                format!("`encoding_format` is `float` or `base64`, got `{f}`"),
            ))
        }
    };
    if let Some(d) = r.dimensions {
        if d != width as i64 {
            return Err(ApiError::invalid(
                "dimensions",
                format!("this model's embeddings have {width} dimensions (they cannot be shortened), got {d}"),
            ));
        }
    }
    let inputs: Vec<Vec<u32>> = match &r.input {
        EmbeddingInput::Text(t) => vec![encode_prompt(l, t)],
        EmbeddingInput::Texts(v) => v.iter().map(|t| encode_prompt(l, t)).collect(),
        EmbeddingInput::Tokens(ids) => vec![ids.clone()],
        EmbeddingInput::TokenLists(v) => v.clone(),
    };
    if inputs.is_empty() {
        return Err(ApiError::invalid("input", "`input` is empty"));
    }
    if inputs.len() > super::api::MAX_EMBEDDING_INPUTS {
        return Err(ApiError::invalid(
            "input",
            format!(
                "at most {} inputs per request, got {}",
                super::api::MAX_EMBEDDING_INPUTS,
                inputs.len()
            ),
        ));
    }
    let prompt_tokens: usize = inputs.iter().map(Vec::len).sum();
    let rows = l.engine.embed(inputs).await.map_err(|e| match e {
        SubmitError::QueueFull { .. } => ApiError {
            retry_after: Some(1),
            ..ApiError::new(503, "unavailable_error", e.to_string()).with_code("queue_full")
        },
        e => ApiError::invalid("input", e.to_string()),
    })?;
    let data: Vec<Value> = rows
        .into_iter()
        .enumerate()
        .map(|(i, mut v)| {
            normalize(&mut v);
            let embedding = if base64 {
                use base64::Engine as _;
                let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                Value::from(base64::engine::general_purpose::STANDARD.encode(bytes))
            } else {
                json!(v)
            };
            json!({"object": "embedding", "index": i, "embedding": embedding})
        })
        .collect();
    Ok(axum::Json(json!({
        "object": "list",
        "data": data,
        "model": l.model_id,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }))
    .into_response())
}

/// Scales `v` to unit Euclidean length (llama-server's default
/// `embd_normalize`); a zero vector stays zero.
fn normalize(v: &mut [f32]) {
    let norm = v
        .iter()
        .map(|&x| f64::from(x) * f64::from(x))
        .sum::<f64>()
        .sqrt();
    if norm > 0.0 {
        let inv = 1.0 / norm;
        v.iter_mut().for_each(|x| *x = (f64::from(*x) * inv) as f32);
    }
}

/// `POST /tokenize` (llama-server's): `content` to token ids, with
/// `add_special` (a BOS where the model wants one; default false) and
/// `with_pieces` (each id with its text, or its bytes when they are not
/// UTF-8).
async fn tokenize(State(s): State<Arc<AppState>>, req: Request) -> Result<Response, ApiError> {
    let bytes = read_body(&s, req).await?;
    let l = s.loaded()?;
    let r: TokenizeRequest = parse_body(&bytes)?;
    let ids = l.tokenizer.encode(
        &r.content,
        EncodeOptions {
            add_bos: r.add_special.unwrap_or(false) && l.tokenizer.add_bos_default(),
            parse_special: r.parse_special.unwrap_or(true),
        },
    );
    let tokens: Vec<Value> = if r.with_pieces.unwrap_or(false) {
        ids.iter()
            .map(|&id| {
                let b = l.tokenizer.token_bytes(id).unwrap_or(&[]);
                let piece = match std::str::from_utf8(b) {
                    Ok(t) => Value::from(t),
                    Err(_) => json!(b),
                };
                json!({"id": id, "piece": piece})
            })
            .collect()
    } else {
        ids.iter().map(|&id| json!(id)).collect()
    };
    Ok(axum::Json(json!({"tokens": tokens})).into_response())
}

/// `POST /detokenize` (llama-server's): token ids to `content`.
async fn detokenize(State(s): State<Arc<AppState>>, req: Request) -> Result<Response, ApiError> {
    let bytes = read_body(&s, req).await?;
    let l = s.loaded()?;
    let r: DetokenizeRequest = parse_body(&bytes)?;
    let vocab = l.engine.limits().vocab;
    if let Some(bad) = r.tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(ApiError::invalid(
            "tokens",
            format!("token id {bad} is outside the vocabulary of {vocab}"),
        ));
    }
    Ok(axum::Json(json!({"content": l.tokenizer.decode(&r.tokens)})).into_response())
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
    let lim = l.engine.limits();
    metric(
        "kv_cache_bytes",
        "gauge",
        &match lim.kv_types {
            Some((k, v)) => format!("Bytes the KV cache takes (keys {k}, values {v})."),
            None => "Bytes the KV cache takes.".into(),
        },
        lim.kv_bytes.to_string(),
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
        "drafted_tokens_total",
        "counter",
        "Guessed tokens verified by a step (speculative decoding).",
        st.tokens_drafted_total.to_string(),
    );
    metric(
        "accepted_tokens_total",
        "counter",
        "Guessed tokens that were the tokens sampled (speculative decoding).",
        st.tokens_accepted_total.to_string(),
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

async fn completions(State(s): State<Arc<AppState>>, req: Request) -> Result<Response, ApiError> {
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
