//! Accuracy of the fast quantized-matmul path (8-bit activations) against the
//! exact path and against the float32 reference, on the committed SmolLM2
//! prompts (tests/fixtures/smollm2/expected.json, made by
//! tests/reference/smollm2_reference.py with transformers in float32).
//!
//! `cargo run --release --example fast_vs_exact -- [MODEL.gguf] [threads]`
//! (default model: ~/.cache/llama-graph/SmolLM2-135M-Instruct.Q4_1.gguf).
//!
//! For each case both modes are teacher-forced on the reference's tokens
//! (prompt, then the reference's greedy tokens one by one) and compared per
//! step: top-1 agreement fast vs exact and fast vs reference, the largest
//! |logit difference| fast vs exact over the whole vocabulary, and the largest
//! difference from the reference's top-10 logits for each mode.

use llama_graph::generate::sampler::argmax;
use llama_graph::kernels::MatmulMode;
use llama_graph::session::{Model, Session, SessionOptions};
use std::path::PathBuf;

fn run(
    model: &Model,
    threads: usize,
    mode: MatmulMode,
    prompt: &[u32],
    gen: &[u32],
) -> Vec<Vec<f32>> {
    let opts = SessionOptions {
        threads,
        exact: mode == MatmulMode::Exact,
        ..SessionOptions::default()
    };
    let mut s = Session::new(model, &opts).expect("session");
    let mut out = vec![s.feed(prompt).expect("feed").to_vec()];
    for &t in &gen[..gen.len() - 1] {
        out.push(s.feed(&[t]).expect("feed").to_vec());
    }
    out
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let home = std::env::var("HOME").unwrap_or_default();
    let path = args.get(1).map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(home).join(".cache/llama-graph/SmolLM2-135M-Instruct.Q4_1.gguf")
    });
    let threads: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(1);
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/smollm2/expected.json");
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&fixture).expect("fixture")).expect("json");
    let model = Model::open(&path).expect("model");
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array()
            .expect("array")
            .iter()
            .map(|x| x.as_u64().expect("id") as u32)
            .collect()
    };
    let (mut steps, mut agree_exact, mut agree_ref_fast, mut agree_ref_exact) = (0, 0, 0, 0);
    let (mut max_fe, mut max_ref_fast, mut max_ref_exact) = (0f32, 0f32, 0f32);
    for (ci, case) in doc["cases"].as_array().expect("cases").iter().enumerate() {
        let prompt = ids(&case["prompt_tokens"]);
        let gen = ids(&case["generated_tokens"]);
        let exact = run(&model, threads, MatmulMode::Exact, &prompt, &gen);
        let fast = run(&model, threads, MatmulMode::Fast, &prompt, &gen);
        let (mut c_fe, mut c_rf, mut c_re, mut c_agree) = (0f32, 0f32, 0f32, 0);
        for (i, (e, f)) in exact.iter().zip(&fast).enumerate() {
            steps += 1;
            let (ae, af) = (argmax(e), argmax(f));
            if ae == af {
                agree_exact += 1;
                c_agree += 1;
            }
            if af == gen[i] as usize {
                agree_ref_fast += 1;
            }
            if ae == gen[i] as usize {
                agree_ref_exact += 1;
            }
            let d = e
                .iter()
                .zip(f)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            c_fe = c_fe.max(d);
            for tl in case["steps"][i]["top"].as_array().expect("top") {
                let id = tl[0].as_u64().expect("id") as usize;
                let want = tl[1].as_f64().expect("logit") as f32;
                c_rf = c_rf.max((f[id] - want).abs());
                c_re = c_re.max((e[id] - want).abs());
            }
        }
        // The reference's top-2 margin at the first step and the same
        // difference under each mode (a sign flip changes the greedy reply).
        let top = case["steps"][0]["top"].as_array().expect("top");
        let (i1, i2) = (
            top[0][0].as_u64().expect("id") as usize,
            top[1][0].as_u64().expect("id") as usize,
        );
        let (r1, r2) = (
            top[0][1].as_f64().expect("logit"),
            top[1][1].as_f64().expect("logit"),
        );
        println!(
            "case {ci}: step 0 margin top1-top2 ({i1} vs {i2}): reference {:.3}, exact {:.3}, fast {:.3}",
            r1 - r2,
            exact[0][i1] - exact[0][i2],
            fast[0][i1] - fast[0][i2]
        );
        println!(
            "case {ci}: {} steps, top-1 fast==exact {c_agree}, max|fast-exact| {c_fe:.3}, max|ref-fast| {c_rf:.3}, max|ref-exact| {c_re:.3}",
            exact.len()
        );
        max_fe = max_fe.max(c_fe);
        max_ref_fast = max_ref_fast.max(c_rf);
        max_ref_exact = max_ref_exact.max(c_re);
    }
    println!(
        "{{\"steps\": {steps}, \"top1_fast_eq_exact\": {agree_exact}, \"top1_fast_eq_reference\": {agree_ref_fast}, \"top1_exact_eq_reference\": {agree_ref_exact}, \"max_abs_fast_minus_exact\": {max_fe:.4}, \"max_abs_reference_minus_fast_top10\": {max_ref_fast:.4}, \"max_abs_reference_minus_exact_top10\": {max_ref_exact:.4}}}"
    );
}
