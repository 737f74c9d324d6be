//! Hand-written pre-tokenizers (the regex splits that come before BPE).
//!
//! The Llama 3 / cl100k pattern and the GPT-2 pattern are implemented as
//! explicit scanners instead of with a backtracking regex engine. Each
//! alternative of the pattern is tried in order at the current position,
//! exactly as a leftmost-first regex engine would, but every decision is a
//! bounded look at the next one or two characters, so splitting is linear in
//! the input length. With `fancy-regex` the `\s+(?!\S)` alternative
//! backtracks over whole whitespace runs, which is quadratic on long runs
//! (the reason Meta's Python wrapper cuts runs at 25 000 characters).
//!
//! Character classes: `\p{L}` and `\p{N}` are Unicode general category
//! groups (from the `unicode-properties` tables), `\s` is the Unicode
//! `White_Space` property, as in the Rust `regex` crate used by tiktoken.
use unicode_properties::{GeneralCategoryGroup, UnicodeGeneralCategory};

/// Unicode `White_Space` (what `\s` means in the Rust regex crate).
#[inline]
pub(crate) fn is_ws(c: char) -> bool {
    matches!(
        c,
        '\t'..='\r'
            | ' '
            | '\u{85}'
            | '\u{a0}'
            | '\u{1680}'
            | '\u{2000}'..='\u{200a}'
            | '\u{2028}'
            | '\u{2029}'
            | '\u{202f}'
            | '\u{205f}'
            | '\u{3000}'
    )
}

