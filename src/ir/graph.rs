//! The graph: a petgraph `StableDiGraph` of named, typed nodes.
//!
//! Every node carries a stable hierarchical name (`layers.3.attention.wq`),
//! its op and its output [`TensorMeta`]. Edges carry the input slot. Shapes
//! are inferred and checked when a node is added, so a graph that exists is
//! a graph whose shapes agree; [`Graph::verify`] re-checks a whole graph
//! after a rewrite.

use super::infer::infer;
use super::{DType, Op, Shape};
use petgraph::stable_graph::{NodeIndex, StableDiGraph};
use petgraph::visit::EdgeRef;
use petgraph::Direction;
use serde::{Deserialize, Serialize};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::fmt;
use thiserror::Error;

/// A node's index in its graph (stable across removals).
pub type NodeId = NodeIndex<u32>;

/// The output type of a node.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TensorMeta {
    /// The (symbolic) shape.
    pub shape: Shape,
    /// The element type.
    pub dtype: DType,
}

impl TensorMeta {
    /// An output type of `shape` and `dtype`.
    pub fn new(shape: Shape, dtype: DType) -> Self {
        TensorMeta { shape, dtype }
    }
}

impl fmt::Display for TensorMeta {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.dtype, self.shape)
    }
}

/// One node: an op, its name and its output type.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Node {
    /// The stable hierarchical name (`layers.3.attention.wq`), unique in
    /// the graph.
    pub name: String,
    /// What it computes.
    pub op: Op,
    /// Its output's shape and dtype, inferred and checked when added.
    pub meta: TensorMeta,
    /// The transformer layer this node belongs to, if any (for DOT clusters
    /// and per-layer statistics).
    pub layer: Option<usize>,
}

/// An edge feeds its source node's output into input `slot` of its target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Edge {
    /// The input slot of the target node this edge feeds.
    pub slot: usize,
}

/// A graph that is not well formed; every message names the node.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum GraphError {
    /// A node's inputs or declared type do not fit its op.
    #[error("node `{node}`: {message}")]
    Node {
        /// The node's name.
        node: String,
        /// What does not fit.
        message: String,
    },
    /// Two nodes would have the same name.
    #[error("duplicate node name `{0}`")]
    DuplicateName(String),
    /// The edges make a cycle through the named node.
    #[error("the graph has a cycle through `{0}`")]
    Cycle(String),
}

impl GraphError {
    /// A [`GraphError::Node`] for the node named `node`.
    pub fn node(node: &str, message: impl Into<String>) -> Self {
        GraphError::Node {
            node: node.to_string(),
            message: message.into(),
        }
    }
}

/// A weight that does not exist in the checkpoint but is made from tensors
/// that do: `parts` concatenated along `axis` (0: whole rows of `[out, in]`
/// matrices, which is a byte concatenation for every dtype, quantized ones
/// included). Passes that pack weights record them here; binding
/// materialises each once, when a session is prepared.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PackedWeight {
    /// The packed weight's name (`<tensor>.packed`, `layers.N.attention.wqkv.weight`).
    pub name: String,
    /// The checkpoint tensors it is made of, in order.
    pub parts: Vec<String>,
    /// The axis they are concatenated along.
    pub axis: usize,
    /// The storage dtype when it differs from the parts' (the
    /// `compress_weights` pass stores bf16 weights as
    /// [`DType::BF16Z`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stored_as: Option<crate::ir::DType>,
    /// How the rows are arranged (the `interleave_weights` pass stores
    /// quantized weights as [`WeightLayout::X8`]).
    #[serde(default, skip_serializing_if = "WeightLayout::is_rows")]
    pub layout: WeightLayout,
}

/// How the bytes of a stored weight matrix are arranged.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum WeightLayout {
    /// Rows one after another, as in the checkpoint.
    #[default]
    Rows,
    /// Block-quantized rows interleaved in groups of 8, so that one vector
    /// load holds the same word of 8 rows (see
    /// `kernels::quantized::fast::x8`).
    X8,
}

impl WeightLayout {
    /// Is this the checkpoint's row-by-row layout?
    pub fn is_rows(&self) -> bool {
        *self == WeightLayout::Rows
    }
}

