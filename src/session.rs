//! Running a model: the layer between the CLI and the compiler/executor.
//!
//! A [`Model`] comes from [`crate::weights::open`] (re-exported here, with
//! [`Model::open`], for the callers that know it by this path).
//! [`Session::new`] builds the graph for its arguments, compiles it into a
//! plan, binds the weights and prepares an executor with its KV pool.
//! [`Session::feed`] runs one sequence (the CLI's case: a batch of one
//! sequence per step) and keeps its position across calls; a batching
//! engine drives [`Session::exec_mut`] with batches of several sequences
//! whose blocks it takes from [`Session::pool_mut`]. A session that leads a
//! pipeline forwards each step through its [`PipelineLink`]
//! ([`crate::dist`]).
#![warn(missing_docs)]

use crate::dist::stage::{PipelineLink, StepHeader};
use crate::exec::batch::WindowRing;
use crate::exec::{
    bind_weights, materialize_packed, store_dtypes, Batch, BindError, ExecError, Executor, KvPool,
    Logits,
};
use crate::ir::{Graph, GraphError, LogitRows, Pooling};
pub use crate::kernels::kv::CacheType;
use crate::model::llama::BuildError;
use crate::model::{build_llama, BuildOptions};
use crate::passes::{partition, run_pipeline, PassError, PassList, PipelineReport, StagePlan};
use crate::plan::{compile, ExecPlan, PlanLimits};
pub use crate::weights::{LoadError, Model, ModelFormat, TensorSelector};
use std::ops::Range;
use thiserror::Error;

