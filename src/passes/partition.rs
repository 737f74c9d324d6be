//! `partition`: the compiled graph cut into pipeline stages at layer
//! boundaries, for running one stage per process (see `crate::dist`).
//!
//! A [`StagePlan`] gives each stage a contiguous range of transformer
//! layers, either as counts (`--layers-per-stage 10,12,10`) or balanced by
//! the bytes of weights each stage holds. [`partition`] then places every
//! node of the graph in a stage and returns one self-contained graph per
//! stage:
//!
//! * a node of layer `l` belongs to the stage that holds layer `l`;
//! * a node outside the layers that reads a weight or an earlier stage's
//!   value (the embedding, the final norm, the output head) belongs to the
//!   latest stage among its inputs, the first stage if it has none;
//! * sources (weights, KV caches, token ids, RoPE tables) and the cheap
//!   per-step values computed from sources alone without a weight (RoPE
//!   angles) are *replicated*: each stage that reads them has its own copy,
//!   so only the residual stream crosses a boundary;
//! * each value computed in stage `k` and read in stage `k + 1` becomes a
//!   typed boundary: a `Send { to: k + 1 }` node (named `<value>.send`,
//!   the output of stage `k`) and a `Recv { from: k }` source in stage
//!   `k + 1` named like the value, so the later stage reads exactly as the
//!   whole graph did. In a Llama graph that is the `[S, dim]` hidden state
//!   after the stage's last layer, and nothing else.
//!
//! Each stage graph is built with the ordinary checked constructors, so
//! shapes are re-inferred; it verifies, renumbers and plans on its own, and
//! binds only the weights (and packed weights) it reads. A value read two
//! or more stages later, or graph outputs outside the last stage, are
//! refused: stages pass values only to their successor.

use crate::ir::{Graph, GraphError, NodeId, Op};
use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;

/// Which layers each stage runs: contiguous ranges that cover every layer
/// in order, none empty.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StagePlan {
    pub layers: Vec<Range<usize>>,
}

impl StagePlan {
    /// Stages of `counts[k]` layers each, in order; they must add up to
    /// `n_layers`.
    pub fn from_counts(counts: &[usize], n_layers: usize) -> Result<StagePlan, String> {
        if counts.is_empty() {
            return Err("at least one stage is needed".into());
        }
        if let Some(k) = counts.iter().position(|&c| c == 0) {
            return Err(format!(
                "stage {k} would have no layers; every stage needs at least one"
            ));
        }
        let total: usize = counts.iter().sum();
        if total != n_layers {
            return Err(format!(
                "the layers per stage ({}) add up to {total}, but the model has {n_layers} layers",
                counts
                    .iter()
                    .map(|c| c.to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            ));
        }
        let mut start = 0;
        let layers = counts
            .iter()
            .map(|&c| {
                let r = start..start + c;
                start += c;
                r
            })
            .collect();
        Ok(StagePlan { layers })
    }

    /// `n_stages` stages whose largest holds as few weight bytes as possible
    /// (weights outside the layers count for the stage that holds them: the
    /// final norm and output head for the last, a tied embedding table for
    /// the first and the last; see [`layer_weight_bytes`]). Among plans with
    /// the same largest stage, the most even one wins.
    pub fn balanced(graph: &Graph, n_stages: usize) -> Result<StagePlan, String> {
        let bytes = layer_weight_bytes(graph);
        let n_layers = bytes.per_layer.len();
        if n_stages == 0 {
            return Err("at least one stage is needed".into());
        }
        if n_stages > n_layers {
            return Err(format!(
                "{n_stages} stages need at least {n_stages} layers; the model has {n_layers}"
            ));
        }
        // cost(k, a..b): bytes of stage k holding layers a..b.
        let prefix: Vec<u64> = std::iter::once(0)
            .chain(bytes.per_layer.iter().scan(0u64, |acc, &b| {
                *acc += b;
                Some(*acc)
            }))
            .collect();
        let cost = |k: usize, a: usize, b: usize| {
            let mut c = prefix[b] - prefix[a];
            if k == 0 {
                c += bytes.first;
            }
            if k == n_stages - 1 {
                c += bytes.last;
            }
            c
        };
        // best[k][e]: the best (largest stage, sum of squared stage sizes)
        // of stages 0..=k over layers 0..e, compared in that order: the
        // largest stage as small as possible, then stages as even as
        // possible; cut[k][e]: where stage k starts in that solution.
        type Score = (u64, u128);
        let inf: Score = (u64::MAX, u128::MAX);
        let sq = |c: u64| (c as u128) * (c as u128);
        let mut best = vec![vec![inf; n_layers + 1]; n_stages];
        let mut cut = vec![vec![0usize; n_layers + 1]; n_stages];
        for (e, b) in best[0].iter_mut().enumerate().skip(1) {
            let c = cost(0, 0, e);
            *b = (c, sq(c));
        }
        for k in 1..n_stages {
            for e in (k + 1)..=n_layers {
                for a in k..e {
                    let prev = best[k - 1][a];
                    if prev == inf {
                        continue;
                    }
                    let c = cost(k, a, e);
                    let score = (prev.0.max(c), prev.1.saturating_add(sq(c)));
                    if score < best[k][e] {
                        best[k][e] = score;
                        cut[k][e] = a;
                    }
                }
            }
        }
        let mut layers = vec![0..0; n_stages];
        let mut e = n_layers;
        for k in (0..n_stages).rev() {
            let a = if k == 0 { 0 } else { cut[k][e] };
            layers[k] = a..e;
            e = a;
        }
        Ok(StagePlan { layers })
    }

    pub fn n_stages(&self) -> usize {
        self.layers.len()
    }

    /// The stage that runs layer `l`.
    pub fn stage_of_layer(&self, l: usize) -> Option<usize> {
        self.layers.iter().position(|r| r.contains(&l))
    }

    /// `layers 0..8 | 8..16 | ...`, for messages.
    pub fn describe(&self) -> String {
        self.layers
            .iter()
            .map(|r| format!("{}..{}", r.start, r.end))
            .collect::<Vec<_>>()
            .join(" | ")
    }
}

/// Weight bytes of each layer, and of the weights outside the layers that
/// the first and the last stage read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LayerBytes {
    pub per_layer: Vec<u64>,
    pub first: u64,
    pub last: u64,
}

