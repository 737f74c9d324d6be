//! Attention over the paged pool: both forms against a straightforward f64
//! reference, and the fused kernel's batch invariance (a row's result is
//! bitwise the same whatever else is in the step, however the queries are
//! grouped and on any number of threads).

use super::*;
use crate::kernels::kv::{kv_write_rows, CacheType, KvHalf, KvStore};
use crate::kernels::testutil::{assert_close, Rng};
use crate::kernels::Isa;

/// A pool with random keys and values.
struct Pool {
    geom: KvGeom,
    n_rep: usize,
    k: KvStore,
    v: KvStore,
}

impl Pool {
    /// Random keys and values written through the cache's own writes (so
    /// stored as `ty` stores them).
    fn new(n_blocks: usize, hkv: usize, d: usize, n_rep: usize, ty: CacheType, seed: u64) -> Pool {
        Pool::with_block(16, n_blocks, hkv, d, n_rep, ty, seed)
    }
    /// [`Pool::new`] with blocks of `block` positions.
    fn with_block(
        block: usize,
        n_blocks: usize,
        hkv: usize,
        d: usize,
        n_rep: usize,
        ty: CacheType,
        seed: u64,
    ) -> Pool {
        let geom = KvGeom {
            n_blocks,
            n_kv_heads: hkv,
            head_dim: d,
            block,
        };
        let mut rng = Rng::new(seed);
        let slots: Vec<i32> = (0..geom.capacity() as i32).collect();
        let mut fill = |half, run| {
            let mut c = KvStore::new(ty, geom.elems(), run).unwrap();
            kv_write_rows(&mut c, half, &geom, &slots, &rng.vec(geom.elems())).unwrap();
            c
        };
        let (k, v) = (fill(KvHalf::K, geom.block), fill(KvHalf::V, 1));
        Pool { geom, n_rep, k, v }
    }
    fn h(&self) -> usize {
        self.geom.n_kv_heads * self.n_rep
    }
}

/// A sequence: its blocks in the pool and its length.
#[derive(Clone)]
struct Seq {
    blocks: Vec<i32>,
}

/// Gives `n` sequences disjoint, shuffled blocks, `per` each.
fn seqs_in(pool: &Pool, n: usize, per: usize, seed: u64) -> Vec<Seq> {
    let mut ids: Vec<i32> = (0..pool.geom.n_blocks as i32).collect();
    let mut rng = Rng::new(seed);
    for i in (1..ids.len()).rev() {
        ids.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
    }
    assert!(n * per <= ids.len());
    (0..n)
        .map(|j| Seq {
            blocks: ids[j * per..(j + 1) * per].to_vec(),
        })
        .collect()
}

/// One step: (sequence, start position, query count) in step order.
struct Step {
    table: Vec<i32>,
    blocks: Vec<i32>,
    tokens: usize,
}

fn step(seqs: &[Seq], parts: &[(usize, usize, usize)]) -> Step {
    let (mut table, mut blocks, mut first) = (Vec::new(), Vec::new(), 0);
    for &(j, start, count) in parts {
        table.extend([
            first as i32,
            count as i32,
            start as i32,
            blocks.len() as i32,
            1,
        ]);
        blocks.extend(&seqs[j].blocks);
        first += count;
    }
    Step {
        table,
        blocks,
        tokens: first,
    }
}

/// Query rows for every (sequence, position): deterministic per
/// (sequence, position), so the same query appears in every grouping.
fn q_of(pool: &Pool, j: usize, p: usize) -> Vec<f32> {
    let mut rng = Rng::new(1000 * j as u64 + p as u64 + 7);
    rng.vec(pool.h() * pool.geom.head_dim)
        .iter()
        .map(|x| x * 4.0)
        .collect()
}

fn q_for(pool: &Pool, parts: &[(usize, usize, usize)]) -> Vec<f32> {
    let mut q = Vec::new();
    for &(j, start, count) in parts {
        for p in start..start + count {
            q.extend(q_of(pool, j, p));
        }
    }
    q
}

/// Causal attention of the step in f64.
fn naive(pool: &Pool, q: &[f32], s: &StepSeqs<'_>) -> Vec<f64> {
    naive_windowed(pool, q, s, None)
}

