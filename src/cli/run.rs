//! `llama-graph run`: generate text.

use super::flags::{n_predict, ContextFlags, RuntimeFlags, SamplingFlags, SpecFlags};
use super::model::ModelArg;
use super::pipeline::{PipelineFlags, Role};
use clap::Args;
use llama_graph::generate::chat::{conversation_tokens, ContextPolicy, Message};
use llama_graph::generate::constraint::{Constraint, GrammarSpec, Grammars};
use llama_graph::generate::SamplerConfig;
use llama_graph::generate::{
    generate_constrained, generate_shifting, ContextShift, GenOptions, GenStats, Speculation,
};
use llama_graph::session::{Model, Session};
use llama_graph::tokenizer::EncodeOptions;
use serde_json::json;
use std::io::{IsTerminal, Read, Write};
use std::path::PathBuf;
use std::time::Instant;

#[derive(Debug, Args)]
#[command(
    after_help = "Sampling order (fixed): repeat penalty, then greedy if --temp 0, else top-k, top-p, min-p, temperature, draw.\nStops at the model's end-of-sequence/end-of-turn token (not printed; --ignore-eos goes on), at -n tokens, at a --stop string, or when the context is full."
)]
pub struct RunArgs {
    #[command(flatten)]
    pub model: ModelArg,
    /// The prompt. Without -p, -f or --prompt-tokens the prompt is read
    /// from standard input when it is not a terminal.
    #[arg(short = 'p', long = "prompt", value_name = "TEXT")]
    pub prompt: Option<String>,
    /// Read the prompt from a file.
    #[arg(
        short = 'f',
        long = "file",
        value_name = "PATH",
        conflicts_with = "prompt"
    )]
    pub file: Option<PathBuf>,
    /// Feed these token ids directly (comma-separated), bypassing the tokenizer.
    #[arg(long = "prompt-tokens", value_name = "IDS", value_delimiter = ',', conflicts_with_all = ["prompt", "file"])]
    pub prompt_tokens: Option<Vec<u32>>,
    /// Wrap the prompt in the model's chat template (Llama 3 format for Meta
    /// checkpoints, the GGUF's own template otherwise) and stop at the end
    /// of the assistant's turn.
    #[arg(long)]
    pub chat: bool,
    /// With --chat: a system message.
    #[arg(long = "system", value_name = "TEXT", requires = "chat")]
    pub system: Option<String>,
    /// Tokens to generate; -1 = until the context is full.
    #[arg(
        short = 'n',
        long = "n-predict",
        value_name = "N",
        default_value_t = 256,
        allow_negative_numbers = true
    )]
    pub n_predict: i64,
    #[command(flatten)]
    pub runtime: RuntimeFlags,
    #[command(flatten)]
    pub context: ContextFlags,
    #[command(flatten)]
    pub sampling: SamplingFlags,
    #[command(flatten)]
    pub pipeline: PipelineFlags,
    #[command(flatten)]
    pub spec: SpecFlags,
    /// Stop when this text appears (repeatable); it is not printed.
    #[arg(long = "stop", value_name = "TEXT")]
    pub stop: Vec<String>,
    /// Do not stop at the model's end-of-sequence/end-of-turn tokens: they
    /// are printed like any other token and generation goes on to -n (what
    /// the server's `ignore_eos` does; for timing a fixed number of tokens).
    #[arg(long = "ignore-eos")]
    pub ignore_eos: bool,
    /// Constrain the output to JSON valid against the JSON schema in this
    /// file (every token is sampled among those the schema allows).
    #[arg(long = "json-schema", value_name = "FILE", conflicts_with = "grammar")]
    pub json_schema: Option<PathBuf>,
    /// Constrain the output to the grammar in this file: llama.cpp's GBNF
    /// (start rule `root`), or llguidance's Lark-like syntax when the file
    /// starts with `%llguidance`.
    #[arg(long = "grammar", value_name = "FILE")]
    pub grammar: Option<PathBuf>,
    /// Write the statistics as JSON to this file.
    #[arg(long = "stats-json", value_name = "PATH")]
    pub stats_json: Option<PathBuf>,
    /// Write prompt tokens, generated tokens and, for every step, the top-10
    /// logits and their log-sum-exp (a logit minus it is the token's
    /// log-probability) as JSON to this file.
    #[arg(long = "logits-out", value_name = "PATH")]
    pub logits_out: Option<PathBuf>,
    /// Write debug.log naming every op as it runs, with its shapes.
    #[arg(short = 'v', long = "debug")]
    pub debug: bool,
    /// Also report weights the graph does not use, and the plan's figures.
    #[arg(long)]
    pub verbose: bool,
}

