//! `llama-graph perplexity`: a model's perplexity over a text, and its KL
//! divergence from a reference run, as llama.cpp's `llama-perplexity`
//! measures them (see `llama_graph::generate::perplexity`).

use super::flags::RuntimeFlags;
use super::model::ModelArg;
use clap::Args;
use llama_graph::generate::perplexity::{
    first_scored, n_chunks, row_words, scored_per_chunk, KldStats, LogProbReader, LogProbWriter,
    PplStats,
};
use llama_graph::ir::LogitRows;
use llama_graph::session::{Model, Session};
use llama_graph::tokenizer::EncodeOptions;
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Debug, Args)]
#[command(
    after_help = "Method (llama-perplexity's): the text's tokens are cut into -c sized chunks, each evaluated from an empty cache with its first token replaced by the BOS when the model adds one; the second half of each chunk is scored. PPL = exp(mean negative log-likelihood).\n\nKL divergence: run once with --kl-divergence-base FILE (a reference, e.g. the F32 file with --exact) to save every scored position's log-probabilities; then --kl-divergence --kl-divergence-base FILE with another model or other flags reports mean KLD, its percentiles and how often both runs rank the same token first (\"Same top p\"). The file format is llama-perplexity's: either tool reads the other's files."
)]
pub struct PerplexityArgs {
    #[command(flatten)]
    pub model: ModelArg,
    /// The text to score (with --kl-divergence optional: the tokens come
    /// from the base file, and the text, when given, must give the same).
    #[arg(short = 'f', long = "file", value_name = "PATH")]
    pub file: Option<PathBuf>,
    /// Score at most N chunks (default: all the text gives).
    #[arg(long = "chunks", value_name = "N")]
    pub chunks: Option<usize>,
    /// Without --kl-divergence: save every scored position's
    /// log-probabilities to FILE (about 2 bytes x vocabulary per scored
    /// token). With it: the saved reference to compare with.
    #[arg(long = "kl-divergence-base", value_name = "FILE")]
    pub kl_divergence_base: Option<PathBuf>,
    /// Compare with the reference in --kl-divergence-base: mean KL
    /// divergence, its percentiles, "Same top p" and both perplexities.
    #[arg(long = "kl-divergence", requires = "kl_divergence_base")]
    pub kl_divergence: bool,
    #[command(flatten)]
    pub runtime: RuntimeFlags,
}

/// llama-perplexity's default context.
const DEFAULT_CTX: usize = 512;

