//! The engine's own thread: the step loop that admits, schedules and runs
//! the sequences (speculative decoding and embedding jobs included) and
//! publishes their tokens and the engine's statistics.

use super::{EmbedJob, Finish, GenEvent, GenExtras, Shared, StreamShared};
use crate::exec::{Batch, KvPool};
use crate::generate::constraint::Constraint;
use crate::generate::sampler::{Sampler, TokenLogprobs};
use crate::generate::spec::{Adapt, Drafter, SpecConfig};
use crate::ir::SEQ_TABLE_COLS;
use crate::server::scheduler::{Scheduler, SchedulerConfig, SeqId};
use crate::session::Session;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

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
pub(super) struct SpecEngine {
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
    /// Whether the drafter has read the sequence (its prompt) once.
    read: bool,
}

impl SpecEngine {
    pub(super) fn new(config: SpecConfig, free: Vec<Drafter>) -> SpecEngine {
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
                read: false,
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
            let k = s.adapt.choose_for(&self.config, left, &s.drafter, history);
            if k == 0 {
                continue;
            }
            // A draft model catches up with the tokens it has not seen
            // (the whole prompt at first, then at most
            // `spec::MAX_CATCH_UP`); `Adapt::draft_times` weighs it.
            let t = Instant::now();
            let Ok(fed) = s.drafter.prefill(history) else {
                failed.push(id);
                continue;
            };
            // Reading the prompt is not a cost of guessing.
            let (fed, catch_up) = if s.read {
                (fed, t.elapsed().as_secs_f64())
            } else {
                (0, 0.0)
            };
            s.read = true;
            let t = Instant::now();
            if s.drafter.draft(history, k, &mut self.drafts).is_err() {
                // The draft model failed: this sequence decodes plainly.
                failed.push(id);
                continue;
            }
            if self.model {
                s.adapt
                    .draft_times(self.drafts.len(), fed, catch_up, t.elapsed().as_secs_f64());
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

    /// Counts this step's verifications in `/metrics`: before any of the
    /// step's tokens reaches its client, so that a client that has its
    /// answer reads counters that include it.
    fn count(&self, shared: &Shared) {
        for &(_, drafted, kept) in &self.verified {
            shared
                .tokens_drafted_total
                .fetch_add(drafted as u64, Ordering::Relaxed);
            shared
                .tokens_accepted_total
                .fetch_add(kept as u64, Ordering::Relaxed);
        }
    }

    /// After a step of `secs` that carried `plan`: the controllers learn
    /// the step's cost and this step's verifications.
    fn record(&mut self, plan: &[crate::server::scheduler::Slot], secs: f64) {
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
        }
    }
}

/// The engine thread: admits, schedules, steps, samples, retires, until the
/// last handle is dropped.
pub(super) fn engine_loop(
    session: &mut Session,
    mut embed: Option<&mut Session>,
    mut spec: Option<&mut SpecEngine>,
    parallel: usize,
    shared: &Shared,
) {
    let mut embed_pool = embed.as_ref().map(|e| {
        let g = e.exec().kv_geom();
        KvPool::new(g.n_blocks, g.block)
    });
    let mut embeds: Vec<EmbedJob> = Vec::new();
    let geom = session.exec().kv_geom();
    let sched = Scheduler::new(
        SchedulerConfig {
            parallel,
            step_tokens: session.exec().max_chunk(),
            context: session.context(),
        },
        // The scheduler hands out the whole pool (the session's own
        // single-sequence allocator is not used here).
        KvPool::new(geom.n_blocks, geom.block),
    );
    // Window layers that keep only their window: a ring per sequence.
    let mut sched = match session.window_ring() {
        Some(r) => sched.with_window(r),
        None => sched,
    };
    shared.kv_total.store(sched.kv_total(), Ordering::Relaxed);
    let mut live: HashMap<SeqId, Live> = HashMap::with_capacity(parallel);
    let mut next_id: SeqId = 0;
    let mut batch = Batch::with_capacity(session.exec().max_chunk(), parallel, geom.n_blocks);
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
        if let Some(sp) = spec.as_deref() {
            sp.count(shared);
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
            sp.record(&plan, t0.elapsed().as_secs_f64());
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
    let max_seqs = session.exec().max_seqs();
    let max_tokens = session.exec().max_chunk();
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
                .exec_mut()
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
