//! `llama-graph bench`: prompt-processing and generation throughput, with
//! llama.cpp's `llama-bench` flags and output rows so the two tools' figures
//! can be put side by side.
//!
//! As in llama-bench, the tokens are synthetic (random ids from the
//! vocabulary, no tokenizer, no sampling):
//! - `ppN`: the KV cache is reset and one N-token prompt is fed (in chunks of
//!   `-b`); tokens/s = N / wall time.
//! - `tgN`: the cache is reset and N tokens are fed one at a time (each step
//!   computes the last row's logits); tokens/s = N / wall time.
//! - with `-d D` (llama-bench's `--n-depth`), each run of either test first
//!   feeds D synthetic tokens (in chunks of `-b`, untimed) after the reset,
//!   so the N timed tokens attend over D positions already in the cache; the
//!   row is named `ppN @ dD` / `tgN @ dD`.
//!
//! Each test runs once untimed (warm-up) and then `-r` times.

use super::model::ModelArg;
use super::pipeline::Role;
use clap::{Args, ValueEnum};
use llama_graph::passes::PassList;
use llama_graph::session::{Model, Session, SessionOptions};
use serde::Serialize;
use std::time::Instant;

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum OutputFormat {
    Md,
    Json,
}

#[derive(Debug, Args)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArg,
    /// Thread counts to test (comma-separated).
    #[arg(
        short = 't',
        long = "threads",
        value_delimiter = ',',
        default_value = "2"
    )]
    pub threads: Vec<usize>,
    /// Prompt lengths to test (comma-separated; 0 = none).
    #[arg(
        short = 'p',
        long = "n-prompt",
        value_delimiter = ',',
        default_value = "512"
    )]
    pub n_prompt: Vec<usize>,
    /// Generation lengths to test (comma-separated; 0 = none).
    #[arg(
        short = 'n',
        long = "n-gen",
        value_delimiter = ',',
        default_value = "128"
    )]
    pub n_gen: Vec<usize>,
    /// Depths to test (comma-separated), as llama-bench's --n-depth: each
    /// ppN and tgN runs after this many tokens are already in the KV cache
    /// (fed untimed, in chunks of -b, after the reset of every run).
    #[arg(
        short = 'd',
        long = "n-depth",
        value_delimiter = ',',
        default_value = "0"
    )]
    pub n_depth: Vec<usize>,
    /// Repetitions of each test.
    #[arg(short = 'r', long = "repetitions", default_value_t = 5)]
    pub reps: usize,
    /// Prefill chunk (the most tokens per step).
    #[arg(short = 'b', long = "batch-size", default_value_t = 512)]
    pub batch: usize,
    /// Output format.
    #[arg(short = 'o', long = "output", value_enum, default_value = "md")]
    pub output: OutputFormat,
    /// Skip the untimed warm-up run of each test.
    #[arg(long = "no-warmup")]
    pub no_warmup: bool,
    /// Exact quantized matmuls (f32 activations) instead of the fast path
    /// (activations quantized per block to an 8-bit quant plus an 8-bit
    /// remainder, integer dot products; every quantized type but Q2_K).
    #[arg(long = "exact")]
    pub exact: bool,
    #[command(flatten)]
    pub cache: super::flags::CacheTypeFlags,
    /// Optimisation passes: `all`, `none` or a comma-separated list of pass
    /// names (see `llama-graph graph --help`), as for `run`.
    #[arg(long = "passes", value_name = "LIST", default_value = "all", value_parser = super::flags::parse_passes)]
    pub passes: String,
    /// Seed of the synthetic token ids.
    #[arg(long = "seed", default_value_t = 1234)]
    pub seed: u64,
    /// Sequences decoding at once in tgN (each with its own KV cache,
    /// greedy, round robin): tokens/s counts all of them. With --pipeline,
    /// a sequence's next step starts as soon as its logits are back, so
    /// several sequences in flight keep every stage busy.
    #[arg(long = "in-flight", value_name = "M", default_value_t = 1)]
    pub in_flight: usize,
    #[command(flatten)]
    pub pipeline: super::pipeline::PipelineFlags,
}

