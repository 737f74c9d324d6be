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
//!
//! The handle, requests and events are here; the engine's thread (the step
//! loop, speculative decoding, embedding jobs) is in `engine/run.rs`.
#![warn(missing_docs)]

use crate::generate::constraint::Constraint;
use crate::generate::sampler::{Penalties, SamplerConfig, TokenLogprobs};
use crate::generate::spec::{check_vocab, Drafter, SpecConfig};
use crate::ir::{LogitRows, Pooling};
use crate::session::{CacheType, Model, Session, SessionError, SessionOptions};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::task::{Context, Poll};
use thiserror::Error;
use tokio::sync::mpsc;

mod run;
use run::{engine_loop, SpecEngine};

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
                        let dopts = session_opts.for_draft();
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
                    let block = session.exec().kv_geom().block;
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
        if session.plan().max.n < cfg.parallel {
            return Err(EngineError::Invalid(format!(
                "the session was compiled for {} sequences per step, the engine runs {}",
                session.plan().max.n,
                cfg.parallel
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
                    let width = e.graph().outputs().first().map_or(0, |&o| {
                        e.graph().node(o).meta.shape.dims()[1]
                            .as_const()
                            .unwrap_or(0)
                    });
                    (e.exec().max_chunk().min(e.context()), width)
                });
                let _ = ready_tx.send(Ok((
                    session.context(),
                    session.vocab(),
                    embedding,
                    session.exec().kv_bytes(),
                    session.exec().kv_types(),
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
