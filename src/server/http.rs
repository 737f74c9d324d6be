//! The HTTP side: routes, the OpenAI endpoints, authentication, limits and
//! the connection loop.
//!
//! Every request is bounded: the connection count, the time to send the
//! headers (hyper's header read timeout, which also closes idle keep-alive
//! connections) and the body (size and time), the engine's queue. A
//! streaming response owns its [`GenStream`]; when the client goes away
//! hyper drops the response body, which drops the stream and cancels the
//! sequence.
//!
//! Routes, middleware and the small endpoints are here; the generation
//! endpoints and their whole and streamed responses are in
//! `http/generate.rs`.

use super::api::{
    compile_constraint, parse_body, ApiError, DetokenizeRequest, EmbeddingInput, EmbeddingRequest,
    TokenizeRequest,
};
use super::engine::{EngineHandle, SubmitError};
use crate::generate::chat::{ChatFormat, ContextPolicy};
use crate::generate::constraint::{Constraint, GrammarSpec, Grammars};
use crate::generate::sampler::Rng;
use crate::tokenizer::{EncodeOptions, Tokenizer};
use axum::body::Bytes;
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

mod generate;
use generate::{chat_completions, completions};

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
