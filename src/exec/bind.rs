//! Binding the graph's weight nodes to loaded tensors.

use crate::ir::{DType, Graph, Op, WeightLayout};
use crate::weights::{TensorBytes, WeightStore, WeightTensor};
use std::collections::BTreeMap;
use std::sync::Arc;
use thiserror::Error;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum BindError {
    #[error("missing tensor `{tensor}` (the graph expects {expected})")]
    Missing { tensor: String, expected: String },
    #[error("tensor `{tensor}` has shape {actual:?}, expected {expected:?}")]
    Shape {
        tensor: String,
        expected: Vec<usize>,
        actual: Vec<usize>,
    },
    #[error("tensor `{tensor}` has dtype {actual}, expected {expected}")]
    DType {
        tensor: String,
        expected: DType,
        actual: DType,
    },
    #[error("packed weight `{packed}`: {message}")]
    Packed { packed: String, message: String },
    #[error("tensor `{tensor}` holds {actual} bytes, but {dtype}{shape:?} needs {expected}")]
    Size {
        tensor: String,
        dtype: DType,
        shape: Vec<usize>,
        expected: usize,
        actual: usize,
    },
}

/// The weights a graph reads, by checkpoint name, plus the names of the
/// tensors in the store that it does not read.
#[derive(Debug, Clone)]
pub struct BoundWeights {
    pub tensors: BTreeMap<String, WeightTensor>,
    pub unused: Vec<String>,
}

/// Finds every weight node's tensor by name and checks its shape, dtype and
/// byte size. Every failure names the tensor, what was expected and what
/// was found.
pub fn bind_weights(graph: &Graph, store: &WeightStore) -> Result<BoundWeights, BindError> {
    let mut tensors = BTreeMap::new();
    for id in graph.topo_order().expect("a verified graph is acyclic") {
        let node = graph.node(id);
        let Op::Weight { tensor } = &node.op else {
            continue;
        };
        let expected: Vec<usize> = node
            .meta
            .shape
            .dims()
            .iter()
            .map(|d| d.as_const().unwrap_or(0))
            .collect();
        let t = store
            .tensors
            .get(tensor)
            .ok_or_else(|| BindError::Missing {
                tensor: tensor.clone(),
                expected: format!("{}", node.meta),
            })?;
        if t.shape != expected {
            return Err(BindError::Shape {
                tensor: tensor.clone(),
                expected,
                actual: t.shape.clone(),
            });
        }
        if t.dtype != node.meta.dtype {
            return Err(BindError::DType {
                tensor: tensor.clone(),
                expected: node.meta.dtype,
                actual: t.dtype,
            });
        }
        let numel: usize = expected.iter().product();
        let want = t.dtype.bytes_for(numel);
        // A BF16Z tensor's exception table follows its blocks (its layout is
        // checked in full where it is read: `kernels::bf16z::Bf16z::parse`).
        let fits = match want {
            Some(w) if t.dtype == DType::BF16Z => t.data.len() >= w,
            w => w == Some(t.data.len()),
        };
        if !fits {
            return Err(BindError::Size {
                tensor: tensor.clone(),
                dtype: t.dtype,
                shape: expected,
                expected: want.unwrap_or(usize::MAX),
                actual: t.data.len(),
            });
        }
        tensors.insert(tensor.clone(), t.clone());
    }
    let unused = store
        .tensors
        .keys()
        .filter(|k| !tensors.contains_key(*k))
        .cloned()
        .collect();
    Ok(BoundWeights { tensors, unused })
}

/// One packed weight, checked, before its bytes are placed.
struct PackPlan<'a> {
    name: &'a str,
    dtype: DType,
    shape: Vec<usize>,
    parts: Vec<&'a WeightTensor>,
    bytes: usize,
    /// The arena's dtype: `dtype` (a byte copy) or BF16Z.
    stored: DType,
    /// For BF16Z storage: each row's exception count (see
    /// [`crate::kernels::bf16z`]).
    counts: Vec<u32>,
    /// How the rows are stored in the arena.
    layout: WeightLayout,
}