/// A model as a static graph of typed ops; see the module docs.
///
/// Building a graph by hand (the Llama builder, `model::build_llama`, does
/// the same for a whole model):
///
/// ```
/// use llama_graph::ir::dot::{to_dot, DotOptions};
/// use llama_graph::ir::{DType, Dim, Graph, Op, Shape, TensorMeta};
///
/// let mut g = Graph::new();
/// let i32_s = TensorMeta::new(Shape::new([Dim::S]), DType::I32);
/// let tokens = g.add_source("tokens", Op::Tokens, i32_s, None)?;
/// let table = g.add_source(
///     "tok_embeddings.weight",
///     Op::Weight { tensor: "tok_embeddings.weight".into() },
///     TensorMeta::new(Shape::constant(&[256, 64]), DType::BF16),
///     None,
/// )?;
/// // The output type is inferred (and checked) from the inputs.
/// let h = g.add_op("h", Op::Embedding, &[table, tokens], None)?;
/// g.mark_output(h);
/// assert_eq!(g.node(h).meta.to_string(), "f32[S, 64]");
/// // An input of the wrong type is refused, naming the node.
/// assert!(g.add_op("bad", Op::Embedding, &[tokens, table], None).is_err());
/// let dot = to_dot(&g, DotOptions::default())?;
/// assert!(dot.starts_with("digraph"));
/// # Ok::<(), llama_graph::ir::GraphError>(())
/// ```
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Graph {
    g: StableDiGraph<Node, Edge>,
    names: BTreeMap<String, NodeId>,
    outputs: Vec<NodeId>,
    /// Packed weights the graph reads, by name.
    #[serde(default)]
    packed: BTreeMap<String, PackedWeight>,
}

impl Graph {
    /// An empty graph.
    pub fn new() -> Self {
        Graph::default()
    }

    /// Adds a source node (no inputs) with its declared output type.
    pub fn add_source(
        &mut self,
        name: impl Into<String>,
        op: Op,
        meta: TensorMeta,
        layer: Option<usize>,
    ) -> Result<NodeId, GraphError> {
        let name = name.into();
        if !op.is_source() {
            return Err(GraphError::node(
                &name,
                format!("{} is not a source op", op.kind()),
            ));
        }
        let meta = infer(&op, &[], Some(&meta)).map_err(|m| GraphError::node(&name, m))?;
        self.insert(
            Node {
                name,
                op,
                meta,
                layer,
            },
            &[],
        )
    }

