//! The generation engine behind the server: a thread that owns the compiled
//! session and turns queued requests into streams of token ids.
//!
//! The HTTP layer only speaks this module's small API: [`EngineHandle::submit`]
//! a [`GenRequest`] (prompt ids, a token budget, sampling, stop ids) and read
//! [`GenEvent`]s from the returned [`GenStream`]; dropping the stream cancels
//! the sequence. [`EngineHandle::stats`] feeds `/metrics`.
//!
//! The engine batches: one thread owns the compiled [`Session`] and runs
//! graph steps that carry tokens of several sequences at once. Between
//! steps it admits queued requests into the running batch, drops cancelled
//! ones (their KV blocks are free for the next step) and retires finished
//! ones; [`super::scheduler::Scheduler`] decides what each step carries
//! (decode tokens first, then prefill chunks within the step's token
//! budget) and hands out KV blocks. At most `parallel` sequences run at
//! once; requests wait in a bounded queue until one can start (a full queue
//! refuses at once with [`SubmitError::QueueFull`]) and start in arrival
//! order. Every kernel computes a sequence's rows independently of the rest
//! of the batch, so a greedy request's tokens do not depend on what else is
//! running.
//!
//! With speculative decoding ([`EngineHandle::start_speculative`]), before
//! each step the engine guesses the next tokens of every decoding sequence
//! (prompt lookup, or a draft model on a session of its own per sequence
//! slot, run on this thread), and the sequence feeds its newest token and
//! the guesses in the same batched step as everyone else's tokens; its
//! tokens are sampled from the step's rows one at a time exactly as a
//! plain step would sample them (see `docs/design/speculative.md`), so the
//! tokens do not change.
#![warn(missing_docs)]

use super::scheduler::{Scheduler, SchedulerConfig, SeqId};
use crate::exec::{Batch, KvPool};
use crate::generate::constraint::Constraint;
use crate::generate::sampler::{Penalties, Sampler, SamplerConfig, TokenLogprobs};
use crate::generate::spec::{check_vocab, Adapt, Drafter, SpecConfig};
use crate::ir::{LogitRows, Pooling, SEQ_TABLE_COLS};
use crate::session::{CacheType, Model, Session, SessionError, SessionOptions};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use thiserror::Error;
use tokio::sync::mpsc;

/// One generation: the prompt as token ids, how many tokens to generate at
/// most, how to sample them and which sampled ids end it.
#[derive(Debug, Clone)]
pub struct GenRequest {
    /// The prompt's token ids (a chat already rendered by its template).
    pub prompt: Vec<u32>,
    /// At least 1; `prompt.len() + max_tokens` must fit the context.
    pub max_tokens: usize,
    /// How to pick each token.
    pub sampling: SamplerConfig,
    /// Sampled ids that end the sequence (usually the tokenizer's
    /// end-of-sequence and end-of-turn ids). Such a token is counted in
    /// `completion_tokens` but not sent as a [`GenEvent::Token`].
    pub stop_tokens: Vec<u32>,
}

/// What a request may ask beyond a [`GenRequest`] (all off by default).
#[derive(Clone, Default)]
pub struct GenExtras {
    /// The grammar every token must follow (structured output).
    pub constraint: Option<Constraint>,
    /// Logit bias and presence/frequency penalties.
    pub penalties: Penalties,
    /// Report every sampled token's log-probability with this many
    /// alternatives (see [`GenStream::take_logprobs`]).
    pub logprobs: Option<usize>,
    /// Speculative decoding for this request: `None` follows the engine
    /// (on when it was started with a drafter), `Some(false)` turns it
    /// off, `Some(true)` is refused by an engine without a drafter.
    pub speculative: Option<bool>,
}

/// Speculative decoding in the engine (see
/// [`EngineHandle::start_speculative`]).
pub struct EngineSpec {
    /// How many tokens to guess per step, and whether that adapts.
    pub config: SpecConfig,
    /// The draft model (its vocabulary must be the model's); `None`:
    /// prompt lookup.
    pub draft: Option<Model>,
}

/// Why a sequence ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// A stop token was sampled.
    Stop,
    /// `max_tokens` were generated.
    Length,
    /// The stream was dropped (or the engine shut down) before the end.
    Cancelled,
}

/// What a [`GenStream`] yields: every generated token in order, then
/// exactly one `Done` or `Error`, then nothing.
#[derive(Debug, Clone, PartialEq)]
pub enum GenEvent {
    /// The next generated token (stop tokens are not sent).
    Token(u32),
    /// The sequence ended.
    Done {
        /// Why.
        finish: Finish,
        /// Tokens of the prompt.
        prompt_tokens: usize,
        /// Tokens sampled, including a final stop token.
        completion_tokens: usize,
    },
    /// The step failed; the message says why. Nothing follows.
    Error(String),
}

/// Why a request was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SubmitError {
    /// The queue holds `capacity` waiting requests already.
    #[error("the server is busy: {capacity} requests are already waiting; retry later")]
    QueueFull {
        /// The queue's capacity.
        capacity: usize,
    },
    /// The prompt plus `max_tokens` would not fit the context.
    #[error("the prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) exceed the context of {context} tokens")]
    TooLong {
        /// Tokens of the prompt.
        prompt_tokens: usize,
        /// Tokens asked for.
        max_tokens: usize,
        /// The most one sequence may hold.
        context: usize,
    },
    /// Something else about the request is wrong (an empty prompt, an id
    /// outside the vocabulary, `max_tokens` 0, a bad sampling parameter);
    /// the message says what.
    #[error("{0}")]
    Invalid(String),
}

