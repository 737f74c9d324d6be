//! The generation engine behind the server: a thread that owns the compiled
//! session and turns queued requests into streams of token ids.
//!
//! The HTTP layer only speaks this module's small API: [`EngineHandle::submit`]
//! a [`GenRequest`] (prompt ids, a token budget, sampling, stop ids) and read
//! [`GenEvent`]s from the returned [`GenStream`]; dropping the stream cancels
//! the sequence. [`EngineHandle::stats`] feeds `/metrics`.
//!
//! This implementation serves one sequence at a time over the
//! single-sequence [`Session`]: requests wait in a bounded queue (a full
//! queue refuses at once with [`SubmitError::QueueFull`]) and run in
//! arrival order. The API is the one a batching engine keeps.

use crate::generate::sampler::{Sampler, SamplerConfig};
use crate::session::{Model, Session, SessionError, SessionOptions};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use thiserror::Error;
use tokio::sync::mpsc;

/// One generation: the prompt as token ids, how many tokens to generate at
/// most, how to sample them and which sampled ids end it.
#[derive(Debug, Clone)]
pub struct GenRequest {
    pub prompt: Vec<u32>,
    /// At least 1; `prompt.len() + max_tokens` must fit the context.
    pub max_tokens: usize,
    pub sampling: SamplerConfig,
    /// Sampled ids that end the sequence (usually the tokenizer's
    /// end-of-sequence and end-of-turn ids). Such a token is counted in
    /// `completion_tokens` but not sent as a [`GenEvent::Token`].
    pub stop_tokens: Vec<u32>,
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
    Token(u32),
    Done {
        finish: Finish,
        prompt_tokens: usize,
        /// Tokens sampled, including a final stop token.
        completion_tokens: usize,
    },
    Error(String),
}

/// Why a request was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SubmitError {
    #[error("the server is busy: {capacity} requests are already waiting; retry later")]
    QueueFull { capacity: usize },
    #[error("the prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) exceed the context of {context} tokens")]
    TooLong {
        prompt_tokens: usize,
        max_tokens: usize,
        context: usize,
    },
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
    /// KV-cache cells in all.
    pub kv_total: usize,
    /// Generated tokens per second while at least one sequence was in
    /// flight, over the most recent stretch of at least one second of such
    /// time (0 before the first such stretch).
    pub tokens_per_s: f64,
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
}

/// How to start an engine.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// The session to compile (its `context` is the total KV size).
    pub session: SessionOptions,
    /// Sequences in flight at most (`-np`). This engine runs one at a time
    /// whatever the value.
    pub parallel: usize,
    /// Requests that may wait for a free sequence slot.
    pub queue_capacity: usize,
}

#[derive(Debug, Error)]
pub enum EngineError {
    #[error(transparent)]
    Session(#[from] SessionError),
    #[error("{0}")]
    Invalid(String),
    #[error("the engine thread could not start: {0}")]
    Thread(String),
}

struct Job {
    req: GenRequest,
    tx: mpsc::UnboundedSender<GenEvent>,
}

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
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
    /// f64 bits.
    tokens_per_s: AtomicU64,
}

/// Closes the queue when the last handle goes away; the engine thread then
/// finishes (cancelling what was queued) and exits.
struct Owner {
    shared: Arc<Shared>,
}

impl Drop for Owner {
    fn drop(&mut self) {
        let mut q = self.shared.queue.lock().unwrap_or_else(|e| e.into_inner());
        q.shutdown = true;
        self.shared.ready.notify_all();
    }
}

/// A handle on a running engine; cheap to clone and share between threads.
#[derive(Clone)]
pub struct EngineHandle {
    owner: Arc<Owner>,
    limits: EngineLimits,
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
}

impl GenStream {
    /// The next event; `None` after the final `Done`/`Error`.
    pub async fn next(&mut self) -> Option<GenEvent> {
        self.rx.recv().await
    }

    /// The next event, blocking the calling thread (not for async code).
    pub fn blocking_next(&mut self) -> Option<GenEvent> {
        self.rx.blocking_recv()
    }

    pub fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Option<GenEvent>> {
        self.rx.poll_recv(cx)
    }
}

