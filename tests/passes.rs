//! Optimisation passes: each fusion gives the same outputs as the unfused
//! graph on random weights, rewrites what it should (op counts), and the
//! optimised graphs are pinned by snapshots next to the unoptimised ones.
mod common;

use llama_graph::exec::materialize_packed;
use llama_graph::ir::{print, DType, Graph, LogitRows, Op, PackedWeight, RopeScaling};
use llama_graph::kernels::quantized::quantize_row;
use llama_graph::model::{build_llama, BuildOptions, ModelArgs};
use llama_graph::passes::{count_kind, run_pipeline, PassList, PASSES};
use llama_graph::session::{Model, ModelFormat, Session, SessionOptions};
use llama_graph::weights::{TensorBytes, WeightStore, WeightTensor};
use std::sync::Arc;

/// SplitMix64, mapped to roughly uniform [-1, 1).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f32 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

fn encode(dtype: DType, v: &[f32]) -> Vec<u8> {
    let mut out = vec![0u8; dtype.bytes_for(v.len()).unwrap()];
    quantize_row(dtype, v, &mut out).unwrap();
    out
}

/// A model with random weights for `args`: matrices in `dtype`, norm
/// weights in f32 (as GGUF files have them).
fn random_model(args: &ModelArgs, dtype: DType, seed: u64) -> Model {
    let g = build_llama(args, &BuildOptions::new(16)).unwrap();
    let mut rng = Rng(seed);
    let mut store = WeightStore::default();
    for id in g.node_ids() {
        let n = g.node(id);
        let Op::Weight { tensor } = &n.op else {
            continue;
        };
        let shape: Vec<usize> = n
            .meta
            .shape
            .dims()
            .iter()
            .map(|d| d.as_const().unwrap())
            .collect();
        let numel: usize = shape.iter().product();
        let (dt, vals): (DType, Vec<f32>) = if shape.len() == 1 {
            (
                DType::F32,
                (0..numel).map(|_| 1.0 + 0.2 * rng.next()).collect(),
            )
        } else {
            let scale = 1.5 / (shape[1] as f32).sqrt();
            (dtype, (0..numel).map(|_| scale * rng.next()).collect())
        };
        store.tensors.insert(
            tensor.clone(),
            WeightTensor {
                dtype: dt,
                shape,
                data: TensorBytes::Owned(Arc::new(encode(dt, &vals))),
            },
        );
    }
    Model {
        path: "random".into(),
        format: ModelFormat::MetaDir,
        args: args.clone(),
        weights: store,
        tokenizer: None,
        chat_template: None,
        name: None,
        file_type: None,
    }
}

fn tiny_args(scaled_rope: bool) -> ModelArgs {
    let mut a = common::graph_params("tiny");
    if scaled_rope {
        a.rope_scaling = Some(RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_context: 16,
        });
        a.rope_theta = 500000.0;
    }
    a
}

/// Logits of the last position after a multi-chunk prompt and after each
/// of a few single-token steps.
fn run(model: &Model, passes: &str, rows: LogitRows) -> (Vec<Vec<f32>>, Session) {
    run_with(model, passes, rows, None)
}

fn run_with(
    model: &Model,
    passes: &str,
    rows: LogitRows,
    serial_attention_work: Option<usize>,
) -> (Vec<Vec<f32>>, Session) {
    run_mode(model, passes, rows, serial_attention_work, true)
}

fn run_mode(
    model: &Model,
    passes: &str,
    rows: LogitRows,
    serial_attention_work: Option<usize>,
    exact: bool,
) -> (Vec<Vec<f32>>, Session) {
    let opts = SessionOptions {
        context: Some(48),
        batch: 5,
        parallel: 1,
        threads: 2,
        logit_rows: rows,
        passes: PassList::parse(passes).unwrap(),
        exact,
        ..SessionOptions::default()
    };
    let mut s = Session::new(model, &opts).unwrap();
    if let Some(w) = serial_attention_work {
        s.exec_mut().set_serial_attention_work(w);
    }
    let prompt: Vec<u32> = (0..13).map(|i| (i * 37 + 11) % 256).collect();
    let mut out = vec![s.feed(&prompt).unwrap().to_vec()];
    for t in [7u32, 200, 31, 99] {
        out.push(s.feed(&[t]).unwrap().to_vec());
    }
    (out, s)
}

