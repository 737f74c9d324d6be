//! `llama-graph run`: generate text.

use super::model::ModelArg;
use clap::Args;
use llama_graph::generate::chat::{llama3_dialog_tokens, ChatTemplate, Message};
use llama_graph::generate::{generate, GenOptions, GenStats, SamplerConfig};
use llama_graph::ir::LogitRows;
use llama_graph::passes::PassList;
use llama_graph::session::{Model, ModelFormat, Session, SessionOptions};
use llama_graph::tokenizer::EncodeOptions;
use serde_json::json;
use std::io::{IsTerminal, Read, Write};
use std::path::PathBuf;
use std::time::Instant;

#[derive(Debug, Args)]
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
    /// Context to plan for (KV-cache positions). Default 2048, capped by the
    /// model's own limit.
    #[arg(short = 'c', long = "ctx-size", value_name = "N")]
    pub ctx_size: Option<usize>,
    /// Prefill chunk: the most prompt tokens processed in one step.
    #[arg(
        short = 'b',
        long = "batch-size",
        value_name = "N",
        default_value_t = 512
    )]
    pub batch_size: usize,
    /// Threads (default: all cores).
    #[arg(short = 't', long = "threads", value_name = "N")]
    pub threads: Option<usize>,
    /// Optimisation passes: `all`, `none` or a comma-separated list of pass
    /// names (see `llama-graph graph --help`); they run in declared order.
    #[arg(long = "passes", value_name = "LIST", default_value = "all", value_parser = parse_passes)]
    pub passes: String,
    /// Exact f32 activations in every matmul (no int8 activation shortcut
    /// for quantized weights).
    #[arg(long = "exact")]
    pub exact: bool,
    /// Temperature; 0 = greedy.
    #[arg(
        long = "temp",
        value_name = "T",
        default_value_t = 0.8,
        allow_negative_numbers = true
    )]
    pub temp: f32,
    /// Keep only the K most likely tokens (0 = off).
    #[arg(long = "top-k", value_name = "K", default_value_t = 40)]
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches P (1 = off).
    #[arg(
        long = "top-p",
        value_name = "P",
        default_value_t = 0.95,
        allow_negative_numbers = true
    )]
    pub top_p: f32,
    /// Drop tokens less likely than P times the most likely one (0 = off).
    #[arg(
        long = "min-p",
        value_name = "P",
        default_value_t = 0.05,
        allow_negative_numbers = true
    )]
    pub min_p: f32,
    /// Penalise tokens seen in the last --repeat-last-n tokens (1 = off).
    #[arg(
        long = "repeat-penalty",
        value_name = "X",
        default_value_t = 1.0,
        allow_negative_numbers = true
    )]
    pub repeat_penalty: f32,
    /// Window of the repeat penalty.
    #[arg(long = "repeat-last-n", value_name = "N", default_value_t = 64)]
    pub repeat_last_n: usize,
    /// Random seed for sampling (default: from the clock; the seed used is printed).
    #[arg(short = 's', long = "seed", value_name = "N")]
    pub seed: Option<u64>,
    /// Stop when this text appears (repeatable); it is not printed.
    #[arg(long = "stop", value_name = "TEXT")]
    pub stop: Vec<String>,
    /// Write the statistics as JSON to this file.
    #[arg(long = "stats-json", value_name = "PATH")]
    pub stats_json: Option<PathBuf>,
    /// Write prompt tokens, generated tokens and the top-10 logits of every
    /// step as JSON to this file.
    #[arg(long = "logits-out", value_name = "PATH")]
    pub logits_out: Option<PathBuf>,
    /// Write debug.log naming every op as it runs, with its shapes.
    #[arg(short = 'v', long = "debug")]
    pub debug: bool,
    /// Also report weights the graph does not use, and the plan's figures.
    #[arg(long)]
    pub verbose: bool,
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
    Ok(Some(s))
}

/// Turns the prompt into tokens, applying the chat template if asked.
pub fn prompt_tokens(
    model: &Model,
    text: &str,
    chat: bool,
    system: Option<&str>,
) -> Result<Vec<u32>, String> {
    let tok = model.tokenizer.as_ref().ok_or_else(|| {
        format!(
            "{} has no tokenizer (a Meta directory needs tokenizer.model); use --prompt-tokens to feed ids",
            model.path.display()
        )
    })?;
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
    match (&model.chat_template, model.format) {
        (Some(src), _) => {
            let bos = tok
                .bos_id()
                .and_then(|i| tok.token_bytes(i))
                .map(|b| String::from_utf8_lossy(b).into_owned());
            let eos = tok
                .eos_id()
                .and_then(|i| tok.token_bytes(i))
                .map(|b| String::from_utf8_lossy(b).into_owned());
            let rendered = ChatTemplate::new(src.clone())
                .render(
                    &messages,
                    true,
                    bos.as_deref().unwrap_or(""),
                    eos.as_deref().unwrap_or(""),
                )
                .map_err(|e| e.to_string())?;
            // The template spells out any BOS it wants; never add another.
            Ok(tok.encode(
                &rendered,
                EncodeOptions {
                    add_bos: false,
                    parse_special: true,
                },
            ))
        }
        (None, ModelFormat::MetaDir) => {
            llama3_dialog_tokens(tok, &messages, true).map_err(|e| e.to_string())
        }
        (None, ModelFormat::Gguf) => Err(
            "this GGUF file has no chat template (tokenizer.chat_template); run without --chat"
                .into(),
        ),
    }
}