fn weight_bytes(g: &Graph, id: NodeId) -> u64 {
    let m = &g.node(id).meta;
    m.shape
        .const_numel()
        .and_then(|n| m.dtype.bytes_for(n))
        .unwrap_or(0) as u64
}

/// How many bytes of weights each layer holds; weights outside the layers
/// count for the first stage when they feed the embedding side (no layer
/// node upstream of their readers), except a table that is only gathered
/// from, and for the last stage when they feed the output side. A tied
/// embedding table, which is also the output head, counts for both.
pub fn layer_weight_bytes(g: &Graph) -> LayerBytes {
    let n_layers = g
        .node_ids()
        .filter_map(|i| g.node(i).layer)
        .max()
        .map_or(0, |l| l + 1);
    let mut out = LayerBytes {
        per_layer: vec![0; n_layers],
        ..Default::default()
    };
    let after_layers = downstream_of_layers(g);
    for id in g.node_ids() {
        if !matches!(g.node(id).op, Op::Weight { .. }) {
            continue;
        }
        let b = weight_bytes(g, id);
        match g.node(id).layer {
            Some(l) => out.per_layer[l] += b,
            None => {
                let users = g.users(id);
                // A table only gathered from (an untied embedding) stays in
                // the file mapping; only the rows of the tokens seen become
                // resident, so it does not weigh on the first stage.
                let gathered_only = users.iter().all(|&u| matches!(g.node(u).op, Op::Embedding));
                if !gathered_only && users.iter().any(|u| !after_layers.contains(u)) {
                    out.first += b;
                }
                if users.iter().any(|u| after_layers.contains(u)) {
                    out.last += b;
                }
            }
        }
    }
    out
}

/// Nodes outside the layers that have a layer node upstream.
fn downstream_of_layers(g: &Graph) -> BTreeSet<NodeId> {
    let mut after = BTreeSet::new();
    let order = g.topo_order().unwrap_or_default();
    let mut tainted: BTreeSet<NodeId> = BTreeSet::new();
    for id in order {
        let n = g.node(id);
        let t = n.layer.is_some() || g.inputs(id).iter().any(|i| tainted.contains(i));
        if t {
            tainted.insert(id);
            if n.layer.is_none() {
                after.insert(id);
            }
        }
    }
    after
}

/// One pipeline stage: its layers and its own graph.
#[derive(Debug, Clone)]
pub struct Stage {
    pub index: usize,
    pub layers: Range<usize>,
    pub graph: Graph,
}