/// Why a session could not be compiled or a step could not run.
#[derive(Debug, Error)]
pub enum SessionError {
    /// The builder could not make the model's graph.
    #[error(transparent)]
    Build(#[from] BuildError),
    /// The graph failed a check.
    #[error(transparent)]
    Graph(#[from] GraphError),
    /// An optimisation pass failed.
    #[error(transparent)]
    Pass(#[from] PassError),
    /// The weights do not match the graph (missing, wrong shape or dtype).
    #[error(transparent)]
    Bind(#[from] BindError),
    /// The executor refused a step.
    #[error(transparent)]
    Exec(#[from] ExecError),
    /// The request cannot be honoured (too many tokens, an id outside the
    /// vocabulary, bad options); the message says which.
    #[error("{0}")]
    Invalid(String),
    /// A pipeline stage or its link failed.
    #[error("pipeline: {0}")]
    Pipeline(String),
}

/// How to compile a session.
#[derive(Debug, Clone)]
pub struct SessionOptions {
    /// Planned context (default 2048, capped by the model's limit): the KV
    /// pool's size in positions, shared by all sequences, and the longest
    /// sequence.
    pub context: Option<usize>,
    /// Largest step in tokens (the prefill chunk; with several sequences,
    /// all their tokens in one step).
    pub batch: usize,
    /// Most sequences in one step (1 for a single conversation).
    pub parallel: usize,
    /// Compute threads (default: every core).
    pub threads: usize,
    /// Logits for every position of a step, or only the last.
    pub logit_rows: LogitRows,
    /// Optimisation passes to run (default: all). With
    /// `logit_rows: All`, `last_logits` is skipped.
    pub passes: PassList,
    /// Exact f32 activations in matmuls and an f32 KV pool (`--exact`);
    /// when false, kernels may use faster approximate activations where
    /// they have them and the KV pool stores f16.
    pub exact: bool,
    /// How the KV pool stores keys (`-ctk`); `None`: f16, or f32 with
    /// `exact`.
    pub cache_type_k: Option<CacheType>,
    /// How the KV pool stores values (`-ctv`); `None` as for keys.
    pub cache_type_v: Option<CacheType>,
    /// Sliding-window layers keep every position, as the other layers do
    /// (`--swa-full`), instead of a ring holding only their window.
    pub swa_full: bool,
    /// Compiled as a speculative draft model ([`SessionOptions::for_draft`]):
    /// its guesses do not affect the output, so quantized matmuls take
    /// 8-bit activations without the remainder
    /// ([`MatmulMode::Draft`](crate::kernels::MatmulMode::Draft)), at half
    /// the integer work. `exact` overrides it.
    pub draft: bool,
}

impl SessionOptions {
    /// The options of a draft model's session beside a model compiled with
    /// these: one sequence, the last logit row, [`draft`](Self::draft)
    /// precision; the rest (context, batch, threads, `exact`, cache types)
    /// as here.
    pub fn for_draft(&self) -> SessionOptions {
        SessionOptions {
            parallel: 1,
            logit_rows: LogitRows::Last,
            draft: true,
            ..self.clone()
        }
    }

    /// How these options' matmuls treat activations.
    pub fn matmul_mode(&self) -> crate::kernels::MatmulMode {
        use crate::kernels::MatmulMode;
        if self.exact {
            MatmulMode::Exact
        } else if self.draft {
            MatmulMode::Draft
        } else {
            MatmulMode::Fast
        }
    }

    /// The KV pool's (key, value) types these options ask for.
    pub fn kv_types(&self) -> (CacheType, CacheType) {
        let default = if self.exact {
            CacheType::F32
        } else {
            CacheType::F16
        };
        (
            self.cache_type_k.unwrap_or(default),
            self.cache_type_v.unwrap_or(default),
        )
    }
}

impl Default for SessionOptions {
    fn default() -> Self {
        SessionOptions {
            context: None,
            batch: 512,
            parallel: 1,
            threads: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            logit_rows: LogitRows::Last,
            passes: PassList::all(),
            exact: false,
            cache_type_k: None,
            cache_type_v: None,
            swa_full: false,
            draft: false,
        }
    }
}

/// A compiled model with its KV cache.
pub struct Session {
    /// The executor: the bound weights, the arena and the worker pool.
    exec: Executor,
    /// The schedule and the arena's buffer plan.
    plan: ExecPlan,
    /// The compiled graph (after the passes).
    graph: Graph,
    /// What the passes did.
    passes: PipelineReport,
    /// Checkpoint tensors the graph does not read.
    unused_weights: Vec<String>,
    /// The KV pool's block allocator.
    pool: KvPool,
    /// The blocks of the session's own sequence ([`Session::feed`]).
    blocks: Vec<u32>,
    /// For a pipeline stage: its index, the number of stages and its layers.
    stage: Option<(usize, usize, Range<usize>)>,
    /// On rank 0 of a pipeline: the link to the later stages; `feed` runs
    /// stage 0 here and gets the logits back from the last stage.
    link: Option<PipelineLink>,
    /// The logits the last stage sent back.
    remote_logits: Vec<f32>,
    pos: usize,
    vocab: usize,
    /// The current step, reused across calls.
    batch: Batch,
    /// When the window layers keep only their window: their pool and the
    /// session's own sequence's ring in it.
    window: Option<SessionRing>,
}

/// The window layers' pool of a session and its own sequence's ring.
#[derive(Debug)]
struct SessionRing {
    layout: WindowRing,
    pool: KvPool,
    ring: Vec<u32>,
    /// Positions from here to the sequence's end are held by the ring.
    held_from: usize,
}

impl Session {
    /// Compiles `model` into a session: builds its graph, runs the passes,
    /// plans the arena, binds the weights and makes the KV pool.
    ///
    /// ```no_run
    /// use llama_graph::session::{Model, Session, SessionOptions};
    /// use llama_graph::tokenizer::EncodeOptions;
    ///
    /// let model = Model::open("SmolLM2-135M-Instruct.Q4_1.gguf".as_ref())?;
    /// let mut session = Session::new(&model, &SessionOptions::default())?;
    /// let tokenizer = model.tokenizer.as_ref().expect("a GGUF file has one");
    /// let prompt = tokenizer.encode("Once upon a time", EncodeOptions { add_bos: true, parse_special: false });
    /// let logits = session.feed(&prompt)?; // the last token's logits
    /// let next = llama_graph::generate::sampler::argmax(logits);
    /// println!("{}", tokenizer.decode(&[next as u32]));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn new(model: &Model, opts: &SessionOptions) -> Result<Session, SessionError> {
        Session::build(model, opts, None, None)
    }

    /// A session whose steps give one embedding per sequence (the final
    /// norm's rows pooled by `pooling`, `[N, E]`) instead of logits; every
    /// sequence of a step must be fed whole (from position 0) in that step.
    /// Read the rows with [`Executor::step`] on a batch of whole sequences.
    pub fn new_embedding(
        model: &Model,
        opts: &SessionOptions,
        pooling: Pooling,
    ) -> Result<Session, SessionError> {
        Session::build(model, opts, None, Some(pooling))
    }

    /// A session for stage `stage` of `plan`: the compiled graph is
    /// partitioned (see [`crate::passes::partition`](mod@crate::passes::partition)) and only this stage's
    /// graph is planned, bound (only its tensors are read) and run, with a
    /// KV pool for its layers only. Stage 0 embeds tokens; the others take
    /// the hidden state through [`Executor::step_with`].
    pub fn new_stage(
        model: &Model,
        opts: &SessionOptions,
        plan: &StagePlan,
        stage: usize,
    ) -> Result<Session, SessionError> {
        if stage >= plan.n_stages() {
            return Err(SessionError::Pipeline(format!(
                "stage {stage} of a {}-stage plan",
                plan.n_stages()
            )));
        }
        Session::build(model, opts, Some((plan, stage)), None)
    }

    fn build(
        model: &Model,
        opts: &SessionOptions,
        stage: Option<(&StagePlan, usize)>,
        pooling: Option<Pooling>,
    ) -> Result<Session, SessionError> {
        if opts.batch == 0 {
            return Err(SessionError::Invalid(
                "the batch size (-b) must be at least 1".into(),
            ));
        }
        if opts.threads == 0 {
            return Err(SessionError::Invalid(
                "the thread count (-t) must be at least 1".into(),
            ));
        }
        if opts.parallel == 0 {
            return Err(SessionError::Invalid(
                "the number of parallel sequences (-np) must be at least 1".into(),
            ));
        }
        let context = model.args.plan_context(opts.context);
        let mut bo = BuildOptions::new(context);
        bo.weight_dtypes = store_dtypes(&model.weights);
        bo.logit_rows = opts.logit_rows;
        bo.pooling = pooling;
        let (kt, vt) = opts.kv_types();
        bo.kv_dtype = kt.dtype();
        bo.kv_v_dtype = vt.dtype();
        // Window layers keep a ring of blocks per sequence instead of every
        // position, where that is smaller (not for embeddings, whose
        // sequences are fed whole in one step).
        let widest = (0..model.args.n_layers)
            .filter_map(|i| model.args.layer_window(i))
            .max();
        let ring = match widest {
            Some(w) if !opts.swa_full && pooling.is_none() => {
                let r = WindowRing::new(w, opts.batch, bo.kv_block);
                (r.ring * opts.parallel < bo.kv_blocks()).then_some(r)
            }
            _ => None,
        };
        bo.window_blocks = ring.map(|r| r.ring * opts.parallel);
        let mut graph = build_llama(&model.args, &bo)?;
        let stage_graph = |g: &Graph| -> Result<Graph, SessionError> {
            match stage {
                None => Ok(g.clone()),
                Some((plan, k)) => Ok(partition(g, plan)?.stages.swap_remove(k).graph),
            }
        };
        // Check every tensor against the builder's graph, where each has its
        // own checkpoint name and shape, before passes pack any of them.
        let unused_weights = bind_weights(&stage_graph(&graph)?, &model.weights)?.unused;
        let mut passes = match opts.logit_rows {
            LogitRows::All => opts.passes.clone().without("last_logits"),
            LogitRows::Last | LogitRows::Tail { .. } => opts.passes.clone(),
        };
        if opts.exact {
            // The exact kernels read rows one after another.
            passes = passes.without("interleave_weights");
        }
        let report = run_pipeline(&mut graph, &passes, |_, _| {})?;
        if stage.is_some() {
            graph = stage_graph(&graph)?;
        }
        let limits = PlanLimits {
            max_tokens: opts.batch,
            max_seqs: opts.parallel,
            context,
            max_logit_rows: opts.logit_rows.max_rows(opts.batch, opts.parallel),
        };
        let plan = compile(&graph, &limits)?;
        plan.buffers.check().map_err(SessionError::Invalid)?;
        // Packed weights are made once, here.
        let store = materialize_packed(&graph, &model.weights)?;
        let bound = bind_weights(&graph, &store)?;
        let mut exec = Executor::new(&graph, &plan, bound, opts.threads)?;
        exec.set_matmul_mode(opts.matmul_mode());
        let vocab = model.args.vocab_size.unwrap_or(0);
        let geom = exec.kv_geom();
        let pool = KvPool::new(geom.n_blocks, geom.block);
        let max = plan.max;
        Ok(Session {
            exec,
            plan,
            graph,
            passes: report,
            unused_weights,
            blocks: Vec::with_capacity(geom.n_blocks),
            pool,
            stage: stage.map(|(p, k)| (k, p.n_stages(), p.layers[k].clone())),
            link: None,
            remote_logits: Vec::new(),
            pos: 0,
            vocab,
            batch: Batch::with_capacity(max.s, max.n, geom.n_blocks),
            window: ring.map(|layout| SessionRing {
                layout,
                pool: KvPool::new(layout.ring * opts.parallel, layout.block),
                ring: Vec::with_capacity(layout.ring),
                held_from: 0,
            }),
        })
    }

    /// Makes this session (stage 0 of a pipeline) rank 0 of the pipeline:
    /// [`Session::feed`] sends each step on and returns the logits the last
    /// stage sends back.
    pub fn attach_pipeline(&mut self, link: PipelineLink) -> Result<(), SessionError> {
        match &self.stage {
            Some((0, n, _)) if *n == link.n_stages() => {
                self.link = Some(link);
                Ok(())
            }
            other => Err(SessionError::Pipeline(format!(
                "only stage 0 of a {}-stage plan leads a {}-rank pipeline (this session: {other:?})",
                link.n_stages(),
                link.n_stages()
            ))),
        }
    }

    /// The pipeline link, if this session leads one.
    pub fn pipeline(&mut self) -> Option<&mut PipelineLink> {
        self.link.as_mut()
    }

    /// After an error rank 0 reported: ends every rank of the pipeline this
    /// session leads (`MPI_Abort` under MPI).
    pub fn abort_pipeline(&mut self, code: i32) {
        if let Some(mut l) = self.link.take() {
            l.abort(code);
        }
    }

    /// Ends the pipeline this session leads (every rank stops; `reason`
    /// empty for a clean stop).
    pub fn stop_pipeline(&mut self, reason: &str) -> Result<(), SessionError> {
        match self.link.take() {
            Some(mut l) => l
                .stop(reason)
                .map_err(|e| SessionError::Pipeline(e.to_string())),
            None => Ok(()),
        }
    }

    /// Runs the current batch: here alone, or as stage 0 of the pipeline
    /// this session leads, in which case the step goes on to the later
    /// stages and, when `want_logits`, the last stage's logits come back
    /// (one row per sequence). Without `want_logits` a pipelined step
    /// returns no logits.
    fn run_batch(&mut self, want_logits: bool) -> Result<Option<&[f32]>, SessionError> {
        let out = run_step(
            &mut self.exec,
            self.link.as_mut(),
            &mut self.remote_logits,
            self.vocab,
            &self.batch,
            want_logits,
        )?;
        Ok(out.map(|l| l.last()))
    }

    /// Runs one step that the caller built (the server's scheduler: decode
    /// tokens and prefill chunks of several sequences, with their block
    /// tables from the caller's KV pool) and returns its logits, one row
    /// per sequence as [`Executor::step`] gives them. Alone, the step runs
    /// here; leading a pipeline, this rank runs stage 0, the later stages
    /// the rest, and the logits come back from the last one. Either way
    /// the rows are the same, so a caller is written once for both.
    pub fn step(&mut self, batch: &Batch) -> Result<Logits<'_>, SessionError> {
        run_step(
            &mut self.exec,
            self.link.as_mut(),
            &mut self.remote_logits,
            self.vocab,
            batch,
            true,
        )?
        .ok_or_else(|| SessionError::Pipeline("no logits came back".into()))
    }

    /// Greedy decoding of several sequences for throughput measurements:
    /// sequence `j` starts at position 0 with `starts[j]` and decodes `n`
    /// tokens, with its own blocks of the KV pool. Each step is one
    /// sequence's token (a micro-batch). Alone, the steps alternate;
    /// leading a pipeline, a sequence's next step starts as soon as its
    /// logits are back, so while the later stages work on one sequence this
    /// rank runs stage 0 of the next, and with as many sequences as stages
    /// every stage is busy. Returns each sequence's tokens; their blocks go
    /// back to the pool. The session's own sequence must be empty.
    pub fn decode_in_flight(
        &mut self,
        starts: &[u32],
        n: usize,
    ) -> Result<Vec<Vec<u32>>, SessionError> {
        let m = starts.len();
        if m == 0 || n == 0 || n > self.context() || self.pos != 0 {
            return Err(SessionError::Invalid(format!(
                "{m} sequences of {n} tokens from position {}: need at least one sequence of 1 to {} tokens from an empty session",
                self.pos,
                self.context()
            )));
        }
        let mut blocks: Vec<Vec<u32>> = vec![Vec::new(); m];
        let mut rings: Vec<Vec<u32>> = vec![Vec::new(); m];
        let result = self.decode_in_flight_with(starts, n, &mut blocks, &mut rings);
        for b in &mut blocks {
            self.pool.release(b);
        }
        if let Some(w) = self.window.as_mut() {
            for r in &mut rings {
                w.pool.release(r);
            }
        }
        result
    }

    fn decode_in_flight_with(
        &mut self,
        starts: &[u32],
        n: usize,
        blocks: &mut [Vec<u32>],
        rings: &mut [Vec<u32>],
    ) -> Result<Vec<Vec<u32>>, SessionError> {
        let m = starts.len();
        if let Some(w) = self.window.as_mut() {
            for r in rings.iter_mut() {
                if !w.pool.reserve(r, w.layout.positions()) {
                    return Err(SessionError::Invalid(format!(
                        "the window layers' pool holds rings for {} sequences, not {m} (use -np {m} or --swa-full)",
                        w.pool.total_blocks() / w.layout.ring
                    )));
                }
            }
        }
        for b in blocks.iter_mut() {
            if !self.pool.reserve(b, n) {
                return Err(SessionError::Invalid(format!(
                    "the KV pool has {} blocks of {} positions, too few for {m} sequences of {n} tokens (use a larger -c)",
                    self.pool.total_blocks(),
                    self.pool.block_size()
                )));
            }
        }
        fn argmax(l: &[f32]) -> u32 {
            let mut best = 0;
            for (i, &v) in l.iter().enumerate() {
                if v > l[best] {
                    best = i;
                }
            }
            best as u32
        }
        let perr = |e: crate::dist::DistError| SessionError::Pipeline(e.to_string());
        let mut next: Vec<u32> = starts.to_vec();
        let mut out: Vec<Vec<u32>> = vec![Vec::with_capacity(n); m];
        let mut issued: std::collections::VecDeque<usize> = Default::default();
        let vocab = self.vocab;
        let take = |link: &mut PipelineLink,
                    issued: &mut std::collections::VecDeque<usize>,
                    next: &mut Vec<u32>,
                    out: &mut Vec<Vec<u32>>|
         -> Result<(), SessionError> {
            let Some(front) = issued.pop_front() else {
                return Ok(());
            };
            let l = link.recv_logits().map_err(perr)?;
            if l.width != vocab || l.rows != 1 {
                return Err(SessionError::Pipeline(format!(
                    "{} x {} logits came back for one sequence's step",
                    l.rows, l.width
                )));
            }
            let t = argmax(&l.data);
            next[front] = t;
            out[front].push(t);
            Ok(())
        };
        for i in 0..n {
            for j in 0..m {
                if let Some(link) = self.link.as_mut() {
                    // Sequence j's token from step i - 1 is due first.
                    while out[j].len() < i && !issued.is_empty() {
                        take(link, &mut issued, &mut next, &mut out)?;
                    }
                }
                self.batch.clear();
                self.batch
                    .push_ring(&[next[j]], i, &blocks[j], &rings[j], 1);
                let step = self.exec.step(&self.batch)?;
                match self.link.as_mut() {
                    None => {
                        let t = argmax(step.last());
                        next[j] = t;
                        out[j].push(t);
                    }
                    Some(link) => {
                        let h = StepHeader { want_logits: true };
                        link.forward(&h, &self.batch, step.data).map_err(perr)?;
                        issued.push_back(j);
                    }
                }
            }
        }
        if let Some(link) = self.link.as_mut() {
            while !issued.is_empty() {
                take(link, &mut issued, &mut next, &mut out)?;
            }
        }
        Ok(out)
    }

    /// The executor: the bound weights, the arena and the worker pool.
    pub fn exec(&self) -> &Executor {
        &self.exec
    }

    /// The executor, to run steps the caller builds ([`Executor::step`]) or
    /// to switch its profiling and debugging knobs.
    pub fn exec_mut(&mut self) -> &mut Executor {
        &mut self.exec
    }

    /// The schedule and the arena's buffer plan.
    pub fn plan(&self) -> &ExecPlan {
        &self.plan
    }

    /// The compiled graph (after the passes; a stage's graph for a stage).
    pub fn graph(&self) -> &Graph {
        &self.graph
    }

    /// What the passes did.
    pub fn passes(&self) -> &PipelineReport {
        &self.passes
    }

    /// Checkpoint tensors the graph does not read.
    pub fn unused_weights(&self) -> &[String] {
        &self.unused_weights
    }

    /// The KV pool's block allocator.
    pub fn pool(&self) -> &KvPool {
        &self.pool
    }

    /// The KV pool's block allocator, for a caller that runs sequences of
    /// its own through [`Session::exec_mut`] (take their blocks here, give
    /// them back when done).
    pub fn pool_mut(&mut self) -> &mut KvPool {
        &mut self.pool
    }

    /// For a pipeline stage: its index, the number of stages and its layers.
    pub fn stage(&self) -> Option<(usize, usize, Range<usize>)> {
        self.stage.clone()
    }

    /// Tokens already in the KV cache.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// The planned context: the most tokens the session's sequence holds.
    pub fn context(&self) -> usize {
        self.exec.context()
    }

    /// The KV cache's size and types, as `run`, `chat`, `bench` and `serve`
    /// print it at start: `KV cache: 2048 positions, keys f16, values f16,
    /// 45.0 MiB`.
    pub fn kv_summary(&self) -> String {
        let (k, v) = self
            .exec
            .kv_types()
            .map_or(("-".into(), "-".into()), |(k, v)| {
                (k.to_string(), v.to_string())
            });
        let ring = self.window.as_ref().map_or(String::new(), |w| {
            format!(
                " (window layers: their last {} per sequence; --swa-full keeps all)",
                w.layout.positions()
            )
        });
        format!(
            "KV cache: {} positions{ring}, keys {k}, values {v}, {:.2} MiB{}",
            self.exec.kv_geom().capacity(),
            self.exec.kv_bytes() as f64 / 1048576.0,
            if self.stage.is_some() {
                " (this stage's layers)"
            } else {
                ""
            }
        )
    }

    /// The vocabulary size: the length of a logits row.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// Starts over: the sequence's KV blocks go back to the pool.
    pub fn reset(&mut self) {
        self.pos = 0;
        self.pool.release(&mut self.blocks);
        if let Some(w) = self.window.as_mut() {
            w.held_from = 0;
        }
    }

    /// Forgets every cached position from `pos` on (to re-feed a changed
    /// suffix, as a chat does when the template re-renders a turn), and
    /// returns the position the session goes on from: `pos` (or the
    /// current one, if lower), or 0 when the model's window layers no
    /// longer hold the window before `pos` (they keep only a ring of their
    /// latest positions), so the whole sequence must be fed again.
    pub fn rewind(&mut self, pos: usize) -> usize {
        self.pos = self.pos.min(pos);
        if let Some(w) = self.window.as_mut() {
            if !w.layout.can_resume(self.pos, w.held_from) {
                self.pos = 0;
            }
            if self.pos == 0 {
                w.held_from = 0;
            }
        }
        self.pool.truncate(&mut self.blocks, self.pos);
        self.pos
    }

    /// The window layers' ring, when they keep only their window: blocks
    /// per sequence, the widest window and the block size.
    pub fn window_ring(&self) -> Option<WindowRing> {
        self.window.as_ref().map(|w| w.layout)
    }

    /// Makes `tokens` the current step of the session's own sequence (the
    /// KV blocks must be reserved) and moves its position past them.
    fn push_own(&mut self, tokens: &[u32], rows: usize) {
        self.batch.clear();
        let ring = match self.window.as_mut() {
            Some(w) => {
                w.held_from = w.held_from.max(w.layout.held_from(self.pos + tokens.len()));
                w.ring.as_slice()
            }
            None => &[],
        };
        self.batch
            .push_ring(tokens, self.pos, &self.blocks, ring, rows);
        self.pos += tokens.len();
    }

    /// Feeds `tokens` (at most the batch size) as one step and returns all
    /// of the step's logits: one row per token with `LogitRows::All`, the
    /// last token's with `LogitRows::Last`.
    pub fn feed_step(&mut self, tokens: &[u32]) -> Result<crate::exec::Logits<'_>, SessionError> {
        if tokens.len() > self.exec.max_chunk() {
            return Err(ExecError::StepSize {
                got: tokens.len(),
                max: self.exec.max_chunk(),
            }
            .into());
        }
        self.check_and_reserve(tokens)?;
        self.push_own(tokens, 1);
        Ok(self.exec.step(&self.batch)?)
    }

    /// Feeds `tokens` (at most the batch size) as one step that asks for
    /// the logits of its last `rows` tokens (1 to `tokens.len()`), as
    /// verifying drafted tokens does: the step is an ordinary step of the
    /// graph whose `LastRows` returns `rows` rows for this sequence. The
    /// session must be compiled with `LogitRows::Tail { max }`, `max >=
    /// rows` (with `All` every token's row comes back). Returns the rows,
    /// in position order.
    pub fn feed_rows(&mut self, tokens: &[u32], rows: usize) -> Result<Logits<'_>, SessionError> {
        if tokens.len() > self.exec.max_chunk() {
            return Err(ExecError::StepSize {
                got: tokens.len(),
                max: self.exec.max_chunk(),
            }
            .into());
        }
        self.check_and_reserve(tokens)?;
        self.push_own(tokens, rows);
        run_step(
            &mut self.exec,
            self.link.as_mut(),
            &mut self.remote_logits,
            self.vocab,
            &self.batch,
            true,
        )?
        .ok_or_else(|| SessionError::Pipeline("no logits came back".into()))
    }

    /// Checks that `tokens` fit after the current position and are in the
    /// vocabulary, and takes the KV blocks they need.
    fn check_and_reserve(&mut self, tokens: &[u32]) -> Result<(), SessionError> {
        if tokens.is_empty() {
            return Err(SessionError::Invalid("nothing to feed".into()));
        }
        if self.pos + tokens.len() > self.context() {
            return Err(ExecError::ContextOverflow {
                tokens: tokens.len(),
                pos: self.pos,
                context: self.context(),
            }
            .into());
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= self.vocab) {
            return Err(SessionError::Invalid(format!(
                "token id {bad} is outside the vocabulary of {}",
                self.vocab
            )));
        }
        if let Some(w) = self.window.as_mut() {
            let need = w.layout.positions();
            if !w.pool.reserve(&mut w.ring, need) {
                return Err(SessionError::Invalid(format!(
                    "the window layers' pool has {} free blocks, too few for a ring of {}",
                    w.pool.free_blocks(),
                    w.layout.ring
                )));
            }
        }
        if !self.pool.reserve(&mut self.blocks, self.pos + tokens.len()) {
            return Err(SessionError::Invalid(format!(
                "the KV pool has {} free blocks of {} positions, too few for {} more tokens",
                self.pool.free_blocks(),
                self.pool.block_size(),
                tokens.len()
            )));
        }
        Ok(())
    }

    /// Feeds `tokens` in chunks of at most the batch size and returns the
    /// logits of the last one. Fails before any work if they do not fit.
    pub fn feed(&mut self, tokens: &[u32]) -> Result<&[f32], SessionError> {
        self.check_and_reserve(tokens)?;
        let chunk = self.exec.max_chunk();
        let n_chunks = tokens.len().div_ceil(chunk);
        let mut chunks = tokens.chunks(chunk);
        for c in chunks.by_ref().take(n_chunks - 1) {
            self.push_own(c, 1);
            self.run_batch(false)?;
        }
        let c = chunks.next().unwrap_or_default();
        self.push_own(c, 1);
        self.run_batch(true)?
            .ok_or_else(|| SessionError::Pipeline("no logits came back".into()))
    }
}

/// One step of `batch` here (`link` None), or as stage 0 of a pipeline:
/// stage 0's output goes on and, when `want_logits`, the last stage's
/// logits come back into `remote` (checked: rows of `vocab`, one per
/// sequence of the step).
fn run_step<'a>(
    exec: &'a mut Executor,
    link: Option<&mut PipelineLink>,
    remote: &'a mut Vec<f32>,
    vocab: usize,
    batch: &Batch,
    want_logits: bool,
) -> Result<Option<Logits<'a>>, SessionError> {
    let Some(link) = link else {
        return Ok(Some(exec.step(batch)?));
    };
    let out = exec.step(batch)?;
    let Some(l) = link
        .relay_step(batch, out.data, want_logits, vocab)
        .map_err(|e| SessionError::Pipeline(e.to_string()))?
    else {
        return Ok(None);
    };
    *remote = l.data;
    Ok(Some(Logits {
        rows: l.rows,
        vocab: l.width,
        data: remote,
    }))
}
