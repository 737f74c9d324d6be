//! Continuous batching in the serving engine (issue 15, point 2), on a
//! small random Meta checkpoint: requests that do not fit the free KV wait
//! and then run, a short KV pool preempts and recomputes sequences without
//! changing their tokens, a cancelled sequence's KV is freed, and the
//! engine never holds more sequences than `-np`; requests that arrive
//! together with a common prefix compute it once, with unchanged tokens.
mod common;

use llama_graph::generate::{generate, GenOptions, SamplerConfig, StopReason};
use llama_graph::server::engine::{
    EngineConfig, EngineHandle, Finish, GenEvent, GenRequest, GenStream, SubmitError,
};
use llama_graph::session::{Model, Session, SessionOptions};

fn model() -> Model {
    Model::open(&common::root().join("tests/fixtures/meta/gqa_scaled")).unwrap()
}

fn options(context: usize) -> SessionOptions {
    SessionOptions {
        context: Some(context),
        batch: 32,
        threads: 2,
        ..SessionOptions::default()
    }
}

fn engine(context: usize, parallel: usize) -> EngineHandle {
    EngineHandle::start(
        model(),
        EngineConfig {
            session: options(context),
            parallel,
            queue_capacity: 16,
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

fn prompt(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 37 + salt * 101 + 3) % 512)
        .collect()
}

fn request(prompt: Vec<u32>, max_tokens: usize) -> GenRequest {
    GenRequest {
        prompt,
        max_tokens,
        sampling: greedy(),
        stop_tokens: Vec::new(),
    }
}

/// What `generate` gives alone.
fn alone(prompt: &[u32], n: usize) -> Vec<u32> {
    let m = model();
    let mut s = Session::new(&m, &options(512)).unwrap();
    let opts = GenOptions {
        n_predict: Some(n),
        sampler: greedy(),
        stop_strings: Vec::new(),
        record_top: false,
        ignore_eos: false,
    };
    let st = generate(&mut s, None, prompt, &opts, &mut |_| {}).unwrap();
    assert_eq!(st.stop_reason, Some(StopReason::Length));
    st.generated_tokens
}

fn collect(mut s: GenStream) -> (Vec<u32>, GenEvent) {
    let mut toks = Vec::new();
    loop {
        match s.blocking_next().expect("a stream ends with Done or Error") {
            GenEvent::Token(t) => toks.push(t),
            end => return (toks, end),
        }
    }
}

/// Polls the engine's statistics until `done` holds (at most ~10 s of
/// polling; the engine frees a cancelled sequence within one step).
fn wait_for(e: &EngineHandle, done: impl Fn(&llama_graph::server::engine::EngineStats) -> bool) {
    for _ in 0..2000 {
        if done(&e.stats()) {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    panic!("the engine did not get there: {:?}", e.stats());
}

#[test]
fn requests_longer_than_the_free_kv_wait_and_then_run() {
    // A pool of 256 positions: each request fits alone, not both at once.
    let e = engine(256, 2);
    let (a, b) = (prompt(200, 1), prompt(180, 2));
    let sa = e.submit(request(a.clone(), 20)).unwrap();
    let sb = e.submit(request(b.clone(), 30)).unwrap();
    assert_eq!(collect(sa).0, alone(&a, 20));
    assert_eq!(collect(sb).0, alone(&b, 30));
    // One that can never fit is refused with the numbers.
    let Err(err) = e.submit(request(prompt(250, 3), 10)) else {
        panic!("a request over the context was accepted");
    };
    assert_eq!(
        err,
        SubmitError::TooLong {
            prompt_tokens: 250,
            max_tokens: 10,
            context: 256
        }
    );
    let st = e.stats();
    assert_eq!((st.in_flight, st.kv_used, st.kv_total), (0, 0, 256));
}

#[test]
fn a_short_pool_preempts_and_recomputes_without_changing_tokens() {
    // 128 positions for three sequences that each grow to 90: the pool runs
    // out while they decode, so the youngest are preempted and fed again.
    let e = engine(128, 3);
    let prompts: Vec<Vec<u32>> = (0..3).map(|j| prompt(30, 10 + j)).collect();
    let streams: Vec<GenStream> = prompts
        .iter()
        .map(|p| e.submit(request(p.clone(), 60)).unwrap())
        .collect();
    for (p, s) in prompts.iter().zip(streams) {
        let (toks, end) = collect(s);
        assert_eq!(toks, alone(p, 60));
        assert!(matches!(
            end,
            GenEvent::Done {
                finish: Finish::Length,
                prompt_tokens: 30,
                completion_tokens: 60
            }
        ));
    }
    let st = e.stats();
    assert!(st.preemptions_total > 0, "the pool was short: {st:?}");
    assert_eq!((st.in_flight, st.kv_used), (0, 0));
}

#[test]
fn a_cancelled_sequence_frees_its_kv_and_the_engine_goes_on() {
    let e = engine(512, 4);
    let mut s = e.submit(request(prompt(40, 4), 400)).unwrap();
    for _ in 0..3 {
        assert!(matches!(s.blocking_next(), Some(GenEvent::Token(_))));
    }
    assert!(e.stats().kv_used >= 40);
    drop(s);
    wait_for(&e, |st| st.in_flight == 0 && st.kv_used == 0);
    let p = prompt(20, 5);
    assert_eq!(
        collect(e.submit(request(p.clone(), 8)).unwrap()).0,
        alone(&p, 8)
    );
}

#[test]
fn at_most_parallel_sequences_run_and_the_rest_queue() {
    // Eight requests, two run at a time: all eight finish with their own
    // tokens, and the engine never reports more than two in flight.
    let e = engine(512, 2);
    let prompts: Vec<Vec<u32>> = (0..8).map(|j| prompt(5 + 7 * j, 20 + j as u32)).collect();
    let streams: Vec<GenStream> = prompts
        .iter()
        .map(|p| e.submit(request(p.clone(), 6)).unwrap())
        .collect();
    let mut max_in_flight = 0;
    for (p, s) in prompts.iter().zip(streams) {
        max_in_flight = max_in_flight.max(e.stats().in_flight);
        assert_eq!(collect(s).0, alone(p, 6));
    }
    assert!(max_in_flight <= 2, "{max_in_flight}");
    assert_eq!(e.stats().requests_total, 8);
}

#[test]
fn requests_with_a_common_prefix_compute_it_once_with_unchanged_tokens() {
    // Six requests at once that start with the same 24 tokens (a system
    // prompt, say) and go on differently: the first computes the common
    // part (its whole prompt in one step of at most 32 tokens), the other
    // five read its first KV block (16 positions), get a copy of its
    // second (positions 16..24 of it) and are fed from position 24. Every
    // request gets the tokens it gets alone. (The first request is the
    // longest, so that it is still running when the others arrive; one
    // that arrived after it finished would take the prefix cache's 24
    // positions instead: 24 reused positions each either way.)
    let e = engine(512, 6);
    let n = |j: usize| if j == 0 { 48 } else { 8 };
    let common = prompt(24, 7);
    let prompts: Vec<Vec<u32>> = (0..6)
        .map(|j| {
            let mut p = common.clone();
            p.extend(prompt(3 + 5 * j, 30 + j as u32));
            p
        })
        .collect();
    let streams: Vec<GenStream> = prompts
        .iter()
        .enumerate()
        .map(|(j, p)| e.submit(request(p.clone(), n(j))).unwrap())
        .collect();
    for (j, (p, s)) in prompts.iter().zip(streams).enumerate() {
        assert_eq!(collect(s).0, alone(p, n(j)), "request {j}");
    }
    wait_for(&e, |st| st.in_flight == 0);
    let reused = e.stats().tokens_prompt_cached_total;
    assert_eq!(reused, 5 * 24);
}

/// One request of a [`drive`] run: the step it arrives at, its prompt, how
/// many tokens it generates and how it samples them.
struct Arrival {
    step: usize,
    prompt: Vec<u32>,
    n: usize,
    sampler: SamplerConfig,
}

/// Runs `arrivals` through the scheduler and a session step by step, as the
/// engine does but with each request admitted exactly at its step (so that
/// "together" and "one step apart" are what the test says). Returns each
/// request's tokens and the prompt positions the scheduler gave it from
/// another sequence or the prefix cache instead of computing them.
fn drive(arrivals: &[Arrival], parallel: usize) -> (Vec<Vec<u32>>, Vec<usize>) {
    use llama_graph::exec::{Batch, KvPool};
    use llama_graph::generate::Sampler;
    use llama_graph::server::scheduler::{Scheduler, SchedulerConfig};
    let m = model();
    let mut o = options(512);
    o.parallel = parallel;
    let mut session = Session::new(&m, &o).unwrap();
    let g = session.exec().kv_geom();
    let mut sched = Scheduler::new(
        SchedulerConfig {
            parallel,
            step_tokens: session.exec().max_chunk(),
            context: session.context(),
        },
        KvPool::new(g.n_blocks, g.block),
    );
    let mut batch = Batch::default();
    let mut out: Vec<Vec<u32>> = vec![Vec::new(); arrivals.len()];
    let mut samplers: Vec<Option<Sampler>> = (0..arrivals.len()).map(|_| None).collect();
    let mut reused = vec![0; arrivals.len()];
    let mut done = 0;
    for step in 0..1000 {
        for (id, a) in arrivals.iter().enumerate().filter(|(_, a)| a.step == step) {
            assert!(
                sched.admit(id as u64, &a.prompt, a.n),
                "request {id} admitted"
            );
            let mut s = Sampler::new(a.sampler, session.vocab()).unwrap();
            for &t in &a.prompt {
                s.accept(t);
            }
            samplers[id] = Some(s);
        }
        if done == arrivals.len() {
            return (out, reused);
        }
        let plan = sched.schedule(&mut batch).to_vec();
        if plan.is_empty() {
            // Nothing in flight until the next arrival.
            continue;
        }
        let mut sampled = Vec::new();
        {
            let logits = session.step(&batch).unwrap();
            for (j, slot) in plan.iter().enumerate().filter(|(_, s)| s.samples) {
                let i = slot.id as usize;
                if out[i].is_empty() {
                    reused[i] = sched.reused_of(slot.id);
                }
                let s = samplers[i].as_mut().unwrap();
                sampled.push((slot.id, s.sample(logits.row(j))));
            }
        }
        sched.advance();
        for (id, tok) in sampled {
            let i = id as usize;
            out[i].push(tok);
            if out[i].len() == arrivals[i].n {
                assert!(sched.finish(id));
                done += 1;
            } else {
                samplers[i].as_mut().unwrap().accept(tok);
                assert!(sched.push_token(id, tok));
            }
        }
    }
    panic!("the requests did not finish in 1000 steps");
}

/// What `generate` gives alone with `sampler`.
fn alone_with(prompt: &[u32], n: usize, sampler: SamplerConfig) -> Vec<u32> {
    let m = model();
    let mut s = Session::new(&m, &options(512)).unwrap();
    let opts = GenOptions {
        n_predict: Some(n),
        sampler,
        stop_strings: Vec::new(),
        record_top: false,
        ignore_eos: true,
    };
    let st = generate(&mut s, None, prompt, &opts, &mut |_| {}).unwrap();
    assert_eq!(st.stop_reason, Some(StopReason::Length));
    st.generated_tokens
}

fn seeded(seed: u64) -> SamplerConfig {
    SamplerConfig {
        temperature: 1.0,
        seed,
        ..SamplerConfig::default()
    }
}

/// Identical prompts (OpenAI's `n` choices, or two clients asking the same
/// thing) admitted in the same step, one or more steps apart, and after
/// the same prompt's KV went to the prefix cache: every request gets, token
/// for token, what it gets alone, greedy and seeded, for prompt lengths
/// inside one KV block, ending on a block boundary, one past it, and longer
/// than one step (32 tokens); and every later request took at least the
/// whole blocks of the prompt (its last token aside, which is always fed)
/// from the first one instead of computing them.
#[test]
fn identical_prompts_share_their_kv_with_unchanged_tokens() {
    let n = 10;
    let bs = Session::new(&model(), &options(512))
        .unwrap()
        .exec()
        .kv_geom()
        .block;
    assert_eq!(bs, 16, "the lengths below are chosen around blocks of 16");
    for len in [5, 16, 17, 24, 33, 40, 70] {
        let p = prompt(len, 40 + len as u32);
        let whole = (len - 1) / bs * bs;
        for (what, samplers) in [
            ("greedy", [greedy(); 4]),
            ("seeded", [seeded(41), seeded(42), seeded(43), seeded(44)]),
        ] {
            let want: Vec<Vec<u32>> = samplers.iter().map(|&s| alone_with(&p, n, s)).collect();
            // The step each request arrives at (in the last two rows the
            // first has finished and left its KV in the prefix cache).
            for steps in [
                [0, 0, 0, 0],
                [0, 1, 1, 1],
                [0, 1, 2, 3],
                [0, 2, 2, 4],
                [0, 40, 40, 40],
                [0, 40, 41, 41],
            ] {
                // The first request generates all its tokens, or ends on
                // its first one (as a choice whose first token is a stop
                // token does) while the others wait for its prompt KV.
                for first_n in [n, 1] {
                    let arrivals: Vec<Arrival> = (0..4)
                        .map(|i| Arrival {
                            step: steps[i],
                            prompt: p.clone(),
                            n: if i == 0 { first_n } else { n },
                            sampler: samplers[i],
                        })
                        .collect();
                    let (got, reused) = drive(&arrivals, 4);
                    let what = format!(
                    "{what}, prompt of {len}, arriving at steps {steps:?}, the first generating {first_n}"
                );
                    for i in 0..4 {
                        assert_eq!(got[i], want[i][..arrivals[i].n], "{what}: request {i}");
                    }
                    assert_eq!(reused[0], 0, "{what}");
                    for (i, &r) in reused.iter().enumerate().skip(1) {
                        assert!(
                            (whole..len).contains(&r),
                            "{what}: request {i} reused {r} positions"
                        );
                    }
                }
            }
        }
    }
}
