//! The executor: runs a compiled plan one step at a time.
//!
//! Construction does all the work that does not depend on the step: the
//! schedule is resolved into a flat list of `Step`s whose inputs and
//! output are concrete locations (arena offsets, weight indices, cache
//! slots, step inputs), the arena and the KV pool are allocated, vector
//! weights are widened to f32. [`Executor::step`] then checks the step's
//! [`Batch`] (its sequences and their KV blocks), derives each token's
//! position and KV slot, binds the symbols (`S`, `N`, `T`) and calls one
//! kernel per step: no allocation, no thread spawn, no lock beyond the
//! pool's own hand-off.

use super::arena::{Arena, ArenaPtr};
use super::batch::Batch;
use super::bind::BoundWeights;
use crate::ir::{
    Bindings, CacheKind, DType, Graph, Op, Pooling, RopeParams, Shape, StepInput, WeightLayout,
};
use crate::kernels::{
    self, AttnWork, CacheType, Epilogue, KernelError, Kernels, KvGeom, KvHalf, KvStore, MatmulMode,
    StepSeqs, WeightRef,
};
use crate::plan::{ExecPlan, Value};
use crate::pool::ThreadPool;
use crate::weights::WeightTensor;
use std::collections::HashMap;
use std::io::Write;
use std::time::{Duration, Instant};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum ExecError {
    #[error("{node}: {source}")]
    Kernel {
        node: String,
        #[source]
        source: KernelError,
    },
    #[error("{node}: {message}")]
    Unsupported { node: String, message: String },
    #[error("a step of {tokens} tokens at position {pos} does not fit the planned context of {context} (use a larger --ctx-size)")]
    ContextOverflow {
        tokens: usize,
        pos: usize,
        context: usize,
    },
    #[error("a step holds 1 to {max} tokens, got {got}")]
    StepSize { got: usize, max: usize },
    #[error("a step holds 1 to {max} sequences, got {got}")]
    StepSeqs { got: usize, max: usize },
    #[error("a step returns at most {max} logit rows, {got} were asked for (compile the session with more: LogitRows::Tail)")]
    StepRows { got: usize, max: usize },
    #[error("bad step batch: {0}")]
    Batch(String),
    #[error("the graph has no output")]
    NoOutput,
}

/// Where a step's operand lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Loc {
    /// A step input: given by the batch or derived from it.
    Input(StepInput),
    Weight(usize),
    /// Index into `Executor::caches` (`2 * layer + kind`).
    Cache(usize),
    /// Offset into the arena, in f32 elements.
    Arena(usize),
    /// Index into `Executor::tables` (a constant-folded RoPE table).
    Table(usize),
}

#[derive(Debug, Clone)]
struct Step {
    name: String,
    op: Op,
    ins: Vec<(Loc, Shape)>,
    out: Loc,
    shape: Shape,
}

/// Per-step timing, when profiling is on.
#[derive(Debug, Clone, Default)]
pub struct OpProfile {
    pub name: String,
    pub op: &'static str,
    pub calls: u64,
    pub total: Duration,
}

/// The logits a step produced: `rows` rows of `vocab` values (each
/// sequence's last tokens, as many as the batch asks for it, in batch
/// order: see [`Batch::logit_rows_of`]; or one per token with
/// `LogitRows::All`).
pub struct Logits<'a> {
    pub rows: usize,
    pub vocab: usize,
    pub data: &'a [f32],
}

impl<'a> Logits<'a> {
    pub fn row(&self, i: usize) -> &'a [f32] {
        let d: &'a [f32] = self.data;
        &d[i * self.vocab..(i + 1) * self.vocab]
    }
    pub fn last(&self) -> &'a [f32] {
        self.row(self.rows - 1)
    }
}

/// Tokens per block of the fused QKV projection: its packed `[tokens,
/// (H+2Hkv)·D]` product lives in a scratch of this many rows (0.5 MiB for
/// SmolLM2) instead of one of the whole prefill chunk (2 MiB at 512).
const QKV_BLOCK: usize = 128;

/// Fused attention calls of at most this many multiply-adds (tens of
/// microseconds on one core) run on the calling thread: decode over a
/// cache of up to ~220 positions for SmolLM2 (576 wide), ~60 for a
/// 2048-wide model. Waking the pool's workers costs more than that work
/// when the cores are shared. Beyond it, decode attention runs its
/// sequences' key spans on the pool (`kernels::attention::paged`); the
/// threshold changes where rows are computed, never their values.
pub const SERIAL_ATTENTION_WORK: usize = 1 << 18;