impl PackPlan<'_> {
    /// Releases the pages of the files the parts are mapped from, after a
    /// chunk of them was copied (see [`TensorBytes::release_mapping`]: the
    /// whole mapping, since a fault may map again pages of tensors copied
    /// earlier). Pages still to be copied come back on their next read.
    fn release_sources(&self) {
        for part in &self.parts {
            part.data.release_mapping();
        }
    }

    /// Row `r` of the concatenated parts (rows of `row_bytes`).
    fn row(&self, r: usize, row_bytes: usize) -> &[u8] {
        let mut r = r;
        for part in &self.parts {
            let rows = part.shape[0];
            if r < rows {
                return &part.data.as_bytes()[r * row_bytes..(r + 1) * row_bytes];
            }
            r -= rows;
        }
        &[]
    }
}

/// Alignment of each packed weight inside the arena (a cache line).
const ARENA_ALIGN: usize = 64;
/// Bytes copied between two releases of the source pages, so that the
/// resident size grows by at most this much while the arena fills.
const COPY_CHUNK: usize = 1 << 20;

/// Materialises the graph's packed weights (see
/// [`crate::ir::PackedWeight`]) once, into one weight arena: an anonymous
/// mapping, backed by transparent huge pages where the kernel grants them,
/// so that kernels stream weights without a TLB miss and a prefetcher
/// restart every 4 KiB. Each packed weight is the byte concatenation of its
/// parts' whole rows (axis 0), which is exact for every dtype, quantized
/// block formats included. The pages of the mapped parts are released as
/// they are copied (they are clean file pages), so the resident size does
/// not grow by more than one copy chunk. A one-part packed weight whose
/// bytes are already owned is shared, not copied. Returns a store with the
/// packed tensors added (the parts stay readable; other tensors are shared).
pub fn materialize_packed(graph: &Graph, store: &WeightStore) -> Result<WeightStore, BindError> {
    let mut plans = Vec::new();
    for p in graph.packed() {
        let err = |message: String| BindError::Packed {
            packed: p.name.clone(),
            message,
        };
        if p.axis != 0 {
            return Err(err(format!("only axis 0 is supported, got {}", p.axis)));
        }
        let mut rows = 0usize;
        let mut cols = None;
        let mut dtype = None;
        let mut total = 0usize;
        let mut parts = Vec::new();
        for part in &p.parts {
            let t = store.tensors.get(part).ok_or_else(|| BindError::Missing {
                tensor: part.clone(),
                expected: format!("a part of `{}`", p.name),
            })?;
            if t.shape.len() != 2 {
                return Err(err(format!(
                    "part `{part}` has shape {:?}, not 2-D",
                    t.shape
                )));
            }
            if cols.is_some_and(|c| c != t.shape[1]) || dtype.is_some_and(|d| d != t.dtype) {
                return Err(err(format!(
                    "part `{part}` is {}{:?}, unlike the first part",
                    t.dtype, t.shape
                )));
            }
            let want = t
                .shape
                .iter()
                .try_fold(1usize, |a, &d| a.checked_mul(d))
                .and_then(|n| t.dtype.bytes_for(n));
            if want != Some(t.data.len()) {
                return Err(BindError::Size {
                    tensor: part.clone(),
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                    expected: want.unwrap_or(usize::MAX),
                    actual: t.data.len(),
                });
            }
            cols = Some(t.shape[1]);
            dtype = Some(t.dtype);
            rows = rows
                .checked_add(t.shape[0])
                .ok_or_else(|| err("row count overflows".into()))?;
            total = total
                .checked_add(t.data.len())
                .ok_or_else(|| err("size overflows".into()))?;
            parts.push(t);
        }
        let (Some(cols), Some(dtype)) = (cols, dtype) else {
            return Err(err("no parts".into()));
        };
        let mut plan = PackPlan {
            name: &p.name,
            dtype,
            shape: vec![rows, cols],
            parts,
            bytes: total,
            stored: p.stored_as.unwrap_or(dtype),
            counts: Vec::new(),
            layout: p.layout,
        };
        if p.layout == WeightLayout::X8
            && (p.stored_as.is_some()
                || !crate::kernels::quantized::fast::x8::supports(dtype, rows, cols))
        {
            return Err(err(format!(
                "{dtype}[{rows}, {cols}] cannot be stored with rows interleaved by 8"
            )));
        }
        match p.stored_as {
            None => {}
            Some(DType::BF16Z) if dtype == DType::BF16 => {
                use crate::kernels::matmul::bf16z;
                if cols == 0 || !cols.is_multiple_of(bf16z::BLOCK) {
                    return Err(err(format!("{cols} columns are not a multiple of 32")));
                }
                let rb = cols * 2;
                let release = |_, _| plan.release_sources();
                plan.counts = bf16z::exception_counts(&|r| plan.row(r, rb), rows, cols, &release);
                plan.release_sources();
                let exceptions = plan.counts.iter().map(|&c| c as usize).sum();
                plan.bytes = bf16z::encoded_len(rows, cols, exceptions)
                    .ok_or_else(|| err("size overflows".into()))?;
            }
            Some(other) => {
                return Err(err(format!("cannot store {dtype} parts as {other}")));
            }
        }
        plans.push(plan);
    }
    let shared = |p: &PackPlan| {
        p.parts.len() == 1
            && p.stored == p.dtype
            && p.layout == WeightLayout::Rows
            && matches!(p.parts[0].data, TensorBytes::Owned(_))
    };
    // Offsets in the arena. Every size was checked against bytes that exist,
    // so the sum is bounded by the store's size.
    let mut offsets = Vec::with_capacity(plans.len());
    let mut arena_len = 0usize;
    for p in &plans {
        if shared(p) {
            offsets.push(0);
            continue;
        }
        let at = arena_len.next_multiple_of(ARENA_ALIGN);
        offsets.push(at);
        arena_len = at.checked_add(p.bytes).ok_or_else(|| BindError::Packed {
            packed: p.name.to_string(),
            message: "the weight arena's size overflows".into(),
        })?;
    }
    let arena = fill_arena(&plans, &offsets, arena_len, shared).map_err(|e| BindError::Packed {
        packed: "(weight arena)".into(),
        message: format!("cannot map or fill {arena_len} bytes of anonymous memory: {e}"),
    })?;
    let mut out = store.clone();
    for (p, &offset) in plans.iter().zip(&offsets) {
        let data = if shared(p) {
            p.parts[0].data.clone()
        } else {
            TensorBytes::Arena {
                map: arena.clone(),
                offset,
                len: p.bytes,
            }
        };
        out.tensors.insert(
            p.name.to_string(),
            WeightTensor {
                dtype: p.stored,
                shape: p.shape.clone(),
                data,
            },
        );
    }
    copy_out_small_mapped(graph, &mut out);
    Ok(out)
}

