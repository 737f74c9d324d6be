//! Running one model as a pipeline of processes: each rank runs one stage
//! of the partitioned graph (see [`crate::passes::partition`](mod@crate::passes::partition)) and passes
//! the hidden state to the next over a [`Transport`].
//!
//! * [`Transport`]: ordered messages between ranks. [`local::LocalTransport`]
//!   connects threads of one process (tests, and the protocol without MPI);
//!   `mpi::MpiTransport` (cargo feature `mpi`) connects the processes of an
//!   `mpirun` job over OpenMPI.
//! * [`stage`]: the wire protocol (a step header with the step's token
//!   count, positions and sequence slot, then the `[S, dim]` hidden state),
//!   rank 0's [`stage::PipelineLink`] and the loop every other rank runs
//!   ([`stage::serve_stage`]), and the start-up agreement that makes a
//!   failure on one rank fail every rank with the same message.
//!
//! Failure: a rank that fails says why and stops the job
//! ([`Transport::abort`]: `MPI_Abort`, so `mpirun` ends every rank); a rank
//! killed outright is noticed by `mpirun`, which ends the job; and every
//! receive has a deadline and the MPI transport exchanges heartbeats, so a
//! rank that stops answering without exiting (stopped, hung host, lost
//! network) is declared dead after the timeout instead of hanging the others.

pub mod local;
#[cfg(feature = "mpi")]
pub mod mpi;
pub mod stage;

use std::time::Duration;
use thiserror::Error;

/// What a message is, so that streams of different kinds never mix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum Tag {
    /// Start-up: each rank's outcome of opening the model (to rank 0), then
    /// the verdict (from rank 0).
    Status = 1,
    /// The stage stream: steps (header + hidden state) and the final stop,
    /// from rank `k` to rank `k + 1`, in order.
    Stage = 2,
    /// Logits from the last rank back to rank 0.
    Logits = 3,
    /// Measurements of the transport itself (ping-pong).
    Probe = 4,
}

impl Tag {
    pub fn from_i32(t: i32) -> Option<Tag> {
        Some(match t {
            1 => Tag::Status,
            2 => Tag::Stage,
            3 => Tag::Logits,
            4 => Tag::Probe,
            _ => return None,
        })
    }
}

#[derive(Debug, Clone, PartialEq, Error)]
pub enum DistError {
    #[error("rank {peer} did not answer within {secs:.1} s (it died, hangs, or the network is down); stopping")]
    Timeout { peer: usize, secs: f64 },
    #[error("rank {peer} is gone (its process ended)")]
    PeerGone { peer: usize },
    #[error("rank {peer} sent a malformed {what} message: {message}")]
    Protocol {
        peer: usize,
        what: &'static str,
        message: String,
    },
    #[error("rank {rank} failed: {message}")]
    Remote { rank: usize, message: String },
    #[error("{0}")]
    Transport(String),
}

/// Ordered, reliable messages between the ranks of one job. Messages from
/// one rank to another under one tag arrive in the order they were sent.
pub trait Transport: Send {
    /// This process's rank, `0..size()`.
    fn rank(&self) -> usize;
    /// The number of ranks.
    fn size(&self) -> usize;
    /// Sends `bytes` to rank `to`.
    fn send(&mut self, to: usize, tag: Tag, bytes: Vec<u8>) -> Result<(), DistError>;
    /// Waits for the next message from rank `from` under `tag`; fails when
    /// the peer is known dead or nothing came within the transport's timeout.
    fn recv(&mut self, from: usize, tag: Tag) -> Result<Vec<u8>, DistError>;
    /// Like [`Transport::recv`] without the deadline: for a rank that waits
    /// for work, which may not come for as long as the job is idle (a stage
    /// of a server between requests). A peer that dies is still noticed
    /// (heartbeats under MPI, its dropped sender in one process).
    fn recv_idle(&mut self, from: usize, tag: Tag) -> Result<Vec<u8>, DistError>;
    /// Ends the whole job after a failure that was already reported
    /// (`MPI_Abort` under MPI). Local transports return, and their peers
    /// see this rank gone.
    fn abort(&mut self, code: i32);
    /// Ends this rank's part of the job in order (`MPI_Finalize` under MPI).
    fn finish(&mut self) {}
}

/// How long a receive waits for a message before the peer is declared
/// dead, unless `LLAMA_GRAPH_PIPELINE_TIMEOUT` (seconds) says otherwise.
/// Long enough for the slowest step of a large model (a prefill chunk of a
/// 70B stage on a busy host), short enough that a hang is reported within
/// the minute; heartbeats (MPI) catch a dead or stopped rank much sooner.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// The environment variable that overrides [`DEFAULT_TIMEOUT`].
pub const TIMEOUT_ENV: &str = "LLAMA_GRAPH_PIPELINE_TIMEOUT";

