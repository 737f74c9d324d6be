//! A decode step allocates nothing: the executor runs over buffers planned
//! and allocated when the session was built, and the sampler reuses its own.
mod common;

use llama_graph::generate::{Sampler, SamplerConfig};
use llama_graph::ir::LogitRows;
use llama_graph::session::{Model, Session, SessionOptions};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

struct Counting;
static ALLOCS: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        System.alloc(l)
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        System.dealloc(p, l)
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        System.realloc(p, l, n)
    }
}

#[global_allocator]
static A: Counting = Counting;

#[test]
fn decode_steps_do_not_allocate() {
    for (case, threads) in [("gqa_scaled", 2), ("nrep3", 1)] {
        let model = Model::open(&common::root().join("tests/fixtures/meta").join(case)).unwrap();
        let opts = SessionOptions {
            context: Some(128),
            batch: 16,
            threads,
            logit_rows: LogitRows::Last,
            ..SessionOptions::default()
        };
        let mut sess = Session::new(&model, &opts).unwrap();
        let vocab = sess.vocab();
        for cfg in [
            SamplerConfig {
                temperature: 0.0,
                ..SamplerConfig::default()
            },
            SamplerConfig {
                temperature: 0.8,
                repeat_penalty: 1.1,
                seed: 3,
                ..SamplerConfig::default()
            },
        ] {
            sess.reset();
            let mut sampler = Sampler::new(cfg, vocab).unwrap();
            let mut tok = sampler.sample(sess.feed(&[1, 2, 3, 4, 5]).unwrap());
            // Warm up once (first-touch effects), then count.
            tok = sampler.sample(sess.feed(&[tok]).unwrap());
            let before = ALLOCS.load(Ordering::SeqCst);
            for _ in 0..32 {
                sampler.accept(tok);
                tok = sampler.sample(sess.feed(&[tok]).unwrap());
            }
            let n = ALLOCS.load(Ordering::SeqCst) - before;
            assert_eq!(
                n, 0,
                "{case}: {n} allocations in 32 decode steps with {cfg:?}"
            );
        }
    }
    // The counter does see allocations.
    let before = ALLOCS.load(Ordering::SeqCst);
    let v = std::hint::black_box(vec![1u8; 100]);
    assert!(ALLOCS.load(Ordering::SeqCst) > before && v.len() == 100);
}
