//! Token ids to response text, incrementally: the streaming UTF-8 decoder
//! (a character split over tokens is sent once complete) followed by the
//! stop-string matcher (text that may start a stop string is held back, a
//! stop string is never sent).

use crate::generate::stop::{StopMatcher, StopStatus};
use crate::tokenizer::{StreamDecoder, Tokenizer};

pub struct TextStream<'a> {
    decoder: StreamDecoder<'a>,
    stops: StopMatcher,
    stopped: bool,
}

impl<'a> TextStream<'a> {
    pub fn new(tok: &'a Tokenizer, stops: Vec<String>) -> Self {
        TextStream {
            decoder: StreamDecoder::new(tok),
            stops: StopMatcher::new(stops),
            stopped: false,
        }
    }

    /// Adds one token; returns the text now safe to send, and whether a
    /// stop string ended the text (then nothing more is to be sent).
    pub fn push(&mut self, id: u32) -> (String, bool) {
        if self.stopped {
            return (String::new(), true);
        }
        let piece = self.decoder.push(id);
        match self.stops.push(&piece) {
            StopStatus::Continue(s) => (s, false),
            StopStatus::Stopped(s) => {
                self.stopped = true;
                (s, true)
            }
        }
    }

    /// The text still held back, at the end of the sequence (an unfinished
    /// character becomes U+FFFD; a stop string may still complete in it).
    pub fn finish(&mut self) -> (String, bool) {
        if self.stopped {
            return (String::new(), true);
        }
        let rest = self.decoder.flush();
        let (mut out, stopped) = match self.stops.push(&rest) {
            StopStatus::Continue(s) => (s, false),
            StopStatus::Stopped(s) => (s, true),
        };
        if !stopped {
            out.push_str(&self.stops.finish());
        }
        self.stopped = true;
        (out, stopped)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::gguf::GgufTokenizerParts;

    /// Byte-level tokens: "Ã" and "©" are the bytes 0xC3 and 0xA9, which
    /// together are "é".
    fn tok() -> Tokenizer {
        let toks = ["c", "a", "f", "Ã", "©", "!", "x"];
        Tokenizer::from_gguf_parts(GgufTokenizerParts {
            model: "gpt2".into(),
            pre: Some("gpt2".into()),
            tokens: toks.iter().map(|s| s.as_bytes().to_vec()).collect(),
            merges: Some(vec![]),
            ..Default::default()
        })
        .unwrap()
    }

    fn push_all(t: &mut TextStream, ids: &[u32]) -> Vec<(String, bool)> {
        ids.iter().map(|&i| t.push(i)).collect()
    }

    #[test]
    fn a_character_split_over_tokens_is_sent_once_whole() {
        let tk = tok();
        let mut t = TextStream::new(&tk, vec![]);
        let out = push_all(&mut t, &[0, 1, 2, 3, 4, 5]);
        let texts: Vec<&str> = out.iter().map(|(s, _)| s.as_str()).collect();
        assert_eq!(texts, ["c", "a", "f", "", "é", "!"]);
        assert_eq!(t.finish(), (String::new(), false));
    }

    #[test]
    fn stop_strings_across_tokens_are_never_sent() {
        let tk = tok();
        let mut t = TextStream::new(&tk, vec!["é!".into()]);
        let out = push_all(&mut t, &[0, 1, 2, 3, 4]);
        assert_eq!(
            out.iter().map(|(s, _)| s.as_str()).collect::<String>(),
            "caf"
        );
        assert_eq!(t.push(5), (String::new(), true));
        // Nothing after the stop.
        assert_eq!(t.push(0), (String::new(), true));
        assert_eq!(t.finish(), (String::new(), true));
    }

    #[test]
    fn held_back_text_is_released_at_the_end() {
        let tk = tok();
        let mut t = TextStream::new(&tk, vec!["ax!".into()]);
        assert_eq!(
            push_all(&mut t, &[0, 1, 6]),
            [
                ("c".into(), false),
                (String::new(), false),
                (String::new(), false)
            ]
        );
        assert_eq!(t.finish(), ("ax".into(), false));
        // An unfinished character at the end becomes U+FFFD.
        let mut t = TextStream::new(&tk, vec![]);
        assert_eq!(t.push(3), (String::new(), false));
        assert_eq!(t.finish(), ("\u{FFFD}".into(), false));
    }
}