fn assert_close(a: &[Vec<f32>], b: &[Vec<f32>], what: &str) {
    assert_eq!(a.len(), b.len());
    for (step, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(x.len(), y.len());
        let scale = y.iter().fold(0f32, |m, v| m.max(v.abs())).max(1.0);
        let diff = x.iter().zip(y).fold(0f32, |m, (p, q)| m.max((p - q).abs()));
        assert!(
            diff <= 2e-5 * scale,
            "{what}: step {step}: max |diff| {diff} (logit scale {scale})"
        );
        // The comparison is not vacuous: the logits vary.
        let spread = y.iter().fold(0f32, |m, v| m.max((v - y[0]).abs()));
        assert!(spread > 1e-3, "{what}: degenerate logits");
    }
}

/// Every pass alone (and the dependent chains for fuse_rope_cache and
/// compress_weights) gives the unfused graph's logits, for f32, bf16 and
/// block-quantized (Q8_0, Q4_1) weights, which packing concatenates
/// byte-wise (and compress_weights stores losslessly when they are bf16).
#[test]
fn each_fusion_matches_the_unfused_graph() {
    // fuse_rope_cache alone finds nothing (it needs fuse_qkv and
    // fuse_attention first), nor does compress_weights (it needs packed
    // weights), so they are tested in those chains.
    let singles: Vec<String> = PASSES
        .iter()
        .map(|p| p.name.to_string())
        // interleave_weights also needs packed weights, and exact sessions
        // skip it: see fast_path_logits_do_not_depend_on_the_weight_layout.
        .filter(|n| n != "fuse_rope_cache" && n != "compress_weights" && n != "interleave_weights")
        .collect();
    let mut configs: Vec<String> = singles.clone();
    configs.push("fuse_qkv,fuse_attention,fuse_rope_cache".into());
    configs.push("pack_weights,compress_weights".into());
    configs.push("fuse_qkv,fuse_gate_up,compress_weights".into());
    configs.push("all".into());
    for (dtype, scaled) in [
        (DType::F32, true),
        (DType::BF16, false),
        (DType::Q8_0, true),
        (DType::Q4_1, false),
    ] {
        let model = random_model(&tiny_args(scaled), dtype, 42);
        let (want, _) = run(&model, "none", LogitRows::Last);
        for c in &configs {
            let (got, sess) = run(&model, c, LogitRows::Last);
            let rewrites: usize = sess.passes().passes.iter().map(|p| p.rewrites).sum();
            // dead_code has nothing to remove in the builder's graph.
            if c != "dead_code" {
                assert!(rewrites > 0, "{c} rewrote nothing");
            }
            // The bf16 model's packed weights are stored compressed.
            if dtype == DType::BF16 && (c == "all" || c.contains("compress_weights")) {
                let compressed = sess
                    .passes()
                    .passes
                    .iter()
                    .find(|p| p.name == "compress_weights");
                assert!(
                    compressed.is_some_and(|p| p.rewrites > 0),
                    "{c}: compress_weights rewrote nothing"
                );
            }
            assert_close(&got, &want, &format!("{dtype} {c}"));
        }
        // Fused attention on the pool too (small calls run serially by default).
        let (got, _) = run_with(&model, "all", LogitRows::Last, Some(0));
        assert_close(&got, &want, &format!("{dtype} all, pooled attention"));
    }
}