/// The receive timeout in force.
pub fn timeout_from_env() -> Result<Duration, String> {
    match std::env::var(TIMEOUT_ENV) {
        Err(_) => Ok(DEFAULT_TIMEOUT),
        Ok(v) => match v.trim().parse::<f64>() {
            Ok(s) if s > 0.0 && s.is_finite() => Ok(Duration::from_secs_f64(s)),
            _ => Err(format!(
                "{TIMEOUT_ENV}={v:?}: expected a positive number of seconds"
            )),
        },
    }
}

/// The stage plan every rank computes the same way from the model: counts
/// from `--layers-per-stage`, or balanced by weight bytes over `n_stages`.
pub fn stage_plan(
    args: &crate::model::ModelArgs,
    dtypes: &std::collections::BTreeMap<String, crate::ir::DType>,
    n_stages: usize,
    layers_per_stage: Option<&[usize]>,
) -> Result<crate::passes::StagePlan, String> {
    use crate::passes::StagePlan;
    if let Some(counts) = layers_per_stage {
        if counts.len() != n_stages {
            return Err(format!(
                "--layers-per-stage names {} stages, but the job has {n_stages} ranks (one stage per rank)",
                counts.len()
            ));
        }
        return StagePlan::from_counts(counts, args.n_layers);
    }
    let mut bo = crate::model::BuildOptions::new(1);
    bo.weight_dtypes = dtypes.clone();
    let g = crate::model::build_llama(args, &bo).map_err(|e| e.to_string())?;
    StagePlan::balanced(&g, n_stages)
}

/// Opens the model at `path` for stage `stage` of `n_stages`: only the
/// tensors that stage reads are kept (and, for a sharded Meta checkpoint,
/// merged). Returns the model and the plan.
pub fn open_stage_model(
    path: &std::path::Path,
    n_stages: usize,
    stage: usize,
    layers_per_stage: Option<&[usize]>,
) -> Result<(crate::session::Model, crate::passes::StagePlan), String> {
    let plan = std::cell::RefCell::new(None);
    let select = |args: &crate::model::ModelArgs,
                  dtypes: &std::collections::BTreeMap<String, crate::ir::DType>| {
        let p = stage_plan(args, dtypes, n_stages, layers_per_stage)?;
        let mut bo = crate::model::BuildOptions::new(1);
        bo.weight_dtypes = dtypes.clone();
        let g = crate::model::build_llama(args, &bo).map_err(|e| e.to_string())?;
        let part = crate::passes::partition(&g, &p).map_err(|e| e.to_string())?;
        let names = part
            .stages
            .get(stage)
            .map(|s| s.tensor_names())
            .ok_or_else(|| format!("no stage {stage} in a {n_stages}-stage plan"))?;
        *plan.borrow_mut() = Some(p);
        Ok(names)
    };
    let model = crate::weights::open_only(path, &select).map_err(|e| e.to_string())?;
    let plan = plan
        .into_inner()
        .ok_or_else(|| "the stage plan was not made".to_string())?;
    Ok((model, plan))
}

/// A rank's incoming messages, `(from, tag, bytes)`, as a transport's
/// receiving thread or peers deliver them, with the ones that arrived while
/// a receive waited for another peer or tag kept aside in order.
pub(crate) struct Inbox {
    rx: std::sync::mpsc::Receiver<(usize, Tag, Vec<u8>)>,
    early: std::collections::VecDeque<(usize, Tag, Vec<u8>)>,
}

impl Inbox {
    pub(crate) fn new(rx: std::sync::mpsc::Receiver<(usize, Tag, Vec<u8>)>) -> Inbox {
        Inbox {
            rx,
            early: std::collections::VecDeque::new(),
        }
    }

    /// The next message from `from` under `tag`, waiting until `deadline`
    /// (`None`: until every sender is gone). A timeout names `from` and
    /// `timeout`; `gone` is the error once no sender is left.
    pub(crate) fn recv_until(
        &mut self,
        from: usize,
        tag: Tag,
        deadline: Option<std::time::Instant>,
        timeout: std::time::Duration,
        gone: impl FnOnce() -> DistError,
    ) -> Result<Vec<u8>, DistError> {
        use std::sync::mpsc::RecvTimeoutError;
        if let Some(i) = self
            .early
            .iter()
            .position(|(f, t, _)| *f == from && *t == tag)
        {
            return Ok(self.early.remove(i).map(|e| e.2).unwrap_or_default());
        }
        loop {
            let got = match deadline {
                Some(d) => self
                    .rx
                    .recv_timeout(d.saturating_duration_since(std::time::Instant::now())),
                None => self.rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
            };
            match got {
                Ok((f, t, b)) if f == from && t == tag => return Ok(b),
                Ok(e) => self.early.push_back(e),
                Err(RecvTimeoutError::Timeout) => {
                    return Err(DistError::Timeout {
                        peer: from,
                        secs: timeout.as_secs_f64(),
                    })
                }
                Err(RecvTimeoutError::Disconnected) => return Err(gone()),
            }
        }
    }
}