/// One result row, with llama-bench's field names.
#[derive(Debug, Serialize)]
pub struct BenchRow {
    pub model_filename: String,
    pub model_size: u64,
    pub model_n_params: u64,
    pub n_threads: usize,
    pub n_batch: usize,
    pub n_prompt: usize,
    pub n_gen: usize,
    /// Tokens in the cache before the timed ones (llama-bench's n_depth).
    pub n_depth: usize,
    pub test: String,
    pub avg_ns: u64,
    pub stddev_ns: u64,
    pub avg_ts: f64,
    pub stddev_ts: f64,
    pub samples_ns: Vec<u64>,
    pub samples_ts: Vec<f64>,
    /// Seconds to open the model and compile the session (not in llama-bench).
    pub load_s: f64,
    /// Exact (f32-activation) quantized matmuls (not in llama-bench).
    pub exact: bool,
    /// The instruction-set level the kernels ran at (not in llama-bench;
    /// `LLAMA_GRAPH_ISA` caps it).
    pub isa: String,
    /// Pipeline stages (MPI ranks; 1 without --pipeline) (not in llama-bench).
    pub stages: usize,
    /// Sequences decoding at once in tgN (not in llama-bench).
    pub in_flight: usize,
    /// Bytes the KV cache takes per position, all layers' keys and values
    /// (not in llama-bench; with --pipeline, rank 0's layers only).
    pub kv_bytes_per_pos: u64,
    /// The KV cache's key and value types (llama-bench's type_k, type_v).
    pub type_k: String,
    pub type_v: String,
}

/// Mean and sample standard deviation (0 for fewer than two samples).
fn mean_std(v: &[f64]) -> (f64, f64) {
    if v.is_empty() {
        return (0.0, 0.0);
    }
    let n = v.len() as f64;
    let mean = v.iter().sum::<f64>() / n;
    if v.len() < 2 {
        return (mean, 0.0);
    }
    let var = v.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / (n - 1.0);
    (mean, var.sqrt())
}

/// xorshift64* ids in `0..vocab`.
fn synthetic_tokens(seed: &mut u64, n: usize, vocab: usize) -> Vec<u32> {
    (0..n)
        .map(|_| {
            *seed ^= *seed >> 12;
            *seed ^= *seed << 25;
            *seed ^= *seed >> 27;
            (seed.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 33) as usize % vocab.max(1)
        })
        .map(|t| t as u32)
        .collect()
}

enum Test {
    Prompt(usize),
    Gen(usize),
}

impl Test {
    fn n(&self) -> usize {
        match *self {
            Test::Prompt(n) | Test::Gen(n) => n,
        }
    }
}

/// One timed run: reset, feed the `depth` tokens untimed, then time the test.
fn run_once(
    session: &mut Session,
    test: &Test,
    depth: &[u32],
    tokens: &[u32],
    in_flight: usize,
) -> Result<f64, String> {
    session.reset();
    if !depth.is_empty() {
        session.feed(depth).map_err(|e| e.to_string())?;
    }
    let t0 = Instant::now();
    match *test {
        Test::Prompt(_) => {
            session.feed(tokens).map_err(|e| e.to_string())?;
        }
        Test::Gen(n) if in_flight > 1 => {
            session
                .decode_in_flight(&tokens[..in_flight], n)
                .map_err(|e| e.to_string())?;
        }
        Test::Gen(n) => {
            for &t in &tokens[..n] {
                session.feed(&[t]).map_err(|e| e.to_string())?;
            }
        }
    }
    Ok(t0.elapsed().as_secs_f64())
}

