//! Opening a model and running it: the layer between the CLI and the
//! compiler/executor.
//!
//! [`Model::open`] reads a Meta checkpoint directory (`params.json`,
//! `consolidated.*.pth`), a Hugging Face directory (`config.json`,
//! `*.safetensors`) or a GGUF file into model arguments and a weight store,
//! always under Meta's tensor names and with Meta's Q/K row order.
//! [`Session::new`] builds the graph for those arguments, compiles it into a
//! plan, binds the weights and prepares an executor with its KV pool.
//! [`Session::feed`] runs one sequence (the CLI's case: a batch of one
//! sequence per step) and keeps its position across calls; a batching
//! engine drives [`Session::exec`] with batches of several sequences whose
//! blocks it takes from [`Session::pool`].
#![warn(missing_docs)]

use crate::dist::stage::{PipelineLink, StepHeader};
use crate::exec::{
    bind_weights, materialize_packed, store_dtypes, Batch, BindError, ExecError, Executor, KvPool,
    Logits,
};
use crate::ir::{DType, Graph, GraphError, LogitRows, Pooling};
pub use crate::kernels::kv::CacheType;
use crate::model::llama::BuildError;
use crate::model::{build_llama, BuildOptions, ModelArgs, ParamsError};
use crate::passes::{partition, run_pipeline, PassError, PassList, PipelineReport, StagePlan};
use crate::plan::{compile, ExecPlan, PlanLimits};
use crate::tokenizer::gguf::GgufTokenizerParts;
use crate::tokenizer::{Tokenizer, TokenizerError};
use crate::weights::gguf::{GgufError, LlamaGguf};
use crate::weights::hf::{load_hf_checkpoint, HfError};
use crate::weights::pth::{load_meta_checkpoint, merge_shards, open_pth, shard_paths, PthError};
use crate::weights::WeightStore;
use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;
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