/// Python's `str.isspace()`: `White_Space` plus U+001C..U+001F.
#[inline]
pub(crate) fn is_py_space(c: char) -> bool {
    is_ws(c) || ('\u{1c}'..='\u{1f}').contains(&c)
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Class {
    Letter,
    Number,
    Space,
    Other,
}

#[inline]
fn class(c: char) -> Class {
    if c.is_ascii() {
        return if c.is_ascii_alphabetic() {
            Class::Letter
        } else if c.is_ascii_digit() {
            Class::Number
        } else if is_ws(c) {
            Class::Space
        } else {
            Class::Other
        };
    }
    if is_ws(c) {
        return Class::Space;
    }
    match c.general_category_group() {
        GeneralCategoryGroup::Letter => Class::Letter,
        GeneralCategoryGroup::Number => Class::Number,
        _ => Class::Other,
    }
}

#[inline]
pub(crate) fn is_number(c: char) -> bool {
    class(c) == Class::Number
}

/// The text as characters with byte offsets (`offs.len() == chars.len() + 1`).
struct Chars {
    cs: Vec<char>,
    cl: Vec<Class>,
    offs: Vec<usize>,
}

impl Chars {
    fn new(s: &str) -> Self {
        let mut cs = Vec::with_capacity(s.len());
        let mut offs = Vec::with_capacity(s.len() + 1);
        for (i, c) in s.char_indices() {
            cs.push(c);
            offs.push(i);
        }
        offs.push(s.len());
        let cl = cs.iter().map(|&c| class(c)).collect();
        Chars { cs, cl, offs }
    }
    fn len(&self) -> usize {
        self.cs.len()
    }
    /// End of the run of characters of class `k` starting at `i`.
    fn run(&self, mut i: usize, k: Class) -> usize {
        while i < self.len() && self.cl[i] == k {
            i += 1;
        }
        i
    }
}

#[inline]
fn is_nl(c: char) -> bool {
    c == '\r' || c == '\n'
}

/// Meta's Llama 3 pattern (the cl100k pattern):
///
/// ```text
/// (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}
/// | ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
/// ```
///
/// Appends the byte ranges of the pieces of `s` to `out`.
pub(crate) fn split_llama3(s: &str, out: &mut Vec<(usize, usize)>) {
    split_cl100k(s, 3, out)
}

/// Qwen2's pattern (Qwen2, Qwen2.5, Qwen3; llama.cpp `qwen2`): Llama 3's
/// with `\p{N}` instead of `\p{N}{1,3}`, so every digit is its own piece:
///
/// ```text
/// (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}
/// | ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
/// ```
pub(crate) fn split_qwen2(s: &str, out: &mut Vec<(usize, usize)>) {
    split_cl100k(s, 1, out)
}

/// The cl100k-shaped pattern with runs of at most `max_digits` numbers.
fn split_cl100k(s: &str, max_digits: usize, out: &mut Vec<(usize, usize)>) {
    let t = Chars::new(s);
    let n = t.len();
    let mut i = 0;
    while i < n {
        let end = llama3_match(&t, i, max_digits);
        debug_assert!(end > i);
        out.push((t.offs[i], t.offs[end]));
        i = end;
    }
}

fn llama3_match(t: &Chars, i: usize, max_digits: usize) -> usize {
    let n = t.len();
    let c = t.cs[i];
    let at = |j: usize| if j < n { Some(t.cs[j]) } else { None };
    // (?i:'s|'t|'re|'ve|'m|'ll|'d) -- case-insensitive with Unicode simple
    // case folding: 's' also matches U+017F LATIN SMALL LETTER LONG S.
    if c == '\'' {
        if let Some(c1) = at(i + 1) {
            if matches!(
                c1,
                's' | 'S' | '\u{17f}' | 't' | 'T' | 'm' | 'M' | 'd' | 'D'
            ) {
                return i + 2;
            }
            let c2 = at(i + 2);
            let two = matches!(
                (c1, c2),
                ('r' | 'R' | 'v' | 'V', Some('e' | 'E')) | ('l' | 'L', Some('l' | 'L'))
            );
            if two {
                return i + 3;
            }
        }
    }
    let k = t.cl[i];
    // [^\r\n\p{L}\p{N}]?\p{L}+
    if k == Class::Letter {
        return t.run(i, Class::Letter);
    }
    if k != Class::Number && !is_nl(c) && i + 1 < n && t.cl[i + 1] == Class::Letter {
        return t.run(i + 1, Class::Letter);
    }
    // \p{N}{1,3} (Llama 3), \p{N} (Qwen2)
    if k == Class::Number {
        let mut j = i + 1;
        while j < n && j < i + max_digits && t.cl[j] == Class::Number {
            j += 1;
        }
        return j;
    }
    // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
    let punct_start = if k == Class::Other {
        Some(i)
    } else if c == ' ' && i + 1 < n && t.cl[i + 1] == Class::Other {
        Some(i + 1)
    } else {
        None
    };
    if let Some(p) = punct_start {
        let mut j = t.run(p, Class::Other);
        while j < n && is_nl(t.cs[j]) {
            j += 1;
        }
        return j;
    }
    // Only whitespace is left.
    debug_assert_eq!(k, Class::Space);
    let j = t.run(i, Class::Space);
    // \s*[\r\n]+ : the match ends after the last newline of the run.
    if let Some(last_nl) = (i..j).rev().find(|&q| is_nl(t.cs[q])) {
        return last_nl + 1;
    }
    whitespace_tail(n, i, j)
}

/// `\s+(?!\S)|\s+` on a maximal whitespace run `[i, j)`.
#[inline]
fn whitespace_tail(n: usize, i: usize, j: usize) -> usize {
    if j == n {
        j
    } else if j - i >= 2 {
        j - 1
    } else {
        i + 1
    }
}

/// The GPT-2 pattern (case-sensitive contractions):
///
/// ```text
/// 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
/// ```
///
/// Appends the byte ranges of the pieces of `s[base..]`-relative text to
/// `out`, offset by `base`.
pub(crate) fn split_gpt2(s: &str, base: usize, out: &mut Vec<(usize, usize)>) {
    let t = Chars::new(s);
    let n = t.len();
    let mut i = 0;
    while i < n {
        let end = gpt2_match(&t, i);
        debug_assert!(end > i);
        out.push((base + t.offs[i], base + t.offs[end]));
        i = end;
    }
}

fn gpt2_match(t: &Chars, i: usize) -> usize {
    let n = t.len();
    let c = t.cs[i];
    if c == '\'' && i + 1 < n {
        let c1 = t.cs[i + 1];
        if matches!(c1, 's' | 't' | 'm' | 'd') {
            return i + 2;
        }
        if i + 2 < n {
            let c2 = t.cs[i + 2];
            if matches!((c1, c2), ('r', 'e') | ('v', 'e') | ('l', 'l')) {
                return i + 3;
            }
        }
    }
    let k = t.cl[i];
    // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`
    if k != Class::Space {
        return t.run(i, k);
    }
    if c == ' ' && i + 1 < n && t.cl[i + 1] != Class::Space {
        return t.run(i + 1, t.cl[i + 1]);
    }
    let j = t.run(i, Class::Space);
    whitespace_tail(n, i, j)
}

/// The split used by llama.cpp's `smollm` (and StarCoder-like) pre-tokenizer
/// and by the original SmolLM `tokenizer.json` (`Digits(individual_digits)`
/// followed by `ByteLevel`): every `\p{N}` character is its own piece, the
/// text between is split with the GPT-2 pattern.
pub(crate) fn split_digits_then_gpt2(s: &str, out: &mut Vec<(usize, usize)>) {
    let mut start = 0;
    for (i, c) in s.char_indices() {
        if is_number(c) {
            if start < i {
                split_gpt2(&s[start..i], start, out);
            }
            out.push((i, i + c.len_utf8()));
            start = i + c.len_utf8();
        }
    }
    if start < s.len() {
        split_gpt2(&s[start..], start, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pieces(f: fn(&str, &mut Vec<(usize, usize)>), s: &str) -> Vec<String> {
        let mut v = Vec::new();
        f(s, &mut v);
        v.iter().map(|&(a, b)| s[a..b].to_string()).collect()
    }
    fn l3(s: &str) -> Vec<String> {
        pieces(split_llama3, s)
    }
    fn g2(s: &str) -> Vec<String> {
        pieces(|s, o| split_gpt2(s, 0, o), s)
    }

    #[test]
    fn llama3_whitespace_rules() {
        assert_eq!(l3("a   b"), ["a", "  ", " b"]);
        assert_eq!(l3("trailing  "), ["trailing", "  "]);
        assert_eq!(l3("x\n\n\ny"), ["x", "\n\n\n", "y"]);
        assert_eq!(l3("x \n  y"), ["x", " \n", " ", " y"]);
        assert_eq!(l3("  leading"), [" ", " leading"]);
    }

    #[test]
    fn llama3_numbers_contractions_punct() {
        assert_eq!(l3("12345"), ["123", "45"]);
        assert_eq!(l3("I'M don't"), ["I", "'M", " don", "'t"]);
        assert_eq!(l3("WE'LL"), ["WE", "'LL"]);
        assert_eq!(l3("a+=b;\n"), ["a", "+=", "b", ";\n"]);
        assert_eq!(l3(" !!x"), [" !!", "x"]);
    }

    #[test]
    fn qwen2_digits_alone() {
        let q = |s| pieces(split_qwen2, s);
        assert_eq!(q("x 12345"), ["x", " ", "1", "2", "3", "4", "5"]);
        assert_eq!(q("I'M a+=b;\n"), ["I", "'M", " a", "+=", "b", ";\n"]);
    }

    #[test]
    fn gpt2_rules() {
        assert_eq!(g2("a   b"), ["a", "  ", " b"]);
        assert_eq!(g2("I'M don't"), ["I", "'", "M", " don", "'t"]);
        assert_eq!(g2("x 123"), ["x", " 123"]);
        assert_eq!(g2("  "), ["  "]);
    }

    #[test]
    fn digits_isolated() {
        let v = pieces(split_digits_then_gpt2, "ab 12c");
        assert_eq!(v, ["ab", " ", "1", "2", "c"]);
    }
}