/// In fast mode, `interleave_weights` stores the packed quantized weights
/// row-interleaved (x8) and every logit stays bit for bit what the
/// row-major weights give (prefill chunks and single-token steps); exact
/// sessions skip the pass.
#[test]
fn fast_path_logits_do_not_depend_on_the_weight_layout() {
    let rows_only = PassList::all()
        .without("interleave_weights")
        .names()
        .join(",");
    // (The block types our quantizer writes; the kernels' tests cover the others.)
    for dtype in [DType::Q8_0, DType::Q4_0, DType::Q4_1] {
        let model = random_model(&tiny_args(false), dtype, 11);
        let (want, s0) = run_mode(&model, &rows_only, LogitRows::Last, None, false);
        assert!(!s0
            .passes()
            .passes
            .iter()
            .any(|p| p.name == "interleave_weights"));
        let (got, sess) = run_mode(&model, "all", LogitRows::Last, None, false);
        let x8 = sess
            .passes()
            .passes
            .iter()
            .find(|p| p.name == "interleave_weights")
            .map(|p| p.rewrites);
        assert!(
            x8.is_some_and(|n| n > 0),
            "{dtype}: interleave_weights rewrote nothing ({x8:?})"
        );
        for (step, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!(
                a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{dtype}: step {step} logits differ between x8 and row-major weights"
            );
        }
        assert_eq!(got.len(), want.len());
        let (_, exact) = run_mode(&model, "all", LogitRows::Last, None, true);
        assert!(!exact
            .passes()
            .passes
            .iter()
            .any(|p| p.name == "interleave_weights"));
    }
}

#[test]
fn all_logit_rows_skip_last_logits_and_match() {
    let model = random_model(&tiny_args(false), DType::F32, 7);
    let (want, _) = run(&model, "none", LogitRows::All);
    let (got, sess) = run(&model, "all", LogitRows::All);
    assert!(!sess.passes().passes.iter().any(|p| p.name == "last_logits"));
    assert_eq!(count_kind(sess.graph(), "LastRows"), 0);
    assert_close(&got, &want, "rows=All");
}

fn build(arch: &str) -> Graph {
    let args = common::graph_params(arch);
    let ctx = args.plan_context(None);
    build_llama(&args, &BuildOptions::new(ctx)).unwrap()
}

fn optimised(arch: &str) -> Graph {
    let mut g = build(arch);
    run_pipeline(&mut g, &PassList::all(), |_, _| {}).unwrap();
    g
}

/// A Qwen2 graph whose Q/K/V projections stay unfused (as when their
/// weights have different types, e.g. a Q4_K_M file's Q6_K `attn_v`): its
/// bias adds are not residuals, so `fuse_residual` fuses only the two real
/// residual adds of each layer and leaves the biases as `Add`.
#[test]
fn fuse_residual_leaves_biases() {
    let g = build("qwen2.5-0.5b");
    let n = common::graph_params("qwen2.5-0.5b").n_layers;
    assert_eq!(count_kind(&g, "Add"), 5 * n);
    let mut f = g.clone();
    let r = run_pipeline(
        &mut f,
        &PassList::parse("fuse_residual").unwrap(),
        |_, _| {},
    )
    .unwrap();
    assert_eq!(r.passes[0].rewrites, 2 * n);
    assert_eq!(count_kind(&f, "MatMulAdd"), 2 * n);
    assert_eq!(count_kind(&f, "Add"), 3 * n);
}

