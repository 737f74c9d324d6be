//! Continuous batching: which tokens of which sequences go into the next
//! graph step.
//!
//! The scheduler knows sequences only as token lists and KV blocks; the
//! engine around it owns the samplers and the client streams. Every step:
//!
//! 1. **decode tokens first**: each running sequence whose tokens are all in
//!    the KV cache but its newest one feeds that token (one token, one
//!    logits row, the next sampled token);
//! 2. **prefill chunks** fill the rest of the step's token budget, oldest
//!    sequence first, so prompts are fed in chunks mixed with the other
//!    sequences' decode tokens;
//! 3. a sequence whose chunk reaches its newest token **samples** from this
//!    step's logits.
//!
//! KV memory is the executor's pool of blocks ([`KvPool`]). A new sequence
//! is admitted (at most `parallel` run at once) when the pool can hold its
//! whole prompt; its blocks are taken then, so a prompt once admitted is
//! never starved of KV. Decoding takes one more block every `BS` tokens.
//! When the pool is exhausted, the youngest running sequence is
//! **preempted**: its blocks go back to the pool and it waits, ahead of new
//! requests, to be fed again from its first token (recomputation, as vLLM
//! does). Because every kernel computes a sequence's rows independently of
//! the batch, a preempted sequence continues with exactly the tokens it
//! would have produced. A sequence whose prompt plus budget exceeds the
//! context can never run and is refused when it is added; one that does
//! fit always runs eventually, since the oldest running sequence is never
//! preempted and the pool holds a whole context.
//!
//! **Shared prompt prefixes.** Requests that arrive together often start
//! with the same tokens (a chat template's system prompt). A sequence that
//! no step has fed yet and whose prompt starts with more tokens an older
//! running sequence has than it holds (from the prefix cache, below) reads
//! that sequence's whole blocks for them
//! ([`KvPool::share`]); while the older one has not fed those positions
//! yet, the younger one waits for it (a step or two) rather than compute
//! them a second time. The shared tokens of a last, partial block are
//! copied instead ([`Batch::copy_block`], at the start of the step), into
//! the younger sequence's own block, when the older one has already fed
//! them. The younger one is fed from the first position past the shared
//! tokens. A prefix-cache entry (below) is a donor too, at that first
//! step: a sequence that waited for an older one which then finished
//! before it started (an `n` choice ending on its first token) takes the
//! prompt from the KV that sequence left in the cache. A sequence only
//! writes past its fed positions, so no block is written while another
//! sequence reads it.
//!
//! **Prefix cache.** A sequence that ends normally ([`Scheduler::finish`])
//! keeps its KV blocks as a cache entry: the tokens whose positions it fed
//! and the blocks holding them. A new sequence whose prompt starts with the
//! same tokens takes over the entry with the longest common prefix and is
//! fed from the first differing token (at least its last prompt token is
//! always fed, for its logits), as llama-server's slots reuse their cached
//! prompt. Where that token lies inside a block another sequence still
//! reads, the entry gives the positions up to the block's start, and the
//! sequence's first step takes the rest from a running sequence as above.
//! Entries are evicted, oldest first, whenever the pool needs their
//! blocks (admission, decode growth, readmission) and beyond `parallel` of
//! them; they never cause a preemption or a refusal. Since every kernel
//! computes a sequence's rows independently of the batch and of how its
//! tokens were chunked, a reused or shared position holds exactly the
//! values feeding it again would write, so the generated tokens do not
//! change.
//!
//! **Speculative decoding.** Before a step, the engine may give a decoding
//! sequence guesses of its next tokens ([`Scheduler::set_draft`]). The
//! decode pass then feeds its newest token and the guesses (as many as the
//! step's token budget and the pool allow without preempting anyone; none
//! otherwise) and asks logits for all of them; KV blocks are reserved for
//! every guessed position. After the step the engine appends the tokens
//! it kept and [`Scheduler::rollback`] forgets the positions computed on
//! guesses that were not kept, giving back the blocks past them.

use crate::exec::batch::WindowRing;
use crate::exec::{Batch, KvPool};
use std::collections::VecDeque;

/// A sequence's identity, chosen by the caller.
pub type SeqId = u64;

/// Limits of the scheduler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Sequences in flight at most (`-np`).
    pub parallel: usize,
    /// Tokens per step at most (decode tokens and prefill chunks together).
    pub step_tokens: usize,
    /// Positions one sequence may hold at most (prompt plus generated).
    pub context: usize,
}