impl Stage {
    /// `stage 1 of 3: layers 10..20`.
    pub fn label(&self, n_stages: usize) -> String {
        format!(
            "stage {} of {n_stages}: layers {}..{}",
            self.index, self.layers.start, self.layers.end
        )
    }

    /// The checkpoint tensors the stage reads (the parts of packed weights
    /// included): what its process maps and binds.
    pub fn tensor_names(&self) -> BTreeSet<String> {
        let g = &self.graph;
        let mut names = BTreeSet::new();
        for id in g.node_ids() {
            if let Op::Weight { tensor } = &g.node(id).op {
                match g.packed_weight(tensor) {
                    Some(p) => names.extend(p.parts.iter().cloned()),
                    None => {
                        names.insert(tensor.clone());
                    }
                }
            }
        }
        names
    }

    /// The stage's boundary input, if it receives one: (name, row width).
    pub fn receives(&self) -> Option<(&str, usize)> {
        self.graph.node_ids().find_map(|id| {
            let n = self.graph.node(id);
            match n.op {
                Op::Recv { .. } => Some((n.name.as_str(), n.meta.shape.dims()[1].as_const()?)),
                _ => None,
            }
        })
    }
}

/// The stages of a partitioned graph, in pipeline order.
#[derive(Debug, Clone)]
pub struct Partition {
    pub stages: Vec<Stage>,
}

impl Partition {
    /// The text dump of every stage, each under a `# stage k of n: layers
    /// a..b` heading.
    pub fn dump(&self) -> Result<String, GraphError> {
        let n = self.stages.len();
        let mut out = String::new();
        for s in &self.stages {
            out.push_str(&format!("# {}\n", s.label(n)));
            out.push_str(&crate::ir::print::dump(&s.graph)?);
        }
        Ok(out)
    }

    /// DOT with one cluster per stage (see [`crate::ir::dot::to_dot_stages`]).
    pub fn to_dot(&self, opts: crate::ir::dot::DotOptions) -> Result<String, GraphError> {
        let n = self.stages.len();
        let graphs: Vec<&Graph> = self.stages.iter().map(|s| &s.graph).collect();
        let labels: Vec<String> = self.stages.iter().map(|s| s.label(n)).collect();
        crate::ir::dot::to_dot_stages(&graphs, &labels, opts)
    }
}

