//! Opening a model and running it: the layer between the CLI and the
//! compiler/executor.
//!
//! [`Model::open`] reads a Meta checkpoint directory (`params.json`,
//! `consolidated.*.pth`) or a GGUF file into model arguments and a weight
//! store. [`Session::new`] builds the graph for those arguments, compiles it
//! into a plan, binds the weights and prepares an executor. The session
//! keeps the KV-cache position across calls.

use crate::exec::{bind_weights, store_dtypes, BindError, ExecError, Executor};
use crate::ir::{GraphError, LogitRows};
use crate::model::llama::BuildError;
use crate::model::{build_llama, BuildOptions, ModelArgs, ParamsError};
use crate::plan::{compile, ExecPlan};
use crate::weights::pth::{load_meta_checkpoint, PthError};
use crate::weights::WeightStore;
use std::path::{Path, PathBuf};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum LoadError {
    #[error("{path}: {message}")]
    Path { path: String, message: String },
    #[error("{path}: {source}")]
    Params {
        path: String,
        #[source]
        source: ParamsError,
    },
    #[error(transparent)]
    Pth(#[from] PthError),
    #[error("vocab_size disagrees: {0}")]
    Vocab(String),
}

#[derive(Debug, Error)]
pub enum SessionError {
    #[error(transparent)]
    Build(#[from] BuildError),
    #[error(transparent)]
    Graph(#[from] GraphError),
    #[error(transparent)]
    Bind(#[from] BindError),
    #[error(transparent)]
    Exec(#[from] ExecError),
    #[error("{0}")]
    Invalid(String),
}

/// The format a model was found in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelFormat {
    /// Meta's distribution: params.json + consolidated.*.pth (+ tokenizer.model).
    MetaDir,
    /// A GGUF file.
    Gguf,
}

/// A model's arguments and weights.
pub struct Model {
    pub path: PathBuf,
    pub format: ModelFormat,
    pub args: ModelArgs,
    pub weights: WeightStore,
}

impl Model {
    /// Opens a Meta checkpoint directory.
    pub fn open_meta_dir(dir: &Path) -> Result<Model, LoadError> {
        let pj = dir.join("params.json");
        let text = std::fs::read_to_string(&pj).map_err(|e| LoadError::Path {
            path: pj.display().to_string(),
            message: format!("cannot read params.json: {e}"),
        })?;
        let mut args = ModelArgs::from_params_json(&text).map_err(|source| LoadError::Params {
            path: pj.display().to_string(),
            source,
        })?;
        let weights = load_meta_checkpoint(dir)?;
        let emb_rows = weights
            .tensors
            .get("tok_embeddings.weight")
            .and_then(|t| t.shape.first().copied());
        match (args.vocab_size, emb_rows) {
            (None, Some(rows)) => args.vocab_size = Some(rows),
            (Some(v), Some(rows)) if v != rows => {
                return Err(LoadError::Vocab(format!(
                    "params.json says {v}, tok_embeddings.weight has {rows} rows"
                )))
            }
            _ => {}
        }
        Ok(Model {
            path: dir.to_path_buf(),
            format: ModelFormat::MetaDir,
            args,
            weights,
        })
    }
}

/// How to compile a session.
#[derive(Debug, Clone)]
pub struct SessionOptions {
    /// Planned context (default 2048, capped by the model's limit).
    pub context: Option<usize>,
    /// Largest prefill chunk.
    pub batch: usize,
    pub threads: usize,
    /// Logits for every position of a step, or only the last.
    pub logit_rows: LogitRows,
}

impl Default for SessionOptions {
    fn default() -> Self {
        SessionOptions {
            context: None,
            batch: 512,
            threads: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            logit_rows: LogitRows::Last,
        }
    }
}

/// A compiled model with its KV cache.
pub struct Session {
    pub exec: Executor,
    pub plan: ExecPlan,
    pub unused_weights: Vec<String>,
    pos: usize,
    vocab: usize,
}

impl Session {
    pub fn new(model: &Model, opts: &SessionOptions) -> Result<Session, SessionError> {
        if opts.batch == 0 {
            return Err(SessionError::Invalid(
                "the batch size (-b) must be at least 1".into(),
            ));
        }
        if opts.threads == 0 {
            return Err(SessionError::Invalid(
                "the thread count (-t) must be at least 1".into(),
            ));
        }
        let context = model.args.plan_context(opts.context);
        let mut bo = BuildOptions::new(context);
        bo.weight_dtypes = store_dtypes(&model.weights);
        bo.logit_rows = opts.logit_rows;
        let graph = build_llama(&model.args, &bo)?;
        let plan = compile(&graph, opts.batch, context)?;
        plan.buffers.check().map_err(SessionError::Invalid)?;
        let bound = bind_weights(&graph, &model.weights)?;
        let unused_weights = bound.unused.clone();
        let exec = Executor::new(&graph, &plan, bound, opts.threads)?;
        let vocab = model.args.vocab_size.unwrap_or(0);
        Ok(Session {
            exec,
            plan,
            unused_weights,
            pos: 0,
            vocab,
        })
    }

    /// Tokens already in the KV cache.
    pub fn position(&self) -> usize {
        self.pos
    }

    pub fn context(&self) -> usize {
        self.exec.context()
    }

    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// Starts over (the cache is overwritten as positions are reused).
    pub fn reset(&mut self) {
        self.pos = 0;
    }

    /// Feeds `tokens` in chunks of at most the batch size and returns the
    /// logits of the last one. Fails before any work if they do not fit.
    pub fn feed(&mut self, tokens: &[i32]) -> Result<&[f32], SessionError> {
        if tokens.is_empty() {
            return Err(SessionError::Invalid("nothing to feed".into()));
        }
        let end = self.pos + tokens.len();
        if end > self.context() {
            return Err(ExecError::ContextOverflow {
                tokens: tokens.len(),
                pos: self.pos,
                context: self.context(),
            }
            .into());
        }
        let chunk = self.exec.max_chunk();
        let n_chunks = tokens.len().div_ceil(chunk);
        for (i, c) in tokens.chunks(chunk).enumerate() {
            if i + 1 < n_chunks {
                self.exec.step(c, self.pos)?;
                self.pos += c.len();
            }
        }
        let last = tokens.chunks(chunk).next_back().unwrap_or(&[]);
        let pos = self.pos;
        self.pos += last.len();
        let logits = self.exec.step(last, pos)?;
        Ok(logits.last())
    }
}
