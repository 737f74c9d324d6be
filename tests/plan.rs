//! Buffer planning: liveness, arena offsets, the overlap checker.
mod common;

use llama_graph::model::{build_llama, BuildOptions};
use llama_graph::passes::{run_pipeline, PassList};
use llama_graph::plan::{compile, PlanLimits};

#[test]
fn llama_3_1_8b_arena_is_small_and_checked() {
    let args = common::graph_params("llama-3.1-8b");
    let g = build_llama(&args, &BuildOptions::new(8192)).unwrap();
    let plan = compile(&g, &PlanLimits::one_sequence(512, 8192)).unwrap();
    let b = &plan.buffers;
    b.check().unwrap();
    assert!(b.arena_bytes >= b.peak_live_bytes);
    eprintln!(
        "arena {} MiB, naive {} MiB, peak {} MiB, ratio {:.3}, in place {}",
        b.arena_bytes >> 20,
        b.naive_activation_bytes >> 20,
        b.peak_live_bytes >> 20,
        b.arena_bytes as f64 / b.naive_activation_bytes as f64,
        b.in_place
    );
    assert!(
        b.arena_bytes * 4 <= b.naive_activation_bytes,
        "arena must be <= 25% of naive"
    );
}

#[test]
fn checker_catches_overlap() {
    let args = common::graph_params("tiny");
    let g = build_llama(&args, &BuildOptions::new(64)).unwrap();
    let mut plan = compile(&g, &PlanLimits::one_sequence(16, 64)).unwrap();
    plan.buffers.check().unwrap();
    // Move a buffer onto another that is live at the same time.
    let bufs = &mut plan.buffers.buffers;
    let (i, j) = (0..bufs.len())
        .flat_map(|i| (0..bufs.len()).map(move |j| (i, j)))
        .find(|&(i, j)| {
            i != j
                && bufs[i].bytes <= bufs[j].bytes
                && bufs[i].first <= bufs[j].last
                && bufs[j].first <= bufs[i].last
                && bufs[i].bytes > 0
                && bufs[j].bytes > 0
        })
        .unwrap();
    bufs[i].offset = bufs[j].offset;
    let err = plan.buffers.check().unwrap_err();
    assert!(err.contains("overlap"), "{err}");
}

/// Issue 5's acceptance figure: the 8B graph at chunk 512, context 8192.
#[test]
fn optimised_8b_plan_is_small_and_checked() {
    let mut g = build_llama(
        &common::graph_params("llama-3.1-8b"),
        &BuildOptions::new(8192),
    )
    .unwrap();
    run_pipeline(&mut g, &PassList::all(), |_, _| {}).unwrap();
    let plan = compile(&g, &PlanLimits::one_sequence(512, 8192)).unwrap();
    let b = &plan.buffers;
    b.check().unwrap();
    eprintln!(
        "optimised 8B: arena {} MiB, naive {} MiB, ratio {:.4}, in place {}",
        b.arena_bytes >> 20,
        b.naive_activation_bytes >> 20,
        b.arena_bytes as f64 / b.naive_activation_bytes as f64,
        b.in_place
    );
    assert!(b.arena_bytes * 4 <= b.naive_activation_bytes);
    assert!(b.arena_bytes >= b.peak_live_bytes);
    // The residual adds accumulate in place.
    assert!(b.in_place >= 64, "{}", b.in_place);
}