/// Splits `g` into the stages of `plan` (see the module documentation).
pub fn partition(g: &Graph, plan: &StagePlan) -> Result<Partition, GraphError> {
    let n_stages = plan.n_stages();
    let err = |node: &str, m: String| GraphError::node(node, m);
    if n_stages == 0 {
        return Err(err(
            "<graph>",
            "a partition needs at least one stage".into(),
        ));
    }
    for (k, r) in plan.layers.iter().enumerate() {
        let expected = if k == 0 { 0 } else { plan.layers[k - 1].end };
        if r.is_empty() || r.start != expected {
            return Err(err(
                "<graph>",
                format!("stage {k} has layers {r:?}: stages need contiguous, non-empty layer ranges in order"),
            ));
        }
    }
    let order = g.topo_order()?;
    // Which nodes every stage may recompute: sources, and weight-free
    // values computed from them alone.
    let mut replicated: BTreeSet<NodeId> = BTreeSet::new();
    for &id in &order {
        let n = g.node(id);
        let ins = g.inputs(id);
        let rep = n.op.is_source()
            || (!n.op.has_side_effects()
                && n.layer.is_none()
                && ins.iter().all(|i| {
                    replicated.contains(i) && !matches!(g.node(*i).op, Op::Weight { .. })
                }));
        if rep {
            replicated.insert(id);
        }
    }
    // The stage of every other node.
    let mut stage_of: BTreeMap<NodeId, usize> = BTreeMap::new();
    for &id in &order {
        if replicated.contains(&id) {
            continue;
        }
        let n = g.node(id);
        let from_inputs = g
            .inputs(id)
            .iter()
            .filter_map(|i| stage_of.get(i).copied())
            .max();
        let s = match n.layer {
            Some(l) => plan.stage_of_layer(l).ok_or_else(|| {
                err(
                    &n.name,
                    format!(
                        "layer {l} is in no stage (the stages hold layers {})",
                        plan.describe()
                    ),
                )
            })?,
            None => from_inputs.unwrap_or(0),
        };
        if let Some(f) = from_inputs.filter(|&f| f > s) {
            return Err(err(
                &n.name,
                format!("is placed in stage {s} but reads a value of stage {f}"),
            ));
        }
        stage_of.insert(id, s);
    }
    if let Some(l) = (0..plan.layers.last().map_or(0, |r| r.end))
        .find(|&l| !g.node_ids().any(|i| g.node(i).layer == Some(l)))
    {
        return Err(err(
            "<graph>",
            format!("the stages hold layer {l}, which the graph does not have"),
        ));
    }
    for &o in g.outputs() {
        let s = stage_of.get(&o).copied().unwrap_or(n_stages - 1);
        if s != n_stages - 1 {
            return Err(err(
                &g.node(o).name,
                format!("is a graph output but falls in stage {s}, not the last stage"),
            ));
        }
    }
    // Values crossing a boundary: computed in stage k, read in stage k + 1.
    let mut sends: BTreeMap<usize, BTreeSet<NodeId>> = BTreeMap::new();
    for (&id, &s) in &stage_of {
        for u in g.users(id) {
            let Some(&t) = stage_of.get(&u) else { continue };
            if t == s {
                continue;
            }
            if t != s + 1 {
                return Err(err(
                    &g.node(id).name,
                    format!(
                        "is computed in stage {s} and read by `{}` in stage {t}; stages pass values only to the next stage",
                        g.node(u).name
                    ),
                ));
            }
            sends.entry(s).or_default().insert(id);
        }
    }
    let mut stages = Vec::with_capacity(n_stages);
    for k in 0..n_stages {
        let received: BTreeSet<NodeId> = if k == 0 {
            BTreeSet::new()
        } else {
            sends.get(&(k - 1)).cloned().unwrap_or_default()
        };
        // The nodes of stage k, and the replicated ones they read.
        let mut keep: BTreeSet<NodeId> = stage_of
            .iter()
            .filter(|&(_, &s)| s == k)
            .map(|(&i, _)| i)
            .collect();
        let mut stack: Vec<NodeId> = keep.iter().copied().collect();
        while let Some(id) = stack.pop() {
            for i in g.inputs(id) {
                if replicated.contains(&i) && keep.insert(i) {
                    stack.push(i);
                }
            }
        }
        let mut sg = Graph::new();
        let mut map: BTreeMap<NodeId, NodeId> = BTreeMap::new();
        for &id in &order {
            let n = g.node(id);
            if received.contains(&id) {
                let r = sg.add_source(
                    n.name.clone(),
                    Op::Recv { from: k - 1 },
                    n.meta.clone(),
                    None,
                )?;
                map.insert(id, r);
                continue;
            }
            if !keep.contains(&id) {
                continue;
            }
            let new = if n.op.is_source() {
                if let Op::Weight { tensor } = &n.op {
                    if let Some(p) = g.packed_weight(tensor) {
                        sg.add_packed(p.clone());
                    }
                }
                sg.add_source(n.name.clone(), n.op.clone(), n.meta.clone(), n.layer)?
            } else {
                let ins: Vec<NodeId> = g.inputs(id).iter().map(|i| map[i]).collect();
                let new = if matches!(n.op, Op::Reshape) {
                    sg.add_op_as(n.name.clone(), n.op.clone(), &ins, n.meta.clone(), n.layer)?
                } else {
                    sg.add_op(n.name.clone(), n.op.clone(), &ins, n.layer)?
                };
                if sg.node(new).meta != n.meta {
                    return Err(err(
                        &n.name,
                        format!(
                            "its type changed when its stage was built: {} became {}",
                            n.meta,
                            sg.node(new).meta
                        ),
                    ));
                }
                new
            };
            map.insert(id, new);
        }
        if k + 1 < n_stages {
            let out = sends.get(&k).cloned().unwrap_or_default();
            if out.is_empty() {
                return Err(err(
                    "<graph>",
                    format!("stage {k} computes nothing that stage {} reads", k + 1),
                ));
            }
            for v in out {
                let name = format!("{}.send", g.node(v).name);
                let s = sg.add_op(name, Op::Send { to: k + 1 }, &[map[&v]], None)?;
                sg.mark_output(s);
            }
        } else {
            for o in g.outputs() {
                sg.mark_output(map[o]);
            }
        }
        let sg = sg.renumbered()?;
        sg.verify()?;
        stages.push(Stage {
            index: k,
            layers: plan.layers[k].clone(),
            graph: sg,
        });
    }
    Ok(Partition { stages })
}