/// Counters and gauges for `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineStats {
    /// Requests accepted by `submit`.
    pub requests_total: u64,
    /// Prompt tokens processed (counted when a sequence starts).
    pub tokens_prompt_total: u64,
    /// Tokens sampled, stop tokens included.
    pub tokens_generated_total: u64,
    /// Requests waiting to start (not counting dropped ones).
    pub queue_depth: usize,
    /// Sequences started and not yet finished.
    pub in_flight: usize,
    /// KV-cache cells (token positions) holding a live sequence's tokens.
    pub kv_used: usize,
    /// KV-cache cells in all (the pool all sequences share).
    pub kv_total: usize,
    /// KV-cache cells holding finished sequences' tokens for prompts that
    /// start with the same ones (the prefix cache; taken back whenever
    /// needed).
    pub kv_cached: usize,
    /// Prompt tokens whose KV came from the prefix cache or from a
    /// sequence in flight with the same prefix (not computed again).
    pub tokens_prompt_cached_total: u64,
    /// Generated tokens per second while at least one sequence was in
    /// flight, over the most recent stretch of at least one second of such
    /// time (0 before the first such stretch).
    pub tokens_per_s: f64,
    /// Sequences preempted because the KV pool ran short (their blocks were
    /// freed and they were fed again from their first token later).
    pub preemptions_total: u64,
    /// Guessed tokens verified by a step (speculative decoding).
    pub tokens_drafted_total: u64,
    /// Guessed tokens that were the tokens sampled (kept).
    pub tokens_accepted_total: u64,
}

/// Fixed properties of a running engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineLimits {
    /// The most tokens (prompt plus generated) one sequence may hold.
    pub context: usize,
    /// Sequences run at once at most.
    pub parallel: usize,
    /// Requests that may wait at most.
    pub queue_capacity: usize,
    /// Token ids are below this.
    pub vocab: usize,
    /// With embeddings ([`EngineHandle::start_with_embeddings`]): the most
    /// tokens one input may have, and the embedding's width.
    pub embedding: Option<(usize, usize)>,
    /// Bytes the KV pool takes (every layer's keys and values on this rank).
    pub kv_bytes: usize,
    /// The KV pool's key and value types.
    pub kv_types: Option<(CacheType, CacheType)>,
}

/// How to start an engine.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// The session to compile: its `context` is the KV pool all sequences
    /// share (and the longest one sequence may be), its `batch` the most
    /// tokens per step (decode tokens and prefill chunks together).
    pub session: SessionOptions,
    /// Sequences in flight at most (`-np`): the most sequences per step.
    pub parallel: usize,
    /// Requests that may wait for a free sequence slot.
    pub queue_capacity: usize,
}

/// Why an engine could not start.
#[derive(Debug, Error)]
pub enum EngineError {
    /// The session did not compile.
    #[error(transparent)]
    Session(#[from] SessionError),
    /// The configuration is inconsistent; the message says how.
    #[error("{0}")]
    Invalid(String),
    /// The operating system refused the engine thread.
    #[error("the engine thread could not start: {0}")]
    Thread(String),
}

struct Job {
    req: GenRequest,
    extras: GenExtras,
    tx: mpsc::UnboundedSender<GenEvent>,
    lp_tx: Option<mpsc::UnboundedSender<TokenLogprobs>>,
    shared: Arc<StreamShared>,
}

/// What a stream and its sequence share besides the events.
#[derive(Debug, Default)]
struct StreamShared {
    /// Set by [`GenStream::finish`]: the client has its answer; the
    /// sequence ends as a normal finish (its KV stays in the prefix cache)
    /// rather than a cancellation.
    finished: AtomicBool,
    /// Prompt tokens whose KV came from the prefix cache or a sequence in
    /// flight (set when the sequence samples its first token).
    cached: AtomicUsize,
}

/// Embedding inputs of one request and where their embeddings go.
struct EmbedJob {
    inputs: Vec<Vec<u32>>,
    tx: tokio::sync::oneshot::Sender<Result<Vec<Vec<f32>>, String>>,
}

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    embeds: VecDeque<EmbedJob>,
    shutdown: bool,
}

#[derive(Default)]
struct Shared {
    queue: Mutex<Queue>,
    ready: Condvar,
    requests_total: AtomicU64,
    tokens_prompt_total: AtomicU64,
    tokens_generated_total: AtomicU64,
    in_flight: AtomicUsize,
    kv_used: AtomicUsize,
    kv_total: AtomicUsize,
    kv_cached: AtomicUsize,
    tokens_prompt_cached_total: AtomicU64,
    preemptions_total: AtomicU64,
    /// f64 bits.
    tokens_per_s: AtomicU64,
    tokens_drafted_total: AtomicU64,
    tokens_accepted_total: AtomicU64,
}

/// Closes the queue when the last handle goes away; the engine thread then
/// finishes (cancelling what was queued, stopping a pipeline it leads) and
/// exits, which the drop waits for (at most the step under way).
struct Owner {
    shared: Arc<Shared>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Drop for Owner {
    fn drop(&mut self) {
        {
            let mut q = self.shared.queue.lock().unwrap_or_else(|e| e.into_inner());
            q.shutdown = true;
            self.shared.ready.notify_all();
        }
        let t = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(t) = t {
            let _ = t.join();
        }
    }
}

/// A handle on a running engine; cheap to clone and share between threads.
#[derive(Clone)]
pub struct EngineHandle {
    owner: Arc<Owner>,
    limits: EngineLimits,
    /// Whether it decodes speculatively.
    speculative: bool,
}

impl std::fmt::Debug for EngineHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineHandle")
            .field("limits", &self.limits)
            .finish()
    }
}

/// The receiving end of one sequence. Dropping it cancels the sequence
/// (the engine notices before its next step and frees the sequence's KV).
pub struct GenStream {
    rx: mpsc::UnboundedReceiver<GenEvent>,
    logprobs: Option<mpsc::UnboundedReceiver<TokenLogprobs>>,
    shared: Arc<StreamShared>,
}

impl GenStream {
    /// After a [`GenEvent::Token`] of a request that asked for logprobs
    /// ([`GenExtras::logprobs`]): that token's log-probabilities (the engine
    /// sends them before the token).
    pub fn take_logprobs(&mut self) -> Option<TokenLogprobs> {
        self.logprobs.as_mut().and_then(|r| r.try_recv().ok())
    }

