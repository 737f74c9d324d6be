//! A persistent worker pool for data-parallel kernels.
//!
//! Threads are created once by [`ThreadPool::new`]. [`ThreadPool::run`] hands
//! every worker the same closure; workers and the calling thread take chunk
//! indices from one atomic counter until all chunks are taken, then the caller
//! waits until every worker has left the job. Idle workers spin briefly (so
//! back-to-back kernels do not pay a wake-up) and then sleep on a condvar.
//!
//! `run` does not allocate: the job is published as a borrowed trait-object
//! pointer in pre-allocated shared state. A panic in any chunk stops the
//! hand-out of further chunks and is re-raised on the calling thread once all
//! workers are out of the job (so the borrowed closure is never used after
//! `run` returns). Nested or concurrent `run` calls on the same pool execute
//! their chunks inline on the calling thread instead of deadlocking.

use std::any::Any;
use std::cell::UnsafeCell;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, TryLockError};
use std::thread::JoinHandle;

/// Busy-wait iterations before an idle worker sleeps (~0.1 ms).
const SPIN_ITERS: u32 = 1 << 12;
/// Busy-wait iterations before the caller, waiting for workers still inside
/// a chunk, sleeps.
const WAIT_SPIN_ITERS: u32 = 1 << 16;

type Job = *const (dyn Fn(usize, usize) + Sync + 'static);

/// Job state word: bits 0..32 count workers inside the job, bit 32 is set
/// once the job is closed to joiners, bits 33.. hold the job's epoch.
const ACTIVE_MASK: u64 = (1 << 32) - 1;
const CLOSED: u64 = 1 << 32;
const EPOCH_SHIFT: u32 = 33;

fn epoch_of(st: u64) -> u64 {
    st >> EPOCH_SHIFT
}

struct Shared {
    /// See [`ACTIVE_MASK`], [`CLOSED`], [`EPOCH_SHIFT`].
    state: AtomicU64,
    /// The current job; written by the caller only while the previous job is
    /// closed with no worker inside and the next is not yet open; read by a
    /// worker only after it joined an open job (and before it leaves).
    job: UnsafeCell<Option<Job>>,
    n_chunks: AtomicUsize,
    next_chunk: AtomicUsize,
    /// Workers asleep on `wake_cv` (the caller skips the notify syscall when
    /// everybody is spinning).
    sleepers: AtomicUsize,
    caller_sleeping: AtomicBool,
    shutdown: AtomicBool,
    lock: Mutex<()>,
    wake_cv: Condvar,
    done_cv: Condvar,
    /// The first panic payload of the current job.
    panic: Mutex<Option<Box<dyn Any + Send + 'static>>>,
}

// SAFETY: `job` is accessed under the join/close protocol described on the
// field: the caller's write happens-before a worker's read (Release store of
// the open state / Acquire CAS that joins), and the worker's last use
// happens-before the caller's next write (AcqRel decrement of the active
// count, observed by the caller with Acquire). The pointee is `Sync`.
unsafe impl Sync for Shared {}
// SAFETY: see above; the raw pointer is only dereferenced under that protocol.
unsafe impl Send for Shared {}

/// A fixed set of worker threads plus the calling thread.
pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    n_threads: usize,
    /// Serialises `run`; a failed `try_lock` means nested/concurrent use.
    run_lock: Mutex<()>,
    /// Epoch of the next job (only touched under `run_lock`).
    next_epoch: AtomicU64,
}

impl std::fmt::Debug for ThreadPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadPool")
            .field("n_threads", &self.n_threads)
            .finish()
    }
}