/// The instruction-set level the kernels run at, and what the CPU has.
pub fn isa_line() -> String {
    use llama_graph::kernels::isa::{Isa, ISA_ENV};
    let (cur, best) = (
        llama_graph::kernels::Kernels::current().isa(),
        Isa::detect(),
    );
    if cur == best {
        format!("kernels: {cur} instruction set (the best this CPU has; {ISA_ENV} can lower it)")
    } else {
        format!("kernels: {cur} instruction set ({ISA_ENV}; this CPU has {best})")
    }
}

fn read_prompt(a: &RunArgs) -> Result<Option<String>, String> {
    if let Some(p) = &a.prompt {
        return Ok(Some(p.clone()));
    }
    if let Some(f) = &a.file {
        return std::fs::read_to_string(f)
            .map(Some)
            .map_err(|e| format!("{}: {e}", f.display()));
    }
    if a.prompt_tokens.is_some() {
        return Ok(None);
    }
    let stdin = std::io::stdin();
    if stdin.is_terminal() {
        return Err(
            "no prompt: give -p TEXT, -f FILE, --prompt-tokens IDS, or pipe the prompt on stdin"
                .into(),
        );
    }
    let mut s = String::new();
    stdin
        .lock()
        .read_to_string(&mut s)
        .map_err(|e| format!("reading the prompt from stdin: {e}"))?;
    if s.is_empty() {
        return Err(
            "no prompt: standard input was empty; give -p TEXT, -f FILE or --prompt-tokens IDS"
                .into(),
        );
    }
    Ok(Some(s))
}

/// Turns the prompt into tokens, applying the chat template if asked.
pub fn prompt_tokens(
    model: &Model,
    text: &str,
    chat: bool,
    system: Option<&str>,
) -> Result<Vec<u32>, String> {
    let tok = tokenizer(model)?;
    if !chat {
        let add_bos = tok.add_bos_default();
        return Ok(tok.encode(
            text,
            EncodeOptions {
                add_bos,
                parse_special: false,
            },
        ));
    }
    let mut messages = Vec::new();
    if let Some(s) = system {
        messages.push(Message::new("system", s));
    }
    messages.push(Message::new("user", text));
    chat_prompt_tokens(model, &messages)
}

/// What `--json-schema` / `--grammar` ask for, read and checked before the
/// model loads.
fn output_spec(a: &RunArgs) -> Result<Option<GrammarSpec>, String> {
    let read =
        |p: &PathBuf| std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()));
    if let Some(p) = &a.json_schema {
        let v: serde_json::Value = serde_json::from_str(&read(p)?)
            .map_err(|e| format!("--json-schema {}: not JSON: {e}", p.display()))?;
        return Ok(Some(GrammarSpec::JsonSchema(v)));
    }
    if let Some(p) = &a.grammar {
        return Ok(Some(GrammarSpec::from_grammar_text(&read(p)?)));
    }
    Ok(None)
}

fn tokenizer(model: &Model) -> Result<&llama_graph::tokenizer::Tokenizer, String> {
    model.tokenizer.as_ref().ok_or_else(|| {
        format!(
            "{} has no tokenizer (a Meta directory needs tokenizer.model); use --prompt-tokens to feed ids",
            model.path.display()
        )
    })
}

/// A conversation in the model's chat format, as tokens.
pub fn chat_prompt_tokens(model: &Model, messages: &[Message]) -> Result<Vec<u32>, String> {
    conversation_tokens(model, messages).map_err(|e| e.to_string())
}

