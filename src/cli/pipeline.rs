//! `--pipeline`: one command run as a pipeline of stages over the ranks of
//! an MPI job (`mpirun -np N llama-graph run --pipeline ...`). Rank 0 runs
//! stage 0 and everything outside the graph (prompt, tokenizer, sampler,
//! output); every other rank opens its stage and serves steps until rank 0
//! stops the pipeline. See `docs/distributed.md`.

use super::model::ModelArg;
use clap::Args;
use llama_graph::dist::stage::{agree, serve_stage, PipelineLink};
use llama_graph::dist::{open_stage_model, Transport};
use llama_graph::session::{Model, Session, SessionOptions};

#[derive(Debug, Args, Clone, Default)]
pub struct PipelineFlags {
    /// Run as a pipeline over the ranks of an MPI job, one stage of layers
    /// per rank: `mpirun -np N llama-graph run|bench|serve --pipeline ...`.
    /// Every rank opens the same model path but maps only its stage's
    /// tensors and keeps only its layers' KV cache; rank 0 also owns the
    /// tokenizer, the sampler and the output (for serve: the HTTP server;
    /// stop it with SIGTERM to rank 0). Needs a build with `--features mpi`.
    #[arg(long = "pipeline")]
    pub pipeline: bool,
    /// Layers of each stage, one count per rank, comma-separated (e.g.
    /// 10,12,8); they must add up to the model's layers. Default: stages
    /// balanced by weight bytes. Implies --pipeline.
    #[arg(
        long = "layers-per-stage",
        value_name = "N,N,..",
        value_delimiter = ','
    )]
    pub layers_per_stage: Option<Vec<usize>>,
}

impl PipelineFlags {
    pub fn enabled(&self) -> bool {
        self.pipeline || self.layers_per_stage.is_some()
    }
}

/// This process's part.
pub enum Role {
    /// No pipeline: the whole model in this process.
    Single,
    /// Rank 0 of a pipeline job.
    Leader(Box<dyn Transport>),
    /// Another rank: it serves its stage.
    Worker(Box<dyn Transport>),
}

impl Role {
    /// Joins the MPI job when the flags ask for a pipeline.
    pub fn start(flags: &PipelineFlags) -> Result<Role, String> {
        if !flags.enabled() {
            return Ok(Role::Single);
        }
        let t = transport()?;
        if t.size() == 1 {
            eprintln!("pipeline: a job of one rank runs the whole model in one stage");
            if let Some(c) = &flags.layers_per_stage {
                if c.len() != 1 {
                    return Err(format!(
                        "--layers-per-stage names {} stages, but the job has 1 rank (one stage per rank)",
                        c.len()
                    ));
                }
            }
            return Ok(Role::Single);
        }
        Ok(if t.rank() == 0 {
            Role::Leader(t)
        } else {
            Role::Worker(t)
        })
    }
}

#[cfg(feature = "mpi")]
fn transport() -> Result<Box<dyn Transport>, String> {
    let timeout = llama_graph::dist::timeout_from_env()?;
    let t = llama_graph::dist::mpi::MpiTransport::init(timeout).map_err(|e| e.to_string())?;
    Ok(Box::new(t))
}

#[cfg(not(feature = "mpi"))]
fn transport() -> Result<Box<dyn Transport>, String> {
    Err("--pipeline needs MPI, and this build has none: build with `cargo build --release --features mpi` (needs Debian's openmpi-bin, libopenmpi-dev and libclang-dev) and start it with `mpirun -np N`".into())
}

/// What a staged rank opened: its model (only its tensors) and session.
pub struct Staged {
    pub model: Model,
    pub session: Session,
}