impl ThreadPool {
    /// A pool running jobs on `n_threads` threads in total: the caller of
    /// [`run`](Self::run) plus `n_threads - 1` workers. `0` is treated as 1.
    pub fn new(n_threads: usize) -> Self {
        let n_threads = n_threads.max(1);
        let shared = Arc::new(Shared {
            state: AtomicU64::new(CLOSED),
            job: UnsafeCell::new(None),
            n_chunks: AtomicUsize::new(0),
            next_chunk: AtomicUsize::new(0),
            sleepers: AtomicUsize::new(0),
            caller_sleeping: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            lock: Mutex::new(()),
            wake_cv: Condvar::new(),
            done_cv: Condvar::new(),
            panic: Mutex::new(None),
        });
        // Every worker has started (and done its thread start-up, which
        // allocates) before `new` returns, so the pool is quiet from then on.
        let started = Arc::new(std::sync::Barrier::new(n_threads));
        let workers = (1..n_threads)
            .map(|i| {
                let s = Arc::clone(&shared);
                let started = Arc::clone(&started);
                std::thread::Builder::new()
                    .name(format!("llama-graph-worker-{i}"))
                    .spawn(move || {
                        started.wait();
                        worker_loop(&s, i)
                    })
                    .expect("failed to spawn pool worker thread")
            })
            .collect();
        started.wait();
        ThreadPool {
            shared,
            workers,
            n_threads,
            run_lock: Mutex::new(()),
            next_epoch: AtomicU64::new(1),
        }
    }

    /// A pool with one thread per available CPU.
    pub fn with_available_parallelism() -> Self {
        Self::new(std::thread::available_parallelism().map_or(1, |n| n.get()))
    }

    /// Total threads that execute chunks (workers + caller).
    pub fn n_threads(&self) -> usize {
        self.n_threads
    }

    /// Calls `f(i)` once for every `i in 0..n_chunks`, spread over the pool,
    /// and returns when all calls have finished. Chunks run in no particular
    /// order. If any call panics, remaining chunks may be skipped and the
    /// panic is resumed here after all threads have left the job.
    pub fn run<F: Fn(usize) + Sync>(&self, n_chunks: usize, f: &F) {
        self.run_indexed(n_chunks, &|c, _| f(c));
    }

    /// Like [`run`](Self::run), but also passes the index (`0..n_threads()`)
    /// of the thread executing the chunk, for per-thread scratch space. At
    /// any moment each index is used by at most one thread of this job.
    /// (Nested or concurrent calls run inline with index 0; per-thread
    /// scratch handed out as `&mut` cannot be shared with them anyway.)
    ///
    /// Workers join a job only while it is open; the caller closes it once
    /// every chunk has been taken, so a worker that is not scheduled in time
    /// never delays the caller.
    pub fn run_indexed<F: Fn(usize, usize) + Sync>(&self, n_chunks: usize, f: &F) {
        if n_chunks == 0 {
            return;
        }
        let inline = || (0..n_chunks).for_each(|c| f(c, 0));
        if self.n_threads == 1 || n_chunks == 1 {
            inline();
            return;
        }
        let _guard = match self.run_lock.try_lock() {
            Ok(g) => g,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => {
                // Nested call from inside a chunk, or another thread is using
                // the pool: run inline rather than deadlock.
                inline();
                return;
            }
        };
        let s = &*self.shared;
        let dyn_f: &(dyn Fn(usize, usize) + Sync) = f;
        // SAFETY: erasing the lifetime is sound because this function does not
        // return (normally or by unwinding) before the job is closed and every
        // worker that joined it has left; no worker touches the job after.
        let job: Job = unsafe {
            std::mem::transmute::<*const (dyn Fn(usize, usize) + Sync + '_), Job>(dyn_f as *const _)
        };
        // SAFETY: the previous job is closed with no worker inside, and the
        // new one is not open yet, so nobody reads `job` concurrently.
        unsafe { *s.job.get() = Some(job) };
        s.n_chunks.store(n_chunks, Ordering::Relaxed);
        s.next_chunk.store(0, Ordering::Relaxed);
        let epoch =
            self.next_epoch.fetch_add(1, Ordering::Relaxed) & ((1 << (64 - EPOCH_SHIFT)) - 1);
        s.state.store(epoch << EPOCH_SHIFT, Ordering::SeqCst); // open, 0 active
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _l = s.lock.lock().unwrap_or_else(|p| p.into_inner());
            s.wake_cv.notify_all();
        }

        run_chunks(s, f, 0);

        // Every chunk is taken: close the job to late joiners, then wait for
        // the workers inside to finish their chunks.
        s.state.fetch_or(CLOSED, Ordering::SeqCst);
        let mut spins = 0u32;
        while s.state.load(Ordering::Acquire) & ACTIVE_MASK != 0 {
            if spins < WAIT_SPIN_ITERS {
                spins += 1;
                std::hint::spin_loop();
                continue;
            }
            let mut l = s.lock.lock().unwrap_or_else(|p| p.into_inner());
            s.caller_sleeping.store(true, Ordering::SeqCst);
            while s.state.load(Ordering::SeqCst) & ACTIVE_MASK != 0 {
                l = s.done_cv.wait(l).unwrap_or_else(|p| p.into_inner());
            }
            s.caller_sleeping.store(false, Ordering::SeqCst);
        }
        // SAFETY: closed and no worker inside; clear the dangling pointer.
        unsafe { *s.job.get() = None };
        let payload = s.panic.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(p) = payload {
            resume_unwind(p);
        }
    }
}

