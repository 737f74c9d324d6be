//! The pipeline protocol between stage ranks.
//!
//! Rank 0 runs stage 0 (the embedding and the first layers) and owns
//! everything outside the graph: the tokenizer, the sampler, the prompt,
//! the KV pool's block allocator. Each step it sends the next rank the
//! step's batch (its tokens, the sequence table with each sequence's first
//! token, token count, start position and block-list offset, and the block
//! table, and the block copies to apply first: see [`crate::exec::Batch`]),
//! whether logits are wanted, and the
//! `[S, dim]` hidden state, little-endian. Each middle rank runs its stage on it
//! and sends the same header with its own output onward; the last rank
//! sends the logits back to rank 0 when the header asks for them (the last
//! chunk of a prompt, every decode step). A stop message travels down the
//! same ordered stream, so every rank ends after the last step.
//!
//! The batch carries everything a stage needs to bind the step, so stages
//! keep no state of their own beyond their KV pool, whose geometry is the
//! same on every stage: the block tables rank 0 allocates address every
//! stage's pool alike. Several batches can be in flight: rank 0 can start a
//! step of one sequence while the later stages still work on another's
//! (micro-batches).

use super::{DistError, Tag, Transport};
use crate::exec::{Batch, Executor};

/// What travels with a batch besides its tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepHeader {
    /// Whether the last rank sends the logits back.
    pub want_logits: bool,
}

/// A message of the stage stream.
#[derive(Debug, Clone, PartialEq)]
pub enum StageMsg {
    /// A step: its header, its batch and the hidden state of its tokens.
    Step(StepHeader, Batch, Vec<f32>),
    /// The end of the job: empty for a clean stop, else why rank 0 stopped.
    Stop(String),
    /// A probe of the link's cost: rank 1 sends the same bytes straight
    /// back to rank 0 (under [`Tag::Probe`]).
    Echo(Vec<u8>),
}

const KIND_STEP: u32 = 1;
const KIND_STOP: u32 = 2;
const KIND_ECHO: u32 = 3;
/// kind, flags, token count, sequence-table values, block count,
/// copy-table values, hidden values.
const HEADER_WORDS: usize = 8;
const HEADER_BYTES: usize = 4 * HEADER_WORDS;

fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn f32s_to_bytes(out: &mut Vec<u8>, v: &[f32]) {
    out.reserve(v.len() * 4);
    for x in v {
        out.extend_from_slice(&x.to_le_bytes());
    }
}

fn bytes_to_f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn bytes_to_i32s(b: &[u8]) -> Vec<i32> {
    b.chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]])
}

/// Bytes of a step message: the header, the batch's tables (4 bytes per
/// token, 20 per sequence, 4 per block, 8 per block copy, 4 per entry of
/// the window layers' block table) and the hidden state.
pub fn step_bytes(batch: &Batch, hidden: usize) -> usize {
    HEADER_BYTES
        + 4 * (batch.tokens().len()
            + batch.seq_table().len()
            + batch.block_table().len()
            + batch.copy_table().len()
            + batch.window_block_table().len()
            + hidden)
}

/// Encodes a step.
pub fn encode_step(h: &StepHeader, batch: &Batch, hidden: &[f32]) -> Vec<u8> {
    let (t, q, bl) = (batch.tokens(), batch.seq_table(), batch.block_table());
    let (cp, wb) = (batch.copy_table(), batch.window_block_table());
    let mut out = Vec::with_capacity(step_bytes(batch, hidden.len()));
    for w in [
        KIND_STEP,
        u32::from(h.want_logits),
        t.len() as u32,
        q.len() as u32,
        bl.len() as u32,
        cp.len() as u32,
        wb.len() as u32,
        hidden.len() as u32,
    ] {
        put_u32(&mut out, w);
    }
    for v in t.iter().chain(q).chain(bl).chain(cp).chain(wb) {
        out.extend_from_slice(&v.to_le_bytes());
    }
    f32s_to_bytes(&mut out, hidden);
    out
}

/// Encodes a stop with its reason (empty: a clean stop).
pub fn encode_stop(reason: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + reason.len());
    put_u32(&mut out, KIND_STOP);
    out.extend_from_slice(reason.as_bytes());
    out
}

/// Encodes an echo probe of `len` payload bytes.
pub fn encode_echo(len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + len);
    put_u32(&mut out, KIND_ECHO);
    out.resize(4 + len, 0x5a);
    out
}

