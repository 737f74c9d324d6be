//! The serving engine's contract (`src/server/engine.rs`) on a small random
//! Meta checkpoint: the tokens it streams are the tokens `generate` gives,
//! stop tokens and budgets end sequences with the right counts, a dropped
//! stream is cancelled, the queue is bounded and requests that cannot fit
//! are refused before any work.
mod common;

use llama_graph::generate::{generate, GenOptions, SamplerConfig, StopReason};
use llama_graph::server::engine::{
    EngineConfig, EngineHandle, Finish, GenEvent, GenRequest, GenStream, SubmitError,
};
use llama_graph::session::{Model, Session, SessionOptions};

const CONTEXT: usize = 256;

fn model() -> Model {
    Model::open(&common::root().join("tests/fixtures/meta/gqa_scaled")).unwrap()
}

fn session_options() -> SessionOptions {
    SessionOptions {
        context: Some(CONTEXT),
        batch: 16,
        threads: 2,
        ..SessionOptions::default()
    }
}

fn engine(queue_capacity: usize) -> EngineHandle {
    EngineHandle::start(
        model(),
        EngineConfig {
            session: session_options(),
            parallel: 1,
            queue_capacity,
        },
    )
    .unwrap()
}

fn greedy() -> SamplerConfig {
    SamplerConfig {
        temperature: 0.0,
        ..SamplerConfig::default()
    }
}

fn prompt() -> Vec<u32> {
    // 37 tokens: two prefill chunks of 16 and one of 5.
    (0..37).map(|i| (i * 13 + 5) % 512).collect()
}

/// Every event of a stream, in order.
fn collect(mut s: GenStream) -> (Vec<u32>, GenEvent) {
    let mut toks = Vec::new();
    loop {
        match s.blocking_next().expect("a stream ends with Done or Error") {
            GenEvent::Token(t) => toks.push(t),
            end => {
                assert!(s.blocking_next().is_none(), "nothing after the end");
                return (toks, end);
            }
        }
    }
}

/// What `generate` (the `run` path) gives for the same request.
fn reference(prompt: &[u32], n: usize, sampler: SamplerConfig) -> Vec<u32> {
    let m = model();
    let mut s = Session::new(&m, &session_options()).unwrap();
    let opts = GenOptions {
        n_predict: Some(n),
        sampler,
        stop_strings: Vec::new(),
        record_top: false,
        ignore_eos: false,
    };
    let stats = generate(&mut s, None, prompt, &opts, &mut |_| {}).unwrap();
    assert_eq!(stats.stop_reason, Some(StopReason::Length));
    stats.generated_tokens
}

fn request(prompt: Vec<u32>, max_tokens: usize) -> GenRequest {
    GenRequest {
        prompt,
        max_tokens,
        sampling: greedy(),
        stop_tokens: Vec::new(),
    }
}

#[test]
fn streams_the_tokens_generate_gives() {
    let e = engine(4);
    let want = reference(&prompt(), 20, greedy());
    // Twice: the second sequence must not see the first one's cache.
    for _ in 0..2 {
        let (toks, end) = collect(e.submit(request(prompt(), 20)).unwrap());
        assert_eq!(toks, want);
        assert_eq!(
            end,
            GenEvent::Done {
                finish: Finish::Length,
                prompt_tokens: 37,
                completion_tokens: 20
            }
        );
    }
    // A seeded sampled request is reproducible and equals generate's.
    let sampled = SamplerConfig {
        temperature: 1.0,
        seed: 11,
        ..SamplerConfig::default()
    };
    let want = reference(&prompt(), 12, sampled);
    let mut req = request(prompt(), 12);
    req.sampling = sampled;
    assert_eq!(collect(e.submit(req).unwrap()).0, want);

    let st = e.stats();
    assert_eq!(st.requests_total, 3);
    assert_eq!(st.tokens_prompt_total, 3 * 37);
    assert_eq!(st.tokens_generated_total, 20 + 20 + 12);
    assert_eq!((st.in_flight, st.queue_depth, st.kv_used), (0, 0, 0));
    assert_eq!(st.kv_total, CONTEXT);
}

#[test]
fn a_stop_token_ends_the_sequence_and_is_counted_not_sent() {
    let e = engine(4);
    let want = reference(&prompt(), 20, greedy());
    // The first position where a token appears for the first time past
    // the start, so that the stop cannot trigger earlier.
    let at = (1..want.len())
        .find(|&i| !want[..i].contains(&want[i]))
        .expect("some new token in 20 greedy steps");
    let mut req = request(prompt(), 20);
    req.stop_tokens = vec![want[at]];
    let (toks, end) = collect(e.submit(req).unwrap());
    assert_eq!(toks, want[..at]);
    assert_eq!(
        end,
        GenEvent::Done {
            finish: Finish::Stop,
            prompt_tokens: 37,
            completion_tokens: at + 1
        }
    );
}

#[test]
fn requests_that_cannot_run_are_refused_before_any_work() {
    let e = engine(4);
    assert_eq!(
        e.submit(request(prompt(), CONTEXT - 36)).err(),
        Some(SubmitError::TooLong {
            prompt_tokens: 37,
            max_tokens: CONTEXT - 36,
            context: CONTEXT
        })
    );
    // Exactly full is fine: the last sampled token is never fed.
    let (toks, _) = collect(e.submit(request(prompt(), CONTEXT - 37)).unwrap());
    assert_eq!(toks.len(), CONTEXT - 37);
    let bad = |r: GenRequest| match e.submit(r) {
        Err(SubmitError::Invalid(m)) => m,
        other => panic!("expected Invalid, got {:?}", other.err()),
    };
    assert!(bad(request(vec![], 4)).contains("empty"));
    assert!(bad(request(prompt(), 0)).contains("max_tokens"));
    assert!(bad(request(vec![1, 512], 4)).contains("token id 512"));
    let mut r = request(prompt(), 4);
    r.sampling.top_p = 0.0;
    assert!(bad(r).contains("top-p"));
    let st = e.stats();
    assert_eq!(st.requests_total, 1, "refused requests are not counted");
}

#[test]
fn queue_is_bounded_and_dropped_streams_are_cancelled() {
    let e = engine(1);
    // A long sequence; once its first token arrives it is running.
    let mut a = e.submit(request(prompt(), CONTEXT - 37)).unwrap();
    assert!(matches!(a.blocking_next(), Some(GenEvent::Token(_))));
    let b = e.submit(request(prompt(), 5)).unwrap();
    assert_eq!(
        e.submit(request(prompt(), 5)).err(),
        Some(SubmitError::QueueFull { capacity: 1 })
    );
    // Cancel the running one: the queued one runs and completes.
    drop(a);
    let (toks, end) = collect(b);
    assert_eq!(toks.len(), 5);
    assert!(matches!(
        end,
        GenEvent::Done {
            finish: Finish::Length,
            ..
        }
    ));
    let st = e.stats();
    assert!(
        st.tokens_generated_total < (CONTEXT - 37 + 5) as u64,
        "the dropped sequence stopped early: {st:?}"
    );
    // Queued and never read: dropping it before it starts skips it.
    let c = e.submit(request(prompt(), 5)).unwrap();
    drop(c);
    let (toks, _) = collect(e.submit(request(prompt(), 3)).unwrap());
    assert_eq!(toks.len(), 3);
    let st = e.stats();
    assert_eq!((st.in_flight, st.queue_depth, st.kv_used), (0, 0, 0));
}
