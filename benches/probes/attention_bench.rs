//! Fused attention over the paged KV pool, one layer of SmolLM2-135M (9
//! heads, 3 kv heads, head_dim 64): prefill chunks and decode steps at
//! several positions, f16 and f32 pools, at AVX2 and, if the CPU has it,
//! AVX-512F, interleaved on the same data, medians. A row `S=1 x 8` is a
//! decode step of eight sequences at that position. Then a decode step
//! over all 30 layers' f16 caches at depth 4096 (94 MB, more than the
//! caches hold, as in `bench -d 4096`), with the KV bytes read per second.
//!
//! `cargo run --release --example attention_bench -- [reps] [deep|deep1b]`
//! (`deep`: only the 30-layer table; `deep1b`: only that table for
//! Llama-3.2-1B's shape, 32 heads, 8 kv heads, 16 layers, 134 MB)
//! (run it under `flock /tmp/llama-graph-bench.lock` on a shared machine).
use llama_graph::kernels::{attention_paged, AttnWork, Isa, KvGeom, KvStore, StepSeqs};
use llama_graph::pool::ThreadPool;
use std::time::Instant;

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let reps: usize = std::env::args()
        .nth(1)
        .map(|s| s.parse().expect("reps"))
        .unwrap_or(30);
    let mut seed = 0x1234_5678_9abc_def0u64;
    let mut rnd = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        ((seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    };
    let levels: Vec<Isa> = [Isa::Avx2, Isa::Avx512]
        .into_iter()
        .filter(|l| l.supported())
        .collect();
    let mode = std::env::args().nth(2);
    if mode.as_deref() == Some("deep1b") {
        println!("{}", deep_decode(&levels, &mut rnd, reps, (32, 8, 16)));
        return;
    }
    println!("{}", deep_decode(&levels, &mut rnd, reps, (9, 3, 30)));
    if mode.as_deref() == Some("deep") {
        return;
    }
    let (h, hkv, d) = (9usize, 3usize, 64usize);
    print!("| threads | KV | S | P | seqs |");
    for l in &levels {
        print!(" {} (us) |", l.name());
    }
    println!(" GFLOP/s |");
    println!("|---|---|---|---|---|{}---|", "---|".repeat(levels.len()));
    for threads in [1, 2] {
        let pool = ThreadPool::new(threads);
        for f16 in [true, false] {
            for (s, pos, n_seqs) in [
                (128usize, 0usize, 1usize),
                (512, 0, 1),
                (64, 448, 1),
                (16, 200, 1),
                (4, 200, 1),
                (1, 127, 1),
                (1, 511, 1),
                (1, 2047, 1),
                (1, 511, 8),
            ] {
                let per_seq = (pos + s).div_ceil(16);
                let geom = KvGeom {
                    n_blocks: per_seq * n_seqs,
                    n_kv_heads: hkv,
                    head_dim: d,
                    block: 16,
                };
                let mut fill = || {
                    let v: Vec<f32> = (0..geom.elems()).map(|_| rnd()).collect();
                    if f16 {
                        KvStore::F16(v.iter().map(|&x| half::f16::from_f32(x)).collect())
                    } else {
                        KvStore::F32(v)
                    }
                };
                let (kc, vc) = (fill(), fill());
                let mut table = Vec::new();
                for j in 0..n_seqs {
                    // First token, count, start position, block list offset, logit rows.
                    table.extend([
                        (j * s) as i32,
                        s as i32,
                        pos as i32,
                        (j * per_seq) as i32,
                        1,
                    ]);
                }
                let blocks: Vec<i32> = (0..geom.n_blocks as i32).collect();
                let seqs = StepSeqs::new(&table, &blocks, s * n_seqs, &geom).unwrap();
                let q: Vec<f32> = (0..s * n_seqs * h * d).map(|_| rnd()).collect();
                let mut out = vec![0f32; q.len()];
                let mut work = AttnWork::new(&geom, h / hkv, s * n_seqs, n_seqs, threads);
                let inner = (2_000_000 / (n_seqs * s * (pos + s)).max(1)).clamp(1, 200);
                let mut times = vec![Vec::new(); levels.len()];
                for rep in 0..reps + 2 {
                    for (li, &l) in levels.iter().enumerate() {
                        let t = Instant::now();
                        for _ in 0..inner {
                            let (k, v) = (kc.view(), vc.view());
                            attention_paged(
                                &pool,
                                l,
                                &q,
                                k,
                                v,
                                &geom,
                                h / hkv,
                                None,
                                &seqs,
                                &mut out,
                                &mut work,
                            )
                            .unwrap();
                        }
                        if rep >= 2 {
                            times[li].push(t.elapsed().as_secs_f64() / inner as f64);
                        }
                    }
                }
                let meds: Vec<f64> = times.iter_mut().map(|v| median(v)).collect();
                let best = meds.iter().cloned().fold(f64::INFINITY, f64::min);
                // Causal multiply-adds of q·K and p·V (2 FLOP each).
                let pairs: usize = (0..s).map(|i| pos + i + 1).sum::<usize>() * n_seqs;
                let flop = 4.0 * (pairs * h * d) as f64;
                print!(
                    "| {threads} | {} | {s} | {pos} | {n_seqs} |",
                    if f16 { "f16" } else { "f32" }
                );
                for m in &meds {
                    print!(" {:.1} |", m * 1e6);
                }
                println!(" {:.1} |", flop / best * 1e-9);
            }
        }
    }
}

