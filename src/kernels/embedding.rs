//! Token embedding lookup.

use super::{check_len, mul_dims, KernelError, WeightRef};

/// `out[i, :] = table[ids[i], :]` converted to f32; `table` is
/// `[vocab, dim]` (F32/F16/BF16). Ids outside `0..vocab` give
/// [`KernelError::IdOutOfRange`].
pub fn embedding_rows<I: Copy + Into<i64>>(
    table: WeightRef<'_>,
    vocab: usize,
    dim: usize,
    ids: &[I],
    out: &mut [f32],
) -> Result<(), KernelError> {
    const OP: &str = "embedding_rows";
    let compressed = if table.dtype == crate::ir::DType::BF16Z {
        Some(super::matmul::bf16z::Bf16z::parse(table.bytes, vocab, dim)?)
    } else {
        table.check_elems(OP, mul_dims(OP, "vocab*dim overflows", vocab, dim)?)?;
        None
    };
    check_len(
        OP,
        "out elements (ids*dim)",
        mul_dims(OP, "ids*dim overflows", ids.len(), dim)?,
        out.len(),
    )?;
    // Check every id before writing anything.
    for (index, &id) in ids.iter().enumerate() {
        let id: i64 = id.into();
        if id < 0 || id as u64 >= vocab as u64 {
            return Err(KernelError::IdOutOfRange {
                op: OP,
                id,
                index,
                rows: vocab,
            });
        }
    }
    if dim == 0 {
        return Ok(());
    }
    for (&id, row) in ids.iter().zip(out.chunks_exact_mut(dim)) {
        let id: i64 = id.into();
        match &compressed {
            Some(z) => z.decode_row_f32(id as usize, row),
            None => table.read_into(id as usize * dim, row),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::DType;
    use crate::kernels::testutil::{decoded, encode, Rng};

    #[test]
    fn rows_and_bounds() {
        let mut rng = Rng::new(30);
        let (vocab, dim) = (49, 576);
        let t = rng.vec(vocab * dim);
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let b = encode(&t, dtype);
            let td = decoded(&t, dtype);
            let ids: Vec<u32> = vec![0, 48, 7, 7];
            let mut out = vec![0.0; ids.len() * dim];
            embedding_rows(WeightRef::new(dtype, &b), vocab, dim, &ids, &mut out).unwrap();
            for (i, &id) in ids.iter().enumerate() {
                assert_eq!(
                    &out[i * dim..(i + 1) * dim],
                    &td[id as usize * dim..(id as usize + 1) * dim]
                );
            }
            let e = embedding_rows(
                WeightRef::new(dtype, &b),
                vocab,
                dim,
                &[3i32, 49],
                &mut out[..2 * dim],
            )
            .unwrap_err();
            assert_eq!(
                e,
                KernelError::IdOutOfRange {
                    op: "embedding_rows",
                    id: 49,
                    index: 1,
                    rows: 49
                }
            );
            assert!(embedding_rows(
                WeightRef::new(dtype, &b),
                vocab,
                dim,
                &[-1i32],
                &mut out[..dim]
            )
            .is_err());
            assert!(embedding_rows(
                WeightRef::new(dtype, &b[1..]),
                vocab,
                dim,
                &[0i32],
                &mut out[..dim]
            )
            .is_err());
        }
    }
}