/// Causal attention of the step in f64, a query at `p` seeing positions
/// `t > p - window`.
fn naive_windowed(pool: &Pool, q: &[f32], s: &StepSeqs<'_>, window: Option<usize>) -> Vec<f64> {
    let (d, h_n) = (pool.geom.head_dim, pool.h());
    let bs = pool.geom.block;
    let mut out = vec![0f64; q.len()];
    for sq in s.iter() {
        for i in 0..sq.count {
            let row = sq.first + i;
            let n_t = sq.start + i + 1;
            let t0 = window.map_or(0, |w| n_t.saturating_sub(w));
            for h in 0..h_n {
                let g = h / pool.n_rep;
                let qv = &q[(row * h_n + h) * d..][..d];
                let key = |t: usize, e: usize| {
                    pool.k
                        .view()
                        .get(pool.geom.k_index(sq.block_of(t, bs), t % bs, g, e))
                        as f64
                };
                let sc: Vec<f64> = (t0..n_t)
                    .map(|t| {
                        (0..d).map(|e| qv[e] as f64 * key(t, e)).sum::<f64>() / (d as f64).sqrt()
                    })
                    .collect();
                let mx = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let ex: Vec<f64> = sc.iter().map(|v| (v - mx).exp()).collect();
                let z: f64 = ex.iter().sum();
                for (t, &w) in (t0..n_t).zip(&ex) {
                    let base = pool.geom.v_index(sq.block_of(t, bs), t % bs, g, 0);
                    for e in 0..d {
                        out[(row * h_n + h) * d + e] += w / z * pool.v.view().get(base + e) as f64;
                    }
                }
            }
        }
    }
    out
}

fn fused(pool: &Pool, isa: Isa, threads: usize, st: &Step, q: &[f32]) -> Vec<f32> {
    fused_windowed(pool, isa, threads, st, q, None)
}

fn fused_windowed(
    pool: &Pool,
    isa: Isa,
    threads: usize,
    st: &Step,
    q: &[f32],
    window: Option<usize>,
) -> Vec<f32> {
    let tp = ThreadPool::new(threads);
    let s = StepSeqs::new(&st.table, &st.blocks, st.tokens, &pool.geom).unwrap();
    let mut work = AttnWork::new(&pool.geom, pool.n_rep, st.tokens, s.len(), threads);
    let mut out = vec![f32::NAN; q.len()];
    attention_paged(
        &tp,
        isa,
        q,
        pool.k.view(),
        pool.v.view(),
        &pool.geom,
        pool.n_rep,
        window,
        &s,
        &mut out,
        &mut work,
    )
    .unwrap();
    out
}

fn unfused(pool: &Pool, st: &Step, q: &[f32]) -> Vec<f32> {
    unfused_windowed(pool, st, q, None)
}

/// The reference path: `attn_scores_windowed`, `softmax_rows`, `attn_values`.
fn unfused_windowed(pool: &Pool, st: &Step, q: &[f32], window: Option<usize>) -> Vec<f32> {
    let tp = ThreadPool::new(2);
    let s = StepSeqs::new(&st.table, &st.blocks, st.tokens, &pool.geom).unwrap();
    let t_n = s.max_keys() + 3; // longer than needed: the tail is masked
    let mut scores = vec![0f32; pool.h() * st.tokens * t_n];
    let (g, r) = (&pool.geom, pool.n_rep);
    attn_scores_windowed(&tp, q, pool.k.view(), g, r, &s, t_n, window, &mut scores).unwrap();
    softmax_rows(&tp, &mut scores, t_n).unwrap();
    let mut out = vec![f32::NAN; q.len()];
    attn_values(&tp, &scores, pool.v.view(), g, r, &s, t_n, &mut out).unwrap();
    out
}

/// A mixed step: a prefill chunk from 0, a chunk after a history, a
/// decode token after a long history (two spans), a two-token chunk.
fn mixed_parts() -> Vec<(usize, usize, usize)> {
    vec![(0, 0, 37), (1, 70, 20), (2, 300, 1), (3, 5, 2)]
}

