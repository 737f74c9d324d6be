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
        Op::Send { .. } => "shape=cds, style=filled, fillcolor=\"#f4cccc\"",
        Op::Recv { .. } => "shape=cds, style=filled, fillcolor=\"#f4cccc\", orientation=180",
        _ => "shape=box, style=rounded",
    }
}

/// Renders `graph` as a DOT digraph.
pub fn to_dot(graph: &Graph, opts: DotOptions) -> Result<String, GraphError> {
    let mut out = header();
    write_graph(&mut out, graph, opts, "", "  ")?;
    let _ = writeln!(out, "}}");
    Ok(out)
}

/// Renders the graphs of pipeline stages (see `crate::passes::partition`)
/// as one DOT digraph: one cluster per stage (labelled with `labels[k]`)
/// holding its layer clusters, and a dashed edge from each `Send` to the
/// `Recv` of the same value in the stage it goes to. Node identifiers are
/// `s<k>/<name>`, as a value that several stages read (a RoPE table, a
/// tied embedding) is a node of each.
pub fn to_dot_stages(
    stages: &[&Graph],
    labels: &[String],
    opts: DotOptions,
) -> Result<String, GraphError> {
    let mut out = header();
    for (k, g) in stages.iter().enumerate() {
        let _ = writeln!(out, "  subgraph cluster_stage_{k} {{");
        let label = labels
            .get(k)
            .cloned()
            .unwrap_or_else(|| format!("stage {k}"));
        let _ = writeln!(
            out,
            "    label={}; style=\"rounded,bold\"; color=\"#cc0000\"; fontcolor=\"#cc0000\";",
            quote(&label)
        );
        write_graph(&mut out, g, opts, &format!("s{k}/"), "    ")?;
        let _ = writeln!(out, "  }}");
    }
    for (k, g) in stages.iter().enumerate() {
        for id in g.topo_order()? {
            let n = g.node(id);
            let Op::Send { to } = n.op else { continue };
            let Some(&src) = g.inputs(id).first() else {
                continue;
            };
            let value = &g.node(src).name;
            if stages.get(to).is_some_and(|t| t.find(value).is_some()) {
                let _ = writeln!(
                    out,
                    "  {} -> {} [style=dashed, color=\"#cc0000\", penwidth=2, label=\"MPI\"];",
                    quote(&format!("s{k}/{}", n.name)),
                    quote(&format!("s{to}/{value}"))
                );
            }
        }
    }
    let _ = writeln!(out, "}}");
    Ok(out)
}

fn header() -> String {
    let mut out = String::new();
    let _ = writeln!(out, "digraph llama_graph {{");
    let _ = writeln!(out, "  rankdir=TB;");
    let _ = writeln!(out, "  node [fontname=\"Helvetica\", fontsize=10];");
    let _ = writeln!(out, "  edge [color=\"#666666\"];");
    out
}

/// Writes one graph's nodes (in layer clusters) and edges, node ids
/// prefixed with `prefix`, lines indented by `ind`.
fn write_graph(
    out: &mut String,
    graph: &Graph,
    opts: DotOptions,
    prefix: &str,
    ind: &str,
) -> Result<(), GraphError> {
    let id = |name: &str| quote(&format!("{prefix}{name}"));
    let order = graph.topo_order()?;
    let shown = |l: Option<usize>| match (l, opts.max_layers) {
        (Some(l), Some(m)) => l < m,
        _ => true,
    };
    let mut clusters: BTreeMap<Option<usize>, Vec<String>> = BTreeMap::new();
    let mut hidden_layers = std::collections::BTreeSet::new();
    for &nid in &order {
        let n = graph.node(nid);
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
            id(&n.name),
            quote(&label),
            style(&n.op)
        ));
    }
    for (layer, lines) in &clusters {
        match layer {
            Some(l) => {
                let _ = writeln!(
                    out,
                    "{ind}subgraph cluster_{}layer_{l} {{",
                    prefix.replace('/', "_")
                );
                let _ = writeln!(
                    out,
                    "{ind}  label={}; style=rounded; color=\"#3d85c6\";",
                    quote(&format!("layers.{l}"))
                );
                for line in lines {
                    let _ = writeln!(out, "{ind}  {line}");
                }
                let _ = writeln!(out, "{ind}}}");
            }
            None => {
                for line in lines {
                    let _ = writeln!(out, "{ind}{line}");
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
            "{ind}{} [label={}, shape=box, style=dashed];",
            id(&name),
            quote(&format!("… {} more layers …", hidden_layers.len()))
        );
        Some(name)
    };
    let mut elided_edges = std::collections::BTreeSet::new();
    for &nid in &order {
        let n = graph.node(nid);
        for (slot, src) in graph.inputs(nid).into_iter().enumerate() {
            let s = graph.node(src);
            match (shown(s.layer), shown(n.layer), &elided) {
                (true, true, _) => {
                    let _ = writeln!(
                        out,
                        "{ind}{} -> {} [label=\"{slot}\"];",
                        id(&s.name),
                        id(&n.name)
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
        let _ = writeln!(out, "{ind}{} -> {} [style=dashed];", id(&a), id(&b));
    }
    Ok(())
}