pub fn run(a: RunArgs) -> super::CliResult {
    let t_start = Instant::now();
    let role = Role::start(&a.pipeline)?;
    // Validate everything that does not need the model first.
    let n_predict = n_predict(a.n_predict)?;
    let output = output_spec(&a)?;
    let threads = a.runtime.threads()?;
    let shift = a.context.policy(ContextPolicy::Refuse) == ContextPolicy::Shift;
    let spec = a.spec.config()?;
    if spec.is_some() && !matches!(role, Role::Single) {
        return Err("--draft-model and --spec-ngram do not run with --pipeline yet".into());
    }
    if shift && !matches!(role, Role::Single) {
        return Err("--context-full shift does not run with --pipeline yet".into());
    }
    let opts_for = |m: &Model| {
        let context = m.args.plan_context(a.runtime.ctx_size);
        a.spec
            .session_options(a.runtime.session_options(context, threads)?)
    };
    if let Role::Worker(t) = role {
        return Ok(super::pipeline::work(t, &a.model, &a.pipeline, &opts_for)?);
    }
    // Rank 0 (or the only process) reads the prompt and samples.
    let prepare = |model: &Model| -> Result<(SamplerConfig, Vec<u32>, usize), String> {
        let sampler = a.sampling.config()?;
        let text = read_prompt(&a)?;
        let prompt = match (&a.prompt_tokens, &text) {
            (Some(ids), _) => ids.clone(),
            (None, Some(t)) => prompt_tokens(model, t, a.chat, a.system.as_deref())?,
            (None, None) => return Err("no prompt".into()),
        };
        let context = model.args.plan_context(a.runtime.ctx_size);
        // With a context shift only the prompt itself must fit.
        let n = if shift { None } else { n_predict };
        llama_graph::generate::run::check_fits(prompt.len(), n, context)
            .map_err(|e| e.to_string())?;
        Ok((sampler, prompt, context))
    };
    let (model, mut session, (sampler, prompt, context)) = match role {
        Role::Leader(t) => {
            let (staged, prep) =
                super::pipeline::lead(t, &a.model, &a.pipeline, &opts_for, prepare)?;
            (staged.model, staged.session, prep)
        }
        _ => {
            let (model, _) = a.model.open(false)?;
            let prep = prepare(&model)?;
            let session = Session::new(&model, &opts_for(&model)?)?;
            (model, session, prep)
        }
    };
    let mut drafter = a.spec.drafter(&model, &opts_for(&model)?)?;
    if a.verbose || a.debug {
        eprintln!("{}", isa_line());
    }
    if a.verbose {
        let b = &session.plan().buffers;
        eprintln!(
            "plan: {} kernel calls per step, arena {:.1} MiB (naive {:.1} MiB), {} in-place",
            session.exec().n_steps(),
            b.arena_bytes as f64 / 1048576.0,
            b.naive_activation_bytes as f64 / 1048576.0,
            b.in_place
        );
        if !session.unused_weights().is_empty() {
            eprintln!("unused tensors: {}", session.unused_weights().join(", "));
        }
    }
    if a.debug {
        let f = std::fs::File::create("debug.log").map_err(|e| format!("debug.log: {e}"))?;
        session
            .exec_mut()
            .set_trace(Some(Box::new(std::io::BufWriter::new(f))));
        eprintln!("debug: writing every op to debug.log");
    }
    let mut constraint: Option<Constraint> = match &output {
        None => None,
        Some(spec) => {
            let flag = if a.json_schema.is_some() {
                "--json-schema"
            } else {
                "--grammar"
            };
            let tok = tokenizer(&model)?;
            let t0 = Instant::now();
            let c = Grammars::new(tok, session.vocab())
                .and_then(|g| g.compile(spec))
                .map_err(|e| format!("{flag}: {e}"));
            if a.verbose {
                eprintln!(
                    "{flag}: vocabulary trie and grammar ready in {:.3} s",
                    t0.elapsed().as_secs_f64()
                );
            }
            match c {
                Ok(c) => Some(c),
                Err(e) => {
                    session.abort_pipeline(1);
                    return Err(e.into());
                }
            }
        }
    };
    let load_s = t_start.elapsed().as_secs_f64();
    eprintln!(
        "prompt: {} tokens, context {context}, {threads} threads",
        prompt.len()
    );
    eprintln!("{}", session.kv_summary());

    let gen_opts = GenOptions {
        n_predict,
        sampler,
        stop_strings: a.stop.clone(),
        record_top: a.logits_out.is_some(),
        ignore_eos: a.ignore_eos,
    };
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let mut emit = |s: &str| {
        let _ = out.write_all(s.as_bytes());
        let _ = out.flush();
    };
    let speculation = match (drafter.as_mut(), spec) {
        (Some(d), Some(config)) => Some(Speculation {
            drafter: d,
            config,
            before: &[],
        }),
        _ => None,
    };
    // A shift keeps the BOS, as llama.cpp's does with --keep 0.
    let bos = model.tokenizer.as_ref().and_then(|t| t.bos_id());
    let generated = if shift {
        let keep = usize::from(bos.is_some() && prompt.first() == bos.as_ref());
        generate_shifting(
            &mut session,
            speculation,
            constraint.as_mut(),
            model.tokenizer.as_ref(),
            &prompt,
            &gen_opts,
            ContextShift { keep },
            &mut emit,
        )
    } else {
        generate_constrained(
            &mut session,
            speculation,
            constraint.as_mut(),
            model.tokenizer.as_ref(),
            &prompt,
            &gen_opts,
            &mut emit,
        )
    };
    let stats = match generated {
        Ok(s) => s,
        Err(e) => {
            drop(out);
            eprintln!("error: {e}");
            session.abort_pipeline(1);
            return Err(e.into());
        }
    };
    drop(out);
    if session.pipeline().is_some() {
        if let Some(mib) = super::pipeline::peak_rss_mib() {
            eprintln!("pipeline: rank 0: peak RSS {mib:.1} MiB");
        }
        session.stop_pipeline("")?;
    }
    println!();
    if stats.shifts > 0 {
        eprintln!(
            "context full {} times: dropped {} tokens in all and fed the rest again",
            stats.shifts, stats.dropped_tokens
        );
    }
    report(&stats, load_s, a.stats_json.as_ref())?;
    if let Some(p) = &a.logits_out {
        let steps: Vec<_> = stats
            .top
            .iter()
            .zip(&stats.logsumexp)
            .map(|(t, lse)| {
                json!({"top": t.iter().map(|(i, l)| json!([i, l])).collect::<Vec<_>>(), "logsumexp": lse})
            })
            .collect();
        let v = json!({"prompt_tokens": stats.prompt_tokens, "generated_tokens": stats.generated_tokens, "steps": steps});
        std::fs::write(p, serde_json::to_string(&v)?)
            .map_err(|e| format!("{}: {e}", p.display()))?;
    }
    Ok(())
}

