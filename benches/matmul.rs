//! Matmul throughput and pool overhead (std::time, no harness).
//!
//! Run: `cargo bench --bench matmul` (optionally `-- quick` for fewer sizes).
//! Prints GFLOP/s (2·S·N·K per call) for F32/F16/BF16 weights at S=1 (GEMV)
//! and S=128, N×K = 2048×2048 and 8192×2048, on 1 and 2 threads, and the
//! per-`run` overhead of the pool with empty chunks.

use llama_graph::ir::DType;
use llama_graph::kernels::matmul::{flops, matmul_bf16_dot, matmul_with};
use llama_graph::kernels::Isa;
use llama_graph::kernels::{
    attention_paged, attn_scores, attn_values, softmax_rows, AttnWork, Epilogue, KvGeom, KvStore,
    StepSeqs, WeightRef,
};
use llama_graph::pool::ThreadPool;
use std::hint::black_box;
use std::time::{Duration, Instant};

fn encode(v: &[f32], dtype: DType) -> Aligned<u8> {
    Aligned::new(&llama_graph::kernels::plain_bytes(v, dtype).expect("a plain dtype"))
}

/// A copy of a slice at a 64-byte-aligned address, as the executor's
/// weight arena and activation plan place every tensor (`plan::ALIGN`):
/// a plain `Vec` lands wherever the allocator puts it, and 64-byte loads
/// from a misaligned buffer split cache lines, so the same kernel measured
/// up to ~20% apart from one build of this bench to the next.
struct Aligned<T> {
    buf: Vec<T>,
    at: usize,
    len: usize,
}

impl<T: Copy + Default> Aligned<T> {
    fn new(v: &[T]) -> Self {
        let per = (64 / std::mem::size_of::<T>()).max(1);
        let mut buf = vec![T::default(); v.len() + per];
        let at = buf.as_ptr().align_offset(64).min(per);
        buf[at..at + v.len()].copy_from_slice(v);
        Aligned {
            buf,
            at,
            len: v.len(),
        }
    }
}

impl<T> std::ops::Deref for Aligned<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.buf[self.at..self.at + self.len]
    }
}

impl<T> std::ops::DerefMut for Aligned<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.buf[self.at..self.at + self.len]
    }
}

/// Median seconds per call over repeated timed batches (~`budget` total).
fn time_it(budget: Duration, mut f: impl FnMut()) -> f64 {
    f(); // warm-up
    let t = Instant::now();
    f();
    let one = t.elapsed().as_secs_f64().max(1e-9);
    let per_batch = ((budget.as_secs_f64() / 5.0 / one) as usize).max(1);
    let mut samples = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        for _ in 0..per_batch {
            f();
        }
        samples.push(t.elapsed().as_secs_f64() / per_batch as f64);
    }
    samples.sort_by(|a, b| a.partial_cmp(b).unwrap());
    samples[2]
}