/// Opens stage `rank` of the job: the model (only its tensors) and its
/// session with `opts(&model)`.
fn open(
    t: &dyn Transport,
    model_arg: &ModelArg,
    flags: &PipelineFlags,
    opts: &dyn Fn(&Model) -> Result<SessionOptions, String>,
) -> Result<Staged, String> {
    let (rank, n) = (t.rank(), t.size());
    let path = model_arg.resolve()?;
    let (model, plan) = open_stage_model(&path, n, rank, flags.layers_per_stage.as_deref())?;
    let o = opts(&model)?;
    let session = Session::new_stage(&model, &o, &plan, rank).map_err(|e| e.to_string())?;
    let weights: usize = model.weights.tensors.values().map(|t| t.data.len()).sum();
    eprintln!(
        "pipeline: rank {rank} of {n}: stage {rank} (layers {}..{} of {}; plan {}): {:.1} MiB of weights mapped, KV cache {:.1} MiB",
        plan.layers[rank].start,
        plan.layers[rank].end,
        model.args.n_layers,
        plan.describe(),
        weights as f64 / 1048576.0,
        session.exec().kv_bytes() as f64 / 1048576.0
    );
    Ok(Staged { model, session })
}

/// After a failed start-up agreement: every rank prints the one message
/// and ends in order (`MPI_Finalize` waits for all, so every rank has
/// printed before `mpirun` sees the first non-zero exit), then exits 1.
fn fail_everywhere(mut t: Box<dyn Transport>, e: &str) -> ! {
    eprintln!("error: {e}");
    t.finish();
    std::process::exit(1)
}

/// Peak resident memory of this process (VmHWM), in MiB.
pub fn peak_rss_mib() -> Option<f64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

/// Rank 0: opens stage 0, runs `check` (the checks rank 0 makes before any
/// work: the prompt fits, ...) and agrees with every rank on the outcome;
/// on success the session leads the pipeline. A failure on any rank is
/// returned, the same message on every rank.
pub fn lead<C>(
    mut t: Box<dyn Transport>,
    model_arg: &ModelArg,
    flags: &PipelineFlags,
    opts: &dyn Fn(&Model) -> Result<SessionOptions, String>,
    check: impl FnOnce(&Model) -> Result<C, String>,
) -> Result<(Staged, C), String> {
    let mut mine =
        open(t.as_ref(), model_arg, flags, opts).and_then(|s| check(&s.model).map(|c| (s, c)));
    let verdict = agree(t.as_mut(), mine.as_ref().map(|_| ()).map_err(Clone::clone));
    if let Err(e) = verdict {
        fail_everywhere(t, &e);
    }
    let link = PipelineLink::new(t).map_err(|e| e.to_string())?;
    if let Ok((s, _)) = &mut mine {
        s.session.attach_pipeline(link).map_err(|e| e.to_string())?;
    }
    mine
}

/// Every rank but 0: opens its stage, agrees, then serves steps until rank
/// 0 stops the pipeline. Returns the error to exit with, if any.
pub fn work(
    mut t: Box<dyn Transport>,
    model_arg: &ModelArg,
    flags: &PipelineFlags,
    opts: &dyn Fn(&Model) -> Result<SessionOptions, String>,
) -> Result<(), String> {
    let rank = t.rank();
    let mine = open(t.as_ref(), model_arg, flags, opts);
    let verdict = agree(t.as_mut(), mine.as_ref().map(|_| ()).map_err(Clone::clone));
    let mut staged = match (mine, verdict) {
        (Ok(s), Ok(())) => s,
        (_, Err(e)) | (Err(e), Ok(())) => fail_everywhere(t, &e),
    };
    match serve_stage(staged.session.exec_mut(), t.as_mut()) {
        Ok(reason) => {
            if let Some(mib) = peak_rss_mib() {
                eprintln!("pipeline: rank {rank}: peak RSS {mib:.1} MiB");
            }
            t.finish();
            if reason.is_empty() {
                Ok(())
            } else {
                Err(format!("rank 0 stopped the pipeline: {reason}"))
            }
        }
        Err(e) => {
            let msg = format!("rank {rank}: {e}");
            eprintln!("error: {msg}");
            t.abort(1);
            Err(msg)
        }
    }
}
