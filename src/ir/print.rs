//! The canonical text dump of a graph: one line per node in topological
//! order, naming inputs by name (never by index), so it is stable under
//! rewrites and suitable for snapshots.

use super::{Graph, GraphError, Op};
use std::fmt::Write;

/// Renders `graph` as text, one node per line:
/// `name = Op{params}(input, input) -> dtype[shape]`.
pub fn dump(graph: &Graph) -> Result<String, GraphError> {
    let mut out = String::new();
    for id in graph.topo_order()? {
        let n = graph.node(id);
        let params = match &n.op {
            Op::Weight { tensor } if *tensor == n.name => String::new(),
            op => op.params(),
        };
        let inputs: Vec<&str> = graph
            .inputs(id)
            .into_iter()
            .map(|i| graph.node(i).name.as_str())
            .collect();
        let _ = write!(out, "{} = {}", n.name, n.op.kind());
        if !params.is_empty() {
            let _ = write!(out, "{{{params}}}");
        }
        if !inputs.is_empty() {
            let _ = write!(out, "({})", inputs.join(", "));
        }
        let _ = writeln!(out, " -> {}", n.meta);
    }
    let outs: Vec<&str> = graph
        .outputs()
        .iter()
        .map(|&o| graph.node(o).name.as_str())
        .collect();
    let _ = writeln!(out, "outputs: {}", outs.join(", "));
    Ok(out)
}
