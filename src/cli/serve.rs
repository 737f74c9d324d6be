//! `llama-graph serve`: the OpenAI-compatible HTTP server.

use super::flags::{ContextFlags, RuntimeFlags, SpecFlags};
use super::model::ModelArg;
use super::pipeline::{PipelineFlags, Role};
use clap::Args;
use llama_graph::generate::chat::ChatFormat;
use llama_graph::generate::spec::check_vocab;
use llama_graph::ir::Pooling;
use llama_graph::server::engine::{EngineConfig, EngineHandle, EngineSpec};
use llama_graph::server::{serve, AppState, Loaded, ServerOptions};
use llama_graph::session::{Model, SessionOptions};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

#[derive(Debug, Args)]
#[command(
    after_help = "Endpoints: POST /v1/chat/completions, POST /v1/completions, POST /v1/embeddings (with --pooling), GET /v1/models and /v1/models/{id}, POST /tokenize and /detokenize, GET /health (503 while loading), GET /metrics (Prometheus text).\nRequests take OpenAI's fields (messages, max_tokens or max_completion_tokens, temperature, top_p, seed, n, stop, stream, stream_options, logprobs, top_logprobs, presence_penalty, frequency_penalty, logit_bias, response_format, tools, tool_choice, parallel_tool_calls; user, metadata and store are accepted and ignored) and llama.cpp's top_k, min_p, repeat_penalty, ignore_eos, grammar and json_schema, and `speculative` (false: this request decodes without --draft-model/--spec-ngram; the tokens are the same either way); any other field is refused with 400 naming it. Unset sampling fields default to temperature 0.8, top_k 40, top_p 0.95, min_p 0.05, and max_tokens to the rest of the context. See docs/serving.md."
)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArg,
    /// Address to listen on. The default, loopback, is reachable from this
    /// machine only; 0.0.0.0 listens on every interface.
    #[arg(long = "host", value_name = "ADDR", default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on; 0 takes any free port (the address is printed).
    #[arg(long = "port", value_name = "N", default_value_t = 8080)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on every route but /health
    /// (also read from LLAMA_API_KEY).
    #[arg(
        long = "api-key",
        value_name = "KEY",
        env = "LLAMA_API_KEY",
        hide_env_values = true
    )]
    pub api_key: Option<String>,
    /// Sequences generated at once at most (also -np).
    #[arg(long = "parallel", value_name = "N", default_value_t = 4)]
    pub parallel: usize,
    /// The model's name in responses and /v1/models (default: the file name
    /// without .gguf).
    #[arg(short = 'a', long = "alias", value_name = "NAME")]
    pub alias: Option<String>,
    /// Requests that may wait for a free sequence; beyond that, requests
    /// are refused with 503 and Retry-After.
    #[arg(long = "max-queue", value_name = "N", default_value_t = 64)]
    pub max_queue: usize,
    /// Seconds a client has to send a request's headers, and then its body
    /// (408 or a closed connection after that); idle keep-alive
    /// connections are closed after it too.
    #[arg(long = "timeout", value_name = "SECONDS", default_value_t = 30)]
    pub timeout: u64,
    /// Largest request body in bytes (413 beyond).
    #[arg(long = "max-body-bytes", value_name = "N", default_value_t = 8 << 20)]
    pub max_body_bytes: usize,
    /// Connections served at once; further ones wait to be accepted.
    #[arg(long = "max-connections", value_name = "N", default_value_t = 256)]
    pub max_connections: usize,
    /// Serve POST /v1/embeddings, pooling each input's final hidden states
    /// (after the last norm) into one vector: `mean` of every token, the
    /// first token's (`cls`) or the `last` token's; answers are normalized
    /// to unit length. Compiles a second graph for it (its packed weights
    /// and a KV pool of one step). An input may have up to -b tokens.
    #[arg(long = "pooling", value_name = "MODE", value_parser = parse_pooling)]
    pub pooling: Option<Pooling>,
    /// Allow browsers on this origin to call the API (CORS; repeatable,
    /// e.g. http://localhost:3000, or `*` for any). Off by default: no CORS
    /// headers, and preflight requests get 405.
    #[arg(long = "cors-origin", value_name = "ORIGIN")]
    pub cors_origin: Vec<String>,
    /// Seconds a streaming response may stay silent (a long prompt being
    /// processed) before an SSE comment line (`: keep-alive`) is sent to
    /// keep proxies and clients from timing out.
    #[arg(long = "sse-keepalive", value_name = "SECONDS", default_value_t = 10.0)]
    pub sse_keepalive: f64,
    #[command(flatten)]
    pub runtime: RuntimeFlags,
    /// Speculative decoding for every request (a request opts out with
    /// `"speculative": false`): each sequence's guesses ride in the same
    /// batched step as the other sequences' tokens, and its tokens are the
    /// ones it gets without them. A draft model runs one session per
    /// sequence slot (-np) on the engine thread.
    #[command(flatten)]
    pub spec: SpecFlags,
    #[command(flatten)]
    pub context: ContextFlags,
    /// `mpirun -np N llama-graph serve --pipeline ...`: rank 0 serves HTTP
    /// and runs the tokenizer, scheduler and sampler and stage 0; the
    /// other ranks run the later stages of every batched step. Stop it
    /// with SIGTERM to rank 0 (every rank then ends cleanly).
    #[command(flatten)]
    pub pipeline: PipelineFlags,
}