/// Why a session could not be compiled or a step could not run.
#[derive(Debug, Error)]
pub enum SessionError {
    /// The builder could not make the model's graph.
    #[error(transparent)]
    Build(#[from] BuildError),
    /// The graph failed a check.
    #[error(transparent)]
    Graph(#[from] GraphError),
    /// An optimisation pass failed.
    #[error(transparent)]
    Pass(#[from] PassError),
    /// The weights do not match the graph (missing, wrong shape or dtype).
    #[error(transparent)]
    Bind(#[from] BindError),
    /// The executor refused a step.
    #[error(transparent)]
    Exec(#[from] ExecError),
    /// The request cannot be honoured (too many tokens, an id outside the
    /// vocabulary, bad options); the message says which.
    #[error("{0}")]
    Invalid(String),
    /// A pipeline stage or its link failed.
    #[error("pipeline: {0}")]
    Pipeline(String),
}

/// The graph variant of a GGUF's architecture (llama.cpp's `llm_build_*` for
/// it): Qwen2's Q/K/V biases, the Q/K norm of Qwen3 and Gemma 3, Gemma 3's
/// embedding scale, post-norms, GELU-tanh gate and local layers (a window on
/// five of every six layers, RoPE base 10000 there: llama.cpp's
/// `set_swa_pattern(6)` and `rope_freq_base_train_swa`), and the sliding
/// window the file states.
fn gguf_variant(
    m: &crate::weights::gguf::LlamaGgufMeta,
    has_qkv_bias: bool,
    has_qk_norm: bool,
) -> crate::model::Variant {
    use crate::model::{Family, GateAct, Variant};
    let mut v = Variant {
        family: m.family,
        head_dim: (m.head_dim * m.n_heads != m.dim).then_some(m.head_dim),
        qkv_bias: has_qkv_bias,
        qk_norm: has_qk_norm,
        sliding_window: m.sliding_window,
        ..Variant::default()
    };
    if m.family == Family::Llama && m.sliding_window.is_some() {
        v.family = Family::Mistral;
    }
    if m.family == Family::Gemma3 {
        v.post_norms = true;
        v.embed_scale = true;
        v.gate_act = GateAct::GeluTanh;
        if m.sliding_window.is_some() {
            v.global_every = Some(m.swa_pattern.unwrap_or(6));
            v.local_rope_theta = Some(shortest_f64(m.rope_freq_base_swa.unwrap_or(10000.0)));
        }
    }
    v
}

/// Chooses the checkpoint tensors to load from the model's arguments and
/// the dtypes of all its tensors (see [`Model::open_only`]).
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

impl Model {
    /// Opens a Meta checkpoint directory or a GGUF file, whichever `path` is.
    pub fn open(path: &Path) -> Result<Model, LoadError> {
        let perr = |message: String| LoadError::Path {
            path: path.display().to_string(),
            message,
        };
        let meta = std::fs::metadata(path).map_err(|e| perr(format!("cannot open: {e}")))?;
        if meta.is_dir() {
            if path.join("config.json").is_file() {
                return Model::open_hf_dir(path);
            }
            if path.join("params.json").is_file() {
                return Model::open_meta_dir(path);
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
            return Model::open_gguf(path);
        }
        Err(perr(
            "neither a GGUF file nor a checkpoint directory (Meta: params.json + consolidated.*.pth; \
             Hugging Face: config.json + model.safetensors)"
                .into(),
        ))
    }

    /// Opens a GGUF file (llama architecture).
    pub fn open_gguf(path: &Path) -> Result<Model, LoadError> {
        Model::open_gguf_file(path)
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
        let mut model = Model::open(path)?;
        let keep = select(&model.args, &store_dtypes(&model.weights)).map_err(perr)?;
        model.weights.tensors.retain(|k, _| keep.contains(k));
        Ok(model)
    }

    fn open_gguf_file(path: &Path) -> Result<Model, LoadError> {
        let gerr = |source| LoadError::Gguf {
            path: path.display().to_string(),
            source,
        };
        let g = LlamaGguf::open(path).map_err(gerr)?;
        let m = &g.meta;
        let perr = |message: String| LoadError::Path {
            path: path.display().to_string(),
            message,
        };
        if m.rope_dim != m.head_dim {
            return Err(perr(format!(
                "partial rotary embeddings (RoPE over {} of {} dims) are not supported",
                m.rope_dim, m.head_dim
            )));
        }
        if m.head_dim * m.n_heads != m.dim && m.family == crate::model::Family::Llama {
            return Err(perr(format!(
                "unsupported geometry: head_dim {} x {} heads != dim {}",
                m.head_dim, m.n_heads, m.dim
            )));
        }
        let has = |suffix: &str| g.store.tensors.contains_key(&format!("layers.0.{suffix}"));
        if g.store
            .tensors
            .keys()
            .any(|k| k.starts_with("rope_factors"))
        {
            return Err(perr(
                "per-frequency RoPE factors (rope_factors_long/short: Phi-3 LongRoPE) are not supported"
                    .into(),
            ));
        }
        let rope_scaling = match (&m.rope_scaling, m.has_rope_freqs) {
            (None, false) => None,
            // llama.cpp stores Llama 3.1's per-frequency factors in
            // `rope_freqs.weight`; they come from the same formula.
            (None, true) => {
                let factors = g
                    .store
                    .tensors
                    .get("rope_freqs.weight")
                    .filter(|t| t.dtype == crate::ir::DType::F32)
                    .map(|t| {
                        t.data
                            .as_bytes()
                            .chunks_exact(4)
                            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                            .collect::<Vec<f32>>()
                    })
                    .unwrap_or_default();
                let s = crate::weights::gguf::llama::llama3_scaling_from_rope_freqs(
                    &factors,
                    m.head_dim,
                    m.rope_theta,
                )
                .ok_or_else(|| {
                    perr(
                        "rope_freqs.weight holds per-frequency RoPE factors that are not \
                         Llama 3.x scaling (low 1, high 4, original context 8192); not supported"
                            .into(),
                    )
                })?;
                Some(s)
            }
            (Some(s), false) if s.kind == "linear" => match s.factor {
                Some(f) if f.is_finite() && f > 0.0 => Some(crate::ir::RopeScaling::Linear {
                    factor: f64::from(f),
                }),
                _ => {
                    return Err(perr(
                        "RoPE scaling type `linear` needs a positive llama.rope.scaling.factor"
                            .into(),
                    ))
                }
            },
            (Some(s), _) => {
                return Err(perr(format!(
                    "RoPE scaling type `{}` is not supported",
                    s.kind
                )))
            }
        };
        let args = ModelArgs {
            dim: m.dim,
            n_layers: m.n_layers,
            n_heads: m.n_heads,
            n_kv_heads: m.n_kv_heads,
            vocab_size: Some(m.vocab_size),
            multiple_of: 1,
            ffn_dim_multiplier: None,
            ffn_hidden_dim: m.ffn_dim,
            // The f32 in the file, as its shortest decimal (1e-5, not
            // 9.99999974738e-6): the same f32 value, and the same graph as
            // the checkpoint the file was converted from.
            norm_eps: shortest_f64(m.norm_eps),
            rope_theta: shortest_f64(m.rope_theta),
            rope_scaling,
            max_context: Some(m.context_length).filter(|&c| c > 0),
            tied_embeddings: g.tied_output,
            variant: gguf_variant(m, has("attention.wq.bias"), has("attention.q_norm.weight")),
        };
        args.validate().map_err(|e| perr(e.to_string()))?;
        let t = &g.tokenizer;
        let tokenizer = if t.tokens.is_empty() {
            None
        } else {
            let parts = GgufTokenizerParts::from(t);
            Some(
                Tokenizer::from_gguf_parts(parts).map_err(|source| LoadError::Tokenizer {
                    path: path.display().to_string(),
                    source,
                })?,
            )
        };
        // The metadata (vocabulary, merges, template) now lives in owned
        // values; its file pages need not stay resident.
        g.file.release_header_pages();
        Ok(Model {
            path: path.to_path_buf(),
            format: ModelFormat::Gguf,
            args,
            chat_template: g.tokenizer.chat_template.clone(),
            name: g.meta.name.clone(),
            file_type: g.meta.file_type.map(|t| {
                format!(
                    "{} (general.file_type {t})",
                    crate::weights::gguf::file_type_name(t)
                )
            }),
            weights: g.store,
            tokenizer,
        })
    }

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

    /// Opens a Meta checkpoint directory.
    pub fn open_meta_dir(dir: &Path) -> Result<Model, LoadError> {
        Model::open_meta_dir_with(dir, None)
    }

    fn open_meta_dir_with(
        dir: &Path,
        select: Option<&TensorSelector<'_>>,
    ) -> Result<Model, LoadError> {
        let pj = dir.join("params.json");
        let text = std::fs::read_to_string(&pj).map_err(|e| LoadError::Path {
            path: pj.display().to_string(),
            message: format!("cannot read params.json: {e}"),
        })?;
        let mut args = ModelArgs::from_params_json(&text).map_err(|source| LoadError::Params {
            path: pj.display().to_string(),
            source,
        })?;
        let emb_rows_of = |w: &WeightStore| {
            w.tensors
                .get("tok_embeddings.weight")
                .and_then(|t| t.shape.first().copied())
        };
        let (weights, emb_rows) = match select {
            None => {
                let w = load_meta_checkpoint(dir)?;
                let rows = emb_rows_of(&w);
                (w, rows)
            }
            Some(select) => {
                // Shards are views until merged; merge only what is kept.
                // Meta splits the embedding along its columns, so shard 0
                // has every row.
                let mut shards = shard_paths(dir)?
                    .iter()
                    .map(|p| open_pth(p))
                    .collect::<Result<Vec<_>, _>>()?;
                let rows = shards.first().and_then(emb_rows_of);
                let mut a = args.clone();
                if a.vocab_size.is_none() {
                    a.vocab_size = rows;
                }
                let dtypes = shards.first().map(store_dtypes).unwrap_or_default();
                let keep = select(&a, &dtypes).map_err(|message| LoadError::Path {
                    path: dir.display().to_string(),
                    message,
                })?;
                for s in &mut shards {
                    s.tensors.retain(|k, _| keep.contains(k));
                }
                (merge_shards(shards)?, rows)
            }
        };
        match (args.vocab_size, emb_rows) {
            (None, Some(rows)) => args.vocab_size = Some(rows),
            (Some(v), Some(rows)) if v != rows => {
                return Err(LoadError::Vocab(format!(
                    "params.json says {v}, tok_embeddings.weight has {rows} rows"
                )))
            }
            _ => {}
        }
        let tokenizer = Model::tokenizer_model_file(dir, &args)?;
        Ok(Model {
            path: dir.to_path_buf(),
            format: ModelFormat::MetaDir,
            args,
            weights,
            tokenizer,
            chat_template: None,
            name: None,
            file_type: None,
        })
    }
}

/// An f32 read from a file as the f64 its shortest decimal spells.
fn shortest_f64(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(f64::from(x))
}

/// How to compile a session.
#[derive(Debug, Clone)]
pub struct SessionOptions {
    /// Planned context (default 2048, capped by the model's limit): the KV
    /// pool's size in positions, shared by all sequences, and the longest
    /// sequence.
    pub context: Option<usize>,
    /// Largest step in tokens (the prefill chunk; with several sequences,
    /// all their tokens in one step).
    pub batch: usize,
    /// Most sequences in one step (1 for a single conversation).
    pub parallel: usize,
    /// Compute threads (default: every core).
    pub threads: usize,
    /// Logits for every position of a step, or only the last.
    pub logit_rows: LogitRows,
    /// Optimisation passes to run (default: all). With
    /// `logit_rows: All`, `last_logits` is skipped.
    pub passes: PassList,
    /// Exact f32 activations in matmuls and an f32 KV pool (`--exact`);
    /// when false, kernels may use faster approximate activations where
    /// they have them and the KV pool stores f16.
    pub exact: bool,
    /// How the KV pool stores keys (`-ctk`); `None`: f16, or f32 with
    /// `exact`.
    pub cache_type_k: Option<CacheType>,
    /// How the KV pool stores values (`-ctv`); `None` as for keys.
    pub cache_type_v: Option<CacheType>,
}

impl SessionOptions {
    /// The KV pool's (key, value) types these options ask for.
    pub fn kv_types(&self) -> (CacheType, CacheType) {
        let default = if self.exact {
            CacheType::F32
        } else {
            CacheType::F16
        };
        (
            self.cache_type_k.unwrap_or(default),
            self.cache_type_v.unwrap_or(default),
        )
    }
}

impl Default for SessionOptions {
    fn default() -> Self {
        SessionOptions {
            context: None,
            batch: 512,
            parallel: 1,
            threads: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            logit_rows: LogitRows::Last,
            passes: PassList::all(),
            exact: false,
            cache_type_k: None,
            cache_type_v: None,
        }
    }
}

/// A compiled model with its KV cache.
pub struct Session {
    /// The executor: the bound weights, the arena and the worker pool.
    pub exec: Executor,
    /// The schedule and the arena's buffer plan.
    pub plan: ExecPlan,
    /// The compiled graph (after the passes).
    pub graph: Graph,
    /// What the passes did.
    pub passes: PipelineReport,
    /// Checkpoint tensors the graph does not read.
    pub unused_weights: Vec<String>,
    /// The KV pool's block allocator.
    pub pool: KvPool,
    /// The blocks of the session's own sequence ([`Session::feed`]).
    blocks: Vec<u32>,
    /// For a pipeline stage: its index, the number of stages and its layers.
    pub stage: Option<(usize, usize, Range<usize>)>,
    /// On rank 0 of a pipeline: the link to the later stages; `feed` runs
    /// stage 0 here and gets the logits back from the last stage.
    link: Option<PipelineLink>,
    /// The logits the last stage sent back.
    remote_logits: Vec<f32>,
    pos: usize,
    vocab: usize,
    /// The current step, reused across calls.
    batch: Batch,
}

impl Session {
    /// Compiles `model` into a session: builds its graph, runs the passes,
    /// plans the arena, binds the weights and makes the KV pool.
    ///
    /// ```no_run
    /// use llama_graph::session::{Model, Session, SessionOptions};
    /// use llama_graph::tokenizer::EncodeOptions;
    ///
    /// let model = Model::open("SmolLM2-135M-Instruct.Q4_1.gguf".as_ref())?;
    /// let mut session = Session::new(&model, &SessionOptions::default())?;
    /// let tokenizer = model.tokenizer.as_ref().expect("a GGUF file has one");
    /// let prompt = tokenizer.encode("Once upon a time", EncodeOptions { add_bos: true, parse_special: false });
    /// let logits = session.feed(&prompt)?; // the last token's logits
    /// let next = llama_graph::generate::sampler::argmax(logits);
    /// println!("{}", tokenizer.decode(&[next as u32]));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn new(model: &Model, opts: &SessionOptions) -> Result<Session, SessionError> {
        Session::build(model, opts, None, None)
    }

    /// A session whose steps give one embedding per sequence (the final
    /// norm's rows pooled by `pooling`, `[N, E]`) instead of logits; every
    /// sequence of a step must be fed whole (from position 0) in that step.
    /// Read the rows with [`Executor::step`] on a batch of whole sequences.
    pub fn new_embedding(
        model: &Model,
        opts: &SessionOptions,
        pooling: Pooling,
    ) -> Result<Session, SessionError> {
        Session::build(model, opts, None, Some(pooling))
    }

    /// A session for stage `stage` of `plan`: the compiled graph is
    /// partitioned (see [`crate::passes::partition`](mod@crate::passes::partition)) and only this stage's
    /// graph is planned, bound (only its tensors are read) and run, with a
    /// KV pool for its layers only. Stage 0 embeds tokens; the others take
    /// the hidden state through [`Executor::step_with`].
    pub fn new_stage(
        model: &Model,
        opts: &SessionOptions,
        plan: &StagePlan,
        stage: usize,
    ) -> Result<Session, SessionError> {
        if stage >= plan.n_stages() {
            return Err(SessionError::Pipeline(format!(
                "stage {stage} of a {}-stage plan",
                plan.n_stages()
            )));
        }
        Session::build(model, opts, Some((plan, stage)), None)
    }

    fn build(
        model: &Model,
        opts: &SessionOptions,
        stage: Option<(&StagePlan, usize)>,
        pooling: Option<Pooling>,
    ) -> Result<Session, SessionError> {
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
        if opts.parallel == 0 {
            return Err(SessionError::Invalid(
                "the number of parallel sequences (-np) must be at least 1".into(),
            ));
        }
        let context = model.args.plan_context(opts.context);
        let mut bo = BuildOptions::new(context);
        bo.weight_dtypes = store_dtypes(&model.weights);
        bo.logit_rows = opts.logit_rows;
        bo.pooling = pooling;
        let (kt, vt) = opts.kv_types();
        bo.kv_dtype = kt.dtype();
        bo.kv_v_dtype = vt.dtype();
        let mut graph = build_llama(&model.args, &bo)?;
        let stage_graph = |g: &Graph| -> Result<Graph, SessionError> {
            match stage {
                None => Ok(g.clone()),
                Some((plan, k)) => Ok(partition(g, plan)?.stages.swap_remove(k).graph),
            }
        };
        // Check every tensor against the builder's graph, where each has its
        // own checkpoint name and shape, before passes pack any of them.
        let unused_weights = bind_weights(&stage_graph(&graph)?, &model.weights)?.unused;
        let mut passes = match opts.logit_rows {
            LogitRows::All => opts.passes.clone().without("last_logits"),
            LogitRows::Last | LogitRows::Tail { .. } => opts.passes.clone(),
        };
        if opts.exact {
            // The exact kernels read rows one after another.
            passes = passes.without("interleave_weights");
        }
        let report = run_pipeline(&mut graph, &passes, |_, _| {})?;
        if stage.is_some() {
            graph = stage_graph(&graph)?;
        }
        let limits = PlanLimits {
            max_tokens: opts.batch,
            max_seqs: opts.parallel,
            context,
            max_logit_rows: opts.logit_rows.max_rows(opts.batch, opts.parallel),
        };
        let plan = compile(&graph, &limits)?;
        plan.buffers.check().map_err(SessionError::Invalid)?;
        // Packed weights are made once, here.
        let store = materialize_packed(&graph, &model.weights)?;
        let bound = bind_weights(&graph, &store)?;
        let mut exec = Executor::new(&graph, &plan, bound, opts.threads)?;
        exec.set_exact(opts.exact);
        let vocab = model.args.vocab_size.unwrap_or(0);
        let geom = exec.kv_geom();
        let pool = KvPool::new(geom.n_blocks, geom.block);
        let max = plan.max;
        Ok(Session {
            exec,
            plan,
            graph,
            passes: report,
            unused_weights,
            blocks: Vec::with_capacity(geom.n_blocks),
            pool,
            stage: stage.map(|(p, k)| (k, p.n_stages(), p.layers[k].clone())),
            link: None,
            remote_logits: Vec::new(),
            pos: 0,
            vocab,
            batch: Batch::with_capacity(max.s, max.n, geom.n_blocks),
        })
    }

    /// Makes this session (stage 0 of a pipeline) rank 0 of the pipeline:
    /// [`Session::feed`] sends each step on and returns the logits the last
    /// stage sends back.
    pub fn attach_pipeline(&mut self, link: PipelineLink) -> Result<(), SessionError> {
        match &self.stage {
            Some((0, n, _)) if *n == link.n_stages() => {
                self.link = Some(link);
                Ok(())
            }
            other => Err(SessionError::Pipeline(format!(
                "only stage 0 of a {}-stage plan leads a {}-rank pipeline (this session: {other:?})",
                link.n_stages(),
                link.n_stages()
            ))),
        }
    }

    /// The pipeline link, if this session leads one.
    pub fn pipeline(&mut self) -> Option<&mut PipelineLink> {
        self.link.as_mut()
    }

    /// After an error rank 0 reported: ends every rank of the pipeline this
    /// session leads (`MPI_Abort` under MPI).
    pub fn abort_pipeline(&mut self, code: i32) {
        if let Some(mut l) = self.link.take() {
            l.abort(code);
        }
    }

    /// Ends the pipeline this session leads (every rank stops; `reason`
    /// empty for a clean stop).
    pub fn stop_pipeline(&mut self, reason: &str) -> Result<(), SessionError> {
        match self.link.take() {
            Some(mut l) => l
                .stop(reason)
                .map_err(|e| SessionError::Pipeline(e.to_string())),
            None => Ok(()),
        }
    }

    /// Runs the current batch: here alone, or as stage 0 of the pipeline
    /// this session leads, in which case the step goes on to the later
    /// stages and, when `want_logits`, the last stage's logits come back
    /// (one row per sequence). Without `want_logits` a pipelined step
    /// returns no logits.
    fn run_batch(&mut self, want_logits: bool) -> Result<Option<&[f32]>, SessionError> {
        let out = run_step(
            &mut self.exec,
            self.link.as_mut(),
            &mut self.remote_logits,
            self.vocab,
            &self.batch,
            want_logits,
        )?;
        Ok(out.map(|l| l.last()))
    }

    /// Runs one step that the caller built (the server's scheduler: decode
    /// tokens and prefill chunks of several sequences, with their block
    /// tables from the caller's KV pool) and returns its logits, one row
    /// per sequence as [`Executor::step`] gives them. Alone, the step runs
    /// here; leading a pipeline, this rank runs stage 0, the later stages
    /// the rest, and the logits come back from the last one. Either way
    /// the rows are the same, so a caller is written once for both.
    pub fn step(&mut self, batch: &Batch) -> Result<Logits<'_>, SessionError> {
        run_step(
            &mut self.exec,
            self.link.as_mut(),
            &mut self.remote_logits,
            self.vocab,
            batch,
            true,
        )?
        .ok_or_else(|| SessionError::Pipeline("no logits came back".into()))
    }

    /// Greedy decoding of several sequences for throughput measurements:
    /// sequence `j` starts at position 0 with `starts[j]` and decodes `n`
    /// tokens, with its own blocks of the KV pool. Each step is one
    /// sequence's token (a micro-batch). Alone, the steps alternate;
    /// leading a pipeline, a sequence's next step starts as soon as its
    /// logits are back, so while the later stages work on one sequence this
    /// rank runs stage 0 of the next, and with as many sequences as stages
    /// every stage is busy. Returns each sequence's tokens; their blocks go
    /// back to the pool. The session's own sequence must be empty.
    pub fn decode_in_flight(
        &mut self,
        starts: &[u32],
        n: usize,
    ) -> Result<Vec<Vec<u32>>, SessionError> {
        let m = starts.len();
        if m == 0 || n == 0 || n > self.context() || self.pos != 0 {
            return Err(SessionError::Invalid(format!(
                "{m} sequences of {n} tokens from position {}: need at least one sequence of 1 to {} tokens from an empty session",
                self.pos,
                self.context()
            )));
        }
        let mut blocks: Vec<Vec<u32>> = vec![Vec::new(); m];
        let result = self.decode_in_flight_with(starts, n, &mut blocks);
        for b in &mut blocks {
            self.pool.release(b);
        }
        result
    }

    fn decode_in_flight_with(
        &mut self,
        starts: &[u32],
        n: usize,
        blocks: &mut [Vec<u32>],
    ) -> Result<Vec<Vec<u32>>, SessionError> {
        let m = starts.len();
        for b in blocks.iter_mut() {
            if !self.pool.reserve(b, n) {
                return Err(SessionError::Invalid(format!(
                    "the KV pool has {} blocks of {} positions, too few for {m} sequences of {n} tokens (use a larger -c)",
                    self.pool.total_blocks(),
                    self.pool.block_size()
                )));
            }
        }
        fn argmax(l: &[f32]) -> u32 {
            let mut best = 0;
            for (i, &v) in l.iter().enumerate() {
                if v > l[best] {
                    best = i;
                }
            }
            best as u32
        }
        let perr = |e: crate::dist::DistError| SessionError::Pipeline(e.to_string());
        let mut next: Vec<u32> = starts.to_vec();
        let mut out: Vec<Vec<u32>> = vec![Vec::with_capacity(n); m];
        let mut issued: std::collections::VecDeque<usize> = Default::default();
        let vocab = self.vocab;
        let take = |link: &mut PipelineLink,
                    issued: &mut std::collections::VecDeque<usize>,
                    next: &mut Vec<u32>,
                    out: &mut Vec<Vec<u32>>|
         -> Result<(), SessionError> {
            let Some(front) = issued.pop_front() else {
                return Ok(());
            };
            let l = link.recv_logits().map_err(perr)?;
            if l.width != vocab || l.rows != 1 {
                return Err(SessionError::Pipeline(format!(
                    "{} x {} logits came back for one sequence's step",
                    l.rows, l.width
                )));
            }
            let t = argmax(&l.data);
            next[front] = t;
            out[front].push(t);
            Ok(())
        };
        for i in 0..n {
            for j in 0..m {
                if let Some(link) = self.link.as_mut() {
                    // Sequence j's token from step i - 1 is due first.
                    while out[j].len() < i && !issued.is_empty() {
                        take(link, &mut issued, &mut next, &mut out)?;
                    }
                }
                self.batch.clear();
                self.batch.push(&[next[j]], i, &blocks[j]);
                let step = self.exec.step(&self.batch)?;
                match self.link.as_mut() {
                    None => {
                        let t = argmax(step.last());
                        next[j] = t;
                        out[j].push(t);
                    }
                    Some(link) => {
                        let h = StepHeader { want_logits: true };
                        link.forward(&h, &self.batch, step.data).map_err(perr)?;
                        issued.push_back(j);
                    }
                }
            }
        }
        if let Some(link) = self.link.as_mut() {
            while !issued.is_empty() {
                take(link, &mut issued, &mut next, &mut out)?;
            }
        }
        Ok(out)
    }

    /// Tokens already in the KV cache.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// The planned context: the most tokens the session's sequence holds.
    pub fn context(&self) -> usize {
        self.exec.context()
    }

    /// The KV cache's size and types, as `run`, `chat`, `bench` and `serve`
    /// print it at start: `KV cache: 2048 positions, keys f16, values f16,
    /// 45.0 MiB`.
    pub fn kv_summary(&self) -> String {
        let (k, v) = self
            .exec
            .kv_types()
            .map_or(("-".into(), "-".into()), |(k, v)| {
                (k.to_string(), v.to_string())
            });
        format!(
            "KV cache: {} positions, keys {k}, values {v}, {:.2} MiB{}",
            self.exec.kv_geom().capacity(),
            self.exec.kv_bytes() as f64 / 1048576.0,
            if self.stage.is_some() {
                " (this stage's layers)"
            } else {
                ""
            }
        )
    }

    /// The vocabulary size: the length of a logits row.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// Starts over: the sequence's KV blocks go back to the pool.
    pub fn reset(&mut self) {
        self.pos = 0;
        self.pool.release(&mut self.blocks);
    }

    /// Forgets every cached position from `pos` on (to re-feed a changed
    /// suffix, as a chat does when the template re-renders a turn).
    pub fn rewind(&mut self, pos: usize) {
        self.pos = self.pos.min(pos);
        self.pool.truncate(&mut self.blocks, self.pos);
    }

    /// Feeds `tokens` (at most the batch size) as one step and returns all
    /// of the step's logits: one row per token with `LogitRows::All`, the
    /// last token's with `LogitRows::Last`.
    pub fn feed_step(&mut self, tokens: &[u32]) -> Result<crate::exec::Logits<'_>, SessionError> {
        if tokens.len() > self.exec.max_chunk() {
            return Err(ExecError::StepSize {
                got: tokens.len(),
                max: self.exec.max_chunk(),
            }
            .into());
        }
        self.check_and_reserve(tokens)?;
        self.batch.clear();
        self.batch.push(tokens, self.pos, &self.blocks);
        self.pos += tokens.len();
        Ok(self.exec.step(&self.batch)?)
    }

    /// Feeds `tokens` (at most the batch size) as one step that asks for
    /// the logits of its last `rows` tokens (1 to `tokens.len()`), as
    /// verifying drafted tokens does: the step is an ordinary step of the
    /// graph whose `LastRows` returns `rows` rows for this sequence. The
    /// session must be compiled with `LogitRows::Tail { max }`, `max >=
    /// rows` (with `All` every token's row comes back). Returns the rows,
    /// in position order.
    pub fn feed_rows(&mut self, tokens: &[u32], rows: usize) -> Result<Logits<'_>, SessionError> {
        if tokens.len() > self.exec.max_chunk() {
            return Err(ExecError::StepSize {
                got: tokens.len(),
                max: self.exec.max_chunk(),
            }
            .into());
        }
        self.check_and_reserve(tokens)?;
        self.batch.clear();
        self.batch.push_rows(tokens, self.pos, &self.blocks, rows);
        self.pos += tokens.len();
        run_step(
            &mut self.exec,
            self.link.as_mut(),
            &mut self.remote_logits,
            self.vocab,
            &self.batch,
            true,
        )?
        .ok_or_else(|| SessionError::Pipeline("no logits came back".into()))
    }

    /// Checks that `tokens` fit after the current position and are in the
    /// vocabulary, and takes the KV blocks they need.
    fn check_and_reserve(&mut self, tokens: &[u32]) -> Result<(), SessionError> {
        if tokens.is_empty() {
            return Err(SessionError::Invalid("nothing to feed".into()));
        }
        if self.pos + tokens.len() > self.context() {
            return Err(ExecError::ContextOverflow {
                tokens: tokens.len(),
                pos: self.pos,
                context: self.context(),
            }
            .into());
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= self.vocab) {
            return Err(SessionError::Invalid(format!(
                "token id {bad} is outside the vocabulary of {}",
                self.vocab
            )));
        }
        if !self.pool.reserve(&mut self.blocks, self.pos + tokens.len()) {
            return Err(SessionError::Invalid(format!(
                "the KV pool has {} free blocks of {} positions, too few for {} more tokens",
                self.pool.free_blocks(),
                self.pool.block_size(),
                tokens.len()
            )));
        }
        Ok(())
    }

    /// Feeds `tokens` in chunks of at most the batch size and returns the
    /// logits of the last one. Fails before any work if they do not fit.
    pub fn feed(&mut self, tokens: &[u32]) -> Result<&[f32], SessionError> {
        self.check_and_reserve(tokens)?;
        let chunk = self.exec.max_chunk();
        let n_chunks = tokens.len().div_ceil(chunk);
        let mut chunks = tokens.chunks(chunk);
        for c in chunks.by_ref().take(n_chunks - 1) {
            self.batch.clear();
            self.batch.push(c, self.pos, &self.blocks);
            self.pos += c.len();
            self.run_batch(false)?;
        }
        let c = chunks.next().unwrap_or_default();
        self.batch.clear();
        self.batch.push(c, self.pos, &self.blocks);
        self.pos += c.len();
        self.run_batch(true)?
            .ok_or_else(|| SessionError::Pipeline("no logits came back".into()))
    }
}

/// One step of `batch` here (`link` None), or as stage 0 of a pipeline:
/// stage 0's output goes on and, when `want_logits`, the last stage's
/// logits come back into `remote` (checked: rows of `vocab`, one per
/// sequence of the step).
fn run_step<'a>(
    exec: &'a mut Executor,
    link: Option<&mut PipelineLink>,
    remote: &'a mut Vec<f32>,
    vocab: usize,
    batch: &Batch,
    want_logits: bool,
) -> Result<Option<Logits<'a>>, SessionError> {
    let Some(link) = link else {
        return Ok(Some(exec.step(batch)?));
    };
    let out = exec.step(batch)?;
    let perr = |e: crate::dist::DistError| SessionError::Pipeline(e.to_string());
    link.forward(&StepHeader { want_logits }, batch, out.data)
        .map_err(perr)?;
    if !want_logits {
        return Ok(None);
    }
    let l = link.recv_logits().map_err(perr)?;
    if l.width != vocab || l.rows == 0 || l.rows > batch.n_tokens() {
        return Err(SessionError::Pipeline(format!(
            "the last stage sent {} x {} logits for a step of {} sequences and {} tokens, expected rows of {}",
            l.rows,
            l.width,
            batch.n_seqs(),
            batch.n_tokens(),
            vocab
        )));
    }
    *remote = l.data;
    Ok(Some(Logits {
        rows: l.rows,
        vocab: l.width,
        data: remote,
    }))
}