/// Why a sequence cannot be added.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AddError {
    /// Its prompt plus its token budget exceed the context: it could never
    /// run.
    TooLong { tokens: usize, context: usize },
    /// The prompt is empty.
    Empty,
}

/// One sequence's place in the next step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    pub id: SeqId,
    /// Tokens fed in this step.
    pub tokens: usize,
    /// Whether this step's logits row for the sequence gives its next token
    /// (its chunk reaches its newest token).
    pub samples: bool,
}

/// A finished sequence's KV, kept for a later prompt with the same prefix.
#[derive(Debug)]
struct Cached {
    /// The tokens whose positions `blocks` hold (a prefix of the finished
    /// sequence's tokens: those it fed).
    tokens: Vec<u32>,
    blocks: Vec<u32>,
}

#[derive(Debug)]
struct Seq {
    id: SeqId,
    /// Prompt then generated tokens.
    tokens: Vec<u32>,
    /// Positions in the KV cache (a prefix of `tokens`).
    fed: usize,
    /// Whether a step has fed it since it was admitted (or readmitted after
    /// a preemption): until then it may still take shared positions.
    started: bool,
    blocks: Vec<u32>,
    /// `tokens.len()` never exceeds this.
    max_len: usize,
    /// Prompt positions it took from the prefix cache or another sequence
    /// since it was (re)admitted.
    reused: usize,
    /// Guesses of its next tokens for the next step (see
    /// [`Scheduler::set_draft`]).
    draft: Vec<u32>,
    /// Its ring in the window layers' pool, when they keep only their
    /// window (see [`Scheduler::with_window`]).
    ring: Vec<u32>,
}

/// The continuous-batching scheduler (see the module documentation).
#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    pool: KvPool,
    /// Admitted sequences, oldest first.
    running: Vec<Seq>,
    /// Preempted sequences, to be fed again before any new one is
    /// admitted (oldest preemption first).
    preempted: VecDeque<Seq>,
    /// The current step's plan.
    plan: Vec<Slot>,
    /// Sequences preempted so far (for statistics and tests).
    preemptions: u64,
    /// Finished sequences' KV, oldest first (see the module documentation).
    cache: VecDeque<Cached>,
    /// Per block, the cache entries holding it (a block is the cache's
    /// alone when this equals its pool references).
    cache_refs: Vec<u32>,
    /// Prompt positions whose KV came from the cache or from another
    /// running sequence (statistics, tests).
    reused: u64,
    /// A decode token and its guesses, as one step feeds them.
    scratch: Vec<u32>,
    /// The window layers' ring layout and pool, when they keep only their
    /// window.
    window: Option<(WindowRing, KvPool)>,
}

impl Scheduler {
    /// A scheduler over `pool` (whose blocks it hands out alone).
    pub fn new(cfg: SchedulerConfig, pool: KvPool) -> Self {
        let cfg = SchedulerConfig {
            parallel: cfg.parallel.max(1),
            step_tokens: cfg.step_tokens.max(1),
            context: cfg.context.min(pool.capacity()),
        };
        Scheduler {
            running: Vec::with_capacity(cfg.parallel),
            preempted: VecDeque::with_capacity(cfg.parallel),
            plan: Vec::with_capacity(cfg.parallel),
            cache: VecDeque::with_capacity(cfg.parallel + 1),
            cache_refs: vec![0; pool.total_blocks()],
            cfg,
            pool,
            preemptions: 0,
            reused: 0,
            scratch: Vec::new(),
            window: None,
        }
    }

    /// The scheduler for a model whose window layers keep only their
    /// window: each running sequence holds a ring of `ring.ring` blocks of
    /// their own pool (`parallel` rings). Such a model's prompt prefixes
    /// are neither cached nor shared: the positions before a window are
    /// gone from those layers (llama.cpp's `--swa-full` keeps them; here
    /// the session's `swa_full`).
    pub fn with_window(mut self, ring: WindowRing) -> Self {
        let pool = KvPool::new(self.cfg.parallel * ring.ring, ring.block);
        self.window = Some((ring, pool));
        self
    }