/// Parses `--pooling`.
fn parse_pooling(s: &str) -> Result<Pooling, String> {
    match s {
        "mean" => Ok(Pooling::Mean),
        "cls" => Ok(Pooling::Cls),
        "last" => Ok(Pooling::Last),
        _ => Err(format!("`{s}`: the pooling is mean, cls or last")),
    }
}

pub fn run(a: ServeArgs) -> super::CliResult {
    let threads = a.runtime.threads()?;
    if !(a.sse_keepalive > 0.0 && a.sse_keepalive <= 3600.0) {
        return Err(format!(
            "--sse-keepalive must be more than 0 and at most 3600 seconds, got {}",
            a.sse_keepalive
        )
        .into());
    }
    for o in &a.cors_origin {
        if o != "*" && axum::http::HeaderValue::from_str(o).is_err() {
            return Err(format!("--cors-origin {o:?}: not a valid origin").into());
        }
    }
    if a.parallel == 0 {
        return Err("-np/--parallel must be at least 1".into());
    }
    if a.max_queue == 0 {
        return Err("--max-queue must be at least 1".into());
    }
    if a.timeout == 0 {
        return Err("--timeout must be at least 1 second".into());
    }
    if a.max_connections == 0 {
        return Err("--max-connections must be at least 1".into());
    }
    if a.api_key.as_deref() == Some("") {
        return Err("--api-key is empty".into());
    }
    let ip: std::net::IpAddr = a.host.parse().map_err(|_| {
        format!(
            "--host {}: not an IP address (e.g. 127.0.0.1 or 0.0.0.0)",
            a.host
        )
    })?;
    let addr = SocketAddr::new(ip, a.port);
    // Every rank compiles its stage for the same steps as rank 0's engine
    // runs (tokens and sequences per step).
    let opts_for = |m: &Model| -> Result<SessionOptions, String> {
        let context = m.args.plan_context(a.runtime.ctx_size);
        let mut o = a.runtime.session_options(context, threads)?;
        o.parallel = a.parallel;
        Ok(o)
    };
    let role = match Role::start(&a.pipeline)? {
        // The later stages serve steps until rank 0 stops the pipeline.
        Role::Worker(t) => return Ok(super::pipeline::work(t, &a.model, &a.pipeline, &opts_for)?),
        r => r,
    };
    // One worker thread: HTTP is a sliver of the work next to the model's
    // steps, and a second worker is woken (and parks again) with the first
    // on every streamed token, taking a core from the compute threads.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the async runtime: {e}"))?;
    let state = AppState::new(ServerOptions {
        api_key: a.api_key.clone(),
        max_body_bytes: a.max_body_bytes,
        read_timeout: Duration::from_secs(a.timeout),
        max_connections: a.max_connections,
        cors_origins: a.cors_origin.clone(),
        sse_keepalive: Duration::from_secs_f64(a.sse_keepalive),
        context_full: a
            .context
            .policy(llama_graph::generate::chat::ContextPolicy::Shift),
    });
    // Listen first: /health answers 503 while the model loads.
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind(addr))
        .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    let local = listener.local_addr()?;
    eprintln!(
        "listening on http://{local} (loading the model; /health answers 503 until it is ready)"
    );
    let server = runtime.spawn(serve(listener, state.clone(), shutdown_signal()));

    let t0 = Instant::now();
    let pipelined = matches!(role, Role::Leader(_));
    let loaded = load(&a, role, &opts_for);
    let loaded = match loaded {
        Ok(l) => l,
        Err(e) => {
            runtime.shutdown_background();
            return Err(e);
        }
    };
    let lim = loaded.engine.limits();
    eprintln!(
        "ready in {:.2} s: model `{}`, KV pool of {} tokens shared by up to {} sequences at once, queue of {}, {threads} threads{}",
        t0.elapsed().as_secs_f64(),
        loaded.model_id,
        lim.context,
        lim.parallel,
        lim.queue_capacity,
        if a.api_key.is_some() { ", API key required" } else { "" }
    );
    if let Some((k, v)) = lim.kv_types {
        eprintln!(
            "KV cache: {} positions, keys {k}, values {v}, {:.2} MiB",
            lim.context,
            lim.kv_bytes as f64 / 1048576.0
        );
    }
    state.set_loaded(loaded);
    match runtime.block_on(server) {
        Ok(r) => r?,
        Err(e) => return Err(format!("the server task failed: {e}").into()),
    }
    eprintln!("shutting down");
    runtime.shutdown_timeout(Duration::from_secs(1));
    // The last engine handle: the engine ends (and stops the pipeline).
    drop(state);
    if pipelined {
        if let Some(mib) = super::pipeline::peak_rss_mib() {
            eprintln!("pipeline: rank 0: peak RSS {mib:.1} MiB");
        }
    }
    Ok(())
}

