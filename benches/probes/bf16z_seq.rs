//! A decode step's GEMVs (16 layers of Llama 3.2 1B shapes plus the output
//! head) over near-Gaussian bf16 weights, read as plain bf16 and as `bf16z`
//! (the same weights, losslessly in 49/64 of the bytes), alternated, with a
//! plain read of the bf16 bytes as the bandwidth yardstick.
//!
//! `cargo run --release --example bf16z_seq -- [threads, default 2] [reps, default 8]`

use llama_graph::ir::DType;
use llama_graph::kernels::matmul::bf16z::{self, Bf16z};
use llama_graph::kernels::matmul::Epilogue;
use llama_graph::kernels::{gemv, WeightRef};
use llama_graph::pool::ThreadPool;
use std::time::Instant;

#[path = "common/decode_step.rs"]
mod decode_step;
use decode_step::{huge, median, n_out};

fn main() {
    let isa = llama_graph::kernels::Kernels::current().isa();
    let args: Vec<String> = std::env::args().collect();
    let threads: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(2);
    let reps: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(8);
    let pool = ThreadPool::new(threads);
    if std::env::var_os("L2_ONLY").is_some() {
        let plain: Vec<u8> = (0..128 * 2048)
            .flat_map(|i: u32| {
                let v = ((i.wrapping_mul(2_654_435_761) >> 8) as f32 / 8_388_608.0 - 1.0) * 0.05;
                half::bf16::from_f32(v).to_le_bytes()
            })
            .collect();
        let x: Vec<f32> = (0..2048).map(|i| ((i % 7) as f32 - 3.0) * 0.1).collect();
        l2_rate(&plain, &x);
        return;
    }
    let ops = decode_step::ops();
    let total: usize = ops.iter().map(|&(n, k, _)| n * k * 2).sum();
    let mut plain = huge(total);
    // Near-Gaussian values, as the random checkpoints draw them.
    let mut state = 0x1234_5678_u64;
    for c in plain.chunks_exact_mut(2) {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        let s = (z & 0xffff) + ((z >> 16) & 0xffff) + ((z >> 32) & 0xffff) + (z >> 48);
        let v = 0.02 * (s as f32 / 65536.0 - 2.0) * 1.732_050_8;
        c.copy_from_slice(&half::bf16::from_f32(v).to_le_bytes());
    }
    let t0 = Instant::now();
    let mut encoded = Vec::new();
    let mut off = 0;
    for &(n, k, _) in &ops {
        encoded.push(bf16z::encode(&plain[off..off + n * k * 2], n, k).expect("encode"));
        off += n * k * 2;
    }
    let ztotal: usize = encoded.iter().map(Vec::len).sum();
    let mut zmap = huge(ztotal);
    let mut zoff = Vec::new();
    let mut o = 0;
    for e in &encoded {
        zmap[o..o + e.len()].copy_from_slice(e);
        zoff.push(o);
        o += e.len();
    }
    drop(encoded);
    let views: Vec<Bf16z> = ops
        .iter()
        .zip(&zoff)
        .enumerate()
        .map(|(i, (&(n, k, _), &o))| {
            let end = zoff.get(i + 1).copied().unwrap_or(ztotal);
            Bf16z::parse(&zmap[o..end], n, k).expect("parse")
        })
        .collect();
    let n_exc: usize = views.iter().map(|v| v.n_exceptions()).sum();
    eprintln!(
        "encoded {:.2} GB -> {:.2} GB ({:.3}), {n_exc} exceptions, in {:.1} s",
        total as f64 / 1e9,
        ztotal as f64 / 1e9,
        ztotal as f64 / total as f64,
        t0.elapsed().as_secs_f64()
    );
    let x: Vec<f32> = (0..8192).map(|i| ((i % 7) as f32 - 3.0) * 0.1).collect();
    let mut y = vec![0f32; 128256];
    let mut y2 = vec![0f32; 128256];
    let step_plain = |y: &mut [f32]| {
        let mut off = 0;
        for &(n, k, ep) in &ops {
            let w = WeightRef::new(DType::BF16, &plain[off..off + n * k * 2]);
            off += n * k * 2;
            let n_out = n_out(n, &ep);
            gemv::gemv_at(
                isa,
                &pool,
                llama_graph::kernels::LinearArgs::new(&x[..k], 1, k, w, n, ep),
                &mut y[..n_out],
            )
            .expect("gemv");
        }
    };
    let step_z = |y: &mut [f32]| {
        for (&(n, k, ep), v) in ops.iter().zip(&views) {
            let n_out = n_out(n, &ep);
            bf16z::gemv_at(isa, &pool, &x[..k], *v, ep, &mut y[..n_out]).expect("gemv");
        }
    };
    let words = decode_step::words(&plain);
    let read = || decode_step::read(&pool, words, 1 << 17);
    step_plain(&mut y);
    step_z(&mut y2);
    let worst = y
        .iter()
        .zip(&y2)
        .map(|(a, b)| (a - b).abs() / (1.0 + a.abs()))
        .fold(0f32, f32::max);
    eprintln!("largest relative difference of the last outputs: {worst:e}");
    read();
    l2_rate(&plain[..128 * 2048 * 2], &x);
    let (mut tp, mut tz, mut tr) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..reps {
        let t = Instant::now();
        step_plain(&mut y);
        tp.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        step_z(&mut y2);
        tz.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        read();
        tr.push(t.elapsed().as_secs_f64());
    }
    let mut ratio: Vec<f64> = tp.iter().zip(&tz).map(|(p, z)| p / z).collect();
    let (p, z, r) = (median(&mut tp), median(&mut tz), median(&mut tr));
    println!(
        "{threads} threads: bf16 {:.1} ms/step ({:.1} GB/s), bf16z {:.1} ms/step ({:.1} GB/s of bf16z bytes), plain read of the bf16 bytes {:.1} ms ({:.1} GB/s); bf16z speed-up over bf16: median of per-rep ratios {:.2}",
        p * 1e3,
        total as f64 / p / 1e9,
        z * 1e3,
        ztotal as f64 / z / 1e9,
        r * 1e3,
        total as f64 / r / 1e9,
        median(&mut ratio)
    );
}