#[test]
fn fusion_counts() {
    for arch in ["llama-3.1-8b", "smollm2-135m", "llama-3.2-1b"] {
        let n = common::graph_params(arch).n_layers;
        let before = build(arch);
        let single = |name: &str| {
            let mut g = before.clone();
            let r = run_pipeline(&mut g, &PassList::parse(name).unwrap(), |_, _| {}).unwrap();
            (g, r.passes[0].rewrites)
        };
        let (g, r) = single("fuse_attention");
        assert_eq!(r, n);
        assert_eq!(count_kind(&g, "Softmax"), 0, "{arch}");
        assert_eq!(count_kind(&g, "AttnScores"), 0);
        assert_eq!(count_kind(&g, "Attention"), n);
        let (g, r) = single("fold_norm_weight");
        assert_eq!(r, 2 * n + 1);
        assert_eq!(count_kind(&g, "Mul"), n, "only the SwiGLU products remain");
        let (g, r) = single("fuse_qkv");
        assert_eq!(r, n);
        assert_eq!(count_kind(&g, "SliceCols"), 3 * n);
        assert_eq!(g.packed().count(), n);
        let (g, _) = single("fuse_gate_up");
        assert_eq!(count_kind(&g, "MatMulSwiGlu"), n);
        assert_eq!(count_kind(&g, "Silu"), 0);
        let (g, _) = single("fuse_residual");
        assert_eq!(count_kind(&g, "MatMulAdd"), 2 * n);
        assert_eq!(count_kind(&g, "Add"), 0);
        let (g, _) = single("fold_rope_table");
        assert_eq!(count_kind(&g, "RopeFreqs"), 0);
        assert_eq!(count_kind(&g, "RopeTable"), 1);
        let (_, r) = single("fuse_rope_cache");
        assert_eq!(r, 0, "needs fuse_qkv and fuse_attention first");
        let (g, r) = single("dead_code");
        assert_eq!((r, g.node_count()), (0, before.node_count()));
        // Every linear layer's matrix (wq wk wv wo w1 w2 w3 per layer, the
        // output head) becomes a one-part packed copy; norm vectors do not.
        let (g, r) = single("pack_weights");
        assert_eq!(r, 7 * n + 1, "{arch}");
        assert_eq!(g.packed().count(), 7 * n + 1);
        assert!(g.packed().all(|p| p.parts.len() == 1
            && p.name == format!("{}{}", p.parts[0], llama_graph::passes::PACKED_SUFFIX)));
        assert_eq!(count_kind(&g, "Weight"), count_kind(&before, "Weight"));

        let g = optimised(arch);
        let c = g.op_counts();
        let get = |k: &str| c.get(k).copied().unwrap_or(0);
        assert_eq!(get("QkvRopeCache"), n, "{arch}");
        assert_eq!(get("Attention"), n);
        assert_eq!(get("MatMulSwiGlu"), n);
        assert_eq!(get("MatMulAdd"), 2 * n);
        assert_eq!(get("RmsNormScaled"), 2 * n + 1);
        assert_eq!(get("LastRows"), 1);
        for gone in [
            "MatMul",
            "Softmax",
            "KvWrite",
            "Rope",
            "Mul",
            "Add",
            "Silu",
            "RopeFreqs",
        ] {
            assert_eq!(get(gone), 0, "{arch}: {gone} left");
        }
        // Weights: the packed ones replace wq/wk/wv and w1/w3; wo, w2 and
        // the output head are packed alone; the norm vectors stay.
        assert_eq!(get("Weight"), count_kind(&before, "Weight") - 3 * n);
        assert_eq!(g.packed().count(), 4 * n + 1, "{arch}");
        for id in g.node_ids() {
            if let Op::Weight { tensor } = &g.node(id).op {
                // Matrices not only gathered from (an untied embedding table).
                let matrix = g.node(id).meta.shape.rank() == 2
                    && g.users(id)
                        .iter()
                        .any(|&u| !matches!(g.node(u).op, Op::Embedding));
                assert_eq!(
                    g.packed_weight(tensor).is_some(),
                    matrix,
                    "{arch}: {tensor}"
                );
            }
        }
        let (b, a) = (before.nodes_per_layer(), g.nodes_per_layer());
        assert!(
            a[0] * 2 <= b[0],
            "{arch}: {} vs {} nodes per layer",
            a[0],
            b[0]
        );
        assert!(a.iter().all(|&x| x == a[0]));
        let out = g.node(g.outputs()[0]);
        assert_eq!(out.op, Op::OutputHead);
        assert_eq!(
            out.meta.to_string(),
            format!("f32[R, {}]", common::graph_params(arch).vocab_size.unwrap())
        );
    }
}

