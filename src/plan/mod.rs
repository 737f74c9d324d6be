//! Scheduling and buffer planning.
//!
//! A graph is compiled once into an [`ExecPlan`]: a deterministic
//! topological order, where each node's value lives ([`Value`]) and a
//! [`BufferPlan`] that gives every activation an offset in one arena. The
//! arena is sized for the largest step the plan allows ([`PlanLimits`]: a
//! full chunk of tokens, the most sequences per step, a sequence as long as
//! the context) and allocated once; smaller steps use a prefix of each
//! buffer.

use crate::ir::{Bindings, CacheKind, DType, Graph, GraphError, NodeId, Op, StepInput};
use serde::Serialize;
use std::collections::HashMap;

/// Byte alignment of every arena buffer.
pub const ALIGN: usize = 64;

/// Where a node's value lives while a step runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    /// A step input (token ids, positions, slots, the sequence and block
    /// tables), given or derived per step.
    Input(StepInput),
    /// A weight bound by checkpoint name.
    Weight(String),
    /// Persistent KV-cache state.
    Cache { layer: usize, kind: CacheKind },
    /// A constant computed once when the executor is prepared (a RoPE
    /// table), by node name.
    Constant(String),
    /// A buffer of the arena (index into [`BufferPlan::buffers`]).
    Arena(usize),
}

/// One activation buffer: its size at the plan's largest step, its offset
/// in the arena and its lifetime in schedule steps (inclusive).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Buffer {
    /// The node that first writes it (later in-place users share it).
    pub name: String,
    pub bytes: usize,
    pub offset: usize,
    pub first: usize,
    pub last: usize,
}

/// The arena layout.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BufferPlan {
    pub buffers: Vec<Buffer>,
    /// Size of the arena.
    pub arena_bytes: usize,
    /// The sum of every activation's size (what allocating each activation
    /// separately would cost).
    pub naive_activation_bytes: usize,
    /// The most bytes live at any one step (a lower bound for the arena).
    pub peak_live_bytes: usize,
    /// Activations that reuse their input's buffer in place.
    pub in_place: usize,
}

impl BufferPlan {
    /// Verifies that no two buffers that are live at the same step share
    /// any byte, and that all fit in the arena.
    pub fn check(&self) -> Result<(), String> {
        for (i, a) in self.buffers.iter().enumerate() {
            if a.offset % ALIGN != 0 {
                return Err(format!(
                    "buffer `{}` at offset {} is not {ALIGN}-aligned",
                    a.name, a.offset
                ));
            }
            if a.offset + a.bytes > self.arena_bytes {
                return Err(format!("buffer `{}` ends past the arena", a.name));
            }
            for b in &self.buffers[i + 1..] {
                let live_together = a.first <= b.last && b.first <= a.last;
                let overlap = a.offset < b.offset + b.bytes && b.offset < a.offset + a.bytes;
                if live_together && overlap && a.bytes > 0 && b.bytes > 0 {
                    return Err(format!(
                        "buffers `{}` [{}, +{}) steps {}..={} and `{}` [{}, +{}) steps {}..={} overlap",
                        a.name, a.offset, a.bytes, a.first, a.last, b.name, b.offset, b.bytes, b.first, b.last
                    ));
                }
            }
        }
        Ok(())
    }
}

/// A compiled graph: what runs in which order, and where every value lives.
#[derive(Debug, Clone)]
pub struct ExecPlan {
    pub order: Vec<NodeId>,
    pub values: HashMap<NodeId, Value>,
    pub buffers: BufferPlan,
    /// The largest step the arena is sized for.
    pub max: Bindings,
}

/// Ops that may write their output over their first input when that input
/// dies at this node: elementwise or row-local ops whose kernels work in place.
/// `MatMulAdd` accumulates into its residual (input 0).
fn in_place_ok(op: &Op) -> bool {
    matches!(
        op,
        Op::Add
            | Op::Mul
            | Op::Silu
            | Op::GeluTanh
            | Op::Scale { .. }
            | Op::Softmax
            | Op::Rope
            | Op::MatMulAdd
    )
}

fn elem_bytes(d: DType) -> usize {
    match d {
        DType::F32 | DType::I32 => 4,
        DType::F16 | DType::BF16 => 2,
        _ => 1,
    }
}

/// The largest step a plan serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanLimits {
    /// Tokens per step (`S`), across its sequences.
    pub max_tokens: usize,
    /// Sequences per step (`N`).
    pub max_seqs: usize,
    /// The longest sequence (`T`), in positions.
    pub context: usize,
    /// Logit rows per step (`R`): the sequences' last tokens that want
    /// logits (see [`crate::ir::LogitRows::max_rows`]).
    pub max_logit_rows: usize,
}

impl PlanLimits {
    /// Steps of one sequence: chunks of at most `max_chunk` tokens of a
    /// sequence of at most `context` positions.
    pub fn one_sequence(max_chunk: usize, context: usize) -> Self {
        PlanLimits {
            max_tokens: max_chunk,
            max_seqs: 1,
            context,
            max_logit_rows: 1,
        }
    }

    /// The bindings of the largest step (clamped to be consistent: at least
    /// one token and one sequence, no more sequences than tokens, logit
    /// rows from one per sequence to one per token).
    pub fn max_bindings(&self) -> Bindings {
        let context = self.context.max(1);
        let s = self.max_tokens.clamp(1, context);
        let n = self.max_seqs.clamp(1, s);
        Bindings::new(s, n, context).with_rows(self.max_logit_rows.clamp(n, s))
    }
}