/// Decodes a stage message from rank `peer`, checking every length.
pub fn decode_stage(b: &[u8], peer: usize) -> Result<StageMsg, DistError> {
    let bad = |message: String| DistError::Protocol {
        peer,
        what: "stage",
        message,
    };
    if b.len() < 4 {
        return Err(bad(format!("{} bytes, not even a kind", b.len())));
    }
    match u32_at(b, 0) {
        KIND_STOP => Ok(StageMsg::Stop(
            String::from_utf8_lossy(&b[4..]).into_owned(),
        )),
        KIND_ECHO => Ok(StageMsg::Echo(b.to_vec())),
        KIND_STEP => {
            if b.len() < HEADER_BYTES {
                return Err(bad(format!("a step header of {} bytes", b.len())));
            }
            let n: Vec<usize> = (2..HEADER_WORDS).map(|i| u32_at(b, i) as usize).collect();
            let want = n
                .iter()
                .try_fold(0usize, |a, &x| a.checked_add(x))
                .and_then(|w| w.checked_mul(4))
                .and_then(|w| w.checked_add(HEADER_BYTES));
            if want != Some(b.len()) {
                return Err(bad(format!(
                    "{} tokens, {} sequence-table values, {} blocks, {} copy-table values, {} window blocks and {} hidden values announced, {} bytes follow",
                    n[0],
                    n[1],
                    n[2],
                    n[3],
                    n[4],
                    n[5],
                    b.len() - HEADER_BYTES
                )));
            }
            let mut at = HEADER_BYTES;
            let mut take = |k: usize| {
                let r = &b[at..at + 4 * k];
                at += 4 * k;
                r
            };
            let tokens = bytes_to_i32s(take(n[0]));
            let seqs = bytes_to_i32s(take(n[1]));
            let blocks = bytes_to_i32s(take(n[2]));
            let copies = bytes_to_i32s(take(n[3]));
            let window = bytes_to_i32s(take(n[4]));
            let hidden = bytes_to_f32s(take(n[5]));
            let h = StepHeader {
                want_logits: u32_at(b, 1) & 1 == 1,
            };
            Ok(StageMsg::Step(
                h,
                Batch::from_parts(tokens, seqs, blocks, copies).with_window_table(window),
                hidden,
            ))
        }
        k => Err(bad(format!("unknown kind {k}"))),
    }
}

/// Logits of one step, from the last rank to rank 0.
#[derive(Debug, Clone, PartialEq)]
pub struct LogitsMsg {
    pub rows: usize,
    pub width: usize,
    pub data: Vec<f32>,
}

pub fn encode_logits(rows: usize, width: usize, data: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + data.len() * 4);
    put_u32(&mut out, rows as u32);
    put_u32(&mut out, width as u32);
    f32s_to_bytes(&mut out, data);
    out
}

pub fn decode_logits(b: &[u8], peer: usize) -> Result<LogitsMsg, DistError> {
    let bad = |message: String| DistError::Protocol {
        peer,
        what: "logits",
        message,
    };
    if b.len() < 8 {
        return Err(bad(format!("{} bytes", b.len())));
    }
    let (rows, width) = (u32_at(b, 0) as usize, u32_at(b, 1) as usize);
    if rows.checked_mul(width).and_then(|n| n.checked_mul(4)) != Some(b.len() - 8) {
        return Err(bad(format!(
            "{rows} x {width} values announced, {} bytes follow",
            b.len() - 8
        )));
    }
    Ok(LogitsMsg {
        rows,
        width,
        data: bytes_to_f32s(&b[8..]),
    })
}

/// Rank 0's end of the pipeline: sends steps to rank 1, receives logits
/// from the last rank.
///
/// Dropped without [`PipelineLink::stop`] (rank 0 leaving on an error
/// path), it stops the other ranks with that reason, so none waits for a
/// step that will never come.
pub struct PipelineLink {
    transport: Box<dyn Transport>,
    stopped: bool,
}

impl PipelineLink {
    /// Rank 0 of a transport with at least two ranks.
    pub fn new(transport: Box<dyn Transport>) -> Result<Self, DistError> {
        if transport.rank() != 0 || transport.size() < 2 {
            return Err(DistError::Transport(format!(
                "a pipeline link is rank 0 of two or more ranks, not rank {} of {}",
                transport.rank(),
                transport.size()
            )));
        }
        Ok(PipelineLink {
            transport,
            stopped: false,
        })
    }

