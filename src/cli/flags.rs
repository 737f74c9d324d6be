//! Flags shared by the generating subcommands (`run`, `chat`).

use clap::Args;
use llama_graph::generate::chat::ContextPolicy;
use llama_graph::generate::spec::{check_vocab, Drafter, SpecConfig};
use llama_graph::generate::SamplerConfig;
use llama_graph::ir::LogitRows;
use llama_graph::passes::PassList;
use llama_graph::session::{CacheType, Model, Session, SessionOptions};
use std::path::PathBuf;

/// Context, batching and threads.
#[derive(Debug, Args, Clone)]
pub struct RuntimeFlags {
    /// Context to plan for (KV-cache positions). Default 2048, capped by the
    /// model's own limit. For `serve`, the KV pool all sequences share (one
    /// sequence may use all of it).
    #[arg(short = 'c', long = "ctx-size", value_name = "N")]
    pub ctx_size: Option<usize>,
    /// Prefill chunk: the most prompt tokens processed in one step. For
    /// `serve`, the step's token budget: decode tokens of the running
    /// sequences and prefill chunks of new ones together.
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
    /// Exact f32 activations in every matmul. Without it, matmuls over
    /// Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL and
    /// IQ4_XS weights quantize their activations to an 8-bit quant plus an
    /// 8-bit remainder and multiply in integers (logits within ~0.01 of
    /// exact); Q2_K always uses the exact path. With it, results match a
    /// float reference on the same weights within rounding. The KV cache is
    /// f32 with it, f16 without.
    #[arg(long = "exact")]
    pub exact: bool,
    #[command(flatten)]
    pub cache: CacheTypeFlags,
}

/// `-ctk`/`-ctv`: how the KV cache stores keys and values.
#[derive(Debug, Args, Clone, Default)]
pub struct CacheTypeFlags {
    /// KV cache type of the keys (also -ctk): f32, f16, bf16, q8_0 or q4_0
    /// (llama.cpp's names). Default f16 (f32 with --exact). q8_0 takes 34/64
    /// of f16's memory and q4_0 18/64 (8-bit or 4-bit values with one f16
    /// scale per 32, as llama.cpp quantizes them); both need a head dim that
    /// is a multiple of 32. The cache's size is printed at start.
    #[arg(long = "cache-type-k", value_name = "TYPE", value_parser = parse_cache_type)]
    pub cache_type_k: Option<CacheType>,
    /// KV cache type of the values (also -ctv): as for --cache-type-k.
    #[arg(long = "cache-type-v", value_name = "TYPE", value_parser = parse_cache_type)]
    pub cache_type_v: Option<CacheType>,
    /// Keep every position in the sliding-window layers too (Gemma 3's
    /// local layers, Mistral 7B v0.1), as llama.cpp's --swa-full does.
    /// Without it those layers keep a ring holding only their window plus
    /// one batch (the memory printed at start), and `serve` does not reuse
    /// cached prompt prefixes for such a model (the positions before the
    /// window are gone); a chat that rewinds past the ring is fed again
    /// from its start.
    #[arg(long = "swa-full")]
    pub swa_full: bool,
}

/// Parses a KV cache type by llama.cpp's name.
pub fn parse_cache_type(s: &str) -> Result<CacheType, String> {
    s.parse()
}

/// Validates `--passes`.
pub fn parse_passes(s: &str) -> Result<String, String> {
    PassList::parse(s).map(|_| s.to_string())
}

impl RuntimeFlags {
    /// The session options these flags ask for.
    pub fn session_options(
        &self,
        context: usize,
        threads: usize,
    ) -> Result<SessionOptions, String> {
        Ok(SessionOptions {
            context: Some(context),
            batch: self.batch_size,
            parallel: 1,
            threads,
            logit_rows: LogitRows::Last,
            passes: PassList::parse(&self.passes)?,
            exact: self.exact,
            cache_type_k: self.cache.cache_type_k,
            cache_type_v: self.cache.cache_type_v,
            swa_full: self.cache.swa_full,
            draft: false,
        })
    }

    /// Checks the values and resolves the thread count.
    pub fn threads(&self) -> Result<usize, String> {
        if self.batch_size == 0 {
            return Err("-b/--batch-size must be at least 1".into());
        }
        if self.ctx_size == Some(0) {
            return Err("-c/--ctx-size must be at least 1".into());
        }
        match self.threads {
            Some(0) => Err("-t/--threads must be at least 1".into()),
            Some(t) => Ok(t),
            None => Ok(std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)),
        }
    }
}

/// Sampling, in the fixed order documented in `generate::sampler`:
/// repeat penalty, then greedy if --temp 0, else top-k, top-p, min-p,
/// temperature.
#[derive(Debug, Args, Clone)]
pub struct SamplingFlags {
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
}

impl SamplingFlags {
    /// The sampler configuration, validated; prints the seed when sampling.
    pub fn config(&self) -> Result<SamplerConfig, String> {
        let seed = self.seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0)
        });
        let c = SamplerConfig {
            temperature: self.temp,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            repeat_last_n: self.repeat_last_n,
            seed,
        };
        c.validate().map_err(|e| e.to_string())?;
        if c.temperature > 0.0 {
            eprintln!(
                "sampling: seed {seed} (temp {}, top-k {}, top-p {}, min-p {}, repeat-penalty {})",
                c.temperature, c.top_k, c.top_p, c.min_p, c.repeat_penalty
            );
        }
        Ok(c)
    }
}

