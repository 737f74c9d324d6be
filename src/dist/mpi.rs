//! The OpenMPI transport (cargo feature `mpi`, the `mpi` crate).
//!
//! One thread of the process, the *communication thread*, initialises MPI
//! and is the only one that ever calls it (`MPI_THREAD_FUNNELED`); the
//! rest of the process talks to it through channels. It never blocks in
//! MPI: sends are nonblocking and tested until they complete, incoming
//! messages are found with a nonblocking probe, and between rounds it
//! yields, then sleeps 50 µs once idle. So it keeps doing three things
//! whatever the compute threads do:
//!
//! * delivering messages (a stage computing a step still receives the next
//!   one, and its sends complete as soon as the peer's thread takes them);
//! * sending a heartbeat to every other rank every [`HEARTBEAT_EVERY`];
//! * declaring a rank dead when nothing at all (message or heartbeat) came
//!   from it for the heartbeat timeout ([`DEFAULT_HEARTBEAT_TIMEOUT`],
//!   `LLAMA_GRAPH_HEARTBEAT_TIMEOUT` seconds), or when a send to it does not
//!   complete within that time: it then prints which rank it lost and calls
//!   `MPI_Abort`, which makes `mpirun` end every rank.
//!
//! A rank killed outright is usually noticed first by `mpirun` itself,
//! which ends the job when a rank exits abnormally; the heartbeat covers
//! the ranks that stop answering without exiting (a stopped process, a
//! hung host, a lost network), so that no rank waits on a dead peer.
//! A rank that ends in order tells the others (a goodbye message) before
//! `MPI_Finalize`, so its silence afterwards is not taken for a failure.