    pub fn n_stages(&self) -> usize {
        self.transport.size()
    }

    /// Sends a step (its batch and stage 0's output) to rank 1.
    pub fn forward(
        &mut self,
        h: &StepHeader,
        batch: &Batch,
        hidden: &[f32],
    ) -> Result<(), DistError> {
        self.transport
            .send(1, Tag::Stage, encode_step(h, batch, hidden))
    }

    /// Waits for the next logits from the last rank.
    pub fn recv_logits(&mut self) -> Result<LogitsMsg, DistError> {
        let last = self.transport.size() - 1;
        let b = self.transport.recv(last, Tag::Logits)?;
        decode_logits(&b, last)
    }

    /// One pipelined step as rank 0 sees it: stage 0's output `hidden` for
    /// `batch` goes on to rank 1 and, when `want_logits`, the last stage's
    /// logits come back, checked (rows of `vocab`, one to
    /// `batch.n_tokens()` of them). Without `want_logits`, `None`.
    pub fn relay_step(
        &mut self,
        batch: &Batch,
        hidden: &[f32],
        want_logits: bool,
        vocab: usize,
    ) -> Result<Option<LogitsMsg>, DistError> {
        self.forward(&StepHeader { want_logits }, batch, hidden)?;
        if !want_logits {
            return Ok(None);
        }
        let l = self.recv_logits()?;
        if l.width != vocab || l.rows == 0 || l.rows > batch.n_tokens() {
            return Err(DistError::Transport(format!(
                "the last stage sent {} x {} logits for a step of {} sequences and {} tokens, expected rows of {}",
                l.rows,
                l.width,
                batch.n_seqs(),
                batch.n_tokens(),
                vocab
            )));
        }
        Ok(Some(l))
    }

    /// Tells every rank to stop (`reason` empty: cleanly), then ends this
    /// rank's part of the job.
    pub fn stop(&mut self, reason: &str) -> Result<(), DistError> {
        if self.stopped {
            return Ok(());
        }
        self.stopped = true;
        let r = self.transport.send(1, Tag::Stage, encode_stop(reason));
        self.transport.finish();
        r
    }

    /// One round trip of a message of `len` payload bytes to rank 1 and
    /// back: twice the cost of one hop of that size.
    pub fn round_trip(&mut self, len: usize) -> Result<std::time::Duration, DistError> {
        let msg = encode_echo(len);
        let t0 = std::time::Instant::now();
        self.transport.send(1, Tag::Stage, msg)?;
        let b = self.transport.recv(1, Tag::Probe)?;
        let dt = t0.elapsed();
        if b.len() != len + 4 {
            return Err(DistError::Protocol {
                peer: 1,
                what: "echo",
                message: format!("{} bytes back for {}", b.len(), len + 4),
            });
        }
        Ok(dt)
    }

    /// Ends the whole job after an error rank 0 already reported.
    pub fn abort(&mut self, code: i32) {
        self.stopped = true;
        self.transport.abort(code);
    }

    pub fn transport(&mut self) -> &mut dyn Transport {
        self.transport.as_mut()
    }
}

impl Drop for PipelineLink {
    fn drop(&mut self) {
        let _ = self.stop("rank 0 ended without stopping the pipeline");
    }
}

/// The loop of every rank but 0: receive a step from the previous rank,
/// run this stage, send the result on (the hidden state to the next rank,
/// or the logits back to rank 0 from the last one), until a stop comes.
/// Returns the stop's reason (empty for a clean stop).
///
/// The next step is awaited without a deadline ([`Transport::recv_idle`]):
/// a pipeline may be idle for as long as its leader has no work (a server
/// between requests). A dead or silent peer is still noticed by the
/// transport, and a step that never comes back is rank 0's deadline.
pub fn serve_stage(exec: &mut Executor, transport: &mut dyn Transport) -> Result<String, String> {
    let (rank, size) = (transport.rank(), transport.size());
    let last = rank + 1 == size;
    loop {
        let b = transport
            .recv_idle(rank - 1, Tag::Stage)
            .map_err(|e| e.to_string())?;
        match decode_stage(&b, rank - 1).map_err(|e| e.to_string())? {
            StageMsg::Stop(reason) => {
                if !last {
                    transport
                        .send(rank + 1, Tag::Stage, encode_stop(&reason))
                        .map_err(|e| e.to_string())?;
                }
                return Ok(reason);
            }
            StageMsg::Echo(bytes) => {
                transport
                    .send(0, Tag::Probe, bytes)
                    .map_err(|e| e.to_string())?;
            }
            StageMsg::Step(h, batch, hidden) => {
                let out = exec.step_with(&batch, &hidden).map_err(|e| e.to_string())?;
                let msg = if last {
                    if !h.want_logits {
                        continue;
                    }
                    (0, Tag::Logits, encode_logits(out.rows, out.vocab, out.data))
                } else {
                    (rank + 1, Tag::Stage, encode_step(&h, &batch, out.data))
                };
                transport
                    .send(msg.0, msg.1, msg.2)
                    .map_err(|e| e.to_string())?;
            }
        }
    }
}

