//! Stop strings that may be split across tokens.
//!
//! Text is held back while it could still be the start of a stop string, so
//! a stop string is never half-printed.

/// Watches generated text for stop strings, holding back what could still
/// become one.
///
/// ```
/// use llama_graph::generate::{StopMatcher, StopStatus};
///
/// let mut m = StopMatcher::new(vec!["END".into()]);
/// assert_eq!(m.push("one E"), StopStatus::Continue("one ".into()));
/// assert_eq!(m.push("N"), StopStatus::Continue("".into()));
/// assert_eq!(m.push("D two"), StopStatus::Stopped("".into()));
/// ```
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    pending: String,
}

/// What to do after feeding a piece of text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopStatus {
    /// Print `0`; go on.
    Continue(String),
    /// Print `0` (the text before the stop string); stop.
    Stopped(String),
}

impl StopMatcher {
    /// A matcher for `stops` (empty strings are ignored).
    pub fn new(stops: Vec<String>) -> Self {
        StopMatcher {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            pending: String::new(),
        }
    }

    /// Feeds the next piece of text; says what may be printed now.
    pub fn push(&mut self, text: &str) -> StopStatus {
        if self.stops.is_empty() {
            return StopStatus::Continue(text.to_string());
        }
        self.pending.push_str(text);
        if let Some(at) = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min()
        {
            let out = self.pending[..at].to_string();
            self.pending.clear();
            return StopStatus::Stopped(out);
        }
        // Hold back the longest suffix that is a proper prefix of a stop string.
        let mut hold = 0;
        for s in &self.stops {
            for (i, _) in s.char_indices().skip(1) {
                if self.pending.ends_with(&s[..i]) {
                    hold = hold.max(i);
                }
            }
        }
        let cut = self.pending.len() - hold;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        StopStatus::Continue(out)
    }

    /// The held-back text, at the end of generation.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_stop_string_is_never_printed() {
        let mut m = StopMatcher::new(vec!["User:".into()]);
        assert_eq!(m.push("Hello. Us"), StopStatus::Continue("Hello. ".into()));
        assert_eq!(m.push("er"), StopStatus::Continue(String::new()));
        assert_eq!(m.push(": hi"), StopStatus::Stopped(String::new()));
    }

    #[test]
    fn false_start_is_released() {
        let mut m = StopMatcher::new(vec!["User:".into()]);
        assert_eq!(m.push("Us"), StopStatus::Continue(String::new()));
        assert_eq!(m.push("ually"), StopStatus::Continue("Usually".into()));
        assert_eq!(m.push(" U"), StopStatus::Continue(" ".into()));
        assert_eq!(m.finish(), "U");
    }

    #[test]
    fn earliest_stop_wins_and_text_before_is_kept() {
        let mut m = StopMatcher::new(vec!["\n\n".into(), "END".into()]);
        assert_eq!(m.push("abc END x\n\n"), StopStatus::Stopped("abc ".into()));
    }

    #[test]
    fn multibyte_prefixes() {
        let mut m = StopMatcher::new(vec!["é!".into()]);
        assert_eq!(m.push("café"), StopStatus::Continue("caf".into()));
        assert_eq!(m.push("?"), StopStatus::Continue("é?".into()));
    }
}