    /// Prompt tokens whose KV was reused (the prefix cache or a sequence in
    /// flight with the same prefix) rather than computed; known once the
    /// first token has come.
    pub fn cached_tokens(&self) -> usize {
        self.shared.cached.load(Ordering::Relaxed)
    }

    /// Ends the sequence because the client has what it wants (a stop
    /// string appeared): like a normal finish, its KV stays in the prefix
    /// cache for a later prompt with the same prefix. (Dropping the stream
    /// instead cancels the sequence and frees its KV.)
    pub fn finish(self) {
        self.shared.finished.store(true, Ordering::Relaxed);
    }

    /// The next event; `None` after the final `Done`/`Error`.
    pub async fn next(&mut self) -> Option<GenEvent> {
        self.rx.recv().await
    }

    /// The next event, blocking the calling thread (not for async code).
    pub fn blocking_next(&mut self) -> Option<GenEvent> {
        self.rx.blocking_recv()
    }

    /// Polls for the next event (for a `Stream` adapter); `Ready(None)`
    /// after the final `Done`/`Error`.
    pub fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Option<GenEvent>> {
        self.rx.poll_recv(cx)
    }
}

impl EngineHandle {
    /// Compiles a session for `model` on a new engine thread and starts
    /// serving. Returns once the session is ready (or failed to compile).
    ///
    /// ```no_run
    /// use llama_graph::generate::SamplerConfig;
    /// use llama_graph::server::engine::{EngineConfig, EngineHandle, GenEvent, GenRequest};
    /// use llama_graph::session::{Model, SessionOptions};
    ///
    /// let model = Model::open("model.gguf".as_ref())?;
    /// let cfg = EngineConfig { session: SessionOptions::default(), parallel: 4, queue_capacity: 64 };
    /// let engine = EngineHandle::start(model, cfg)?;
    /// let mut stream = engine.submit(GenRequest {
    ///     prompt: vec![1, 415, 5565],
    ///     max_tokens: 16,
    ///     sampling: SamplerConfig { temperature: 0.0, ..Default::default() },
    ///     stop_tokens: vec![2],
    /// })?;
    /// while let Some(event) = stream.blocking_next() {
    ///     match event {
    ///         GenEvent::Token(id) => print!(" {id}"),
    ///         GenEvent::Done { finish, .. } => println!(" ({finish:?})"),
    ///         GenEvent::Error(e) => eprintln!("{e}"),
    ///     }
    /// }
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn start(model: Model, cfg: EngineConfig) -> Result<EngineHandle, EngineError> {
        EngineHandle::start_with_embeddings(model, cfg, None)
    }

    /// Like [`EngineHandle::start`], and with `pooling` also compiles the
    /// model's embedding graph (the final norm pooled per sequence; see
    /// [`Session::new_embedding`]) for [`EngineHandle::embed`]: inputs of
    /// up to the step's token budget, several per step, run by the same
    /// engine thread between generation steps.
    pub fn start_with_embeddings(
        model: Model,
        cfg: EngineConfig,
        pooling: Option<Pooling>,
    ) -> Result<EngineHandle, EngineError> {
        EngineHandle::start_speculative(model, cfg, pooling, None)
    }

    /// [`EngineHandle::start_with_embeddings`], decoding speculatively
    /// with `spec`: each decoding sequence's guesses ride in the batched
    /// step beside the other sequences' tokens, and its tokens are the
    /// ones it gets without them. The session's steps return up to
    /// `parallel * (draft_max + 1)` logit rows (at most `batch`); a draft
    /// model gets `parallel` sessions of its own (one sequence each, the
    /// model's context, threads and `exact`), used on the engine thread.
    pub fn start_speculative(
        model: Model,
        cfg: EngineConfig,
        pooling: Option<Pooling>,
        spec: Option<EngineSpec>,
    ) -> Result<EngineHandle, EngineError> {
        let mut session_opts = cfg.session.clone();
        session_opts.parallel = cfg.parallel;
        let mut target_opts = session_opts.clone();
        if let Some(sp) = &spec {
            sp.config.validate().map_err(EngineError::Invalid)?;
            if sp.config.draft_max + 1 > session_opts.batch {
                return Err(EngineError::Invalid(format!(
                    "--draft-max {} needs steps of {} tokens, more than -b/--batch-size {}",
                    sp.config.draft_max,
                    sp.config.draft_max + 1,
                    session_opts.batch
                )));
            }
            if let Some(d) = &sp.draft {
                check_vocab(&model, d).map_err(EngineError::Invalid)?;
            }
            target_opts.logit_rows = LogitRows::Tail {
                max: (cfg.parallel * (sp.config.draft_max + 1)).min(session_opts.batch),
            };
        }
        let speculative = spec.is_some();
        let mut handle = EngineHandle::launch(&cfg, move || {
            let session = Session::new(&model, &target_opts)?;
            let spec = match spec {
                None => None,
                Some(sp) => {
                    let mut free = Vec::new();
                    if let Some(d) = &sp.draft {
                        let dopts = SessionOptions {
                            logit_rows: LogitRows::Last,
                            parallel: 1,
                            ..session_opts.clone()
                        };
                        for _ in 0..session_opts.parallel {
                            free.push(Drafter::model(Session::new(d, &dopts)?));
                        }
                    }
                    Some((SpecEngine::new(sp.config, free), sp.draft))
                }
            };
            let (spec, draft_model) = match spec {
                Some((s, d)) => (Some(s), d),
                None => (None, None),
            };
            let embed = match pooling {
                None => None,
                Some(p) => {
                    // Room for a full step of whole sequences: every one
                    // may leave part of its last block empty.
                    let mut o = session_opts.clone();
                    let block = session.exec.kv_geom().block;
                    o.context = Some(o.batch + o.parallel * block);
                    Some(Session::new_embedding(&model, &o, p)?)
                }
            };
            // The models' mappings stay alive with the sessions.
            Ok((
                session,
                embed,
                spec,
                Box::new((model, draft_model)) as Box<dyn Send>,
            ))
        })?;
        handle.speculative = speculative;
        Ok(handle)
    }

