//! Helpers the rewriting passes share: finding a pattern's nodes, naming
//! new ones, swapping a fused node in for the ones it replaces, packing
//! weights.
//!
//! Each pass finds its pattern by walking the graph,
//! builds the fused node with the ordinary checked constructors (so shape
//! inference re-checks it), points the users of the old result at it and
//! removes the compute nodes it replaces. Sources left without users
//! (weights of fused matmuls) are dropped by `dead_code`.

use crate::ir::{DType, Graph, GraphError, NodeId, Op, PackedWeight, Shape, TensorMeta};

pub(super) fn op(g: &Graph, id: NodeId) -> &Op {
    &g.node(id).op
}

/// The only reader of `id`, if it has exactly one (through one edge) and
/// is not a graph output.
pub(super) fn sole_user(g: &Graph, id: NodeId) -> Option<NodeId> {
    let u = g.users(id);
    if u.len() == 1
        && !g.outputs().contains(&id)
        && g.inputs(u[0]).iter().filter(|&&i| i == id).count() == 1
    {
        Some(u[0])
    } else {
        None
    }
}

/// The weight tensor name of a weight node.
pub(super) fn weight_name(g: &Graph, id: NodeId) -> Option<&str> {
    match op(g, id) {
        Op::Weight { tensor } => Some(tensor),
        _ => None,
    }
}

pub(super) fn tmp_name(g: &Graph, base: &str) -> String {
    let mut i = 0;
    loop {
        let n = format!("{base}#new{i}");
        if g.find(&n).is_none() {
            return n;
        }
        i += 1;
    }
}

/// Nodes of one op kind, in id order (a snapshot: rewriting is safe).
pub(super) fn nodes_where(g: &Graph, f: impl Fn(&Op) -> bool) -> Vec<NodeId> {
    g.node_ids().filter(|&i| f(op(g, i))).collect()
}

pub(super) fn const_dims(m: &TensorMeta) -> Option<Vec<usize>> {
    m.shape.dims().iter().map(|d| d.as_const()).collect()
}

/// Replaces `old` (all uses and its name) by `new`, then removes `old` and
/// the other `dead` compute nodes.
pub(super) fn commit(
    g: &mut Graph,
    old: NodeId,
    new: NodeId,
    dead: &[NodeId],
) -> Result<(), GraphError> {
    let name = g.node(old).name.clone();
    g.replace_uses(old, new);
    g.remove(old);
    for &d in dead {
        if d != old && g.contains(d) {
            g.remove(d);
        }
    }
    g.rename(new, name)
}

/// Adds (or finds) the weight node of a packed weight made of `parts`
/// concatenated along axis 0 and records it in the graph.
pub(super) fn packed_weight(
    g: &mut Graph,
    name: &str,
    parts: &[NodeId],
    layer: Option<usize>,
) -> Result<Option<NodeId>, GraphError> {
    let mut rows = 0usize;
    let mut cols = None;
    let mut dtype: Option<DType> = None;
    let mut names = Vec::new();
    for &p in parts {
        let Some(n) = weight_name(g, p) else {
            return Ok(None);
        };
        let meta = &g.node(p).meta;
        let Some(d) = const_dims(meta) else {
            return Ok(None);
        };
        if d.len() != 2 || cols.is_some_and(|c| c != d[1]) || dtype.is_some_and(|t| t != meta.dtype)
        {
            return Ok(None);
        }
        cols = Some(d[1]);
        dtype = Some(meta.dtype);
        rows += d[0];
        names.push(n.to_string());
    }
    let (Some(cols), Some(dtype)) = (cols, dtype) else {
        return Ok(None);
    };
    if let Some(id) = g.find(name) {
        return Ok(Some(id));
    }
    let id = g.add_source(
        name,
        Op::Weight {
            tensor: name.to_string(),
        },
        TensorMeta::new(Shape::constant(&[rows, cols]), dtype),
        layer,
    )?;
    g.add_packed(PackedWeight {
        name: name.to_string(),
        parts: names,
        axis: 0,
        stored_as: None,
        layout: Default::default(),
    });
    Ok(Some(id))
}