#[test]
fn pipeline_records_each_pass_and_verifies() {
    let mut g = build("tiny");
    let before = g.node_count();
    let mut seen = Vec::new();
    let r = run_pipeline(&mut g, &PassList::all(), |name, g| {
        g.verify().unwrap();
        seen.push((name.to_string(), g.node_count()));
    })
    .unwrap();
    assert_eq!(r.nodes_before, before);
    assert_eq!(r.nodes_after, g.node_count());
    assert_eq!(r.passes.len(), PASSES.len());
    for (rec, (name, count)) in r.passes.iter().zip(&seen) {
        assert_eq!(rec.name, name);
        assert_eq!(rec.nodes_after, *count);
    }
    for w in r.passes.windows(2) {
        assert_eq!(w[0].nodes_after, w[1].nodes_before);
    }
    // The graph survives serialisation with its packed weights.
    let back = Graph::from_json(&g.to_json().unwrap()).unwrap();
    assert_eq!(print::dump(&back).unwrap(), print::dump(&g).unwrap());
    assert_eq!(back.packed().count(), g.packed().count());
}

#[test]
fn pass_lists_parse_in_declared_order() {
    let l = PassList::parse("dead_code, fuse_qkv").unwrap();
    assert_eq!(l.names(), ["fuse_qkv", "dead_code"]);
    assert!(PassList::parse("none").unwrap().is_empty());
    assert_eq!(PassList::parse("all").unwrap().names().len(), PASSES.len());
    let e = PassList::parse("fuse_qkv,fuse_everything").unwrap_err();
    assert!(
        e.contains("fuse_everything") && e.contains("fuse_gate_up"),
        "{e}"
    );
}

/// A windowed layer's attention is fused and keeps its window (Gemma 3:
/// five windowed layers, then a global one), and its Q/K/V, RoPE and cache
/// writes fuse around it as a global layer's do.
#[test]
fn windowed_attention_is_fused_and_keeps_its_window() {
    let arch = "gemma-3-270m";
    let args = common::graph_params(arch);
    let n = args.n_layers;
    let windows: Vec<Option<usize>> = (0..n).map(|i| args.layer_window(i)).collect();
    assert!(windows.iter().any(|w| w.is_some()) && windows.iter().any(|w| w.is_none()));
    let layer_windows = |g: &Graph| -> Vec<(usize, Option<usize>)> {
        let mut v: Vec<_> = g
            .node_ids()
            .filter_map(|id| match g.node(id).op {
                Op::AttnScores { window, .. } | Op::Attention { window, .. } => {
                    Some((g.node(id).layer.unwrap(), window))
                }
                _ => None,
            })
            .collect();
        v.sort();
        v
    };
    let want: Vec<(usize, Option<usize>)> = windows.iter().copied().enumerate().collect();
    let before = build(arch);
    assert_eq!(layer_windows(&before), want);
    let mut g = before.clone();
    let r = run_pipeline(
        &mut g,
        &PassList::parse("fuse_attention").unwrap(),
        |_, _| {},
    )
    .unwrap();
    assert_eq!(r.passes[0].rewrites, n, "every layer, windowed or not");
    assert_eq!(count_kind(&g, "AttnScores"), 0);
    assert_eq!(count_kind(&g, "Attention"), n);
    assert_eq!(layer_windows(&g), want);
    let g = optimised(arch);
    assert_eq!(count_kind(&g, "QkvRopeCache"), n);
    assert_eq!(count_kind(&g, "KvWrite"), 0);
    assert_eq!(layer_windows(&g), want);
}

/// A windowed tiny model (window 5, shorter than the 13-token prompt):
/// the fused windowed attention gives the unfused graph's logits.
#[test]
fn windowed_fusion_matches_the_unfused_graph() {
    let mut args = tiny_args(false);
    args.variant.sliding_window = Some(5);
    for dtype in [DType::F32, DType::Q8_0] {
        let model = random_model(&args, dtype, 5);
        let (want, _) = run(&model, "none", LogitRows::Last);
        for c in [
            "fuse_attention",
            "fuse_qkv,fuse_attention,fuse_rope_cache",
            "all",
        ] {
            let (got, sess) = run(&model, c, LogitRows::Last);
            assert_eq!(count_kind(sess.graph(), "AttnScores"), 0, "{c}");
            assert_close(&got, &want, &format!("windowed {dtype} {c}"));
        }
        let (got, _) = run_with(&model, "all", LogitRows::Last, Some(0));
        assert_close(
            &got,
            &want,
            &format!("windowed {dtype} all, pooled attention"),
        );
        // The window is honoured: without it the logits differ.
        let (full, _) = run(
            &random_model(&tiny_args(false), dtype, 5),
            "all",
            LogitRows::Last,
        );
        let diff = full[0]
            .iter()
            .zip(&want[0])
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(diff > 1e-3, "the window changes nothing ({diff})");
    }
}