    /// Serves with a session compiled elsewhere, for `cfg.parallel`
    /// sequences: stage 0 leading a pipeline (`serve --pipeline`), whose
    /// steps then run over every stage. `model` (whose mappings the session
    /// reads) lives as long as the engine. When the engine stops (the last
    /// handle dropped), it stops the pipeline, so every rank ends.
    pub fn with_session(
        session: Session,
        model: Model,
        cfg: EngineConfig,
    ) -> Result<EngineHandle, EngineError> {
        if session.plan.max.n < cfg.parallel {
            return Err(EngineError::Invalid(format!(
                "the session was compiled for {} sequences per step, the engine runs {}",
                session.plan.max.n, cfg.parallel
            )));
        }
        EngineHandle::launch(&cfg, move || {
            Ok((session, None, None, Box::new(model) as Box<dyn Send>))
        })
    }

    fn launch(
        cfg: &EngineConfig,
        make: impl FnOnce() -> Result<
                (Session, Option<Session>, Option<SpecEngine>, Box<dyn Send>),
                SessionError,
            > + Send
            + 'static,
    ) -> Result<EngineHandle, EngineError> {
        if cfg.parallel == 0 {
            return Err(EngineError::Invalid(
                "-np/--parallel must be at least 1".into(),
            ));
        }
        if cfg.queue_capacity == 0 {
            return Err(EngineError::Invalid(
                "the queue must hold at least 1 request".into(),
            ));
        }
        let shared = Arc::new(Shared::default());
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let thread_shared = shared.clone();
        let parallel = cfg.parallel;
        let thread = std::thread::Builder::new()
            .name("llama-graph-engine".into())
            .spawn(move || {
                let (mut session, mut embed, mut spec, keep) = match make() {
                    Ok(s) => s,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let embedding = embed.as_ref().map(|e| {
                    let width = e.graph.outputs().first().map_or(0, |&o| {
                        e.graph.node(o).meta.shape.dims()[1].as_const().unwrap_or(0)
                    });
                    (e.exec.max_chunk().min(e.context()), width)
                });
                let _ = ready_tx.send(Ok((
                    session.context(),
                    session.vocab(),
                    embedding,
                    session.exec.kv_bytes(),
                    session.exec.kv_types(),
                )));
                engine_loop(
                    &mut session,
                    embed.as_mut(),
                    spec.as_mut(),
                    parallel,
                    &thread_shared,
                );
                if session.pipeline().is_some() {
                    if let Err(e) = session.stop_pipeline("") {
                        eprintln!("error: stopping the pipeline: {e}");
                    }
                }
                drop(session);
                drop(embed);
                drop(spec);
                drop(keep);
            })
            .map_err(|e| EngineError::Thread(e.to_string()))?;
        let (context, vocab, embedding, kv_bytes, kv_types) = ready_rx
            .recv()
            .map_err(|_| EngineError::Thread("the engine thread ended while loading".into()))??;
        Ok(EngineHandle {
            owner: Arc::new(Owner {
                shared,
                thread: Mutex::new(Some(thread)),
            }),
            limits: EngineLimits {
                context,
                parallel: cfg.parallel,
                queue_capacity: cfg.queue_capacity,
                vocab,
                embedding,
                kv_bytes,
                kv_types,
            },
            speculative: false,
        })
    }

    /// The engine's fixed limits (context, parallel sequences, queue,
    /// vocabulary).
    pub fn limits(&self) -> EngineLimits {
        self.limits
    }

    /// Checks `req` and queues it. Refuses at once, without waiting, when
    /// the queue is full.
    pub fn submit(&self, req: GenRequest) -> Result<GenStream, SubmitError> {
        self.submit_with(req, GenExtras::default())
    }

    /// [`EngineHandle::submit`], every token sampled among those
    /// `constraint` allows (structured output).
    pub fn submit_constrained(
        &self,
        req: GenRequest,
        constraint: Option<Constraint>,
    ) -> Result<GenStream, SubmitError> {
        self.submit_with(
            req,
            GenExtras {
                constraint,
                ..GenExtras::default()
            },
        )
    }

    /// [`EngineHandle::submit`] with what `extras` asks for.
    pub fn submit_with(
        &self,
        req: GenRequest,
        extras: GenExtras,
    ) -> Result<GenStream, SubmitError> {
        let mut v = self.submit_many(vec![(req, extras)])?;
        Ok(v.pop().expect("one stream per request"))
    }

    /// Queues several requests together, or none of them (each is checked
    /// first; a full queue refuses them all). Requests with the same prompt
    /// (OpenAI's `n` choices) are admitted together when `parallel` allows,
    /// and the later ones read the first one's KV blocks for the prompt
    /// rather than compute it again (see [`super::scheduler`]).
    pub fn submit_many(
        &self,
        reqs: Vec<(GenRequest, GenExtras)>,
    ) -> Result<Vec<GenStream>, SubmitError> {
        for (req, extras) in &reqs {
            self.check(req, extras)?;
        }
        let shared = &self.owner.shared;
        let mut streams = Vec::with_capacity(reqs.len());
        {
            let l = self.limits;
            let mut q = shared.queue.lock().unwrap_or_else(|e| e.into_inner());
            if q.jobs.len() + reqs.len() > l.queue_capacity {
                // Requests whose streams were dropped while waiting give
                // their places back.
                q.jobs.retain(|j| !j.tx.is_closed());
            }
            if q.jobs.len() + reqs.len() > l.queue_capacity {
                return Err(SubmitError::QueueFull {
                    capacity: l.queue_capacity,
                });
            }
            for (req, extras) in reqs {
                let (tx, rx) = mpsc::unbounded_channel();
                let (lp_tx, lp_rx) = match extras.logprobs {
                    Some(_) => {
                        let (t, r) = mpsc::unbounded_channel();
                        (Some(t), Some(r))
                    }
                    None => (None, None),
                };
                let st = Arc::new(StreamShared::default());
                q.jobs.push_back(Job {
                    req,
                    extras,
                    tx,
                    lp_tx,
                    shared: st.clone(),
                });
                streams.push(GenStream {
                    rx,
                    logprobs: lp_rx,
                    shared: st,
                });
            }
        }
        shared
            .requests_total
            .fetch_add(streams.len() as u64, Ordering::Relaxed);
        shared.ready.notify_one();
        Ok(streams)
    }

    /// Embeds each input (token ids) with the engine's embedding graph: one
    /// pooled row of the final norm per input (not normalized). Inputs run
    /// whole, several per step, between generation steps.
    pub async fn embed(&self, inputs: Vec<Vec<u32>>) -> Result<Vec<Vec<f32>>, SubmitError> {
        let l = self.limits;
        let Some((max_tokens, _)) = l.embedding else {
            return Err(SubmitError::Invalid(
                "this server has no embedding graph (it runs a pipeline)".into(),
            ));
        };
        for (i, t) in inputs.iter().enumerate() {
            if t.is_empty() {
                return Err(SubmitError::Invalid(format!("input {i} is empty")));
            }
            if t.len() > max_tokens {
                return Err(SubmitError::Invalid(format!(
                    "input {i} has {} tokens; an embedding input has at most {max_tokens} (the step size, -b)",
                    t.len()
                )));
            }
            if let Some(&bad) = t.iter().find(|&&x| x as usize >= l.vocab) {
                return Err(SubmitError::Invalid(format!(
                    "input {i}: token id {bad} is outside the vocabulary of {}",
                    l.vocab
                )));
            }
        }
        let shared = &self.owner.shared;
        let (tx, rx) = tokio::sync::oneshot::channel();
        {
            let mut q = shared.queue.lock().unwrap_or_else(|e| e.into_inner());
            if q.embeds.len() >= l.queue_capacity {
                return Err(SubmitError::QueueFull {
                    capacity: l.queue_capacity,
                });
            }
            q.embeds.push_back(EmbedJob { inputs, tx });
        }
        shared.ready.notify_one();
        match rx.await {
            Ok(r) => r.map_err(SubmitError::Invalid),
            Err(_) => Err(SubmitError::Invalid("the engine stopped".into())),
        }
    }

    fn check(&self, req: &GenRequest, extras: &GenExtras) -> Result<(), SubmitError> {
        let l = self.limits;
        if let Some(&(t, _)) = extras
            .penalties
            .logit_bias
            .iter()
            .find(|&&(t, _)| t as usize >= l.vocab)
        {
            return Err(SubmitError::Invalid(format!(
                "logit_bias: token id {t} is outside the vocabulary of {}",
                l.vocab
            )));
        }
        if extras.speculative == Some(true) && !self.speculative {
            return Err(SubmitError::Invalid(
                "speculative: true asks for speculative decoding, but this server was started without --draft-model or --spec-ngram".into(),
            ));
        }
        if req.prompt.is_empty() {
            return Err(SubmitError::Invalid("the prompt is empty".into()));
        }
        if req.max_tokens == 0 {
            return Err(SubmitError::Invalid("max_tokens must be at least 1".into()));
        }
        if let Some(&bad) = req.prompt.iter().find(|&&t| t as usize >= l.vocab) {
            return Err(SubmitError::Invalid(format!(
                "token id {bad} is outside the vocabulary of {}",
                l.vocab
            )));
        }
        req.sampling
            .validate()
            .map_err(|e| SubmitError::Invalid(e.0))?;
        if req.prompt.len().saturating_add(req.max_tokens) > l.context {
            return Err(SubmitError::TooLong {
                prompt_tokens: req.prompt.len(),
                max_tokens: req.max_tokens,
                context: l.context,
            });
        }
        Ok(())
    }

    /// The counters and gauges `/metrics` reports, as of now.
    pub fn stats(&self) -> EngineStats {
        let s = &self.owner.shared;
        let queue_depth = s
            .queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .jobs
            .iter()
            .filter(|j| !j.tx.is_closed())
            .count();
        EngineStats {
            requests_total: s.requests_total.load(Ordering::Relaxed),
            tokens_prompt_total: s.tokens_prompt_total.load(Ordering::Relaxed),
            tokens_generated_total: s.tokens_generated_total.load(Ordering::Relaxed),
            queue_depth,
            in_flight: s.in_flight.load(Ordering::Relaxed),
            kv_used: s.kv_used.load(Ordering::Relaxed),
            kv_total: s.kv_total.load(Ordering::Relaxed),
            kv_cached: s.kv_cached.load(Ordering::Relaxed),
            tokens_prompt_cached_total: s.tokens_prompt_cached_total.load(Ordering::Relaxed),
            tokens_per_s: f64::from_bits(s.tokens_per_s.load(Ordering::Relaxed)),
            preemptions_total: s.preemptions_total.load(Ordering::Relaxed),
            tokens_drafted_total: s.tokens_drafted_total.load(Ordering::Relaxed),
            tokens_accepted_total: s.tokens_accepted_total.load(Ordering::Relaxed),
        }
    }
}

/// Busy-time throughput: generated tokens over time with a sequence in
/// flight, published once at least a second of such time has gathered.
struct Throughput {
    tokens: u64,
    busy: Duration,
}

impl Throughput {
    const WINDOW: Duration = Duration::from_secs(1);

