//! Asserts that `ThreadPool::run` and the hot kernels do not allocate once
//! the pool exists. A counting global allocator counts every allocation in
//! this test binary (all threads); this file holds a single test so nothing
//! else runs concurrently.

use llama_graph::ir::DType;
use llama_graph::kernels::{
    attention_paged, matmul_with, rmsnorm, AttnWork, Epilogue, Kernels, KvGeom, KvStore, RopeTable,
    StepSeqs, WeightRef,
};
use llama_graph::pool::ThreadPool;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

struct Counting;
static ALLOCS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator; only counts calls.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::SeqCst);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::SeqCst);
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn run_and_kernels_do_not_allocate() {
    let pool = ThreadPool::new(2);
    let sum = AtomicUsize::new(0);
    // Warm up (thread start-up, lazy runtime state).
    for _ in 0..10 {
        pool.run(8, &|i| {
            sum.fetch_add(i, Ordering::Relaxed);
        });
    }
    let (s, k, n) = (5, 64, 48);
    let x = vec![0.5f32; s * k];
    let w: Vec<u8> = vec![0x3f; n * k * 2];
    let mut y = vec![0f32; s * n];
    // Two sequences: the s-token chunk at position 3 and one decode token
    // at position 300 (two key spans), in one pool of f16 blocks.
    let geom = KvGeom {
        n_blocks: 24,
        n_kv_heads: 2,
        head_dim: 16,
        block: 16,
    };
    let q = vec![0.1f32; (s + 1) * 4 * 16];
    let kc = KvStore::F16(vec![half::f16::from_f32(0.2); geom.elems()]);
    let table = [0, s as i32, 3, 0, 1, s as i32, 1, 300, 1, 1];
    let blocks: Vec<i32> = (0..20).collect();
    let seqs = StepSeqs::new(&table, &blocks, s + 1, &geom).unwrap();
    let mut att = vec![0f32; q.len()];
    let mut work = AttnWork::new(&geom, 2, s + 1, 2, pool.n_threads());
    let mut qr = q[..s * 4 * 16].to_vec();
    let rope = RopeTable::new(16, 10000.0, None, 64).unwrap();
    let mut normed = vec![0f32; x.len()];
    // Sleep so workers park, exercising the condvar wake path too.
    std::thread::sleep(std::time::Duration::from_millis(30));

    // The level is resolved once per process, before the measured loop (with
    // LLAMA_GRAPH_ISA set, reading the variable allocates).
    let isa = Kernels::current().isa();

    let before = ALLOCS.load(Ordering::SeqCst);
    for round in 0..1000 {
        pool.run(16, &|i| {
            sum.fetch_add(i, Ordering::Relaxed);
        });
        if round % 100 == 0 {
            matmul_with(
                &pool,
                isa,
                llama_graph::kernels::LinearArgs::new(
                    &x,
                    s,
                    k,
                    WeightRef::new(DType::BF16, &w),
                    n,
                    Epilogue::None,
                ),
                &mut y,
            )
            .unwrap();
            let kv = kc.view();
            attention_paged(
                &pool, isa, &q, kv, kv, &geom, 2, None, &seqs, &mut att, &mut work,
            )
            .unwrap();
            rope.apply(&mut qr, s, 4, 3).unwrap();
            rmsnorm(&x, k, None, 1e-5, &mut normed).unwrap();
        }
    }
    let after = ALLOCS.load(Ordering::SeqCst);
    assert_eq!(after - before, 0, "allocations during pool.run / kernels");
    assert_eq!(sum.load(Ordering::Relaxed), 10 * 28 + 1000 * 120);
    assert!(y.iter().all(|v| v.is_finite() && *v != 0.0));
    // The counter does see allocations (so the zero above is meaningful).
    let v = std::hint::black_box(vec![1u8; 10]);
    assert!(ALLOCS.load(Ordering::SeqCst) > after && v[0] == 1);
}