pub fn run(a: BenchArgs) -> super::CliResult {
    if a.reps == 0 {
        return Err("-r must be at least 1".into());
    }
    if a.threads.contains(&0) {
        return Err("-t: thread counts must be at least 1".into());
    }
    if a.in_flight == 0 {
        return Err("--in-flight must be at least 1".into());
    }
    if a.pipeline.enabled() && a.threads.len() != 1 {
        return Err("with --pipeline, give one thread count (-t N, threads per rank)".into());
    }
    let mut tests: Vec<Test> = a
        .n_prompt
        .iter()
        .filter(|&&n| n > 0)
        .map(|&n| Test::Prompt(n))
        .collect();
    tests.extend(a.n_gen.iter().filter(|&&n| n > 0).map(|&n| Test::Gen(n)));
    let depths = &a.n_depth;
    let deepest = depths.iter().copied().max().unwrap_or(0);
    if deepest > 0 && a.in_flight > 1 {
        return Err(
            "-d (depth) with --in-flight above 1 is not supported: give one or the other".into(),
        );
    }
    let longest = tests
        .iter()
        .map(Test::n)
        .max()
        .unwrap_or(0)
        .max(a.in_flight)
        + deepest;
    let opts_for_threads = |threads: usize| -> Result<SessionOptions, String> {
        Ok(SessionOptions {
            // The KV pool holds every sequence in flight.
            context: Some(longest.max(1) * a.in_flight),
            batch: a.batch,
            threads,
            exact: a.exact,
            passes: PassList::parse(&a.passes)?,
            cache_type_k: a.cache.cache_type_k,
            cache_type_v: a.cache.cache_type_v,
            swa_full: a.cache.swa_full,
            ..SessionOptions::default()
        })
    };
    let opts_for = |_: &Model| opts_for_threads(a.threads[0]);
    let t_load = Instant::now();
    let (model, mut premade) = match Role::start(&a.pipeline)? {
        Role::Worker(t) => return Ok(super::pipeline::work(t, &a.model, &a.pipeline, &opts_for)?),
        Role::Leader(t) => {
            let (staged, ()) =
                super::pipeline::lead(t, &a.model, &a.pipeline, &opts_for, |_| Ok(()))?;
            (staged.model, Some(staged.session))
        }
        Role::Single => (a.model.open(true)?.0, None),
    };
    let model_size: u64 = model
        .weights
        .tensors
        .values()
        .map(|t| t.data.len() as u64)
        .sum();
    let model_n_params: u64 = model
        .weights
        .tensors
        .values()
        .map(|t| t.shape.iter().product::<usize>() as u64)
        .sum();
    let vocab = model.args.vocab_size.unwrap_or(0);
    if vocab == 0 {
        return Err("the model has no vocabulary size".into());
    }
    // The session's context is capped by the model's: say so before any
    // run rather than fail at the first step past it.
    if let Some(limit) = model.args.max_context.filter(|&l| longest > l) {
        return Err(format!(
            "the longest test needs {longest} positions ({deepest} of depth (-d) and {} of test) \
             but the model's context length is {limit}: use a smaller -d, -p or -n",
            longest - deepest
        )
        .into());
    }
    let filename = model.path.display().to_string();
    let open_s = t_load.elapsed().as_secs_f64();
    let mut rows = Vec::new();
    let mut seed = a.seed.max(1);
    eprintln!("{}", super::run::isa_line());
    if matches!(a.output, OutputFormat::Md) {
        println!("| model | size | params | threads | test | t/s |");
        println!("| --- | ---: | ---: | ---: | ---: | ---: |");
    }
    for &threads in &a.threads {
        let t0 = Instant::now();
        let mut session = match premade.take() {
            Some(s) => s,
            None => Session::new(&model, &opts_for_threads(threads)?)?,
        };
        let stages = session.pipeline().map_or(1, |l| l.n_stages());
        eprintln!("{}", session.kv_summary());
        let kv_types = session
            .exec()
            .kv_types()
            .unwrap_or(opts_for_threads(threads)?.kv_types());
        let load_s = open_s + t0.elapsed().as_secs_f64();
        for (&depth, test) in depths
            .iter()
            .flat_map(|d| tests.iter().map(move |t| (d, t)))
        {
            let (name, n_prompt, n_gen, n) = match *test {
                Test::Prompt(n) => (format!("pp{n}"), n, 0, n),
                Test::Gen(n) => (format!("tg{n}"), 0, n, n),
            };
            let name = if depth > 0 {
                format!("{name} @ d{depth}")
            } else {
                name
            };
            let len = match test {
                Test::Gen(_) => n.max(a.in_flight),
                Test::Prompt(_) => n,
            };
            let tokens = synthetic_tokens(&mut seed, len, vocab);
            let depth_tokens = synthetic_tokens(&mut seed, depth, vocab);
            if !a.no_warmup {
                run_once(&mut session, test, &depth_tokens, &tokens, a.in_flight)?;
            }
            let mut secs = Vec::with_capacity(a.reps);
            for _ in 0..a.reps {
                secs.push(run_once(
                    &mut session,
                    test,
                    &depth_tokens,
                    &tokens,
                    a.in_flight,
                )?);
            }
            let count = match test {
                Test::Gen(_) => n * a.in_flight,
                Test::Prompt(_) => n,
            };
            let ts: Vec<f64> = secs.iter().map(|s| count as f64 / s).collect();
            let ns: Vec<f64> = secs.iter().map(|s| s * 1e9).collect();
            let (avg_ts, stddev_ts) = mean_std(&ts);
            let (avg_ns, stddev_ns) = mean_std(&ns);
            let row = BenchRow {
                model_filename: filename.clone(),
                model_size,
                model_n_params,
                n_threads: threads,
                n_batch: a.batch,
                n_prompt,
                n_gen,
                n_depth: depth,
                test: name,
                avg_ns: avg_ns as u64,
                stddev_ns: stddev_ns as u64,
                avg_ts,
                stddev_ts,
                samples_ns: ns.iter().map(|&v| v as u64).collect(),
                samples_ts: ts,
                load_s,
                exact: a.exact,
                isa: llama_graph::kernels::Kernels::current().isa().to_string(),
                stages,
                in_flight: if matches!(test, Test::Gen(_)) {
                    a.in_flight
                } else {
                    1
                },
                type_k: kv_types.0.to_string(),
                type_v: kv_types.1.to_string(),
                kv_bytes_per_pos: (session.exec().kv_bytes()
                    / session.exec().kv_geom().capacity().max(1))
                    as u64,
            };
            if matches!(a.output, OutputFormat::Md) {
                println!(
                    "| {} | {:.2} MiB | {:.2} M | {} | {} | {:.2} ± {:.2} |",
                    model.name.as_deref().unwrap_or("llama"),
                    model_size as f64 / 1048576.0,
                    model_n_params as f64 / 1e6,
                    threads,
                    match (row.stages, row.in_flight) {
                        (1, 1) => row.test.clone(),
                        (st, m) => format!("{} ({m} seq, {st} stages)", row.test),
                    },
                    row.avg_ts,
                    row.stddev_ts
                );
            }
            rows.push(row);
        }
        if session.pipeline().is_some() {
            hop_probe(&mut session, model.args.dim, a.batch)?;
            if let Some(mib) = super::pipeline::peak_rss_mib() {
                eprintln!("pipeline: rank 0: peak RSS {mib:.1} MiB");
            }
            session.stop_pipeline("")?;
        }
    }
    if matches!(a.output, OutputFormat::Json) {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    }
    Ok(())
}

