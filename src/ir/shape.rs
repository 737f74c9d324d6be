//! Shapes with symbolic dimensions.
//!
//! The graph is written once for prefill, decode and any mix of sequences.
//! A step carries tokens of one or more sequences (each token knows its
//! sequence and its position, see the step inputs in [`super::Op`]); three
//! symbols stand for the quantities that change from step to step:
//!
//! * `S`: the number of tokens in this step, across its sequences (a prefill
//!   chunk, one decode token per sequence, or a mix);
//! * `N`: the number of sequences with tokens in this step (`1 <= N <= S`);
//! * `T`: the longest key span of the step: the largest `start + tokens` over
//!   its sequences, i.e. the most cached positions any query attends over;
//! * `R`: the logit rows of the step: the sum over its sequences of the
//!   last tokens each asks logits for (one for plain decoding, `k + 1` for a
//!   sequence verifying `k` drafted tokens; `N <= R <= S`).
//!
//! Everything else is a constant fixed when the graph is built, including the
//! KV pool that all sequences share.

use serde::{Deserialize, Serialize};
use std::fmt;

/// A shape symbol, bound at run time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Sym {
    /// Tokens in this step, across its sequences.
    S,
    /// Sequences with tokens in this step.
    N,
    /// The longest key span of the step (`max(start + tokens)` over its
    /// sequences).
    T,
    /// Logit rows of the step: the last tokens of each sequence that want
    /// logits, summed over its sequences.
    R,
}

/// One dimension: a constant or a symbol.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Dim {
    /// A size known when the graph is built.
    Const(usize),
    /// A size bound per step.
    Sym(Sym),
}

/// Values for the symbols of one step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Bindings {
    /// Tokens in this step (`S`).
    pub s: usize,
    /// Sequences in this step (`N`).
    pub n: usize,
    /// The longest key span (`T`).
    pub t: usize,
    /// Logit rows (`R`).
    pub r: usize,
}

impl Bindings {
    /// A step whose sequences each want the logits of their last token
    /// (`R = N`).
    pub fn new(s: usize, n: usize, t: usize) -> Self {
        Bindings { s, n, t, r: n }
    }
    /// The same step with `r` logit rows.
    pub fn with_rows(self, r: usize) -> Self {
        Bindings { r, ..self }
    }
    /// One sequence: `s` tokens at positions `pos..pos + s`.
    pub fn one_sequence(s: usize, pos: usize) -> Self {
        Bindings {
            s,
            n: 1,
            t: pos + s,
            r: 1,
        }
    }
    /// The value of `sym`.
    pub fn get(&self, sym: Sym) -> usize {
        match sym {
            Sym::S => self.s,
            Sym::N => self.n,
            Sym::T => self.t,
            Sym::R => self.r,
        }
    }
}

impl Dim {
    /// The step's token count.
    pub const S: Dim = Dim::Sym(Sym::S);
    /// The step's sequence count.
    pub const N: Dim = Dim::Sym(Sym::N);
    /// The step's longest key span.
    pub const T: Dim = Dim::Sym(Sym::T);
    /// The step's logit-row count.
    pub const R: Dim = Dim::Sym(Sym::R);

    /// The size under `b`.
    pub fn eval(self, b: &Bindings) -> usize {
        match self {
            Dim::Const(c) => c,
            Dim::Sym(s) => b.get(s),
        }
    }
    /// The size, if it is a constant.
    pub fn as_const(self) -> Option<usize> {
        match self {
            Dim::Const(c) => Some(c),
            Dim::Sym(_) => None,
        }
    }
}

impl From<usize> for Dim {
    fn from(c: usize) -> Self {
        Dim::Const(c)
    }
}

impl fmt::Display for Dim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Dim::Const(c) => write!(f, "{c}"),
            Dim::Sym(s) => write!(f, "{s:?}"),
        }
    }
}

/// A row-major shape, outermost dimension first.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Shape(pub Vec<Dim>);

impl Shape {
    /// A shape of these dimensions.
    pub fn new(dims: impl IntoIterator<Item = Dim>) -> Self {
        Shape(dims.into_iter().collect())
    }
    /// A shape of constant dimensions.
    pub fn constant(dims: &[usize]) -> Self {
        Shape(dims.iter().map(|&d| Dim::Const(d)).collect())
    }
    /// The number of dimensions.
    pub fn rank(&self) -> usize {
        self.0.len()
    }
    /// The dimensions, outermost first.
    pub fn dims(&self) -> &[Dim] {
        &self.0
    }
    /// The innermost dimension, if any.
    pub fn last(&self) -> Option<Dim> {
        self.0.last().copied()
    }
    /// Number of elements once the symbols are bound.
    pub fn numel(&self, b: &Bindings) -> usize {
        self.0.iter().map(|d| d.eval(b)).product()
    }
    /// Number of elements if every dimension is constant.
    pub fn const_numel(&self) -> Option<usize> {
        self.0
            .iter()
            .try_fold(1usize, |acc, d| acc.checked_mul(d.as_const()?))
    }
    /// The element count as a product: (constant factor, sorted symbols).
    /// Two shapes hold the same number of elements for every binding exactly
    /// when their factorisations are equal.
    pub fn factorised_numel(&self) -> (usize, Vec<Sym>) {
        let mut c = 1usize;
        let mut syms = Vec::new();
        for d in &self.0 {
            match d {
                Dim::Const(k) => c = c.saturating_mul(*k),
                Dim::Sym(s) => syms.push(*s),
            }
        }
        syms.sort();
        (c, syms)
    }
    /// The sizes under `b`.
    pub fn eval(&self, b: &Bindings) -> Vec<usize> {
        self.0.iter().map(|d| d.eval(b)).collect()
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("]")
    }
}

/// Builds a [`Shape`] from a list of `Dim`-convertible values:
/// `shape![Dim::S, 4096]`.
#[macro_export]
macro_rules! shape {
    ($($d:expr),* $(,)?) => {
        $crate::ir::Shape(vec![$($crate::ir::Dim::from($d)),*])
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_and_eval() {
        let s = shape![Dim::S, 8, 128];
        assert_eq!(s.to_string(), "[S, 8, 128]");
        assert_eq!(s.eval(&Bindings::one_sequence(3, 10)), vec![3, 8, 128]);
        assert_eq!(shape![Dim::T, 2].numel(&Bindings::one_sequence(3, 10)), 26);
        assert_eq!(shape![Dim::N, 4].eval(&Bindings::new(9, 3, 40)), vec![3, 4]);
    }

    #[test]
    fn factorised_numel_matches_reshapes() {
        assert_eq!(
            shape![Dim::S, 32, 128].factorised_numel(),
            shape![Dim::S, 4096].factorised_numel()
        );
        assert_ne!(
            shape![Dim::T, 4096].factorised_numel(),
            shape![Dim::S, 4096].factorised_numel()
        );
    }
}