#[test]
fn both_forms_match_the_reference() {
    // SmolLM2's geometry, no GQA with a small head, MQA with an odd head dim.
    // Every cache type (the quantized ones need whole groups of 32 dims).
    for (hkv, d, n_rep) in [(3, 64, 3), (4, 16, 1), (1, 20, 4), (2, 7, 2), (2, 32, 2)] {
        for ty in CacheType::ALL {
            if ty.is_quantized() && d % 32 != 0 {
                continue;
            }
            let pool = Pool::new(4 * 24, hkv, d, n_rep, ty, 11);
            let seqs = seqs_in(&pool, 4, 24, 5);
            let parts = mixed_parts();
            let st = step(&seqs, &parts);
            let q = q_for(&pool, &parts);
            let s = StepSeqs::new(&st.table, &st.blocks, st.tokens, &pool.geom).unwrap();
            let want = naive(&pool, &q, &s);
            let what = format!("hkv {hkv} d {d} n_rep {n_rep} {ty}");
            assert_close(
                &unfused(&pool, &st, &q),
                &want,
                2e-5,
                2e-4,
                &format!("unfused {what}"),
            );
            for isa in Isa::supported_levels() {
                for threads in [1, 2] {
                    let got = fused(&pool, isa, threads, &st, &q);
                    assert_close(&got, &want, 2e-5, 2e-4, &format!("fused {isa:?} {what}"));
                }
            }
        }
    }
}

#[test]
fn every_block_size_matches_the_reference() {
    // Decode items read f16, bf16 and f32 pools in place, one block per
    // run of keys (or, with blocks shorter than a vector, through scratch):
    // blocks of 1 to 64 positions, each the mixed step's keys in shuffled
    // blocks, at every level.
    for block in [1, 4, 8, 32, 64] {
        for (hkv, d, n_rep, ty) in [
            (3, 64, 3, CacheType::F16),
            (2, 20, 2, CacheType::F32),
            (1, 32, 4, CacheType::Bf16),
        ] {
            let per = 384 / block;
            let pool = Pool::with_block(block, 4 * per, hkv, d, n_rep, ty, 13);
            let seqs = seqs_in(&pool, 4, per, 7);
            let parts = vec![(0, 0, 37), (1, 300, 1), (2, 63, 2), (3, 129, 3)];
            let st = step(&seqs, &parts);
            let q = q_for(&pool, &parts);
            let s = StepSeqs::new(&st.table, &st.blocks, st.tokens, &pool.geom).unwrap();
            let want = naive(&pool, &q, &s);
            for isa in Isa::supported_levels() {
                let got = fused(&pool, isa, 2, &st, &q);
                let what = format!("block {block} {ty} hkv {hkv} d {d} {isa:?}");
                assert_close(&got, &want, 2e-5, 2e-4, &what);
            }
        }
    }
}

