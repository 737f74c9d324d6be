//! A small STREAM-style memory-bandwidth measurement (copy, scale, add,
//! triad, plus a read-only sum, which is what a decode step does with the
//! weights), single- and multi-threaded.
//!
//! `cargo run --release --example stream -- [MiB per array, default 256] [threads, default 1,2]`
//!
//! Prints one JSON object per thread count on stdout: best-of-N GB/s per
//! kernel (10^9 bytes/s, counting bytes read + bytes written, as STREAM does).

use std::hint::black_box;
use std::time::Instant;

fn best<F: FnMut()>(reps: usize, mut f: F) -> f64 {
    let mut best = f64::INFINITY;
    for _ in 0..reps {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed().as_secs_f64());
    }
    best
}

/// Splits `0..n` into `t` ranges and runs `f(range)` on `t` scoped threads.
fn par<F: Fn(std::ops::Range<usize>) + Sync>(t: usize, n: usize, f: F) {
    let chunk = n.div_ceil(t);
    std::thread::scope(|s| {
        for i in 0..t {
            let r = (i * chunk).min(n)..((i + 1) * chunk).min(n);
            let f = &f;
            s.spawn(move || f(r));
        }
    });
}

#[derive(Clone, Copy)]
struct P(*mut f64);
// SAFETY: threads write disjoint ranges.
unsafe impl Sync for P {}
unsafe impl Send for P {}
impl P {
    /// # Safety
    /// `r` in bounds and owned by the caller thread.
    #[allow(clippy::mut_from_ref)]
    unsafe fn s(&self, r: std::ops::Range<usize>) -> &mut [f64] {
        // SAFETY: as documented.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(r.start), r.len()) }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let mib: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(256);
    let threads: Vec<usize> = args
        .get(2)
        .map(|s| s.split(',').filter_map(|t| t.parse().ok()).collect())
        .unwrap_or_else(|| vec![1, 2]);
    let n = mib * 1024 * 1024 / 8;
    let mut a = vec![1.0f64; n];
    let mut b = vec![2.0f64; n];
    let mut c = vec![0.0f64; n];
    let reps = 5;
    for &t in &threads {
        let (pa, pb, pc) = (P(a.as_mut_ptr()), P(b.as_mut_ptr()), P(c.as_mut_ptr()));
        let bytes = (n * 8) as f64;
        // SAFETY (all closures): each thread touches only its own range.
        let copy = best(reps, || {
            par(t, n, |r| unsafe {
                pc.s(r.clone()).copy_from_slice(pa.s(r))
            })
        });
        let scale = best(reps, || {
            par(t, n, |r| unsafe {
                for (x, y) in pb.s(r.clone()).iter_mut().zip(pc.s(r).iter()) {
                    *x = 3.0 * y;
                }
            })
        });
        let add = best(reps, || {
            par(t, n, |r| unsafe {
                let (x, y) = (pa.s(r.clone()), pb.s(r.clone()));
                for (z, (u, v)) in pc.s(r).iter_mut().zip(x.iter().zip(y.iter())) {
                    *z = u + v;
                }
            })
        });
        let triad = best(reps, || {
            par(t, n, |r| unsafe {
                let (y, z) = (pb.s(r.clone()), pc.s(r.clone()));
                for (x, (u, v)) in pa.s(r).iter_mut().zip(y.iter().zip(z.iter())) {
                    *x = u + 3.0 * v;
                }
            })
        });
        let read = best(reps, || {
            par(t, n, |r| unsafe {
                // Eight independent sums so the adds keep up with the loads.
                let mut acc = [0f64; 8];
                for ch in pa.s(r).chunks_exact(8) {
                    for i in 0..8 {
                        acc[i] += ch[i];
                    }
                }
                black_box(acc);
            })
        });
        println!(
            "{{\"threads\": {t}, \"mib_per_array\": {mib}, \"copy_gbs\": {:.2}, \"scale_gbs\": {:.2}, \"add_gbs\": {:.2}, \"triad_gbs\": {:.2}, \"read_gbs\": {:.2}}}",
            2.0 * bytes / copy / 1e9,
            2.0 * bytes / scale / 1e9,
            3.0 * bytes / add / 1e9,
            3.0 * bytes / triad / 1e9,
            bytes / read / 1e9
        );
    }
    black_box((&a, &b, &c));
}