/// Compiles `graph` for steps up to `limits`.
pub fn compile(graph: &Graph, limits: &PlanLimits) -> Result<ExecPlan, GraphError> {
    let order = graph.topo_order()?;
    let max = limits.max_bindings();
    let pos: HashMap<NodeId, usize> = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();

    let mut values: HashMap<NodeId, Value> = HashMap::new();
    let mut buffers: Vec<Buffer> = Vec::new();
    let mut naive = 0usize;
    let mut in_place = 0usize;
    // Last step at which each buffer is read.
    let last_use = |graph: &Graph, values: &HashMap<NodeId, Value>, id: NodeId| -> usize {
        // Readers of `id`, following aliases (Reshape) transitively.
        let mut last = pos[&id];
        let mut stack = vec![id];
        while let Some(n) = stack.pop() {
            if graph.outputs().contains(&n) {
                last = usize::MAX;
            }
            for u in graph.users(n) {
                last = last.max(pos[&u]);
                if matches!(graph.node(u).op, Op::Reshape | Op::Send { .. }) {
                    stack.push(u);
                }
            }
        }
        let _ = values;
        last
    };

    for (step, &id) in order.iter().enumerate() {
        let node = graph.node(id);
        let inputs = graph.inputs(id);
        let value = match &node.op {
            op if op.step_input().is_some() => Value::Input(op.step_input().expect("a step input")),
            Op::Weight { tensor } => Value::Weight(tensor.clone()),
            Op::KvCache { layer, kind } => Value::Cache {
                layer: *layer,
                kind: *kind,
            },
            Op::RopeTable { .. } => Value::Constant(node.name.clone()),
            // Views: the output is the input's storage.
            Op::Reshape | Op::KvWrite | Op::Send { .. } => values[&inputs[0]].clone(),
            op => {
                let bytes = node.meta.shape.numel(&max) * elem_bytes(node.meta.dtype);
                naive += bytes;
                let reuse = if in_place_ok(op) {
                    match values.get(&inputs[0]) {
                        Some(Value::Arena(b))
                            if buffers[*b].last == step
                                && buffers[*b].bytes == bytes
                                && !inputs[1..]
                                    .iter()
                                    .any(|i| values.get(i) == Some(&Value::Arena(*b))) =>
                        {
                            Some(*b)
                        }
                        _ => None,
                    }
                } else {
                    None
                };
                let last = last_use(graph, &values, id);
                match reuse {
                    Some(b) => {
                        in_place += 1;
                        buffers[b].last = last;
                        Value::Arena(b)
                    }
                    None => {
                        buffers.push(Buffer {
                            name: node.name.clone(),
                            bytes,
                            offset: 0,
                            first: step,
                            last,
                        });
                        Value::Arena(buffers.len() - 1)
                    }
                }
            }
        };
        // A buffer read through an alias must live as long as the alias's readers.
        if matches!(node.op, Op::Reshape | Op::Send { .. }) {
            if let Value::Arena(b) = value {
                let l = last_use(graph, &values, id);
                buffers[b].last = buffers[b].last.max(l);
            }
        }
        values.insert(id, value);
    }
    let end = order.len();
    for b in &mut buffers {
        b.last = b.last.min(end);
    }
    let (arena_bytes, peak) = assign_offsets(&mut buffers, end);
    let plan = BufferPlan {
        buffers,
        arena_bytes,
        naive_activation_bytes: naive,
        peak_live_bytes: peak,
        in_place,
    };
    Ok(ExecPlan {
        order,
        values,
        buffers: plan,
        max,
    })
}

/// Best-fit offset assignment, largest buffers first: each buffer goes into
/// the smallest gap left by the buffers already placed whose lifetimes
/// overlap its own. Returns (arena bytes, peak live bytes).
fn assign_offsets(buffers: &mut [Buffer], steps: usize) -> (usize, usize) {
    let round = |x: usize| x.div_ceil(ALIGN) * ALIGN;
    let mut idx: Vec<usize> = (0..buffers.len()).collect();
    idx.sort_by(|&a, &b| {
        buffers[b]
            .bytes
            .cmp(&buffers[a].bytes)
            .then(buffers[a].first.cmp(&buffers[b].first))
    });
    let mut placed: Vec<usize> = Vec::new();
    let mut arena = 0usize;
    for &i in &idx {
        let size = round(buffers[i].bytes);
        let (first, last) = (buffers[i].first, buffers[i].last);
        let mut busy: Vec<(usize, usize)> = placed
            .iter()
            .filter(|&&j| buffers[j].first <= last && first <= buffers[j].last)
            .map(|&j| (buffers[j].offset, round(buffers[j].bytes)))
            .collect();
        busy.sort_unstable();
        let mut best: Option<(usize, usize)> = None; // (gap size, offset)
        let mut cursor = 0usize;
        for (off, len) in busy {
            if off > cursor {
                let gap = off - cursor;
                if gap >= size && best.is_none_or(|(g, _)| gap < g) {
                    best = Some((gap, cursor));
                }
            }
            cursor = cursor.max(off + len);
        }
        let offset = best.map(|(_, o)| o).unwrap_or(cursor);
        buffers[i].offset = offset;
        arena = arena.max(offset + size);
        placed.push(i);
    }
    let mut peak = 0usize;
    for s in 0..=steps {
        let live: usize = buffers
            .iter()
            .filter(|b| b.first <= s && s <= b.last)
            .map(|b| round(b.bytes))
            .sum();
        peak = peak.max(live);
    }
    (arena, peak)
}
