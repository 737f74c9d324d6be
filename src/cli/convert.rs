//! `llama-graph convert`: any model this runtime reads into a GGUF file
//! llama.cpp runs.

use clap::Args;
use llama_graph::convert::{convert, OutType};
use std::path::PathBuf;
use std::time::Instant;

#[derive(Debug, Args)]
pub struct ConvertArgs {
    /// The model to convert: a Meta checkpoint directory, a Hugging Face
    /// directory (config.json + safetensors + tokenizer.json) or a GGUF file
    /// (re-quantized).
    #[arg(short = 'm', long = "model", value_name = "PATH")]
    pub model: PathBuf,
    /// The GGUF file to write (written to OUT.part first, then renamed).
    #[arg(short = 'o', long = "output", value_name = "OUT.gguf")]
    pub output: PathBuf,
    /// Tensor type: f32, f16, bf16, q8_0, q4_0, or one of llama.cpp's mixes
    /// q4_k_m, q5_k_m, q6_k. Each tensor gets the type llama-quantize would
    /// give it (norms f32; in quantized files the output head q6_k; in the
    /// _k_m mixes attn_v and ffn_down of some layers q6_k; rows that are not
    /// whole 256-element blocks fall back to q5_0/q5_1/q8_0) and the same
    /// blocks, bit for bit.
    #[arg(long = "type", value_name = "TYPE", default_value = "f16", value_parser = OutType::parse)]
    pub out_type: OutType,
}

pub fn run(a: ConvertArgs) -> super::CliResult {
    if a.output.exists() && a.output.is_dir() {
        return Err(format!("{}: is a directory", a.output.display()).into());
    }
    let t0 = Instant::now();
    let bar = indicatif::ProgressBar::new(1);
    bar.set_style(
        indicatif::ProgressStyle::with_template("converting [{bar:30}] {pos}/{len} {msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    let summary = convert(&a.model, &a.output, a.out_type, |done, total, name| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
        bar.set_message(name.to_string());
    });
    bar.finish_and_clear();
    let summary = summary?;
    let mut counts = std::collections::BTreeMap::new();
    for (_, t) in &summary.types {
        *counts.entry(t.to_string()).or_insert(0usize) += 1;
    }
    let counts: Vec<String> = counts.iter().map(|(t, n)| format!("{n} {t}")).collect();
    eprintln!(
        "wrote {}: {} tensors ({}), {:.1} MiB of tensor data in {:.1} s",
        a.output.display(),
        summary.tensors,
        counts.join(", "),
        summary.bytes as f64 / 1048576.0,
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}