#[test]
fn snapshots_of_optimised_graphs() {
    let settings = common::snapshot_settings();
    settings.bind(|| {
        for arch in ["llama-3.1-8b", "smollm2-135m", "gemma-3-270m"] {
            let g = optimised(arch);
            insta::assert_snapshot!(format!("graph_{arch}_optimised"), print::dump(&g).unwrap());
        }
    });
}

fn raw(dtype: DType, shape: &[usize], fill: u8) -> WeightTensor {
    let n: usize = shape.iter().product();
    let len = dtype.bytes_for(n).unwrap();
    WeightTensor {
        dtype,
        shape: shape.to_vec(),
        data: TensorBytes::Owned(Arc::new((0..len).map(|i| fill ^ (i as u8)).collect())),
    }
}

#[test]
fn packed_weights_are_byte_concatenations_for_any_dtype() {
    for dtype in [DType::BF16, DType::Q4_0, DType::Q4_K, DType::Q6_K] {
        let k = 256;
        let mut store = WeightStore::default();
        store.tensors.insert("a".into(), raw(dtype, &[4, k], 1));
        store.tensors.insert("b".into(), raw(dtype, &[2, k], 2));
        let mut g = build("tiny");
        g.add_packed(PackedWeight {
            name: "ab".into(),
            parts: vec!["a".into(), "b".into()],
            axis: 0,
            stored_as: None,
            layout: Default::default(),
        });
        let out = materialize_packed(&g, &store).unwrap();
        let ab = &out.tensors["ab"];
        assert_eq!((ab.dtype, ab.shape.clone()), (dtype, vec![6, k]));
        let mut want = store.tensors["a"].data.as_bytes().to_vec();
        want.extend_from_slice(store.tensors["b"].data.as_bytes());
        assert_eq!(ab.data.as_bytes(), &want[..]);
        // Mismatched parts are refused with a message naming them.
        store.tensors.insert("b".into(), raw(dtype, &[2, 2 * k], 2));
        let e = materialize_packed(&g, &store).unwrap_err().to_string();
        assert!(e.contains("`ab`") && e.contains("`b`"), "{e}");
        store.tensors.remove("b");
        let e = materialize_packed(&g, &store).unwrap_err().to_string();
        assert!(e.contains("missing tensor `b`"), "{e}");
    }
}