/// Takes chunks until none are left; records the first panic and makes the
/// remaining chunks be skipped.
fn run_chunks(s: &Shared, f: &(dyn Fn(usize, usize) + Sync), tid: usize) {
    let n = s.n_chunks.load(Ordering::Relaxed);
    let r = catch_unwind(AssertUnwindSafe(|| loop {
        let i = s.next_chunk.fetch_add(1, Ordering::Relaxed);
        if i >= n {
            break;
        }
        f(i, tid);
    }));
    if let Err(p) = r {
        // Stop handing out chunks (far above n, no overflow on later adds).
        s.next_chunk.store(usize::MAX / 2, Ordering::Relaxed);
        let mut slot = s.panic.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            *slot = Some(p);
        }
    }
}

/// Tries to enter the open job whose epoch differs from `seen`. Returns the
/// joined epoch, or `Err(epoch)` if the newest job is already closed.
fn try_join(s: &Shared, seen: u64) -> Option<Result<u64, u64>> {
    let mut st = s.state.load(Ordering::Acquire);
    loop {
        if epoch_of(st) == seen {
            return None;
        }
        if st & CLOSED != 0 {
            return Some(Err(epoch_of(st)));
        }
        match s
            .state
            .compare_exchange_weak(st, st + 1, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => return Some(Ok(epoch_of(st))),
            Err(cur) => st = cur,
        }
    }
}