/// Largest weight [`copy_out_small_mapped`] copies out of its file mapping.
const SMALL_WEIGHT: usize = 64 << 10;

/// Copies the small weights the graph reads straight from a mapped file
/// (the norm weights) into owned memory, then releases their mappings once
/// more. A read of a few bytes of a mapping maps the pages around them too
/// (fault-around, or a whole large folio of the page cache), so reading the
/// norm weights that lie between a layer's matrices in the file would bring
/// the released pages of those matrices back into the resident set: with a
/// cold page cache, 35 MiB of SmolLM2's 138 MiB Q6_K GGUF stayed resident
/// beside the arena that holds the same bytes.
fn copy_out_small_mapped(graph: &Graph, store: &mut WeightStore) {
    for id in graph.topo_order().expect("a verified graph is acyclic") {
        let Op::Weight { tensor } = &graph.node(id).op else {
            continue;
        };
        let Some(t) = store.tensors.get_mut(tensor) else {
            continue;
        };
        if matches!(t.data, TensorBytes::Mapped { .. }) && t.data.len() <= SMALL_WEIGHT {
            let owned = TensorBytes::Owned(Arc::new(t.data.as_bytes().to_vec()));
            std::mem::replace(&mut t.data, owned).release_mapping();
        }
    }
}

/// Maps the arena, copies every non-shared packed weight into it at its
/// offset, releasing the source pages chunk by chunk, and makes it read-only.
fn fill_arena(
    plans: &[PackPlan],
    offsets: &[usize],
    len: usize,
    shared: impl Fn(&PackPlan) -> bool,
) -> std::io::Result<Arc<memmap2::Mmap>> {
    let mut map = memmap2::MmapOptions::new().len(len.max(1)).map_anon()?;
    // Advice only: without transparent huge pages the arena is made of
    // ordinary pages and everything works the same, a little slower.
    #[cfg(target_os = "linux")]
    let _ = map.advise(memmap2::Advice::HugePage);
    for (p, &offset) in plans.iter().zip(offsets) {
        if shared(p) {
            continue;
        }
        if p.stored == DType::BF16Z {
            let (rows, cols) = (p.shape[0], p.shape[1]);
            let out = &mut map[offset..offset + p.bytes];
            let release = |_, _| p.release_sources();
            crate::kernels::matmul::bf16z::encode_into(
                &|r| p.row(r, cols * 2),
                rows,
                cols,
                &p.counts,
                out,
                &release,
            )
            .map_err(|e| std::io::Error::other(e.to_string()))?;
            p.release_sources();
            continue;
        }
        if p.layout == WeightLayout::X8 {
            // Whole groups of 8 rows, about a copy chunk at a time: gathered
            // (a group may span two parts), interleaved into the arena, and
            // their source pages released.
            use crate::kernels::quantized::fast::x8;
            let (rows, cols) = (p.shape[0], p.shape[1]);
            let rb = p.dtype.bytes_for(cols).unwrap_or(0);
            let per = (COPY_CHUNK / (x8::G * rb).max(1)).max(1) * x8::G;
            let mut tmp = Vec::with_capacity(per * rb);
            let mut r0 = 0;
            while r0 < rows {
                let r1 = (r0 + per).min(rows);
                tmp.clear();
                for r in r0..r1 {
                    tmp.extend_from_slice(p.row(r, rb));
                }
                let out = &mut map[offset + r0 * rb..offset + r1 * rb];
                x8::repack(p.dtype, &tmp, rb, out);
                p.release_sources();
                r0 = r1;
            }
            continue;
        }
        let mut at = offset;
        for part in &p.parts {
            let src = part.data.as_bytes();
            let mut done = 0;
            while done < src.len() {
                let end = (done + COPY_CHUNK).min(src.len());
                map[at..at + end - done].copy_from_slice(&src[done..end]);
                at += end - done;
                // The arena holds these bytes now; the graph reads the copy.
                part.data.release_mapping();
                done = end;
            }
        }
    }
    Ok(Arc::new(map.make_read_only()?))
}