use super::{DistError, Inbox, Tag, Transport};
use mpi::point_to_point::{Destination, MatchedReceiveVec, Source};
use mpi::request::{Request, StaticScope};
use mpi::topology::Communicator;
use std::sync::mpsc::{channel, Receiver, Sender, TryRecvError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How often each rank tells every other rank it is alive.
pub const HEARTBEAT_EVERY: Duration = Duration::from_millis(500);
/// Silence after which a rank is declared dead.
pub const DEFAULT_HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(10);
/// The environment variable that overrides [`DEFAULT_HEARTBEAT_TIMEOUT`].
pub const HEARTBEAT_ENV: &str = "LLAMA_GRAPH_HEARTBEAT_TIMEOUT";

/// MPI tags of the transport's own messages (the protocol's are [`Tag`]s).
const TAG_HEARTBEAT: i32 = 100;
const TAG_BYE: i32 = 101;

enum Cmd {
    Send { to: usize, tag: i32, bytes: Vec<u8> },
    Abort(i32),
    Finish,
}

pub struct MpiTransport {
    rank: usize,
    size: usize,
    cmds: Sender<Cmd>,
    inbox: Inbox,
    timeout: Duration,
    thread: Option<JoinHandle<()>>,
}

fn heartbeat_timeout() -> Result<Duration, String> {
    match std::env::var(HEARTBEAT_ENV) {
        Err(_) => Ok(DEFAULT_HEARTBEAT_TIMEOUT),
        Ok(v) => match v.trim().parse::<f64>() {
            Ok(s) if s > 0.0 && s.is_finite() => Ok(Duration::from_secs_f64(s)),
            _ => Err(format!(
                "{HEARTBEAT_ENV}={v:?}: expected a positive number of seconds"
            )),
        },
    }
}

impl MpiTransport {
    /// Initialises MPI on a new communication thread. `timeout` bounds
    /// every receive (see [`super::DEFAULT_TIMEOUT`]).
    pub fn init(timeout: Duration) -> Result<MpiTransport, DistError> {
        let hb = heartbeat_timeout().map_err(DistError::Transport)?;
        let (cmd_tx, cmd_rx) = channel();
        let (in_tx, in_rx) = channel();
        let (init_tx, init_rx) = channel();
        let thread = std::thread::Builder::new()
            .name("mpi".into())
            .spawn(move || comm_thread(cmd_rx, in_tx, init_tx, hb))
            .map_err(|e| DistError::Transport(format!("cannot start the MPI thread: {e}")))?;
        let (rank, size) = init_rx
            .recv()
            .map_err(|_| DistError::Transport("the MPI thread ended during MPI_Init".into()))?
            .map_err(DistError::Transport)?;
        Ok(MpiTransport {
            rank,
            size,
            cmds: cmd_tx,
            inbox: Inbox::new(in_rx),
            timeout,
            thread: Some(thread),
        })
    }
}

impl MpiTransport {
    /// The next message from `from` under `tag`, waiting until `deadline`
    /// (`None`: for as long as the peer lives).
    fn recv_until(
        &mut self,
        from: usize,
        tag: Tag,
        deadline: Option<Instant>,
    ) -> Result<Vec<u8>, DistError> {
        self.inbox
            .recv_until(from, tag, deadline, self.timeout, || {
                DistError::Transport("the MPI thread has ended".into())
            })
    }
}

impl Transport for MpiTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn send(&mut self, to: usize, tag: Tag, bytes: Vec<u8>) -> Result<(), DistError> {
        if to >= self.size || to == self.rank {
            return Err(DistError::Transport(format!(
                "no rank {to} to send to (this is rank {} of {})",
                self.rank, self.size
            )));
        }
        self.cmds
            .send(Cmd::Send {
                to,
                tag: tag as i32,
                bytes,
            })
            .map_err(|_| DistError::Transport("the MPI thread has ended".into()))
    }

    fn recv(&mut self, from: usize, tag: Tag) -> Result<Vec<u8>, DistError> {
        self.recv_until(from, tag, Some(Instant::now() + self.timeout))
    }

    fn recv_idle(&mut self, from: usize, tag: Tag) -> Result<Vec<u8>, DistError> {
        self.recv_until(from, tag, None)
    }
    fn abort(&mut self, code: i32) {
        if self.cmds.send(Cmd::Abort(code)).is_ok() {
            // MPI_Abort ends this process too; wait for it.
            std::thread::sleep(Duration::from_secs(30));
        }
        std::process::exit(code);
    }

    fn finish(&mut self) {
        let _ = self.cmds.send(Cmd::Finish);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for MpiTransport {
    fn drop(&mut self) {
        self.finish();
    }
}

/// A nonblocking send and the buffer it reads (leaked for the request's
/// `'static` scope, freed when the send completes).
struct Pending {
    req: Option<Request<'static, [u8], StaticScope>>,
    buf: *mut [u8],
    to: usize,
    started: Instant,
}

impl Pending {
    fn start<C: Communicator>(world: &C, to: usize, tag: i32, bytes: Vec<u8>) -> Pending {
        let buf: &'static mut [u8] = Box::leak(bytes.into_boxed_slice());
        let ptr: *mut [u8] = buf;
        // SAFETY: the buffer stays allocated until the request completes
        // (`Pending::done`), and nothing writes it meanwhile.
        let view: &'static [u8] = unsafe { &*ptr };
        let req = world
            .process_at_rank(to as i32)
            .immediate_send_with_tag(StaticScope, view, tag);
        Pending {
            req: Some(req),
            buf: ptr,
            to,
            started: Instant::now(),
        }
    }

    /// Tests the send; true once it completed (the buffer is freed).
    fn done(&mut self) -> bool {
        let Some(req) = self.req.take() else {
            return true;
        };
        match req.test() {
            Ok(_) => {
                // SAFETY: the send completed; MPI no longer reads the buffer,
                // which was leaked from a Box in `start`.
                drop(unsafe { Box::from_raw(self.buf) });
                true
            }
            Err(req) => {
                self.req = Some(req);
                false
            }
        }
    }
}

fn comm_thread(
    cmds: Receiver<Cmd>,
    inbox: Sender<(usize, Tag, Vec<u8>)>,
    init: Sender<Result<(usize, usize), String>>,
    hb_timeout: Duration,
) {
    let Some((universe, _)) = mpi::initialize_with_threading(mpi::Threading::Funneled) else {
        let _ = init.send(Err("MPI was already initialised in this process".into()));
        return;
    };
    let world = universe.world();
    let (rank, size) = (world.rank() as usize, world.size() as usize);
    let _ = init.send(Ok((rank, size)));
    let fatal = |msg: String| -> ! {
        eprintln!("error: rank {rank}: {msg}; stopping every rank");
        world.abort(1)
    };
    let start = Instant::now();
    let mut last_seen = vec![start; size];
    let mut gone = vec![false; size];
    gone[rank] = true;
    let mut pending: Vec<Pending> = Vec::new();
    let mut next_heartbeat = start;
    let mut finishing: Option<Instant> = None;
    let mut idle_rounds = 0u32;
    loop {
        let mut busy = false;
        // Commands from the process.
        while finishing.is_none() {
            match cmds.try_recv() {
                Ok(Cmd::Send { to, tag, bytes }) => {
                    pending.push(Pending::start(&world, to, tag, bytes));
                    busy = true;
                }
                Ok(Cmd::Abort(code)) => world.abort(code),
                Ok(Cmd::Finish) | Err(TryRecvError::Disconnected) => {
                    for p in (0..size).filter(|&p| !gone[p]) {
                        pending.push(Pending::start(&world, p, TAG_BYE, Vec::new()));
                    }
                    finishing = Some(Instant::now());
                }
                Err(TryRecvError::Empty) => break,
            }
        }
        // Messages from the other ranks.
        while let Some(probed) = world.any_process().immediate_matched_probe() {
            let (data, status) = probed.matched_receive_vec::<u8>();
            let from = status.source_rank() as usize;
            busy = true;
            if from < size {
                last_seen[from] = Instant::now();
            }
            match status.tag() {
                TAG_HEARTBEAT => {}
                TAG_BYE => {
                    if from < size {
                        gone[from] = true;
                    }
                }
                t => match Tag::from_i32(t) {
                    Some(tag) => {
                        let _ = inbox.send((from, tag, data));
                    }
                    None => fatal(format!("a message with unknown tag {t} from rank {from}")),
                },
            }
        }
        // Sends in flight.
        pending.retain_mut(|p| !p.done());
        let now = Instant::now();
        if let Some(p) = pending
            .iter()
            .find(|p| now.duration_since(p.started) > hb_timeout)
        {
            fatal(format!(
                "rank {} took no message for {:.1} s (it died or hangs)",
                p.to,
                hb_timeout.as_secs_f64()
            ));
        }
        if let Some(t) = finishing {
            if pending.is_empty() {
                break;
            }
            if now.duration_since(t) > hb_timeout {
                // Peers that left without taking our goodbye: nothing more
                // to deliver; finalise anyway.
                eprintln!(
                    "warning: rank {rank}: {} messages undelivered at the end",
                    pending.len()
                );
                std::mem::forget(pending);
                break;
            }
        } else {
            if now >= next_heartbeat {
                for p in (0..size).filter(|&p| !gone[p]) {
                    pending.push(Pending::start(&world, p, TAG_HEARTBEAT, Vec::new()));
                }
                next_heartbeat = now + HEARTBEAT_EVERY;
            }
            if let Some(p) =
                (0..size).find(|&p| !gone[p] && now.duration_since(last_seen[p]) > hb_timeout)
            {
                fatal(format!(
                    "no word from rank {p} for {:.1} s (it died, hangs or cannot be reached)",
                    hb_timeout.as_secs_f64()
                ));
            }
        }
        if busy {
            idle_rounds = 0;
        } else {
            idle_rounds = idle_rounds.saturating_add(1);
            if idle_rounds < 64 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }
    drop(universe);
}
