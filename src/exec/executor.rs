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

mod run;
use run::RunError;

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
    /// It reads or writes the window layers' own pool (its inputs include
    /// the window slots or block table).
    windowed: bool,
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
    /// The window layers' own pool, when they keep only their window
    /// (same heads and block size as `geom`, fewer blocks).
    window_geom: Option<KvGeom>,
    /// Which stores (by cache index) are in the window layers' pool.
    window_store: Vec<bool>,
    /// Constant-folded RoPE tables, computed once here.
    tables: Vec<kernels::RopeTable>,
    /// Scratch of the fused attention kernel (sized for the largest step).
    attn_work: Option<AttnWork>,
    /// Each token's position and KV slot in the current step.
    positions: Vec<i32>,
    slots: Vec<i32>,
    /// Each token's slot in the window layers' pool.
    window_slots: Vec<i32>,
    /// Scratch holding the packed `[S, (H + 2Hkv)·D]` result of a fused
    /// QKV projection before its epilogue scatters it.
    qkv_scratch: Vec<f32>,
    /// How matmuls treat activations (default `Exact`).
    matmul_mode: MatmulMode,
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
        let mut window_geom = geom;
        // Blocks of the shared pool (the block table's length), and whether
        // window layers keep a pool of their own.
        let table_len = |want: fn(&Op) -> bool| {
            graph
                .node_ids()
                .find(|&i| want(&graph.node(i).op))
                .and_then(|i| graph.node(i).meta.shape.const_numel())
        };
        // (The window table has the shared one's length: the only one left
        // when every layer is a window layer.)
        let window_len = table_len(|o| matches!(o, Op::WindowBlockTable));
        let shared_blocks = table_len(|o| matches!(o, Op::BlockTable))
            .or(window_len)
            .unwrap_or(0);
        let window_table = window_len.is_some();
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
                    // The shared pool has the block table's length in
                    // blocks; a window layer's pool may have fewer.
                    let windowed = window_table && g.n_blocks != shared_blocks;
                    let seen = if windowed {
                        &mut window_geom
                    } else {
                        &mut geom
                    };
                    if seen.n_blocks != 0 && g != *seen {
                        return Err(unsupported(format!(
                            "every layer's cache must have one geometry, got {g:?} and {seen:?}"
                        )));
                    }
                    *seen = g;
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
                    let run = if *kind == CacheKind::K { g.block } else { 1 };
                    caches[c] =
                        KvStore::new(ty, g.elems(), run).map_err(|e| unsupported(e.to_string()))?;
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
            let windowed = ins.iter().any(|(l, _)| {
                matches!(
                    l,
                    Loc::Input(StepInput::WindowSlots | StepInput::WindowBlockTable)
                )
            });
            steps.push(Step {
                name: node.name.clone(),
                op: node.op.clone(),
                ins,
                out,
                shape: node.meta.shape.clone(),
                windowed,
            });
        }
        if geom.n_blocks == 0 && window_geom.n_blocks != 0 {
            // Every layer is a window layer (Mistral 7B v0.1): the shared
            // pool holds no layer, but its blocks still count positions.
            geom = KvGeom {
                n_blocks: shared_blocks,
                ..window_geom
            };
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
        // The stores window steps touch are the window pool's.
        let mut window_store = vec![false; caches.len()];
        for st in steps.iter().filter(|st| st.windowed) {
            for (l, _) in &st.ins {
                if let Loc::Cache(c) = *l {
                    window_store[c] = true;
                }
            }
        }
        let window_geom = if window_table {
            // Equal in size to the shared pool, its stores look shared.
            Some(if window_geom.n_blocks == 0 {
                geom
            } else {
                window_geom
            })
        } else {
            None
        };
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
            window_geom,
            window_store,
            tables,
            attn_work,
            positions: vec![0; max_chunk],
            slots: vec![0; max_chunk],
            window_slots: vec![0; max_chunk],
            qkv_scratch: vec![0.0; qkv_len],
            matmul_mode: MatmulMode::Exact,
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
        self.matmul_mode = if exact {
            MatmulMode::Exact
        } else {
            MatmulMode::Fast
        };
    }

    pub fn exact(&self) -> bool {
        self.matmul_mode == MatmulMode::Exact
    }

    /// Sets how matmuls treat activations (see [`MatmulMode`]; `Draft`
    /// for a speculative draft model's session).
    pub fn set_matmul_mode(&mut self, mode: MatmulMode) {
        self.matmul_mode = mode;
    }

    pub fn matmul_mode(&self) -> MatmulMode {
        self.matmul_mode
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
        let window_seqs = match self.window_geom {
            Some(wg) => {
                let w = StepSeqs::new(batch.seq_table(), batch.window_block_table(), s, &wg)
                    .map_err(|e| {
                        ExecError::Batch(format!(
                            "the window layers' block table (Batch::push_ring): {e}"
                        ))
                    })?;
                Some(w)
            }
            None => None,
        };
        self.copy_blocks(batch.copy_table())?;
        if let Some(w) = &window_seqs {
            w.fill_positions_and_slots(&mut self.positions[..s], &mut self.window_slots[..s]);
        }
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
            self.run_step(i, arena, batch, hidden, (&seqs, window_seqs.as_ref()), &b)
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
            // A pipeline stage's stores of other stages' layers are empty;
            // the window layers' own pool is not the one the ids name.
            let window = &self.window_store;
            for (_, store) in self
                .caches
                .iter_mut()
                .enumerate()
                .filter(|(i, c)| !c.is_empty() && !window.get(*i).copied().unwrap_or(false))
            {
                store.copy_block(&self.geom, c[0] as usize, c[1] as usize);
            }
        }
        Ok(())
    }
}
