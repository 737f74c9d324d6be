//! The byte-pair merge loop shared by all tokenizers.
//!
//! Symbols sit in a doubly linked list; every adjacent pair that can merge
//! is in a min-heap keyed by `(rank, position of the left symbol)`. Popping
//! the heap gives the pair with the best (lowest) rank, ties going to the
//! leftmost pair -- the same choice tiktoken, Hugging Face `tokenizers`,
//! sentencepiece and llama.cpp make with their various loops -- in
//! `O(n log n)` instead of the naive `O(n^2)`. Entries made stale by an
//! earlier merge are recognised by version counters and skipped.
use std::cmp::Reverse;
use std::collections::BinaryHeap;

const NONE: usize = usize::MAX;

struct Node<S> {
    sym: S,
    prev: usize,
    next: usize,
    ver: u32,
    alive: bool,
}

/// Merge `syms` with `pair(left, right) -> Some((rank, merged))` until no
/// adjacent pair merges. Lower rank merges first; ties go to the leftmost.
pub(crate) fn merge<S: Copy>(
    syms: Vec<S>,
    mut pair: impl FnMut(S, S) -> Option<(u32, S)>,
) -> Vec<S> {
    let n = syms.len();
    if n < 2 {
        return syms;
    }
    let mut nodes: Vec<Node<S>> = syms
        .into_iter()
        .enumerate()
        .map(|(i, sym)| Node {
            sym,
            prev: if i == 0 { NONE } else { i - 1 },
            next: if i + 1 == n { NONE } else { i + 1 },
            ver: 0,
            alive: true,
        })
        .collect();
    // (rank, left index, left version, right index, right version, slot)
    type Entry = Reverse<(u32, usize, u32, usize, u32, usize)>;
    let mut heap: BinaryHeap<Entry> = BinaryHeap::with_capacity(n);
    let mut merged: Vec<S> = Vec::with_capacity(n);
    let mut push =
        |nodes: &Vec<Node<S>>, heap: &mut BinaryHeap<Entry>, merged: &mut Vec<S>, l: usize| {
            if l == NONE {
                return;
            }
            let r = nodes[l].next;
            if r == NONE {
                return;
            }
            if let Some((rank, m)) = pair(nodes[l].sym, nodes[r].sym) {
                merged.push(m);
                heap.push(Reverse((
                    rank,
                    l,
                    nodes[l].ver,
                    r,
                    nodes[r].ver,
                    merged.len() - 1,
                )));
            }
        };
    for i in 0..n - 1 {
        push(&nodes, &mut heap, &mut merged, i);
    }
    while let Some(Reverse((_, l, lv, r, rv, slot))) = heap.pop() {
        let valid = nodes[l].alive
            && nodes[r].alive
            && nodes[l].ver == lv
            && nodes[r].ver == rv
            && nodes[l].next == r;
        if !valid {
            continue;
        }
        nodes[l].sym = merged[slot];
        nodes[l].ver += 1;
        nodes[r].alive = false;
        let rn = nodes[r].next;
        nodes[l].next = rn;
        if rn != NONE {
            nodes[rn].prev = l;
        }
        let lp = nodes[l].prev;
        push(&nodes, &mut heap, &mut merged, lp);
        push(&nodes, &mut heap, &mut merged, l);
    }
    let mut out = Vec::new();
    let mut i = 0;
    while i != NONE {
        out.push(nodes[i].sym);
        i = nodes[i].next;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// Naive reference: scan all pairs, merge the min-rank leftmost one.
    fn naive(mut parts: Vec<String>, ranks: &HashMap<String, u32>) -> Vec<String> {
        loop {
            let mut best: Option<(u32, usize)> = None;
            for i in 0..parts.len().saturating_sub(1) {
                let m = format!("{}{}", parts[i], parts[i + 1]);
                if let Some(&r) = ranks.get(&m) {
                    if best.is_none_or(|(br, _)| r < br) {
                        best = Some((r, i));
                    }
                }
            }
            let Some((_, i)) = best else { return parts };
            let right = parts.remove(i + 1);
            parts[i].push_str(&right);
        }
    }

    #[test]
    fn matches_naive_merge() {
        let vocab = [
            "ab", "bc", "aa", "abc", "aaa", "ca", "cab", "bca", "aab", "bb",
        ];
        let ranks: HashMap<String, u32> = vocab
            .iter()
            .enumerate()
            .map(|(i, s)| (s.to_string(), i as u32))
            .collect();
        // Every string over {a,b,c} of length 1 to 7.
        let mut words: Vec<String> = Vec::new();
        let mut layer = vec![String::new()];
        for _ in 0..7 {
            layer = layer
                .iter()
                .flat_map(|w| ['a', 'b', 'c'].map(|c| format!("{w}{c}")))
                .collect();
            words.extend(layer.iter().cloned());
        }
        assert_eq!(words.len(), 3 + 9 + 27 + 81 + 243 + 729 + 2187);
        for w in &words {
            let init: Vec<(usize, usize)> = (0..w.len()).map(|i| (i, i + 1)).collect();
            let got = merge(init, |a, b| {
                ranks.get(&w[a.0..b.1]).map(|&r| (r, (a.0, b.1)))
            });
            let got: Vec<String> = got.iter().map(|&(a, b)| w[a..b].to_string()).collect();
            let want = naive(w.chars().map(|c| c.to_string()).collect(), &ranks);
            assert_eq!(got, want, "word {w}");
        }
    }
}