fn load(
    a: &ServeArgs,
    role: Role,
    opts_for: &dyn Fn(&Model) -> Result<SessionOptions, String>,
) -> Result<Loaded, Box<dyn std::error::Error>> {
    let no_tokenizer = |m: &Model| {
        format!(
            "{} has no tokenizer, which the server needs (a Meta directory needs tokenizer.model)",
            m.path.display()
        )
    };
    let (mut model, staged) = match role {
        Role::Leader(t) => {
            // Rank 0 opens stage 0; a failure on any rank fails every rank.
            let has_tokenizer = |m: &Model| match m.tokenizer {
                Some(_) => Ok(()),
                None => Err(no_tokenizer(m)),
            };
            let (s, ()) = super::pipeline::lead(t, &a.model, &a.pipeline, opts_for, has_tokenizer)?;
            (s.model, Some(s.session))
        }
        _ => (a.model.open(false)?.0, None),
    };
    // The draft model's tokenizer is checked against the model's.
    let spec = match a.spec.config()? {
        None => None,
        Some(_) if staged.is_some() => {
            return Err("--draft-model and --spec-ngram do not run with --pipeline yet".into())
        }
        Some(config) => {
            let draft = match &a.spec.draft_model {
                None => None,
                Some(path) => {
                    let d = Model::open(path).map_err(|e| format!("--draft-model: {e}"))?;
                    check_vocab(&model, &d).map_err(|e| format!("--draft-model: {e}"))?;
                    Some(d)
                }
            };
            Some(EngineSpec { config, draft })
        }
    };
    let tokenizer = model.tokenizer.take().ok_or_else(|| no_tokenizer(&model))?;
    let chat = ChatFormat::of(&model);
    if !chat.available() {
        eprintln!("warning: this GGUF file has no chat template; /v1/chat/completions will refuse requests, /v1/completions works");
    }
    let model_id = a.alias.clone().unwrap_or_else(|| {
        let name = model
            .path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| model.path.display().to_string());
        name.strip_suffix(".gguf")
            .map(str::to_string)
            .unwrap_or(name)
    });
    let cfg = EngineConfig {
        session: opts_for(&model)?,
        parallel: a.parallel,
        queue_capacity: a.max_queue,
    };
    if staged.is_some() && a.pooling.is_some() {
        return Err("--pooling (embeddings) is not available with --pipeline".into());
    }
    let engine = match staged {
        // Each step of the engine runs over every stage.
        Some(session) => EngineHandle::with_session(session, model, cfg)?,
        None => EngineHandle::start_speculative(model, cfg, a.pooling, spec)?,
    };
    Ok(Loaded {
        engine,
        // One model per process: the tokenizer lives until exit.
        tokenizer: Box::leak(Box::new(tokenizer)),
        chat,
        model_id,
    })
}

/// Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
