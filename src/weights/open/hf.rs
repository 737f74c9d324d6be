//! Opening a Hugging Face directory: `config.json`, the safetensors
//! weights and the tokenizer files beside them.

use super::{LoadError, Model, ModelFormat};
use crate::tokenizer::Tokenizer;
use crate::weights::hf::load_hf_checkpoint;
use std::path::Path;

impl Model {
    /// Opens a Hugging Face checkpoint directory (`config.json`,
    /// `model.safetensors` or shards).
    pub fn open_hf_dir(dir: &Path) -> Result<Model, LoadError> {
        let ck = load_hf_checkpoint(dir)?;
        let args = ck.config.args.clone();
        let (tokenizer, chat_template) = Model::hf_tokenizer(dir, &ck.config)?;
        Ok(Model {
            path: dir.to_path_buf(),
            format: ModelFormat::HfDir,
            args,
            weights: ck.weights,
            tokenizer,
            chat_template,
            name: None,
            file_type: None,
        })
    }

    /// The tokenizer of a Hugging Face directory: `tokenizer.json` with
    /// `tokenizer_config.json` (BOS/EOS, `add_bos_token`, the chat template,
    /// or `chat_template.jinja` beside it), else a `tokenizer.model`. Stop
    /// ids: the EOS plus config.json's and generation_config.json's
    /// `eos_token_id` (one id or a list).
    fn hf_tokenizer(
        dir: &Path,
        config: &crate::weights::hf::HfConfig,
    ) -> Result<(Option<Tokenizer>, Option<String>), LoadError> {
        let read = |name: &str| -> Result<Option<String>, LoadError> {
            let p = dir.join(name);
            if !p.is_file() {
                return Ok(None);
            }
            std::fs::read_to_string(&p)
                .map(Some)
                .map_err(|e| LoadError::Path {
                    path: p.display().to_string(),
                    message: format!("cannot read: {e}"),
                })
        };
        let terr = |name: &str, source| LoadError::Tokenizer {
            path: dir.join(name).display().to_string(),
            source,
        };
        let tcfg = match read("tokenizer_config.json")? {
            Some(t) => Some(
                crate::tokenizer::HfTokenizerConfig::parse(&t)
                    .map_err(|e| terr("tokenizer_config.json", e))?,
            ),
            None => None,
        };
        let template = match read("chat_template.jinja")? {
            Some(t) => Some(t),
            None => tcfg.as_ref().and_then(|c| c.chat_template.clone()),
        };
        let mut tok = match read("tokenizer.json")? {
            Some(json) => Some(
                Tokenizer::from_hf_json(json.as_bytes(), tcfg.as_ref())
                    .map_err(|e| terr("tokenizer.json", e))?,
            ),
            None => Model::tokenizer_model_file(dir, &config.args)?,
        };
        if let Some(t) = &mut tok {
            if let Some(v) = config.args.vocab_size {
                if t.n_vocab() > v {
                    return Err(LoadError::Vocab(format!(
                        "the tokenizer has {} tokens but config.json's vocab_size is {v}",
                        t.n_vocab()
                    )));
                }
            }
            let mut stop = config.eos_token_ids.clone();
            if let Some(g) = read("generation_config.json")? {
                if let Ok(v) = serde_json::from_str::<serde_json::Value>(&g) {
                    match &v["eos_token_id"] {
                        serde_json::Value::Array(a) => {
                            stop.extend(a.iter().filter_map(|x| x.as_u64()).map(|x| x as u32))
                        }
                        x => stop.extend(x.as_u64().map(|x| x as u32)),
                    }
                }
            }
            let eos = t.eos_id().or(config.eos_token_ids.first().copied());
            t.set_special_ids(t.bos_id().or(config.bos_token_id), eos, &stop);
        }
        Ok((tok, template))
    }
}