    /// Adds a compute node; its output type is inferred from its inputs and
    /// checked, and an inconsistency is an error naming the node.
    pub fn add_op(
        &mut self,
        name: impl Into<String>,
        op: Op,
        inputs: &[NodeId],
        layer: Option<usize>,
    ) -> Result<NodeId, GraphError> {
        let name = name.into();
        let metas = inputs
            .iter()
            .map(|&i| self.g.node_weight(i).map(|n| &n.meta))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| GraphError::node(&name, "an input node does not exist"))?;
        let meta = infer(&op, &metas, None).map_err(|m| GraphError::node(&name, m))?;
        self.insert(
            Node {
                name,
                op,
                meta,
                layer,
            },
            inputs,
        )
    }

    /// Like [`Graph::add_op`] but with an explicitly declared output shape,
    /// which inference checks (used by `Reshape`).
    pub fn add_op_as(
        &mut self,
        name: impl Into<String>,
        op: Op,
        inputs: &[NodeId],
        declared: TensorMeta,
        layer: Option<usize>,
    ) -> Result<NodeId, GraphError> {
        let name = name.into();
        let metas = inputs
            .iter()
            .map(|&i| self.g.node_weight(i).map(|n| &n.meta))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| GraphError::node(&name, "an input node does not exist"))?;
        let meta = infer(&op, &metas, Some(&declared)).map_err(|m| GraphError::node(&name, m))?;
        self.insert(
            Node {
                name,
                op,
                meta,
                layer,
            },
            inputs,
        )
    }

    fn insert(&mut self, node: Node, inputs: &[NodeId]) -> Result<NodeId, GraphError> {
        if self.names.contains_key(&node.name) {
            return Err(GraphError::DuplicateName(node.name));
        }
        let name = node.name.clone();
        let id = self.g.add_node(node);
        for (slot, &src) in inputs.iter().enumerate() {
            self.g.add_edge(src, id, Edge { slot });
        }
        self.names.insert(name, id);
        Ok(id)
    }

    /// Marks a node as an output of the graph (the logits, for one).
    pub fn mark_output(&mut self, id: NodeId) {
        if !self.outputs.contains(&id) {
            self.outputs.push(id);
        }
    }

    /// The output nodes, in the order they were marked.
    pub fn outputs(&self) -> &[NodeId] {
        &self.outputs
    }

    /// Records a packed weight (see [`PackedWeight`]).
    pub fn add_packed(&mut self, p: PackedWeight) {
        self.packed.insert(p.name.clone(), p);
    }

    /// The packed weights still read by a weight node.
    pub fn packed(&self) -> impl Iterator<Item = &PackedWeight> + '_ {
        self.packed.values()
    }

    /// The packed weight of this name, if any.
    pub fn packed_weight(&self, name: &str) -> Option<&PackedWeight> {
        self.packed.get(name)
    }

    /// The packed weight of this name, to change how it is stored.
    pub fn packed_weight_mut(&mut self, name: &str) -> Option<&mut PackedWeight> {
        self.packed.get_mut(name)
    }

    /// Renames a node (the new name must be free).
    pub fn rename(&mut self, id: NodeId, name: impl Into<String>) -> Result<(), GraphError> {
        let name = name.into();
        if self.names.contains_key(&name) {
            return Err(GraphError::DuplicateName(name));
        }
        let old = std::mem::replace(&mut self.g[id].name, name.clone());
        self.names.remove(&old);
        self.names.insert(name, id);
        Ok(())
    }

    /// The node `id` (which must exist).
    pub fn node(&self, id: NodeId) -> &Node {
        &self.g[id]
    }

    /// The node `id`, to change in place (which must exist).
    pub fn node_mut(&mut self, id: NodeId) -> &mut Node {
        &mut self.g[id]
    }

    /// The node of this name, if any.
    pub fn find(&self, name: &str) -> Option<NodeId> {
        self.names.get(name).copied()
    }

    /// How many nodes the graph has.
    pub fn node_count(&self) -> usize {
        self.g.node_count()
    }

    /// Every node's id, in id order.
    pub fn node_ids(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.g.node_indices()
    }

    /// The node's inputs in slot order.
    pub fn inputs(&self, id: NodeId) -> Vec<NodeId> {
        let mut e: Vec<(usize, NodeId)> = self
            .g
            .edges_directed(id, Direction::Incoming)
            .map(|e| (e.weight().slot, e.source()))
            .collect();
        e.sort_unstable();
        e.into_iter().map(|(_, n)| n).collect()
    }

    /// Nodes that read this node's output (each once, in id order).
    pub fn users(&self, id: NodeId) -> Vec<NodeId> {
        let mut u: Vec<NodeId> = self
            .g
            .edges_directed(id, Direction::Outgoing)
            .map(|e| e.target())
            .collect();
        u.sort_unstable();
        u.dedup();
        u
    }

    /// Removes a node and its edges.
    pub fn remove(&mut self, id: NodeId) {
        if let Some(n) = self.g.remove_node(id) {
            self.names.remove(&n.name);
            self.outputs.retain(|&o| o != id);
            if let Op::Weight { tensor } = &n.op {
                if !self
                    .g
                    .node_weights()
                    .any(|m| matches!(&m.op, Op::Weight { tensor: t } if t == tensor))
                {
                    self.packed.remove(tensor);
                }
            }
        }
    }

    /// Whether `id` is still a node of the graph.
    pub fn contains(&self, id: NodeId) -> bool {
        self.g.contains_node(id)
    }

    /// Points every use of `old` at `new` (including graph outputs).
    pub fn replace_uses(&mut self, old: NodeId, new: NodeId) {
        let uses: Vec<(NodeId, Edge, petgraph::stable_graph::EdgeIndex<u32>)> = self
            .g
            .edges_directed(old, Direction::Outgoing)
            .map(|e| (e.target(), *e.weight(), e.id()))
            .collect();
        for (target, w, eid) in uses {
            self.g.remove_edge(eid);
            self.g.add_edge(new, target, w);
        }
        for o in &mut self.outputs {
            if *o == old {
                *o = new;
            }
        }
    }

    /// A deterministic topological order: among ready nodes, the one added
    /// first goes first, so the order follows the builder's.
    pub fn topo_order(&self) -> Result<Vec<NodeId>, GraphError> {
        let mut indeg: BTreeMap<NodeId, usize> = BTreeMap::new();
        for id in self.g.node_indices() {
            indeg.insert(id, self.g.edges_directed(id, Direction::Incoming).count());
        }
        let mut ready: BinaryHeap<Reverse<NodeId>> = indeg
            .iter()
            .filter(|(_, &d)| d == 0)
            .map(|(&id, _)| Reverse(id))
            .collect();
        let mut order = Vec::with_capacity(indeg.len());
        while let Some(Reverse(id)) = ready.pop() {
            order.push(id);
            for e in self.g.edges_directed(id, Direction::Outgoing) {
                let d = indeg.get_mut(&e.target()).expect("edge target is a node");
                *d -= 1;
                if *d == 0 {
                    ready.push(Reverse(e.target()));
                }
            }
        }
        if order.len() != indeg.len() {
            let stuck = indeg
                .iter()
                .find(|(id, _)| !order.contains(id))
                .map(|(&id, _)| self.g[id].name.clone())
                .unwrap_or_default();
            return Err(GraphError::Cycle(stuck));
        }
        Ok(order)
    }

    /// The same graph with node ids renumbered so that id order is a
    /// readable schedule: compute nodes in topological order, each source
    /// placed just before its first reader (unread sources last). Passes
    /// leave freed ids behind that new nodes reuse; renumbering after a
    /// rewrite keeps dumps and schedules in builder-like order.
    pub fn renumbered(&self) -> Result<Graph, GraphError> {
        let order = self.topo_order()?;
        let mut seq: Vec<NodeId> = Vec::with_capacity(order.len());
        let mut placed = std::collections::HashSet::new();
        for &id in &order {
            if self.g[id].op.is_source() {
                continue;
            }
            for i in self.inputs(id) {
                if self.g[i].op.is_source() && placed.insert(i) {
                    seq.push(i);
                }
            }
            placed.insert(id);
            seq.push(id);
        }
        for &id in &order {
            if placed.insert(id) {
                seq.push(id);
            }
        }
        let mut out = Graph::new();
        let mut map = BTreeMap::new();
        for &old in &seq {
            let n = out.g.add_node(self.g[old].clone());
            out.names.insert(self.g[old].name.clone(), n);
            map.insert(old, n);
        }
        for &old in &seq {
            let mut ins: Vec<(usize, NodeId)> = self
                .g
                .edges_directed(old, Direction::Incoming)
                .map(|e| (e.weight().slot, e.source()))
                .collect();
            ins.sort_unstable();
            for (slot, src) in ins {
                out.g.add_edge(map[&src], map[&old], Edge { slot });
            }
        }
        out.outputs = self.outputs.iter().map(|o| map[o]).collect();
        out.packed = self.packed.clone();
        Ok(out)
    }

    /// Checks the whole graph: acyclic, unique names, every node's arity and
    /// inferred type consistent with its inputs, outputs present.
    pub fn verify(&self) -> Result<(), GraphError> {
        self.topo_order()?;
        let mut seen = BTreeMap::new();
        for id in self.g.node_indices() {
            let n = &self.g[id];
            if seen.insert(n.name.clone(), id).is_some() {
                return Err(GraphError::DuplicateName(n.name.clone()));
            }
            if self.names.get(&n.name) != Some(&id) {
                return Err(GraphError::node(&n.name, "name index out of date"));
            }
            let inputs = self.inputs(id);
            let slots: Vec<usize> = {
                let mut s: Vec<usize> = self
                    .g
                    .edges_directed(id, Direction::Incoming)
                    .map(|e| e.weight().slot)
                    .collect();
                s.sort_unstable();
                s
            };
            if slots != (0..inputs.len()).collect::<Vec<_>>() {
                return Err(GraphError::node(
                    &n.name,
                    format!("input slots {slots:?} are not 0..n"),
                ));
            }
            let metas: Vec<&TensorMeta> = inputs.iter().map(|&i| &self.g[i].meta).collect();
            let declared = if n.op.is_source() || matches!(n.op, Op::Reshape) {
                Some(&n.meta)
            } else {
                None
            };
            let meta = infer(&n.op, &metas, declared).map_err(|m| GraphError::node(&n.name, m))?;
            if meta != n.meta {
                return Err(GraphError::node(
                    &n.name,
                    format!("recorded type {} but inputs give {}", n.meta, meta),
                ));
            }
        }
        if self.outputs.is_empty() {
            return Err(GraphError::node("<graph>", "no outputs"));
        }
        Ok(())
    }

    /// Node counts by op kind, sorted by kind.
    pub fn op_counts(&self) -> BTreeMap<&'static str, usize> {
        let mut m = BTreeMap::new();
        for id in self.g.node_indices() {
            *m.entry(self.g[id].op.kind()).or_insert(0) += 1;
        }
        m
    }

    /// Nodes per layer (index = layer); nodes outside layers are not counted.
    pub fn nodes_per_layer(&self) -> Vec<usize> {
        let mut v: Vec<usize> = Vec::new();
        for id in self.g.node_indices() {
            if let Some(l) = self.g[id].layer {
                if v.len() <= l {
                    v.resize(l + 1, 0);
                }
                v[l] += 1;
            }
        }
        v
    }

    /// Serialises to JSON.
    pub fn to_json(&self) -> serde_json::Result<String> {
        serde_json::to_string(self)
    }
    /// Reads the JSON that [`Graph::to_json`] writes.
    pub fn from_json(s: &str) -> serde_json::Result<Graph> {
        serde_json::from_str(s)
    }
    /// Serialises to bincode (standard configuration).
    pub fn to_bincode(&self) -> Result<Vec<u8>, bincode::error::EncodeError> {
        bincode::serde::encode_to_vec(self, bincode::config::standard())
    }
    /// Reads the bincode that [`Graph::to_bincode`] writes.
    pub fn from_bincode(b: &[u8]) -> Result<Graph, bincode::error::DecodeError> {
        let (g, _) = bincode::serde::decode_from_slice(b, bincode::config::standard())?;
        Ok(g)
    }
}
