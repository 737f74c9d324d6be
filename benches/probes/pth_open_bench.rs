//! Measure how long opening a Meta `.pth` checkpoint takes (zip central
//! directory + local headers + pickle + tensor views; no weight bytes read)
//! and how much resident memory it adds.
//!
//!   cargo run --release --example pth_open_bench -- [DIR] [--repeat N]
//!
//! DIR defaults to /work/tmp-ckpt/llama-3.2-1b-random. When DIR has no
//! consolidated.00.pth, a Llama-3.2-1B-shaped random bf16 checkpoint
//! (3.0 GB: Meta's names include output.weight) is generated there first
//! with `generate_random_checkpoint`; `--preset 8b` generates a
//! Llama-3-8B-shaped one instead (16 GB, exercises zip64 offsets).
//! Keep DIR outside the repository.

use llama_graph::ir::DType;
use llama_graph::weights::pth::{
    generate_random_checkpoint, load_meta_checkpoint, open_pth, MetaParams,
};
use llama_graph::weights::TensorBytes;
use std::path::PathBuf;
use std::time::Instant;

const LLAMA_3_2_1B: &str = r#"{"dim": 2048, "n_layers": 16, "n_heads": 32, "n_kv_heads": 8,
  "vocab_size": 128256, "multiple_of": 256, "ffn_dim_multiplier": 1.5, "norm_eps": 1e-05,
  "rope_theta": 500000.0, "use_scaled_rope": true}"#;

const LLAMA_3_8B: &str = r#"{"dim": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8,
  "vocab_size": 128256, "multiple_of": 1024, "ffn_dim_multiplier": 1.3, "norm_eps": 1e-05,
  "rope_theta": 500000.0}"#;

/// (VmRSS, RssAnon, RssFile) in KiB from /proc/self/status (Linux).
fn rss() -> (u64, u64, u64) {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |k: &str| {
        s.lines()
            .find(|l| l.starts_with(k))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("RssAnon:"), field("RssFile:"))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let mut dir = PathBuf::from("/work/tmp-ckpt/llama-3.2-1b-random");
    let mut repeat = 5usize;
    let mut params = LLAMA_3_2_1B;
    while let Some(a) = args.next() {
        if a == "--preset" {
            params = match args.next().as_deref() {
                Some("1b") => LLAMA_3_2_1B,
                Some("8b") => LLAMA_3_8B,
                _ => return Err("--preset 1b|8b".into()),
            };
        } else if a == "--repeat" {
            repeat = args.next().ok_or("--repeat N")?.parse()?;
        } else {
            dir = PathBuf::from(a);
        }
    }
    let file = dir.join("consolidated.00.pth");
    if !file.exists() {
        let p = MetaParams::from_json(params)?;
        eprintln!("generating {} ...", file.display());
        let t = Instant::now();
        let r0 = rss();
        generate_random_checkpoint(&dir, &p, 0, DType::BF16)?;
        let r1 = rss();
        eprintln!(
            "generated in {:.1} s (RSS {} -> {} KiB)",
            t.elapsed().as_secs_f64(),
            r0.0,
            r1.0
        );
    }
    let size = std::fs::metadata(&file)?.len();
    println!("file: {} ({:.2} GB)", file.display(), size as f64 / 1e9);

    // First open measured separately (cold-ish: page cache may still be warm).
    let mut times = Vec::new();
    for i in 0..repeat {
        let before = rss();
        let t = Instant::now();
        let store = open_pth(&file)?;
        let dt = t.elapsed();
        let after = rss();
        times.push(dt.as_secs_f64() * 1e3);
        let mapped = store
            .tensors
            .values()
            .filter(|t| matches!(t.data, TensorBytes::Mapped { .. }))
            .count();
        let bytes: usize = store.tensors.values().map(|t| t.data.len()).sum();
        if i == 0 {
            println!(
                "tensors: {} ({} mapped zero-copy), {:.2} GB of weights",
                store.tensors.len(),
                mapped,
                bytes as f64 / 1e9
            );
        }
        println!(
            "open #{i}: {:.2} ms; RSS +{} KiB (anon +{} KiB, file-backed +{} KiB)",
            dt.as_secs_f64() * 1e3,
            after.0 as i64 - before.0 as i64,
            after.1 as i64 - before.1 as i64,
            after.2 as i64 - before.2 as i64
        );
        drop(store);
    }
    times.sort_by(|a, b| a.total_cmp(b));
    println!(
        "open_pth: min {:.2} ms, median {:.2} ms over {repeat} runs",
        times[0],
        times[times.len() / 2]
    );
    let t = Instant::now();
    let s = load_meta_checkpoint(&dir)?;
    println!(
        "load_meta_checkpoint (1 shard): {:.2} ms, {} tensors",
        t.elapsed().as_secs_f64() * 1e3,
        s.tensors.len()
    );
    Ok(())
}