/// The closing statistics on stderr (and as JSON when asked).
pub fn report(stats: &GenStats, load_s: f64, json_path: Option<&PathBuf>) -> super::CliResult {
    let reason = stats
        .stop_reason
        .map(|r| {
            serde_json::to_value(r)
                .ok()
                .and_then(|v| v.as_str().map(String::from))
                .unwrap_or_default()
        })
        .unwrap_or_default();
    eprintln!(
        "load {load_s:.2} s | prompt {} tokens, {:.1} tokens/s | generated {} tokens, {:.1} tokens/s | stop: {reason}",
        stats.prompt_tokens.len(),
        stats.prefill_tokens_per_s(),
        stats.generated_tokens.len(),
        stats.decode_tokens_per_s(),
    );
    if !stats.constrained_sampling.is_zero() {
        eprintln!(
            "constrained sampling (mask, sample, grammar step): {:.3} ms per token, {:.1}% of the decode time",
            stats.constrained_sampling.as_secs_f64() * 1e3
                / stats.generated_tokens.len().max(1) as f64,
            100.0 * stats.constrained_sampling.as_secs_f64()
                / stats.decode.as_secs_f64().max(1e-9),
        );
    }
    if let Some(sp) = &stats.spec {
        eprintln!(
            "speculation: {} drafted, {} accepted ({:.0}%), {} verifying steps, {} one-token steps, {:.2} s drafting",
            sp.drafted,
            sp.accepted,
            100.0 * sp.acceptance(),
            sp.verify_steps,
            sp.plain_steps,
            sp.draft_time.as_secs_f64()
        );
    }
    if let Some(p) = json_path {
        let v = json!({
            "load_s": load_s,
            "prompt_tokens": stats.prompt_tokens.len(),
            "prefill_tokens_per_s": stats.prefill_tokens_per_s(),
            "generated_tokens": stats.generated_tokens.len(),
            "decode_tokens_per_s": stats.decode_tokens_per_s(),
            "stop_reason": reason,
            "constrained_sampling_s": stats.constrained_sampling.as_secs_f64(),
            "generated": stats.generated_tokens,
            "decode_s": stats.decode.as_secs_f64(),
            "spec": stats.spec.as_ref().map(|sp| json!({
                "drafted": sp.drafted,
                "accepted": sp.accepted,
                "verify_steps": sp.verify_steps,
                "plain_steps": sp.plain_steps,
                "draft_s": sp.draft_time.as_secs_f64(),
            })),
        });
        std::fs::write(p, serde_json::to_string_pretty(&v)?)
            .map_err(|e| format!("{}: {e}", p.display()))?;
    }
    Ok(())
}