    fn add(&mut self, tokens: u64, busy: Duration, out: &AtomicU64) {
        self.tokens += tokens;
        self.busy += busy;
        if self.busy >= Self::WINDOW {
            let rate = self.tokens as f64 / self.busy.as_secs_f64();
            out.store(rate.to_bits(), Ordering::Relaxed);
            self.tokens = 0;
            self.busy = Duration::ZERO;
        }
    }
}

/// A running sequence's generation state.
struct Live {
    tx: mpsc::UnboundedSender<GenEvent>,
    sampler: Sampler,
    /// The grammar the tokens must follow, if any.
    constraint: Option<Constraint>,
    prompt_tokens: usize,
    max_tokens: usize,
    stop_tokens: Vec<u32>,
    /// Tokens sampled so far (a final stop token included).
    generated: usize,
    /// Where each token's log-probabilities go, and how many alternatives.
    logprobs: Option<(mpsc::UnboundedSender<TokenLogprobs>, usize)>,
    shared: Arc<StreamShared>,
}

/// Speculative decoding on the engine thread: a drafter per sequence that
/// takes part (prompt lookup, or one of the draft model's sessions, one
/// per sequence slot) and its draft-length controller.
struct SpecEngine {
    config: SpecConfig,
    /// Draft-model drafters no sequence uses (empty with prompt lookup).
    free: Vec<Drafter>,
    model: bool,
    seqs: HashMap<SeqId, SeqSpec>,
    drafts: Vec<u32>,
    /// This step's verifications: (sequence, guesses, kept guesses).
    verified: Vec<(SeqId, usize, usize)>,
}

struct SeqSpec {
    drafter: Drafter,
    adapt: Adapt,
}

impl SpecEngine {
    fn new(config: SpecConfig, free: Vec<Drafter>) -> SpecEngine {
        SpecEngine {
            config,
            model: !free.is_empty(),
            seqs: HashMap::with_capacity(free.len()),
            free,
            drafts: Vec::with_capacity(config.draft_max),
            verified: Vec::new(),
        }
    }

