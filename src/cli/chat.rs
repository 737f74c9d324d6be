//! `llama-graph chat`: an interactive conversation that keeps the KV cache
//! across turns.
//!
//! Each turn renders the whole conversation with the model's chat format,
//! finds how much of it the cache already holds (the longest common token
//! prefix), rewinds to there and feeds only the rest.
//!
//! A conversation that outgrows the context is shifted by default: before
//! a turn whose conversation leaves less than a quarter of the context for
//! the reply, the oldest turns after the system prompt are dropped until
//! the rest takes at most half of it, and the rest is fed again (the common
//! prefix is then the system prompt). `--context-full refuse` refuses such
//! a turn instead, with the numbers.

use super::flags::{n_predict, ContextFlags, RuntimeFlags, SamplingFlags, SpecFlags};
use super::model::ModelArg;
use clap::Args;
use llama_graph::generate::chat::{ChatFormat, ContextPolicy, Message};
use llama_graph::generate::{generate_with, GenOptions, Speculation, StopReason};
use llama_graph::session::Session;
use std::io::{BufRead, IsTerminal, Write};

#[derive(Debug, Args)]
pub struct ChatArgs {
    #[command(flatten)]
    pub model: ModelArg,
    /// A system message for the whole conversation.
    #[arg(long = "system", value_name = "TEXT")]
    pub system: Option<String>,
    /// Tokens to generate per reply at most; -1 = until the context is full.
    #[arg(
        short = 'n',
        long = "n-predict",
        value_name = "N",
        default_value_t = 512,
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
    pub spec: SpecFlags,
}

pub fn run(a: ChatArgs) -> super::CliResult {
    let n_predict = n_predict(a.n_predict)?;
    let threads = a.runtime.threads()?;
    let sampler = a.sampling.config()?;
    let (model, _) = a.model.open(false)?;
    let tok = model
        .tokenizer
        .as_ref()
        .ok_or("this model has no tokenizer, which chat needs")?;
    let context = model.args.plan_context(a.runtime.ctx_size);
    let spec = a.spec.config()?;
    let opts = a
        .spec
        .session_options(a.runtime.session_options(context, threads)?)?;
    let policy = a.context.policy(ContextPolicy::Shift);
    let format = ChatFormat::of(&model);
    // Room a turn keeps for the reply, and what a shift cuts down to.
    let reserve = n_predict.unwrap_or(context).min(context / 4).max(1);
    let target = context / 2;
    let mut session = Session::new(&model, &opts)?;
    eprintln!("{}", session.kv_summary());
    let mut drafter = a.spec.drafter(&model, &opts)?;
    let interactive = std::io::stdin().is_terminal();
    if interactive {
        eprintln!(
            "chat: type a message and press Enter; /exit or Ctrl-D to quit, /reset to start over."
        );
    }
    let mut messages: Vec<Message> = a.system.iter().map(|s| Message::new("system", s)).collect();
    let mut cached: Vec<u32> = Vec::new();
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    loop {
        if interactive {
            eprint!("> ");
            let _ = std::io::stderr().flush();
        }
        let Some(line) = lines.next() else { break };
        let line = line.map_err(|e| format!("reading stdin: {e}"))?;
        let text = line.trim();
        match text {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                messages.retain(|m| m.role == "system");
                cached.clear();
                session.reset();
                eprintln!("(conversation cleared)");
                continue;
            }
            _ => {}
        }
        messages.push(Message::new("user", text));
        let fitted = match format.fit(tok, &messages, context, reserve, target, policy) {
            Ok(f) => f,
            Err(e) => {
                eprintln!("error: {e}");
                messages.pop();
                continue;
            }
        };
        if fitted.dropped > 0 {
            messages.drain(fitted.kept_from..fitted.kept_from + fitted.dropped);
            eprintln!(
                "(context full: dropped the {} oldest messages; {} tokens are fed again)",
                fitted.dropped,
                fitted.tokens.len()
            );
        }
        let full = fitted.tokens;
        let keep = cached
            .iter()
            .zip(&full)
            .take_while(|(a, b)| a == b)
            .count()
            .min(full.len() - 1);
        // (A model whose window layers keep only a ring may need the whole
        // conversation fed again.)
        let keep = session.rewind(keep);
        // The reply stops at the context's end at the latest.
        let room = context - full.len();
        let gen = GenOptions {
            n_predict: Some(n_predict.unwrap_or(room).min(room)),
            sampler,
            stop_strings: Vec::new(),
            record_top: false,
            ignore_eos: false,
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
                before: &full[..keep],
            }),
            _ => None,
        };
        let stats = match generate_with(
            &mut session,
            speculation,
            Some(tok),
            &full[keep..],
            &gen,
            &mut emit,
        ) {
            Ok(s) => s,
            Err(e) => {
                drop(out);
                eprintln!("\nerror: {e}");
                messages.pop();
                continue;
            }
        };
        drop(out);
        println!();
        // The cache now holds the prompt and every generated token but the
        // final stop token, which was sampled but not fed.
        cached = full;
        if stats.stop_reason == Some(StopReason::Length)
            && stats.generated_tokens.len() == room
            && n_predict.is_none_or(|n| n > room)
        {
            eprintln!("(the reply was cut where the context is full)");
        }
        let fed = match stats.stop_reason {
            Some(StopReason::Eos) => &stats.generated_tokens[..stats.generated_tokens.len() - 1],
            _ => &stats.generated_tokens[..],
        };
        cached.extend_from_slice(fed);
        cached.truncate(session.position());
        messages.push(Message::new("assistant", &tok.decode(fed)));
        eprintln!(
            "[{} prompt tokens at {:.1} t/s, {} generated at {:.1} t/s, {} of {} context used]",
            stats.prompt_tokens.len(),
            stats.prefill_tokens_per_s(),
            stats.generated_tokens.len(),
            stats.decode_tokens_per_s(),
            session.position(),
            session.context()
        );
    }
    Ok(())
}
