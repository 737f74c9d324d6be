//! Writing new keys or values into one layer's KV cache `[C, Hkv, D]`.

use super::{check_len, mul_dims, KernelError};

/// Copies `x` (`[s, row]`, `row = n_kv_heads * head_dim`) into rows
/// `pos..pos+s` of `cache` (`[capacity, row]`). Returns
/// [`KernelError::CacheOverflow`] if `pos + s > capacity`.
pub fn kv_write_rows(
    cache: &mut [f32],
    capacity: usize,
    row: usize,
    pos: usize,
    x: &[f32],
    s: usize,
) -> Result<(), KernelError> {
    const OP: &str = "kv_write";
    check_len(
        OP,
        "cache elements",
        mul_dims(OP, "cache size overflows", capacity, row)?,
        cache.len(),
    )?;
    check_len(
        OP,
        "x elements",
        mul_dims(OP, "s*row overflows", s, row)?,
        x.len(),
    )?;
    match pos.checked_add(s) {
        Some(end) if end <= capacity => {}
        _ => {
            return Err(KernelError::CacheOverflow {
                pos,
                len: s,
                capacity,
            })
        }
    }
    cache[pos * row..(pos + s) * row].copy_from_slice(x);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_rows_and_checks_bounds() {
        let (c, row) = (5, 6);
        let mut kc = vec![0.0; c * row];
        let k: Vec<f32> = (0..2 * row).map(|i| i as f32 + 1.0).collect();
        kv_write_rows(&mut kc, c, row, 3, &k, 2).unwrap();
        assert!(kc[..3 * row].iter().all(|&x| x == 0.0));
        assert_eq!(&kc[3 * row..], &k[..]);
        let e = kv_write_rows(&mut kc, c, row, 4, &k, 2).unwrap_err();
        assert!(matches!(
            e,
            KernelError::CacheOverflow {
                pos: 4,
                len: 2,
                capacity: 5
            }
        ));
        assert!(kv_write_rows(&mut kc, c, row, usize::MAX, &k, 2).is_err());
        assert!(kv_write_rows(&mut kc, c, row, 0, &k[1..], 2).is_err());
    }
}