fn worker_loop(s: &Shared, tid: usize) {
    let mut seen = epoch_of(s.state.load(Ordering::Acquire));
    loop {
        // Wait for a job with a new epoch (or shutdown).
        let mut spins = 0u32;
        let joined = loop {
            if s.shutdown.load(Ordering::Acquire) {
                return;
            }
            match try_join(s, seen) {
                Some(Ok(e)) => break e,
                Some(Err(e)) => {
                    // Missed that job entirely; wait for the next one.
                    seen = e;
                    continue;
                }
                None => {}
            }
            if spins < SPIN_ITERS {
                spins += 1;
                std::hint::spin_loop();
                continue;
            }
            let mut l = s.lock.lock().unwrap_or_else(|p| p.into_inner());
            s.sleepers.fetch_add(1, Ordering::SeqCst);
            while epoch_of(s.state.load(Ordering::SeqCst)) == seen
                && !s.shutdown.load(Ordering::SeqCst)
            {
                l = s.wake_cv.wait(l).unwrap_or_else(|p| p.into_inner());
            }
            s.sleepers.fetch_sub(1, Ordering::SeqCst);
            spins = 0;
        };
        seen = joined;
        // SAFETY: we joined an open job: the caller published `job` before
        // opening it and keeps the closure alive until we leave below.
        if let Some(job) = unsafe { *s.job.get() } {
            // SAFETY: as above, the pointee outlives this use.
            run_chunks(s, unsafe { &*job }, tid);
        }
        let prev = s.state.fetch_sub(1, Ordering::SeqCst);
        if prev & ACTIVE_MASK == 1 && s.caller_sleeping.load(Ordering::SeqCst) {
            let _l = s.lock.lock().unwrap_or_else(|p| p.into_inner());
            s.done_cv.notify_all();
        }
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        {
            let _l = self.shared.lock.lock().unwrap_or_else(|p| p.into_inner());
            self.shared.wake_cv.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// A raw pointer to an output buffer that chunks of a pool job write to at
/// disjoint positions. Kernels use it to share `&mut [f32]` across threads.
#[derive(Clone, Copy)]
pub(crate) struct SyncPtr<T>(pub *mut T);
// SAFETY: users guarantee that concurrent accesses through it are disjoint.
unsafe impl<T> Sync for SyncPtr<T> {}
// SAFETY: as above.
unsafe impl<T> Send for SyncPtr<T> {}

impl<T> SyncPtr<T> {
    pub(crate) fn new(s: &mut [T]) -> Self {
        SyncPtr(s.as_mut_ptr())
    }
    /// # Safety
    /// `start..start+len` must be in bounds of the original slice and not
    /// accessed by any other thread while the returned slice lives.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice(&self, start: usize, len: usize) -> &mut [T] {
        // SAFETY: guaranteed by the caller.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(start), len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn every_chunk_once() {
        for threads in [1, 2, 3] {
            let pool = ThreadPool::new(threads);
            for n in [0, 1, 2, 7, 100, 1000] {
                let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                pool.run(n, &|i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                });
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
            }
        }
    }

    #[test]
    fn many_runs_and_sleep_wakeup() {
        let pool = ThreadPool::new(2);
        let total = AtomicUsize::new(0);
        for round in 0..200 {
            if round % 50 == 0 {
                // Let workers fall asleep to exercise the condvar path.
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            pool.run(5, &|i| {
                total.fetch_add(i + 1, Ordering::Relaxed);
            });
        }
        assert_eq!(total.load(Ordering::Relaxed), 200 * 15);
    }

    #[test]
    fn panic_propagates_and_pool_survives() {
        let pool = ThreadPool::new(2);
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.run(64, &|i| {
                if i == 13 {
                    panic!("chunk 13 failed");
                }
            })
        }));
        let err = r.expect_err("panic must propagate");
        let msg = err.downcast_ref::<&str>().copied().unwrap_or("");
        assert_eq!(msg, "chunk 13 failed");
        // The pool still works afterwards.
        let count = AtomicUsize::new(0);
        pool.run(10, &|_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 10);
    }

    #[test]
    fn thread_indices_in_range() {
        let pool = ThreadPool::new(2);
        let seen: Vec<AtomicUsize> = (0..2).map(|_| AtomicUsize::new(0)).collect();
        pool.run_indexed(1000, &|_, t| {
            seen[t].fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(
            seen.iter()
                .map(|a| a.load(Ordering::Relaxed))
                .sum::<usize>(),
            1000
        );
    }

    #[test]
    fn every_chunk_panicking_on_all_threads() {
        let pool = ThreadPool::new(2);
        for _ in 0..20 {
            let r = catch_unwind(AssertUnwindSafe(|| {
                pool.run(50, &|_| {
                    std::thread::sleep(std::time::Duration::from_micros(50));
                    panic!("boom")
                })
            }));
            assert!(r.is_err());
        }
        let count = AtomicUsize::new(0);
        pool.run(7, &|_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 7);
    }

    #[test]
    fn nested_run_does_not_deadlock() {
        let pool = ThreadPool::new(2);
        let count = AtomicUsize::new(0);
        pool.run(4, &|_| {
            pool.run(3, &|_| {
                count.fetch_add(1, Ordering::Relaxed);
            });
        });
        assert_eq!(count.load(Ordering::Relaxed), 12);
    }
}