pub struct Executor {
    steps: Vec<Step>,
    weights: Vec<WeightTensor>,
    /// How each weight's rows are stored (by weight index; the graph's
    /// packed weights say, see [`crate::ir::WeightLayout`]).
    layouts: Vec<WeightLayout>,
    /// Rank-1 weights (norm scales) widened to f32 once, by weight index.
    vectors: HashMap<usize, Vec<f32>>,
    /// The KV pool: one store per (layer, K/V), index `2 * layer + kind`.
    caches: Vec<KvStore>,
    geom: KvGeom,
    /// Constant-folded RoPE tables, computed once here.
    tables: Vec<kernels::RopeTable>,
    /// Scratch of the fused attention kernel (sized for the largest step).
    attn_work: Option<AttnWork>,
    /// Each token's position and KV slot in the current step.
    positions: Vec<i32>,
    slots: Vec<i32>,
    /// Scratch holding the packed `[S, (H + 2Hkv)·D]` result of a fused
    /// QKV projection before its epilogue scatters it.
    qkv_scratch: Vec<f32>,
    /// Exact f32 activations in matmuls (`kernels::MatmulMode::Exact`; otherwise `Fast`).
    exact: bool,
    /// The kernels of the instruction-set level, resolved once.
    kernels: &'static Kernels,
    arena: Arena,
    pool: ThreadPool,
    /// A one-thread pool: small fused-attention calls (decode over a short
    /// cache) run on the calling thread instead of paying a hand-off.
    serial: ThreadPool,
    /// Threshold (multiply-adds) for running fused attention serially.
    serial_attention_work: usize,
    /// The longest sequence, in positions.
    context: usize,
    max_chunk: usize,
    max_seqs: usize,
    /// The most logit rows (`R`) a step may ask for.
    max_rows: usize,
    output: (Loc, Shape),
    trace: Option<Box<dyn Write + Send>>,
    profile: Option<Vec<OpProfile>>,
}

fn elems(d: DType) -> usize {
    match d {
        DType::F32 | DType::I32 => 1,
        _ => 0,
    }
}

impl Executor {
    /// Prepares `plan` (compiled from `graph`) to run with `weights` on
    /// `threads` threads.
    pub fn new(
        graph: &Graph,
        plan: &ExecPlan,
        weights: BoundWeights,
        threads: usize,
    ) -> Result<Executor, ExecError> {
        let context = plan.max.t;
        let max_chunk = plan.max.s;
        let max_seqs = plan.max.n;
        let max_rows = plan.max.r;
        let names: Vec<String> = weights.tensors.keys().cloned().collect();
        let windex: HashMap<&str, usize> = names
            .iter()
            .enumerate()
            .map(|(i, n)| (n.as_str(), i))
            .collect();
        let tensors: Vec<WeightTensor> = weights.tensors.into_values().collect();
        let layouts: Vec<WeightLayout> = names
            .iter()
            .map(|n| graph.packed_weight(n).map(|p| p.layout).unwrap_or_default())
            .collect();
        let mut caches: Vec<KvStore> = Vec::new();
        let mut geom = KvGeom {
            n_blocks: 0,
            n_kv_heads: 0,
            head_dim: 0,
            block: 0,
        };
        // Constants first: every RoPE table, computed once.
        let mut tables = Vec::new();
        let mut table_index: HashMap<String, usize> = HashMap::new();
        for &id in &plan.order {
            let node = graph.node(id);
            if let Op::RopeTable { params, max_pos } = &node.op {
                let t = kernels::RopeTable::new(
                    params.head_dim,
                    params.theta as f32,
                    params.scaling.map(Into::into),
                    *max_pos,
                )
                .map_err(|e| ExecError::Unsupported {
                    node: node.name.clone(),
                    message: e.to_string(),
                })?;
                table_index.insert(node.name.clone(), tables.len());
                tables.push(t);
            }
        }
        let loc_of = |v: &Value| -> Result<Loc, String> {
            Ok(match v {
                Value::Input(k) => Loc::Input(*k),
                Value::Weight(n) => Loc::Weight(
                    *windex
                        .get(n.as_str())
                        .ok_or_else(|| format!("weight `{n}` is not bound"))?,
                ),
                Value::Cache { layer, kind } => {
                    Loc::Cache(2 * layer + usize::from(*kind == CacheKind::V))
                }
                Value::Arena(b) => {
                    let off = plan.buffers.buffers[*b].offset;
                    debug_assert_eq!(off % 4, 0);
                    Loc::Arena(off / 4)
                }
                Value::Constant(n) => Loc::Table(
                    *table_index
                        .get(n)
                        .ok_or_else(|| format!("constant `{n}` is not computed"))?,
                ),
            })
        };
        let mut steps = Vec::new();
        let mut vectors = HashMap::new();
        for &id in &plan.order {
            let node = graph.node(id);
            let unsupported = |m: String| ExecError::Unsupported {
                node: node.name.clone(),
                message: m,
            };
            let out = loc_of(&plan.values[&id]).map_err(unsupported)?;
            match &node.op {
                Op::KvCache { layer, kind } => {
                    let d: Vec<usize> = node
                        .meta
                        .shape
                        .dims()
                        .iter()
                        .filter_map(|d| d.as_const())
                        .collect();
                    let g = match kind {
                        CacheKind::K => KvGeom {
                            n_blocks: d[0],
                            n_kv_heads: d[1],
                            head_dim: d[2],
                            block: d[3],
                        },
                        CacheKind::V => KvGeom {
                            n_blocks: d[0],
                            n_kv_heads: d[1],
                            head_dim: d[3],
                            block: d[2],
                        },
                    };
                    if geom.n_blocks != 0 && g != geom {
                        return Err(unsupported(format!(
                            "every layer's cache must have one geometry, got {g:?} and {geom:?}"
                        )));
                    }
                    geom = g;
                    let slot = 2 * layer + 1;
                    if caches.len() <= slot {
                        caches.resize(slot + 1, KvStore::F32(Vec::new()));
                    }
                    let Loc::Cache(c) = out else {
                        unreachable!("a cache value is a cache")
                    };
                    let ty = CacheType::of_dtype(node.meta.dtype).ok_or_else(|| {
                        unsupported(format!(
                            "a KV cache of {} is not supported",
                            node.meta.dtype
                        ))
                    })?;
                    // Keys: two dims of one key are BS elements apart.
                    let run = if *kind == CacheKind::K { geom.block } else { 1 };
                    caches[c] = KvStore::new(ty, geom.elems(), run)
                        .map_err(|e| unsupported(e.to_string()))?;
                    continue;
                }
                Op::Weight { .. } => {
                    if let Loc::Weight(w) = out {
                        if node.meta.shape.rank() == 1 {
                            let t = &tensors[w];
                            let n = t.shape[0];
                            let mut v = vec![0.0f32; n];
                            kernels::dequantize_row(t.dtype, t.data.as_bytes(), &mut v)
                                .map_err(|e| unsupported(e.to_string()))?;
                            vectors.insert(w, v);
                        }
                    }
                    continue;
                }
                Op::Reshape | Op::RopeTable { .. } | Op::Send { .. } => continue,
                op if op.step_input().is_some() => continue,
                _ => {}
            }
            // A cache write's value is the cache (f32 or f16), not an activation.
            if elems(node.meta.dtype) == 0 && !matches!(node.op, Op::KvWrite) {
                return Err(unsupported(format!(
                    "activations of dtype {} are not supported",
                    node.meta.dtype
                )));
            }
            let ins = graph
                .inputs(id)
                .into_iter()
                .map(|i| {
                    Ok((
                        loc_of(&plan.values[&i]).map_err(unsupported)?,
                        graph.node(i).meta.shape.clone(),
                    ))
                })
                .collect::<Result<Vec<_>, ExecError>>()?;
            steps.push(Step {
                name: node.name.clone(),
                op: node.op.clone(),
                ins,
                out,
                shape: node.meta.shape.clone(),
            });
        }
        // Scratch for the fused ops, sized once for the largest step.
        let mut attn_work = None;
        let mut qkv_len = 0usize;
        for st in &steps {
            match st.op {
                Op::Attention { n_rep, .. } if attn_work.is_none() => {
                    attn_work = Some(AttnWork::new(&geom, n_rep, max_chunk, max_seqs, threads));
                }
                Op::QkvRopeCache {
                    n_heads,
                    n_kv_heads,
                    head_dim,
                    ..
                } => {
                    qkv_len = qkv_len
                        .max(max_chunk.min(QKV_BLOCK) * (n_heads + 2 * n_kv_heads) * head_dim);
                }
                _ => {}
            }
        }
        let out_id = *graph.outputs().first().ok_or(ExecError::NoOutput)?;
        let output = (
            loc_of(&plan.values[&out_id]).map_err(|m| ExecError::Unsupported {
                node: "output".into(),
                message: m,
            })?,
            graph.node(out_id).meta.shape.clone(),
        );
        Ok(Executor {
            steps,
            weights: tensors,
            layouts,
            vectors,
            caches,
            geom,
            tables,
            attn_work,
            positions: vec![0; max_chunk],
            slots: vec![0; max_chunk],
            qkv_scratch: vec![0.0; qkv_len],
            exact: true,
            kernels: Kernels::current(),
            arena: Arena::new(plan.buffers.arena_bytes),
            pool: ThreadPool::new(threads),
            serial: ThreadPool::new(1),
            serial_attention_work: SERIAL_ATTENTION_WORK,
            context,
            max_chunk,
            max_seqs,
            max_rows,
            output,
            trace: None,
            profile: None,
        })
    }

