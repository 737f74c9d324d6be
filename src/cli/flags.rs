//! Flags shared by the generating subcommands (`run`, `chat`).

use clap::Args;
use llama_graph::generate::chat::ContextPolicy;
use llama_graph::generate::SamplerConfig;
use llama_graph::ir::LogitRows;
use llama_graph::passes::PassList;
use llama_graph::session::SessionOptions;

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
