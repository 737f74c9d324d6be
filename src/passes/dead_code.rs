//! The `dead_code` pass: drop nodes whose results are unused (cache writes are roots).

use super::{is_root, PassStats};
use crate::ir::{Graph, GraphError, NodeId};
use std::collections::BTreeSet;

/// `dead_code`: removes every node from which no output and no
/// side-effecting node (a cache write) can be reached.
pub fn dead_code(g: &mut Graph) -> Result<PassStats, GraphError> {
    let mut live: BTreeSet<NodeId> = BTreeSet::new();
    let mut stack: Vec<NodeId> = g.node_ids().filter(|&i| is_root(g, i)).collect();
    while let Some(id) = stack.pop() {
        if live.insert(id) {
            stack.extend(g.inputs(id));
        }
    }
    let dead: Vec<NodeId> = g.node_ids().filter(|i| !live.contains(i)).collect();
    for &d in &dead {
        g.remove(d);
    }
    Ok(PassStats {
        rewrites: dead.len(),
    })
}