    /// Takes sequence `seq`'s ring in the window layers' pool, if the model
    /// has one (always there for a running sequence: the pool holds
    /// `parallel` rings).
    fn take_ring(&mut self, seq: &mut Seq) -> bool {
        match self.window.as_mut() {
            Some((r, pool)) => pool.reserve(&mut seq.ring, r.positions()),
            None => true,
        }
    }

    /// Gives sequence `seq`'s ring back.
    fn drop_ring(&mut self, seq: &mut Seq) {
        if let Some((_, pool)) = self.window.as_mut() {
            pool.release(&mut seq.ring);
        }
    }

    pub fn config(&self) -> SchedulerConfig {
        self.cfg
    }

    /// Checks that a sequence of `prompt` tokens generating at most
    /// `max_tokens` can ever run.
    pub fn check(&self, prompt: usize, max_tokens: usize) -> Result<(), AddError> {
        if prompt == 0 {
            return Err(AddError::Empty);
        }
        let tokens = prompt.saturating_add(max_tokens);
        // The last sampled token is never fed, so `tokens - 1` positions
        // are what the sequence holds at most; the refusal is on the
        // caller's own count, as a user states it.
        if tokens > self.cfg.context {
            return Err(AddError::TooLong {
                tokens,
                context: self.cfg.context,
            });
        }
        Ok(())
    }

    /// Whether a new sequence of `prompt` tokens can start now: fewer than
    /// `parallel` are running, none waits to be fed again after a
    /// preemption, and the pool can hold the prompt and still give every
    /// running sequence one more block.
    pub fn can_admit(&self, prompt: usize) -> bool {
        self.running.len() < self.cfg.parallel
            && self.preempted.is_empty()
            && self.available_blocks() >= self.pool.blocks_for(prompt) + self.running.len()
    }

    /// Free blocks plus the blocks the prefix cache would give back.
    fn available_blocks(&self) -> usize {
        self.pool.free_blocks() + self.cache_only_blocks()
    }

    /// Blocks held by prefix-cache entries and nothing else (evicting
    /// every entry frees exactly these).
    fn cache_only_blocks(&self) -> usize {
        (0..self.cache_refs.len())
            .filter(|&b| self.cache_refs[b] > 0 && self.cache_refs[b] == self.pool.refs(b as u32))
            .count()
    }

    /// Counts (`hold`) or uncounts a cache entry's blocks in `cache_refs`.
    fn cache_hold(&mut self, blocks: &[u32], hold: bool) {
        for &b in blocks {
            let r = &mut self.cache_refs[b as usize];
            *r = if hold { *r + 1 } else { r.saturating_sub(1) };
        }
    }

    /// Starts a sequence (call [`Self::can_admit`] first; [`Self::check`]
    /// must have passed). Returns false, changing nothing, if it cannot
    /// start now.
    pub fn admit(&mut self, id: SeqId, prompt: &[u32], max_tokens: usize) -> bool {
        if self.check(prompt.len(), max_tokens).is_err() || !self.can_admit(prompt.len()) {
            return false;
        }
        // Room for every token it may get: appending never reallocates.
        let mut tokens = Vec::with_capacity(prompt.len() + max_tokens);
        tokens.extend_from_slice(prompt);
        let mut seq = Seq {
            id,
            tokens,
            fed: 0,
            started: false,
            blocks: Vec::with_capacity(self.pool.blocks_for(prompt.len() + max_tokens)),
            max_len: prompt.len() + max_tokens,
            reused: 0,
            draft: Vec::new(),
            ring: Vec::new(),
        };
        // The cache entry sharing the longest prefix with the prompt (its
        // last token is fed in any case, for the logits).
        let best = self
            .cache
            .iter()
            .enumerate()
            .map(|(i, c)| (common_prefix(&c.tokens, prompt).min(prompt.len() - 1), i))
            .max_by_key(|&(n, i)| (n, i));
        // Feeding resumes at position n: the block holding it must be the
        // new sequence's alone (a block also read by others is reused only
        // up to its start; `share_prefix` may add the rest).
        let bs = self.pool.block_size();
        let writable = |c: &Cached, n: usize| {
            if n.is_multiple_of(bs) || self.pool.refs(c.blocks[n / bs]) == 1 {
                n
            } else {
                n - n % bs
            }
        };
        let best = best
            .map(|(n, i)| (writable(&self.cache[i], n), i))
            .filter(|_| self.window.is_none());
        if let Some((n, i)) = best.filter(|&(n, _)| n > 0) {
            let mut c = self.cache.remove(i).expect("found above");
            self.cache_hold(&c.blocks, false);
            self.pool.truncate(&mut c.blocks, n);
            seq.blocks.extend_from_slice(&c.blocks);
            seq.fed = n;
            seq.reused = n;
            self.reused += n as u64;
        }
        if !self.reserve(&mut seq.blocks, prompt.len()) || !self.take_ring(&mut seq) {
            self.pool.release(&mut seq.blocks);
            self.drop_ring(&mut seq);
            return false;
        }
        self.running.push(seq);
        true
    }