/// The weight dtypes of a store, for building a graph that matches it.
pub fn store_dtypes(store: &WeightStore) -> BTreeMap<String, DType> {
    store
        .tensors
        .iter()
        .map(|(k, t)| (k.clone(), t.dtype))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Op, PackedWeight, Shape, TensorMeta};
    use std::io::Write;

    fn mapped(map: &Arc<memmap2::Mmap>, offset: usize, rows: usize, cols: usize) -> WeightTensor {
        WeightTensor {
            dtype: DType::F32,
            shape: vec![rows, cols],
            data: TensorBytes::Mapped {
                map: map.clone(),
                offset,
                len: rows * cols * 4,
            },
        }
    }

    fn graph_with(packed: &[(&str, &[&str], usize)], cols: usize) -> Graph {
        let mut g = Graph::new();
        for (name, parts, rows) in packed {
            g.add_source(
                *name,
                Op::Weight {
                    tensor: name.to_string(),
                },
                TensorMeta::new(Shape::constant(&[*rows, cols]), DType::F32),
                None,
            )
            .unwrap();
            g.add_packed(PackedWeight {
                name: name.to_string(),
                parts: parts.iter().map(|p| p.to_string()).collect(),
                axis: 0,
                stored_as: None,
                layout: Default::default(),
            });
        }
        g
    }

    /// Packed weights land in the arena as the byte concatenation of their
    /// parts, aligned; the mapped parts still read the same bytes after
    /// their pages were released; owned one-part weights are shared.
    #[test]
    fn packed_weights_fill_the_arena_exactly() {
        let cols = 1000; // rows of 4000 bytes: copies cross page boundaries
        let bytes: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(&bytes).unwrap();
        // SAFETY: a private temporary file nobody else writes.
        let map = Arc::new(unsafe { memmap2::Mmap::map(&f).unwrap() });
        let owned = Arc::new(bytes[..8 * cols * 4].to_vec());
        let mut store = WeightStore::default();
        store.tensors.insert("a".into(), mapped(&map, 0, 300, cols));
        store
            .tensors
            .insert("b".into(), mapped(&map, 1_200_000, 200, cols));
        store.tensors.insert(
            "c".into(),
            WeightTensor {
                dtype: DType::F32,
                shape: vec![8, cols],
                data: TensorBytes::Owned(owned.clone()),
            },
        );
        let g = graph_with(
            &[
                ("ab", &["a", "b"], 500),
                ("c.packed", &["c"], 8),
                ("b.packed", &["b"], 200),
            ],
            cols,
        );
        let out = materialize_packed(&g, &store).unwrap();
        let ab = &out.tensors["ab"];
        assert_eq!(ab.shape, vec![500, cols]);
        assert!(matches!(ab.data, TensorBytes::Arena { .. }));
        let want: Vec<u8> = [&bytes[..1_200_000], &bytes[1_200_000..2_000_000]].concat();
        assert!(ab.data.as_bytes() == &want[..]);
        let b = &out.tensors["b.packed"];
        assert!(b.data.as_bytes() == &bytes[1_200_000..2_000_000]);
        for t in [ab, b] {
            let TensorBytes::Arena { offset, .. } = t.data else {
                panic!("not in the arena")
            };
            assert_eq!(offset % ARENA_ALIGN, 0);
        }
        match &out.tensors["c.packed"].data {
            TensorBytes::Owned(v) => assert!(Arc::ptr_eq(v, &owned)),
            other => panic!("owned one-part weight copied: {other:?}"),
        }
        // The released originals still read back unchanged.
        assert!(out.tensors["a"].data.as_bytes() == &bytes[..1_200_000]);
        assert!(store.tensors["b"].data.as_bytes() == &bytes[1_200_000..2_000_000]);
    }

    /// Small weights the graph reads from a mapped file are copied out (a
    /// read of them would map their neighbours' released pages again);
    /// large ones and weights the graph does not read stay views.
    #[test]
    fn small_mapped_weights_are_copied_out() {
        let bytes: Vec<u8> = (0..1_000_000u32).map(|i| (i * 13 % 249) as u8).collect();
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(&bytes).unwrap();
        // SAFETY: a private temporary file nobody else writes.
        let map = Arc::new(unsafe { memmap2::Mmap::map(&f).unwrap() });
        let mut store = WeightStore::default();
        store
            .tensors
            .insert("norm".into(), mapped(&map, 4000, 1, 576));
        store
            .tensors
            .insert("big".into(), mapped(&map, 8192, 200, 1000));
        store
            .tensors
            .insert("unread".into(), mapped(&map, 0, 1, 16));
        let mut g = Graph::new();
        for (name, shape) in [("norm", [1, 576]), ("big", [200, 1000])] {
            g.add_source(
                name,
                Op::Weight {
                    tensor: name.to_string(),
                },
                TensorMeta::new(Shape::constant(&shape), DType::F32),
                None,
            )
            .unwrap();
        }
        let out = materialize_packed(&g, &store).unwrap();
        let norm = &out.tensors["norm"];
        assert!(matches!(norm.data, TensorBytes::Owned(_)));
        assert!(norm.data.as_bytes() == &bytes[4000..4000 + 576 * 4]);
        assert!(matches!(
            out.tensors["big"].data,
            TensorBytes::Mapped { .. }
        ));
        assert!(out.tensors["big"].data.as_bytes() == &bytes[8192..8192 + 800_000]);
        assert!(matches!(
            out.tensors["unread"].data,
            TensorBytes::Mapped { .. }
        ));
    }

    #[test]
    fn packed_parts_must_agree() {
        let mut store = WeightStore::default();
        for (name, cols) in [("x", 4usize), ("y", 5)] {
            store.tensors.insert(
                name.into(),
                WeightTensor {
                    dtype: DType::F32,
                    shape: vec![2, cols],
                    data: TensorBytes::Owned(Arc::new(vec![0; 2 * cols * 4])),
                },
            );
        }
        let g = graph_with(&[("xy", &["x", "y"], 4)], 4);
        let e = materialize_packed(&g, &store).unwrap_err().to_string();
        assert!(
            e.contains("packed weight `xy`") && e.contains("unlike the first part"),
            "{e}"
        );
        let g = graph_with(&[("xz", &["x", "z"], 4)], 4);
        let e = materialize_packed(&g, &store).unwrap_err().to_string();
        assert!(e.contains("missing tensor `z`"), "{e}");
    }
}