/// One decode step (S=1) at position 4095 over `layers` layers' f16
/// caches of `h` heads and `hkv` kv heads (`shape`), each layer its own
/// pool, at 1 and 2 threads: a table of µs per step and GB/s of keys and
/// values read (medians).
fn deep_decode(
    levels: &[Isa],
    rnd: &mut impl FnMut() -> f32,
    reps: usize,
    (h, hkv, layers): (usize, usize, usize),
) -> String {
    // `attention_bench -- REPS deep LAYERS`: fewer layers (for a profiler).
    let layers: usize = std::env::args()
        .nth(3)
        .map_or(layers, |s| s.parse().expect("layers"));
    let (d, pos) = (64usize, 4095usize);
    let geom = KvGeom {
        n_blocks: (pos + 1).div_ceil(16),
        n_kv_heads: hkv,
        head_dim: d,
        block: 16,
    };
    let mut fill = || -> KvStore {
        KvStore::F16(
            (0..geom.elems())
                .map(|_| half::f16::from_f32(rnd()))
                .collect(),
        )
    };
    let caches: Vec<(KvStore, KvStore)> = (0..layers).map(|_| (fill(), fill())).collect();
    let table = [0i32, 1, pos as i32, 0, 1];
    let blocks: Vec<i32> = (0..geom.n_blocks as i32).collect();
    let seqs = StepSeqs::new(&table, &blocks, 1, &geom).unwrap();
    let q: Vec<f32> = (0..h * d).map(|_| rnd()).collect();
    let mut out = vec![0f32; q.len()];
    let bytes = (layers * 2 * (pos + 1) * hkv * d * 2) as f64;
    let mut s = format!(
        "Decode at depth {}, {h} heads, {hkv} kv heads, {layers} layers of f16 KV ({:.0} MB):\n\n| threads |",
        pos + 1,
        bytes * 1e-6
    );
    for l in levels {
        s += &format!(" {} (us) | GB/s |", l.name());
    }
    s += &format!("\n|---|{}\n", "---|---|".repeat(levels.len()));
    for threads in [1, 2] {
        let pool = ThreadPool::new(threads);
        let mut work = AttnWork::new(&geom, h / hkv, 1, 1, threads);
        let mut times = vec![Vec::new(); levels.len()];
        for rep in 0..reps + 2 {
            for (li, &l) in levels.iter().enumerate() {
                let t = Instant::now();
                for (kc, vc) in &caches {
                    attention_paged(
                        &pool,
                        l,
                        &q,
                        kc.view(),
                        vc.view(),
                        &geom,
                        h / hkv,
                        None,
                        &seqs,
                        &mut out,
                        &mut work,
                    )
                    .unwrap();
                }
                if rep >= 2 {
                    times[li].push(t.elapsed().as_secs_f64());
                }
            }
        }
        s += &format!("| {threads} |");
        for t in &mut times {
            let m = median(t);
            s += &format!(" {:.0} | {:.1} |", m * 1e6, bytes / m * 1e-9);
        }
        s += "\n";
    }
    s
}