pub fn run(a: PerplexityArgs) -> super::CliResult {
    let t_start = Instant::now();
    let threads = a.runtime.threads()?;
    if a.chunks == Some(0) {
        return Err("--chunks must be at least 1".into());
    }
    if !a.kl_divergence && a.file.is_none() {
        return Err(
            "no text: give -f FILE (or --kl-divergence with --kl-divergence-base FILE)".into(),
        );
    }
    // The base file, when comparing, fixes the context and the tokens.
    let mut base = match (&a.kl_divergence_base, a.kl_divergence) {
        (Some(p), true) => Some(LogProbReader::open(p)?),
        _ => None,
    };
    let n_ctx = match &base {
        Some(b) => {
            if a.runtime.ctx_size.is_some_and(|c| c != b.n_ctx) {
                return Err(format!(
                    "-c {} differs from the context of {} the base file was made with; leave -c out",
                    a.runtime.ctx_size.unwrap_or(0),
                    b.n_ctx
                )
                .into());
            }
            b.n_ctx
        }
        None => a.runtime.ctx_size.unwrap_or(DEFAULT_CTX),
    };
    let (model, _) = a.model.open(false)?;
    if model.args.plan_context(Some(n_ctx)) < n_ctx {
        return Err(format!(
            "a context of {n_ctx} exceeds the model's limit of {}; use a smaller -c",
            model.args.plan_context(Some(n_ctx))
        )
        .into());
    }
    let tok = model
        .tokenizer
        .as_ref()
        .ok_or("this model has no tokenizer, which perplexity needs")?;
    let text_tokens = match &a.file {
        Some(f) => {
            let text = std::fs::read_to_string(f).map_err(|e| format!("{}: {e}", f.display()))?;
            Some(tok.encode(
                &text,
                EncodeOptions {
                    add_bos: tok.add_bos_default(),
                    parse_special: false,
                },
            ))
        }
        None => None,
    };
    let (tokens, n_chunk) = match &base {
        Some(b) => {
            if let Some(t) = &text_tokens {
                if !t.starts_with(&b.tokens) {
                    return Err(format!(
                        "{} does not tokenize to the tokens saved in the base file (another text or tokenizer?); leave -f out to use the saved tokens",
                        a.file.as_ref().map(|f| f.display().to_string()).unwrap_or_default()
                    )
                    .into());
                }
            }
            let n = a.chunks.map_or(b.n_chunk, |c| c.min(b.n_chunk));
            (b.tokens.clone(), n)
        }
        None => {
            let t = text_tokens.unwrap_or_default();
            let n = n_chunks(t.len(), n_ctx, a.chunks)?;
            (t, n)
        }
    };
    let vocab = model.args.vocab_size.unwrap_or(0);
    if let Some(b) = &base {
        if b.n_vocab != vocab {
            return Err(format!(
                "the base file has a vocabulary of {}, this model {vocab}",
                b.n_vocab
            )
            .into());
        }
    }
    if let Some(&bad) = tokens[..n_chunk * n_ctx]
        .iter()
        .find(|&&t| t as usize >= vocab)
    {
        return Err(format!("token {bad} is outside the vocabulary of {vocab}").into());
    }
    let mut opts = a.runtime.session_options(n_ctx, threads)?;
    opts.batch = opts.batch.min(n_ctx);
    opts.logit_rows = LogitRows::All;
    let mut session = Session::new(&model, &opts)?;
    let bos = if tok.add_bos_default() {
        tok.bos_id()
    } else {
        None
    };
    eprintln!(
        "perplexity: {} tokens, {n_chunk} chunks of {n_ctx} (scoring the last {} of each), batch {}, {threads} threads, load {:.2} s",
        tokens.len(),
        scored_per_chunk(n_ctx),
        opts.batch,
        t_start.elapsed().as_secs_f64()
    );
    let mut writer = match (&a.kl_divergence_base, a.kl_divergence) {
        (Some(p), false) => {
            let f = std::fs::File::create(p).map_err(|e| format!("{}: {e}", p.display()))?;
            let w = std::io::BufWriter::with_capacity(1 << 20, f);
            Some(
                LogProbWriter::new(w, n_ctx, vocab, &tokens[..n_chunk * n_ctx])
                    .map_err(|e| format!("{}: {e}", p.display()))?,
            )
        }
        _ => None,
    };
    let mut base_row = vec![0u16; row_words(vocab)];
    let mut ppl = PplStats::default();
    let mut kld = KldStats::default();
    let first = first_scored(n_ctx);
    let t_eval = Instant::now();
    let stderr = std::io::stderr();
    for c in 0..n_chunk {
        let mut chunk = tokens[c * n_ctx..(c + 1) * n_ctx].to_vec();
        if let Some(b) = bos {
            chunk[0] = b;
        }
        session.reset();
        let mut pos = 0;
        for step in chunk.chunks(opts.batch) {
            let logits = session.feed_step(step)?;
            for (r, p) in (pos..pos + step.len()).enumerate() {
                if p < first || p + 1 >= n_ctx {
                    continue;
                }
                let row = logits.row(r);
                let next = chunk[p + 1];
                if let Some(b) = base.as_mut() {
                    b.next_row(&mut base_row)
                        .map_err(|e| format!("reading the base file: {e}"))?;
                    kld.add(row, &base_row, next);
                } else if let Some(w) = writer.as_mut() {
                    ppl.add(w.row(row, next).map_err(|e| format!("writing: {e}"))?);
                } else {
                    ppl.add(llama_graph::generate::perplexity::nll(row, next));
                }
            }
            pos += step.len();
        }
        let mut e = stderr.lock();
        if base.is_some() {
            let _ = write!(e, "[{}]{:.4}/{:.6},", c + 1, kld.ppl.ppl(), kld.kld().0);
        } else {
            let _ = write!(e, "[{}]{:.4},", c + 1, ppl.ppl());
        }
        let _ = e.flush();
    }
    eprintln!();
    if let Some(w) = writer {
        w.finish().map_err(|e| format!("writing: {e}"))?;
    }
    let secs = t_eval.elapsed().as_secs_f64();
    eprintln!(
        "evaluated {} tokens in {secs:.1} s ({:.1} tokens/s)",
        n_chunk * n_ctx,
        (n_chunk * n_ctx) as f64 / secs.max(1e-9)
    );
    match base {
        None => print_ppl(&ppl),
        Some(_) => print_kld(&kld),
    }
    describe(&model, &a);
    Ok(())
}