/// Latency of a `run` whose workers have parked (slept past the spin phase).
fn pool_wake_latency() {
    let pool = ThreadPool::new(2);
    let mut v = Vec::new();
    for _ in 0..30 {
        std::thread::sleep(Duration::from_millis(3));
        let t = Instant::now();
        pool.run(2, &|i| {
            black_box(i);
        });
        v.push(t.elapsed().as_secs_f64());
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    println!(
        "pool.run after workers parked (threads=2, chunks=2): median {:.1} us",
        v[v.len() / 2] * 1e6
    );
}

/// Single-thread streaming read bandwidth over a 64 MiB buffer (DRAM).
fn read_bandwidth() {
    let buf: Vec<u64> = (0..8usize << 20).map(|i| i as u64).collect();
    let t = time_it(Duration::from_millis(500), || {
        let mut acc = [0u64; 8];
        for c in buf.chunks_exact(8) {
            for i in 0..8 {
                acc[i] = acc[i].wrapping_add(c[i]);
            }
        }
        black_box(acc);
    });
    println!(
        "read bandwidth (1 thread, 64 MiB): {:.1} GB/s",
        (buf.len() * 8) as f64 / t / 1e9
    );
}

/// Two chunks of pure arithmetic (~1 ms each) on 1 and 2 threads: shows
/// whether a second core is actually available while benchmarking.
fn pool_scaling() {
    fn work(seed: usize) -> f64 {
        let mut x = seed as f64;
        for i in 0..1_500_000 {
            x = x * 0.999_999 + (i & 7) as f64;
        }
        x
    }
    for threads in [1, 2] {
        let pool = ThreadPool::new(threads);
        let t = time_it(Duration::from_millis(300), || {
            pool.run(2, &|i| {
                black_box(work(black_box(i)));
            })
        });
        println!(
            "pool scaling: 2 x compute chunk, threads={threads}: {:.3} ms",
            t * 1e3
        );
    }
    // Baseline without the pool: a scoped thread per chunk (spawned per call).
    let t = time_it(Duration::from_millis(300), || {
        std::thread::scope(|sc| {
            let h = sc.spawn(|| black_box(work(black_box(1))));
            black_box(work(black_box(0)));
            black_box(h.join().ok());
        })
    });
    println!(
        "pool scaling baseline: 2 x compute chunk, std::thread::scope: {:.3} ms",
        t * 1e3
    );
}

fn pool_overhead() {
    for threads in [1, 2] {
        let pool = ThreadPool::new(threads);
        for chunks in [1, 2, 16] {
            let t = time_it(Duration::from_millis(300), || {
                pool.run(chunks, &|i| {
                    black_box(i);
                })
            });
            println!(
                "pool.run overhead: threads={threads} chunks={chunks:>2}: {:8.3} us/run",
                t * 1e6
            );
        }
    }
}

/// Single-thread peak of independent 8-lane FMAs (12 chains), GFLOP/s.
#[cfg(target_arch = "x86_64")]
fn fma_peak() {
    #[target_feature(enable = "avx2,fma")]
    unsafe fn chains(iters: usize) -> f32 {
        use std::arch::x86_64::*;
        let mut acc = [_mm256_set1_ps(0.0); 12];
        let a = _mm256_set1_ps(0.999_999);
        let b = _mm256_set1_ps(1e-7);
        for _ in 0..iters {
            for v in acc.iter_mut() {
                *v = _mm256_fmadd_ps(*v, a, b);
            }
        }
        let mut s = 0.0;
        for v in acc {
            let mut o = [0f32; 8];
            _mm256_storeu_ps(o.as_mut_ptr(), v);
            s += o.iter().sum::<f32>();
        }
        s
    }
    if !Isa::detect().avx2() {
        return;
    }
    let iters = 2_000_000;
    let t = time_it(Duration::from_millis(300), || {
        // SAFETY: features checked above.
        black_box(unsafe { chains(black_box(iters)) });
    });
    println!(
        "fma peak (1 thread, 12 chains x 8 lanes): {:.1} GFLOP/s",
        (iters * 12 * 16) as f64 / t / 1e9
    );
}
#[cfg(not(target_arch = "x86_64"))]
fn fma_peak() {}

/// Fused vs unfused attention, Llama-3.2-1B-like heads (32 q, 8 kv, D=64).
fn attention_bench() {
    for (s, pos) in [(1usize, 1023usize), (128, 0)] {
        let (h, hkv, d) = (32, 8, 64);
        let geom = KvGeom {
            n_blocks: (pos + s).div_ceil(16),
            n_kv_heads: hkv,
            head_dim: d,
            block: 16,
        };
        let q: Vec<f32> = (0..s * h * d)
            .map(|i| ((i % 17) as f32 - 8.0) * 0.05)
            .collect();
        let kv: Vec<half::f16> = (0..geom.elems())
            .map(|i| half::f16::from_f32(((i % 13) as f32 - 6.0) * 0.05))
            .collect();
        let (kc, vc) = (KvStore::F16(kv.clone()), KvStore::F16(kv));
        // One sequence whose blocks are the whole (shuffled-free) pool.
        let blocks: Vec<i32> = (0..geom.n_blocks as i32).collect();
        let table = [0, s as i32, pos as i32, 0, 1];
        let seqs = StepSeqs::new(&table, &blocks, s, &geom).unwrap();
        let mut out = vec![0f32; q.len()];
        for threads in [1, 2] {
            let pool = ThreadPool::new(threads);
            let mut work = AttnWork::new(&geom, h / hkv, s, 1, threads);
            let tf = time_it(Duration::from_millis(300), || {
                let (k, v) = (kc.view(), vc.view());
                let isa = llama_graph::kernels::Kernels::current().isa();
                attention_paged(
                    &pool,
                    isa,
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
            });
            let t_n = pos + s;
            let mut sc = vec![0f32; h * s * t_n];
            let tu = time_it(Duration::from_millis(300), || {
                attn_scores(&pool, &q, kc.view(), &geom, h / hkv, &seqs, t_n, &mut sc).unwrap();
                softmax_rows(&pool, &mut sc, t_n).unwrap();
                attn_values(&pool, &sc, vc.view(), &geom, h / hkv, &seqs, t_n, &mut out).unwrap();
            });
            println!(
                "attention S={s:>3} P={pos:>4} H=32 Hkv=8 D=64 f16 KV threads={threads}: fused {:8.1} us, unfused {:8.1} us",
                tf * 1e6,
                tu * 1e6
            );
        }
    }
}

/// The float matmuls of one SmolLM2-135M layer in prefill (q, k, v, o
/// with residual, gate/up with SwiGLU, down with residual) for S = 128 and
/// 512 tokens: AVX2 and AVX-512 kernels interleaved on the same data
/// (rounds alternate between them; medians per kernel), so machine-load
/// drift hits both alike. `cargo bench --bench matmul -- prefill [f32|f16|bf16] [t1|t2]`.
fn prefill_ab(args: &[String]) {
    let want = |tag: &str, group: &[&str]| {
        let given: Vec<&String> = args
            .iter()
            .filter(|a| group.contains(&a.as_str()))
            .collect();
        given.is_empty() || given.iter().any(|a| a.as_str() == tag)
    };
    let (dim, hidden, kv) = (576usize, 1536usize, 192usize);
    // (n, k, swiglu/residual)
    let shapes = [
        (dim, dim, 0u8),
        (kv, dim, 0),
        (kv, dim, 0),
        (dim, dim, 2),
        (2 * hidden, dim, 1),
        (dim, hidden, 2),
    ];
    let flop: f64 = shapes.iter().map(|&(n, k, _)| 2.0 * (n * k) as f64).sum();
    let ws: Vec<Vec<f32>> = shapes
        .iter()
        .map(|&(n, k, _)| {
            (0..n * k)
                .map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 1e-3)
                .collect()
        })
        .collect();
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        if !want(dtype.name(), &["f32", "f16", "bf16"]) {
            continue;
        }
        let wb: Vec<Aligned<u8>> = ws.iter().map(|w| encode(w, dtype)).collect();
        for s in [128usize, 512] {
            let x = Aligned::new(
                &(0..s * hidden)
                    .map(|i| ((i * 31 % 100) as f32 - 50.0) * 1e-2)
                    .collect::<Vec<f32>>(),
            );
            let res = Aligned::new(&vec![0.5f32; s * dim]);
            let mut y = Aligned::new(&vec![0f32; s * 2 * hidden]);
            for threads in [1, 2] {
                if !want(&format!("t{threads}"), &["t1", "t2"]) {
                    continue;
                }
                let pool = ThreadPool::new(threads);
                let isas = [Isa::Avx2, Isa::Avx512];
                let mut times = vec![Vec::new(); isas.len()];
                for round in 0..14 {
                    for (ii, &isa) in isas.iter().enumerate() {
                        let t = Instant::now();
                        for (si, &(n, k, e)) in shapes.iter().enumerate() {
                            let w = WeightRef::new(dtype, &wb[si]);
                            let epi = match e {
                                0 => Epilogue::None,
                                1 => Epilogue::SwiGlu,
                                _ => Epilogue::AddResidual(&res),
                            };
                            let ny = if e == 1 { n / 2 } else { n };
                            matmul_with(
                                &pool,
                                isa,
                                llama_graph::kernels::LinearArgs::new(&x[..s * k], s, k, w, n, epi),
                                &mut y[..s * ny],
                            )
                            .unwrap();
                        }
                        black_box(&y);
                        if round >= 2 {
                            times[ii].push(t.elapsed().as_secs_f64());
                        }
                    }
                }
                let mut line = format!("prefill layer {dtype:>4} S={s:>3} threads={threads}:");
                for (ii, isa) in isas.iter().enumerate() {
                    let v = &mut times[ii];
                    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
                    let med = v[v.len() / 2];
                    line += &format!(
                        "  {isa:?} {:7.3} ms {:6.1} GFLOP/s",
                        med * 1e3,
                        flop * s as f64 / med / 1e9
                    );
                }
                println!("{line}");
            }
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "prefill") {
        prefill_ab(&args);
        return;
    }
    let quick = args.iter().any(|a| a == "quick");
    let portable = args.iter().any(|a| a == "portable");
    // Optional filters: dtype name (f32/f16/bf16), "s1"/"s128", "t1"/"t2".
    let want = |tag: &str, group: &[&str]| {
        let given: Vec<&String> = args
            .iter()
            .filter(|a| group.contains(&a.as_str()))
            .collect();
        given.is_empty() || given.iter().any(|a| a.as_str() == tag)
    };
    fma_peak();
    read_bandwidth();
    if !args.iter().any(|a| a == "nopool") {
        pool_overhead();
        pool_wake_latency();
        pool_scaling();
        attention_bench();
    }
    let sizes: &[(usize, usize)] = if quick {
        &[(2048, 2048)]
    } else {
        &[(2048, 2048), (8192, 2048)]
    };
    let isa = if portable {
        Isa::Scalar
    } else {
        llama_graph::kernels::Kernels::current().isa()
    };
    for &(n, k) in sizes {
        let wf: Vec<f32> = (0..n * k)
            .map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 1e-3)
            .collect();
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            if !want(dtype.name(), &["f32", "f16", "bf16"]) {
                continue;
            }
            let wb = encode(&wf, dtype);
            let w = WeightRef::new(dtype, &wb);
            for s in [1usize, 128] {
                if !want(&format!("s{s}"), &["s1", "s128"]) {
                    continue;
                }
                let x = Aligned::new(
                    &(0..s * k)
                        .map(|i| ((i * 31 % 100) as f32 - 50.0) * 1e-2)
                        .collect::<Vec<f32>>(),
                );
                let mut y = Aligned::new(&vec![0f32; s * n]);
                for threads in [1, 2] {
                    if !want(&format!("t{threads}"), &["t1", "t2"]) {
                        continue;
                    }
                    let pool = ThreadPool::new(threads);
                    let budget = Duration::from_millis(if s == 1 { 400 } else { 1200 });
                    // The bf16 dot product (opt-in) next to the level's kernels.
                    let dots: &[bool] = if dtype == DType::BF16 && !portable {
                        &[false, true]
                    } else {
                        &[false]
                    };
                    for &dot in dots {
                        let t = time_it(budget, || {
                            if dot {
                                matmul_bf16_dot(
                                    &pool,
                                    llama_graph::kernels::Kernels::current().isa(),
                                    llama_graph::kernels::LinearArgs::new(
                                        &x,
                                        s,
                                        k,
                                        w,
                                        n,
                                        Epilogue::None,
                                    ),
                                    &mut y,
                                )
                            } else {
                                matmul_with(
                                    &pool,
                                    isa,
                                    llama_graph::kernels::LinearArgs::new(
                                        &x,
                                        s,
                                        k,
                                        w,
                                        n,
                                        Epilogue::None,
                                    ),
                                    &mut y,
                                )
                            }
                            .unwrap();
                            black_box(&y);
                        });
                        let kind = if dot {
                            "bf16dot".to_string()
                        } else {
                            isa.to_string()
                        };
                        let gbs = (wb.len() as f64) / t / 1e9;
                        println!(
                            "matmul {kind:>10} {dtype:>4} N={n:>5} K={k} S={s:>3} threads={threads}: {:7.2} GFLOP/s  {:8.3} ms  (weights {:6.2} GB/s)",
                            flops(s, n, k) / t / 1e9,
                            t * 1e3,
                            gbs
                        );
                    }
                }
            }
        }
    }
}
