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