/// Compute rate with the weights resident in L2 (`plain`: 128 rows of 2048
/// bf16), one thread: what each kernel could do if memory kept up.
fn l2_rate(plain: &[u8], x: &[f32]) {
    let isa = llama_graph::kernels::Kernels::current().isa();
    let one = ThreadPool::new(1);
    let (n, k) = (128, 2048);
    let zb = bf16z::encode(plain, n, k).expect("encode");
    let v = Bf16z::parse(&zb, n, k).expect("parse");
    let w = WeightRef::new(DType::BF16, plain);
    let (mut y, mut y2) = (vec![0f32; n], vec![0f32; n]);
    let (mut bp, mut bz) = (f64::MAX, f64::MAX);
    for _ in 0..3000 {
        let t = Instant::now();
        gemv::gemv_at(
            isa,
            &one,
            llama_graph::kernels::LinearArgs::new(&x[..k], 1, k, w, n, Epilogue::None),
            &mut y,
        )
        .expect("gemv");
        bp = bp.min(t.elapsed().as_secs_f64());
        let t = Instant::now();
        bf16z::gemv_at(isa, &one, &x[..k], v, Epilogue::None, &mut y2).expect("gemv");
        bz = bz.min(t.elapsed().as_secs_f64());
    }
    let wps = |t: f64| (n * k) as f64 / t / 1e9;
    println!(
        "L2-resident, 1 thread: bf16 {:.1} G weights/s, bf16z {:.1} G weights/s",
        wps(bp),
        wps(bz)
    );
}
