//! A [`Transport`] between threads of one process: every rank has an inbox
//! (a channel) that every other rank holds a sender to. It runs the same
//! protocol as MPI does, so the pipeline is tested without an MPI runtime,
//! and a rank whose transport is dropped is seen as gone by the others.

use super::{DistError, Inbox, Tag, Transport};
use std::sync::mpsc::{channel, Sender};
use std::time::{Duration, Instant};

type Envelope = (usize, Tag, Vec<u8>);

pub struct LocalTransport {
    rank: usize,
    peers: Vec<Option<Sender<Envelope>>>,
    inbox: Inbox,
    timeout: Duration,
}

impl LocalTransport {
    /// `n` connected ranks; a receive waits at most `timeout`.
    pub fn mesh(n: usize, timeout: Duration) -> Vec<LocalTransport> {
        let (txs, rxs): (Vec<_>, Vec<_>) = (0..n).map(|_| channel::<Envelope>()).unzip();
        rxs.into_iter()
            .enumerate()
            .map(|(rank, inbox)| LocalTransport {
                rank,
                peers: txs
                    .iter()
                    .enumerate()
                    .map(|(r, t)| (r != rank).then(|| t.clone()))
                    .collect(),
                inbox: Inbox::new(inbox),
                timeout,
            })
            .collect()
    }
}

impl LocalTransport {
    /// The next message from `from` under `tag`, waiting until `deadline`
    /// (`None`: for as long as the peer lives).
    fn recv_until(
        &mut self,
        from: usize,
        tag: Tag,
        deadline: Option<Instant>,
    ) -> Result<Vec<u8>, DistError> {
        self.inbox
            .recv_until(from, tag, deadline, self.timeout, || DistError::PeerGone {
                peer: from,
            })
    }
}

impl Transport for LocalTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.peers.len()
    }

    fn send(&mut self, to: usize, tag: Tag, bytes: Vec<u8>) -> Result<(), DistError> {
        let tx = self
            .peers
            .get(to)
            .and_then(|p| p.as_ref())
            .ok_or_else(|| DistError::Transport(format!("no rank {to} to send to")))?;
        tx.send((self.rank, tag, bytes))
            .map_err(|_| DistError::PeerGone { peer: to })
    }

    fn recv(&mut self, from: usize, tag: Tag) -> Result<Vec<u8>, DistError> {
        self.recv_until(from, tag, Some(Instant::now() + self.timeout))
    }

    fn recv_idle(&mut self, from: usize, tag: Tag) -> Result<Vec<u8>, DistError> {
        self.recv_until(from, tag, None)
    }
    fn abort(&mut self, _code: i32) {
        // Dropping the senders lets the peers see this rank gone once they
        // drain their inboxes.
        for p in &mut self.peers {
            *p = None;
        }
    }
}