fn graph_cli(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_llama-graph"))
        .arg("graph")
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn cli_stats_json_and_dot_after_a_pass() {
    let dir = tempfile::tempdir().unwrap();
    let stats = dir.path().join("stats.json");
    let params = common::root().join("graphs/llama-3.1-8b/params.json");
    let out = graph_cli(&[
        "--params",
        params.to_str().unwrap(),
        "-c",
        "8192",
        "-b",
        "512",
        "--passes",
        "all",
        "--stats-json",
        stats.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&stats).unwrap()).unwrap();
    let n = |k: &str| v[k].as_u64().unwrap_or_else(|| panic!("key {k}"));
    assert_eq!(n("nodes_per_layer_before"), 37);
    assert!(n("nodes_per_layer_after") * 2 <= n("nodes_per_layer_before"));
    assert!(n("nodes_after") < n("nodes_before"));
    assert!(n("arena_bytes") * 4 <= n("naive_activation_bytes"));
    assert_eq!(v["plan_check"], "ok");
    assert_eq!(v["unoptimised"]["plan_check"], "ok");
    let passes = v["passes"].as_array().unwrap();
    assert_eq!(passes.len(), PASSES.len());
    assert_eq!(passes[0]["nodes_before"].as_u64(), Some(n("nodes_before")));
    assert_eq!(
        passes.last().unwrap()["nodes_after"].as_u64(),
        Some(n("nodes_after"))
    );

    let tiny = common::root().join("graphs/tiny/params.json");
    let out = graph_cli(&[
        "--params",
        tiny.to_str().unwrap(),
        "--dot",
        "--after",
        "fuse_qkv",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let dot = String::from_utf8(out.stdout).unwrap();
    assert!(dot.starts_with("digraph"), "{dot}");
    assert!(dot.contains("layers.0.attention.wqkv.weight") && dot.contains("SliceCols"));
    assert!(dot.contains("RmsNormScaled"), "earlier passes ran");
    assert!(!dot.contains("MatMulSwiGlu"), "later passes did not");

    let out = graph_cli(&[
        "--params",
        tiny.to_str().unwrap(),
        "--passes",
        "fuse_qkv",
        "--after",
        "dead_code",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("dead_code"));
    let out = graph_cli(&[
        "--params",
        tiny.to_str().unwrap(),
        "--passes",
        "fuse_everything",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("fuse_everything"));

    // `--help` names every pass (its list is written out by hand).
    let out = graph_cli(&["--help"]);
    let help = String::from_utf8_lossy(&out.stdout).replace(char::is_whitespace, "");
    for p in PASSES {
        assert!(
            help.contains(p.name),
            "graph --help does not name {}",
            p.name
        );
    }
}

#[test]
fn dead_code_keeps_cache_writes_and_drops_unused_work() {
    use llama_graph::ir::{CacheKind, Dim, Shape, TensorMeta};
    let mut g = Graph::new();
    let tokens = g
        .add_source(
            "tokens",
            Op::Tokens,
            TensorMeta::new(Shape(vec![Dim::S]), DType::I32),
            None,
        )
        .unwrap();
    let table = g
        .add_source(
            "emb",
            Op::Weight {
                tensor: "emb".into(),
            },
            TensorMeta::new(Shape::constant(&[10, 8]), DType::F32),
            None,
        )
        .unwrap();
    let x = g
        .add_op("x", Op::Embedding, &[table, tokens], None)
        .unwrap();
    let heads = g
        .add_op_as(
            "heads",
            Op::Reshape,
            &[x],
            TensorMeta::new(
                Shape(vec![Dim::S, Dim::Const(2), Dim::Const(4)]),
                DType::F32,
            ),
            None,
        )
        .unwrap();
    let cache = g
        .add_source(
            "cache",
            Op::KvCache {
                layer: 0,
                kind: CacheKind::K,
            },
            TensorMeta::new(Shape::constant(&[1, 2, 4, 16]), DType::F16),
            None,
        )
        .unwrap();
    let slots = g
        .add_source(
            "slots",
            Op::KvSlots,
            TensorMeta::new(Shape(vec![Dim::S]), DType::I32),
            None,
        )
        .unwrap();
    let write = g
        .add_op("write", Op::KvWrite, &[cache, heads, slots], None)
        .unwrap();
    let w = g
        .add_source(
            "w",
            Op::Weight { tensor: "w".into() },
            TensorMeta::new(Shape::constant(&[3, 8]), DType::F32),
            None,
        )
        .unwrap();
    let unused = g.add_op("unused", Op::MatMul, &[x, w], None).unwrap();
    let out = g.add_op("out", Op::Silu, &[x], None).unwrap();
    g.mark_output(out);
    let r = llama_graph::passes::dead_code(&mut g).unwrap();
    assert_eq!(r.rewrites, 2, "the unused MatMul and its weight");
    assert!(!g.contains(unused) && !g.contains(w));
    for id in [tokens, table, x, heads, cache, slots, write, out] {
        assert!(g.contains(id));
    }
    g.verify().unwrap();
}

#[test]
fn fused_ops_check_their_inputs() {
    use llama_graph::ir::infer::infer;
    use llama_graph::ir::{Dim, Shape, TensorMeta, SEQ_TABLE_COLS};
    let f = |dims: Vec<Dim>| TensorMeta::new(Shape(dims), DType::F32);
    let c = Dim::Const;
    let x = f(vec![Dim::S, c(12)]);
    let e = infer(&Op::SliceCols { start: 8, len: 8 }, &[&x], None).unwrap_err();
    assert!(e.contains("8..16") && e.contains("12 columns"), "{e}");
    let q = f(vec![Dim::S, c(4), c(8)]);
    // Two blocks of 16 positions, 2 kv heads of 8: keys [NB, Hkv, D, BS],
    // values [NB, Hkv, BS, D].
    let k = TensorMeta::new(Shape::constant(&[2, 2, 8, 16]), DType::F16);
    let v = TensorMeta::new(Shape::constant(&[2, 2, 16, 8]), DType::F16);
    let seqs = TensorMeta::new(Shape(vec![Dim::N, c(SEQ_TABLE_COLS)]), DType::I32);
    let blocks = TensorMeta::new(Shape::constant(&[2]), DType::I32);
    let attn = |n_rep| Op::Attention {
        n_rep,
        scale: 0.35,
        window: None,
    };
    let ok = infer(&attn(2), &[&q, &k, &v, &seqs, &blocks], None).unwrap();
    assert_eq!(ok.to_string(), "f32[S, 4, 8]");
    let e = infer(&attn(3), &[&q, &k, &v, &seqs, &blocks], None).unwrap_err();
    assert!(e.contains("q (input 0)"), "{e}");
    // Values in the keys' layout, a block table shorter than the pool, a
    // per-token table where the sequence table belongs.
    let e = infer(&attn(2), &[&q, &k, &k, &seqs, &blocks], None).unwrap_err();
    assert!(e.contains("v (input 2)"), "{e}");
    let one = TensorMeta::new(Shape::constant(&[1]), DType::I32);
    let e = infer(&attn(2), &[&q, &k, &v, &seqs, &one], None).unwrap_err();
    assert!(e.contains("blocks (input 4)"), "{e}");
    // A longer table is a window layer's: its own, smaller pool, with the
    // table laid out as the shared pool's.
    let three = TensorMeta::new(Shape::constant(&[3]), DType::I32);
    infer(&attn(2), &[&q, &k, &v, &seqs, &three], None).unwrap();
    let per_token = TensorMeta::new(Shape(vec![Dim::S]), DType::I32);
    let e = infer(&attn(2), &[&q, &k, &v, &per_token, &blocks], None).unwrap_err();
    assert!(e.contains("seqs (input 3)"), "{e}");
    let w = TensorMeta::new(Shape::constant(&[3, 12]), DType::BF16);
    let e = infer(&Op::MatMulSwiGlu, &[&x, &w], None).unwrap_err();
    assert!(e.contains("even"), "{e}");
    let r = f(vec![Dim::S, c(4)]);
    let e = infer(&Op::MatMulAdd, &[&r, &x, &w], None).unwrap_err();
    assert!(e.contains("residual (input 0)"), "{e}");
}

/// One prefill step longer than the fused QKV projection's token block
/// (128) and the tiled attention's thresholds: fused and unfused agree.
#[test]
fn long_prefill_step_matches_the_unfused_graph() {
    for dtype in [DType::F32, DType::Q8_0] {
        let model = random_model(&tiny_args(false), dtype, 3);
        let logits = |passes: &str| {
            let opts = SessionOptions {
                context: Some(320),
                batch: 300,
                parallel: 1,
                threads: 2,
                logit_rows: LogitRows::Last,
                passes: PassList::parse(passes).unwrap(),
                exact: true,
                ..SessionOptions::default()
            };
            let mut s = Session::new(&model, &opts).unwrap();
            let prompt: Vec<u32> = (0..300).map(|i| (i * 53 + 7) % 256).collect();
            let mut out = vec![s.feed(&prompt).unwrap().to_vec()];
            out.push(s.feed(&[5]).unwrap().to_vec());
            out
        };
        assert_close(&logits("all"), &logits("none"), &format!("{dtype} S=300"));
    }
}
