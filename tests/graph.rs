//! The graph core: builder, shape checks, snapshots, serialisation, DOT.
mod common;

use llama_graph::ir::dot::{to_dot, DotOptions};
use llama_graph::ir::{print, DType, Dim, Graph, GraphError, Op, Shape, TensorMeta};
use llama_graph::model::{build_llama, BuildOptions, ModelArgs};

/// The reference architectures, with the vocabulary to use when params.json
/// leaves it to the tokenizer (Llama 2's 32000).
const ARCHS: &[(&str, Option<usize>)] = &[
    ("llama-3.1-8b", None),
    ("llama-2-7b", Some(32000)),
    ("smollm2-135m", None),
    ("llama-3.2-1b", None),
    ("tiny", None),
];

/// The other families, each from a real Hugging Face `config.json`.
const FAMILY_ARCHS: &[&str] = &[
    "qwen2.5-0.5b",
    "qwen3-0.6b",
    "mistral-7b-v0.1",
    "phi-3-mini-4k",
    "gemma-3-270m",
];

fn all_archs() -> impl Iterator<Item = &'static str> {
    ARCHS
        .iter()
        .map(|(a, _)| *a)
        .chain(FAMILY_ARCHS.iter().copied())
}

fn build(arch: &str) -> Graph {
    let mut args = common::graph_params(arch);
    if let Some((_, Some(v))) = ARCHS.iter().find(|(a, _)| *a == arch) {
        args.vocab_size = Some(*v);
    }
    let ctx = args.plan_context(None);
    build_llama(&args, &BuildOptions::new(ctx)).expect("graph builds")
}

#[test]
fn derived_arguments_match_meta() {
    let a = common::graph_params("llama-3.1-8b");
    assert_eq!((a.head_dim(), a.n_rep(), a.ffn_hidden_dim), (128, 4, 14336));
    let a = common::graph_params("llama-2-7b");
    assert_eq!(
        (a.head_dim(), a.n_rep(), a.ffn_hidden_dim, a.vocab_size),
        (128, 1, 11008, None)
    );
    let a = common::graph_params("smollm2-135m");
    assert_eq!((a.head_dim(), a.n_rep(), a.ffn_hidden_dim), (64, 3, 1536));
    assert!(a.tied_embeddings);
    assert_eq!(
        a.plan_context(Some(100_000)),
        8192,
        "capped by the model's own limit"
    );
}

#[test]
fn graphs_verify_and_have_expected_structure() {
    for (arch, _) in ARCHS {
        let g = build(arch);
        g.verify().unwrap();
        let args = common::graph_params(arch);
        let per_layer = g.nodes_per_layer();
        assert_eq!(per_layer.len(), args.n_layers, "{arch}");
        assert!(
            per_layer.iter().all(|&n| n == per_layer[0]),
            "{arch}: uniform layers"
        );
        let counts = g.op_counts();
        assert_eq!(counts["AttnScores"], args.n_layers);
        assert_eq!(counts["KvWrite"], 2 * args.n_layers);
        assert_eq!(counts["Add"], 2 * args.n_layers, "two residuals per layer");
        assert_eq!(counts["RmsNorm"], 2 * args.n_layers + 1);
        let weights = counts["Weight"];
        let tied = if args.tied_embeddings { 0 } else { 1 };
        assert_eq!(
            weights,
            9 * args.n_layers + 2 + tied,
            "{arch}: Meta's tensor count"
        );
    }
}

#[test]
fn symbolic_shapes_in_graph() {
    let g = build("llama-3.1-8b");
    let shape_of = |name: &str| g.node(g.find(name).unwrap()).meta.to_string();
    assert_eq!(shape_of("tok_embeddings"), "f32[S, 4096]");
    assert_eq!(shape_of("layers.3.attention.wq"), "f32[S, 4096]");
    assert_eq!(shape_of("layers.3.attention.k_heads"), "f32[S, 8, 128]");
    // The KV pool: 2048 positions in blocks of 16, keys dims-major.
    assert_eq!(
        shape_of("layers.3.attention.cache_k"),
        "f32[128, 8, 128, 16]"
    );
    assert_eq!(
        shape_of("layers.3.attention.cache_v"),
        "f32[128, 8, 16, 128]"
    );
    assert_eq!(
        shape_of("layers.3.attention.cache_k.write"),
        "f32[128, 8, 128, 16]"
    );
    assert_eq!(shape_of("layers.3.attention.scores"), "f32[32, S, T]");
    assert_eq!(shape_of("positions"), "i32[S]");
    assert_eq!(shape_of("kv.slots"), "i32[S]");
    assert_eq!(shape_of("kv.seqs"), "i32[N, 5]");
    assert_eq!(shape_of("kv.blocks"), "i32[128]");
    assert_eq!(shape_of("layers.3.attention.wq.weight"), "bf16[4096, 4096]");
    assert_eq!(shape_of("output"), "f32[S, 128256]");
}