fn describe(model: &Model, a: &PerplexityArgs) {
    if let Some(t) = &model.file_type {
        eprintln!(
            "model: {} ({t}){}",
            model.path.display(),
            if a.runtime.exact { ", --exact" } else { "" }
        );
    }
}

fn print_ppl(p: &PplStats) {
    println!(
        "Final estimate: PPL = {:.4} +/- {:.5}",
        p.ppl(),
        p.ppl_error()
    );
}

/// The statistics llama-perplexity prints after a KL-divergence run, in
/// its words and formats.
fn print_kld(k: &KldStats) {
    if k.count() < 100 {
        println!(
            "only {} positions were scored; like llama-perplexity, no statistics below 100 (use more chunks)",
            k.count()
        );
        return;
    }
    let (lp, lpe) = k.ppl.mean_and_error();
    let (lb, lbe) = k.ppl_base.mean_and_error();
    let (ppl, ppl_base) = (lp.exp(), lb.exp());
    println!("====== Perplexity statistics ======");
    println!(
        "Mean PPL(Q)                   : {:10.6} ± {:10.6}",
        ppl,
        ppl * lpe
    );
    println!(
        "Mean PPL(base)                : {:10.6} ± {:10.6}",
        ppl_base,
        ppl_base * lbe
    );
    let (r, re) = k.log_ppl_ratio();
    println!("Mean ln(PPL(Q)/PPL(base))     : {r:10.6} ± {re:10.6}");
    println!(
        "Mean PPL(Q)/PPL(base)         : {:10.6} ± {:10.6}",
        r.exp(),
        r.exp() * re
    );
    println!();
    println!("====== KL divergence statistics ======");
    let (m, me) = k.kld();
    println!("Mean    KLD: {m:10.6} ± {me:10.6}");
    let mut v = k.klds.clone();
    v.sort_by(f32::total_cmp);
    let pct = |f| llama_graph::generate::perplexity::percentile(&v, f);
    println!("Maximum KLD: {:10.6}", v[v.len() - 1]);
    println!("99.9%   KLD: {:10.6}", pct(0.999));
    println!("99.0%   KLD: {:10.6}", pct(0.99));
    println!("95.0%   KLD: {:10.6}", pct(0.95));
    println!("Median  KLD: {:10.6}", pct(0.5));
    println!("Minimum KLD: {:10.6}", v[0]);
    println!();
    println!("====== Token probability statistics ======");
    let (rms, rmse) = k.rms_p_diff();
    println!("RMS Δp    : {:6.3} ± {:5.3} %", 100.0 * rms, 100.0 * rmse);
    let (st, ste) = k.same_top();
    println!("Same top p: {:6.3} ± {:5.3} %", 100.0 * st, 100.0 * ste);
}