    /// A sequence starts: it guesses unless its request opted out.
    fn admit(&mut self, id: SeqId, extras: &GenExtras) {
        if extras.speculative == Some(false) {
            return;
        }
        let drafter = if self.model {
            match self.free.pop() {
                Some(d) => d,
                None => return,
            }
        } else {
            Drafter::ngram()
        };
        self.seqs.insert(
            id,
            SeqSpec {
                drafter,
                adapt: Adapt::default(),
            },
        );
    }

    /// Gives the drafters of sequences that ended back (before new
    /// sequences are admitted, so that each finds one).
    fn reclaim(&mut self, live: &HashMap<SeqId, Live>) {
        let ended: Vec<SeqId> = self
            .seqs
            .keys()
            .filter(|id| !live.contains_key(id))
            .copied()
            .collect();
        for id in ended {
            if let Some(s) = self.seqs.remove(&id) {
                if self.model {
                    self.free.push(s.drafter);
                }
            }
        }
    }

    /// Hands every decoding sequence its guesses for the next step.
    fn draft(&mut self, sched: &mut Scheduler, live: &HashMap<SeqId, Live>) {
        self.reclaim(live);
        let mut failed = Vec::new();
        for (&id, s) in &mut self.seqs {
            let Some(l) = live.get(&id) else { continue };
            if l.generated == 0 {
                continue;
            }
            let Some(history) = sched.decoding(id) else {
                continue;
            };
            // A kept guess is followed by one more sampled token.
            let left = l.max_tokens.saturating_sub(l.generated + 1);
            let k = s.adapt.choose(&self.config, left);
            if k == 0 {
                continue;
            }
            // A draft model catches up with the tokens it has not seen
            // (the whole prompt at first) outside the timed draft, so the
            // controller weighs what a guess costs, not the prompt.
            if s.drafter.prefill(history).is_err() {
                failed.push(id);
                continue;
            }
            let t = Instant::now();
            if s.drafter.draft(history, k, &mut self.drafts).is_err() {
                // The draft model failed: this sequence decodes plainly.
                failed.push(id);
                continue;
            }
            if self.model {
                s.adapt
                    .draft_time(self.drafts.len(), t.elapsed().as_secs_f64());
            }
            if self.drafts.len() >= self.config.draft_min.max(1) {
                sched.set_draft(id, &self.drafts);
            }
        }
        for id in failed {
            // Its session may hold anything now: it is not reused.
            self.seqs.remove(&id);
        }
    }

