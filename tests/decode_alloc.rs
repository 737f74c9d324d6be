//! A decode step allocates nothing: the executor runs over buffers planned
//! and allocated when the session was built, and the sampler reuses its own.
mod common;

use llama_graph::exec::{Batch, KvPool};
use llama_graph::generate::{Sampler, SamplerConfig};
use llama_graph::ir::LogitRows;
use llama_graph::server::scheduler::{Scheduler, SchedulerConfig};
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
    batched_steps_do_not_allocate();
    // The counter does see allocations.
    let before = ALLOCS.load(Ordering::SeqCst);
    let v = std::hint::black_box(vec![1u8; 100]);
    assert!(ALLOCS.load(Ordering::SeqCst) > before && v.len() == 100);
}

/// Steps of four sequences at once, planned by the serving scheduler
/// (decode tokens beside a prompt fed in chunks, a block taken every 16
/// tokens): the scheduler, the executor and the samplers allocate nothing.
/// Called from the test above so that no other test runs meanwhile.
fn batched_steps_do_not_allocate() {
    let model = Model::open(&common::root().join("tests/fixtures/meta/gqa_scaled")).unwrap();
    let opts = SessionOptions {
        context: Some(256),
        batch: 16,
        parallel: 4,
        threads: 2,
        logit_rows: LogitRows::Last,
        ..SessionOptions::default()
    };
    let mut sess = Session::new(&model, &opts).unwrap();
    let geom = sess.exec().kv_geom();
    let mut sched = Scheduler::new(
        SchedulerConfig {
            parallel: 4,
            step_tokens: 16,
            context: 256,
        },
        KvPool::new(geom.n_blocks, geom.block),
    );
    let mut batch = Batch::with_capacity(16, 4, geom.n_blocks);
    let cfg = SamplerConfig {
        temperature: 0.8,
        seed: 9,
        ..SamplerConfig::default()
    };
    let mut samplers: Vec<Sampler> = (0..4)
        .map(|_| Sampler::new(cfg, sess.vocab()).unwrap())
        .collect();
    for j in 0..3u64 {
        let prompt: Vec<u32> = (0..5 + 3 * j as u32).collect();
        assert!(sched.admit(j, &prompt, 60));
    }
    let mut step = |sched: &mut Scheduler, sess: &mut Session, samplers: &mut [Sampler]| {
        let n = sched.schedule(&mut batch).len();
        let logits = sess.exec_mut().step(&batch).unwrap();
        let mut next = [(0u64, 0u32); 4];
        let mut k = 0;
        for j in 0..n {
            let slot = sched.plan()[j];
            if slot.samples {
                next[k] = (slot.id, samplers[slot.id as usize].sample(logits.row(j)));
                k += 1;
            }
        }
        sched.advance();
        for &(id, t) in &next[..k] {
            samplers[id as usize].accept(t);
            assert!(sched.push_token(id, t));
        }
    };
    // Warm up (first touches), then admit a long prompt that is fed in
    // chunks beside the others' decode tokens, and count.
    for _ in 0..3 {
        step(&mut sched, &mut sess, &mut samplers);
    }
    let long: Vec<u32> = (0..40).collect();
    let before = ALLOCS.load(Ordering::SeqCst);
    assert!(sched.admit(3, &long, 40));
    let after_admit = ALLOCS.load(Ordering::SeqCst);
    for _ in 0..32 {
        step(&mut sched, &mut sess, &mut samplers);
    }
    let n = ALLOCS.load(Ordering::SeqCst) - after_admit;
    assert_eq!(n, 0, "{n} allocations in 32 batched steps");
    assert!(
        after_admit > before,
        "admitting a sequence allocates its lists"
    );
    assert_eq!(sched.running(), 4);
}
