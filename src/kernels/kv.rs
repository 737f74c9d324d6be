//! Writing new keys/values into a per-layer KV cache `[C, Hkv, D]`.

use super::{check_len, mul_dims, KernelError};

/// Copies `k`, `v` (`[s, n_kv_heads, head_dim]`) into rows `pos..pos+s` of
/// `k_cache`, `v_cache` (`[capacity, n_kv_heads, head_dim]`). Returns
/// [`KernelError::CacheOverflow`] if `pos + s > capacity`.
#[allow(clippy::too_many_arguments)]
pub fn kv_write(
    k_cache: &mut [f32],
    v_cache: &mut [f32],
    capacity: usize,
    n_kv_heads: usize,
    head_dim: usize,
    pos: usize,
    k: &[f32],
    v: &[f32],
    s: usize,
) -> Result<(), KernelError> {
    const OP: &str = "kv_write";
    let row = mul_dims(OP, "n_kv_heads*head_dim overflows", n_kv_heads, head_dim)?;
    let cache_len = mul_dims(OP, "cache size overflows", capacity, row)?;
    check_len(OP, "k cache elements", cache_len, k_cache.len())?;
    check_len(OP, "v cache elements", cache_len, v_cache.len())?;
    let n = mul_dims(OP, "s*row overflows", s, row)?;
    check_len(OP, "k elements", n, k.len())?;
    check_len(OP, "v elements", n, v.len())?;
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
    k_cache[pos * row..pos * row + n].copy_from_slice(k);
    v_cache[pos * row..pos * row + n].copy_from_slice(v);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_rows_and_checks_bounds() {
        let (c, h, d) = (5, 2, 3);
        let mut kc = vec![0.0; c * h * d];
        let mut vc = vec![0.0; c * h * d];
        let k: Vec<f32> = (0..2 * h * d).map(|i| i as f32 + 1.0).collect();
        let v: Vec<f32> = k.iter().map(|x| -x).collect();
        kv_write(&mut kc, &mut vc, c, h, d, 3, &k, &v, 2).unwrap();
        assert!(kc[..3 * h * d].iter().all(|&x| x == 0.0));
        assert_eq!(&kc[3 * h * d..], &k[..]);
        assert_eq!(&vc[3 * h * d..], &v[..]);
        let e = kv_write(&mut kc, &mut vc, c, h, d, 4, &k, &v, 2).unwrap_err();
        assert!(matches!(
            e,
            KernelError::CacheOverflow {
                pos: 4,
                len: 2,
                capacity: 5
            }
        ));
        assert!(kv_write(&mut kc, &mut vc, c, h, d, usize::MAX, &k, &v, 2).is_err());
        assert!(kv_write(&mut kc, &mut vc, c, h, d, 0, &k[1..], &v, 2).is_err());
    }
}
