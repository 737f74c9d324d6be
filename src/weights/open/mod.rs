//! Opening a model: format detection and one entry point, [`open`], for
//! every layout the runtime reads.
//!
//! [`open`] reads a Meta checkpoint directory (`params.json`,
//! `consolidated.*.pth`), a Hugging Face directory (`config.json`,
//! `*.safetensors`) or a GGUF file into model arguments and a weight store,
//! always under Meta's tensor names and with Meta's Q/K row order, plus the
//! tokenizer and chat template the model ships. [`detect`] says which
//! layout a path is without reading it; [`open_only`] keeps only the
//! tensors a pipeline stage needs. One file per layout: `gguf.rs`, `hf.rs`,
//! `meta.rs`.
#![warn(missing_docs)]

mod gguf;
mod hf;
mod meta;

use crate::exec::store_dtypes;
use crate::ir::DType;
use crate::model::{ModelArgs, ParamsError};
use crate::tokenizer::{Tokenizer, TokenizerError};
use crate::weights::gguf::GgufError;
use crate::weights::hf::HfError;
use crate::weights::pth::PthError;
use crate::weights::WeightStore;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use thiserror::Error;

/// Why a model could not be opened; every message names the file.
#[derive(Debug, Error)]
pub enum LoadError {
    /// The path is missing, unreadable or not a model in a known layout.
    #[error("{path}: {message}")]
    Path {
        /// The path given.
        path: String,
        /// What is wrong with it and what to do.
        message: String,
    },
    /// `params.json` (or the arguments derived from `config.json` or GGUF
    /// metadata) is invalid.
    #[error("{path}: {source}")]
    Params {
        /// The file the arguments came from.
        path: String,
        /// The field at fault.
        #[source]
        source: ParamsError,
    },
    /// A Meta `.pth` checkpoint could not be read.
    #[error(transparent)]
    Pth(#[from] PthError),
    /// A Hugging Face directory could not be read.
    #[error(transparent)]
    Hf(#[from] HfError),
    /// A GGUF file could not be read.
    #[error("{path}: {source}")]
    Gguf {
        /// The GGUF file.
        path: String,
        /// What the reader found.
        #[source]
        source: GgufError,
    },
    /// The tokenizer could not be read.
    #[error("{path}: {source}")]
    Tokenizer {
        /// The tokenizer's file.
        path: String,
        /// What the tokenizer reader found.
        #[source]
        source: TokenizerError,
    },
    /// The arguments' `vocab_size` disagrees with the tokenizer or the
    /// embedding table.
    #[error("vocab_size disagrees: {0}")]
    Vocab(String),
}

/// Chooses the checkpoint tensors to load from the model's arguments and
/// the dtypes of all its tensors (see [`open_only`]).
pub type TensorSelector<'a> =
    dyn Fn(&ModelArgs, &BTreeMap<String, DType>) -> Result<BTreeSet<String>, String> + 'a;

/// The format a model was found in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelFormat {
    /// Meta's distribution: params.json + consolidated.*.pth (+ tokenizer.model).
    MetaDir,
    /// A GGUF file.
    Gguf,
    /// Hugging Face's layout: config.json + *.safetensors (+ tokenizer files).
    HfDir,
}

/// A model's arguments, weights and (when it has one) tokenizer.
pub struct Model {
    /// The path it was opened from.
    pub path: PathBuf,
    /// Which of the three layouts it is.
    pub format: ModelFormat,
    /// The architecture's arguments (Meta's `params.json` names).
    pub args: ModelArgs,
    /// Every tensor, by Meta's names, as views of the file mapping where
    /// possible.
    pub weights: WeightStore,
    /// The tokenizer, when the model ships one.
    pub tokenizer: Option<Tokenizer>,
    /// The model's own Jinja chat template (GGUF `tokenizer.chat_template`).
    pub chat_template: Option<String>,
    /// The model's name, where the file gives one.
    pub name: Option<String>,
    /// The file's declared quantization (GGUF `general.file_type`), e.g.
    /// `Q4_K_M`, where the file gives one.
    pub file_type: Option<String>,
}

/// Opens the model at `path`, whichever layout it is (see [`detect`]):
/// a GGUF file, a Hugging Face directory or a Meta checkpoint directory.
pub fn open(path: &Path) -> Result<Model, LoadError> {
    match detect(path)? {
        ModelFormat::HfDir => Model::open_hf_dir(path),
        ModelFormat::MetaDir => Model::open_meta_dir(path),
        ModelFormat::Gguf => Model::open_gguf(path),
    }
}

/// Which layout `path` holds: a directory with `config.json` (Hugging
/// Face) or `params.json` (Meta), or a file starting with the GGUF magic.
/// Anything else is an error that names the path and the layouts known.
pub fn detect(path: &Path) -> Result<ModelFormat, LoadError> {
    let perr = |message: String| LoadError::Path {
        path: path.display().to_string(),
        message,
    };
    let meta = std::fs::metadata(path).map_err(|e| perr(format!("cannot open: {e}")))?;
    if meta.is_dir() {
        if path.join("config.json").is_file() {
            return Ok(ModelFormat::HfDir);
        }
        if path.join("params.json").is_file() {
            return Ok(ModelFormat::MetaDir);
        }
        return Err(perr(
            "is a directory, but neither a Meta checkpoint (params.json + consolidated.*.pth) \
             nor a Hugging Face one (config.json + model.safetensors)"
                .into(),
        ));
    }
    let mut magic = [0u8; 4];
    use std::io::Read;
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut magic))
        .map_err(|e| perr(format!("cannot read: {e}")))?;
    if &magic == b"GGUF" {
        return Ok(ModelFormat::Gguf);
    }
    Err(perr(
        "neither a GGUF file nor a checkpoint directory (Meta: params.json + consolidated.*.pth; \
         Hugging Face: config.json + model.safetensors)"
            .into(),
    ))
}

