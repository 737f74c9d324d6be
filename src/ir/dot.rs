//! Graphviz DOT export: one cluster per transformer layer, labels showing op,
//! name and shape. Node identifiers are the stable node names.

use super::{Graph, GraphError, Op};
use std::collections::BTreeMap;
use std::fmt::Write;

/// DOT options.
#[derive(Debug, Clone, Copy, Default)]
pub struct DotOptions {
    /// Draw only the first `n` layers; the rest are elided into one node.
    pub max_layers: Option<usize>,
}

fn quote(s: &str) -> String {
    let mut q = String::with_capacity(s.len() + 2);
    q.push('"');
    for c in s.chars() {
        match c {
            '"' => q.push_str("\\\""),
            '\\' => q.push_str("\\\\"),
            '\n' => q.push_str("\\n"),
            c => q.push(c),
        }
    }
    q.push('"');
    q
}

fn style(op: &Op) -> &'static str {
    match op {
        Op::Weight { .. } => {
            "shape=note, style=filled, fillcolor=\"#eeeeee\", fontcolor=\"#555555\""
        }
        Op::KvCache { .. } => "shape=cylinder, style=filled, fillcolor=\"#ffe9b3\"",
        op if op.step_input().is_some() || matches!(op, Op::RopeTable { .. }) => {
            "shape=invhouse, style=filled, fillcolor=\"#d9ead3\""
        }
        Op::OutputHead => "shape=box, style=\"filled,bold\", fillcolor=\"#cfe2f3\"",
        _ => "shape=box, style=rounded",
    }
}

/// Renders `graph` as a DOT digraph.
pub fn to_dot(graph: &Graph, opts: DotOptions) -> Result<String, GraphError> {
    let order = graph.topo_order()?;
    let shown = |l: Option<usize>| match (l, opts.max_layers) {
        (Some(l), Some(m)) => l < m,
        _ => true,
    };
    let mut clusters: BTreeMap<Option<usize>, Vec<String>> = BTreeMap::new();
    let mut hidden_layers = std::collections::BTreeSet::new();
    for &id in &order {
        let n = graph.node(id);
        if !shown(n.layer) {
            hidden_layers.insert(n.layer.unwrap_or(0));
            continue;
        }
        let mut label = n.op.kind().to_string();
        let p = n.op.params();
        if !p.is_empty() && !matches!(n.op, Op::Weight { .. }) {
            label.push_str(&format!(" {{{p}}}"));
        }
        label.push('\n');
        label.push_str(&n.name);
        label.push('\n');
        label.push_str(&n.meta.to_string());
        clusters.entry(n.layer).or_default().push(format!(
            "{} [label={}, {}];",
            quote(&n.name),
            quote(&label),
            style(&n.op)
        ));
    }
    let mut out = String::new();
    let _ = writeln!(out, "digraph llama_graph {{");
    let _ = writeln!(out, "  rankdir=TB;");
    let _ = writeln!(out, "  node [fontname=\"Helvetica\", fontsize=10];");
    let _ = writeln!(out, "  edge [color=\"#666666\"];");
    for (layer, lines) in &clusters {
        match layer {
            Some(l) => {
                let _ = writeln!(out, "  subgraph cluster_layer_{l} {{");
                let _ = writeln!(
                    out,
                    "    label={}; style=rounded; color=\"#3d85c6\";",
                    quote(&format!("layers.{l}"))
                );
                for line in lines {
                    let _ = writeln!(out, "    {line}");
                }
                let _ = writeln!(out, "  }}");
            }
            None => {
                for line in lines {
                    let _ = writeln!(out, "  {line}");
                }
            }
        }
    }
    let elided = if hidden_layers.is_empty() {
        None
    } else {
        let first = hidden_layers.iter().next().copied().unwrap_or(0);
        let last = hidden_layers.iter().next_back().copied().unwrap_or(0);
        let name = format!("layers.{first}..{last} (elided)");
        let _ = writeln!(
            out,
            "  {} [label={}, shape=box, style=dashed];",
            quote(&name),
            quote(&format!("… {} more layers …", hidden_layers.len()))
        );
        Some(name)
    };
    let mut elided_edges = std::collections::BTreeSet::new();
    for &id in &order {
        let n = graph.node(id);
        for (slot, src) in graph.inputs(id).into_iter().enumerate() {
            let s = graph.node(src);
            match (shown(s.layer), shown(n.layer), &elided) {
                (true, true, _) => {
                    let _ = writeln!(
                        out,
                        "  {} -> {} [label=\"{slot}\"];",
                        quote(&s.name),
                        quote(&n.name)
                    );
                }
                (true, false, Some(e)) if s.layer.is_some() => {
                    elided_edges.insert((s.name.clone(), e.clone()));
                }
                (false, true, Some(e)) => {
                    elided_edges.insert((e.clone(), n.name.clone()));
                }
                _ => {}
            }
        }
    }
    for (a, b) in elided_edges {
        let _ = writeln!(out, "  {} -> {} [style=dashed];", quote(&a), quote(&b));
    }
    let _ = writeln!(out, "}}");
    Ok(out)
}