pub fn run(a: RunArgs) -> super::CliResult {
    let t_start = Instant::now();
    // Validate everything that does not need the model first.
    let n_predict = match a.n_predict {
        -1 => None,
        n if n >= 1 => Some(n as usize),
        n => {
            return Err(format!(
                "-n must be at least 1, or -1 for \"until the context is full\"; got {n}"
            )
            .into())
        }
    };
    let threads = match a.threads {
        Some(0) => return Err("-t/--threads must be at least 1".into()),
        Some(t) => t,
        None => std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
    };
    if a.batch_size == 0 {
        return Err("-b/--batch-size must be at least 1".into());
    }
    if a.ctx_size == Some(0) {
        return Err("-c/--ctx-size must be at least 1".into());
    }
    let seed = a.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0)
    });
    let sampler = SamplerConfig {
        temperature: a.temp,
        top_k: a.top_k,
        top_p: a.top_p,
        min_p: a.min_p,
        repeat_penalty: a.repeat_penalty,
        repeat_last_n: a.repeat_last_n,
        seed,
    };
    sampler.validate()?;
    let text = read_prompt(&a)?;

    let (model, _) = a.model.open(false)?;
    let prompt = match (&a.prompt_tokens, &text) {
        (Some(ids), _) => ids.clone(),
        (None, Some(t)) => prompt_tokens(&model, t, a.chat, a.system.as_deref())?,
        (None, None) => unreachable!("read_prompt returns a prompt or ids"),
    };
    let context = model.args.plan_context(a.ctx_size);
    llama_graph::generate::run::check_fits(prompt.len(), n_predict, context)?;

    let opts = SessionOptions {
        context: Some(context),
        batch: a.batch_size,
        threads,
        logit_rows: LogitRows::Last,
        passes: PassList::parse(&a.passes)?,
        exact: a.exact,
    };
    let mut session = Session::new(&model, &opts)?;
    if a.verbose {
        let b = &session.plan.buffers;
        eprintln!(
            "plan: {} kernel calls per step, arena {:.1} MiB (naive {:.1} MiB), {} in-place",
            session.exec.n_steps(),
            b.arena_bytes as f64 / 1048576.0,
            b.naive_activation_bytes as f64 / 1048576.0,
            b.in_place
        );
        if !session.unused_weights.is_empty() {
            eprintln!("unused tensors: {}", session.unused_weights.join(", "));
        }
    }
    if a.debug {
        let f = std::fs::File::create("debug.log").map_err(|e| format!("debug.log: {e}"))?;
        session
            .exec
            .set_trace(Some(Box::new(std::io::BufWriter::new(f))));
        eprintln!("debug: writing every op to debug.log");
    }
    let load_s = t_start.elapsed().as_secs_f64();
    if a.temp > 0.0 {
        eprintln!(
            "sampling: seed {seed} (temp {}, top-k {}, top-p {}, min-p {}, repeat-penalty {})",
            a.temp, a.top_k, a.top_p, a.min_p, a.repeat_penalty
        );
    }
    eprintln!(
        "prompt: {} tokens, context {context}, {threads} threads",
        prompt.len()
    );

    let gen_opts = GenOptions {
        n_predict,
        sampler,
        stop_strings: a.stop.clone(),
        record_top: a.logits_out.is_some(),
    };
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let mut emit = |s: &str| {
        let _ = out.write_all(s.as_bytes());
        let _ = out.flush();
    };
    let stats = generate(
        &mut session,
        model.tokenizer.as_ref(),
        &prompt,
        &gen_opts,
        &mut emit,
    )?;
    drop(out);
    println!();
    report(&stats, load_s, a.stats_json.as_ref())?;
    if let Some(p) = &a.logits_out {
        let steps: Vec<_> = stats
            .top
            .iter()
            .map(|t| json!({"top": t.iter().map(|(i, l)| json!([i, l])).collect::<Vec<_>>()}))
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
    if let Some(p) = json_path {
        let v = json!({
            "load_s": load_s,
            "prompt_tokens": stats.prompt_tokens.len(),
            "prefill_tokens_per_s": stats.prefill_tokens_per_s(),
            "generated_tokens": stats.generated_tokens.len(),
            "decode_tokens_per_s": stats.decode_tokens_per_s(),
            "stop_reason": reason,
        });
        std::fs::write(p, serde_json::to_string_pretty(&v)?)
            .map_err(|e| format!("{}: {e}", p.display()))?;
    }
    Ok(())
}

/// Validates `--passes`.
pub fn parse_passes(s: &str) -> Result<String, String> {
    PassList::parse(s).map(|_| s.to_string())
}