/// Opens a model keeping only the tensors `select` names (a pipeline
/// stage's): the others are dropped from the store before anything
/// reads their pages, and the shards of a Meta checkpoint are merged
/// only for the selected tensors.
pub fn open_only(path: &Path, select: &TensorSelector<'_>) -> Result<Model, LoadError> {
    let perr = |message: String| LoadError::Path {
        path: path.display().to_string(),
        message,
    };
    if std::fs::metadata(path).is_ok_and(|m| m.is_dir()) && path.join("params.json").is_file() {
        return Model::open_meta_dir_with(path, Some(select));
    }
    let mut model = open(path)?;
    let keep = select(&model.args, &store_dtypes(&model.weights)).map_err(perr)?;
    model.weights.tensors.retain(|k, _| keep.contains(k));
    Ok(model)
}

impl Model {
    /// Opens the model at `path`, whichever layout it is: [`open`].
    pub fn open(path: &Path) -> Result<Model, LoadError> {
        open(path)
    }

    /// Opens a model keeping only the tensors `select` names: [`open_only`].
    pub fn open_only(path: &Path, select: &TensorSelector<'_>) -> Result<Model, LoadError> {
        open_only(path, select)
    }

    /// The `tokenizer.model` of a directory (SentencePiece or tiktoken),
    /// where there is one.
    fn tokenizer_model_file(dir: &Path, args: &ModelArgs) -> Result<Option<Tokenizer>, LoadError> {
        let tok_path = dir.join("tokenizer.model");
        if !tok_path.exists() {
            return Ok(None);
        }
        let data = std::fs::read(&tok_path).map_err(|e| LoadError::Path {
            path: tok_path.display().to_string(),
            message: e.to_string(),
        })?;
        // SentencePiece files are protobuf (first field tag 0x0a);
        // Llama 3's tiktoken file is base64 text.
        let t = if data.first() == Some(&0x0a) {
            Tokenizer::from_sentencepiece_bytes(&data)
        } else {
            Tokenizer::from_tiktoken_bytes(&data)
        }
        .map_err(|source| LoadError::Tokenizer {
            path: tok_path.display().to_string(),
            source,
        })?;
        if let Some(v) = args.vocab_size {
            if t.n_vocab() > v {
                return Err(LoadError::Vocab(format!(
                    "the tokenizer has {} tokens but the model's vocabulary is {v}",
                    t.n_vocab()
                )));
            }
        }
        Ok(Some(t))
    }
}