/// Start-up agreement: every rank reports how opening its stage went; rank
/// 0 sends back the first failure (its own first, then by rank), so every
/// rank fails with the same message, or none does.
pub fn agree(transport: &mut dyn Transport, mine: Result<(), String>) -> Result<(), String> {
    let (rank, size) = (transport.rank(), transport.size());
    let encode = |r: &Result<(), String>| match r {
        Ok(()) => Vec::new(),
        Err(m) => m.clone().into_bytes(),
    };
    let verdict: Result<(), String> = if rank == 0 {
        let mut first = mine.map_err(|m| format!("rank 0: {m}"));
        for r in 1..size {
            let b = transport.recv(r, Tag::Status).map_err(|e| e.to_string())?;
            if first.is_ok() && !b.is_empty() {
                first = Err(format!("rank {r}: {}", String::from_utf8_lossy(&b)));
            }
        }
        for r in 1..size {
            transport
                .send(r, Tag::Status, encode(&first))
                .map_err(|e| e.to_string())?;
        }
        first
    } else {
        transport
            .send(0, Tag::Status, encode(&mine))
            .map_err(|e| e.to_string())?;
        let b = transport.recv(0, Tag::Status).map_err(|e| e.to_string())?;
        if b.is_empty() {
            Ok(())
        } else {
            Err(String::from_utf8_lossy(&b).into_owned())
        }
    };
    verdict
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_and_logits_round_trip() {
        let h = StepHeader { want_logits: true };
        let mut batch = Batch::with_capacity(8, 2, 4);
        batch.push_ring(&[5, 6], 17, &[3, 1], &[7], 1);
        batch.push(&[9], 4, &[0]);
        batch.copy_block(2, 0);
        assert_eq!(batch.window_block_table(), &[7, 7]);
        let v = [1.5f32, -0.25, 3.0, f32::MIN_POSITIVE, 0.0, 7.0];
        let b = encode_step(&h, &batch, &v);
        // 8 header words; 3 tokens, 2 sequence rows of 5, 3 blocks, one
        // copy, 2 window blocks, 6 hidden values.
        assert_eq!(b.len(), 4 * 8 + 4 * (3 + 10 + 3 + 2 + 2 + 6));
        assert_eq!(b.len(), step_bytes(&batch, 6));
        assert_eq!(
            decode_stage(&b, 0).unwrap(),
            StageMsg::Step(h, batch, v.to_vec())
        );
        assert_eq!(
            decode_stage(&encode_stop("no"), 0).unwrap(),
            StageMsg::Stop("no".into())
        );
        assert_eq!(
            decode_stage(&encode_echo(5), 1).unwrap(),
            StageMsg::Echo(encode_echo(5))
        );
        let l = decode_logits(&encode_logits(1, 4, &v[..4]), 2).unwrap();
        assert_eq!((l.rows, l.width, l.data), (1, 4, v[..4].to_vec()));
    }

    #[test]
    fn malformed_messages_are_refused() {
        let h = StepHeader { want_logits: false };
        let mut batch = Batch::with_capacity(1, 1, 1);
        batch.push(&[1], 0, &[0]);
        let mut b = encode_step(&h, &batch, &[1.0, 2.0]);
        b.pop();
        let e = decode_stage(&b, 4).unwrap_err().to_string();
        assert!(
            e.contains("rank 4") && e.contains("2 hidden values announced"),
            "{e}"
        );
        assert!(decode_stage(&[9, 0, 0, 0], 1).is_err());
        assert!(decode_stage(&[], 1).is_err());
        assert!(decode_logits(&encode_logits(2, 4, &[0.0; 7]), 1).is_err());
    }
}
