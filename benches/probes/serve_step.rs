//! Single-stream decode step time, the `run` path against the server's
//! engine, in one process, interleaved:
//! `cargo run --release --example serve_step -- MODEL [tokens] [threads] [rounds] [parallel]`.
//!
//! * `run`: a session compiled for one sequence, `Session::feed` one token
//!   per step (what `llama-graph run` does);
//! * `step-np`: a session compiled for `parallel` sequences, one sequence
//!   per step through `Session::step` (the engine's call, no threads);
//! * `engine`: the whole engine thread, one request, tokens read by the
//!   caller as they come (what one HTTP stream sees, minus HTTP).
//!
//! Each prints the mean time per decode step (first token excluded).
//! `LG_SERVE_STEP_ONLY=run|step|engine` runs one path only, once (for
//! instruction counts under callgrind: compare two token counts).
use llama_graph::generate::sampler::{argmax, SamplerConfig};
use llama_graph::session::{Model, Session, SessionOptions};
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let path = args
        .get(1)
        .expect("usage: serve_step MODEL [tokens] [threads] [rounds] [parallel]");
    let n: usize = args.get(2).map(|s| s.parse().unwrap()).unwrap_or(128);
    let threads: usize = args.get(3).map(|s| s.parse().unwrap()).unwrap_or(2);
    let rounds: usize = args.get(4).map(|s| s.parse().unwrap()).unwrap_or(3);
    let parallel: usize = args.get(5).map(|s| s.parse().unwrap()).unwrap_or(16);
    let prompt: Vec<u32> = (0..40u32).map(|i| 100 + i * 7).collect();
    let opts1 = SessionOptions {
        context: Some(4096),
        threads,
        ..SessionOptions::default()
    };
    let optsn = SessionOptions {
        parallel,
        ..opts1.clone()
    };
    let only = std::env::var("LG_SERVE_STEP_ONLY").unwrap_or_default();
    if !only.is_empty() {
        let model = Model::open(std::path::Path::new(path)).unwrap();
        match only.as_str() {
            "run" => {
                let mut s1 = Session::new(&model, &opts1).unwrap();
                let mut tok = argmax(s1.feed(&prompt).unwrap()) as u32;
                for _ in 1..n {
                    tok = argmax(s1.feed(&[tok]).unwrap()) as u32;
                }
                println!("{tok}");
            }
            "step" => {
                let mut sn = Session::new(&model, &optsn).unwrap();
                let mut blocks = Vec::new();
                assert!(sn.pool_mut().reserve(&mut blocks, prompt.len() + n));
                let mut b = llama_graph::exec::Batch::with_capacity(512, parallel, 4096);
                b.push(&prompt, 0, &blocks);
                let mut tok = argmax(sn.step(&b).unwrap().row(0)) as u32;
                for i in 1..n {
                    b.clear();
                    b.push(&[tok], prompt.len() + i - 1, &blocks);
                    tok = argmax(sn.step(&b).unwrap().row(0)) as u32;
                }
                println!("{tok}");
            }
            _ => {
                let engine = llama_graph::server::engine::EngineHandle::start(
                    model,
                    llama_graph::server::engine::EngineConfig {
                        session: optsn.clone(),
                        parallel,
                        queue_capacity: 4,
                    },
                )
                .unwrap();
                let mut st = engine
                    .submit(llama_graph::server::engine::GenRequest {
                        prompt: prompt.clone(),
                        max_tokens: n,
                        sampling: SamplerConfig {
                            temperature: 0.0,
                            ..SamplerConfig::default()
                        },
                        stop_tokens: vec![],
                    })
                    .unwrap();
                while st.blocking_next().is_some() {}
            }
        }
        return;
    }
    let model = Model::open(std::path::Path::new(path)).unwrap();
    let mut s1 = Session::new(&model, &opts1).unwrap();
    let mut sn = Session::new(&model, &optsn).unwrap();
    drop(model);
    let engine = {
        let model = Model::open(std::path::Path::new(path)).unwrap();
        llama_graph::server::engine::EngineHandle::start(
            model,
            llama_graph::server::engine::EngineConfig {
                session: optsn.clone(),
                parallel,
                queue_capacity: 4,
            },
        )
        .unwrap()
    };
    for r in 0..rounds {
        // run
        s1.reset();
        let mut tok = argmax(s1.feed(&prompt).unwrap()) as u32;
        let t0 = Instant::now();
        for _ in 1..n {
            tok = argmax(s1.feed(&[tok]).unwrap()) as u32;
        }
        let run = t0.elapsed().as_secs_f64() / (n - 1) as f64;
        // step through a multi-sequence session
        let mut blocks = Vec::new();
        assert!(sn.pool_mut().reserve(&mut blocks, prompt.len() + n));
        let mut b = llama_graph::exec::Batch::with_capacity(512, parallel, 4096);
        b.push(&prompt, 0, &blocks);
        let mut tok = argmax(sn.step(&b).unwrap().row(0)) as u32;
        let t0 = Instant::now();
        for i in 1..n {
            b.clear();
            b.push(&[tok], prompt.len() + i - 1, &blocks);
            tok = argmax(sn.step(&b).unwrap().row(0)) as u32;
        }
        let step = t0.elapsed().as_secs_f64() / (n - 1) as f64;
        sn.pool_mut().release(&mut blocks);
        // the engine
        let mut st = engine
            .submit(llama_graph::server::engine::GenRequest {
                prompt: prompt.clone(),
                max_tokens: n,
                sampling: SamplerConfig {
                    temperature: 0.0,
                    ..SamplerConfig::default()
                },
                stop_tokens: vec![],
            })
            .unwrap();
        let mut first = None;
        let mut got = 0;
        let ts = Instant::now();
        let mut ttft = 0.0;
        while let Some(ev) = st.blocking_next() {
            if let llama_graph::server::engine::GenEvent::Token(_) = ev {
                got += 1;
                if first.is_none() {
                    first = Some(Instant::now());
                    ttft = ts.elapsed().as_secs_f64();
                }
            }
        }
        let eng = first.unwrap().elapsed().as_secs_f64() / (got - 1) as f64;
        println!(
            "round {r}: run {:.0} us/step, step-np{parallel} {:.0} us ({:.3}), engine {:.0} us ({:.3}), engine ttft {:.1} ms",
            run * 1e6,
            step * 1e6,
            run / step,
            eng * 1e6,
            run / eng,
            ttft * 1e3
        );
    }
}