    /// Ends a sequence that finished: its fed positions stay in the prefix
    /// cache for a later prompt that starts with the same tokens. False if
    /// it is unknown.
    pub fn finish(&mut self, id: SeqId) -> bool {
        let Some(i) = self.running.iter().position(|s| s.id == id) else {
            return self.remove(id);
        };
        let mut s = self.running.remove(i);
        self.drop_ring(&mut s);
        if self.window.is_some() {
            // Nothing to cache: the window layers kept only a ring.
            self.pool.release(&mut s.blocks);
            return true;
        }
        // Positions computed on guesses that were not kept are not cached.
        s.fed = s.fed.min(s.tokens.len());
        s.tokens.truncate(s.fed);
        self.pool.truncate(&mut s.blocks, s.fed);
        if s.fed == 0 {
            return true;
        }
        self.cache_hold(&s.blocks, true);
        self.cache.push_back(Cached {
            tokens: s.tokens,
            blocks: s.blocks,
        });
        while self.cache.len() > self.cfg.parallel {
            self.evict_oldest();
        }
        true
    }

    /// Empties the prefix cache (its blocks go back to the pool).
    pub fn clear_cache(&mut self) {
        while self.evict_oldest() {}
    }

    fn evict_oldest(&mut self) -> bool {
        match self.cache.pop_front() {
            Some(mut c) => {
                self.cache_hold(&c.blocks, false);
                self.pool.release(&mut c.blocks);
                true
            }
            None => false,
        }
    }

    /// Grows `blocks` to hold `positions` positions, evicting cache entries
    /// (oldest first) while the pool is short. False, taking nothing more,
    /// if even an empty cache leaves too few blocks.
    fn reserve(&mut self, blocks: &mut Vec<u32>, positions: usize) -> bool {
        let need = self.pool.blocks_for(positions).saturating_sub(blocks.len());
        if need > self.available_blocks() {
            return false;
        }
        while self.pool.free_blocks() < need && self.evict_oldest() {}
        self.pool.reserve(blocks, positions)
    }

    /// Removes a sequence wherever it is and returns its KV blocks to the
    /// pool at once. False if it is unknown.
    pub fn remove(&mut self, id: SeqId) -> bool {
        if let Some(i) = self.running.iter().position(|s| s.id == id) {
            let mut s = self.running.remove(i);
            self.pool.release(&mut s.blocks);
            self.drop_ring(&mut s);
            return true;
        }
        if let Some(i) = self.preempted.iter().position(|s| s.id == id) {
            if let Some(mut s) = self.preempted.remove(i) {
                self.pool.release(&mut s.blocks);
                self.drop_ring(&mut s);
            }
            return true;
        }
        false
    }

    /// Plans the next step into `batch` and returns its slots, in batch
    /// order (the order of the step's logits rows). Empty when nothing can
    /// run.
    pub fn schedule(&mut self, batch: &mut Batch) -> &[Slot] {
        batch.clear();
        self.plan.clear();
        self.readmit();
        let mut budget = self.cfg.step_tokens;
        // Decode tokens first, then prefill chunks; oldest first in each.
        for decode in [true, false] {
            let mut i = 0;
            while i < self.running.len() && budget > 0 {
                let pending = self.running[i].tokens.len() - self.running[i].fed;
                if pending == 0 || (pending == 1) != decode {
                    i += 1;
                    continue;
                }
                if !decode && self.share_prefix(i, batch) == Share::Wait {
                    i += 1;
                    continue;
                }
                if decode && self.plan_draft(i, budget, batch) {
                    budget -= self.plan.last().map_or(0, |p| p.tokens);
                    i += 1;
                    continue;
                }
                let pending = self.running[i].tokens.len() - self.running[i].fed;
                let want = pending.min(budget);
                // Only decode tokens may preempt: in the decode pass the
                // younger sequences are not planned yet; prefill chunks
                // already hold their blocks (a prompt is reserved whole).
                match self.grow(i, want, decode) {
                    Grow::Fits(n) => {
                        self.running[i].started = true;
                        let s = &self.running[i];
                        batch.push_ring(&s.tokens[s.fed..s.fed + n], s.fed, &s.blocks, &s.ring, 1);
                        self.plan.push(Slot {
                            id: s.id,
                            tokens: n,
                            samples: s.fed + n == s.tokens.len(),
                        });
                        budget -= n;
                        i += 1;
                    }
                    // `i` now names the next sequence (this one was
                    // preempted).
                    Grow::Preempted => {}
                    Grow::Wait => i += 1,
                }
            }
        }
        // Guesses are for this step alone.
        for s in &mut self.running {
            s.draft.clear();
        }
        &self.plan
    }