#[test]
fn shape_mismatch_names_node_expected_and_actual() {
    let mut g = Graph::new();
    let x = g
        .add_source(
            "x",
            Op::Tokens,
            TensorMeta::new(Shape(vec![Dim::S]), DType::I32),
            None,
        )
        .unwrap();
    let table = g
        .add_source(
            "emb.weight",
            Op::Weight {
                tensor: "emb.weight".into(),
            },
            TensorMeta::new(Shape::constant(&[10, 8]), DType::F32),
            None,
        )
        .unwrap();
    let h = g.add_op("emb", Op::Embedding, &[table, x], None).unwrap();
    let w = g
        .add_source(
            "proj.weight",
            Op::Weight {
                tensor: "proj.weight".into(),
            },
            TensorMeta::new(Shape::constant(&[16, 9]), DType::BF16),
            None,
        )
        .unwrap();
    let err = g.add_op("proj", Op::MatMul, &[h, w], None).unwrap_err();
    assert_eq!(
        err.to_string(),
        "node `proj`: weight (input 1) axis 1: expected dimension 8, got 9 (shape [16, 9])"
    );
    let err = g.add_op("sum", Op::Add, &[h, w], None).unwrap_err();
    assert!(
        matches!(err, GraphError::Node { ref node, .. } if node == "sum"),
        "{err}"
    );
    assert!(
        err.to_string().contains("expected dtype f32, got bf16"),
        "{err}"
    );
    // A reshape that changes the element count is refused.
    let err = g
        .add_op_as(
            "bad_reshape",
            Op::Reshape,
            &[h],
            TensorMeta::new(
                Shape(vec![Dim::S, Dim::Const(4), Dim::Const(3)]),
                DType::F32,
            ),
            None,
        )
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "node `bad_reshape`: reshape from [S, 8] to [S, 4, 3] changes the element count"
    );
    // Duplicate names are refused.
    let err = g.add_op("emb", Op::Silu, &[h], None).unwrap_err();
    assert_eq!(err, GraphError::DuplicateName("emb".into()));
}

#[test]
fn snapshots_pin_structure_and_shapes() {
    let settings = common::snapshot_settings();
    settings.bind(|| {
        for arch in all_archs() {
            let g = build(arch);
            insta::assert_snapshot!(format!("graph_{arch}"), print::dump(&g).unwrap());
        }
    });
}

#[test]
fn dropping_a_residual_changes_the_snapshot() {
    // Rewire layer 0's second residual away, as an architecture change
    // would, and check that the pinned dump no longer matches.
    let mut g = build("tiny");
    let res = g.find("layers.0.ffn_residual").unwrap();
    let down = g.find("layers.0.feed_forward.w2").unwrap();
    g.replace_uses(res, down);
    g.remove(res);
    g.verify().unwrap();
    let pinned = std::fs::read_to_string(common::root().join("snapshots/graph_tiny.snap")).unwrap();
    let body = pinned.splitn(3, "---").nth(2).unwrap().trim_start();
    assert_eq!(
        body,
        print::dump(&build("tiny")).unwrap(),
        "the snapshot pins the built graph"
    );
    assert_ne!(body, print::dump(&g).unwrap());
}

#[test]
fn serde_round_trips() {
    for arch in ["tiny", "smollm2-135m"] {
        let g = build(arch);
        let json = g.to_json().unwrap();
        let back = Graph::from_json(&json).unwrap();
        back.verify().unwrap();
        assert_eq!(print::dump(&back).unwrap(), print::dump(&g).unwrap());
        assert_eq!(back.to_json().unwrap(), json);
        let bin = g.to_bincode().unwrap();
        let back = Graph::from_bincode(&bin).unwrap();
        back.verify().unwrap();
        assert_eq!(back.to_json().unwrap(), json);
        assert_eq!(back.to_bincode().unwrap(), bin);
    }
}