impl EngineHandle {
    /// Compiles a session for `model` on a new engine thread and starts
    /// serving. Returns once the session is ready (or failed to compile).
    pub fn start(model: Model, cfg: EngineConfig) -> Result<EngineHandle, EngineError> {
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
        let session_opts = cfg.session.clone();
        std::thread::Builder::new()
            .name("llama-graph-engine".into())
            .spawn(move || {
                let session = match Session::new(&model, &session_opts) {
                    Ok(s) => s,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let _ = ready_tx.send(Ok((session.context(), session.vocab())));
                // The model's mappings stay alive with the session.
                engine_loop(session, &thread_shared);
                drop(model);
            })
            .map_err(|e| EngineError::Thread(e.to_string()))?;
        let (context, vocab) = ready_rx
            .recv()
            .map_err(|_| EngineError::Thread("the engine thread ended while loading".into()))??;
        Ok(EngineHandle {
            owner: Arc::new(Owner { shared }),
            limits: EngineLimits {
                context,
                parallel: cfg.parallel,
                queue_capacity: cfg.queue_capacity,
                vocab,
            },
        })
    }

    pub fn limits(&self) -> EngineLimits {
        self.limits
    }

    /// Checks `req` and queues it. Refuses at once, without waiting, when
    /// the queue is full.
    pub fn submit(&self, req: GenRequest) -> Result<GenStream, SubmitError> {
        let l = self.limits;
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
        let shared = &self.owner.shared;
        let (tx, rx) = mpsc::unbounded_channel();
        {
            let mut q = shared.queue.lock().unwrap_or_else(|e| e.into_inner());
            if q.jobs.len() >= l.queue_capacity {
                // Requests whose streams were dropped while waiting give
                // their places back.
                q.jobs.retain(|j| !j.tx.is_closed());
            }
            if q.jobs.len() >= l.queue_capacity {
                return Err(SubmitError::QueueFull {
                    capacity: l.queue_capacity,
                });
            }
            q.jobs.push_back(Job { req, tx });
        }
        shared.requests_total.fetch_add(1, Ordering::Relaxed);
        shared.ready.notify_one();
        Ok(GenStream { rx })
    }

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
            kv_total: self.limits.context,
            tokens_per_s: f64::from_bits(s.tokens_per_s.load(Ordering::Relaxed)),
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

fn engine_loop(mut session: Session, shared: &Shared) {
    let mut rate = Throughput {
        tokens: 0,
        busy: Duration::ZERO,
    };
    loop {
        let job = {
            let mut q = shared.queue.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                if q.shutdown {
                    // Queued streams see their channel close.
                    q.jobs.clear();
                    return;
                }
                if let Some(j) = q.jobs.pop_front() {
                    // Counted in flight before it leaves the queue's count,
                    // so that a reader never sees it in neither.
                    shared.in_flight.fetch_add(1, Ordering::Relaxed);
                    break j;
                }
                q = shared.ready.wait(q).unwrap_or_else(|e| e.into_inner());
            }
        };
        run_job(&mut session, job, shared, &mut rate);
    }
}

/// Runs one sequence to its end and releases it; every path sends exactly
/// one final event (which a cancelled stream no longer receives), after the
/// sequence has left the in-flight count, so that a client that has its
/// answer never sees its own sequence in the statistics.
fn run_job(session: &mut Session, job: Job, shared: &Shared, rate: &mut Throughput) {
    let Job { req, tx } = job;
    let t0 = Instant::now();
    let mut generated = 0usize;
    let end = if tx.is_closed() {
        Ok(Finish::Cancelled)
    } else {
        decode(session, &req, &tx, shared, &mut generated)
    };
    rate.add(generated as u64, t0.elapsed(), &shared.tokens_per_s);
    shared.kv_used.store(0, Ordering::Relaxed);
    shared.in_flight.fetch_sub(1, Ordering::Relaxed);
    let _ = tx.send(match end {
        Ok(finish) => GenEvent::Done {
            finish,
            prompt_tokens: req.prompt.len(),
            completion_tokens: generated,
        },
        Err(e) => GenEvent::Error(e),
    });
}

/// Feeds the prompt, then samples, sends and feeds tokens until a stop
/// token, the budget or a cancelled stream. `generated` counts sampled
/// tokens as they are sampled.
fn decode(
    session: &mut Session,
    req: &GenRequest,
    tx: &mpsc::UnboundedSender<GenEvent>,
    shared: &Shared,
    generated: &mut usize,
) -> Result<Finish, String> {
    let mut sampler = Sampler::new(req.sampling, session.vocab()).map_err(|e| e.0)?;
    for &t in &req.prompt {
        sampler.accept(t);
    }
    session.reset();
    shared
        .tokens_prompt_total
        .fetch_add(req.prompt.len() as u64, Ordering::Relaxed);
    // The prompt in chunks, so that a cancelled long prompt stops early.
    let chunk = session.exec.max_chunk().max(1);
    let (head, last) = req.prompt.split_at(req.prompt.len() - 1);
    for c in head.chunks(chunk) {
        if tx.is_closed() {
            return Ok(Finish::Cancelled);
        }
        let fed = session.feed(c).map(|_| ());
        shared.kv_used.store(session.position(), Ordering::Relaxed);
        fed.map_err(|e| e.to_string())?;
    }
    let mut logits = session.feed(last).map_err(|e| e.to_string())?;
    loop {
        let tok = sampler.sample(logits);
        *generated += 1;
        shared
            .tokens_generated_total
            .fetch_add(1, Ordering::Relaxed);
        shared.kv_used.store(session.position(), Ordering::Relaxed);
        if req.stop_tokens.contains(&tok) {
            return Ok(Finish::Stop);
        }
        if tx.send(GenEvent::Token(tok)).is_err() {
            return Ok(Finish::Cancelled);
        }
        if *generated >= req.max_tokens {
            return Ok(Finish::Length);
        }
        if tx.is_closed() {
            return Ok(Finish::Cancelled);
        }
        sampler.accept(tok);
        logits = session.feed(&[tok]).map_err(|e| e.to_string())?;
    }
}