    /// Chooses exact f32 activations for matmuls (the default) or, where the
    /// kernels offer it, faster approximate ones (`--exact` off).
    pub fn set_exact(&mut self, exact: bool) {
        self.exact = exact;
    }

    pub fn exact(&self) -> bool {
        self.exact
    }

    /// Fused attention calls of at most `work` multiply-adds run on the
    /// calling thread (default [`SERIAL_ATTENTION_WORK`]); 0 always uses the pool.
    pub fn set_serial_attention_work(&mut self, work: usize) {
        self.serial_attention_work = work;
    }

    /// Writes a line per op as it runs (name, op, shapes) to `w`.
    pub fn set_trace(&mut self, w: Option<Box<dyn Write + Send>>) {
        self.trace = w;
    }

    /// Turns per-op timing on or off.
    pub fn set_profiling(&mut self, on: bool) {
        self.profile = on.then(|| {
            self.steps
                .iter()
                .map(|s| OpProfile {
                    name: s.name.clone(),
                    op: s.op.kind(),
                    ..Default::default()
                })
                .collect()
        });
    }

    pub fn profile(&self) -> Option<&[OpProfile]> {
        self.profile.as_deref()
    }

    /// The longest sequence a step may extend, in positions.
    pub fn context(&self) -> usize {
        self.context
    }

    /// The most tokens per step.
    pub fn max_chunk(&self) -> usize {
        self.max_chunk
    }

    /// The most sequences per step.
    pub fn max_seqs(&self) -> usize {
        self.max_seqs
    }

    /// The most logit rows a step may ask for (see [`Batch::push_rows`]).
    pub fn max_logit_rows(&self) -> usize {
        self.max_rows
    }