/// `-n`: a positive count, or -1 for "until the context is full".
pub fn n_predict(n: i64) -> Result<Option<usize>, String> {
    match n {
        -1 => Ok(None),
        n if n >= 1 => Ok(Some(n as usize)),
        n => Err(format!(
            "-n must be at least 1, or -1 for \"until the context is full\"; got {n}"
        )),
    }
}

/// Speculative decoding: the output is the same tokens as without it (see
/// docs/design/speculative.md).
#[derive(Debug, Args, Clone)]
pub struct SpecFlags {
    /// Speculative decoding with this draft model: a smaller model (any
    /// format -m takes) with the same tokenizer vocabulary, checked at
    /// load. It guesses the next tokens greedily; the model verifies them
    /// in one step and keeps exactly the tokens it would have produced
    /// without a draft. The draft runs its quantized matmuls with 8-bit
    /// activations alone (cheaper guesses; they never change the output);
    /// with --exact it runs exact too.
    #[arg(
        long = "draft-model",
        value_name = "PATH",
        conflicts_with = "spec_ngram"
    )]
    pub draft_model: Option<PathBuf>,
    /// Speculative decoding with prompt lookup: the guess is what followed
    /// the latest earlier occurrence of the last 3 (else 2) tokens in the
    /// prompt and the output so far. Pays on output that quotes its input
    /// (edits, extraction, summaries with quotes); costs nothing otherwise.
    #[arg(long = "spec-ngram")]
    pub spec_ngram: bool,
    /// With --draft-model or --spec-ngram: the most tokens guessed per step
    /// (also accepted as llama.cpp's newer name, --spec-draft-n-max).
    #[arg(
        long = "draft-max",
        visible_alias = "spec-draft-n-max",
        value_name = "N",
        default_value_t = 8
    )]
    pub draft_max: usize,
    /// With --draft-model or --spec-ngram: guesses shorter than this are
    /// not verified (the step decodes one token; also accepted as
    /// --spec-draft-n-min).
    #[arg(
        long = "draft-min",
        visible_alias = "spec-draft-n-min",
        value_name = "N",
        default_value_t = 1
    )]
    pub draft_min: usize,
    /// Always guess up to --draft-max tokens. By default the number adapts
    /// to the measured acceptance and the measured cost of a longer step,
    /// down to none when guessing does not pay (then a short guess now and
    /// then re-measures acceptance, taking at most ~2% of the time).
    #[arg(long = "draft-fixed")]
    pub draft_fixed: bool,
}

impl SpecFlags {
    /// The speculation asked for, validated (`None`: plain decoding).
    pub fn config(&self) -> Result<Option<SpecConfig>, String> {
        if self.draft_model.is_none() && !self.spec_ngram {
            return Ok(None);
        }
        let c = SpecConfig {
            draft_max: self.draft_max,
            draft_min: self.draft_min,
            adaptive: !self.draft_fixed,
        };
        c.validate()?;
        Ok(Some(c))
    }

    /// The session options for the model: with speculation its steps
    /// return up to `--draft-max + 1` logit rows.
    pub fn session_options(&self, mut opts: SessionOptions) -> Result<SessionOptions, String> {
        if let Some(c) = self.config()? {
            opts.logit_rows = LogitRows::Tail {
                max: c.draft_max + 1,
            };
            if c.draft_max + 1 > opts.batch {
                return Err(format!(
                    "--draft-max {} needs steps of {} tokens, more than -b/--batch-size {}",
                    c.draft_max,
                    c.draft_max + 1,
                    opts.batch
                ));
            }
        }
        Ok(opts)
    }

    /// The drafter: the draft model opened, its vocabulary checked against
    /// `target`'s and compiled like the model (`opts`, one logit row), or
    /// prompt lookup.
    pub fn drafter(
        &self,
        target: &Model,
        opts: &SessionOptions,
    ) -> Result<Option<Drafter>, String> {
        if self.spec_ngram {
            return Ok(Some(Drafter::ngram()));
        }
        let Some(path) = &self.draft_model else {
            return Ok(None);
        };
        let draft = Model::open(path).map_err(|e| format!("--draft-model: {e}"))?;
        check_vocab(target, &draft).map_err(|e| format!("--draft-model: {e}"))?;
        let dopts = opts.for_draft();
        let session = Session::new(&draft, &dopts).map_err(|e| format!("--draft-model: {e}"))?;
        Ok(Some(Drafter::model(session)))
    }
}

/// What happens when a conversation outgrows the context.
#[derive(Debug, Args, Clone)]
pub struct ContextFlags {
    /// When the context is full: `shift` drops the oldest turns after the
    /// system prompt (`run`: the older half of the tokens after the first)
    /// and feeds the rest again, so the conversation goes on; `refuse`
    /// stops there and says how many tokens were needed. Default: `shift`
    /// for `chat` and `serve`, `refuse` for `run` (which then stops
    /// generating at the context's end; with `shift`, `-n` may exceed the
    /// context and `-n -1` runs until an end-of-sequence token).
    #[arg(long = "context-full", value_name = "POLICY", value_parser = ["shift", "refuse"])]
    pub context_full: Option<String>,
}

impl ContextFlags {
    /// The policy asked for, or `default`.
    pub fn policy(&self, default: ContextPolicy) -> ContextPolicy {
        self.context_full
            .as_deref()
            .and_then(|s| s.parse().ok())
            .unwrap_or(default)
    }
}