    /// Gives decoding sequence `id` guesses of the tokens after its newest
    /// one, for the next [`Self::schedule`] only: it feeds its newest token
    /// and the guesses in one slot that asks a logits row for each (see
    /// [`Batch::logit_rows_of`]). Guesses past its token budget are
    /// dropped. False (nothing changes) if it is unknown or not decoding.
    pub fn set_draft(&mut self, id: SeqId, draft: &[u32]) -> bool {
        let Some(s) = self.running.iter_mut().find(|s| s.id == id) else {
            return false;
        };
        if !s.started || s.tokens.len() != s.fed + 1 {
            return false;
        }
        // Each kept guess is followed by one more sampled token.
        let room = s.max_len.saturating_sub(s.tokens.len() + 1);
        s.draft.clear();
        s.draft.extend_from_slice(&draft[..draft.len().min(room)]);
        true
    }

    /// The tokens (prompt, then generated) of a running sequence whose
    /// newest token is the only one not in the KV cache (it decodes).
    pub fn decoding(&self, id: SeqId) -> Option<&[u32]> {
        self.running
            .iter()
            .find(|s| s.id == id && s.started && s.tokens.len() == s.fed + 1)
            .map(|s| s.tokens.as_slice())
    }

    /// After a step and the tokens it kept ([`Self::push_token`]): forgets
    /// sequence `id`'s positions computed on guesses that were not kept
    /// (all but its newest token are in the KV cache again) and gives back
    /// the blocks past them. Nothing for an unknown sequence.
    pub fn rollback(&mut self, id: SeqId) {
        if let Some(s) = self.running.iter_mut().find(|s| s.id == id) {
            let keep = s.tokens.len().saturating_sub(1);
            if s.fed > keep {
                s.fed = keep;
                self.pool.truncate(&mut s.blocks, keep);
            }
        }
    }

    /// Plans running sequence `i`'s newest token with its guesses, if it
    /// has any, the budget holds at least one, and the pool holds their
    /// positions while still giving every younger running sequence one
    /// more block (guesses never cause a preemption). True if planned.
    fn plan_draft(&mut self, i: usize, budget: usize, batch: &mut Batch) -> bool {
        let s = &self.running[i];
        let k = s.draft.len().min(budget.saturating_sub(1));
        if k == 0 {
            return false;
        }
        let target = s.fed + 1 + k;
        let need = self.pool.blocks_for(target).saturating_sub(s.blocks.len());
        let younger = self.running.len() - i - 1;
        if need > 0 && need + younger > self.available_blocks() {
            return false;
        }
        let mut blocks = std::mem::take(&mut self.running[i].blocks);
        let ok = self.reserve(&mut blocks, target);
        let s = &mut self.running[i];
        s.blocks = blocks;
        if !ok {
            return false;
        }
        self.scratch.clear();
        self.scratch.push(s.tokens[s.fed]);
        self.scratch.extend_from_slice(&s.draft[..k]);
        batch.push_ring(&self.scratch, s.fed, &s.blocks, &s.ring, k + 1);
        self.plan.push(Slot {
            id: s.id,
            tokens: k + 1,
            samples: true,
        });
        true
    }

    /// The plan of the last [`Self::schedule`] call.
    pub fn plan(&self) -> &[Slot] {
        &self.plan
    }

    /// Records that the planned step ran: each planned sequence's tokens
    /// are now in the KV cache.
    pub fn advance(&mut self) {
        for p in &self.plan {
            if let Some(s) = self.running.iter_mut().find(|s| s.id == p.id) {
                s.fed += p.tokens;
            }
        }
    }