/// The cost of one stage boundary: round trips of a decode step's and of
/// a full prefill chunk's message between rank 0 and rank 1 (the header
/// plus `S x dim` f32 values), halved. On stderr.
fn hop_probe(session: &mut Session, dim: usize, batch: usize) -> Result<(), String> {
    let Some(link) = session.pipeline() else {
        return Ok(());
    };
    for s in [1usize, batch] {
        let bytes = 24 + s * dim * 4;
        let mut us: Vec<f64> = Vec::new();
        for i in 0..=50 {
            let dt = link.round_trip(bytes).map_err(|e| e.to_string())?;
            if i > 0 {
                us.push(dt.as_secs_f64() * 1e6 / 2.0);
            }
        }
        us.sort_by(f64::total_cmp);
        eprintln!(
            "pipeline: one hop of S={s}: {bytes} bytes ({} per token), median {:.1} us, min {:.1} us over {} round trips",
            dim * 4,
            us[us.len() / 2],
            us[0],
            us.len()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mean_and_sample_stddev() {
        let (m, s) = mean_std(&[2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0]);
        assert_eq!(m, 5.0);
        // Sample variance: 32 / 7.
        assert!((s - (32.0f64 / 7.0).sqrt()).abs() < 1e-12);
        assert_eq!(mean_std(&[3.0]), (3.0, 0.0));
    }

    #[test]
    fn synthetic_ids_in_range_and_reproducible() {
        let (mut a, mut b) = (7u64, 7u64);
        let x = synthetic_tokens(&mut a, 1000, 49152);
        assert_eq!(x, synthetic_tokens(&mut b, 1000, 49152));
        assert!(x.iter().all(|&t| t < 49152));
        // Not constant.
        assert!(x.iter().any(|&t| t != x[0]));
    }
}