    /// After a step of `secs` that carried `plan`: the controllers learn
    /// the step's cost and this step's verifications, and the counters
    /// count them.
    fn record(&mut self, plan: &[super::scheduler::Slot], secs: f64, shared: &Shared) {
        for p in plan {
            if let Some(s) = self.seqs.get_mut(&p.id) {
                if p.samples {
                    s.adapt.step_time(p.tokens, secs);
                }
            }
        }
        for &(id, drafted, kept) in &self.verified {
            if let Some(s) = self.seqs.get_mut(&id) {
                s.adapt.verified(drafted, kept);
            }
            shared
                .tokens_drafted_total
                .fetch_add(drafted as u64, Ordering::Relaxed);
            shared
                .tokens_accepted_total
                .fetch_add(kept as u64, Ordering::Relaxed);
        }
    }
}

/// The engine thread: admits, schedules, steps, samples, retires, until the
/// last handle is dropped.
fn engine_loop(
    session: &mut Session,
    mut embed: Option<&mut Session>,
    mut spec: Option<&mut SpecEngine>,
    parallel: usize,
    shared: &Shared,
) {
    let mut embed_pool = embed.as_ref().map(|e| {
        let g = e.exec.kv_geom();
        KvPool::new(g.n_blocks, g.block)
    });
    let mut embeds: Vec<EmbedJob> = Vec::new();
    let geom = session.exec.kv_geom();
    let mut sched = Scheduler::new(
        SchedulerConfig {
            parallel,
            step_tokens: session.exec.max_chunk(),
            context: session.context(),
        },
        // The scheduler hands out the whole pool (the session's own
        // single-sequence allocator is not used here).
        KvPool::new(geom.n_blocks, geom.block),
    );
    shared.kv_total.store(sched.kv_total(), Ordering::Relaxed);
    let mut live: HashMap<SeqId, Live> = HashMap::with_capacity(parallel);
    let mut next_id: SeqId = 0;
    let mut batch = Batch::with_capacity(session.exec.max_chunk(), parallel, geom.n_blocks);
    let mut plan = Vec::with_capacity(parallel);
    // (sequence, token, whether it was a kept guess: already accepted by
    // the sampler before the next row was sampled).
    let mut sampled: Vec<(SeqId, u32, bool)> = Vec::with_capacity(parallel);
    let mut gone: Vec<SeqId> = Vec::with_capacity(parallel);
    let mut failed: Vec<(SeqId, String)> = Vec::new();
    let mut rate = Throughput {
        tokens: 0,
        busy: Duration::ZERO,
    };
    loop {
        if let Some(sp) = spec.as_deref_mut() {
            sp.reclaim(&live);
        }
        // Admit queued requests while a sequence can start; wait when idle.
        {
            let mut q = shared.queue.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                if q.shutdown {
                    // Queued and running streams see their channels close.
                    q.jobs.clear();
                    return;
                }
                while let Some(job) = q.jobs.front() {
                    if job.tx.is_closed() {
                        q.jobs.pop_front();
                        continue;
                    }
                    if !sched.can_admit(job.req.prompt.len()) {
                        break;
                    }
                    let job = q.jobs.pop_front().expect("looked at above");
                    let id = next_id;
                    next_id += 1;
                    let vocab = session.vocab();
                    let sampler = Sampler::new(job.req.sampling, vocab).and_then(|mut s| {
                        s.set_penalties(job.extras.penalties.clone(), vocab)?;
                        Ok(s)
                    });
                    match sampler {
                        Ok(mut sampler) if sched.admit(id, &job.req.prompt, job.req.max_tokens) => {
                            for &t in &job.req.prompt {
                                sampler.accept(t);
                            }
                            if let Some(sp) = spec.as_deref_mut() {
                                sp.admit(id, &job.extras);
                            }
                            shared.in_flight.fetch_add(1, Ordering::Relaxed);
                            shared
                                .tokens_prompt_total
                                .fetch_add(job.req.prompt.len() as u64, Ordering::Relaxed);
                            live.insert(
                                id,
                                Live {
                                    tx: job.tx,
                                    sampler,
                                    prompt_tokens: job.req.prompt.len(),
                                    max_tokens: job.req.max_tokens,
                                    stop_tokens: job.req.stop_tokens,
                                    generated: 0,
                                    logprobs: job.lp_tx.zip(job.extras.logprobs),
                                    constraint: job.extras.constraint,
                                    shared: job.shared,
                                },
                            );
                        }
                        Ok(_) => {
                            let _ = job
                                .tx
                                .send(GenEvent::Error("the request cannot fit the context".into()));
                        }
                        Err(e) => {
                            let _ = job.tx.send(GenEvent::Error(e.0));
                        }
                    }
                }
                embeds.extend(q.embeds.drain(..));
                if !sched.is_idle() || !embeds.is_empty() {
                    break;
                }
                q = shared.ready.wait(q).unwrap_or_else(|e| e.into_inner());
            }
        }
        if !embeds.is_empty() {
            match (embed.as_deref_mut(), embed_pool.as_mut()) {
                (Some(e), Some(pool)) => run_embeddings(e, pool, &mut embeds),
                _ => {
                    for j in embeds.drain(..) {
                        let _ = j.tx.send(Err("this engine has no embedding graph".into()));
                    }
                }
            }
        }
        // Sequences whose client has gone: their KV is free for this step.
        gone.clear();
        gone.extend(
            live.iter()
                .filter(|(_, l)| l.tx.is_closed())
                .map(|(&id, _)| id),
        );
        for &id in &gone {
            let end = live.get(&id).map_or(Finish::Cancelled, Live::gone_finish);
            retire(&mut sched, &mut live, id, Ok(end), shared);
        }
        if let Some(sp) = spec.as_deref_mut() {
            sp.draft(&mut sched, &live);
            sp.verified.clear();
        }
        plan.clear();
        plan.extend_from_slice(sched.schedule(&mut batch));
        if plan.is_empty() {
            continue;
        }
        let t0 = Instant::now();
        sampled.clear();
        // Here alone, or over every stage of the pipeline this session
        // leads: the same logits rows either way.
        let mut verified = spec.as_deref_mut().map(|s| &mut s.verified);
        let stepped = session.step(&batch).map(|logits| {
            for (j, slot) in plan.iter().enumerate() {
                if let (true, Some(l)) = (slot.samples, live.get_mut(&slot.id)) {
                    // A sequence that feeds guesses after its newest token
                    // has a row for each: row `i` follows guess `i`, and is
                    // the row a plain step gets only if guess `i` is the
                    // token sampled from row `i - 1`.
                    let rows = batch.logit_rows_of(j);
                    let n_rows = rows.len();
                    let entry = &batch.seq_table()[SEQ_TABLE_COLS * j..];
                    let end = (entry[0] + entry[1]) as usize;
                    let guesses = &batch.tokens()[end + 1 - n_rows..end];
                    let mut kept = 0;
                    for (i, r) in rows.enumerate() {
                        let row = logits.row(r);
                        let tok = match l.constraint.as_mut() {
                            None => l.sampler.sample(row),
                            Some(c) => match c.sample(&mut l.sampler, row) {
                                Ok(t) => t,
                                Err(e) => {
                                    failed.push((slot.id, e.to_string()));
                                    break;
                                }
                            },
                        };
                        if let Some((tx, top)) = &l.logprobs {
                            let _ = tx.send(l.sampler.logprobs(row, tok, *top));
                        }
                        if l.generated == 0 && i == 0 {
                            l.shared
                                .cached
                                .store(sched.reused_of(slot.id), Ordering::Relaxed);
                        }
                        let more = i + 1 < n_rows
                            && guesses[i] as u32 == tok
                            && !l.stop_tokens.contains(&tok)
                            && l.generated + i + 1 < l.max_tokens;
                        sampled.push((slot.id, tok, more));
                        if !more {
                            break;
                        }
                        l.sampler.accept(tok);
                        kept += 1;
                    }
                    if let (true, Some(v)) = (n_rows > 1, verified.as_deref_mut()) {
                        v.push((slot.id, n_rows - 1, kept));
                    }
                }
            }
        });
        if let Err(e) = stepped {
            let msg = e.to_string();
            for slot in &plan {
                retire(&mut sched, &mut live, slot.id, Err(msg.clone()), shared);
            }
            if session.pipeline().is_some() {
                // The stages may disagree on what ran: no later step can
                // be trusted. End every rank (mpirun then ends the job).
                eprintln!("error: the pipeline failed: {msg}");
                session.abort_pipeline(1);
                return;
            }
            continue;
        }
        sched.advance();
        for &(id, tok, accepted) in &sampled {
            let Some(l) = live.get_mut(&id) else {
                continue;
            };
            l.generated += 1;
            shared
                .tokens_generated_total
                .fetch_add(1, Ordering::Relaxed);
            let end = if l.stop_tokens.contains(&tok) {
                Some(Finish::Stop)
            } else if l.tx.send(GenEvent::Token(tok)).is_err() {
                Some(l.gone_finish())
            } else if l.generated >= l.max_tokens {
                Some(Finish::Length)
            } else {
                if !accepted {
                    l.sampler.accept(tok);
                }
                sched.push_token(id, tok);
                None
            };
            if let Some(f) = end {
                retire(&mut sched, &mut live, id, Ok(f), shared);
            }
        }
        // After the tokens sampled before the failure (the kept guesses
        // of a step that verified some), as plain steps would have sent
        // them.
        for (id, msg) in failed.drain(..) {
            retire(&mut sched, &mut live, id, Err(msg), shared);
        }
        if let Some(sp) = spec.as_deref_mut() {
            // Positions computed on guesses not kept are forgotten.
            for &(id, _, _) in &sp.verified {
                sched.rollback(id);
            }
            sp.record(&plan, t0.elapsed().as_secs_f64(), shared);
        }
        publish_kv(&sched, shared);
        shared
            .preemptions_total
            .store(sched.preemptions(), Ordering::Relaxed);
        rate.add(sampled.len() as u64, t0.elapsed(), &shared.tokens_per_s);
    }
}

