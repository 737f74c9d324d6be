//! Throughput of the quantized matmul kernels on synthetic weights
//! (exact vs fast path), in GB/s of weights streamed and GFLOP/s.
//!
//! `cargo run --release --example qmatmul_bench -- [threads, default 1] [s, default 1]`
//!
//! `DTYPES=q8_0,q4_1` restricts the weight types, `SHAPES=head,1b` the
//! matrices (by a part of their names). For Q8_0/Q4_0/Q4_1 the fast
//! path is also run with each kernel level the CPU supports (AVX2, AVX-512
//! VNNI), interleaved in rounds; the figures are medians over the rounds.
//! Over x8 weights each level also runs the draft models' activations
//! without the remainder (`Plain`, `MatmulMode::Draft`).

use llama_graph::ir::DType;
use llama_graph::kernels::dispatch::MatmulMode;
use llama_graph::kernels::quantized::fast::{self as qfast, ActQuant, Layout, Q8Act};
use llama_graph::kernels::quantized::quantize_row;
use llama_graph::kernels::{Epilogue, WeightRef};
use llama_graph::kernels::{Isa, Kernels};
use llama_graph::pool::ThreadPool;
use std::time::Instant;

/// User+system CPU seconds of this thread (from /proc; 10 ms resolution),
/// so timings on a shared machine can exclude time spent descheduled.
fn thread_cpu_s() -> f64 {
    let st = std::fs::read_to_string("/proc/thread-self/stat").unwrap_or_default();
    let rest = st.rsplit(')').next().unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let tick = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // Fields after the command name: state is index 0; utime 11, stime 12.
    (tick(11) + tick(12)) / 100.0
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let threads: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(1);
    let s: usize = args.get(2).and_then(|v| v.parse().ok()).unwrap_or(1);
    let pool = ThreadPool::new(threads);
    let mut seed = 1u64;
    let mut rnd = || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((seed >> 33) as f32 / (1u64 << 31) as f32) - 0.5
    };
    // SmolLM2 shapes: a 30-layer stack of [1536,576] is too small to leave
    // cache, so use sizes that do: the output head and a tall FFN-like matrix.
    // One [1536,576] matrix is also run on its own: it stays in L2, so its
    // figures show the kernels' compute cost without memory bandwidth (the
    // noisiest part of this machine).
    for (name, n, k) in [
        ("in-cache 1536x576", 1536, 576),
        ("head 49152x576", 49152, 576),
        ("ffn x30 46080x576", 46080, 576),
        ("down x30 17280x1536", 17280, 1536),
        // Llama-3.2-1B-shaped layers (rows a multiple of 256 for the K formats).
        ("1b in-cache 2048x2048", 2048, 2048),
        ("1b l2 256x2048", 256, 2048),
        ("1b gate+up 16384x2048", 16384, 2048),
        ("1b down 2048x8192", 2048, 8192),
    ] {
        if std::env::var("SHAPES").is_ok_and(|f| !f.split(',').any(|p| name.contains(p))) {
            continue;
        }
        let wf: Vec<f32> = (0..n * k).map(|_| rnd()).collect();
        let x: Vec<f32> = (0..s * k).map(|_| rnd()).collect();
        let only: Option<String> = std::env::var("DTYPES").ok();
        for dtype in [
            DType::Q4_1,
            DType::Q8_0,
            DType::Q4_0,
            DType::Q4_K,
            DType::Q5_K,
            DType::Q6_K,
            DType::Q3_K,
            DType::Q5_0,
            DType::IQ4_NL,
            DType::IQ4_XS,
            DType::F16,
            DType::F32,
        ] {
            if only
                .as_ref()
                .is_some_and(|o| !o.split(',').any(|d| d == dtype.to_string()))
            {
                continue;
            }
            let Some(rb) = dtype.bytes_for(k) else {
                continue;
            };
            let mut wq = vec![0u8; n * rb];
            if quantize_row(dtype, &wf[..k], &mut wq[..rb]).is_ok() {
                for j in 0..n {
                    quantize_row(
                        dtype,
                        &wf[j * k..(j + 1) * k],
                        &mut wq[j * rb..(j + 1) * rb],
                    )
                    .unwrap();
                }
            } else {
                // No quantizer for this type: random block bytes with small
                // finite scales (the kernels' speed does not depend on values).
                for (i, b) in wq.iter_mut().enumerate() {
                    *b = (i as u64)
                        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
                        .rotate_left(17) as u8;
                }
                let (bb, fields): (usize, &[usize]) = match dtype {
                    DType::Q4_1 | DType::Q5_1 | DType::Q4_K | DType::Q5_K => {
                        (dtype.block_bytes(), &[0, 2])
                    }
                    DType::Q3_K => (dtype.block_bytes(), &[108]),
                    DType::Q6_K => (dtype.block_bytes(), &[208]),
                    _ => (dtype.block_bytes(), &[0]),
                };
                for b in wq.chunks_exact_mut(bb) {
                    for &at in fields {
                        b[at..at + 2].copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
                    }
                }
            }
            let w = WeightRef::new(dtype, &wq);
            let mut y = vec![0f32; s * n];
            for mode in [MatmulMode::Exact, MatmulMode::Fast] {
                Kernels::current()
                    .matmul_any(
                        &pool,
                        llama_graph::kernels::LinearArgs::new(&x, s, k, w, n, Epilogue::None),
                        &mut y,
                        mode,
                    )
                    .unwrap();
                let reps = if s > 1 { 5 } else { 100 };
                let t = Instant::now();
                let c0 = thread_cpu_s();
                for _ in 0..reps {
                    Kernels::current()
                        .matmul_any(
                            &pool,
                            llama_graph::kernels::LinearArgs::new(&x, s, k, w, n, Epilogue::None),
                            &mut y,
                            mode,
                        )
                        .unwrap();
                }
                let wall = t.elapsed().as_secs_f64() / reps as f64;
                let cpu = (thread_cpu_s() - c0) / reps as f64;
                // With one thread, CPU time excludes time spent descheduled.
                let dt = if threads == 1 && cpu > 0.0 { cpu } else { wall };
                println!(
                    "{name:22} {dtype:5} {mode:?}: wall {:8.3} ms cpu {:8.3} ms  {:6.2} GB/s  {:6.1} GFLOP/s",
                    wall * 1e3,
                    cpu * 1e3,
                    wq.len() as f64 / dt / 1e9,
                    2.0 * (s * n * k) as f64 / dt / 1e9
                );
            }
            if !qfast::supports(dtype) {
                continue;
            }
            // Kernel levels and weight layouts A/B, interleaved: rounds of
            // (each variant: reps runs).
            let mut w8 = vec![0u8; wq.len()];
            let has_x8 = qfast::x8::supports(dtype, n, k);
            if has_x8 {
                qfast::x8::repack(dtype, &wq, rb, &mut w8);
            }
            let mut variants: Vec<(Isa, Layout, ActQuant)> = vec![];
            for level in [Isa::Avx2, Isa::Avx512Vnni] {
                if level.supported() {
                    variants.push((level, Layout::Rows, ActQuant::Remainder));
                    if has_x8 {
                        variants.push((level, Layout::X8, ActQuant::Remainder));
                        variants.push((level, Layout::X8, ActQuant::Plain));
                    }
                }
            }
            let mut scratch = vec![Q8Act::default(); qfast::scratch_len(s, k).unwrap()];
            let mut times: Vec<Vec<f64>> = vec![vec![]; variants.len()];
            let env_n = |k: &str, d: usize| {
                std::env::var(k)
                    .ok()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(d)
            };
            let reps = env_n("REPS", if s > 1 { 3 } else { 30 });
            for _round in 0..env_n("ROUNDS", 7) {
                for (vi, &(level, layout, quant)) in variants.iter().enumerate() {
                    let wl = if layout == Layout::X8 {
                        WeightRef::new(dtype, &w8).with_layout(Layout::X8)
                    } else {
                        w
                    };
                    let mut run = || {
                        qfast::qmatmul_fast_with(
                            level,
                            quant,
                            &pool,
                            llama_graph::kernels::LinearArgs::new(&x, s, k, wl, n, Epilogue::None),
                            &mut y,
                            &mut scratch,
                        )
                        .unwrap()
                    };
                    run();
                    let t = Instant::now();
                    for _ in 0..reps {
                        run();
                    }
                    times[vi].push(t.elapsed().as_secs_f64() / reps as f64);
                }
            }
            for (vi, (level, layout, quant)) in variants.iter().enumerate() {
                let v = &mut times[vi];
                v.sort_by(f64::total_cmp);
                let (med, best) = (v[v.len() / 2], v[0]);
                println!(
                    "{name:22} {dtype:5} Fast/{level:?}/{layout:?}/{quant:?}: median {:8.3} ms (best {:8.3})  {:6.2} GB/s  {:6.1} GFLOP/s (median)",
                    med * 1e3,
                    best * 1e3,
                    wq.len() as f64 / med / 1e9,
                    2.0 * (s * n * k) as f64 / med / 1e9
                );
            }
        }
    }
}