#[test]
fn windowed_fused_matches_the_windowed_reference() {
    // Windows smaller than a KV block (16 positions), equal to one,
    // straddling blocks, equal to a tile, and longer than a span; steps of
    // several sequences mixing prefill chunks (tiled items, one crossing
    // the span boundary at 256) and decode queries (decode items).
    let steps = [
        mixed_parts(),
        vec![(0, 250, 30), (1, 370, 1), (2, 100, 3), (3, 200, 64)],
    ];
    for (hkv, d, n_rep, ty) in [
        (3, 64, 3, CacheType::F16),
        (2, 32, 2, CacheType::F32),
        (1, 20, 4, CacheType::Bf16),
        (2, 32, 1, CacheType::Q8_0),
    ] {
        let pool = Pool::new(4 * 24, hkv, d, n_rep, ty, 17);
        let seqs = seqs_in(&pool, 4, 24, 3);
        for parts in &steps {
            let st = step(&seqs, parts);
            let q = q_for(&pool, parts);
            let s = StepSeqs::new(&st.table, &st.blocks, st.tokens, &pool.geom).unwrap();
            for w in [1, 5, 16, 23, 40, 64, 100, 300] {
                let window = Some(w);
                let what = format!("hkv {hkv} d {d} n_rep {n_rep} {ty} window {w}");
                let want = naive_windowed(&pool, &q, &s, window);
                let reference = unfused_windowed(&pool, &st, &q, window);
                assert_close(&reference, &want, 2e-5, 2e-4, &format!("unfused {what}"));
                let reference: Vec<f64> = reference.iter().map(|&x| x as f64).collect();
                for isa in Isa::supported_levels() {
                    for threads in [1, 2] {
                        let got = fused_windowed(&pool, isa, threads, &st, &q, window);
                        assert_close(
                            &got,
                            &reference,
                            2e-5,
                            2e-4,
                            &format!("fused {isa:?} {what}"),
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn rows_do_not_depend_on_the_batch() {
    // Sequence 0 has 600 positions (three spans); its queries at 560..580
    // are computed in five groupings, beside other sequences or alone, on
    // one or two threads: every row must be bitwise the same.
    // With a sliding window too: 57 puts the windows' starts (504..523)
    // across a tile and span boundary (512), so some rows of an item see
    // nothing of its first tile and span; 300 spans two spans.
    for (hkv, d, n_rep, ty, window) in [
        (3, 64, 3, CacheType::F16, None),
        (2, 20, 2, CacheType::F16, None),
        (3, 64, 3, CacheType::F32, None),
        (3, 64, 3, CacheType::Bf16, None),
        (3, 64, 3, CacheType::Q8_0, None),
        (2, 32, 2, CacheType::Q4_0, None),
        (3, 64, 3, CacheType::F16, Some(57)),
        (2, 20, 1, CacheType::F32, Some(57)),
        (2, 20, 2, CacheType::F16, Some(300)),
    ] {
        let pool = Pool::new(160, hkv, d, n_rep, ty, 21);
        let seqs = seqs_in(&pool, 4, 40, 9);
        let target: Vec<usize> = (560..580).collect();
        let groupings: Vec<Vec<Vec<(usize, usize, usize)>>> = vec![
            // All 20 queries in one tiled item group, alone.
            vec![vec![(0, 560, 20)]],
            // One decode step per query, alone.
            target.iter().map(|&p| vec![(0, p, 1)]).collect(),
            // Chunks of 2, 5, 13 beside other sequences' prefill and decode.
            vec![
                vec![(1, 0, 40), (0, 560, 2), (2, 200, 1)],
                vec![(3, 9, 3), (0, 562, 5), (1, 40, 1)],
                vec![(2, 201, 1), (0, 567, 13), (3, 12, 30)],
            ],
            // Chunks of 3 (decode items with three queries) and 17.
            vec![
                vec![(0, 560, 3), (1, 0, 7)],
                vec![(2, 100, 50), (0, 563, 17)],
            ],
        ];
        for isa in Isa::supported_levels() {
            let mut reference: Option<Vec<Vec<f32>>> = None;
            for (gi, grouping) in groupings.iter().enumerate() {
                for threads in [1, 2, 3] {
                    // Row results of sequence 0, by position.
                    let mut rows: Vec<Vec<f32>> = vec![Vec::new(); target.len()];
                    for parts in grouping {
                        let st = step(&seqs, parts);
                        let q = q_for(&pool, parts);
                        let out = fused_windowed(&pool, isa, threads, &st, &q, window);
                        let row_len = pool.h() * d;
                        let mut first = 0;
                        for &(j, start, count) in parts {
                            if j == 0 {
                                for i in 0..count {
                                    rows[start + i - 560] = out
                                        [(first + i) * row_len..(first + i + 1) * row_len]
                                        .to_vec();
                                }
                            }
                            first += count;
                        }
                    }
                    match &reference {
                        None => reference = Some(rows),
                        Some(r) => {
                            for (p, (a, b)) in r.iter().zip(&rows).enumerate() {
                                let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                                assert!(
                                    same,
                                    "{isa:?} {ty} d {d} window {window:?}: grouping {gi} on \
                                     {threads} threads changes the row at position {}",
                                    560 + p
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn deep_decode_items_match_tiled_rows() {
    // A sequence of 2204 positions (nine spans): at one thread its decode
    // steps run as items of three consecutive spans each, at two and three
    // threads of one or two; every row must be bitwise what a tiled chunk
    // of the same queries gives, in the pool's place (f16, bf16), through
    // f32 scratch (q8_0), and with a window that starts mid-item.
    for (ty, window) in [
        (CacheType::F16, None),
        (CacheType::Bf16, None),
        (CacheType::Q8_0, None),
        (CacheType::F16, Some(1500)),
    ] {
        let (hkv, d, n_rep) = (3, 64, 3);
        let pool = Pool::new(150, hkv, d, n_rep, ty, 31);
        let seqs = seqs_in(&pool, 1, 140, 5);
        let row_len = pool.h() * d;
        for isa in Isa::supported_levels() {
            let tiled_parts = [(0, 2200, 4)];
            let st = step(&seqs, &tiled_parts);
            let tiled = fused_windowed(&pool, isa, 1, &st, &q_for(&pool, &tiled_parts), window);
            for threads in [1, 2, 3] {
                for (p, count) in [(2200, 1), (2201, 3), (2203, 1)] {
                    let parts = [(0, p, count)];
                    let st = step(&seqs, &parts);
                    let q = q_for(&pool, &parts);
                    let out = fused_windowed(&pool, isa, threads, &st, &q, window);
                    let want = &tiled[(p - 2200) * row_len..(p - 2200 + count) * row_len];
                    let same = out
                        .iter()
                        .zip(want)
                        .all(|(x, y)| x.to_bits() == y.to_bits());
                    assert!(
                        same,
                        "{isa:?} {ty} window {window:?}: decode of {count} at {p} on \
                         {threads} threads differs from the tiled rows"
                    );
                }
            }
        }
    }
}

#[test]
fn decode_rows_do_not_depend_on_head_groups() {
    // A sequence of 4096 positions (sixteen spans) and one of 700 (three)
    // in one step: at one thread every decode item walks all three kv
    // heads, at two threads too (the spans give enough items), at three
    // in groups of two heads and one, at four one head each; the rows
    // must be the same bits whichever, at every level.
    let (hkv, d, n_rep) = (3, 64, 3);
    let pool = Pool::new(512, hkv, d, n_rep, CacheType::F16, 41);
    let seqs = seqs_in(&pool, 2, 256, 7);
    let parts = [(0, 4095, 1), (1, 698, 2)];
    let st = step(&seqs, &parts);
    let q = q_for(&pool, &parts);
    for isa in Isa::supported_levels() {
        let one = fused_windowed(&pool, isa, 1, &st, &q, None);
        for threads in [2, 3, 4] {
            let out = fused_windowed(&pool, isa, threads, &st, &q, None);
            let same = out
                .iter()
                .zip(&one)
                .all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(
                same,
                "{isa:?}: decode rows on {threads} threads differ from 1 thread"
            );
        }
    }
}

#[test]
fn causal_mask_exact() {
    // Keys all equal, value rows one-hot on the position: a query at
    // position p must average exactly the first p + 1 one-hot rows.
    let (hkv, d, n_rep) = (1, 32, 3);
    let mut pool = Pool::new(2, hkv, d, n_rep, CacheType::F32, 1);
    let geom = pool.geom;
    pool.k = KvStore::F32(vec![1.0; geom.elems()]);
    let mut v = vec![0.0; geom.elems()];
    let blocks = [1, 0];
    for t in 0..d {
        v[geom.v_index(blocks[t / 16], t % 16, 0, t)] = 1.0;
    }
    pool.v = KvStore::F32(v);
    let seqs = vec![Seq {
        blocks: blocks.iter().map(|&b| b as i32).collect(),
    }];
    // With a sliding window w, the average of rows p+1-w..=p.
    let windows = [None, Some(1), Some(5), Some(16), Some(19)];
    for (parts, window) in [vec![(0, 3, 20)], vec![(0, 3, 2)], vec![(0, 30, 1)]]
        .into_iter()
        .flat_map(|p| windows.map(|w| (p.clone(), w)))
    {
        let st = step(&seqs, &parts);
        let q = vec![0.5f32; st.tokens * n_rep * d];
        let mut outs = vec![(
            "unfused".to_string(),
            unfused_windowed(&pool, &st, &q, window),
        )];
        for isa in Isa::supported_levels() {
            outs.push((
                format!("{isa:?}"),
                fused_windowed(&pool, isa, 2, &st, &q, window),
            ));
        }
        let (_, start, count) = parts[0];
        for (what, out) in outs {
            for i in 0..count {
                let p = start + i;
                let first = window.map_or(0, |w| (p + 1).saturating_sub(w));
                for h in 0..n_rep {
                    let o = &out[(i * n_rep + h) * d..][..d];
                    for (t, &x) in o.iter().enumerate() {
                        let want = if (first..=p).contains(&t) {
                            1.0 / (p + 1 - first) as f32
                        } else {
                            0.0
                        };
                        assert!(
                            (x - want).abs() < 1e-6,
                            "{what} window {window:?} p {p} t {t}: {x} vs {want}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn span_merge_is_the_online_softmax() {
    // Merging two halves equals one pass over all keys (up to rounding),
    // a span without keys changes nothing, the first span is taken as is.
    let (m1, l1, a1) = (2.0f32, 3.0f32, [1.0f32, -2.0]);
    let (m2, l2, a2) = (5.0f32, 0.5f32, [4.0f32, 0.5]);
    let (mut mm, mut ll, mut aa) = (f32::NEG_INFINITY, 0.0, [0.0f32; 2]);
    merge_span(
        &mut mm,
        &mut ll,
        &mut aa,
        f32::NEG_INFINITY,
        9.0,
        &[9.0, 9.0],
    );
    assert_eq!((mm, ll, aa), (f32::NEG_INFINITY, 0.0, [0.0, 0.0]));
    merge_span(&mut mm, &mut ll, &mut aa, m1, l1, &a1);
    assert_eq!((mm, ll, aa), (m1, l1, a1));
    merge_span(&mut mm, &mut ll, &mut aa, m2, l2, &a2);
    let w1 = ((m1 - m2) as f64).exp();
    assert_eq!(mm, m2);
    assert!((ll as f64 - (l1 as f64 * w1 + l2 as f64)).abs() < 1e-6);
    assert!((aa[0] as f64 - (a1[0] as f64 * w1 + a2[0] as f64)).abs() < 1e-6);
}

#[test]
fn bad_steps_are_refused() {
    let pool = Pool::new(8, 2, 16, 2, CacheType::F32, 3);
    let seqs = seqs_in(&pool, 2, 4, 1);
    let st = step(&seqs, &[(0, 0, 5), (1, 10, 1)]);
    let s = StepSeqs::new(&st.table, &st.blocks, st.tokens, &pool.geom).unwrap();
    let tp = ThreadPool::new(1);
    let mut work = AttnWork::new(&pool.geom, 2, 6, 2, 1);
    let q = q_for(&pool, &[(0, 0, 5), (1, 10, 1)]);
    let mut out = vec![0.0; q.len()];
    let (k, v, g) = (pool.k.view(), pool.v.view(), &pool.geom);
    let isa = crate::kernels::Kernels::current().isa();
    let mut run = |q: &[f32], k: KvView<'_>, window: Option<usize>| {
        attention_paged(&tp, isa, q, k, v, g, 2, window, &s, &mut out, &mut work)
    };
    assert!(run(&q[1..], k, None).is_err(), "a short q");
    assert!(run(&q, KvView::F32(&[]), None).is_err(), "an empty cache");
    assert!(run(&q, k, None).is_ok());
    assert!(run(&q, k, Some(0)).is_err(), "an empty window");
    let mut scores = vec![0.0; 4 * 6 * 10];
    assert!(
        attn_scores(&tp, &q, k, g, 2, &s, 10, &mut scores).is_err(),
        "T shorter than 11 keys"
    );
}

#[cfg(target_arch = "x86_64")]
#[test]
fn avx2_exp_accuracy() {
    use std::arch::x86_64::*;
    if !Isa::detect().avx2() {
        return;
    }
    let mut xs = vec![
        f32::NEG_INFINITY,
        -100.0,
        -87.5,
        0.0,
        -1e-8,
        -0.5,
        -86.9,
        -3.3,
    ];
    xs.extend((0..2000).map(|i| -(i as f32) * 0.05));
    xs.truncate(xs.len() / 8 * 8);
    for c in xs.chunks_exact(8) {
        let mut out = [0f32; 8];
        // SAFETY: AVX2 and FMA detected above.
        unsafe {
            #[target_feature(enable = "avx2,fma")]
            unsafe fn run(x: &[f32], out: &mut [f32; 8]) {
                // SAFETY: 8 floats each; features enabled here.
                unsafe {
                    _mm256_storeu_ps(
                        out.as_mut_ptr(),
                        crate::kernels::simd::exp_ps(_mm256_loadu_ps(x.as_ptr())),
                    )
                }
            }
            run(c, &mut out);
        }
        for (&x, &e) in c.iter().zip(&out) {
            let want = (x as f64).exp();
            if x == f32::NEG_INFINITY {
                assert_eq!(e, 0.0, "exp({x})");
            } else if x < -87.0 {
                assert!(e < 1e-37, "exp({x}) = {e}");
            } else {
                assert!(
                    ((e as f64) - want).abs() <= 4e-7 * want,
                    "exp({x}) = {e}, want {want}"
                );
            }
        }
    }
}