impl Live {
    /// How a sequence whose stream is gone ended: normally when the client
    /// called [`GenStream::finish`], cancelled otherwise.
    fn gone_finish(&self) -> Finish {
        if self.shared.finished.load(Ordering::Relaxed) {
            Finish::Stop
        } else {
            Finish::Cancelled
        }
    }
}

/// Runs the queued embedding requests: their inputs, in order, packed into
/// steps of whole sequences (at most the step's sequences and tokens), each
/// on blocks of the embedding session's own KV pool taken for the step.
fn run_embeddings(session: &mut Session, pool: &mut KvPool, jobs: &mut Vec<EmbedJob>) {
    let max_seqs = session.exec.max_seqs();
    let max_tokens = session.exec.max_chunk();
    let mut results: Vec<Result<Vec<Vec<f32>>, String>> = jobs
        .iter()
        .map(|j| Ok(Vec::with_capacity(j.inputs.len())))
        .collect();
    let items: Vec<(usize, usize)> = jobs
        .iter()
        .enumerate()
        .flat_map(|(j, job)| (0..job.inputs.len()).map(move |i| (j, i)))
        .collect();
    let mut batch = Batch::with_capacity(max_tokens, max_seqs, pool.total_blocks());
    let mut blocks: Vec<Vec<u32>> = Vec::with_capacity(max_seqs);
    let mut at = 0;
    while at < items.len() {
        batch.clear();
        let (mut n, mut tokens) = (0, 0);
        while at + n < items.len() && n < max_seqs {
            let (j, i) = items[at + n];
            let input = &jobs[j].inputs[i];
            if n > 0 && tokens + input.len() > max_tokens {
                break;
            }
            let mut b = Vec::new();
            if !pool.reserve(&mut b, input.len()) {
                break;
            }
            batch.push(input, 0, &b);
            blocks.push(b);
            tokens += input.len();
            n += 1;
        }
        let out = if n == 0 {
            Err("an embedding input does not fit the step".to_string())
        } else {
            session
                .exec
                .step(&batch)
                .map(|rows| (0..n).map(|r| rows.row(r).to_vec()).collect::<Vec<_>>())
                .map_err(|e| e.to_string())
        };
        for b in &mut blocks {
            pool.release(b);
        }
        blocks.clear();
        let span = &items[at..at + n.max(1)];
        match out {
            Ok(rows) => {
                for (&(j, _), row) in span.iter().zip(rows) {
                    if let Ok(r) = &mut results[j] {
                        r.push(row);
                    }
                }
            }
            Err(m) => {
                for &(j, _) in span {
                    results[j] = Err(m.clone());
                }
            }
        }
        at += n.max(1);
    }
    for (job, r) in jobs.drain(..).zip(results) {
        let _ = job.tx.send(r);
    }
}

fn publish_kv(sched: &Scheduler, shared: &Shared) {
    shared.kv_used.store(sched.kv_used(), Ordering::Relaxed);
    shared.kv_cached.store(sched.kv_cached(), Ordering::Relaxed);
    shared
        .tokens_prompt_cached_total
        .store(sched.reused_tokens(), Ordering::Relaxed);
}

/// Ends a sequence: its KV blocks go back to the pool, it leaves the
/// in-flight count, then its stream gets its one final event (which a
/// cancelled stream no longer receives), so that a client that has its
/// answer never sees its own sequence in the statistics.
fn retire(
    sched: &mut Scheduler,
    live: &mut HashMap<SeqId, Live>,
    id: SeqId,
    end: Result<Finish, String>,
    shared: &Shared,
) {
    // A sequence that ended normally keeps its KV for a later prompt with
    // the same prefix; a cancelled one (its client left) or a failed one
    // frees it at once.
    if matches!(end, Ok(Finish::Stop | Finish::Length)) {
        sched.finish(id);
    } else {
        sched.remove(id);
    }
    publish_kv(sched, shared);
    let Some(l) = live.remove(&id) else {
        return;
    };
    shared.in_flight.fetch_sub(1, Ordering::Relaxed);
    let _ = l.tx.send(match end {
        Ok(finish) => GenEvent::Done {
            finish,
            prompt_tokens: l.prompt_tokens,
            completion_tokens: l.generated,
        },
        Err(e) => GenEvent::Error(e),
    });
}