    /// The KV pool's geometry (blocks, heads, head dim, block size).
    pub fn kv_geom(&self) -> KvGeom {
        self.geom
    }

    /// Bytes the KV pool takes (every layer's keys and values).
    pub fn kv_bytes(&self) -> usize {
        self.caches.iter().map(KvStore::bytes).sum()
    }

    /// The types of the KV pool's keys and values (of the first layer this
    /// executor holds; every layer has the same), or `None` without a cache.
    pub fn kv_types(&self) -> Option<(CacheType, CacheType)> {
        self.caches
            .chunks_exact(2)
            .find(|c| !c[0].is_empty())
            .map(|c| (c[0].cache_type(), c[1].cache_type()))
    }

    pub fn threads(&self) -> usize {
        self.pool.n_threads()
    }

    /// Number of kernel calls per step.
    pub fn n_steps(&self) -> usize {
        self.steps.len()
    }

    /// Runs the graph for one step's batch (the tokens of one or more
    /// sequences, their positions and KV blocks) and returns the logits.
    /// The batch is checked first: token and sequence counts within the
    /// plan, every sequence within the context, its block list long enough
    /// and inside the pool.
    pub fn step(&mut self, batch: &Batch) -> Result<Logits<'_>, ExecError> {
        self.step_with(batch, &[])
    }

    /// Runs one step of a pipeline stage's graph (see
    /// [`crate::passes::partition`](mod@crate::passes::partition)): the first stage embeds the batch's
    /// tokens, the others read `hidden`, the `[S, E]` values their `Recv`
    /// node stands for (what the previous stage sent for this batch).
    /// Returns the graph's output: the logits on the last stage, the hidden
    /// state to send on the others.
    pub fn step_with(&mut self, batch: &Batch, hidden: &[f32]) -> Result<Logits<'_>, ExecError> {
        let s = batch.n_tokens();
        if s == 0 || s > self.max_chunk {
            return Err(ExecError::StepSize {
                got: s,
                max: self.max_chunk,
            });
        }
        let n = batch.n_seqs();
        if n > self.max_seqs {
            return Err(ExecError::StepSeqs {
                got: n,
                max: self.max_seqs,
            });
        }
        let seqs = StepSeqs::new(batch.seq_table(), batch.block_table(), s, &self.geom)
            .map_err(|e| ExecError::Batch(e.to_string()))?;
        if let Some(long) = seqs.iter().find(|q| q.keys() > self.context) {
            return Err(ExecError::ContextOverflow {
                tokens: long.count,
                pos: long.start,
                context: self.context,
            });
        }
        let r = seqs.logit_rows();
        if r > self.max_rows {
            return Err(ExecError::StepRows {
                got: r,
                max: self.max_rows,
            });
        }
        self.copy_blocks(batch.copy_table())?;
        seqs.fill_positions_and_slots(&mut self.positions[..s], &mut self.slots[..s]);
        let b = Bindings::new(s, n, seqs.max_keys()).with_rows(r);
        let arena = self.arena.base();
        for i in 0..self.steps.len() {
            let t0 = self.profile.as_ref().map(|_| Instant::now());
            if let Some(w) = self.trace.as_mut() {
                let st = &self.steps[i];
                let ins: Vec<String> = st
                    .ins
                    .iter()
                    .map(|(_, sh)| format!("{:?}", sh.eval(&b)))
                    .collect();
                let _ = writeln!(
                    w,
                    "[S={s} N={n} T={}] {} {} {} {} -> {:?}",
                    b.t,
                    st.name,
                    st.op.kind(),
                    st.op.params(),
                    ins.join(" "),
                    st.shape.eval(&b)
                );
            }
            self.run_step(i, arena, batch, hidden, &seqs, &b)
                .map_err(|e| match e {
                    RunError::Kernel(source) => ExecError::Kernel {
                        node: self.steps[i].name.clone(),
                        source,
                    },
                    RunError::Unsupported(message) => ExecError::Unsupported {
                        node: self.steps[i].name.clone(),
                        message,
                    },
                })?;
            if let (Some(t0), Some(p)) = (t0, self.profile.as_mut()) {
                p[i].calls += 1;
                p[i].total += t0.elapsed();
            }
        }
        let (loc, shape) = &self.output;
        let rows = shape.dims()[0].eval(&b);
        let vocab = shape.dims()[1].eval(&b);
        let Loc::Arena(off) = *loc else {
            return Err(ExecError::NoOutput);
        };
        // SAFETY: the output buffer lies in the arena; no step is running.
        let data = unsafe { arena.slice(off, rows * vocab) };
        Ok(Logits { rows, vocab, data })
    }

    /// Applies a batch's block copies (see [`Batch::copy_block`]) to every
    /// KV store this executor holds, in order, after checking them all:
    /// (source, destination) pairs of distinct blocks inside the pool.
    fn copy_blocks(&mut self, copies: &[i32]) -> Result<(), ExecError> {
        if copies.is_empty() {
            return Ok(());
        }
        let nb = self.geom.n_blocks;
        let block = |v: i32| usize::try_from(v).ok().filter(|&b| b < nb);
        if !copies.len().is_multiple_of(2) {
            return Err(ExecError::Batch(format!(
                "the copy table has {} values, not (source, destination) pairs",
                copies.len()
            )));
        }
        for c in copies.chunks_exact(2) {
            match (block(c[0]), block(c[1])) {
                (Some(a), Some(b)) if a != b => {}
                _ => {
                    return Err(ExecError::Batch(format!(
                        "block copy {} -> {}: both must be distinct blocks of the pool's {nb}",
                        c[0], c[1]
                    )))
                }
            }
        }
        for c in copies.chunks_exact(2) {
            // A pipeline stage's stores of other stages' layers are empty.
            for store in self.caches.iter_mut().filter(|c| !c.is_empty()) {
                store.copy_block(&self.geom, c[0] as usize, c[1] as usize);
            }
        }
        Ok(())
    }

    fn weight(&self, loc: Loc) -> Result<WeightRef<'_>, RunError> {
        match loc {
            Loc::Weight(w) => {
                let t = &self.weights[w];
                Ok(WeightRef::new(t.dtype, t.data.as_bytes()).with_layout(self.layouts[w]))
            }
            _ => Err(RunError::Unsupported("expected a weight operand".into())),
        }
    }

    fn run_step(
        &mut self,
        i: usize,
        arena: ArenaPtr,
        batch: &Batch,
        hidden: &[f32],
        seqs: &StepSeqs<'_>,
        b: &Bindings,
    ) -> Result<(), RunError> {
        let st = &self.steps[i];
        let s_n = b.s;
        // Integer step inputs.
        let ints = |k: usize| -> Result<&[i32], RunError> {
            match st.ins[k].0 {
                Loc::Input(StepInput::Tokens) => Ok(batch.tokens()),
                Loc::Input(StepInput::Positions) => Ok(&self.positions[..s_n]),
                Loc::Input(StepInput::KvSlots) => Ok(&self.slots[..s_n]),
                Loc::Input(StepInput::SeqTable) => Ok(batch.seq_table()),
                Loc::Input(StepInput::BlockTable) => Ok(batch.block_table()),
                _ => Err(RunError::Unsupported("expected a step input".into())),
            }
        };
        let pool = &self.pool;
        // The table of kernels and whether matmuls keep f32 activations.
        let exact = (self.kernels, self.exact);
        #[allow(clippy::too_many_arguments)]
        fn matmul(
            pool: &ThreadPool,
            x: &[f32],
            s: usize,
            k: usize,
            w: WeightRef<'_>,
            n: usize,
            e: Epilogue<'_>,
            y: &mut [f32],
            (kernels, exact): (&Kernels, bool),
        ) -> Result<(), KernelError> {
            let mode = if exact {
                MatmulMode::Exact
            } else {
                MatmulMode::Fast
            };
            kernels.matmul_any(pool, x, s, k, w, n, e, y, mode)
        }
        let numel = |sh: &Shape| sh.numel(b);
        let dim = |sh: &Shape, k: usize| sh.dims()[k].eval(b);
        let out_len = numel(&st.shape);
        // SAFETY (for every arena slice below): the plan gives each buffer
        // that is live at this step its own byte range (checked by
        // `BufferPlan::check`), so the output never overlaps an input except
        // in place, where the input slice is not created.
        let input = |k: usize| -> Result<&[f32], RunError> {
            match st.ins[k].0 {
                Loc::Arena(off) => Ok(unsafe { arena.slice(off, numel(&st.ins[k].1)) }),
                _ => Err(RunError::Unsupported(
                    "expected an activation operand".into(),
                )),
            }
        };
        // Copies input 0 into the output unless they are the same buffer,
        // so in-place kernels can run on the output.
        let out_from_input0 = || -> Result<&mut [f32], RunError> {
            let Loc::Arena(o) = st.out else {
                return Err(RunError::Unsupported("output is not an activation".into()));
            };
            let out = unsafe { arena.slice_mut(o, out_len) };
            if st.ins[0].0 != st.out {
                out.copy_from_slice(input(0)?);
            }
            Ok(out)
        };
        let out_fresh = || -> Result<&mut [f32], RunError> {
            let Loc::Arena(o) = st.out else {
                return Err(RunError::Unsupported("output is not an activation".into()));
            };
            Ok(unsafe { arena.slice_mut(o, out_len) })
        };
        match &st.op {
            Op::Embedding => {
                let table = self.weight(st.ins[0].0)?;
                let (vocab, dim_e) = (dim(&st.ins[0].1, 0), dim(&st.ins[0].1, 1));
                kernels::embedding_any(table, vocab, dim_e, ints(1)?, out_fresh()?)?;
            }
            Op::RopeFreqs(p) => {
                let RopeParams {
                    head_dim,
                    theta,
                    scaling,
                } = *p;
                let positions = ints(0)?;
                kernels::dispatch::rope_fill_freqs(
                    out_fresh()?,
                    positions,
                    head_dim,
                    theta as f32,
                    scaling,
                )?;
            }
            Op::GatherRows => {
                let Loc::Table(t) = st.ins[0].0 else {
                    return Err(RunError::Unsupported(
                        "rows are gathered from a RoPE table only".into(),
                    ));
                };
                self.tables[t].gather(ints(1)?, out_fresh()?)?;
            }
            Op::RmsNorm { eps } => {
                let d = dim(&st.shape, st.shape.rank() - 1);
                kernels::rmsnorm(input(0)?, d, None, *eps as f32, out_fresh()?)?;
            }
            Op::MatMul | Op::OutputHead => {
                let (xs, ws) = (&st.ins[0].1, &st.ins[1].1);
                let k = dim(xs, 1);
                let n = dim(ws, 0);
                let x = input(0)?;
                let s = dim(xs, 0);
                let w = self.weight(st.ins[1].0)?;
                matmul(pool, x, s, k, w, n, Epilogue::None, out_fresh()?, exact)?;
            }
            Op::MatMulAdd => {
                let (xs, ws) = (&st.ins[1].1, &st.ins[2].1);
                let (s, k, n) = (dim(xs, 0), dim(xs, 1), dim(ws, 0));
                let w = self.weight(st.ins[2].0)?;
                let x = input(1)?;
                if st.ins[0].0 == st.out {
                    matmul(
                        pool,
                        x,
                        s,
                        k,
                        w,
                        n,
                        Epilogue::Accumulate,
                        out_fresh()?,
                        exact,
                    )?;
                } else {
                    let r = input(0)?;
                    matmul(
                        pool,
                        x,
                        s,
                        k,
                        w,
                        n,
                        Epilogue::AddResidual(r),
                        out_fresh()?,
                        exact,
                    )?;
                }
            }
            Op::MatMulSwiGlu => {
                let (xs, ws) = (&st.ins[0].1, &st.ins[1].1);
                let (s, k, n) = (dim(xs, 0), dim(xs, 1), dim(ws, 0));
                let w = self.weight(st.ins[1].0)?;
                matmul(
                    pool,
                    input(0)?,
                    s,
                    k,
                    w,
                    n,
                    Epilogue::SwiGlu,
                    out_fresh()?,
                    exact,
                )?;
            }
            Op::SliceCols { start, len } => {
                let n = dim(&st.ins[0].1, 1);
                let x = input(0)?;
                let out = out_fresh()?;
                for (o, xr) in out.chunks_exact_mut(*len).zip(x.chunks_exact(n)) {
                    o.copy_from_slice(&xr[*start..*start + *len]);
                }
            }
            Op::LastRows => {
                let e = dim(&st.ins[0].1, 1);
                let x = input(0)?;
                let out = out_fresh()?;
                let mut rows = out.chunks_exact_mut(e);
                for sq in seqs.iter() {
                    let end = sq.first + sq.count;
                    // The token range leads the zip: when it ends, no
                    // output row has been taken (and lost) for it.
                    for (t, o) in (end - sq.rows..end).zip(rows.by_ref()) {
                        o.copy_from_slice(&x[t * e..(t + 1) * e]);
                    }
                }
            }
            Op::PoolRows { pooling } => {
                let e = dim(&st.ins[0].1, 1);
                let x = input(0)?;
                let out = out_fresh()?;
                for (sq, o) in seqs.iter().zip(out.chunks_exact_mut(e)) {
                    if sq.start != 0 {
                        return Err(RunError::Unsupported(format!(
                            "pooling needs a whole sequence in one step; this one starts at position {}",
                            sq.start
                        )));
                    }
                    let rows = &x[sq.first * e..(sq.first + sq.count) * e];
                    match pooling {
                        Pooling::Cls => o.copy_from_slice(&rows[..e]),
                        Pooling::Last => o.copy_from_slice(&rows[rows.len() - e..]),
                        Pooling::Mean => {
                            // Rows summed in position order, then scaled:
                            // the same bits whatever else the step holds.
                            o.fill(0.0);
                            for r in rows.chunks_exact(e) {
                                for (a, &v) in o.iter_mut().zip(r) {
                                    *a += v;
                                }
                            }
                            let inv = 1.0 / sq.count as f32;
                            o.iter_mut().for_each(|a| *a *= inv);
                        }
                    }
                }
            }
            Op::RmsNormScaled { eps } => {
                let d = dim(&st.shape, st.shape.rank() - 1);
                let Loc::Weight(w) = st.ins[1].0 else {
                    return Err(RunError::Unsupported(
                        "the norm weight must be a weight".into(),
                    ));
                };
                let v = self
                    .vectors
                    .get(&w)
                    .ok_or_else(|| RunError::Unsupported("norm weight is not a vector".into()))?;
                let wr = kernels::WeightRef::from_f32(v);
                kernels::rmsnorm(input(0)?, d, Some(wr), *eps as f32, out_fresh()?)?;
            }
            Op::Attention { n_rep, .. } => {
                let n_rep = *n_rep;
                let (Loc::Cache(ck), Loc::Cache(cv)) = (st.ins[1].0, st.ins[2].0) else {
                    return Err(RunError::Unsupported(
                        "attention reads the two caches".into(),
                    ));
                };
                let d = self.geom.head_dim;
                // Multiply-adds of q·K and p·V: below the threshold the call
                // is cheaper on this thread than a hand-off to the pool.
                let work: usize = seqs.iter().map(|q| q.count * q.keys()).sum::<usize>()
                    * 2
                    * self.geom.n_kv_heads
                    * n_rep
                    * d;
                let pool = if work <= self.serial_attention_work {
                    &self.serial
                } else {
                    pool
                };
                let q = input(0)?;
                let out = out_fresh()?;
                let attn = self
                    .attn_work
                    .as_mut()
                    .ok_or_else(|| RunError::Unsupported("no attention scratch".into()))?;
                (self.kernels.attention)(
                    pool,
                    q,
                    self.caches[ck].view(),
                    self.caches[cv].view(),
                    &self.geom,
                    n_rep,
                    seqs,
                    out,
                    attn,
                )?;
            }
            Op::QkvRopeCache {
                n_heads,
                n_kv_heads,
                head_dim,
                bias,
                qk_norm,
            } => {
                let (h, hkv, d) = (*n_heads, *n_kv_heads, *head_dim);
                let vector = |k: usize| -> Result<&[f32], RunError> {
                    let Loc::Weight(w) = st.ins[k].0 else {
                        return Err(RunError::Unsupported("expected a weight vector".into()));
                    };
                    self.vectors
                        .get(&w)
                        .map(Vec::as_slice)
                        .ok_or_else(|| RunError::Unsupported("not a vector weight".into()))
                };
                // The biases of q, k, v (one vector each), then the q and k
                // norm weights.
                let biases = if *bias {
                    Some([vector(6)?, vector(7)?, vector(8)?])
                } else {
                    None
                };
                let nb = if *bias { 9 } else { 6 };
                let norms = match qk_norm {
                    Some(eps) => Some((vector(nb)?, vector(nb + 1)?, *eps as f32)),
                    None => None,
                };
                let (xs, ws) = (&st.ins[0].1, &st.ins[1].1);
                let (s, k, n) = (dim(xs, 0), dim(xs, 1), dim(ws, 0));
                let Loc::Arena(xo) = st.ins[0].0 else {
                    return Err(RunError::Unsupported("x must be an activation".into()));
                };
                let Loc::Weight(wi) = st.ins[1].0 else {
                    return Err(RunError::Unsupported("expected a weight operand".into()));
                };
                let (Loc::Cache(ck), Loc::Cache(cv)) = (st.ins[3].0, st.ins[4].0) else {
                    return Err(RunError::Unsupported("expected the two caches".into()));
                };
                let Loc::Arena(o) = st.out else {
                    return Err(RunError::Unsupported("output is not an activation".into()));
                };
                let Loc::Arena(fo) = st.ins[2].0 else {
                    return Err(RunError::Unsupported("bad RoPE angles operand".into()));
                };
                if ck == cv || (hkv, d) != (self.geom.n_kv_heads, self.geom.head_dim) {
                    return Err(RunError::Unsupported(
                        "the step does not fit the caches".into(),
                    ));
                }
                let slots = ints(5)?;
                // SAFETY: x, the angles and the output are distinct live
                // buffers of the plan.
                let x = unsafe { arena.slice(xo, s * k) };
                let freqs = unsafe { arena.slice(fo, s * d) };
                let q_out = unsafe { arena.slice_mut(o, s * h * d) };
                let t = &self.weights[wi];
                let w = WeightRef::new(t.dtype, t.data.as_bytes()).with_layout(self.layouts[wi]);
                let (qn, kn) = (h * d, hkv * d);
                let (lo, hi) = self.caches.split_at_mut(ck.max(cv));
                let (kc, vc) = if ck < cv {
                    (&mut lo[ck], &mut hi[0])
                } else {
                    (&mut hi[0], &mut lo[cv])
                };
                // The packed product goes through a scratch of at most
                // QKV_BLOCK tokens; each token's q goes to the output, its
                // keys are rotated and, with its values, written to its KV
                // slot; then q is rotated.
                for t0 in (0..s).step_by(QKV_BLOCK) {
                    let sb = QKV_BLOCK.min(s - t0);
                    let y = &mut self.qkv_scratch[..sb * n];
                    let xb = &x[t0 * k..(t0 + sb) * k];
                    matmul(pool, xb, sb, k, w, n, Epilogue::None, y, exact)?;
                    for (i, row) in y.chunks_exact_mut(n).enumerate() {
                        let t = t0 + i;
                        let f = &freqs[t * d..(t + 1) * d];
                        if let Some([bq, bk, bv]) = biases {
                            // The same f32 adds as the unfused `Add`s.
                            let (rq, rest) = row.split_at_mut(qn);
                            let (rk, rv) = rest.split_at_mut(kn);
                            kernels::add_inplace(rq, bq)?;
                            kernels::add_inplace(rk, bk)?;
                            kernels::add_inplace(&mut rv[..kn], bv)?;
                        }
                        q_out[t * qn..(t + 1) * qn].copy_from_slice(&row[..qn]);
                        let krow = &mut row[qn..qn + kn];
                        if let Some((_, kw, eps)) = norms {
                            rms_norm_heads(krow, d, kw, eps)?;
                        }
                        kernels::dispatch::rope_apply_freqs(krow, 1, hkv, d, f)?;
                        let slot = slots[t] as usize;
                        kernels::kv::kv_write_row(kc, KvHalf::K, &self.geom, slot, krow)?;
                        let vrow = &row[qn + kn..qn + 2 * kn];
                        kernels::kv::kv_write_row(vc, KvHalf::V, &self.geom, slot, vrow)?;
                    }
                }
                if let Some((qw, _, eps)) = norms {
                    rms_norm_heads(q_out, d, qw, eps)?;
                }
                kernels::dispatch::rope_apply_freqs(q_out, s, h, d, freqs)?;
            }
            Op::Rope => {
                let (s, h, d) = (dim(&st.shape, 0), dim(&st.shape, 1), dim(&st.shape, 2));
                let freqs = input(1)?;
                kernels::dispatch::rope_apply_freqs(out_from_input0()?, s, h, d, freqs)?;
            }
            Op::KvWrite => {
                let Loc::Cache(c) = st.ins[0].0 else {
                    return Err(RunError::Unsupported("KvWrite needs a cache".into()));
                };
                let Loc::Arena(xo) = st.ins[1].0 else {
                    return Err(RunError::Unsupported("KvWrite reads an activation".into()));
                };
                // SAFETY: the input buffer is live and not written by this step.
                let x = unsafe { arena.slice(xo, numel(&st.ins[1].1)) };
                let half = if c % 2 == 0 { KvHalf::K } else { KvHalf::V };
                let slots = ints(2)?;
                kernels::kv_write_rows(&mut self.caches[c], half, &self.geom, slots, x)?;
            }
            Op::AttnScores { n_rep, window, .. } => {
                let Loc::Cache(c) = st.ins[1].0 else {
                    return Err(RunError::Unsupported("attention reads a cache".into()));
                };
                let cache = self.caches[c].view();
                let (geom, t) = (&self.geom, b.t);
                let x = input(0)?;
                let out = out_fresh()?;
                kernels::attn_scores_windowed(pool, x, cache, geom, *n_rep, seqs, t, *window, out)?;
            }
            Op::AttnValues { n_rep } => {
                let Loc::Cache(c) = st.ins[1].0 else {
                    return Err(RunError::Unsupported("attention reads a cache".into()));
                };
                let cache = self.caches[c].view();
                let (geom, t) = (&self.geom, b.t);
                let x = input(0)?;
                let out = out_fresh()?;
                kernels::attn_values(pool, x, cache, geom, *n_rep, seqs, t, out)?;
            }
            Op::Softmax => {
                let row = dim(&st.shape, st.shape.rank() - 1);
                kernels::softmax_rows(pool, out_from_input0()?, row)?;
            }
            Op::Silu => kernels::dispatch::silu_inplace(out_from_input0()?),
            Op::GeluTanh => kernels::gelu_tanh_inplace(out_from_input0()?),
            Op::Scale { factor } => kernels::scale_inplace(out_from_input0()?, *factor as f32),
            Op::Add => match st.ins[1].0 {
                Loc::Weight(w) => {
                    // A bias, broadcast over rows.
                    let v = self
                        .vectors
                        .get(&w)
                        .ok_or_else(|| RunError::Unsupported("Add of a matrix weight".into()))?;
                    let out = out_from_input0()?;
                    if v.is_empty() || !out.len().is_multiple_of(v.len()) {
                        return Err(RunError::Unsupported(
                            "bias length does not divide the rows".into(),
                        ));
                    }
                    for row in out.chunks_exact_mut(v.len()) {
                        kernels::add_inplace(row, v)?;
                    }
                }
                _ => {
                    let bsl = input(1)?;
                    kernels::add_inplace(out_from_input0()?, bsl)?;
                }
            },
            Op::Mul => match st.ins[1].0 {
                Loc::Weight(w) => {
                    let v = self
                        .vectors
                        .get(&w)
                        .ok_or_else(|| RunError::Unsupported("Mul by a matrix weight".into()))?;
                    kernels::dispatch::mul_broadcast_inplace(out_from_input0()?, v)?;
                }
                _ => {
                    let bsl = input(1)?;
                    kernels::dispatch::mul_inplace(out_from_input0()?, bsl)?;
                }
            },
            Op::Recv { from } => {
                let out = out_fresh()?;
                if hidden.len() != out.len() {
                    return Err(RunError::Unsupported(format!(
                        "this stage reads the hidden state stage {from} sent: {} values for {} tokens, got {}",
                        out.len(),
                        b.s,
                        hidden.len()
                    )));
                }
                out.copy_from_slice(hidden);
            }
            Op::Tokens
            | Op::Positions
            | Op::KvSlots
            | Op::SeqTable
            | Op::BlockTable
            | Op::Weight { .. }
            | Op::KvCache { .. }
            | Op::Reshape
            | Op::RopeTable { .. }
            | Op::Send { .. } => {}
        }
        Ok(())
    }
}

/// RMS-normalises each `d`-sized head of `x` in place, times `w` (`[d]`):
/// the same kernel (and so the same bits) as the unfused `RmsNorm` + `Mul`
/// pair folded into `RmsNormScaled`.
fn rms_norm_heads(x: &mut [f32], d: usize, w: &[f32], eps: f32) -> Result<(), KernelError> {
    let mut head = [0f32; 512];
    if d > head.len() {
        return Err(KernelError::Invalid {
            op: "qk_norm",
            what: "head_dim above 512",
        });
    }
    let wr = kernels::WeightRef::from_f32(w);
    for hx in x.chunks_exact_mut(d) {
        head[..d].copy_from_slice(hx);
        kernels::rmsnorm(&head[..d], d, Some(wr), eps, hx)?;
    }
    Ok(())
}

enum RunError {
    Kernel(KernelError),
    Unsupported(String),
}

impl From<KernelError> for RunError {
    fn from(e: KernelError) -> Self {
        RunError::Kernel(e)
    }
}
