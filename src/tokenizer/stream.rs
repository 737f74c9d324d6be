//! Incremental decoding of a stream of token ids.
//!
//! A multi-byte UTF-8 character can be split over several tokens (byte
//! tokens, or byte-level BPE tokens that end mid-character). The
//! [`StreamDecoder`] keeps the bytes of an unfinished character and emits it
//! only once it is complete. Bytes that can never start or continue a valid
//! sequence become U+FFFD at once; [`StreamDecoder::flush`] turns a trailing
//! incomplete sequence into U+FFFD.
use super::Tokenizer;

/// Turns token ids into text as they arrive.
pub struct StreamDecoder<'a> {
    tok: &'a Tokenizer,
    pending: Vec<u8>,
}

impl<'a> StreamDecoder<'a> {
    pub fn new(tok: &'a Tokenizer) -> Self {
        StreamDecoder {
            tok,
            pending: Vec::new(),
        }
    }

    /// Add one token; returns the text that became complete (may be empty).
    /// An out-of-range id yields U+FFFD (after any pending bytes, which are
    /// then incomplete and also become U+FFFD).
    pub fn push(&mut self, id: u32) -> String {
        match self.tok.token_bytes(id) {
            Some(b) => {
                self.pending.extend_from_slice(b);
                self.drain(false)
            }
            None => {
                let mut s = self.flush();
                s.push('\u{FFFD}');
                s
            }
        }
    }

    /// Add raw bytes; returns the text that became complete.
    pub fn push_bytes(&mut self, b: &[u8]) -> String {
        self.pending.extend_from_slice(b);
        self.drain(false)
    }

    /// Emit whatever is pending; an incomplete trailing sequence becomes
    /// U+FFFD.
    pub fn flush(&mut self) -> String {
        self.drain(true)
    }

    /// Bytes held back waiting for the rest of a character.
    pub fn pending_bytes(&self) -> &[u8] {
        &self.pending
    }

    fn drain(&mut self, at_end: bool) -> String {
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let ok = e.valid_up_to();
                    // The prefix was just validated, so this cannot fail.
                    out.push_str(std::str::from_utf8(&rest[..ok]).unwrap_or_default());
                    match e.error_len() {
                        Some(bad) => {
                            out.push('\u{FFFD}');
                            rest = &rest[ok + bad..];
                        }
                        None => {
                            // Incomplete sequence at the end.
                            if at_end {
                                out.push('\u{FFFD}');
                                rest = &[];
                            } else {
                                rest = &rest[ok..];
                            }
                            break;
                        }
                    }
                }
            }
        }
        let keep = rest.to_vec();
        self.pending = keep;
        out
    }
}