#[test]
fn committed_graphs_are_fresh() {
    // `graphs/<arch>/graph.dot` is what `llama-graph graph --dot` prints.
    // Regenerate with: LLAMA_GRAPH_UPDATE_GRAPHS=1 cargo test --release --test graph committed_graphs
    let update = std::env::var_os("LLAMA_GRAPH_UPDATE_GRAPHS").is_some();
    let mut stale = Vec::new();
    for arch in all_archs() {
        let dot = to_dot(&build(arch), DotOptions::default()).unwrap();
        let path = common::root().join("graphs").join(arch).join("graph.dot");
        if update {
            std::fs::write(&path, &dot).unwrap();
        } else if std::fs::read_to_string(&path).ok().as_deref() != Some(dot.as_str()) {
            stale.push(path.display().to_string());
        }
    }
    assert!(
        stale.is_empty(),
        "stale or missing: {stale:?}; regenerate with LLAMA_GRAPH_UPDATE_GRAPHS=1 cargo test --release --test graph committed_graphs"
    );
}

#[test]
fn dot_renders_with_graphviz() {
    let dot_bin = std::process::Command::new("dot").arg("-V").output();
    assert!(
        dot_bin.is_ok(),
        "graphviz `dot` is required for this test: apt-get install graphviz"
    );
    for (arch, layers) in [
        ("tiny", None),
        ("llama-3.1-8b", Some(2)),
        ("smollm2-135m", None),
    ] {
        let dot = to_dot(&build(arch), DotOptions { max_layers: layers }).unwrap();
        let mut child = std::process::Command::new("dot")
            .arg("-Tsvg")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write;
        child
            .stdin
            .take()
            .unwrap()
            .write_all(dot.as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{arch}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let svg = String::from_utf8_lossy(&out.stdout);
        assert!(svg.contains("<svg") && svg.contains("layers.0"), "{arch}");
        if let Some(n) = layers {
            assert!(
                !svg.contains(&format!("layers.{n}.attention.wq")),
                "elided layers not drawn"
            );
            assert!(svg.contains("more layers"));
        }
    }
}

/// Each family's builder output: the ops its variant adds, per layer.
#[test]
fn family_graphs_have_their_ops() {
    for arch in FAMILY_ARCHS {
        let args = common::graph_params(arch);
        let g = build(arch);
        g.verify().unwrap();
        let n = args.n_layers;
        let c = g.op_counts();
        let count = |k: &str| c.get(k).copied().unwrap_or(0);
        let v = &args.variant;
        // Residuals, plus one bias add per projection (Qwen2).
        let biases = if v.qkv_bias { 3 * n } else { 0 };
        assert_eq!(count("Add"), 2 * n + biases, "{arch}");
        // Two norms per layer, two more with post-norms, two with Q/K norm.
        let norms = 2 + 2 * usize::from(v.post_norms) + 2 * usize::from(v.qk_norm);
        assert_eq!(count("RmsNorm"), norms * n + 1, "{arch}");
        assert_eq!(count("Scale"), usize::from(v.embed_scale), "{arch}");
        assert_eq!(
            count("GeluTanh"),
            if v.gate_act == llama_graph::model::GateAct::GeluTanh {
                n
            } else {
                0
            }
        );
        // Window on every layer (Mistral, Phi-3) or 5 of 6 (Gemma 3).
        let windowed = (0..n).filter(|&i| args.layer_window(i).is_some()).count();
        let dump = print::dump(&g).unwrap();
        assert_eq!(dump.matches(", window=").count(), windowed, "{arch}");
        // Gemma 3's local layers have their own RoPE table.
        let tables = if v.local_rope_theta.is_some() { 2 } else { 1 };
        assert_eq!(count("RopeFreqs"), tables, "{arch}");
    }
    let a = common::graph_params("gemma-3-270m");
    assert_eq!(
        (
            a.head_dim(),
            a.n_rep(),
            a.layer_window(0),
            a.layer_window(5)
        ),
        (256, 4, Some(512), None)
    );
    let a = common::graph_params("qwen3-0.6b");
    assert_eq!((a.head_dim(), a.dim / a.n_heads), (128, 64));
}

#[test]
fn vocab_must_be_known() {
    let a = common::graph_params("llama-2-7b");
    let err = build_llama(&a, &BuildOptions::new(16)).unwrap_err();
    assert!(err.to_string().contains("vocab_size"), "{err}");
    let a: ModelArgs = common::graph_params("tiny");
    assert!(build_llama(&a, &BuildOptions::new(0)).is_err());
}
