//! Opening a Meta checkpoint directory: `params.json`, the
//! `consolidated.*.pth` shards (merged) and `tokenizer.model`.

use super::{LoadError, Model, ModelFormat, TensorSelector};
use crate::exec::store_dtypes;
use crate::model::ModelArgs;
use crate::weights::pth::{load_meta_checkpoint, merge_shards, open_pth, shard_paths};
use crate::weights::WeightStore;
use std::path::Path;

impl Model {
    /// Opens a Meta checkpoint directory.
    pub fn open_meta_dir(dir: &Path) -> Result<Model, LoadError> {
        Model::open_meta_dir_with(dir, None)
    }

    pub(super) fn open_meta_dir_with(
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