    /// Appends a sampled token to a sequence. False if the sequence is
    /// unknown or already at its token budget.
    pub fn push_token(&mut self, id: SeqId, token: u32) -> bool {
        match self.running.iter_mut().find(|s| s.id == id) {
            Some(s) if s.tokens.len() < s.max_len => {
                s.tokens.push(token);
                true
            }
            _ => false,
        }
    }

    /// Sequences admitted and not finished (preempted ones included).
    pub fn in_flight(&self) -> usize {
        self.running.len() + self.preempted.len()
    }
    pub fn running(&self) -> usize {
        self.running.len()
    }
    /// Sequences waiting to be fed again after a preemption.
    pub fn preempted(&self) -> usize {
        self.preempted.len()
    }
    pub fn preemptions(&self) -> u64 {
        self.preemptions
    }
    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.preempted.is_empty()
    }
    /// Positions held by sequences in flight (whole blocks; the prefix
    /// cache not counted).
    pub fn kv_used(&self) -> usize {
        (self.pool.total_blocks() - self.pool.free_blocks() - self.cache_only_blocks())
            * self.pool.block_size()
    }
    /// Positions held by the prefix cache alone (whole blocks), free for
    /// the taking.
    pub fn kv_cached(&self) -> usize {
        self.cache_only_blocks() * self.pool.block_size()
    }
    /// Prompt positions whose KV came from the prefix cache or from another
    /// running sequence so far.
    pub fn reused_tokens(&self) -> u64 {
        self.reused
    }
    /// Prompt positions sequence `id` took from the prefix cache or from
    /// another running sequence instead of computing them (0 if unknown).
    pub fn reused_of(&self, id: SeqId) -> usize {
        self.running
            .iter()
            .chain(&self.preempted)
            .find(|s| s.id == id)
            .map_or(0, |s| s.reused)
    }
    /// Positions the pool holds.
    pub fn kv_total(&self) -> usize {
        self.pool.capacity()
    }
    /// The ids of the sequences admitted (running, then preempted).
    pub fn ids(&self) -> impl Iterator<Item = SeqId> + '_ {
        self.running
            .iter()
            .map(|s| s.id)
            .chain(self.preempted.iter().map(|s| s.id))
    }

    /// Moves preempted sequences back to running while the pool holds
    /// their tokens (they are fed again from the first one).
    fn readmit(&mut self) {
        while let Some(s) = self.preempted.front() {
            let need = self.pool.blocks_for(s.tokens.len()) + self.running.len();
            if self.running.len() >= self.cfg.parallel || self.available_blocks() < need {
                break;
            }
            let mut s = self.preempted.pop_front().expect("checked above");
            let mut blocks = std::mem::take(&mut s.blocks);
            let ok = self.reserve(&mut blocks, s.tokens.len());
            s.blocks = blocks;
            let ring = self.take_ring(&mut s);
            debug_assert!(ok && ring, "counted above");
            self.running.push(s);
        }
    }

    /// Takes the blocks sequence `i` needs to feed `want` more tokens. If
    /// the pool is short it feeds what its blocks hold, or, when
    /// `may_preempt`, preempts the youngest running sequences (sequence `i`
    /// itself if it is the youngest).
    fn grow(&mut self, i: usize, want: usize, may_preempt: bool) -> Grow {
        loop {
            let target = self.running[i].fed + want;
            let mut blocks = std::mem::take(&mut self.running[i].blocks);
            let ok = self.reserve(&mut blocks, target);
            let s = &mut self.running[i];
            s.blocks = blocks;
            if ok {
                return Grow::Fits(want);
            }
            // Feed what the blocks already held allow (a prompt admitted
            // whole always fits; this is for decode growth).
            let held = s.blocks.len() * self.pool.block_size();
            if held > s.fed {
                return Grow::Fits((held - s.fed).min(want));
            }
            if !may_preempt {
                return Grow::Wait;
            }
            let victim = self.running.len() - 1;
            self.preempt(victim);
            if victim == i {
                return Grow::Preempted;
            }
        }
    }

    /// For running sequence `i`, which no step has fed yet (it may hold
    /// positions from the prefix cache): the older running sequences and
    /// the prefix-cache entries whose tokens share a prefix with its own
    /// (its last token aside, which is fed in any case). While an older
    /// sequence has yet to feed whole blocks of shared tokens beyond what
    /// sequence `i` holds and no one offers them now, sequence `i` waits.
    /// Otherwise, if an older sequence or a cache entry holds more shared
    /// positions than sequence `i` does, it takes the most: that donor's
    /// whole blocks for them and, for the rest, a copy of its next block
    /// into sequence `i`'s own (see [`Batch::copy_block`]); it is then fed
    /// from the first position past them. A cache entry stays in the cache
    /// (its blocks are read by one more sequence): this is how a sequence
    /// that waited for an older one gets the prompt KV that sequence left
    /// when it finished before the waiting one started (an `n` choice
    /// whose first token is a stop token).
    fn share_prefix(&mut self, i: usize, batch: &mut Batch) -> Share {
        let bs = self.pool.block_size();
        let me = &self.running[i];
        if me.started || self.window.is_some() {
            return Share::None;
        }
        let (own, held) = (me.tokens.len() - 1, me.fed);
        // The shared positions in whole blocks, and the most shared
        // positions a donor holds.
        let (mut whole, mut best) = (0, None::<(usize, Donor)>);
        let mut offer = |have: usize, d: Donor| {
            if have > best.map_or(held, |(n, _)| n) {
                best = Some((have, d));
            }
        };
        for (j, d) in self.running[..i].iter().enumerate() {
            let common = common_prefix(&d.tokens, &me.tokens).min(own);
            whole = whole.max(common / bs * bs);
            offer(common.min(d.fed), Donor::Running(j));
        }
        for (j, c) in self.cache.iter().enumerate() {
            offer(
                common_prefix(&c.tokens, &me.tokens).min(own),
                Donor::Cached(j),
            );
        }
        let have = best.map_or(held, |(n, _)| n);
        if have < whole {
            return Share::Wait;
        }
        let Some((n, d)) = best else {
            return Share::None;
        };
        // Blocks below `held / bs` already hold the right positions; the
        // ones from there to n's whole blocks are taken from the donor (a
        // partly held block is the sequence's own and goes back), and the
        // block holding position n, if any, is copied into the
        // sequence's own: a fresh block, or its own partly held one.
        let (k0, k) = (held / bs, n / bs);
        // Both lists are the scheduler's; take the donor's ids out while
        // the pool rewrites the sequence's.
        let donor = match d {
            Donor::Running(j) => std::mem::take(&mut self.running[j].blocks),
            Donor::Cached(j) => std::mem::take(&mut self.cache[j].blocks),
        };
        self.pool
            .share(&donor[k0..k], &mut self.running[i].blocks[k0..k]);
        if n > k * bs {
            // The donor holds positions k·bs..n. Copies apply in order,
            // so a donor whose own block k is a copy made in this step
            // passes on its contents. (A cache entry evicted later in this
            // step may see the block reused, but only after the copies.)
            batch.copy_block(donor[k], self.running[i].blocks[k]);
        }
        match d {
            Donor::Running(j) => self.running[j].blocks = donor,
            Donor::Cached(j) => self.cache[j].blocks = donor,
        }
        self.running[i].fed = n;
        self.running[i].reused += n - held;
        self.reused += (n - held) as u64;
        Share::Shared
    }

    fn preempt(&mut self, i: usize) {
        let mut s = self.running.remove(i);
        self.pool.release(&mut s.blocks);
        self.drop_ring(&mut s);
        s.fed = 0;
        s.started = false;
        s.reused = 0;
        self.preemptions += 1;
        self.preempted.push_back(s);
    }
}

/// How many leading tokens `a` and `b` share.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Where a sequence takes shared prompt positions from.
#[derive(Debug, Clone, Copy)]
enum Donor {
    /// An older running sequence (its index).
    Running(usize),
    /// A prefix-cache entry (its index).
    Cached(usize),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Share {
    /// No older sequence or cache entry shares a token the sequence can
    /// take.
    None,
    /// The sequence now reads a donor's blocks for its first positions.
    Shared,
    /// The older sequence has yet to feed the shared positions.
    Wait,
}

enum Grow {
    /// Feed this many tokens (at least one).
    Fits(usize),
    /// The sequence was preempted.
    Preempted,
    /// Nothing fits this step; the sequence waits.
    Wait,
}

#[cfg(test)]
mod tests;
